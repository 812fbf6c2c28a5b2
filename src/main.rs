//! The `genslm` command line: parse arguments, call the library, map errors to exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use genslm::data::fasta::OnInvalid;
use genslm::data::ingest::{tokenize_to_parquet, IngestOptions};
use genslm::tokenizer::{Trailing, VocabKind};
use genslm::train::trainer::{train_threads, DataSource, RunOptions};

#[derive(Parser)]
#[command(
    name = "genslm",
    version,
    about = "Genome-scale language models over long DNA sequences"
)]
struct Cli {
    /// No progress bars or summaries, only errors.
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum VocabArg {
    Genslm69,
    Genslm71,
}

#[derive(Clone, Copy, ValueEnum)]
enum OnInvalidArg {
    Error,
    Skip,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize FASTA files (plain or gz/bz2/xz/zst) into a parquet dataset, one row per record.
    Tokenize {
        /// FASTA files or directories (walked recursively for .fa .fasta .fna .ffn .fas[.gz|.bz2|.xz|.zst]).
        #[arg(long, num_args = 1.., required = true)]
        fasta: Vec<PathBuf>,
        /// Output parquet file (written atomically).
        #[arg(long)]
        out: PathBuf,
        /// Codon vocabulary (GenSLM's 69-token, or 71-token with [BOS]/[EOS]).
        #[arg(long, value_enum, default_value = "genslm69")]
        vocab: VocabArg,
        /// What to do with an invalid record or unreadable file: stop, or skip it with a warning.
        #[arg(long, value_enum, default_value = "error")]
        on_invalid: OnInvalidArg,
        /// Drop a trailing partial codon instead of emitting [UNK] (GenSLM emits [UNK]).
        #[arg(long)]
        drop_partial_codon: bool,
    },
    /// Train a GenSLM model from FASTA (or a tokenized parquet dataset) into a run directory.
    Train(Box<TrainArgs>),
    /// Score records: per record, predicted tokens, mean NLL (nats/token) and perplexity (TSV).
    Score {
        /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
        #[arg(long)]
        model: PathBuf,
        /// FASTA files or directories.
        #[arg(long, num_args = 1.., required = true)]
        fasta: Vec<PathBuf>,
        /// Window length in codons (default: the model's max_position_embeddings).
        #[arg(long)]
        seq_len: Option<usize>,
        /// Windows per forward pass.
        #[arg(long, default_value_t = 4)]
        batch_size: usize,
    },
    /// Print a model config's shape, parameter count and training memory.
    Info {
        /// Model config (TOML), e.g. configs/genslm-25m.toml.
        #[arg(long)]
        config: PathBuf,
    },
    /// Embed records: one vector per record (mean of a layer's hidden states) into parquet.
    Embed(Box<EmbedArgs>),
    /// Plot an embeddings file: 2-D PCA scatter (PNG) coloured by a column.
    Plot {
        /// Embeddings parquet written by `genslm embed`.
        #[arg(long)]
        embeddings: PathBuf,
        /// Output PNG (written atomically).
        #[arg(long)]
        out: PathBuf,
        /// Column that colours the points (numeric: colour bar; text: legend).
        #[arg(long, default_value = "gc_content")]
        color: String,
        /// Plot title (default: file, records and layer).
        #[arg(long)]
        title: Option<String>,
    },
    /// Generate DNA with a model (FASTA, one record per sample, settings in the header).
    Generate(Box<GenerateArgs>),
    /// Plan training memory per GPU and the longest sequence that fits (or --compare-published).
    Plan(Box<genslm::plan::cli::PlanArgs>),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum PoolArg {
    Mean,
    Last,
}

/// `genslm embed`.
#[derive(clap::Args)]
struct EmbedArgs {
    /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// FASTA files or directories.
    #[arg(long, num_args = 1.., conflicts_with = "data", required_unless_present = "data")]
    fasta: Vec<PathBuf>,
    /// A dataset written by `genslm tokenize`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Output parquet (written atomically).
    #[arg(long)]
    out: PathBuf,
    /// Hidden state: 0 = embeddings, i = output of layer i, -1 = after the final LayerNorm.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    layer: i64,
    /// Pooling over a record's tokens.
    #[arg(long, value_enum, default_value = "mean")]
    pool: PoolArg,
    /// Window in codons (default: the training window, else max_position_embeddings; whole records for ALiBi).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Also draw the PCA plot (coloured by GC content) to this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// `genslm generate`.
#[derive(clap::Args)]
struct GenerateArgs {
    /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// DNA to start from (A/C/G/T, a multiple of 3 bases).
    #[arg(long, default_value = "ATG")]
    prompt: String,
    /// Samples to draw.
    #[arg(long, default_value_t = 1)]
    num: usize,
    /// Codons per sample, prompt included.
    #[arg(long, default_value_t = 1024)]
    max_codons: usize,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 50)]
    top_k: usize,
    /// Keep the most likely tokens up to this probability mass (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    /// Logit temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Random seed (sample i uses stream i of it).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// End a sample at its first stop codon (TAA, TAG, TGA; kept).
    #[arg(long)]
    stop_at_stop_codon: bool,
    /// Samples decoded together.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Output FASTA (written atomically; default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn run_embed(a: EmbedArgs, quiet: bool) -> anyhow::Result<()> {
    use genslm::infer::embed::{embed_to_parquet, EmbedInput, EmbedOptions, Pool};
    let input = match a.data {
        Some(p) => EmbedInput::Parquet(p),
        None => EmbedInput::Fasta(a.fasta),
    };
    let opts = EmbedOptions {
        layer: a.layer,
        pool: match a.pool {
            PoolArg::Mean => Pool::Mean,
            PoolArg::Last => Pool::Last,
        },
        seq_len: a.seq_len,
        batch_size: a.batch_size,
        progress: !quiet,
    };
    let s = embed_to_parquet(&a.model, &input, &a.out, &opts)?;
    if !quiet {
        eprintln!(
            "embedded {} records ({} tokens, layer {}, dim {}, window {}) in {:.1} s: {}",
            s.records,
            s.tokens,
            s.layer,
            s.dim,
            s.window.map_or("whole records".into(), |w| w.to_string()),
            s.elapsed.as_secs_f64(),
            a.out.display()
        );
    }
    if let Some(png) = a.plot {
        let p = genslm::plot::plot_embeddings(&a.out, &png, &Default::default())?;
        if !quiet {
            eprintln!("plotted {} points: {}", p.points, png.display());
        }
    }
    Ok(())
}

fn run_generate(a: GenerateArgs, quiet: bool) -> anyhow::Result<()> {
    use genslm::infer::generate::{generate_fasta, GenerateOptions};
    let opts = GenerateOptions {
        prompt: a.prompt,
        num: a.num,
        max_codons: a.max_codons,
        sampling: genslm::infer::sample::SamplingParams {
            top_k: a.top_k,
            top_p: a.top_p,
            temperature: a.temperature,
        },
        seed: a.seed,
        stop_at_stop_codon: a.stop_at_stop_codon,
        batch_size: a.batch_size,
        use_cache: true,
        progress: !quiet,
    };
    let n = generate_fasta(&a.model, &opts, a.out.as_deref(), quiet)?;
    if !quiet {
        if let Some(out) = &a.out {
            eprintln!("wrote {n} sequences to {}", out.display());
        }
    }
    Ok(())
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Backend {
    Cpu,
    Cuda,
}

/// `genslm train`: every setting flag overrides the `[train]` field of the same name.
#[derive(clap::Args)]
struct TrainArgs {
    /// FASTA files or directories (tokenized into RUN/data.parquet).
    #[arg(long, num_args = 1.., conflicts_with = "data", required_unless_present = "data")]
    fasta: Vec<PathBuf>,
    /// A dataset written by `genslm tokenize`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Model and training config (TOML), e.g. configs/tiny.toml.
    #[arg(long)]
    config: PathBuf,
    /// Run directory: config.toml, metrics.jsonl, checkpoints/.
    #[arg(long)]
    out: PathBuf,
    /// Continue from OUT/checkpoints/latest.
    #[arg(long)]
    resume: bool,
    /// Stop after this many steps in this invocation (with a checkpoint); --resume continues.
    #[arg(long)]
    stop_after: Option<u64>,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: Backend,
    /// Sequence-parallel degree P (Ulysses): each sequence is split over P ranks.
    #[arg(long, default_value_t = 1)]
    sp: usize,
    /// Data-parallel degree D: the global batch is split over D replicas. P × D ranks run as
    /// threads of this process.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    #[arg(long)]
    steps: Option<u64>,
    /// Codons per sample.
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    warmup: Option<u64>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    val_fraction: Option<f64>,
    #[arg(long)]
    val_every: Option<u64>,
    #[arg(long)]
    checkpoint_every: Option<u64>,
    #[arg(long)]
    max_grad_norm: Option<f64>,
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Skip steps whose loss or gradient is NaN/Inf instead of stopping.
    #[arg(long)]
    skip_nonfinite: bool,
    /// Attention implementation (overrides `[model] attention`).
    #[arg(long, value_enum)]
    attention: Option<AttentionArg>,
}

/// One rank per process under mpirun/srun: SP from --sp, DP = processes / SP.
#[cfg(feature = "mpi")]
fn train_launched(
    cfg: &genslm::config::Config,
    data: &DataSource,
    out: &std::path::Path,
    opts: &RunOptions,
    n: usize,
    sp: usize,
    dp: usize,
) -> anyhow::Result<genslm::train::trainer::TrainSummary> {
    if dp != 1 && dp * sp != n {
        anyhow::bail!("--dp {dp} × --sp {sp} ≠ the {n} processes mpirun started");
    }
    let universe = genslm::parallel::mpi::init()?;
    let ranks = genslm::parallel::mpi::mpi_ranks(&universe, sp)?;
    Ok(genslm::train::trainer::train_with_ranks(
        cfg, data, out, opts, &ranks,
    )?)
}

#[cfg(not(feature = "mpi"))]
fn train_launched(
    _cfg: &genslm::config::Config,
    _data: &DataSource,
    _out: &std::path::Path,
    _opts: &RunOptions,
    n: usize,
    _sp: usize,
    _dp: usize,
) -> anyhow::Result<genslm::train::trainer::TrainSummary> {
    anyhow::bail!(
        "started by an MPI launcher with {n} processes, but this build has no MPI support \
         (rebuild with --features mpi), or run one process with --sp/--dp (ranks as threads)"
    )
}

/// World size announced by mpirun/srun, when started by one with more than one process.
fn launcher_world_size() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_SIZE",
        "SLURM_NTASKS",
    ]
    .iter()
    .filter_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
    .find(|&n| n > 1)
}

