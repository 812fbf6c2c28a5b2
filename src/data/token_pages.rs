//! The `tokens` column of a dataset, encoded page by page as rows arrive.
//!
//! parquet's column writer takes a row only whole (every write must start at a row boundary),
//! so a 200 Mbp chromosome's 67M ids would first exist as i32 values plus two i16 level arrays,
//! 8 bytes per codon, before being encoded. Here pages are cut at any value (rows may span
//! pages in data page v1; no offset index is written for this column, which is what would
//! forbid it), and each one-byte id is bit-packed as an index into a dictionary of all 256 byte
//! values, so the dictionary is the identity and nothing is hashed. Memory is the encoded chunk,
//! under one byte per codon. Readers see the usual `list<int32>` column.

use bytes::Bytes;
use parquet::basic::{Compression, Encoding};
use parquet::column::page::{CompressedPage, Page, PageWriter};
use parquet::column::writer::ColumnCloseResult;
use parquet::errors::Result;
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::writer::{SerializedPageWriter, TrackedWrite};
use parquet::schema::types::ColumnDescPtr;

/// Values per data page (about 0.9 MB encoded at 7 bits per id).
const PAGE_VALUES: usize = 1 << 20;

/// Runs of one repetition or definition level (both have bit width 1 here).
#[derive(Default)]
struct Runs(Vec<(u8, u32)>);

impl Runs {
    fn push(&mut self, level: u8, n: usize) {
        if n == 0 {
            return;
        }
        match self.0.last_mut() {
            Some((l, len)) if *l == level => *len += n as u32,
            _ => self.0.push((level, n as u32)),
        }
    }

