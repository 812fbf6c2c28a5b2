//! One rank's training loop: FASTA or parquet → windows → AdamW steps, with validation,
//! metrics and checkpoints in a run directory (docs/ARCHITECTURE.md §7). The launcher
//! (`trainer.rs`) starts one of these per rank.
//!
//! Determinism: initial weights and data order are pure functions of the seed (see `rng.rs`),
//! the loader's state is one counter, and the optimizer state is saved exactly, so a resumed run
//! reproduces the uninterrupted run's losses step for step on CPU.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::backend::resolve_precision;
use crate::config::Config;
use crate::config::ModelConfig;
use crate::data::loader::{Batch, Corpus, Loader};
use crate::error::{Error, Result};
use crate::model::io::load_config;
use crate::model::GenSlm;
use crate::parallel::parallelize::{gather_shard_to_root, join_tp_slices};
use crate::parallel::ranks::{Quantized, Ranks};
use crate::parallel::{Degrees, Topology};
use crate::train::checkpoint::{
    commit_checkpoint, prepare_staging, read_saved, staging_dir, TrainerState,
};
use crate::train::dist_optim::StepOutcome;
use crate::train::engine::{Engine, Start};
use crate::train::fault::injected_fault;
use crate::train::layerwise::Keep;
use crate::train::metrics::{
    peak_rss_mib, train_flops_per_sequence, MetricsLog, RankMemory, StepMetrics,
};
use crate::train::nonfinite::NonFinitePolicy;
use crate::train::old_run::OldRun;
use crate::train::optim::AdamWConfig;
use crate::train::optim_shards::write_shard;
use crate::train::param_source::ParamSource;
use crate::train::pipeline::{gather_stages, Pipe, StageTimes};
use crate::train::resume::{check_resume, check_state, check_weights_config};
use crate::train::run_dir::prune_checkpoints;
use crate::train::schedule::lr_at;
use crate::train::setup::validate_layout;
use crate::train::setup::RunOptions;
use crate::train::shard::local_batch;
use crate::train::step::all_reduce_scalar;

/// What a run did.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub steps_done: u64,
    /// Of those, the steps skipped for a non-finite loss or gradient (`--skip-nonfinite`).
    pub steps_skipped: u64,
    pub final_loss: f64,
    pub final_val_loss: Option<f64>,
    pub peak_rss_mib: f64,
    pub last_checkpoint: Option<PathBuf>,
}

