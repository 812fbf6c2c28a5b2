//! Embedding files: parquet with one row per record.
//!
//! Columns: `id`, `description`, `source`, the digest (`md5`, or the input dataset's `xxh3`) (strings), `length` (bases, int64),
//! `gc_content` (float64), `n_tokens` (the record's tokens, int64), `layer` (the hidden-state index
//! used, int32: 0 = embeddings, `num_layers` = after the final LayerNorm) and `embedding`
//! (fixed-size list of float32, the model's hidden size). Key-value metadata records the model,
//! pooling and window (`genslm.*`).
//!
//! Rows are written in batches and the file appears under its name only when complete.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{
    FixedSizeListBuilder, Float32Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::data::digest::DigestKind;
use crate::error::{Error, Result};
use crate::infer::parquet_sink::ParquetSink;

/// Rows per batch handed to the parquet writer.
const BATCH_ROWS: usize = 256;
/// Row-group size in bytes after encoding.
const ROW_GROUP_BYTES: usize = 32 << 20;

/// One output row.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingRow<'a> {
    pub id: &'a str,
    pub description: &'a str,
    pub source: &'a str,
    /// Hex digest of the record's bases, of the writer's kind.
    pub digest: &'a str,
    pub length: u64,
    pub gc_content: f64,
    pub n_tokens: u64,
    pub layer: i32,
    pub embedding: &'a [f32],
}

/// The columns of an embeddings file of `dim`-wide vectors whose digest column is `digest`'s.
pub fn schema(dim: usize, digest: DigestKind) -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("description", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, false),
        Field::new(digest.column(), DataType::Utf8, false),
        Field::new("length", DataType::Int64, false),
        Field::new("gc_content", DataType::Float64, false),
        Field::new("n_tokens", DataType::Int64, false),
        Field::new("layer", DataType::Int32, false),
        Field::new(
            "embedding",
            DataType::FixedSizeList(
                Arc::new(Field::new("item", DataType::Float32, false)),
                dim as i32,
            ),
            false,
        ),
    ]))
}

/// Streams embedding rows into a parquet file that appears only after [`finish`].
///
/// [`finish`]: EmbeddingWriter::finish
pub struct EmbeddingWriter {
    sink: ParquetSink,
    dim: usize,
    strings: [StringBuilder; 4],
    length: Int64Builder,
    gc: Float64Builder,
    n_tokens: Int64Builder,
    layer: Int32Builder,
    embedding: FixedSizeListBuilder<Float32Builder>,
    rows: usize,
    total: u64,
}

impl EmbeddingWriter {
    /// `metadata`: extra key-value pairs stored in the file footer.
    pub fn create(
        path: &Path,
        dim: usize,
        digest: DigestKind,
        metadata: Vec<(String, String)>,
    ) -> Result<Self> {
        let sink = ParquetSink::create(path, schema(dim, digest), metadata, ROW_GROUP_BYTES)?;
        let item = Arc::new(Field::new("item", DataType::Float32, false));
        Ok(Self {
            sink,
            dim,
            strings: Default::default(),
            length: Int64Builder::new(),
            gc: Float64Builder::new(),
            n_tokens: Int64Builder::new(),
            layer: Int32Builder::new(),
            embedding: FixedSizeListBuilder::new(Float32Builder::new(), dim as i32)
                .with_field(item),
            rows: 0,
            total: 0,
        })
    }

    pub fn push(&mut self, row: &EmbeddingRow<'_>) -> Result<()> {
        if row.embedding.len() != self.dim {
            return Err(self.err(format!(
                "record '{}': embedding has {} values, the file holds {}",
                row.id,
                row.embedding.len(),
                self.dim
            )));
        }
        for (b, v) in self
            .strings
            .iter_mut()
            .zip([row.id, row.description, row.source, row.digest])
        {
            b.append_value(v);
        }
        self.length.append_value(row.length as i64);
        self.gc.append_value(row.gc_content);
        self.n_tokens.append_value(row.n_tokens as i64);
        self.layer.append_value(row.layer);
        self.embedding.values().append_slice(row.embedding);
        self.embedding.append(true);
        self.rows += 1;
        self.total += 1;
        if self.rows >= BATCH_ROWS {
            self.write_batch()?;
        }
        Ok(())
    }

