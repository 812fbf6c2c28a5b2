//! `genslm train`: arguments, launcher detection (threads or MPI ranks) and the summary.

use std::path::PathBuf;

use genslm::config::Config;
use genslm::parallel::Degrees;
use genslm::train::trainer::{train_grid, DataSource, RunOptions};

use super::device::DeviceArgs;
use super::AttentionArg;

/// The rank grid's degrees (`genslm train`, `genslm bench train`).
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct DegreeArgs {
    /// Sequence-parallel degree P (Ulysses): each sequence is split over P ranks.
    #[arg(long, default_value_t = 1)]
    pub sp: usize,
    /// Context-parallel degree C (ring attention): each sequence is cut into 2C chunks and CP
    /// rank c holds chunks c and 2C−1−c (equal causal work); K/V blocks travel around the ring.
    /// Combines with --sp (Ulysses inside each CP rank's chunks).
    #[arg(long, default_value_t = 1)]
    pub cp: usize,
    /// Tensor-parallel degree T (Megatron): each layer's heads and MLP columns, the embedding
    /// and the output head's vocabulary are split over T ranks, which see the same tokens. T
    /// must divide the heads and the intermediate size; any ZeRO stage (under ZeRO-2/3 each TP
    /// rank's slices are sharded over its data group, DP × CP × SP).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Data-parallel degree D: the global batch is split over D replicas. D × C × P × T ranks
    /// run as threads of this process (or one per process under mpirun).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Pipeline stages P: the layers are cut into P stages (the embeddings on the first, the
    /// head on the last); the micro-batches of a step (--grad-accum) flow through them by
    /// --pp-schedule (threads, or one process per rank under mpirun); ZeRO 0 or 1.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
}

impl DegreeArgs {
    pub fn degrees(self) -> Degrees {
        Degrees {
            dp: self.dp,
            cp: self.cp,
            sp: self.sp,
            tp: self.tp,
            pp: self.pp,
        }
    }
}

