//! `genslm variants`: zero-shot variant effects — the change in the model's log-likelihood of
//! a coding sequence when a VCF's variants (SNVs, MNVs, indels) are applied, with the codon and
//! amino-acid change of each, or in-silico saturation mutagenesis of a region as a heatmap.
//!
//! The coding frame: each reference record is a CDS read from its first base, or `--cds
//! START..END` (1-based, inclusive, as annotation tools write it) is the CDS on every record.
//! A variant whose change (after trimming the alleles' shared bases) is not entirely inside the
//! CDS is reported as `outside_cds` without a score (a genome's VCF has such variants; scoring
//! them in a frame they are not in would be wrong); one that reaches the CDS's incomplete last
//! codon, or leaves a window with nothing to predict, is annotated and not scored.
//! Windows and Δ: see [`delta`].

pub mod annotate;
mod code;
pub mod delta;
pub mod heatmap;
mod hgvs;
mod output;
mod place;
pub mod vcf;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::backend::Compute;
use crate::data::fasta::{self, OnInvalid};
use crate::error::{Error, Result};
use crate::infer::window::{check_forward_memory, resolve_window};
use crate::model::io::load_model_dir;
use crate::tokenizer::CodonTokenizer;
use annotate::{Annotation, Consequence};
use delta::Delta;
use place::place;
use vcf::Variant;

/// Where the variants come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VariantSource {
    /// A VCF (plain or gzip).
    Vcf(PathBuf),
    /// Every single-base substitution of bases `start..=end` (1-based) of the record.
    Saturate { start: u64, end: u64 },
}

/// Settings of one `variants` run.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantOptions {
    pub source: VariantSource,
    /// The record to mutate (`--saturate`) or the only record to read variants on.
    pub chrom: Option<String>,
    /// The CDS on the record, 1-based inclusive (None: the whole record).
    pub cds: Option<(u64, u64)>,
    /// Window in codons (None: the model's training window).
    pub window: Option<usize>,
    /// ALT suffixes decoded together.
    pub batch_size: usize,
    /// Warn and leave out bad variants instead of stopping at the first.
    pub skip_invalid: bool,
    /// Reuse the REF window's keys/values for the ALT suffixes (false: recompute everything).
    pub prefix_reuse: bool,
    /// Draw the saturation heatmap here.
    pub heatmap: Option<PathBuf>,
    pub compute: Compute,
    /// Tokens of REF and ALT windows built and held at once (the memory bound of a long
    /// --saturate or VCF); the scores do not depend on it.
    pub chunk_tokens: usize,
}

impl Default for VariantOptions {
    fn default() -> Self {
        Self {
            source: VariantSource::Saturate { start: 1, end: 1 },
            chrom: None,
            cds: None,
            window: None,
            batch_size: 16,
            skip_invalid: false,
            prefix_reuse: true,
            heatmap: None,
            compute: Compute::default(),
            chunk_tokens: CHUNK_TOKENS,
        }
    }
}

/// One output row.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantRow {
    pub variant: Variant,
    pub annotation: Option<Annotation>,
    /// 0-based first codon and length of the window; tokens of REF and ALT.
    pub window: Option<(usize, usize, usize, usize)>,
    pub delta: Option<Delta>,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantSummary {
    pub variants: usize,
    pub scored: usize,
    pub skipped: usize,
    /// The window asked for (or the model's), in codons.
    pub window: usize,
    /// The shortest and longest windows scored (clipped at the CDS ends, stretched to hold a
    /// long change); `None` when nothing was scored.
    pub used: Option<(usize, usize)>,
    /// Whether the heatmap was drawn (none is when no variant of the region was scored).
    pub heatmap_drawn: bool,
    pub elapsed: Duration,
}

