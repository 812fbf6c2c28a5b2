//! The training loop: FASTA or parquet → windows → AdamW steps, with validation, metrics and
//! checkpoints in a run directory (docs/ARCHITECTURE.md §7).
//!
//! Determinism: initial weights and data order are pure functions of the seed (see `rng.rs`),
//! the loader's state is one counter, and the optimizer state is saved exactly, so a resumed run
//! reproduces the uninterrupted run's losses step for step on CPU.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::resolve_precision;
use crate::config::Config;
use crate::data::loader::{Batch, Corpus, Loader};
use crate::error::{Error, Result};
use crate::model::io::load_config;
use crate::model::params::Layout;
use crate::model::GenSlm;
use crate::ops::primitive::tensor_to_vec;
use crate::parallel::parallelize::gather_shard_to_root;
use crate::parallel::ranks::{abort_all, thread_grid, Ranks};
use crate::parallel::tensor_slices::gather_slices;
use crate::parallel::{Degrees, Topology};
use crate::train::checkpoint::{
    commit_checkpoint, prepare_staging, read_saved, staging_dir, TrainerState,
};
use crate::train::engine::{Engine, Start};
use crate::train::metrics::{
    peak_rss_mib, train_flops_per_sequence, MetricsLog, RankMemory, StepMetrics,
};
use crate::train::optim::AdamWConfig;
use crate::train::optim_shards::write_shard;
use crate::train::param_source::ParamSource;
use crate::train::resume::{check_resume, check_state};
use crate::train::run_dir::prune_checkpoints;
use crate::train::schedule::lr_at;
use crate::train::setup::{check_memory, load_corpus, prepare_run, validate_layout};
use crate::train::shard::{local_batch, local_nll};
use crate::train::step::all_reduce_scalar;

pub use crate::train::setup::{DataSource, RunOptions};

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps_done: u64,
    pub final_loss: f64,
    pub final_val_loss: Option<f64>,
    pub peak_rss_mib: f64,
    pub last_checkpoint: Option<PathBuf>,
}

/// Trains `cfg.model` with `cfg.train` on `data`, writing everything under `run` (one rank).
pub fn train(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
) -> Result<TrainSummary> {
    let (corpus, _lock) = prepare_run(cfg, data, run, opts)?;
    train_rank(cfg, &corpus, run, opts, &Ranks::single())
}

/// The same run with `dp × sp` ranks as threads of this process (docs/ARCHITECTURE.md §5). Only rank 0
/// writes metrics and checkpoints; a failing rank stops the others with its message.
pub fn train_threads(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    dp: usize,
    sp: usize,
) -> Result<TrainSummary> {
    train_grid(cfg, data, run, opts, Degrees::new(dp, 1, sp))
}

/// [`train_threads`] on a DP × CP × SP × TP grid.
pub fn train_grid(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    d: Degrees,
) -> Result<TrainSummary> {
    let topo = Topology::of(0, d)?;
    validate_layout(cfg, &topo)?;
    let n = d.world();
    check_memory(cfg, d.dp, topo.seq_degree(), n, opts)?;
    if n == 1 {
        if cfg.train.zero >= 2 {
            eprintln!(
                "note: ZeRO-{} with one rank has nothing to shard: the whole model stays on \
                 this rank (ZeRO-0 in effect)",
                cfg.train.zero
            );
        }
        return train(cfg, data, run, opts);
    }
    let (corpus, _lock) = prepare_run(cfg, data, run, opts)?;
    let corpus = Arc::new(corpus);
    let timeout = Duration::from_secs(cfg.train.rank_timeout_s);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut started = 0;
    for ranks in thread_grid(d, timeout) {
        let (cfg, corpus, run) = (cfg.clone(), corpus.clone(), run.to_path_buf());
        let opts = RunOptions {
            thread_rank: ranks.topo.rank,
            ranks_in_process: n,
            ..opts.clone()
        };
        let tx = tx.clone();
        let rank = ranks.topo.rank;
        let abort_ranks = ranks.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{RANK_THREAD_PREFIX}{rank}"))
            .spawn(move || {
                let r = run_rank_guarded(&ranks, || train_rank(&cfg, &corpus, &run, &opts, &ranks));
                let _ = tx.send(r);
            });
        if let Err(e) = spawned {
            // The ranks already running stop at their next collective.
            let why = format!("could not start rank {rank} as a thread: {e}");
            abort_all(&abort_ranks, &why);
            return Err(Error::Invalid(format!(
                "{why} (a process or thread limit? lower --dp/--sp)"
            )));
        }
        started += 1;
    }
    drop(tx);
    collect_rank_results(&rx, started, timeout)
}

