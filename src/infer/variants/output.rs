//! The `variants` table: TSV, one row per variant allele, written atomically.
//!
//! Columns: `chrom pos id ref alt` (as in the VCF), `consequence` (synonymous, missense,
//! nonsense, stop_lost, start_lost, frameshift, inframe_insertion, inframe_deletion,
//! incomplete_codon, outside_cds), `aa_change` (e.g. N501Y; 1-based codon numbers in the CDS),
//! `codon` (1-based CDS codon where the sequences first differ), `ref_codons` / `alt_codons`
//! (the codons a substitution touches; an indel's first REF codon), `window_start` (1-based
//! CDS codon of the window's first), `ref_tokens` / `alt_tokens` (window lengths in codons),
//! `delta_ll` (Σ log p(ALT) − Σ log p(REF) over the windows, nats), `delta_ll_codon` (the sum of
//! the per-codon Δ at the variant's codons) and `codon_deltas` (those per-codon Δ,
//! comma-separated). `NA` where a value does not exist (an unscored variant; the window's first
//! codon, which is never predicted).

use std::fmt::Write as _;
use std::path::Path;

use super::annotate::Consequence;
use super::VariantRow;
use crate::error::Result;

pub const HEADER: &str = "chrom\tpos\tid\tref\talt\tconsequence\taa_change\tcodon\tref_codons\t\
    alt_codons\twindow_start\tref_tokens\talt_tokens\tdelta_ll\tdelta_ll_codon\tcodon_deltas";

fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        "NA".into()
    }
}

fn or_na(s: &str) -> &str {
    if s.is_empty() {
        "NA"
    } else {
        s
    }
}

/// One row's text (no newline).
pub fn row(r: &VariantRow) -> String {
    let v = &r.variant;
    let mut s = format!(
        "{}\t{}\t{}\t{}\t{}\t",
        v.chrom, v.pos, v.id, v.reference, v.alt
    );
    match &r.annotation {
        Some(a) => {
            let _ = write!(
                s,
                "{}\t{}\t{}\t{}\t{}",
                a.consequence.name(),
                or_na(&a.aa_change),
                a.codons.start + 1,
                or_na(&a.ref_codons),
                or_na(&a.alt_codons)
            );
        }
        None => {
            let _ = write!(s, "{}\tNA\tNA\tNA\tNA", Consequence::OutsideCds.name());
        }
    }
    match (&r.window, &r.delta) {
        (Some((start, _, rt, at)), Some(d)) => {
            let codon_sum: f64 = d.codons.iter().filter(|x| x.is_finite()).sum();
            let any = d.codons.iter().any(|x| x.is_finite());
            let _ = write!(
                s,
                "\t{}\t{rt}\t{at}\t{}\t{}\t{}",
                start + 1,
                num(d.total),
                if any { num(codon_sum) } else { "NA".into() },
                d.codons
                    .iter()
                    .map(|&x| num(x))
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        _ => s.push_str("\tNA\tNA\tNA\tNA\tNA\tNA"),
    }
    s
}

pub fn write_tsv(path: &Path, rows: &[VariantRow]) -> Result<()> {
    let mut text = String::with_capacity(rows.len() * 160 + HEADER.len() + 1);
    text.push_str(HEADER);
    text.push('\n');
    for r in rows {
        text.push_str(&row(r));
        text.push('\n');
    }
    crate::atomic::write_bytes(path, text.as_bytes())
}