/// `START..END` (1-based, inclusive) as a pair; `what` names the flag in errors.
pub fn parse_range(s: &str, what: &str) -> Result<(u64, u64)> {
    let bad = || {
        Error::Invalid(format!(
            "{what} '{s}': expected START..END, 1-based and inclusive (e.g. 21563..25384)"
        ))
    };
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let (a, b): (u64, u64) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if a == 0 {
        return Err(Error::Invalid(format!(
            "{what} '{s}': positions count from 1 (1-based, inclusive)"
        )));
    }
    if b < a {
        return Err(Error::Invalid(format!(
            "{what} '{s}': START {a} is past END {b}; give START..END, 1-based and inclusive \
             (a CDS on the reverse strand is given by its reverse-complemented record)"
        )));
    }
    Ok((a, b))
}

/// The sequences read, by record id, and the ids of every record in the input (for messages).
type Records = (HashMap<String, Vec<u8>>, Vec<String>);

/// Reads the records named in `wanted` (all when `None`) from `inputs`.
fn read_records(inputs: &[PathBuf], wanted: Option<&HashSet<String>>) -> Result<Records> {
    let mut out = HashMap::new();
    let mut names = Vec::new();
    // Where each record read was found: a second record of the same id would otherwise replace
    // the first, and variants would be scored against whichever came last.
    let mut found: HashMap<String, PathBuf> = HashMap::new();
    for f in fasta::discover(inputs)? {
        let mut warn = |w: String| eprintln!("warning: {w}");
        fasta::read_file(&f, OnInvalid::Error, &mut warn, &mut |rec, _| {
            names.push(rec.id.to_string());
            if wanted.is_none_or(|w| w.contains(rec.id)) {
                if let Some(first) = found.insert(rec.id.to_string(), f.clone()) {
                    return Err(Error::Invalid(format!(
                        "{}: record id '{}' appears twice (first in {}): a variant's CHROM must \
                         name one record; rename or remove one of them",
                        f.display(),
                        rec.id,
                        first.display()
                    )));
                }
                out.insert(rec.id.to_string(), rec.seq.to_vec());
            }
            Ok(())
        })?;
    }
    Ok((out, names))
}

/// Why the rows without a Δ have none, one line per reason present: outside the CDS, in its
/// incomplete last codon, or a window of fewer than 2 codons (a deletion that leaves nothing
/// to predict, which a small --window makes likely: not the CDS's doing).
fn unscored_notes(rows: &[VariantRow]) -> Vec<String> {
    let (mut outside, mut incomplete, mut short) = (0, 0, 0);
    for r in rows.iter().filter(|r| r.delta.is_none()) {
        match &r.annotation {
            None => outside += 1,
            Some(a) if a.consequence == Consequence::Incomplete => incomplete += 1,
            Some(_) => short += 1,
        }
    }
    let mut notes = Vec::new();
    if outside > 0 {
        notes.push(format!(
            "{outside} variant(s) outside the CDS: annotated {}, not scored",
            Consequence::OutsideCds.name()
        ));
    }
    if incomplete > 0 {
        notes.push(format!(
            "{incomplete} variant(s) in the CDS's incomplete last codon: annotated {}, not scored",
            Consequence::Incomplete.name()
        ));
    }
    if short > 0 {
        notes.push(format!(
            "{short} variant(s) not scored: REF's or ALT's window holds fewer than 2 codons \
             (a deletion as long as the window, or a CDS that short); a larger --window \
             scores those the CDS leaves 2 codons or more"
        ));
    }
    notes
}

/// Tokens of REF and ALT windows held at once while scoring (4 bytes each): 64 MiB.
pub const CHUNK_TOKENS: usize = 1 << 24;

