//! Opening a parquet file genslm reads (a dataset, an embeddings file): only as a regular
//! file, recorded as an input, and refused before any page is decoded where its pages would
//! not decode within memory or in a codec genslm reads.

use std::fs::File;
use std::path::Path;

use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::error::{Error, Result};

/// Opens a parquet file for reading; errors name the file.
pub fn open_parquet(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<File>> {
    // A parquet file is read from its end: a named pipe would block the open, then fail.
    crate::error::file_or_missing(path, "a parquet file")?;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // A dataset or embeddings file read is an input: `embed --data X --out X` replaced it.
    crate::atomic::note_input(path);
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| Error::Dataset {
        path: path.to_path_buf(),
        msg: format!("not a readable parquet file: {e}"),
    })?;
    check_codecs(path, builder.metadata())?;
    Ok(builder)
}

/// Refuses pages compressed other than as genslm reads them, naming the codec, before any is
/// decoded. zstd (polars' default) and snappy decompress into the size a page declares; the
/// parquet library's gzip reads on to the end of whatever a page inflates to, so a 4 MB gzip
/// file aborted the process asking for 4 GB, and brotli and lz4 are not built in. And refuses
/// a column chunk that says it inflates past memory (an 80 KB zstd file held a 1.9 GB id, and
/// the process aborted decoding it): decoding holds its pages and arrow's copy of them.
fn check_codecs(path: &Path, meta: &parquet::file::metadata::ParquetMetaData) -> Result<()> {
    use parquet::basic::Compression as C;
    let avail = crate::host_memory::available_bytes();
    for (g, group) in meta.row_groups().iter().enumerate() {
        for column in group.columns() {
            let inflated = column.uncompressed_size().max(0) as f64;
            if let Some(a) = avail.filter(|&a| 3.0 * inflated > a) {
                return Err(Error::Dataset {
                    path: path.to_path_buf(),
                    msg: format!(
                        "column `{}` of row group {g} holds {:.0} MB uncompressed; decoding it \
                         needs about three times that, and {:.0} MB of memory is available",
                        column.column_path(),
                        inflated / 1e6,
                        a / 1e6
                    ),
                });
            }
            let codec = column.compression();
            if !matches!(codec, C::UNCOMPRESSED | C::SNAPPY | C::ZSTD(_)) {
                return Err(Error::Dataset {
                    path: path.to_path_buf(),
                    msg: format!(
                        "column `{}` of row group {g} is compressed with {codec}: genslm reads \
                         parquet pages that are uncompressed, snappy or zstd. Rewrite the file \
                         with one of those (pyarrow: pq.write_table(table, path, \
                         compression='zstd'))",
                        column.column_path()
                    ),
                });
            }
        }
    }
    Ok(())
}
