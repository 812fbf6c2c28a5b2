//! The `variants` table: TSV (or parquet), one row per variant allele, written atomically.
//!
//! Columns: `chrom pos id ref alt` (as in the VCF), `consequence` (synonymous, missense,
//! nonsense, stop_lost, stop_retained, start_lost, frameshift, inframe_insertion, inframe_deletion,
//! incomplete_codon, outside_cds), `aa_change` (e.g. N501Y, Y144del, E484Kfs*12; 1-based codon
//! numbers in the CDS; indels as HGVS names them), `codon` (1-based CDS codon where the
//! sequences first differ), `ref_codons` / `alt_codons` (the codons the change touches in REF
//! and the same stretch of ALT; a frameshift's first codon), `window_start` (1-based
//! CDS codon of the window's first), `ref_tokens` / `alt_tokens` (window lengths in tokens: codons, at a record's end its
//! partial codon's `[UNK]` and genslm71's `[EOS]`,
//! and a genslm71 `[BOS]` when the window starts at the record's first base),
//! `delta_ll` (Σ log p(ALT) − Σ log p(REF) over the windows, nats), `delta_ll_codon` (the sum of
//! the per-codon Δ at the variant's codons), `codon_deltas` (those per-codon Δ,
//! comma-separated) and `delta_mean_ll` (mean log p per predicted codon, ALT's minus REF's: the
//! figure to compare indels by, since their windows predict different numbers of codons). `NA` where a value does not exist (an unscored variant; the window's first
//! codon, which is never predicted).

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

/// One cell of the table, typed: the TSV writes its text, parquet its value.
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Text(String),
    Int(Option<i64>),
    Float(Option<f64>),
    /// `codon_deltas`: per-codon Δ (a codon never predicted is NA inside the list).
    Floats(Option<Vec<f64>>),
}

impl Cell {
    fn float(x: f64) -> Cell {
        Cell::Float(x.is_finite().then_some(x))
    }

    fn text(&self) -> String {
        match self {
            Cell::Text(t) => or_na(t).to_string(),
            Cell::Int(i) => i.map_or("NA".into(), |i| i.to_string()),
            Cell::Float(x) => x.map_or("NA".into(), num),
            Cell::Floats(None) => "NA".into(),
            Cell::Floats(Some(v)) => v.iter().map(|&x| num(x)).collect::<Vec<_>>().join(","),
        }
    }
}

/// One row's cells, in [`HEADER`]'s order.
fn cells(r: &VariantRow) -> Vec<Cell> {
    let v = &r.variant;
    let text = |s: &str| Cell::Text(s.to_string());
    let mut c = vec![
        text(&v.chrom),
        Cell::Int(Some(v.pos as i64)),
        text(&v.id),
        text(&v.reference),
        text(&v.alt),
    ];
    match &r.annotation {
        Some(a) => c.extend([
            text(a.consequence.name()),
            text(&a.aa_change),
            Cell::Int(Some(a.codons.start as i64 + 1)),
            text(&a.ref_codons),
            text(&a.alt_codons),
        ]),
        None => c.extend([
            text(Consequence::OutsideCds.name()),
            text(""),
            Cell::Int(None),
            text(""),
            text(""),
        ]),
    }
    match (&r.window, &r.delta) {
        (Some((start, _, rt, at)), Some(d)) => {
            let any = d.codons.iter().any(|x| x.is_finite());
            let codon_sum: f64 = d.codons.iter().filter(|x| x.is_finite()).sum();
            c.extend([
                Cell::Int(Some(*start as i64 + 1)),
                Cell::Int(Some(*rt as i64)),
                Cell::Int(Some(*at as i64)),
                Cell::float(d.total),
                Cell::Float(any.then_some(codon_sum)),
                Cell::Floats(Some(d.codons.clone())),
                Cell::float(d.mean),
            ]);
        }
        _ => c.extend([
            Cell::Int(None),
            Cell::Int(None),
            Cell::Int(None),
            Cell::Float(None),
            Cell::Float(None),
            Cell::Floats(None),
            Cell::Float(None),
        ]),
    }
    c
}

/// One row's text (no newline).
pub fn row(r: &VariantRow) -> String {
    cells(r)
        .iter()
        .map(Cell::text)
        .collect::<Vec<_>>()
        .join("\t")
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
/// where the TSV says `NA`; the computed f64 values, where the TSV prints six decimals),
/// `codon_deltas` a list of float64.
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
    // The TSV's cells, typed: the two formats hold the same table, parquet the exact f64s
    // where the TSV prints six decimals.
    let table: Vec<Vec<Cell>> = rows.iter().map(cells).collect();
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(names.len());
    for (c, &n) in names.iter().enumerate() {
        let col = table.iter().map(|t| &t[c]);
        columns.push(if ints.contains(&n) {
            let mut b = Int64Builder::new();
            col.for_each(|x| b.append_option(if let Cell::Int(i) = x { *i } else { None }));
            Arc::new(b.finish())
        } else if floats.contains(&n) {
            let mut b = Float64Builder::new();
            col.for_each(|x| b.append_option(if let Cell::Float(f) = x { *f } else { None }));
            Arc::new(b.finish())
        } else if n == "codon_deltas" {
            let mut b = ListBuilder::new(Float64Builder::new());
            for x in col {
                match x {
                    Cell::Floats(Some(v)) => {
                        for &d in v {
                            b.values().append_option(d.is_finite().then_some(d));
                        }
                        b.append(true);
                    }
                    _ => b.append(false),
                }
            }
            Arc::new(b.finish())
        } else {
            let mut b = StringBuilder::new();
            for x in col {
                match x {
                    Cell::Text(t) if !t.is_empty() => b.append_value(t),
                    _ => b.append_null(),
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
