//! The `variants` table: TSV (or parquet), one row per variant allele, written atomically.
//!
//! Columns: `chrom pos id ref alt` (as in the VCF), `consequence` (synonymous, missense,
//! nonsense, stop_lost, start_lost, frameshift, inframe_insertion, inframe_deletion,
//! incomplete_codon, outside_cds), `aa_change` (e.g. N501Y; 1-based codon numbers in the CDS),
//! `codon` (1-based CDS codon where the sequences first differ), `ref_codons` / `alt_codons`
//! (the codons a substitution touches; an indel's first REF codon), `window_start` (1-based
//! CDS codon of the window's first), `ref_tokens` / `alt_tokens` (window lengths in tokens: codons,
//! and a genslm71 `[BOS]` when the window starts at the record's first base),
//! `delta_ll` (Σ log p(ALT) − Σ log p(REF) over the windows, nats), `delta_ll_codon` (the sum of
//! the per-codon Δ at the variant's codons), `codon_deltas` (those per-codon Δ,
//! comma-separated) and `delta_mean_ll` (mean log p per predicted codon, ALT's minus REF's: the
//! figure to compare indels by, since their windows predict different numbers of codons). `NA` where a value does not exist (an unscored variant; the window's first
//! codon, which is never predicted).

use std::fmt::Write as _;
use std::path::Path;

use super::annotate::Consequence;
use super::VariantRow;
use crate::error::Result;

pub const HEADER: &str = "chrom\tpos\tid\tref\talt\tconsequence\taa_change\tcodon\tref_codons\t\
    alt_codons\twindow_start\tref_tokens\talt_tokens\tdelta_ll\tdelta_ll_codon\tcodon_deltas\t\
    delta_mean_ll";

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
                "\t{}\t{rt}\t{at}\t{}\t{}\t{}\t{}",
                start + 1,
                num(d.total),
                if any { num(codon_sum) } else { "NA".into() },
                d.codons
                    .iter()
                    .map(|&x| num(x))
                    .collect::<Vec<_>>()
                    .join(","),
                num(d.mean)
            );
        }
        _ => s.push_str("\tNA\tNA\tNA\tNA\tNA\tNA\tNA"),
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

/// The same table as parquet (for `--out *.parquet`): strings for the text columns, int64 for
/// `pos`, `codon`, `window_start`, `ref_tokens`, `alt_tokens`, float64 for the Δ columns (null
/// where the TSV says `NA`), `codon_deltas` a list of float64.
pub fn write_parquet(path: &Path, rows: &[VariantRow]) -> Result<()> {
    use std::sync::Arc;

    use arrow_array::builder::{Float64Builder, Int64Builder, ListBuilder, StringBuilder};
    use arrow_array::{ArrayRef, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};

    let names: Vec<&str> = HEADER.split('\t').collect();
    let ints = ["pos", "codon", "window_start", "ref_tokens", "alt_tokens"];
    let floats = ["delta_ll", "delta_ll_codon", "delta_mean_ll"];
    let fields: Vec<Field> = names
        .iter()
        .map(|&n| {
            let t = if ints.contains(&n) {
                DataType::Int64
            } else if floats.contains(&n) {
                DataType::Float64
            } else if n == "codon_deltas" {
                DataType::List(Arc::new(Field::new("item", DataType::Float64, true)))
            } else {
                DataType::Utf8
            };
            Field::new(n, t, true)
        })
        .collect();
    let schema = Arc::new(Schema::new(fields));
    // Each column from the TSV row's text, so the two formats cannot disagree.
    let texts: Vec<Vec<String>> = rows
        .iter()
        .map(|r| row(r).split('\t').map(str::to_string).collect())
        .collect();
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(names.len());
    for (c, &n) in names.iter().enumerate() {
        let cell = |t: &Vec<String>| t[c].clone();
        columns.push(if ints.contains(&n) {
            let mut b = Int64Builder::new();
            for t in &texts {
                b.append_option(cell(t).parse::<i64>().ok());
            }
            Arc::new(b.finish())
        } else if floats.contains(&n) {
            let mut b = Float64Builder::new();
            for t in &texts {
                b.append_option(cell(t).parse::<f64>().ok());
            }
            Arc::new(b.finish())
        } else if n == "codon_deltas" {
            let mut b = ListBuilder::new(Float64Builder::new());
            for t in &texts {
                let v = cell(t);
                if v == "NA" && t[names.iter().position(|&x| x == "delta_ll").unwrap_or(0)] == "NA"
                {
                    b.append(false);
                    continue;
                }
                for x in v.split(',') {
                    b.values().append_option(x.parse::<f64>().ok());
                }
                b.append(true);
            }
            Arc::new(b.finish())
        } else {
            let mut b = StringBuilder::new();
            for t in &texts {
                let v = cell(t);
                if v == "NA" {
                    b.append_null();
                } else {
                    b.append_value(v);
                }
            }
            Arc::new(b.finish())
        });
    }
    let err = |e: String| crate::error::Error::Dataset {
        path: path.to_path_buf(),
        msg: e,
    };
    let batch = RecordBatch::try_new(schema.clone(), columns).map_err(|e| err(e.to_string()))?;
    let (guard, file) = crate::atomic::AtomicFile::create(path)?;
    let handle = file
        .try_clone()
        .map_err(|e| crate::error::Error::io(guard.tmp_path(), e))?;
    let mut w = parquet::arrow::ArrowWriter::try_new(handle, schema, None)
        .map_err(|e| err(e.to_string()))?;
    w.write(&batch).map_err(|e| err(e.to_string()))?;
    w.close().map_err(|e| err(e.to_string()))?;
    guard.commit(file)
}
