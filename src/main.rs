//! The `genslm` command line: parse arguments, call the library, map errors to exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use genslm::data::fasta::OnInvalid;
use genslm::data::ingest::{tokenize_to_parquet, IngestOptions};
use genslm::tokenizer::{Trailing, VocabKind};

/// `eprintln!` that never panics, as the library's (`lib.rs` says why): a textual macro cannot
/// cross into this crate, so it is defined again here for `main.rs` and `cli/`.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{}",
            genslm::error::for_terminal(&format!($($arg)*))
        );
    }};
}

/// `println!` that never panics (bench's tables): a reader gone (`| head`) ends the command
/// quietly, another failure (a full disk) with a message; temporaries are removed first.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            crate::stdout_failed(e);
        }
    }};
}

/// Ends the process after a failed write to stdout (see `println!` above).
fn stdout_failed(e: std::io::Error) -> ! {
    genslm::interrupt::remove_registered();
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: writing to standard output: {e}");
    std::process::exit(1);
}

mod cli;

#[derive(Parser)]
#[command(
    name = "genslm",
    version,
    about = "Genome-scale language models over long DNA sequences"
)]
struct Cli {
    /// No progress bars or summaries: only errors, warnings and notes.
    #[arg(long, global = true)]
    quiet: bool,
    /// CPU threads for the compute (default: all cores, divided among the processes a
    /// launcher started on this node; RAYON_NUM_THREADS also sets it).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

cli::mirror!(VocabArg => VocabKind { Genslm69, Genslm71 });
cli::mirror!(OnInvalidArg => OnInvalid { Error, Skip });
cli::mirror!(DigestArg => genslm::data::digest::DigestKind { Xxh3, Md5 });

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
        /// What to do with an invalid record or unreadable file: `error` stops with its name,
        /// `skip` skips it with a warning.
        #[arg(long, value_enum, default_value = "error")]
        on_invalid: OnInvalidArg,
        /// Drop a trailing partial codon instead of emitting [UNK] (GenSLM emits [UNK]).
        #[arg(long)]
        drop_partial_codon: bool,
        /// Each record's digest column: xxh3 (XXH3-128, fast) or md5 (as md5sum and GenSLM's
        /// tooling compute it, and as `genslm embed` writes it for FASTA input)
        #[arg(long, value_enum, default_value = "xxh3")]
        digest: DigestArg,
    },
    /// Train a GenSLM model from FASTA (or a tokenized parquet dataset) into a run directory.
    Train(Box<cli::train::TrainArgs>),
    /// Score records: per record, predicted tokens, mean NLL (nats/token) and perplexity (TSV);
    /// with --per-token, every predicted codon's log-probability, entropy, rank and top-k (parquet).
    Score(Box<cli::infer::ScoreArgs>),
    /// Variant effects: Δ log-likelihood of ALT vs REF around each VCF variant (SNVs, MNVs,
    /// indels) on a CDS, with the codon and amino-acid change; or --saturate a region (TSV,
    /// heatmap PNG).
    Variants(Box<cli::variants::VariantsArgs>),
    /// Convert GPT-NeoX weights (GenSLM's Lightning .pt, pytorch_model.bin, safetensors) into
    /// a model directory every genslm command loads. Pickles are read without running code.
    Convert {
        /// A `.pt` checkpoint, `pytorch_model.bin`, `.safetensors` file, or a directory of one.
        input: PathBuf,
        /// New model directory (written whole or not at all).
        #[arg(long)]
        out: PathBuf,
        /// The model's shape: a genslm config TOML (e.g. configs/genslm-25m.toml) or a
        /// config.json. Default: the config.json beside INPUT.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Print a model config's shape, parameter count and training memory.
    Info {
        /// Model config: a genslm TOML (e.g. configs/genslm-25m.toml) or built-in preset name
        /// (tiny, genslm-25m, …, genslm-33b), a Hugging Face config.json, or a model or run
        /// directory.
        #[arg(long)]
        config: PathBuf,
    },
    /// Embed records: one vector per record (mean of a layer's hidden states) into parquet.
    Embed(Box<cli::infer::EmbedArgs>),
    /// Plot an embeddings file (2-D PCA scatter coloured by a column), or a run's curves
    /// (loss and validation loss, learning rate, tokens/s, peak memory over steps), as PNG.
    // One of the two inputs, named together when neither is given.
    #[command(group(clap::ArgGroup::new("input").required(true).args(["embeddings", "run"])))]
    Plot {
        /// Embeddings parquet written by `genslm embed`.
        #[arg(long)]
        embeddings: Option<PathBuf>,
        /// A run directory (`train --out`): plot its metrics.jsonl.
        #[arg(long)]
        run: Option<PathBuf>,
        /// Output PNG (written atomically).
        #[arg(long)]
        out: PathBuf,
        /// Column that colours the points (numeric: colour bar; text: legend); embeddings
        /// only (a run's curves have their own colours, and it was ignored there).
        #[arg(long, default_value = "gc_content", conflicts_with = "run")]
        color: String,
        /// Plot title (default: file, records and layer).
        #[arg(long)]
        title: Option<String>,
    },
    /// Generate DNA with a model (FASTA, one record per sample, settings in the header).
    Generate(Box<cli::infer::GenerateArgs>),
    /// Plan training memory per GPU and the longest sequence that fits (or --compare-published).
    Plan(Box<cli::plan::PlanArgs>),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: cli::bench::BenchCmd,
    },
}