/// Scores the variants of `opts.source` on the records of `inputs`, writing TSV to `out`
/// (and the heatmap when asked).
pub fn run_variants(
    model_dir: &Path,
    inputs: &[PathBuf],
    opts: &VariantOptions,
    out: &Path,
) -> Result<VariantSummary> {
    let t0 = Instant::now();
    if opts.batch_size == 0 {
        return Err(Error::Invalid("--batch-size 0: must be at least 1".into()));
    }
    // Before any work, and before --out is written.
    if opts.heatmap.is_some() && !matches!(opts.source, VariantSource::Saturate { .. }) {
        return Err(Error::Invalid(
            "--heatmap draws --saturate's variants".into(),
        ));
    }
    let model =
        load_model_dir(model_dir, &opts.compute.open()?)?.with_precision(opts.compute.precision);
    if let Some(w) = opts.window.filter(|&w| w < 2) {
        return Err(Error::Invalid(format!(
            "--window {w}: must be at least 2 codons"
        )));
    }
    let w = resolve_window(&model, opts.window, model_dir, "--window")?;
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    let mut skipped = 0usize;
    // Lines skipped under --on-invalid skip, said in line order once all are known.
    let mut skips: Vec<(usize, String)> = Vec::new();
    let warn_skip = |msg: String| eprintln!("warning: {msg}; skipped (--on-invalid skip)");
    let (variants, records, names) = match &opts.source {
        VariantSource::Vcf(path) => {
            let (variants, bad) = vcf::read_vcf(path, opts.skip_invalid, opts.chrom.as_deref())?;
            for b in &bad {
                skips.push((
                    b.line,
                    format!("{}: line {}: {}", path.display(), b.line, b.msg),
                ));
            }
            skipped += bad.len();
            let mut wanted: HashSet<String> = variants.iter().map(|v| v.chrom.clone()).collect();
            if let Some(c) = &opts.chrom {
                wanted.retain(|x| x == c);
            }
            let (records, names) = read_records(inputs, Some(&wanted))?;
            (variants, records, names)
        }
        VariantSource::Saturate { start, end } => {
            let (records, names) = match &opts.chrom {
                Some(c) => read_records(inputs, Some(&HashSet::from([c.clone()])))?,
                None => read_records(inputs, None)?,
            };
            let chrom = match &opts.chrom {
                Some(c) => c.clone(),
                None if names.len() == 1 => names[0].clone(),
                None => {
                    return Err(Error::Invalid(format!(
                        "--saturate: the FASTA input has {} records; name one with --chrom",
                        names.len()
                    )))
                }
            };
            let seq = records.get(&chrom).ok_or_else(|| {
                Error::Invalid(format!(
                    "--chrom '{chrom}' is not a record of the FASTA input"
                ))
            })?;
            if *end as usize > seq.len() {
                return Err(Error::Invalid(format!(
                    "--saturate {start}..{end}: record '{chrom}' has {} bases",
                    seq.len()
                )));
            }
            let mut v = Vec::new();
            for pos in *start..=*end {
                let r = seq[(pos - 1) as usize];
                for alt in [b'A', b'C', b'G', b'T'].into_iter().filter(|&b| b != r) {
                    v.push(Variant {
                        line: 0,
                        chrom: chrom.clone(),
                        pos,
                        id: ".".into(),
                        reference: (r as char).to_string(),
                        alt: (alt as char).to_string(),
                    });
                }
            }
            (v, records, names)
        }
    };
    // A --chrom that names no record: said as such ("no variant lines on CHROM" blamed the
    // VCF).
    if let Some(c) = opts.chrom.as_ref().filter(|c| !names.contains(c)) {
        return Err(Error::Invalid(format!(
            "--chrom '{c}' is not a record of the FASTA input (records: {})",
            crate::error::first_five(&names)
        )));
    }
    if let Some((_, e)) = opts.cds {
        for (id, s) in &records {
            if e as usize > s.len() {
                let (b, _) = opts.cds.unwrap_or_default();
                return Err(Error::Invalid(format!(
                    "--cds {b}..{e}: record '{id}' has only {} bases",
                    s.len()
                )));
            }
        }
    }
    let mut rows = Vec::with_capacity(variants.len());
    // Placed once to check every variant and learn its window's length, before any model
    // work; the windows' tokens are built again a chunk at a time when scored (holding them
    // all took 8 bytes × window per variant: 2.5 GB for --saturate over 48 kb at W 2048).
    let mut scored = Vec::new();
    let (mut longest, mut longest_at) = (0usize, String::new());
    let placed_on = |v: &Variant| match records.get(&v.chrom) {
        None => Err(format!(
            "CHROM '{}' is not a record of the FASTA input (records: {})",
            v.chrom,
            names.join(", ")
        )),
        Some(seq) => {
            let cds = opts.cds.unwrap_or((1, seq.len() as u64));
            place(v, seq, cds, w, &tok, &model)
        }
    };
    for v in variants {
        if opts.chrom.as_ref().is_some_and(|c| *c != v.chrom) {
            continue;
        }
        let at = if v.line > 0 {
            match &opts.source {
                VariantSource::Vcf(p) => format!("{}: line {}: ", p.display(), v.line),
                _ => String::new(),
            }
        } else {
            String::new()
        };
        match placed_on(&v) {
            Ok((annotation, job)) => {
                let window = job
                    .as_ref()
                    .map(|j| (j.start, j.reference.len(), j.reference.len(), j.alt.len()));
                if let Some(j) = job {
                    scored.push(rows.len());
                    let len = j.reference.len().max(j.alt.len());
                    if len > longest {
                        (longest, longest_at) = (len, at.clone());
                    }
                }
                rows.push(VariantRow {
                    variant: v,
                    annotation,
                    window,
                    delta: None,
                });
            }
            Err(msg) if opts.skip_invalid => {
                skips.push((v.line, format!("{at}{msg}")));
                skipped += 1;
            }
            Err(msg) => return Err(Error::Invalid(format!("{at}{msg}"))),
        }
    }
    // In the VCF's line order: lines that do not parse were said before those that do not
    // place (line 5 before lines 3 and 4).
    skips.sort_by_key(|&(line, _)| line);
    for (_, msg) in skips {
        warn_skip(msg);
    }
    if rows.is_empty() {
        return Err(Error::Invalid(match &opts.source {
            VariantSource::Vcf(path) => format!(
                "{}: no variants to score (no variant lines{}{})",
                path.display(),
                opts.chrom
                    .as_ref()
                    .map_or(String::new(), |c| format!(" on CHROM '{c}'")),
                if skipped > 0 {
                    ", or every one skipped"
                } else {
                    ""
                }
            ),
            VariantSource::Saturate { .. } => "no variants to score".into(),
        }));
    }
    // A long insertion stretches its window past the one asked for; past the trained
    // positions too, its score is an extrapolation (resolve_window says so for --window).
    let trained = crate::infer::window::training_length(&model, model_dir);
    if longest > w.max(trained) {
        eprintln!(
            "warning: {longest_at}a window stretched to {longest} codons to hold its whole \
             change, past the model's training length ({trained}: its max_position_embeddings \
             or the window it trained at): positions beyond it were never trained, so such \
             scores are extrapolations"
        );
    }
    // The windows as they are (clipped at the CDS ends), not as asked.
    check_forward_memory(
        &model,
        opts.batch_size.min(scored.len()).max(1),
        longest.max(1),
        "--window",
    )?;
    // Chunks of consecutive variants, so that those sharing a window (the 9 substitutions of
    // a codon, sorted VCF lines) still share its prefix; about `chunk_tokens` tokens held.
    let mut next = 0;
    while next < scored.len() {
        let mut chunk = Vec::new();
        let mut tokens = 0usize;
        while next < scored.len() && (chunk.is_empty() || tokens < opts.chunk_tokens) {
            let Ok((_, Some(job))) = placed_on(&rows[scored[next]].variant) else {
                return Err(Error::Invalid(format!(
                    "internal: variant {} was placed once and not again",
                    scored[next]
                )));
            };
            tokens += job.reference.len() + job.alt.len();
            chunk.push(job);
            next += 1;
        }
        let deltas = if opts.prefix_reuse {
            delta::prefix_reuse(&model, &chunk, opts.batch_size)?
        } else {
            delta::full_recomputation(&model, &chunk)?
        };
        let first = next - chunk.len();
        for (i, d) in scored[first..next].iter().zip(deltas) {
            rows[*i].delta = Some(d);
        }
    }
    if out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
    {
        output::write_parquet(out, &rows)?;
    } else {
        output::write_tsv(out, &rows)?;
    }
    if let Some(png) = &opts.heatmap {
        let VariantSource::Saturate { start, end } = opts.source else {
            return Err(Error::Invalid(
                "--heatmap draws --saturate's variants".into(),
            ));
        };
        let seq = &records[&rows[0].variant.chrom];
        let cds_start = opts.cds.map_or(1, |c| c.0);
        // The model by its directory's name: a whole path pushed the title off the picture.
        let model = model_dir.file_name().unwrap_or(model_dir.as_os_str());
        if scored.is_empty() {
            // A blank map with a ±0 colour bar said nothing; the notes below say why. A file
            // already there is not this run's picture: say so, rather than leave it to be
            // read as one.
            let kept = if png.exists() {
                " (the file already there is left as it was)"
            } else {
                ""
            };
            eprintln!(
                "warning: --heatmap {}: not drawn, none of the region's variants was \
                 scored{kept}",
                png.display()
            );
        } else {
            heatmap::draw(
                png,
                &rows,
                seq,
                (start, end),
                cds_start,
                &model.to_string_lossy(),
            )?;
        }
    }
    for note in unscored_notes(&rows) {
        eprintln!("note: {note}");
    }
    Ok(VariantSummary {
        variants: rows.len(),
        scored: scored.len(),
        skipped,
        window: w,
        used: rows
            .iter()
            .filter_map(|r| r.window.map(|(_, len, _, _)| len))
            .fold(None, |acc, len| match acc {
                None => Some((len, len)),
                Some((lo, hi)) => Some((lo.min(len), hi.max(len))),
            }),
        heatmap_drawn: opts.heatmap.is_some() && !scored.is_empty(),
        elapsed: t0.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::Config;
    use crate::model::GenSlm;
    use crate::tokenizer::VocabKind;

    /// A variant on record `g` (line 1), for these tests and `place`'s.
    pub(super) fn variant(pos: u64, r: &str, a: &str) -> Variant {
        Variant {
            line: 1,
            chrom: "g".into(),
            pos,
            id: ".".into(),
            reference: r.into(),
            alt: a.into(),
        }
    }

    /// With genslm71, a window at the record's first base starts with [BOS], as the model saw
    /// records in training, so the start codon is predicted (from [BOS]) and scored; a window
    /// elsewhere, or genslm69, has none. Prefix reuse still equals full recomputation.
    #[test]
    fn a_window_at_the_record_start_begins_with_bos_where_the_vocabulary_has_one() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let seq = b"ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCTAA";
        for kind in [VocabKind::Genslm69, VocabKind::Genslm71] {
            let mut cfg = Config::load(&path).unwrap().model;
            cfg.vocab = kind;
            cfg.vocab_size = 71;
            let model = GenSlm::init(cfg, 2, &Device::flex()).unwrap();
            let tok = CodonTokenizer::new(kind).unwrap();
            let n = seq.len() as u64;
            let (_, start) = place(&variant(2, "T", "C"), seq, (1, n), 8, &tok, &model).unwrap();
            let (_, inner) = place(&variant(5, "C", "G"), seq, (4, n), 8, &tok, &model).unwrap();
            let (start, inner) = (start.unwrap(), inner.unwrap());
            let bos = kind == VocabKind::Genslm71;
            assert_eq!(start.reference.len(), 8 + usize::from(bos));
            assert_eq!(start.reference[0] == tok.bos_id().unwrap_or(u32::MAX), bos);
            assert_eq!(
                (start.first, start.codons.clone()),
                (usize::from(bos), vec![usize::from(bos)])
            );
            assert_eq!(
                (inner.reference.len(), inner.first),
                (8, 0),
                "--cds past base 1: no [BOS]"
            );
            let jobs = [start, inner];
            let full = delta::full_recomputation(&model, &jobs).unwrap();
            let fast = delta::prefix_reuse(&model, &jobs, 4).unwrap();
            for (f, p) in full.iter().zip(&fast) {
                assert!((f.total - p.total).abs() < 1e-4);
            }
            // The start codon's own Δ exists only where [BOS] predicts it.
            assert_eq!(full[0].codons[0].is_finite(), bos);
        }
    }
}