/// How a rank's thread is named (the panic hook recognises them).
pub const RANK_THREAD_PREFIX: &str = "genslm-rank-";

/// The ranks' results as they finish. Once one has failed, the others get a grace period to
/// report (they stop at their next collective); a rank that does not, frozen in a computation,
/// is left behind: the run's error is returned and the process can exit, instead of waiting
/// forever to join it.
fn collect_rank_results(
    rx: &std::sync::mpsc::Receiver<Result<TrainSummary>>,
    n: usize,
    timeout: Duration,
) -> Result<TrainSummary> {
    use std::sync::mpsc::RecvTimeoutError;
    const GRACE: Duration = Duration::from_secs(5);
    let mut results = Vec::with_capacity(n);
    while results.len() < n {
        let failed = results.iter().any(|r: &Result<TrainSummary>| r.is_err());
        // A healthy run reports when it is done; a frozen rank makes its peers fail within
        // the rank timeout, which ends this wait through their results.
        let wait = if failed { GRACE } else { timeout + GRACE };
        match rx.recv_timeout(wait) {
            Ok(r) => results.push(r),
            Err(RecvTimeoutError::Timeout) if !failed => continue,
            Err(_) => break,
        }
    }
    if results.len() < n && results.iter().all(|r| r.is_ok()) {
        results.push(Err(Error::Invalid("a rank thread never finished".into())));
    }
    first_error_or_root(results)
}

/// The run with ranks given by a launcher (one rank per process, e.g. MPI): rank 0 prepares
/// the run directory and the dataset, the others read them after a barrier.
pub fn train_with_ranks(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    ranks: &Ranks,
) -> Result<TrainSummary> {
    run_rank_guarded(ranks, || {
        validate_layout(cfg, &ranks.topo)?;
        check_memory(cfg, ranks.topo.dp, ranks.topo.seq_degree(), 1, opts)?;
        // Rank 0 may tokenize for a long time: the others wait without a deadline. It holds
        // the run directory's lock until the run ends.
        let (corpus, _lock) = if ranks.is_root() {
            let c = prepare_run(cfg, data, run, opts);
            ranks.world.barrier_unbounded()?;
            let (c, lock) = c?;
            (c, Some(lock))
        } else {
            ranks.world.barrier_unbounded()?;
            let data = match data {
                DataSource::Fasta(_) => DataSource::Parquet(run.join("data.parquet")),
                other => other.clone(),
            };
            (load_corpus(cfg, &data, run, None)?, None)
        };
        train_rank(cfg, &corpus, run, opts, ranks)
    })
}

/// Test hooks: `GENSLM_FAULT_RANK=R:S` makes rank R fail when it starts step S;
/// `GENSLM_FREEZE_RANK=R:S` makes it hang there forever (a rank stuck in a computation).
fn injected_fault(rank: usize, step: u64) -> Result<()> {
    if let Ok(spec) = std::env::var("GENSLM_FREEZE_RANK") {
        if rank_step(&spec) == Some((rank as u64, step)) {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    let fault = std::env::var("GENSLM_FAULT_RANK").ok();
    if fault.and_then(|s| rank_step(&s)) == Some((rank as u64, step)) {
        return Err(Error::Invalid(format!(
            "rank {rank}: injected fault at step {step} (GENSLM_FAULT_RANK)"
        )));
    }
    Ok(())
}

/// Runs one rank's work; an error or panic aborts every group so the other ranks stop waiting.
pub fn run_rank_guarded<T>(ranks: &Ranks, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let rank = ranks.topo.rank;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = crate::error::panic_message(p.as_ref()).unwrap_or("panicked");
        Err(Error::Invalid(format!("rank {rank}: {msg}")))
    });
    if let Err(e) = &out {
        abort_all(ranks, &e.to_string());
    }
    out
}

