//! The file side of every parquet table inference writes (embeddings, per-token scores,
//! per-token states): an atomic file, an arrow writer with snappy pages and a bounded row-group
//! size, key-value metadata, and errors that name the file. The tables build their columns;
//! this writes them.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use crate::atomic::AtomicFile;
use crate::error::{Error, Result};

/// A parquet file that appears under its name only after [`ParquetSink::finish`].
pub struct ParquetSink {
    path: PathBuf,
    schema: SchemaRef,
    guard: AtomicFile,
    file: File,
    writer: ArrowWriter<File>,
}

impl ParquetSink {
    /// `row_group_bytes` bounds the writer's memory: a row group is flushed at that encoded size.
    pub fn create(
        path: &Path,
        schema: SchemaRef,
        metadata: Vec<(String, String)>,
        row_group_bytes: usize,
    ) -> Result<Self> {
        let (guard, file) = AtomicFile::create(path)?;
        let handle = file
            .try_clone()
            .map_err(|e| Error::io(guard.tmp_path(), e))?;
        let kv = metadata
            .into_iter()
            .map(|(k, v)| KeyValue::new(k, v))
            .collect();
        let props = WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_max_row_group_bytes(Some(row_group_bytes))
            .set_key_value_metadata(Some(kv))
            .build();
        let writer = ArrowWriter::try_new(handle, schema.clone(), Some(props)).map_err(|e| {
            Error::Dataset {
                path: path.to_path_buf(),
                msg: e.to_string(),
            }
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            schema,
            guard,
            file,
            writer,
        })
    }

    /// Writes one batch of `columns`, in the schema's order.
    pub fn write(&mut self, columns: Vec<ArrayRef>) -> Result<()> {
        let batch = RecordBatch::try_new(self.schema.clone(), columns)
            .map_err(|e| self.err(e.to_string()))?;
        self.writer
            .write(&batch)
            .map_err(|e| self.err(e.to_string()))
    }

    /// An error about this file.
    pub fn err(&self, msg: String) -> Error {
        Error::Dataset {
            path: self.path.clone(),
            msg,
        }
    }

    /// Writes the footer, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        self.writer.finish().map_err(|e| self.err(e.to_string()))?;
        self.guard.commit(self.file)
    }
}