/// `genslm train`: every setting flag overrides the `[train]` field of the same name.
// One input, FASTA or a tokenized dataset: the error names both when neither is given.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["fasta", "data"])))]
pub struct TrainArgs {
    /// FASTA files or directories (tokenized into RUN/data.parquet).
    #[arg(long, num_args = 1..)]
    fasta: Vec<PathBuf>,
    /// A dataset written by `genslm tokenize`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Model and training config: a TOML file (e.g. configs/tiny.toml), or a built-in preset
    /// by name (tiny, genslm-25m, genslm-250m, genslm-2.5b, genslm-25b, genslm-33b).
    #[arg(long)]
    config: PathBuf,
    /// Run directory: config.toml, metrics.jsonl, checkpoints/.
    #[arg(long)]
    out: PathBuf,
    /// Continue from OUT/checkpoints/latest. Give the run's --config, data and flags again: a
    /// setting that differs from the checkpoint's is refused, or noted where it can change.
    #[arg(long)]
    resume: bool,
    /// Stop after this many steps in this invocation (with a checkpoint); --resume continues.
    #[arg(long)]
    stop_after: Option<u64>,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    degrees: DegreeArgs,
    /// ZeRO stage over the ranks: 0 replicated, 1 Adam moments sharded over DP, 2 also
    /// gradients, 3 also weights (both over all DP × CP × SP ranks; a layer's weights are gathered
    /// only while it runs).
    #[arg(long)]
    zero: Option<u8>,
    /// Optimizer steps in the whole run (with --resume: the run's new total).
    #[arg(long)]
    steps: Option<u64>,
    /// Codons per sample.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Samples (windows of --seq-len codons) per micro-batch.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step (their gradients accumulate into one update); under
    /// --pp, the pipeline's micro-batches.
    #[arg(long)]
    grad_accum: Option<usize>,
    /// Peak learning rate (AdamW), reached after the warm-up and decayed by a cosine to
    /// min_lr_ratio · lr.
    #[arg(long)]
    lr: Option<f64>,
    /// Steps of linear learning-rate warm-up from lr/warmup to lr.
    #[arg(long)]
    warmup: Option<u64>,
    /// Seed of the weights' initialisation, the data's shuffle and the validation split (the
    /// same seed and data give the same run, on any layout).
    #[arg(long)]
    seed: Option<u64>,
    /// Share of the windows held out for validation (0 = none).
    #[arg(long)]
    val_fraction: Option<f64>,
    /// Validate every N steps (and at the end); 0 = only at the end.
    #[arg(long)]
    val_every: Option<u64>,
    /// Write a checkpoint every N steps (and at the end); 0 = only at the end.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    #[arg(long)]
    max_grad_norm: Option<f64>,
    /// AdamW's decoupled weight decay (not applied to biases and LayerNorm weights).
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Skip steps whose loss or gradient is NaN/Inf instead of stopping.
    #[arg(long)]
    skip_nonfinite: bool,
    /// Full activation checkpointing: keep each layer's input, recompute one layer at a time in
    /// the backward (same gradients, far less memory at long sequences, ~1/3 more compute).
    #[arg(long)]
    checkpoint_activations: bool,
    /// Under --tp, keep LayerNorms, the residual and the embedding's output whole on every TP
    /// rank (all-reduces around the tensor-parallel blocks) instead of Megatron sequence
    /// parallelism's 1/T of the sequence each (all-gather/reduce-scatter): for comparison.
    #[arg(long)]
    no_megatron_sp: bool,
    /// Keep every collective on the rank's own thread (blocking) instead of overlapping
    /// communication with compute: the same results, for comparison and debugging.
    #[arg(long)]
    no_overlap: bool,
    /// With --zero 3: layers whose weights are gathered ahead of their use while the current
    /// one computes (default 1; 0 gathers each layer when it runs).
    #[arg(long)]
    prefetch_layers: Option<usize>,
    /// With --zero 3: the weights' all-gathers travel quantized (ZeRO++'s qwZ): `int8`
    /// (block-wise, ~1/4 of the bytes) or `bf16`; every rank computes with the decoded
    /// weights, the fp32 master shards and checkpoints are unchanged. Default (and `fp32`,
    /// which overrides a config file's setting): unquantized.
    #[arg(long, value_name = "int8|bf16|fp32")]
    quantize_weights: Option<QuantArg>,
    /// The gradient reductions travel quantized (ZeRO++'s qgZ, all-to-all based): `int8` or
    /// `bf16`; summed in fp32 on arrival. Default (and `fp32`): unquantized.
    #[arg(long, value_name = "int8|bf16|fp32")]
    quantize_grads: Option<QuantArg>,
    /// Keep state in host memory instead of the device's (ZeRO-Offload, ALST): `optimizer`
    /// (the Adam moments, and with --zero 3 the rank's fp32 master shard, updated by the fused
    /// CPU AdamW), `activations` (with --checkpoint-activations: each layer's kept input,
    /// brought back for its recompute), `all`, or `none` (default). Same results; on the CPU
    /// backend nothing moves.
    #[arg(long, value_name = "none|optimizer|activations|all")]
    offload: Option<genslm::config::Offload>,
    /// Keep the newest K checkpoint directories (older ones are removed); 0 keeps all.
    #[arg(long)]
    keep_checkpoints: Option<usize>,
    /// Start even when the predicted peak memory exceeds the memory available here.
    #[arg(long)]
    skip_memory_check: bool,
    /// Replace a run already in --out (a fresh run into it is refused otherwise). The old run
    /// stays aside until the new one has saved its first checkpoint, and comes back if the
    /// new one stops before that.
    #[arg(long, conflicts_with = "resume")]
    overwrite: bool,
    /// With --skip-nonfinite: stop after more than this many skipped steps in a row.
    #[arg(long)]
    max_consecutive_skips: Option<u64>,
    /// Elements per call when gradients and ZeRO shards travel between ranks.
    #[arg(long)]
    reduce_bucket_size: Option<usize>,
    /// Seconds a thread rank waits for the others before declaring them stuck (checkpoint
    /// writes and tokenizing wait without limit).
    #[arg(long)]
    rank_timeout_s: Option<u64>,
    /// Attention implementation (overrides `[model] attention`).
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
    /// Pipeline schedule with --pp: gpipe (every forward, then every backward), 1f1b (at most
    /// P micro-batches in flight; needs --grad-accum ≥ P), interleaved (with --pp-virtual V:
    /// the bubble / V; --grad-accum a multiple of P), zb (zero-bubble ZB-H1 order).
    #[arg(long)]
    pp_schedule: Option<genslm::parallel::pipeline::schedule::ScheduleKind>,
    /// Chunks of layers per pipeline stage (interleaved).
    #[arg(long)]
    pp_virtual: Option<usize>,
    /// Layers per pipeline chunk in chunk order, e.g. 3,3,2,2 (default: even, extra layers on
    /// the last chunks).
    #[arg(long, value_delimiter = ',')]
    pp_layers: Option<Vec<usize>>,
}