/// `R:S` of a test hook.
fn rank_step(spec: &str) -> Option<(u64, u64)> {
    let (r, s) = spec.split_once(':')?;
    Some((r.parse().ok()?, s.parse().ok()?))
}

/// The root cause among the ranks' results: the first error that is not another rank's
/// "stopping" echo, else rank 0's result.
fn first_error_or_root(mut results: Vec<Result<TrainSummary>>) -> Result<TrainSummary> {
    let cause = results
        .iter()
        .position(|r| matches!(r, Err(e) if !e.to_string().contains("stopping:")));
    let any = results.iter().position(|r| r.is_err());
    match cause.or(any) {
        Some(i) => results.swap_remove(i),
        None => results.swap_remove(0),
    }
}

/// One rank's training loop (the single-process run is rank 0 of a 1 × 1 layout).
pub fn train_rank(
    cfg: &Config,
    corpus: &Corpus,
    run: &Path,
    opts: &RunOptions,
    ranks: &Ranks,
) -> Result<TrainSummary> {
    let t = &cfg.train;
    validate_layout(cfg, &ranks.topo)?;
    let ranks = &ranks.clone().with_bucket(t.reduce_bucket_size);
    let ad = opts.device.open(opts.thread_rank)?.autodiff();
    let precision = resolve_precision(t.precision, opts.device.backend);
    let adamw = AdamWConfig {
        beta1: t.beta1,
        beta2: t.beta2,
        eps: t.eps,
        weight_decay: t.weight_decay,
    };

    let (source, model_cfg, mut state) = if opts.resume {
        let saved = read_saved(run)?;
        // Refused changes stop here too (prepare_run printed the notes of applied ones).
        check_resume(&saved, cfg)?;
        let mut model_cfg = load_config(&saved.dir)?;
        // Applied changes take effect: the optimizer's weight decay, the attention kernel.
        model_cfg.attention = cfg.model.attention;
        // Rank 0 checks every file against the manifest; the others read only their pieces.
        let source = ParamSource::checkpoint(&saved.dir, &model_cfg, ranks.is_root())?;
        let mut state = saved.state;
        check_state(&state, t, &saved.dir)?;
        state.train = t.clone();
        state.adamw = adamw;
        state.data_fingerprint = Some(corpus.fingerprint.clone());
        (source, model_cfg, state)
    } else {
        let state = TrainerState {
            step: 0,
            optimizer_step: 0,
            loader_cursor: 0,
            train: t.clone(),
            adamw,
            data_fingerprint: Some(corpus.fingerprint.clone()),
        };
        (
            ParamSource::init(&cfg.model, t.seed),
            cfg.model.clone(),
            state,
        )
    };
    let start = Start {
        model: model_cfg,
        precision,
        source: &source,
        adamw,
        step: state.optimizer_step,
        device: &ad,
    };
    let mut engine = Engine::build(start, t.zero, ranks, t.seq_len)?;
    let mut loader = Loader::new(t.seed, state.loader_cursor);
    let mut log = if ranks.is_root() {
        Some(MetricsLog::open(
            &run.join("metrics.jsonl"),
            opts.resume.then_some(state.step),
        )?)
    } else {
        None
    };

    let bar = crate::progress::bar(
        opts.progress && ranks.is_root(),
        Some(t.steps),
        "train {bar:30} {pos}/{len} {msg} eta {eta}",
    );
    bar.set_position(state.step);
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
    let mut consecutive_skips = 0u64;
    while state.step < t.steps {
        injected_fault(ranks.topo.rank, state.step + 1)?;
        let step_start = Instant::now();
        let lr = lr_at(
            state.step as usize,
            t.steps as usize,
            t.warmup as usize,
            t.lr,
            t.min_lr_ratio,
        );
        let batches: Vec<Batch> = (0..t.grad_accum)
            .map(|_| loader.next_batch(corpus, t.batch_size))
            .collect();
        let total_targets: usize = batches.iter().map(Batch::n_targets).sum();
        let sent_before = engine.sp().map_or(0, |g| g.elements_sent());
        let local_loss =
            engine.compute(&batches, total_targets, ranks, t.checkpoint_activations)?;
        let sent_per_layer = engine.sp().map(|g| {
            let sent = g.elements_sent() - sent_before;
            // Checkpointing runs each layer's forward (and its exchange) twice.
            let forwards = if t.checkpoint_activations { 2 } else { 1 };
            sent / (forwards * cfg.model.num_layers * batches.len()) as u64
        });
        let loss = all_reduce_scalar(local_loss, ranks)?;
        let out = engine.step(lr, t.max_grad_norm, loss.is_finite(), ranks)?;
        let (norm, finite) = (out.grad_norm, out.applied);
        state.step += 1;
        state.loader_cursor = loader.cursor;
        state.optimizer_step = engine.step_count();
        if !out.params_finite {
            // Nothing of this step is saved: the last checkpoint (if any) stays `latest`.
            return Err(Error::Invalid(format!(
                "step {}: the update made the weights non-finite (NaN/Inf) although loss {loss} \
                 and gradient norm {norm} were finite: --lr {} is far too high. The run stops \
                 without saving this step; start again with a lower --lr",
                state.step, t.lr
            )));
        }
        consecutive_skips = if finite { 0 } else { consecutive_skips + 1 };
        if !finite && t.skip_nonfinite && consecutive_skips > t.max_consecutive_skips {
            return Err(Error::Invalid(format!(
                "step {}: {consecutive_skips} consecutive steps had a non-finite loss or \
                 gradient (limit `max_consecutive_skips` = {}); the run is diverging or the \
                 data is broken: lower --lr or check the data (the last checkpoint stays \
                 resumable)",
                state.step, t.max_consecutive_skips
            )));
        }
        if !finite && !t.skip_nonfinite {
            return Err(Error::Invalid(format!(
                "step {}: loss {loss} / gradient norm {norm} is not finite; lower --lr, check the \
                 data, or pass --skip-nonfinite to skip such steps (resume from the last \
                 checkpoint with --resume)",
                state.step
            )));
        }
        let last = state.step == t.steps;
        let val_loss = if (t.val_every > 0 && state.step % t.val_every == 0) || last {
            validation_loss(&mut engine, corpus, t.batch_size, ranks)?
        } else {
            None
        };
        let secs = step_start.elapsed().as_secs_f64();
        let peak_mib = peak_rss_mib();
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
            peak_rss_mib: peak_mib,
            elapsed_s: start.elapsed().as_secs_f64(),
            skipped_nonfinite: !finite,
            sp_sent_per_layer: sent_per_layer,
            memory: Some(RankMemory::new(
                engine.held_elements(),
                peak_mib,
                opts.ranks_in_process,
            )),
        };
        if let Some(log) = log.as_mut() {
            log.write(&m)?;
        }
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
            let resumed_from = opts.resume.then_some(first_step);
            summary.last_checkpoint = checkpoint(run, cfg, &engine, &state, ranks, resumed_from)?;
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

/// Writes a checkpoint: every rank writes the Adam moments it holds into its own shard file
/// (nothing gathers the optimizer state), the weights are gathered to world rank 0, which
/// writes them and completes the directory; returns it on rank 0. The staging directory must
/// be on a file system every rank sees. The others wait for the write without a deadline: it
/// can take minutes.
fn checkpoint(
    run: &Path,
    cfg: &Config,
    engine: &Engine,
    state: &TrainerState,
    ranks: &Ranks,
    resumed_from: Option<u64>,
) -> Result<Option<PathBuf>> {
    let staging = if ranks.is_root() {
        prepare_staging(run, state.step)?
    } else {
        staging_dir(run, state.step)
    };
    ranks.world.barrier_unbounded()?;
    let runs = engine.moment_runs(&ranks.topo);
    let wrote = write_shard(
        &staging,
        engine.model(),
        &runs,
        ranks.topo.rank,
        ranks.topo.world,
    )?;
    drop(runs);
    let full = gather_weights(engine, cfg, ranks)?;
    // Every shard is on disk before rank 0 lists them in the manifest; it checks it sees them
    // all (ranks on other machines write to their own view of the run directory).
    ranks.world.barrier_unbounded()?;
    let mut shards = [f32::from(u8::from(wrote.is_some()))];
    ranks.world.all_reduce_sum(&mut shards)?;
    let dir = match full {
        Some(full) => {
            let dir = commit_checkpoint(run, cfg, &full, state, &staging, shards[0] as usize)?;
            prune_checkpoints(run, cfg.train.keep_checkpoints, resumed_from)?;
            Some(dir)
        }
        None => None,
    };
    ranks.world.barrier_unbounded()?;
    Ok(dir)
}

/// The whole model's weights on world rank 0 (`None` on the others).
fn gather_weights(engine: &Engine, cfg: &Config, ranks: &Ranks) -> Result<Option<GenSlm>> {
    let model = match engine {
        Engine::Units(z) => return z.gather_weights(ranks),
        Engine::Whole { model, .. } => model,
    };
    let mut table = None;
    if let (Some(pos), Some(_), 0) = (
        model.layout.embed_pos,
        model.position_shard(),
        ranks.topo.dp_rank(),
    ) {
        table = gather_shard_to_root(&model.params[pos], ranks)?;
    }
    if !ranks.topo.gathers_slices() {
        return Ok(None);
    }
    let mut full = model.clone();
    if let (Some(pos), Some(t)) = (model.layout.embed_pos, table) {
        full.params[pos] = t;
        full.layout.specs[pos].shape[0] = cfg.model.max_position_embeddings;
        full.sp = None;
    }
    if ranks.topo.tp > 1 {
        // Only world rank 0's TP group is here: it joins its slices on rank 0.
        let layout = Layout::new(&full.cfg);
        let joined = gather_slices(&full.params, &layout, ranks.tp.as_ref(), ranks.bucket)?;
        let Some(p) = joined else {
            return Ok(None);
        };
        (full.params, full.layout, full.tp) = (p, layout, None);
    }
    Ok(Some(full))
}

/// Mean next-token NLL over the validation windows, on a copy without autodiff. Every DP
/// replica evaluates all windows; its sequence group's ranks each their columns, summed over
/// the group.
fn validation_loss(
    engine: &mut Engine,
    corpus: &Corpus,
    batch: usize,
    ranks: &Ranks,
) -> Result<Option<f64>> {
    if corpus.val.is_empty() {
        return Ok(None);
    }
    // Rows are not split for validation: view the layout as DP = 1 (this sequence group and
    // its TP ranks).
    let t = &ranks.topo;
    let view = Ranks {
        topo: Topology::of(
            t.rank % (t.seq_degree() * t.tp),
            Degrees {
                dp: 1,
                ..t.degrees()
            },
        )?,
        ..ranks.clone()
    };
    let (mut sum, mut n) = (0.0f64, 0usize);
    for ws in corpus.val.chunks(batch) {
        let b = corpus.batch_of(ws);
        n += b.n_targets();
        let lb = local_batch(&b, &view);
        let logits = engine.eval_logits(&lb)?;
        sum += tensor_to_vec(&local_nll(engine.model(), logits, &lb))[0] as f64;
    }
    let mut buf = [sum];
    if ranks.topo.seq_degree() > 1 {
        ranks.seq.all_reduce_sum_f64(&mut buf)?;
        sum = buf[0];
    }
    Ok(Some(sum / n.max(1) as f64))
}