/// Writes a whole report to stdout. `print!` panics when stdout fails (a full disk); a
/// reader that stopped early (`| head`) is no error, anything else is one, named.
fn print_all(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::anyhow!("writing to standard output: {e}"))
        }
        _ => Ok(()),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    genslm::backend::set_cpu_threads(cli.threads)?;
    if let Command::Plot { out, .. } = &cli.command {
        genslm::atomic::check_png_name("--out", out)?;
    }
    let single = match &cli.command {
        Command::Tokenize { .. } => Some("tokenize"),
        Command::Score(_) => Some("score"),
        Command::Embed(_) => Some("embed"),
        Command::Generate(_) => Some("generate"),
        Command::Variants(_) => Some("variants"),
        _ => None,
    };
    // Only train splits its work over a launcher's processes; the others each do all of it.
    if let (Some(cmd), Ok(Some(l))) = (single, genslm::launch::launched()) {
        if l.rank == 0 {
            eprintln!(
                "warning: started as {} processes by {}: `genslm {cmd}` does not split its work \
                 over processes, so each does all of it and writes the same output; run it as \
                 one process",
                l.world, l.launcher
            );
        }
    }
    match cli.command {
        Command::Tokenize {
            fasta,
            out,
            vocab,
            on_invalid,
            drop_partial_codon,
            digest,
        } => {
            let opts = IngestOptions {
                vocab: vocab.into(),
                on_invalid: on_invalid.into(),
                trailing: if drop_partial_codon {
                    Trailing::Drop
                } else {
                    Trailing::Unk
                },
                progress: !cli.quiet,
                digest: digest.into(),
            };
            // (A run's `data.parquet` is its train's, paired with `data.sources.json` and the
            // checkpoints' data fingerprint: the name check refuses it as a run's file before
            // the lock, which would make this process the run's owner. Other names in a run
            // directory take its lock.)
            genslm::atomic::check_parquet_name("--out", &out)?;
            let _run = genslm::run_lock::if_in_run_dir(&out, "tokenize")?;
            let summary = tokenize_to_parquet(&fasta, &out, &opts)?;
            if !cli.quiet {
                eprintln!("{summary}");
                eprintln!("wrote {}", out.display());
            }
        }
        Command::Train(args) => cli::train::run_train(*args, cli.quiet)?,
        Command::Score(args) => cli::infer::run_score(*args)?,
        Command::Variants(args) => cli::variants::run(*args, cli.quiet)?,
        Command::Convert { input, out, config } => {
            let c = genslm::convert::convert(&input, &out, config.as_deref())?;
            if !cli.quiet {
                eprintln!(
                    "converted {} ({}): {} tensors, {} parameters, {} layers × hidden {}, \
                     {} positions{}",
                    input.display(),
                    c.format,
                    c.tensors,
                    c.parameters,
                    c.config.num_layers,
                    c.config.hidden_size,
                    c.config.position,
                    if c.dropped > 0 {
                        format!("; dropped {} attention-mask/rotary buffers", c.dropped)
                    } else {
                        String::new()
                    }
                );
                eprintln!("wrote {}", out.display());
            }
        }
        Command::Info { config } => {
            let model = genslm::info::load_model_config(&config)?;
            print_all(&genslm::info::report(&model))?;
        }
        Command::Embed(args) => cli::infer::run_embed(*args, cli.quiet)?,
        Command::Plot {
            run: Some(run),
            out,
            title,
            ..
        } => {
            let c = genslm::curves::plot_run(&run, &out, title.as_deref())?;
            if !cli.quiet {
                let n = |k: usize, one: &str| format!("{k} {one}{}", if k == 1 { "" } else { "s" });
                let skipped = match c.skipped {
                    0 => String::new(),
                    k => format!(
                        ", {} skipped: non-finite or overflowing loss or gradient",
                        n(k, "step")
                    ),
                };
                eprintln!(
                    "plotted {} ({}{skipped}): {}",
                    n(c.steps.len(), "step"),
                    n(c.val.len(), "validation point"),
                    out.display()
                );
            }
        }
        Command::Plot {
            embeddings,
            out,
            color,
            title,
            ..
        } => {
            // clap requires --embeddings when --run is absent.
            let embeddings = embeddings.unwrap_or_default();
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
        Command::Generate(args) => cli::infer::run_generate(*args, cli.quiet)?,
        Command::Plan(args) => print_all(&genslm::plan::command::run(&(*args).into())?)?,
        Command::Bench { which } => {
            cli::bench_sizes::check_sizes(&which)?;
            cli::bench::run(which)?
        }
    }
    Ok(())
}

/// Panics are bugs or failed ranks, never a way to report bad input: rank threads' panics are
/// caught and reported by their guard (this hook stays silent for them); anything else prints
/// one line, without Rust's "panicked at" text or a backtrace.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        if thread
            .name()
            .is_some_and(|n| n.starts_with(genslm::train::trainer::RANK_THREAD_PREFIX))
        {
            return;
        }
        let msg = genslm::error::panic_message(info.payload()).unwrap_or("unknown failure");
        let at = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("error: internal error: {msg}{at}; please report it");
    }));
}

fn main() -> ExitCode {
    // Before anything allocates: peaks that depend on shapes only (see genslm::alloc).
    genslm::alloc::pin_thresholds();
    install_panic_hook();
    // Ctrl-C and kill remove the temporary outputs of this process before it dies.
    genslm::interrupt::install();
    let cli = Cli::parse();
    if let Err(e) = genslm::isa::check() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A signal's cleanup can fail the main thread (its file removed under it): the
            // process dies of the signal in a moment, with the signal's status, unreported.
            while genslm::interrupt::fired() {
                // The signal's thread ends the process once its cleanup is done, however long
                // that takes (gigabytes on a slow file system); a second signal more than 3 s
                // after the first ends it at once (`interrupt`).
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            if let Some(genslm::error::Error::ReaderGone) = e.downcast_ref() {
                // `score | head`: what was read is the answer, as with `println!` above.
                genslm::interrupt::remove_registered();
                return ExitCode::SUCCESS;
            }
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
