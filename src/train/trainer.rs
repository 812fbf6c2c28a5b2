//! The training loop: FASTA or parquet → windows → AdamW steps, with validation, metrics and
//! checkpoints in a run directory (DESIGN.md §8).
//!
//! Determinism: initial weights and data order are pure functions of the seed (see `rng.rs`),
//! the loader's state is one counter, and the optimizer state is saved exactly, so a resumed run
//! reproduces the uninterrupted run's losses step for step on CPU.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Device, Tensor};

use crate::config::Config;
use crate::data::dataset::read_dataset;
use crate::data::ingest::{tokenize_to_parquet, IngestOptions};
use crate::data::loader::{Batch, Corpus, Loader};
use crate::error::{Error, Result};
use crate::model::neox::{next_token_nll, tensor_to_vec, tokens_tensor};
use crate::model::GenSlm;
use crate::tokenizer::CodonTokenizer;
use crate::train::checkpoint::{load_latest, save_checkpoint, TrainerState};
use crate::train::metrics::{peak_rss_mib, train_flops_per_sequence, MetricsLog, StepMetrics};
use crate::train::optim::{clip_factor, global_norm, AdamW, AdamWConfig};
use crate::train::schedule::lr_at;

/// Where training data comes from.
#[derive(Debug, Clone)]
pub enum DataSource {
    /// FASTA files/directories, tokenized into `RUN/data.parquet` first.
    Fasta(Vec<PathBuf>),
    /// A dataset written by `genslm tokenize`.
    Parquet(PathBuf),
}

/// Run-level options that are not model or optimisation settings.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from `RUN/checkpoints/latest`.
    pub resume: bool,
    /// Stop (with a checkpoint) after this many steps in this invocation.
    pub stop_after: Option<u64>,
    /// Show a progress bar.
    pub progress: bool,
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps_done: u64,
    pub final_loss: f64,
    pub final_val_loss: Option<f64>,
    pub peak_rss_mib: f64,
    pub last_checkpoint: Option<PathBuf>,
}