    /// Appends the levels as a v1 page section: 4-byte length, then RLE runs.
    fn write_to(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        for &(level, len) in &self.0 {
            put_varint(out, u64::from(len) << 1);
            out.push(level);
        }
        let n = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&n.to_le_bytes());
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends `ids` as RLE_DICTIONARY data: a bit-width byte, then one bit-packed run (the last
/// group padded with zeros; readers stop at the page's value count).
fn pack_ids(ids: &[u8], out: &mut Vec<u8>) {
    let max = ids.iter().copied().max().unwrap_or(0);
    let width = (8 - max.leading_zeros()).max(1) as usize;
    out.push(width as u8);
    if ids.is_empty() {
        return;
    }
    let groups = ids.len().div_ceil(8);
    put_varint(out, ((groups as u64) << 1) | 1);
    out.reserve(groups * width);
    for g in ids.chunks(8) {
        let mut bits = 0u64;
        for (i, &v) in g.iter().enumerate() {
            bits |= u64::from(v) << (i * width);
        }
        out.extend_from_slice(&bits.to_le_bytes()[..width]);
    }
}

/// One row group's `tokens` column chunk, built in memory as rows are pushed.
pub struct TokenColumn {
    descr: ColumnDescPtr,
    sink: TrackedWrite<Vec<u8>>,
    data_offset: Option<u64>,
    ids: Vec<u8>,
    rep: Runs,
    def: Runs,
    page_levels: usize,
    levels: u64,
    rows: u64,
}

impl TokenColumn {
    /// Starts a chunk for the leaf `descr` (a required list of required int32).
    pub fn new(descr: ColumnDescPtr) -> Result<Self> {
        let mut sink = TrackedWrite::new(Vec::new());
        let dict: Vec<u8> = (0..256i32).flat_map(i32::to_le_bytes).collect();
        let len = dict.len();
        let page = Page::DictionaryPage {
            buf: Bytes::from(dict),
            num_values: 256,
            encoding: Encoding::PLAIN,
            is_sorted: true,
        };
        SerializedPageWriter::new(&mut sink).write_page(CompressedPage::new(page, len))?;
        Ok(Self {
            descr,
            sink,
            data_offset: None,
            ids: Vec::new(),
            rep: Runs::default(),
            def: Runs::default(),
            page_levels: 0,
            levels: 0,
            rows: 0,
        })
    }

    /// Appends one row's ids.
    pub fn push_row(&mut self, ids: &[u8]) -> Result<()> {
        self.rows += 1;
        if ids.is_empty() {
            // An empty list: one level, no value.
            self.rep.push(0, 1);
            self.def.push(0, 1);
            self.page_levels += 1;
            return Ok(());
        }
        let mut first = true;
        let mut rest = ids;
        while !rest.is_empty() {
            let room = PAGE_VALUES - self.ids.len();
            let (now, later) = rest.split_at(room.min(rest.len()));
            let continued = if first {
                self.rep.push(0, 1);
                now.len() - 1
            } else {
                now.len()
            };
            self.rep.push(1, continued);
            self.def.push(1, now.len());
            self.ids.extend_from_slice(now);
            self.page_levels += now.len();
            first = false;
            rest = later;
            if self.ids.len() >= PAGE_VALUES {
                self.flush_page()?;
            }
        }
        Ok(())
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    fn flush_page(&mut self) -> Result<()> {
        if self.page_levels == 0 {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(self.ids.len() + 64);
        self.rep.write_to(&mut buf);
        self.def.write_to(&mut buf);
        pack_ids(&self.ids, &mut buf);
        let len = buf.len();
        let page = Page::DataPage {
            buf: Bytes::from(buf),
            num_values: self.page_levels as u32,
            encoding: Encoding::RLE_DICTIONARY,
            def_level_encoding: Encoding::RLE,
            rep_level_encoding: Encoding::RLE,
            statistics: None,
        };
        let spec =
            SerializedPageWriter::new(&mut self.sink).write_page(CompressedPage::new(page, len))?;
        self.data_offset.get_or_insert(spec.offset);
        self.levels += self.page_levels as u64;
        self.ids.clear();
        self.rep = Runs::default();
        self.def = Runs::default();
        self.page_levels = 0;
        Ok(())
    }

    /// The encoded chunk and the metadata `SerializedRowGroupWriter::append_column` needs.
    pub fn finish(mut self) -> Result<(Bytes, ColumnCloseResult)> {
        self.flush_page()?;
        let bytes = Bytes::from(self.sink.into_inner()?);
        let size = bytes.len() as i64;
        let metadata = ColumnChunkMetaData::builder(self.descr)
            .set_compression(Compression::UNCOMPRESSED)
            .set_encodings(vec![
                Encoding::PLAIN,
                Encoding::RLE,
                Encoding::RLE_DICTIONARY,
            ])
            .set_num_values(self.levels as i64)
            .set_total_compressed_size(size)
            .set_total_uncompressed_size(size)
            .set_dictionary_page_offset(Some(0))
            .set_data_page_offset(self.data_offset.unwrap_or(0) as i64)
            .build()?;
        let close = ColumnCloseResult {
            bytes_written: size as u64,
            rows_written: self.rows,
            metadata,
            bloom_filter: None,
            column_index: None,
            offset_index: None,
        };
        Ok((bytes, close))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit-packing against the format's own rule (value i of a group sits at bits
    /// i·width..(i+1)·width, little-endian), decoded naively.
    #[test]
    fn packed_ids_decode_bit_by_bit() {
        let ids: Vec<u8> = (0..21u32).map(|i| ((i * 37) % 71) as u8).collect();
        let mut out = Vec::new();
        pack_ids(&ids, &mut out);
        let width = out[0] as usize;
        assert_eq!(width, 7);
        assert_eq!(out[1], ((3 << 1) | 1) as u8, "three groups of eight");
        let data = &out[2..];
        assert_eq!(data.len(), 3 * width);
        for (i, &want) in ids.iter().enumerate() {
            let mut v = 0u8;
            for b in 0..width {
                let bit = i * width + b;
                v |= ((data[bit / 8] >> (bit % 8)) & 1) << b;
            }
            assert_eq!(v, want, "value {i}");
        }
    }

    #[test]
    fn level_runs_merge_and_carry_their_length() {
        let mut r = Runs::default();
        r.push(0, 1);
        r.push(1, 200);
        r.push(1, 100);
        r.push(0, 0);
        let mut out = Vec::new();
        r.write_to(&mut out);
        // 0×1: header 2, value 0; 1×300: varint(600) = 0xd8 0x04, value 1.
        assert_eq!(out, vec![5, 0, 0, 0, 2, 0, 0xd8, 0x04, 1]);
    }
}
