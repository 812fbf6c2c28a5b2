//! Tokenized datasets as parquet: one row per FASTA record.
//!
//! Columns: `id`, `description`, `source` (file), `length` (bases), `gc_content`, the digest
//! (`xxh3` or `md5`, hex of the upper-cased sequence: `data::digest`), `tokens` (list<int32> of
//! token ids). The vocabulary name is kept
//! in the file's key-value metadata (`genslm.vocab`) so training can check it.
//!
//! Rows are buffered up to a row group's worth and written by parquet's column writers, except
//! the token ids, which are encoded as they arrive (see `token_pages`), so memory stays flat
//! however many records pass through and a chromosome costs under a byte per codon. The file
//! is written under a temporary name and renamed only when complete.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{
    Array, Float64Array, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::{add_encoded_arrow_schema_to_metadata, ArrowSchemaConverter};
use parquet::basic::Compression;
use parquet::data_type::{
    ByteArray, ByteArrayType, DataType as ParquetType, DoubleType, Int64Type,
};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedFileWriter, SerializedRowGroupWriter};
use parquet::schema::types::ColumnDescPtr;

use super::parquet_open::open_parquet;
use super::token_pages::TokenColumn;
use crate::atomic::AtomicFile;
use crate::data::digest::DigestKind;
use crate::error::{Error, Result};
use crate::tokenizer::VocabKind;

const VOCAB_KEY: &str = "genslm.vocab";

/// A row group is written once it holds this many rows...
const GROUP_ROWS: usize = 16 << 10;
/// ...or this many token ids (about 42 MB encoded).
const GROUP_TOKENS: usize = 48 << 20;

/// One record as written to a dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Row<'a> {
    pub id: &'a str,
    pub description: &'a str,
    pub source: &'a str,
    pub length: u64,
    pub gc_content: f64,
    /// Hex digest of the bases, of the writer's [`DigestKind`].
    pub digest: &'a str,
    /// Token ids, one byte each (both GenSLM vocabularies have under 256 tokens).
    pub tokens: &'a [u8],
}

/// One record as read back from a dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizedRecord {
    pub id: String,
    pub description: String,
    pub source: String,
    pub length: u64,
    pub gc_content: f64,
    /// Hex digest of the bases (the column `digest_kind` names).
    pub digest: String,
    pub digest_kind: DigestKind,
    pub tokens: Vec<u32>,
}

/// The columns of a dataset whose digest is `digest`.
pub fn schema(digest: DigestKind) -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("description", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, false),
        Field::new("length", DataType::Int64, false),
        Field::new("gc_content", DataType::Float64, false),
        Field::new(digest.column(), DataType::Utf8, false),
        Field::new(
            "tokens",
            DataType::List(Arc::new(Field::new("item", DataType::Int32, false))),
            false,
        ),
    ]))
}

/// The scalar columns of the rows not yet written.
#[derive(Default)]
struct Scalars {
    id: Vec<ByteArray>,
    description: Vec<ByteArray>,
    source: Vec<ByteArray>,
    length: Vec<i64>,
    gc: Vec<f64>,
    digest: Vec<ByteArray>,
}

/// Streams rows into a parquet file that appears under its name only after [`finish`].
///
/// [`finish`]: DatasetWriter::finish
pub struct DatasetWriter {
    path: PathBuf,
    guard: AtomicFile,
    file: File,
    writer: SerializedFileWriter<File>,
    tokens_descr: ColumnDescPtr,
    scalars: Scalars,
    tokens: TokenColumn,
    group_tokens: usize,
    total_rows: u64,
}