/// Trains `cfg.model` with `cfg.train` on `data`, writing everything under `run`.
pub fn train(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
) -> Result<TrainSummary> {
    let t = &cfg.train;
    cfg.model.validate().map_err(Error::Invalid)?;
    t.validate().map_err(Error::Invalid)?;
    std::fs::create_dir_all(run).map_err(|e| Error::io(run, e))?;
    let toml = toml::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
    crate::atomic::write_bytes(&run.join("config.toml"), toml.as_bytes())?;

    let corpus = load_corpus(cfg, data, run)?;
    let ad = Device::flex().autodiff();
    let plain = Device::flex();
    let adamw = AdamWConfig {
        beta1: t.beta1,
        beta2: t.beta2,
        eps: t.eps,
        weight_decay: t.weight_decay,
    };

    let (mut model, mut opt, mut state) = if opts.resume {
        let l = load_latest(run, &ad)?;
        check_resume_compatible(&l.state, cfg)?;
        if l.model.cfg.hidden_size != cfg.model.hidden_size
            || l.model.cfg.num_layers != cfg.model.num_layers
        {
            return Err(Error::Invalid(format!(
                "cannot resume: the checkpoint {} has a different model shape than the config",
                l.dir.display()
            )));
        }
        (l.model, l.opt, l.state)
    } else {
        let model = GenSlm::init(cfg.model.clone(), t.seed, &ad)?;
        let opt = AdamW::new(adamw, &model.params);
        let state = TrainerState {
            step: 0,
            optimizer_step: 0,
            loader_cursor: 0,
            train: t.clone(),
            adamw,
        };
        (model, opt, state)
    };
    model.params = model.params.into_iter().map(|p| p.require_grad()).collect();
    let mut loader = Loader::new(t.seed, state.loader_cursor);
    let mut log = MetricsLog::open(
        &run.join("metrics.jsonl"),
        opts.resume.then_some(state.step),
    )?;

    let bar = progress_bar(opts.progress, t.steps, state.step);
    let flops_per_seq = train_flops_per_sequence(&cfg.model, t.seq_len);
    let start = Instant::now();
    let first_step = state.step;
    let mut summary = TrainSummary {
        steps_done: 0,
        final_loss: f64::NAN,
        final_val_loss: None,
        peak_rss_mib: 0.0,
        last_checkpoint: None,
    };
    while state.step < t.steps {
        let step_start = Instant::now();
        let lr = lr_at(
            state.step as usize,
            t.steps as usize,
            t.warmup as usize,
            t.lr,
            t.min_lr_ratio,
        );
        let batches: Vec<Batch> = (0..t.grad_accum)
            .map(|_| loader.next_batch(&corpus, t.batch_size))
            .collect();
        let total_targets: usize = batches.iter().map(Batch::n_targets).sum();
        let (loss, grads) = loss_and_grads(&model, &batches, total_targets)?;
        let norm = global_norm(&grads);
        state.step += 1;
        state.loader_cursor = loader.cursor;
        let finite = loss.is_finite() && norm.is_finite();
        if finite {
            let k = clip_factor(norm, t.max_grad_norm);
            let grads: Vec<Tensor<1>> = grads.into_iter().map(|g| g * k).collect();
            let params: Vec<Tensor<1>> = model
                .params
                .iter()
                .map(|p| p.clone().without_autodiff())
                .collect();
            let new = opt.update(params, grads, &model.layout.specs, lr);
            model.params = new
                .into_iter()
                .map(|p| p.autodiff().require_grad())
                .collect();
            state.optimizer_step = opt.step;
        } else if !t.skip_nonfinite {
            return Err(Error::Invalid(format!(
                "step {}: loss {loss} / gradient norm {norm} is not finite; lower --lr, check the \
                 data, or pass --skip-nonfinite to skip such steps (resume from the last \
                 checkpoint with --resume)",
                state.step
            )));
        }
        let last = state.step == t.steps;
        let val_loss = if (t.val_every > 0 && state.step % t.val_every == 0) || last {
            validation_loss(&model, &corpus, t.batch_size, &plain)?
        } else {
            None
        };
        let secs = step_start.elapsed().as_secs_f64();
        let seqs = (t.batch_size * t.grad_accum) as f64;
        let m = StepMetrics {
            step: state.step,
            loss,
            val_loss,
            lr,
            grad_norm: norm,
            tokens: total_targets as u64,
            tokens_per_s: total_targets as f64 / secs,
            tflops: flops_per_seq * seqs / secs / 1e12,
            peak_rss_mib: peak_rss_mib(),
            elapsed_s: start.elapsed().as_secs_f64(),
            skipped_nonfinite: !finite,
        };
        log.write(&m)?;
        bar.set_position(state.step);
        bar.set_message(format!("loss {loss:.4} {:.0} tok/s", m.tokens_per_s));
        if !finite {
            bar.suspend(|| {
                eprintln!(
                    "warning: step {}: non-finite loss or gradient, step skipped",
                    state.step
                )
            });
        }
        summary.final_loss = loss;
        if val_loss.is_some() {
            summary.final_val_loss = val_loss;
        }
        let stopping = opts
            .stop_after
            .is_some_and(|n| state.step - first_step >= n);
        let every = t.checkpoint_every > 0 && state.step % t.checkpoint_every == 0;
        if every || last || stopping {
            let dir = save_checkpoint(run, cfg, &model, &opt, &state)?;
            summary.last_checkpoint = Some(dir);
        }
        if stopping {
            break;
        }
    }
    bar.finish_and_clear();
    summary.steps_done = state.step - first_step;
    summary.peak_rss_mib = peak_rss_mib();
    Ok(summary)
}