    fn write_batch(&mut self) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(9);
        for b in &mut self.strings {
            columns.push(Arc::new(b.finish()));
        }
        columns.push(Arc::new(self.length.finish()));
        columns.push(Arc::new(self.gc.finish()));
        columns.push(Arc::new(self.n_tokens.finish()));
        columns.push(Arc::new(self.layer.finish()));
        columns.push(Arc::new(self.embedding.finish()));
        // Schema order: id, description, source, digest, length, gc_content, n_tokens, layer, embedding.
        self.sink.write(columns)?;
        self.rows = 0;
        Ok(())
    }

    fn err(&self, msg: String) -> Error {
        self.sink.err(msg)
    }

    pub fn rows(&self) -> u64 {
        self.total
    }

    /// Writes the footer, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        self.write_batch()?;
        self.sink.finish()
    }
}

/// A column's values for colouring a plot.
#[derive(Debug, Clone, PartialEq)]
pub enum ColumnValues {
    Numeric(Vec<f64>),
    Categorical(Vec<Option<String>>),
}

/// Embeddings read back for plotting: `n × dim` row-major values and one column.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingTable {
    pub n: usize,
    pub dim: usize,
    pub values: Vec<f32>,
    pub color: ColumnValues,
    /// The `layer` column of the first row, when present.
    pub layer: Option<i32>,
}

fn numeric(a: &dyn Array) -> Option<Vec<f64>> {
    macro_rules! prim {
        ($($t:ty),*) => {
            match a.data_type() {
                $(d if d == &<$t as arrow_array::types::ArrowPrimitiveType>::DATA_TYPE => Some(
                    a.as_primitive::<$t>().iter().map(|v| v.map_or(f64::NAN, |x| x as f64)).collect(),
                ),)*
                _ => None,
            }
        };
    }
    prim!(
        Float64Type,
        Float32Type,
        Int64Type,
        Int32Type,
        Int16Type,
        Int8Type,
        UInt64Type,
        UInt32Type,
        UInt16Type,
        UInt8Type
    )
}