/// One rank per process under mpirun/srun: PP from --pp, SP from --sp, CP from --cp, TP from
/// --tp, DP = processes / (PP · SP · CP · TP).
#[cfg(feature = "mpi")]
pub fn train_launched(
    cfg: &genslm::config::Config,
    data: &DataSource,
    out: &std::path::Path,
    opts: &RunOptions,
    n: usize,
    d: Degrees,
) -> anyhow::Result<genslm::train::trainer::TrainSummary> {
    let Degrees { dp, cp, sp, tp, pp } = d;
    if dp != 1 && d.world() != n {
        anyhow::bail!(
            "--dp {dp} × --pp {pp} × --cp {cp} × --sp {sp} × --tp {tp} ≠ the {n} processes mpirun \
             started"
        );
    }
    let universe = genslm::parallel::mpi::init()?;
    let ranks = genslm::parallel::mpi::mpi_ranks(&universe, d)?;
    // One process per GPU: NCCL carries the tensor collectives, MPI the rest (and NCCL's id).
    #[cfg(feature = "nccl")]
    let ranks = if opts.device.backend == genslm::backend::BackendKind::Cuda {
        let (gpu, _) = opts.device.gpu_index(0, |k| std::env::var(k).ok());
        genslm::parallel::nccl::with_nccl(ranks, gpu)?
    } else {
        ranks
    };
    Ok(genslm::train::trainer::train_with_ranks(
        cfg, data, out, opts, &ranks,
    )?)
}

#[cfg(not(feature = "mpi"))]
pub fn train_launched(
    _cfg: &genslm::config::Config,
    _data: &DataSource,
    _out: &std::path::Path,
    _opts: &RunOptions,
    n: usize,
    _d: Degrees,
) -> anyhow::Result<genslm::train::trainer::TrainSummary> {
    anyhow::bail!(
        "started by a parallel launcher with {n} processes, but this build has no MPI support \
         (rebuild with --features mpi), or run one process with --dp/--pp/--cp/--sp/--tp (ranks as \
         threads)"
    )
}