/// Summed-then-normalised loss over the micro-batches of one step, and the gradient of the mean
/// loss (each micro-batch contributes its token share).
fn loss_and_grads(
    model: &GenSlm,
    batches: &[Batch],
    total_targets: usize,
) -> Result<(f64, Vec<Tensor<1>>)> {
    let denom = total_targets.max(1) as f64;
    let mut loss = 0.0;
    let mut acc: Vec<Option<Tensor<1>>> = vec![None; model.params.len()];
    for b in batches {
        let tokens = tokens_tensor(&b.tokens, b.batch, b.seq_len, &model.device);
        let logits = model.forward(tokens, 0)?;
        let (sum, _) = next_token_nll(logits, &b.tokens, &b.mask, b.batch, b.seq_len);
        let scaled = sum / denom;
        loss += tensor_to_vec(&scaled)[0] as f64;
        let grads = scaled.backward();
        for (i, p) in model.params.iter().enumerate() {
            let g = p.grad(&grads).ok_or_else(|| {
                Error::Invalid(format!("no gradient for {}", model.layout.specs[i].name))
            })?;
            acc[i] = Some(match acc[i].take() {
                Some(a) => a + g,
                None => g,
            });
        }
    }
    Ok((
        loss,
        acc.into_iter()
            .map(|g| g.expect("one batch at least"))
            .collect(),
    ))
}

/// Mean next-token NLL over the validation windows, on a copy without autodiff.
fn validation_loss(
    model: &GenSlm,
    corpus: &Corpus,
    batch: usize,
    plain: &Device,
) -> Result<Option<f64>> {
    if corpus.val.is_empty() {
        return Ok(None);
    }
    let eval = GenSlm {
        params: model
            .params
            .iter()
            .map(|p| p.clone().without_autodiff())
            .collect(),
        device: plain.clone(),
        ..model.clone()
    };
    let (mut sum, mut n) = (0.0, 0usize);
    for ws in corpus.val.chunks(batch) {
        let b = corpus.batch_of(ws);
        let logits = eval.forward(tokens_tensor(&b.tokens, b.batch, b.seq_len, plain), 0)?;
        let (s, k) = next_token_nll(logits, &b.tokens, &b.mask, b.batch, b.seq_len);
        sum += tensor_to_vec(&s)[0] as f64;
        n += k;
    }
    Ok(Some(sum / n.max(1) as f64))
}

fn load_corpus(cfg: &Config, data: &DataSource, run: &Path) -> Result<Corpus> {
    let path = match data {
        DataSource::Parquet(p) => p.clone(),
        DataSource::Fasta(paths) => {
            let out = run.join("data.parquet");
            let opts = IngestOptions {
                vocab: cfg.model.vocab,
                ..Default::default()
            };
            tokenize_to_parquet(paths, &out, &opts)?;
            out
        }
    };
    let (vocab, records) = read_dataset(&path)?;
    if vocab != cfg.model.vocab {
        return Err(Error::Invalid(format!(
            "{}: tokenized with {vocab}, but the model uses {}; re-run `genslm tokenize --vocab {}`",
            path.display(),
            cfg.model.vocab,
            cfg.model.vocab
        )));
    }
    let tok = CodonTokenizer::new(vocab)?;
    let max_id = records
        .iter()
        .flat_map(|r| r.tokens.iter())
        .max()
        .copied()
        .unwrap_or(0);
    if max_id as usize >= cfg.model.vocab_size {
        return Err(Error::Invalid(format!(
            "{}: token id {max_id} does not fit the model's vocab_size {}",
            path.display(),
            cfg.model.vocab_size
        )));
    }
    let t = &cfg.train;
    Corpus::new(
        records.into_iter().map(|r| r.tokens).collect(),
        t.seq_len,
        tok.pad_id(),
        t.val_fraction,
        t.seed,
    )
    .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
}

/// Settings that must not change across a resume, or the loss curve would not continue.
fn check_resume_compatible(saved: &TrainerState, cfg: &Config) -> Result<()> {
    let (a, b) = (&saved.train, &cfg.train);
    let mut diffs = Vec::new();
    macro_rules! same {
        ($($f:ident),*) => {$(
            if a.$f != b.$f {
                diffs.push(format!("{} (checkpoint {:?}, now {:?})", stringify!($f), a.$f, b.$f));
            }
        )*};
    }
    same!(
        seq_len,
        batch_size,
        grad_accum,
        seed,
        steps,
        lr,
        warmup,
        min_lr_ratio,
        val_fraction
    );
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "cannot resume: settings differ from the checkpoint: {}",
            diffs.join(", ")
        )))
    }
}

fn progress_bar(enabled: bool, total: u64, done: u64) -> indicatif::ProgressBar {
    if !enabled {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("train {bar:30} {pos}/{len} {msg} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(done);
    bar
}