impl DatasetWriter {
    pub fn create(path: &Path, vocab: VocabKind, digest: DigestKind) -> Result<Self> {
        let derr = |e: parquet::errors::ParquetError| Error::Dataset {
            path: path.to_path_buf(),
            msg: e.to_string(),
        };
        let (guard, file) = AtomicFile::create(path)?;
        let handle = file
            .try_clone()
            .map_err(|e| Error::io(guard.tmp_path(), e))?;
        let schema = schema(digest);
        let mut props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_key_value_metadata(Some(vec![KeyValue::new(
                VOCAB_KEY.to_string(),
                vocab.name().to_string(),
            )]))
            .build();
        // Readers that know arrow get the exact types back (as with arrow's own writer).
        add_encoded_arrow_schema_to_metadata(&schema, &mut props);
        let descr = ArrowSchemaConverter::new().convert(&schema).map_err(derr)?;
        let tokens_descr = descr.column(descr.num_columns() - 1);
        let writer = SerializedFileWriter::new(handle, descr.root_schema_ptr(), Arc::new(props))
            .map_err(derr)?;
        Ok(Self {
            path: path.to_path_buf(),
            guard,
            file,
            writer,
            tokens: TokenColumn::new(tokens_descr.clone()).map_err(derr)?,
            tokens_descr,
            scalars: Scalars::default(),
            group_tokens: 0,
            total_rows: 0,
        })
    }

    pub fn push(&mut self, row: &Row<'_>) -> Result<()> {
        let s = &mut self.scalars;
        s.id.push(row.id.into());
        s.description.push(row.description.into());
        s.source.push(row.source.into());
        s.length.push(row.length as i64);
        s.gc.push(row.gc_content);
        s.digest.push(row.digest.into());
        let group_rows = s.id.len();
        self.tokens.push_row(row.tokens).map_err(|e| self.err(e))?;
        self.total_rows += 1;
        self.group_tokens += row.tokens.len();
        if group_rows >= GROUP_ROWS || self.group_tokens >= GROUP_TOKENS {
            self.write_group()?;
        }
        Ok(())
    }

    fn write_group(&mut self) -> Result<()> {
        if self.tokens.rows() == 0 {
            return Ok(());
        }
        let fresh = TokenColumn::new(self.tokens_descr.clone()).map_err(|e| self.err(e))?;
        let tokens = std::mem::replace(&mut self.tokens, fresh);
        let s = std::mem::take(&mut self.scalars);
        self.group_tokens = 0;
        let write = |writer: &mut SerializedFileWriter<File>| -> parquet::errors::Result<()> {
            let mut group = writer.next_row_group()?;
            put::<ByteArrayType>(&mut group, &s.id)?;
            put::<ByteArrayType>(&mut group, &s.description)?;
            put::<ByteArrayType>(&mut group, &s.source)?;
            put::<Int64Type>(&mut group, &s.length)?;
            put::<DoubleType>(&mut group, &s.gc)?;
            put::<ByteArrayType>(&mut group, &s.digest)?;
            let (bytes, close) = tokens.finish()?;
            group.append_column(&bytes, close)?;
            group.close()?;
            Ok(())
        };
        write(&mut self.writer).map_err(|e| self.err(e))
    }

    fn err(&self, e: impl std::fmt::Display) -> Error {
        Error::Dataset {
            path: self.path.clone(),
            msg: e.to_string(),
        }
    }

    pub fn rows(&self) -> u64 {
        self.total_rows
    }

    /// Writes the footer, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        self.write_group()?;
        self.writer.finish().map_err(|e| self.err(e))?;
        self.guard.commit(self.file)
    }
}

/// Writes the next column of a row group from plain values (required, not repeated).
fn put<T: ParquetType>(
    group: &mut SerializedRowGroupWriter<'_, File>,
    values: &[T::T],
) -> parquet::errors::Result<()> {
    let mut col = group
        .next_column()?
        .ok_or_else(|| parquet::errors::ParquetError::General("too few columns".into()))?;
    col.typed::<T>().write_batch(values, None, None)?;
    col.close()
}

/// Reads every row of a dataset (used by training and tests).
pub fn read_dataset(path: &Path) -> Result<(VocabKind, Vec<TokenizedRecord>)> {
    let reader = DatasetReader::open(path, 1024)?;
    let vocab = reader.vocab;
    let rows = reader.collect::<Result<Vec<_>>>()?;
    Ok((vocab, rows))
}