pub fn run_train(a: TrainArgs, quiet: bool) -> anyhow::Result<()> {
    // `--out .` names the working directory when it is a run already (`--resume`).
    if !(a.out.is_dir() && a.out.as_os_str() == ".") {
        genslm::atomic::check_dir_name("--out", &a.out)?;
    }
    if a.stop_after == Some(0) {
        anyhow::bail!("--stop-after 0: must be at least 1 (it ends the invocation after N steps)");
    }
    let device = a.device.choice();
    // Before anything is read or written: a backend this build or machine lacks is an error.
    device.check()?;
    let (mut cfg, train_keys) = Config::load_keyed(&a.config)?;
    if let Some(k) = a.attention {
        cfg.model.attention = k.into();
    }
    let pipeline_flags = a.pp_schedule.is_some() || a.pp_virtual.is_some() || a.pp_layers.is_some();
    if pipeline_flags && a.degrees.pp <= 1 {
        anyhow::bail!(
            "--pp-schedule, --pp-virtual and --pp-layers set up pipeline stages: give --pp P \
             (2 or more) with them"
        );
    }
    // A resume that names no total keeps the run's (the config's default total recomputed
    // the learning-rate schedule of a run started with --steps, without a word but a note).
    if a.resume && a.steps.is_none() && !train_keys.iter().any(|k| k == "steps") {
        if let Ok(saved) = genslm::train::checkpoint::read_saved(&a.out) {
            cfg.train.steps = saved.state.train.steps;
        }
    }
    let t = &mut cfg.train;
    // The settings a flag gave, so that a bad value is blamed on the flag, not the file.
    let mut flagged: Vec<&str> = Vec::new();
    macro_rules! set {
        ($($f:ident),*) => {$( if let Some(v) = a.$f { t.$f = v; flagged.push(stringify!($f)); } )*};
    }
    set!(
        steps,
        seq_len,
        batch_size,
        grad_accum,
        lr,
        warmup,
        seed,
        val_fraction,
        val_every,
        checkpoint_every,
        max_grad_norm,
        weight_decay,
        reduce_bucket_size,
        rank_timeout_s,
        max_consecutive_skips,
        keep_checkpoints,
        zero,
        pp_schedule,
        pp_virtual,
        prefetch_layers
    );
    if let Some(v) = a.pp_layers {
        t.pp_layers = Some(v);
        flagged.push("pp_layers");
    }
    for (set, field) in [
        (a.quantize_weights.is_some(), "quantize_weights"),
        (a.quantize_grads.is_some(), "quantize_grads"),
        (a.offload.is_some(), "offload"),
    ] {
        if set {
            flagged.push(field);
        }
    }
    t.quantize_weights = a.quantize_weights.map_or(t.quantize_weights, |q| q.0);
    t.quantize_grads = a.quantize_grads.map_or(t.quantize_grads, |q| q.0);
    t.offload = a.offload.unwrap_or(t.offload);
    // Recorded resolved, so config.toml and the checkpoint say what ran.
    t.precision = Some(genslm::backend::resolve_precision(
        a.device.precision().or(t.precision),
        device.backend,
    ));
    t.skip_nonfinite |= a.skip_nonfinite;
    if a.max_consecutive_skips.is_some() && !t.skip_nonfinite {
        eprintln!(
            "note: --max-consecutive-skips counts the steps --skip-nonfinite skips; without it \
             the first non-finite step stops the run"
        );
    }
    t.checkpoint_activations |= a.checkpoint_activations;
    t.megatron_sp &= !a.no_megatron_sp;
    t.overlap &= !a.no_overlap;
    // The same from the file: chunks, a split of stages or a schedule with one stage were
    // accepted and recorded, and meant nothing (the file's default schedule is no setting).
    let schedule = train_keys.iter().any(|k| k == "pp_schedule")
        && t.pp_schedule != genslm::parallel::pipeline::schedule::ScheduleKind::OneFOneB;
    if a.degrees.pp <= 1 && (t.pp_virtual > 1 || t.pp_layers.is_some() || schedule) {
        let mut set = Vec::new();
        if schedule {
            set.push(format!("pp_schedule = {:?}", t.pp_schedule.to_string()));
        }
        if t.pp_virtual > 1 {
            set.push(format!("pp_virtual = {}", t.pp_virtual));
        }
        if t.pp_layers.is_some() {
            set.push("pp_layers".to_string());
        }
        let set = set.join(" and ");
        anyhow::bail!(
            "{}: {set} set up pipeline stages: give --pp P (2 or more), or remove it from the \
             file",
            a.config.display()
        );
    }
    t.validate().map_err(|m| {
        match flagged
            .iter()
            .find(|f| m.starts_with(&format!("field `{f}`")))
        {
            Some(f) => anyhow::anyhow!("--{}: {m}", f.replace('_', "-")),
            None if flagged.is_empty() => anyhow::anyhow!("{}: {m}", a.config.display()),
            None => anyhow::anyhow!("{}: {m} (after command-line overrides)", a.config.display()),
        }
    })?;
    let data = match a.data {
        Some(p) => DataSource::Parquet(p),
        None => DataSource::Fasta(a.fasta),
    };
    let opts = RunOptions {
        resume: a.resume,
        stop_after: a.stop_after,
        overwrite: a.overwrite,
        skip_memory_check: a.skip_memory_check,
        progress: !quiet,
        device,
        thread_rank: 0,
        ranks_in_process: 1,
        network: None,
        config_file: Some(a.config.clone()),
        old_run: Default::default(),
        no_checkpoints: false,
    };
    let degrees = a.degrees.degrees();
    let launch = genslm::launch::launched().map_err(anyhow::Error::msg)?;
    let s = match launch {
        Some(l) if l.launcher == genslm::launch::TORCHRUN => anyhow::bail!(
            "started as rank {} of {} by {} (RANK/WORLD_SIZE): genslm's processes meet through \
             MPI, not torchrun's rendezvous. Start them with mpirun or srun (a build with \
             --features mpi), or run one process with --dp/--pp/--cp/--sp/--tp (ranks as threads)",
            l.rank,
            l.world,
            l.launcher
        ),
        Some(l) => train_launched(&cfg, &data, &a.out, &opts, l.world, degrees)?,
        None => train_grid(&cfg, &data, &a.out, &opts, degrees)?,
    };
    if !quiet {
        eprintln!(
            "trained {} steps{}: loss {:.4}{}, peak memory {:.0} MiB",
            s.steps_done,
            match s.steps_skipped {
                0 => String::new(),
                n => format!(" ({n} skipped: non-finite or overflowing loss or gradient)"),
            },
            s.final_loss,
            s.final_val_loss
                .map(|v| format!(", val loss {v:.4}"))
                .unwrap_or_default(),
            s.peak_rss_mib
        );
        if let Some(c) = s.last_checkpoint {
            eprintln!("checkpoint {}", c.display());
        }
    }
    Ok(())
}

/// `--quantize-weights`/`--quantize-grads`: an encoding, or `fp32` for none.
#[derive(Debug, Clone, Copy)]
pub struct QuantArg(pub Option<genslm::config::Quantize>);

impl std::str::FromStr for QuantArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp32" => Ok(QuantArg(None)),
            _ => s
                .parse()
                .map(|q| QuantArg(Some(q)))
                .map_err(|_| format!("`{s}`: int8, bf16, or fp32 (unquantized)")),
        }
    }
}
