//! The `genslm` command line: parse arguments, call the library, map errors to exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use genslm::data::fasta::OnInvalid;
use genslm::data::ingest::{tokenize_to_parquet, IngestOptions};
use genslm::tokenizer::{Trailing, VocabKind};

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
    /// Print a model config's shape, parameter count and training memory.
    Info {
        /// Model config (TOML), e.g. configs/genslm-25m.toml.
        #[arg(long)]
        config: PathBuf,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
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
        Command::Info { config } => {
            let cfg = genslm::config::Config::load(&config)?;
            print!("{}", genslm::info::report(&cfg.model));
        }
        Command::Bench { which } => match which {
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