/// Streams the rows of a dataset, `batch_rows` at a time, so memory stays flat however large
/// the file is.
pub struct DatasetReader {
    pub vocab: VocabKind,
    /// Rows in the file (from its footer).
    pub num_rows: u64,
    /// Which digest its rows carry.
    pub digest: DigestKind,
    path: PathBuf,
    reader: parquet::arrow::arrow_reader::ParquetRecordBatchReader,
    pending: std::collections::VecDeque<TokenizedRecord>,
    done_rows: usize,
}

impl DatasetReader {
    pub fn open(path: &Path, batch_rows: usize) -> Result<Self> {
        let derr = |msg: String| Error::Dataset {
            path: path.to_path_buf(),
            msg,
        };
        let builder = open_parquet(path)?;
        let vocab = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|k| k.key == VOCAB_KEY))
            .and_then(|k| k.value.clone())
            .map(|v| {
                v.parse::<VocabKind>()
                    .map_err(|e| derr(format!("`{VOCAB_KEY}` metadata: {e}")))
            })
            .transpose()?
            .ok_or_else(|| {
                derr(format!(
                    "no `{VOCAB_KEY}` metadata, so the token ids' vocabulary is unknown (this \
                     file was not written by `genslm tokenize`, or a tool that rewrote it \
                     dropped the key); tokenize the FASTA with `genslm tokenize`, or keep \
                     `{VOCAB_KEY}` (genslm69 or genslm71) in the file's key-value metadata"
                ))
            })?;
        let num_rows = builder.metadata().file_metadata().num_rows().max(0) as u64;
        // The file's digest column (checked again, with the others, as batches are read).
        let digest = DigestKind::ALL
            .into_iter()
            .find(|k| builder.schema().field_with_name(k.column()).is_ok())
            .ok_or_else(|| derr("missing column `xxh3` (or `md5`): the records' digest".into()))?;
        let reader = builder
            .with_batch_size(batch_rows.max(1))
            .build()
            .map_err(|e| derr(e.to_string()))?;
        Ok(Self {
            vocab,
            num_rows,
            digest,
            path: path.to_path_buf(),
            reader,
            pending: Default::default(),
            done_rows: 0,
        })
    }

    fn fill(&mut self, batch: &RecordBatch) -> Result<()> {
        let derr = |msg: String| Error::Dataset {
            path: self.path.clone(),
            msg,
        };
        // The digest column is whichever kind the file has (`xxh3` first).
        let kind = DigestKind::ALL
            .into_iter()
            .find(|k| batch.column_by_name(k.column()).is_some())
            .ok_or_else(|| derr("missing column `xxh3` (or `md5`): the records' digest".into()))?;
        // A missing column is reported before one of the wrong type.
        if let Some(f) = schema(kind)
            .fields()
            .iter()
            .find(|f| batch.column_by_name(f.name()).is_none())
        {
            return Err(derr(format!("missing column `{}`", f.name())));
        }
        let want = schema(kind);
        let bad = |name: &str| {
            let expected = want
                .field_with_name(name)
                .map(|f| f.data_type().to_string())
                .unwrap_or_default();
            derr(format!(
                "column `{name}` has the wrong type (genslm writes {expected})"
            ))
        };
        // genslm writes no nulls: one read as its slot's value would be a made-up token,
        // length or digest (a null token id was read as whatever the slot held).
        for f in want.fields() {
            if let Some(col) = batch
                .column_by_name(f.name())
                .filter(|c| c.null_count() > 0)
            {
                if let Some(row) = (0..col.len()).find(|&r| col.is_null(r)) {
                    return Err(derr(format!(
                        "row {}: column `{}` is null; genslm writes a value in every row",
                        self.done_rows + row,
                        f.name()
                    )));
                }
            }
        }
        fn typed<'a, T: 'static>(batch: &'a RecordBatch, name: &str) -> Option<&'a T> {
            batch.column_by_name(name)?.as_any().downcast_ref::<T>()
        }
        let id = typed::<StringArray>(batch, "id").ok_or_else(|| bad("id"))?;
        let description = typed::<StringArray>(batch, "description");
        let description = description.ok_or_else(|| bad("description"))?;
        let source = typed::<StringArray>(batch, "source").ok_or_else(|| bad("source"))?;
        let length = typed::<Int64Array>(batch, "length").ok_or_else(|| bad("length"))?;
        let gc = typed::<Float64Array>(batch, "gc_content").ok_or_else(|| bad("gc_content"))?;
        let digest =
            typed::<StringArray>(batch, kind.column()).ok_or_else(|| bad(kind.column()))?;
        let tokens = typed::<ListArray>(batch, "tokens").ok_or_else(|| bad("tokens"))?;
        for i in 0..batch.num_rows() {
            let t = tokens.value(i);
            let t = t
                .as_any()
                .downcast_ref::<Int32Array>()
                .ok_or_else(|| bad("tokens"))?;
            // Counted first: the scan runs only for a list that holds a null.
            let null = (t.null_count() > 0).then(|| (0..t.len()).find(|&k| t.is_null(k)));
            if let Some(k) = null.flatten() {
                return Err(derr(format!(
                    "row {}: token {k} of column `tokens` is null; genslm writes an id in every \
                     place",
                    self.done_rows + i
                )));
            }
            // Passed on to embed's output as the record's length: a negative one read as 2⁶⁴ − n.
            let bases = u64::try_from(length.value(i)).map_err(|_| {
                derr(format!(
                    "row {}: negative length {} in column `length`",
                    self.done_rows + i,
                    length.value(i)
                ))
            })?;
            let mut ids = Vec::with_capacity(t.len());
            for &v in t.values().iter() {
                let v = u32::try_from(v).map_err(|_| {
                    derr(format!("row {}: negative token id {v}", self.done_rows + i))
                })?;
                ids.push(v);
            }
            self.pending.push_back(TokenizedRecord {
                id: id.value(i).to_string(),
                description: description.value(i).to_string(),
                source: source.value(i).to_string(),
                length: bases,
                gc_content: gc.value(i),
                digest: digest.value(i).to_string(),
                digest_kind: kind,
                tokens: ids,
            });
        }
        self.done_rows += batch.num_rows();
        Ok(())
    }
}

