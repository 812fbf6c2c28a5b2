//! `genslm variants`: arguments and how they call the library.

use std::path::PathBuf;

use genslm::data::fasta::OnInvalid;
use genslm::infer::variants::{parse_range, run_variants, VariantOptions, VariantSource};

use super::device::DeviceArgs;

/// `genslm variants`.
#[derive(clap::Args)]
pub struct VariantsArgs {
    /// Model directory (config.json + model.safetensors), or a run directory (its latest checkpoint).
    #[arg(long)]
    model: PathBuf,
    /// The reference FASTA (files or directories); VCF CHROM names its records.
    #[arg(long, num_args = 1.., required = true)]
    fasta: Vec<PathBuf>,
    /// Variants to score: a VCF, plain or compressed: gzip/bgzip, bzip2, xz, zstd (SNVs, MNVs, indels; one row per ALT allele).
    #[arg(
        long,
        required_unless_present = "saturate",
        conflicts_with = "saturate"
    )]
    vcf: Option<PathBuf>,
    /// In-silico saturation mutagenesis: every single-base substitution (3 per base) of
    /// START..END (1-based, inclusive) of the record.
    #[arg(long, value_name = "START..END")]
    saturate: Option<String>,
    /// The record to read (--saturate on a FASTA of several records; with --vcf, only this
    /// CHROM: the lines on other chromosomes are passed over unread).
    #[arg(long)]
    chrom: Option<String>,
    /// The CDS on the record, 1-based inclusive (default: the record is a CDS read from its first base).
    #[arg(long, value_name = "START..END")]
    cds: Option<String>,
    /// Window in codons around each variant (default: the model's training window).
    #[arg(long)]
    window: Option<usize>,
    /// ALT windows decoded together.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// A bad variant (REF not matching the reference, unknown CHROM, malformed line): stop, or
    /// warn and leave it out.
    #[arg(long, value_enum, default_value = "error")]
    on_invalid: crate::OnInvalidArg,
    /// Recompute every REF and ALT window in full instead of reusing the REF prefix's keys and
    /// values (the reference path; slower).
    #[arg(long)]
    no_prefix_reuse: bool,
    /// Output table, written atomically: TSV, or parquet when the name ends in .parquet.
    #[arg(long)]
    out: PathBuf,
    /// With --saturate: draw the position × base heatmap of Δ log-likelihood to this PNG.
    #[arg(long, requires = "saturate")]
    heatmap: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(a: VariantsArgs, quiet: bool) -> anyhow::Result<()> {
    let source = match (a.vcf, a.saturate) {
        (Some(v), _) => VariantSource::Vcf(v),
        (None, Some(s)) => {
            let (start, end) = parse_range(&s, "--saturate")?;
            VariantSource::Saturate { start, end }
        }
        (None, None) => unreachable!("clap requires --vcf or --saturate"),
    };
    let cds = a
        .cds
        .as_deref()
        .map(|c| parse_range(c, "--cds"))
        .transpose()?;
    let opts = VariantOptions {
        source,
        chrom: a.chrom,
        cds,
        window: a.window,
        batch_size: a.batch_size,
        skip_invalid: OnInvalid::from(a.on_invalid) == OnInvalid::Skip,
        prefix_reuse: !a.no_prefix_reuse,
        heatmap: a.heatmap.clone(),
        compute: a.device.compute(),
        ..Default::default()
    };
    genslm::atomic::check_text_name(
        "--out",
        &a.out,
        "TSV (parquet where named .parquet)",
        &["tsv", "txt", "tab", "parquet"],
    )?;
    genslm::atomic::check_output_dir(&a.out)?;
    if let Some(png) = &a.heatmap {
        genslm::atomic::distinct_outputs(&[("--out", &a.out), ("--heatmap", png)])?;
        genslm::atomic::check_png_name("--heatmap", png)?;
        genslm::atomic::check_output_dir(png)?;
    }
    let s = run_variants(&a.model, &a.fasta, &opts, &a.out)?;
    if !quiet {
        // The windows actually scored, where they differ from the one asked for.
        let used = match s.used {
            Some((lo, hi)) if (lo, hi) != (s.window, s.window) => {
                format!(" ({lo}–{hi} scored: clipped at the CDS ends, stretched for long changes)")
            }
            _ => String::new(),
        };
        // Skipped lines are variants too: "1 variants (1 scored, 1 skipped)" did not add up.
        eprintln!(
            "{} variant(s) ({} scored, {} skipped), window {} codons{used}, in {:.1} s: {}",
            s.variants + s.skipped,
            s.scored,
            s.skipped,
            s.window,
            s.elapsed.as_secs_f64(),
            a.out.display()
        );
        if let Some(png) = a.heatmap.filter(|_| s.heatmap_drawn) {
            eprintln!("heatmap: {}", png.display());
        }
    }
    Ok(())
}