/// A text column's values, `None` where null (drawn grey, as README says: they were an empty
/// category with a colour of its own).
fn strings(a: &dyn Array) -> Option<Vec<Option<String>>> {
    let own = |v: Option<&str>| v.map(str::to_string);
    match a.data_type() {
        DataType::Utf8 => Some(a.as_string::<i32>().iter().map(own).collect()),
        DataType::LargeUtf8 => Some(a.as_string::<i64>().iter().map(own).collect()),
        // What polars and newer pyarrow write for strings.
        DataType::Utf8View => Some(a.as_string_view().iter().map(own).collect()),
        _ => None,
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Reads the `embedding` column and the column `color` of an embeddings file.
pub fn read_embeddings(path: &Path, color: &str) -> Result<EmbeddingTable> {
    let derr = |msg: String| Error::Dataset {
        path: path.to_path_buf(),
        msg,
    };
    let builder = crate::data::parquet_open::open_parquet(path)?;
    let names: Vec<String> = builder
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    for want in ["embedding", color] {
        if !names.iter().any(|n| n == want) {
            return Err(derr(format!(
                "no column `{want}` (columns: {}){}",
                crate::error::list_some(&names, 20),
                // `--pool none` writes one row per codon (its `context` column says so), with
                // none of a record's columns to colour by.
                if names.iter().any(|n| n == "context") {
                    "; this is a per-codon file (`embed --pool none`): plot a pooled one \
                     (`--pool mean` or `last`)"
                } else if want == "embedding" {
                    "; is this a file written by `genslm embed`?"
                } else {
                    ""
                }
            )));
        }
    }
    let dim = match builder
        .schema()
        .field_with_name("embedding")
        .map(|f| f.data_type().clone())
    {
        Ok(DataType::FixedSizeList(item, d)) if item.data_type() == &DataType::Float32 => {
            d as usize
        }
        Ok(other) => {
            return Err(derr(format!(
                "column `embedding` is {other}, expected a fixed-size list of float32"
            )))
        }
        Err(e) => return Err(derr(e.to_string())),
    };
    // What the projection holds: the vectors as f32 and centred as f64, a colour per row (a
    // string: its text and its allocation), and one batch being decoded (twice, as parquet's
    // pages and arrow's array; batches are at most ~64 MB, below). A 4 KB file of 8 zero vectors of 2^26 dims asked for 16 GB and
    // aborted. Rows counted by row group, as the reader counts them (the footer's own total
    // can say 1 where the groups hold 8).
    let meta = builder.metadata();
    let rows: f64 = meta
        .row_groups()
        .iter()
        .map(|g| g.num_rows().max(0) as f64)
        .sum();
    let per_row = match builder
        .schema()
        .field_with_name(color)
        .map(|f| f.data_type())
    {
        Ok(DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View) => 96.0,
        _ => 16.0,
    };
    let batch_bytes = (rows * dim as f64 * 4.0).min((64u64 << 20) as f64);
    // PCA's vectors of the embedding's width in f64: the mean, two components, their work.
    let need = rows * (dim as f64 * 12.0 + per_row) + 2.0 * batch_bytes + 40.0 * dim as f64;
    if let Some(avail) = crate::host_memory::available_bytes().filter(|&a| need > a) {
        return Err(derr(format!(
            "{rows} embeddings of {dim} dimensions need about {:.1} GiB to project, and {:.1} \
             GiB of memory is available",
            need / GIB,
            avail / GIB
        )));
    }
    // Batches of at most ~64 MB of vectors, whatever their width.
    let batch = ((64usize << 20) / (4 * dim).max(1)).clamp(1, 8192);
    let reader = builder
        .with_batch_size(batch)
        .build()
        .map_err(|e| derr(e.to_string()))?;
    let mut values = Vec::new();
    let mut num: Vec<f64> = Vec::new();
    let mut cat: Vec<Option<String>> = Vec::new();
    let mut is_numeric = None;
    let mut layer = None;
    for batch in reader {
        let batch = batch.map_err(|e| derr(e.to_string()))?;
        let emb = batch
            .column_by_name("embedding")
            .ok_or_else(|| derr("no `embedding`".into()))?;
        let emb = emb.as_fixed_size_list();
        if emb.null_count() > 0 {
            return Err(derr("column `embedding` has null rows".into()));
        }
        let flat = emb.values().as_primitive::<Float32Type>();
        let start = emb.offset() * dim;
        // A null element's slot holds whatever was there (0 in the files seen): refused, not
        // projected as a made-up value. Counted first: the scan runs only where arrow counts
        // a null.
        let null = (flat.null_count() > 0)
            .then(|| (start..start + emb.len() * dim).find(|&i| flat.is_null(i)))
            .flatten();
        if let Some(i) = null {
            let row = values.len() / dim.max(1) + (i - start) / dim;
            return Err(derr(format!(
                "column `embedding`: row {row} holds a null at element {}",
                (i - start) % dim
            )));
        }
        // Fallibly: an estimate is no bound (a row count can lie), and an abort says nothing.
        let total = values.len() / dim.max(1) + emb.len();
        let oom = || {
            derr(format!(
                "{total} rows of {dim} dimensions do not fit in memory"
            ))
        };
        values.try_reserve(emb.len() * dim).map_err(|_| oom())?;
        num.try_reserve(emb.len()).map_err(|_| oom())?;
        cat.try_reserve(emb.len()).map_err(|_| oom())?;
        values.extend_from_slice(&flat.values()[start..start + emb.len() * dim]);
        let col = batch
            .column_by_name(color)
            .ok_or_else(|| derr(format!("no `{color}`")))?;
        if is_numeric.is_none() {
            is_numeric = Some(numeric(col.as_ref()).is_some());
        }
        if is_numeric == Some(true) {
            num.extend(numeric(col.as_ref()).unwrap_or_default());
        } else {
            cat.extend(strings(col.as_ref()).ok_or_else(|| {
                derr(format!(
                    "column `{color}` is {}: colour by a numeric or string column",
                    col.data_type()
                ))
            })?);
        }
        // Several layers in one file (`embed --layers`) would share one projection whose first
        // component only tells the layers apart: refused, as `embed --plot` refuses them.
        if let Some(col) = batch
            .column_by_name("layer")
            .and_then(|c| c.as_primitive_opt::<Int32Type>())
        {
            if col.null_count() > 0 {
                return Err(derr("column `layer` has null rows".into()));
            }
            for &l in col.values().iter() {
                match layer {
                    None => layer = Some(l),
                    Some(first) if first != l => {
                        return Err(derr(format!(
                            "holds embeddings of layer {first} and layer {l}: a projection \
                             takes one layer (write one with `genslm embed --layer L`)"
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    let n = values.len() / dim.max(1);
    Ok(EmbeddingTable {
        n,
        dim,
        values,
        color: if is_numeric == Some(false) {
            ColumnValues::Categorical(cat)
        } else {
            ColumnValues::Numeric(num)
        },
        layer,
    })
}