fn run_train(a: TrainArgs, quiet: bool) -> anyhow::Result<()> {
    if a.backend == Backend::Cuda {
        anyhow::bail!(
            "--backend cuda: this build has no CUDA backend yet (it needs the `cuda` feature, \
             which is not available); use --backend cpu"
        );
    }
    let mut cfg = genslm::config::Config::load(&a.config)?;
    if let Some(k) = a.attention {
        cfg.model.attention = k.into();
    }
    let t = &mut cfg.train;
    macro_rules! set {
        ($($f:ident),*) => {$( if let Some(v) = a.$f { t.$f = v; } )*};
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
        weight_decay
    );
    t.skip_nonfinite |= a.skip_nonfinite;
    t.validate().map_err(|m| {
        anyhow::anyhow!("{}: {m} (after command-line overrides)", a.config.display())
    })?;
    let data = match a.data {
        Some(p) => DataSource::Parquet(p),
        None => DataSource::Fasta(a.fasta),
    };
    let opts = RunOptions {
        resume: a.resume,
        stop_after: a.stop_after,
        progress: !quiet,
    };
    let s = match launcher_world_size() {
        Some(n) => train_launched(&cfg, &data, &a.out, &opts, n, a.sp, a.dp)?,
        None => train_threads(&cfg, &data, &a.out, &opts, a.dp, a.sp)?,
    };
    if !quiet {
        eprintln!(
            "trained {} steps: loss {:.4}{}, peak memory {:.0} MiB",
            s.steps_done,
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

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum AttentionArg {
    Flash,
    Naive,
}

impl From<AttentionArg> for genslm::config::AttentionKind {
    fn from(a: AttentionArg) -> Self {
        match a {
            AttentionArg::Flash => Self::Flash,
            AttentionArg::Naive => Self::Naive,
        }
    }
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Peak memory and time of one training step per sequence length, flash vs naive
    /// attention (each case in its own process, since peak memory is per process).
    Attention {
        #[arg(long, default_value = "configs/tiny.toml")]
        config: PathBuf,
        /// Sequence lengths (codons).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1024,2048,4096,8192,16384"
        )]
        seq_lens: Vec<usize>,
        /// Skip naive attention above this length (its s² scores may not fit).
        #[arg(long, default_value_t = 16384)]
        naive_max: usize,
    },
    /// One training step in this process (used by `bench attention`).
    #[command(hide = true)]
    Step {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        seq_len: usize,
        #[arg(long, value_enum)]
        attention: AttentionArg,
    },
    /// Embedding throughput (sequences/s) on random sequences with a fresh model.
    Embed {
        #[arg(long, default_value = "configs/genslm-25m.toml")]
        config: PathBuf,
        /// Codons per sequence.
        #[arg(long, default_value_t = 2048)]
        seq_len: usize,
        /// Sequences to embed.
        #[arg(long, default_value_t = 8)]
        sequences: usize,
        #[arg(long, default_value_t = 1)]
        batch_size: usize,
    },
    /// Generation throughput (codons/s) with and without the KV cache.
    Generate {
        #[arg(long, default_value = "configs/genslm-25m.toml")]
        config: PathBuf,
        /// Codons to draw per sample.
        #[arg(long, default_value_t = 256)]
        codons: usize,
        /// Samples decoded together.
        #[arg(long, default_value_t = 1)]
        samples: usize,
        /// Skip the run without the cache (it is O(s²) per codon).
        #[arg(long)]
        cache_only: bool,
    },
    /// FASTA → parquet throughput (MB/s) on synthetic plain and gzip FASTA.
    Ingest {
        /// Megabytes of FASTA to generate.
        #[arg(long, default_value_t = 256)]
        mb: usize,
        /// Scratch directory (default: a temporary directory, removed afterwards).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Tokenize {
            fasta,
            out,
            vocab,
            on_invalid,
            drop_partial_codon,
        } => {
            let opts = IngestOptions {
                vocab: match vocab {
                    VocabArg::Genslm69 => VocabKind::Genslm69,
                    VocabArg::Genslm71 => VocabKind::Genslm71,
                },
                on_invalid: match on_invalid {
                    OnInvalidArg::Error => OnInvalid::Error,
                    OnInvalidArg::Skip => OnInvalid::Skip,
                },
                trailing: if drop_partial_codon {
                    Trailing::Drop
                } else {
                    Trailing::Unk
                },
                progress: !cli.quiet,
            };
            let summary = tokenize_to_parquet(&fasta, &out, &opts)?;
            if !cli.quiet {
                eprintln!("{summary}");
                eprintln!("wrote {}", out.display());
            }
        }
        Command::Train(args) => run_train(*args, cli.quiet)?,
        Command::Score {
            model,
            fasta,
            seq_len,
            batch_size,
        } => {
            let stdout = std::io::stdout();
            let mut out = stdout.lock();
            genslm::infer::score::score_fasta(&model, &fasta, seq_len, batch_size, &mut out)?;
        }
        Command::Info { config } => {
            let cfg = genslm::config::Config::load(&config)?;
            print!("{}", genslm::info::report(&cfg.model));
        }
        Command::Embed(args) => run_embed(*args, cli.quiet)?,
        Command::Plot {
            embeddings,
            out,
            color,
            title,
        } => {
            let opts = genslm::plot::PlotOptions {
                color,
                title,
                ..Default::default()
            };
            let p = genslm::plot::plot_embeddings(&embeddings, &out, &opts)?;
            if !cli.quiet {
                eprintln!(
                    "plotted {} points (PC1 {:.1}%, PC2 {:.1}% of variance): {}",
                    p.points,
                    100.0 * p.ratios[0],
                    100.0 * p.ratios[1],
                    out.display()
                );
            }
        }
        Command::Generate(args) => run_generate(*args, cli.quiet)?,
        Command::Plan(args) => print!("{}", genslm::plan::cli::run(&args)?),
        Command::Bench { which } => match which {
            BenchCmd::Step {
                config,
                seq_len,
                attention,
            } => {
                let mut cfg = genslm::config::Config::load(&config)?.model;
                cfg.attention = attention.into();
                let (secs, peak) = genslm::bench::train_step(&cfg, seq_len, 1)?;
                println!("{secs} {peak}");
            }
            BenchCmd::Attention {
                config,
                seq_lens,
                naive_max,
            } => {
                let exe = std::env::current_exe().context("locating the genslm binary")?;
                println!("seq_len  attention  step_s  tokens/s  peak_MiB");
                for &s in &seq_lens {
                    for kind in ["flash", "naive"] {
                        if kind == "naive" && s > naive_max {
                            println!("{s:>7}  {kind:<9}  skipped (--naive-max {naive_max})");
                            continue;
                        }
                        let out = std::process::Command::new(&exe)
                            .args(["bench", "step", "--config"])
                            .arg(&config)
                            .args(["--seq-len", &s.to_string(), "--attention", kind])
                            .output()
                            .context("running a benchmark step")?;
                        let text = String::from_utf8_lossy(&out.stdout);
                        let v: Vec<f64> = text
                            .split_whitespace()
                            .filter_map(|x| x.parse().ok())
                            .collect();
                        if !out.status.success() || v.len() != 2 {
                            println!(
                                "{s:>7}  {kind:<9}  failed: {}",
                                String::from_utf8_lossy(&out.stderr).trim()
                            );
                            continue;
                        }
                        println!(
                            "{s:>7}  {kind:<9}  {:>6.2}  {:>8.0}  {:>8.0}",
                            v[0],
                            s as f64 / v[0],
                            v[1]
                        );
                    }
                }
            }
            BenchCmd::Embed {
                config,
                seq_len,
                sequences,
                batch_size,
            } => {
                let cfg = genslm::config::Config::load(&config)?.model;
                let b = genslm::infer::bench::embed(&cfg, seq_len, sequences, batch_size)?;
                println!("model  seq_len  sequences  batch  seconds  sequences/s  tokens/s");
                println!(
                    "{}  {}  {}  {}  {:.2}  {:.3}  {:.0}",
                    cfg.name,
                    b.seq_len,
                    b.sequences,
                    b.batch_size,
                    b.seconds,
                    b.sequences_per_s(),
                    b.tokens_per_s()
                );
            }
            BenchCmd::Generate {
                config,
                codons,
                samples,
                cache_only,
            } => {
                let cfg = genslm::config::Config::load(&config)?.model;
                println!("model  kv_cache  samples  codons  seconds  codons/s");
                for use_cache in [true, false] {
                    if !use_cache && cache_only {
                        continue;
                    }
                    let b = genslm::infer::bench::generation(&cfg, codons, samples, use_cache)?;
                    println!(
                        "{}  {}  {}  {}  {:.2}  {:.1}",
                        cfg.name,
                        if use_cache { "yes" } else { "no" },
                        b.samples,
                        b.codons,
                        b.seconds,
                        b.codons_per_s()
                    );
                }
            }
            BenchCmd::Ingest { mb, dir } => {
                let tmp;
                let dir = match dir {
                    Some(d) => {
                        std::fs::create_dir_all(&d)
                            .with_context(|| format!("creating {}", d.display()))?;
                        d
                    }
                    None => {
                        tmp = tempfile::tempdir().context("creating a scratch directory")?;
                        tmp.path().to_path_buf()
                    }
                };
                println!("case   fasta_MB  input_MB  seconds  MB/s(fasta)  MB/s(input)  Mbases/s");
                for c in genslm::bench::ingest(&dir, mb)? {
                    let s = &c.summary;
                    let secs = s.elapsed.as_secs_f64();
                    println!(
                        "{:<6} {:>8.1}  {:>8.1}  {:>7.3}  {:>11.1}  {:>11.1}  {:>8.1}",
                        c.name,
                        c.fasta_bytes as f64 / 1e6,
                        s.input_bytes as f64 / 1e6,
                        secs,
                        c.fasta_bytes as f64 / 1e6 / secs,
                        s.mb_per_s(),
                        s.mbases_per_s()
                    );
                }
            }
        },
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