impl Iterator for DatasetReader {
    type Item = Result<TokenizedRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        while self.pending.is_empty() {
            match self.reader.next()? {
                Ok(batch) => {
                    if let Err(e) = self.fill(&batch) {
                        return Some(Err(e));
                    }
                }
                Err(e) => {
                    return Some(Err(Error::Dataset {
                        path: self.path.clone(),
                        msg: e.to_string(),
                    }))
                }
            }
        }
        self.pending.pop_front().map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::basic::Compression;

    /// A dataset written by another tool with genslm's columns and metadata, where `null_token`
    /// makes one token id null and `length` is the second row's length (`None`: null): refused
    /// naming the row and column (a null token was read as whatever its slot held, and trained
    /// on; a negative length was passed on as 2⁶⁴ − n).
    fn foreign(dir: &Path, null_token: bool, length: Option<i64>) -> PathBuf {
        foreign_compressed(dir, null_token, length, Compression::UNCOMPRESSED)
    }

    fn foreign_compressed(
        dir: &Path,
        null_token: bool,
        length: Option<i64>,
        compression: Compression,
    ) -> PathBuf {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        let path = dir.join(format!("f{null_token}{length:?}{compression}.parquet"));
        let strings = |v: [&str; 2]| Arc::new(StringArray::from(v.to_vec())) as _;
        let mut tokens = ListBuilder::new(Int32Builder::new());
        for row in [[5, 6, 7], [8, 9, 10]] {
            for t in row {
                match null_token && t == 9 {
                    true => tokens.values().append_null(),
                    false => tokens.values().append_value(t),
                }
            }
            tokens.append(true);
        }
        let length = Int64Array::from(vec![Some(9), length]);
        let batch = RecordBatch::try_from_iter(vec![
            ("id", strings(["a", "b"])),
            ("description", strings(["", ""])),
            ("source", strings(["x", "x"])),
            ("length", Arc::new(length) as _),
            (
                "gc_content",
                Arc::new(Float64Array::from(vec![0.5, 0.5])) as _,
            ),
            ("xxh3", strings(["", ""])),
            ("tokens", Arc::new(tokens.finish()) as _),
        ])
        .unwrap();
        let props = WriterProperties::builder()
            .set_key_value_metadata(Some(vec![KeyValue::new(
                VOCAB_KEY.to_string(),
                "genslm69".to_string(),
            )]))
            .set_compression(compression)
            .build();
        let file = File::create(&path).unwrap();
        let mut w =
            parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        path
    }