impl Default for TrainSummary {
    fn default() -> Self {
        TrainSummary {
            steps_done: 0,
            steps_skipped: 0,
            final_loss: f64::NAN,
            final_val_loss: None,
            peak_rss_mib: 0.0,
            last_checkpoint: None,
        }
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
    // Every group's calls timed into one clock: the step's comm_wait_s.
    // A communication thread per group where overlap is on (inside the clock, which then
    // counts only the time this thread waits for communication).
    let overlap = t.overlap && ranks.topo.world > 1;
    if let Some(why) = ranks
        .no_overlap
        .as_ref()
        .filter(|_| overlap && ranks.is_root())
    {
        eprintln!("note: communication is not overlapped with compute: {why}");
    }
    // Bytes counted beneath the communication threads (started collectives count too).
    let quantize = Quantized {
        weights: t.quantize_weights,
        grads: t.quantize_grads,
    };
    if quantize != Quantized::default() && ranks.data.size() == 1 && ranks.is_root() {
        eprintln!(
            "note: --quantize-weights/--quantize-grads change nothing here: no gradients or \
             ZeRO-3 weights cross ranks in this layout (its data group is one rank)"
        );
    }
    // As for quantizing: a setting accepted where it has nothing to act on says so.
    if t.prefetch_layers != crate::config::DEFAULT_PREFETCH_LAYERS
        && (t.zero < 3 || ranks.data.size() == 1)
        && ranks.is_root()
    {
        eprintln!(
            "note: --prefetch-layers changes nothing here: only ZeRO-3 gathers layers' weights \
             across ranks (this run: --zero {}, a data group of {} rank(s))",
            t.zero,
            ranks.data.size()
        );
    }
    let (ranks, comm_bytes) = ranks
        .clone()
        .with_bucket(t.reduce_bucket_size)
        .with_megatron_sp(t.megatron_sp)
        .with_quantized(quantize)
        .counted();
    let (ranks, comm_clock) = ranks.overlapped(overlap).timed();
    let overlapped = overlap && ranks.no_overlap.is_none();
    let ranks = &ranks;
    let ad = opts.device.open(opts.thread_rank)?.autodiff();
    // GPU backends: sample the device memory in use where each step peaks (metrics.jsonl),
    // until this rank's loop ends.
    let on_gpu = opts.device.backend != crate::backend::BackendKind::Cpu;
    let _watching = crate::backend::DeviceMemoryWatch::start(on_gpu);
    let (source, model_cfg, mut state) = starting_point(cfg, corpus, run, opts, ranks)?;
    let start = Start {
        model: model_cfg,
        precision: resolve_precision(t.precision, opts.device.backend),
        source: &source,
        adamw: state.adamw,
        step: state.optimizer_step,
        device: &ad,
        pipe: Pipe::plan(cfg, ranks.topo.pp)?,
        offload_optimizer: t.offload.optimizer(),
    };
    let mut engine = Engine::build(start, t.zero, ranks, t.seq_len)?;
    if let Engine::Units(units) = &mut engine {
        units.prefetch = if overlapped { t.prefetch_layers } else { 0 };
    }
    let mut loader = Loader::new(t.seed, state.loader_cursor);
    let mut log = match ranks.is_root() {
        true => Some(MetricsLog::open(
            &run.join("metrics.jsonl"),
            opts.resume.then_some(state.step),
        )?),
        false => None,
    };
    let bar = crate::progress::bar(
        opts.progress && ranks.is_root(),
        Some(t.steps),
        "train {bar:30} {pos}/{len} {msg} eta {eta}",
    );
    bar.set_position(state.step);
    let clock = Clock {
        start: Instant::now(),
        flops_per_seq: train_flops_per_sequence(&cfg.model, t.seq_len),
    };
    let first_step = state.step;
    let mut summary = TrainSummary::default();
    let mut policy = NonFinitePolicy::with_checkpoint(opts.resume);
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
        let (comm_before, bytes_before) = (comm_clock.seconds(), comm_bytes.bytes());
        let (loss, out, sent_per_layer) = train_step(cfg, &mut engine, &batches, lr, ranks)?;
        if on_gpu {
            // Reading the loss waits only for the kernels that made it; the update's come
            // after. The step's time then counts all of its own work, and cubecl's profiler
            // (CUBECL_DEBUG_OPTION=profile, docs/GPU.md) prints one kernel table per step.
            ad.sync().map_err(|e| {
                Error::Invalid(format!(
                    "the GPU failed during step {}: {e}",
                    state.step + 1
                ))
            })?;
        }
        let many = ranks.topo.world > 1;
        let comm = (
            many.then(|| comm_clock.seconds() - comm_before),
            many.then(|| comm_bytes.bytes() - bytes_before),
        );
        state.step += 1;
        state.loader_cursor = loader.cursor;
        state.optimizer_step = engine.step_count();
        policy.check(&out, loss, state.step, t)?;
        let last = state.step == t.steps;
        let val_loss = if (t.val_every > 0 && state.step % t.val_every == 0) || last {
            validation_loss(&mut engine, corpus, t.batch_size, ranks, None)?
        } else {
            None
        };
        summary.steps_skipped += u64::from(!out.applied);
        let m = clock.metrics(
            &state,
            &engine,
            &batches,
            (loss, val_loss, lr, &out),
            (sent_per_layer, comm),
            step_start,
            opts,
        );
        if let Some(log) = log.as_mut() {
            log.write(&m)?;
        }
        bar.set_position(state.step);
        bar.set_message(format!("loss {loss:.4} {:.0} tok/s", m.tokens_per_s));
        // Said once, by the rank that logs: every rank skips the same step (under PP × DP × TP
        // it was printed by each rank group).
        if !out.applied && ranks.is_root() {
            bar.suspend(|| {
                eprintln!(
                    "warning: step {}: {}, step skipped",
                    state.step,
                    if loss.is_finite() && out.grad_norm.is_finite() {
                        "gradient too large for the optimizer's f32 moments"
                    } else {
                        "non-finite loss or gradient"
                    }
                )
            });
        }
        summary.final_loss = loss;
        summary.final_val_loss = val_loss.or(summary.final_val_loss);
        let stopping = opts
            .stop_after
            .is_some_and(|n| state.step - first_step >= n);
        let every = t.checkpoint_every > 0 && state.step % t.checkpoint_every == 0;
        let saving = (every || last || stopping) && !opts.no_checkpoints;
        // After the row is logged (its NaN validation loss is the evidence): at a validation
        // step, and before any save (measured then if this step had none: a checkpoint or a
        // --stop-after stop saved the broken weights). After skipped steps the whole split is
        // measured; else the first batch, a forward's cost, catches an update that left finite
        // weights whose every forward is NaN (`--lr 1e30` saved such a step-1 and exited 0).
        // Without a validation split, the first training batch stands in: it is the probe
        // that matters, not which windows (`--val-fraction 0` saved such weights unsaid).
        if val_loss.is_some() || saving {
            let held_out = !corpus.val.is_empty();
            let val = match val_loss {
                Some(v) => Some(v),
                None if policy.consecutive_skips > 0 && held_out => {
                    validation_loss(&mut engine, corpus, t.batch_size, ranks, None)?
                }
                None if held_out => probe_loss(&mut engine, corpus, &corpus.val, t, ranks)?,
                None => probe_loss(&mut engine, corpus, &corpus.train, t, ranks)?,
            };
            let what = match held_out {
                true => "the validation loss",
                false => "the loss of the first training batch (no validation split)",
            };
            policy.check_validation(val, what, state.step, saving, t)?;
        }
        if saving {
            let (resumed, old) = (opts.resume.then_some(first_step), &opts.old_run);
            summary.last_checkpoint = checkpoint(run, cfg, &engine, &state, ranks, resumed, old)?;
            // Every rank's: any rank's message may be the one the run reports.
            policy.saved = true;
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

/// Where the run starts: the parameters' source, the model config and the trainer state, from
/// the latest checkpoint (`--resume`) or fresh from the seed.
fn starting_point(
    cfg: &Config,
    corpus: &Corpus,
    run: &Path,
    opts: &RunOptions,
    ranks: &Ranks,
) -> Result<(ParamSource, ModelConfig, TrainerState)> {
    let t = &cfg.train;
    let adamw = AdamWConfig::of(t);
    if !opts.resume {
        let state = TrainerState {
            step: 0,
            optimizer_step: 0,
            loader_cursor: 0,
            train: t.clone(),
            adamw,
            data_fingerprint: Some(corpus.fingerprint.clone()),
        };
        return Ok((
            ParamSource::init(&cfg.model, t.seed),
            cfg.model.clone(),
            state,
        ));
    }
    let saved = read_saved(run)?;
    // Refused changes stop here too (prepare_run printed the notes of applied ones).
    check_resume(&saved, cfg)?;
    let mut model_cfg = load_config(&saved.dir)?;
    // Applied changes take effect: the optimizer's weight decay, the attention kernel.
    model_cfg.attention = cfg.model.attention;
    check_weights_config(&model_cfg, &cfg.model, &saved.dir)?;
    // Rank 0 checks every file against the manifest; the others read only their pieces.
    let source = ParamSource::checkpoint(&saved.dir, &model_cfg, ranks.is_root())?;
    let mut state = saved.state;
    check_state(&state, t, &saved.dir)?;
    state.train = t.clone();
    state.adamw = adamw;
    state.data_fingerprint = Some(corpus.fingerprint.clone());
    Ok((source, model_cfg, state))
}

/// One optimizer step over `batches` (gradient accumulation): the loss summed over the ranks,
/// what the update did, and the elements the sequence group exchanged per layer and micro-batch.
fn train_step(
    cfg: &Config,
    engine: &mut Engine,
    batches: &[Batch],
    lr: f64,
    ranks: &Ranks,
) -> Result<(f64, StepOutcome, Option<u64>)> {
    let t = &cfg.train;
    let total_targets: usize = batches.iter().map(Batch::n_targets).sum();
    let sent_before = engine.sp().map_or(0, |g| g.elements_sent());
    let keep = Keep::of(t.checkpoint_activations, t.offload.activations());
    let local_loss = engine.compute(batches, total_targets, ranks, keep)?;
    let sent_per_layer = engine.sp().map(|g| {
        let sent = g.elements_sent() - sent_before;
        // Checkpointing runs each layer's forward (and its exchange) twice.
        let forwards = if t.checkpoint_activations { 2 } else { 1 };
        let layers = engine.layers_run(ranks.topo.pp_rank(), cfg.model.num_layers);
        sent / (forwards * layers * batches.len()).max(1) as u64
    });
    let loss = all_reduce_scalar(local_loss, ranks)?;
    let out = engine.step(lr, t.max_grad_norm, loss.is_finite(), ranks)?;
    Ok((loss, out, sent_per_layer))
}

/// What a step's metrics row needs from the run as a whole.
struct Clock {
    start: Instant,
    flops_per_seq: f64,
}

impl Clock {
    /// The metrics row of the step just taken.
    #[allow(clippy::too_many_arguments)]
    fn metrics(
        &self,
        state: &TrainerState,
        engine: &Engine,
        batches: &[Batch],
        (loss, val_loss, lr, out): (f64, Option<f64>, f64, &StepOutcome),
        (sent_per_layer, (comm_wait_s, comm_bytes)): (Option<u64>, (Option<f64>, Option<u64>)),
        step_start: Instant,
        opts: &RunOptions,
    ) -> StepMetrics {
        let t = &state.train;
        let total_targets: usize = batches.iter().map(Batch::n_targets).sum();
        let secs = step_start.elapsed().as_secs_f64();
        let peak_mib = peak_rss_mib();
        let times = engine.stage_times();
        let in_use = crate::backend::sample_device_memory(&engine.model().device);
        let peak = crate::backend::take_device_peak();
        let mib = |b: u64| b as f64 / 1048576.0;
        let seqs = (t.batch_size * t.grad_accum) as f64;
        StepMetrics {
            step: state.step,
            loss,
            val_loss,
            lr,
            grad_norm: out.grad_norm,
            tokens: total_targets as u64,
            tokens_per_s: total_targets as f64 / secs,
            tflops: self.flops_per_seq * seqs / secs / 1e12,
            peak_rss_mib: peak_mib,
            elapsed_s: self.start.elapsed().as_secs_f64(),
            skipped_nonfinite: !out.applied,
            sp_sent_per_layer: sent_per_layer,
            comm_wait_s,
            comm_bytes,
            pp_busy_s: times.map(|t| t.busy_s.clone()),
            pp_idle_s: times.map(|t| t.idle_s.clone()),
            pp_bubble: times.map(StageTimes::bubble),
            pp_peak_rss_mib: times.map(|t| t.peak_rss_mib.clone()),
            device_peak_mib: peak.map(mib),
            device_in_use_mib: in_use.map(mib),
            memory: Some(RankMemory::new(
                engine.held_bytes(),
                peak_mib,
                opts.ranks_in_process,
            )),
        }
    }
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
    old_run: &OldRun,
) -> Result<Option<PathBuf>> {
    // Removed if Ctrl-C or kill ends the process during the save (gigabytes of shards were
    // left until the run's next start); gone anyway once renamed to step-N. Registered
    // before it exists, so that no moment leaves it unregistered.
    let _staged = ranks
        .is_root()
        .then(|| crate::interrupt::register(staging_dir(run, state.step), true));
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
            let shards = shards[0] as usize;
            // The old run `--overwrite` replaces is disowned as the checkpoint is committed,
            // and deleted after.
            let disown = || old_run.disown();
            let dir = commit_checkpoint(run, cfg, &full, state, &staging, shards, &disown)?;
            old_run.saved();
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
    let (model, opt, pipe) = match engine {
        Engine::Units(z) => return z.gather_weights(ranks),
        Engine::Whole {
            model, opt, pipe, ..
        } => (model, opt, pipe),
    };
    // Under the bf16 layout the checkpoint holds the fp32 masters.
    let masters = opt.master_model(model, ranks)?;
    let model = masters.as_ref().unwrap_or(model);
    let mut table = None;
    // The SP-split position table, by the ranks holding it (stage 0 under PP).
    if let (Some(pos), Some(_), 0) = (
        model.layout.embed_pos,
        model.position_shard(),
        ranks.topo.dp_rank(),
    ) {
        let stage = ranks.topo.pp_rank();
        if pipe
            .as_ref()
            .is_none_or(|p| p.params_of(&model.layout, stage).contains(&pos))
        {
            table = gather_shard_to_root(&model.params[pos], ranks)?;
        }
    }
    // Under PP, stage 0 collects the other stages' parameters (each stage's leading rank
    // sends them; under TP every TP rank its slices, to its own stage-0 peer).
    let mut full = match pipe {
        Some(pipe) if ranks.topo.leads_stage() => {
            match gather_stages(pipe, model.clone(), ranks)? {
                Some(m) => m,
                None => return Ok(None),
            }
        }
        Some(_) => return Ok(None),
        None if ranks.topo.gathers_slices() => model.clone(),
        None => return Ok(None),
    };
    if !ranks.topo.gathers_slices() {
        return Ok(None);
    }
    if let (Some(pos), Some(t)) = (model.layout.embed_pos, table) {
        full.params[pos] = t;
        full.layout.specs[pos].shape[0] = cfg.model.max_position_embeddings;
        full.sp = None;
    }
    // Only world rank 0's TP group is here: it joins its slices on rank 0.
    join_tp_slices(full, ranks)
}

/// Mean next-token NLL over the validation windows, on a copy without autodiff. Every DP
/// replica evaluates all windows; its sequence group's ranks each their columns, summed over
/// the group.
fn validation_loss(
    engine: &mut Engine,
    corpus: &Corpus,
    batch: usize,
    ranks: &Ranks,
    batches: Option<usize>,
) -> Result<Option<f64>> {
    windows_loss(engine, corpus, &corpus.val, batch, ranks, batches)
}

/// The loss of the first batch of `windows`; under `--skip-nonfinite`, of the first of up to
/// four batches that gives a finite one: a batch the run skips for its data is no verdict on
/// the weights. Every rank reaches the same value (reduced over its groups), so the same
/// number of batches on each.
fn probe_loss(
    engine: &mut Engine,
    corpus: &Corpus,
    windows: &[crate::data::loader::Window],
    t: &crate::config::TrainConfig,
    ranks: &Ranks,
) -> Result<Option<f64>> {
    let tries = if t.skip_nonfinite { 4 } else { 1 };
    let mut loss = None;
    for chunk in windows.chunks(t.batch_size.max(1)).take(tries) {
        loss = windows_loss(engine, corpus, chunk, t.batch_size, ranks, Some(1))?;
        if loss.is_some_and(f64::is_finite) {
            break;
        }
    }
    Ok(loss)
}

/// [`validation_loss`] over `windows` (`None` when there are none).
fn windows_loss(
    engine: &mut Engine,
    corpus: &Corpus,
    windows: &[crate::data::loader::Window],
    batch: usize,
    ranks: &Ranks,
    batches: Option<usize>,
) -> Result<Option<f64>> {
    if windows.is_empty() {
        return Ok(None);
    }
    // Rows are not split for validation: view the layout as DP = 1 (this sequence group and
    // its TP ranks; the stage does not change which tokens a rank holds).
    let t = &ranks.topo;
    let view = Ranks {
        topo: Topology::of(
            t.rank % (t.seq_degree() * t.tp * t.pp),
            Degrees {
                dp: 1,
                ..t.degrees()
            },
        )?,
        ..ranks.clone()
    };
    let (mut sum, mut n) = (0.0f64, 0usize);
    for ws in windows.chunks(batch).take(batches.unwrap_or(usize::MAX)) {
        let b = corpus.batch_of(ws);
        n += b.n_targets();
        let lb = local_batch(&b, &view);
        sum += engine.eval_nll(&lb, ranks)?;
    }
    let mut buf = [sum];
    if ranks.topo.seq_degree() > 1 {
        ranks.seq.all_reduce_sum_f64(&mut buf)?;
    }
    // The loss lives on the last stage.
    if ranks.topo.pp > 1 {
        ranks.pp.all_reduce_sum_f64(&mut buf)?;
    }
    sum = buf[0];
    Ok(Some(sum / n.max(1) as f64))
}
