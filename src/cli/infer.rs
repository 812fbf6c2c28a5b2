//! `genslm score`, `genslm embed` and `genslm generate`: arguments and how they call the library.

use std::path::PathBuf;

use genslm::infer::embed::Pool;

use super::device::DeviceArgs;
use super::mirror;

mirror!(PoolArg => Pool { Mean, Last, None });

/// `genslm score`.
#[derive(clap::Args)]
pub struct ScoreArgs {
    /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// FASTA files or directories.
    #[arg(long, num_args = 1.., required = true)]
    fasta: Vec<PathBuf>,
    /// Window length in codons (default: the training window recorded beside a genslm
    /// checkpoint, else the model's max_position_embeddings; the same rule as `embed`).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Codons between window starts (default: the window, i.e. consecutive windows). A stride
    /// S < the window W overlaps windows so that every scored codon keeps at least W − S codons
    /// of left context (Hugging Face's perplexity recipe); each codon is still scored once.
    #[arg(long)]
    stride: Option<usize>,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Also write one row per predicted codon to this parquet file (written atomically):
    /// id, token/codon index, base offset, codon, log-probability, entropy, rank, context and
    /// the top-k codons with their probabilities.
    #[arg(long)]
    per_token: Option<PathBuf>,
    /// Most likely codons listed per position in the --per-token file [default: 5].
    #[arg(long)]
    top_k: Option<usize>,
    /// Add every vocabulary id's log-probability (a list indexed by token id) to the
    /// --per-token file.
    #[arg(long)]
    full_distribution: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `genslm embed`.
// One input, FASTA or a tokenized dataset: the error names both when neither is given.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["fasta", "data"])))]
pub struct EmbedArgs {
    /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// FASTA files or directories.
    #[arg(long, num_args = 1..)]
    fasta: Vec<PathBuf>,
    /// A dataset written by `genslm tokenize`.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Output parquet (written atomically).
    #[arg(long)]
    out: PathBuf,
    /// Hidden state: 0 = embeddings, i = output of layer i (1..num_layers−1), num_layers or
    /// -1 = the last layer's output after the final LayerNorm (transformers'
    /// output_hidden_states numbers them so).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true, conflicts_with = "layers")]
    layer: i64,
    /// Several hidden states from one pass (comma-separated, e.g. 0,4,-1): one row per record
    /// (or token) and layer, with a `layer` column.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    layers: Vec<i64>,
    /// Pooling over a record's tokens; `none` writes every token's state (one row per token
    /// and layer: id, token/codon index, base offset, codon, layer, context, embedding).
    #[arg(long, value_enum, default_value = "mean")]
    pool: PoolArg,
    /// Window in codons (default: the training window, else max_position_embeddings; the same rule as `score`).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Codons between window starts (default: the window). With S < the window W, each
    /// token's state comes from a window where it has at least W − S codons of left context.
    #[arg(long)]
    stride: Option<usize>,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Also draw the PCA plot (coloured by GC content) to this PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `genslm generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
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
    /// End a sample at the first stop codon it draws (TAA, TAG, TGA; kept). Stop codons in
    /// --prompt do not end it: the prompt is given, not drawn.
    #[arg(long)]
    stop_at_stop_codon: bool,
    /// Samples decoded together.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Output FASTA (written atomically; default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run_score(a: ScoreArgs) -> anyhow::Result<()> {
    use genslm::infer::score::{score_fasta, ScoreOptions};
    if let Some(p) = &a.per_token {
        genslm::atomic::check_parquet_name("--per-token", p)?;
    }
    let opts = ScoreOptions {
        seq_len: a.seq_len,
        stride: a.stride,
        batch_size: a.batch_size,
        top_k: match (a.top_k, &a.per_token) {
            (Some(k), Some(_)) => k,
            (Some(_), None) => anyhow::bail!(
                "--top-k lists the most likely codons in the --per-token file: give --per-token \
                 FILE"
            ),
            (None, _) => 5,
        },
        per_token: a.per_token,
        full_distribution: a.full_distribution,
        compute: a.device.compute(),
    };
    let stdout = std::io::stdout();
    score_fasta(&a.model, &a.fasta, &opts, &mut stdout.lock())?;
    Ok(())
}

pub fn run_embed(a: EmbedArgs, quiet: bool) -> anyhow::Result<()> {
    use genslm::infer::embed::{embed_to_parquet, EmbedInput, EmbedOptions};
    let input = match a.data {
        Some(p) => EmbedInput::Parquet(p),
        None => EmbedInput::Fasta(a.fasta),
    };
    genslm::atomic::check_parquet_name("--out", &a.out)?;
    if let Some(png) = &a.plot {
        genslm::atomic::distinct_outputs(&[("--out", &a.out), ("--plot", png)])?;
        // Before any work, with the name: a --plot that is a directory failed after the
        // embeddings were written, saying "Nothing was written".
        genslm::atomic::check_png_name("--plot", png)?;
        // And its directory: the embeddings were written, then the picture failed.
        genslm::atomic::check_output_dir(png)?;
    }
    if a.plot.is_some() && (a.pool == PoolArg::None || a.layers.len() > 1) {
        anyhow::bail!(
            "--plot draws one pooled vector per record: it takes one layer and --pool mean|last"
        );
    }
    let opts = EmbedOptions {
        layers: if a.layers.is_empty() {
            vec![a.layer]
        } else {
            a.layers
        },
        pool: a.pool.into(),
        seq_len: a.seq_len,
        stride: a.stride,
        batch_size: a.batch_size,
        progress: !quiet,
        compute: a.device.compute(),
    };
    let s = embed_to_parquet(&a.model, &input, &a.out, &opts)?;
    if !quiet {
        eprintln!(
            "embedded {} records ({} tokens, layer {}, dim {}, window {}) in {:.1} s: {} rows in {}",
            s.records,
            s.tokens,
            s.layers
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(","),
            s.dim,
            s.window.map_or("whole records".into(), |w| w.to_string()),
            s.elapsed.as_secs_f64(),
            s.rows,
            a.out.display()
        );
    }
    if let Some(png) = a.plot {
        let p = genslm::plot::plot_embeddings(&a.out, &png, &Default::default()).map_err(|e| {
            anyhow::anyhow!(
                "--plot {}: {e} (the embeddings are written: {})",
                png.display(),
                a.out.display()
            )
        })?;
        if !quiet {
            eprintln!("plotted {} points: {}", p.points, png.display());
        }
    }
    Ok(())
}

pub fn run_generate(a: GenerateArgs, quiet: bool) -> anyhow::Result<()> {
    use genslm::infer::generate::{generate_fasta, GenerateOptions};
    if let Some(out) = &a.out {
        genslm::atomic::check_not_stdout("--out", out, "leave --out out to print the FASTA")?;
        genslm::atomic::check_text_name(
            "--out",
            out,
            "FASTA",
            &["fa", "fasta", "fna", "fas", "txt"],
        )?;
    }
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
        compute: a.device.compute(),
    };
    let n = generate_fasta(&a.model, &opts, a.out.as_deref())?;
    if !quiet {
        if let Some(out) = &a.out {
            eprintln!("wrote {n} sequences to {}", out.display());
        }
    }
    Ok(())
}