    #[test]
    fn nulls_in_a_foreign_dataset_are_refused_by_row_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let (_, rows) = read_dataset(&foreign(dir.path(), false, Some(9))).unwrap();
        assert_eq!(rows[1].tokens, [8, 9, 10]);
        for (token, length, says) in [
            (true, Some(9), "row 1: token 1 of column `tokens` is null"),
            (false, None, "row 1: column `length` is null"),
            (false, Some(-9), "row 1: negative length -9"),
        ] {
            let e = read_dataset(&foreign(dir.path(), token, length))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    /// Datasets compressed as other tools write them (polars: zstd by default) read back as
    /// the uncompressed one: they were refused with "Disabled feature at compile time" (gzip,
    /// refused by name, is tested in `cli_embed`: the writer here has no gzip).
    #[test]
    fn datasets_compressed_by_other_tools_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let plain = read_dataset(&foreign(dir.path(), false, Some(9)))
            .unwrap()
            .1;
        for c in [Compression::ZSTD(Default::default()), Compression::SNAPPY] {
            let path = foreign_compressed(dir.path(), false, Some(9), c);
            let used = open_parquet(&path)
                .unwrap()
                .metadata()
                .row_group(0)
                .column(0)
                .compression();
            assert_eq!(used, c, "written as asked");
            let rows = read_dataset(&path).unwrap().1;
            assert_eq!(rows.len(), plain.len());
            for (a, b) in rows.iter().zip(&plain) {
                assert_eq!((&a.id, &a.tokens, a.length), (&b.id, &b.tokens, b.length));
            }
        }
    }

    /// Rows written through the page-cutting token encoder come back unchanged through
    /// parquet's own reader: an empty row, a row spanning several pages, ids needing 8 bits, and
    /// enough rows for two row groups.
    #[test]
    fn rows_round_trip_across_pages_and_row_groups() {
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut rows: Vec<(String, Vec<u8>)> = vec![
            ("empty".into(), vec![]),
            ("three".into(), vec![5, 6, 7]),
            (
                "chromosome".into(),
                (0..2_500_001).map(|_| rng.below(71) as u8).collect(),
            ),
            ("wide".into(), vec![255, 0, 128, 3]),
        ];
        for i in 0..GROUP_ROWS + 5 {
            let n = rng.below(40) as usize;
            rows.push((
                format!("r{i}"),
                (0..n).map(|_| rng.below(71) as u8).collect(),
            ));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.parquet");
        let mut w = DatasetWriter::create(&path, VocabKind::Genslm71, DigestKind::Md5).unwrap();
        for (id, tokens) in &rows {
            w.push(&Row {
                id,
                description: "d",
                source: "s",
                length: tokens.len() as u64 * 3,
                gc_content: 0.25,
                digest: "m",
                tokens,
            })
            .unwrap();
        }
        w.finish().unwrap();
        let groups = open_parquet(&path).unwrap().metadata().num_row_groups();
        assert_eq!(groups, 2);
        let (vocab, back) = read_dataset(&path).unwrap();
        assert_eq!(vocab, VocabKind::Genslm71);
        assert_eq!(back.len(), rows.len());
        for ((id, tokens), r) in rows.iter().zip(&back) {
            assert_eq!(&r.id, id);
            assert_eq!(r.length, tokens.len() as u64 * 3);
            let want: Vec<u32> = tokens.iter().map(|&t| u32::from(t)).collect();
            assert!(r.tokens == want, "row {id} differs");
        }
    }
}
