//! Opening a FASTA file for needletail with a bound on the record it may hold.
//!
//! needletail's parser keeps the record it is reading whole in one buffer, growing it until
//! the next '>' — so a one-record gzip bomb (63 MB expanding to 20 Gbp) grows memory until the
//! process is killed. Its `parse_fastx_reader` decompresses internally, where nothing can
//! watch the bytes; this does the same detection (gzip, bzip2, xz, zstd by their magic bytes,
//! as needletail does) and puts [`RecordLimit`] between the decompressed stream and the
//! parser: past `limit` bytes since the last record start, the read fails and [`Overflow`]
//! says which record and how far it got.

use std::io::{self, BufReader, Cursor, Read};
use std::sync::{Arc, Mutex};

use needletail::errors::ParseError;
use needletail::parser::{FastaReader, FastqReader, FastxReader};

/// What stopped a record that outgrew the limit.
#[derive(Debug, Clone)]
pub struct Overflow {
    /// The record's header line (without '>'), as far as it was seen; at most 200 bytes.
    pub header: String,
    /// Bytes of the record read when it was stopped.
    pub read: u64,
    pub limit: u64,
}

/// Shared with the caller, which turns the parser's I/O error into a message naming the record.
pub type OverflowCell = Arc<Mutex<Option<Overflow>>>;

/// A reader that fails once one record (from a '>' at a line start to the next) passes `limit`
/// bytes.
struct RecordLimit<R> {
    inner: R,
    limit: u64,
    /// Bytes since the current record's '>'.
    since: u64,
    /// The last byte of the previous read ('\n' at the start, so a leading '>' counts).
    prev: u8,
    header: Vec<u8>,
    /// The header continues into the next read (no '\n' seen yet).
    in_header: bool,
    overflow: OverflowCell,
}

const HEADER_KEPT: usize = 200;

impl<R: Read> RecordLimit<R> {
    /// Records the overflow of the current record for the caller; the parser's error.
    fn overflowed(&self) -> io::Error {
        let o = Overflow {
            header: String::from_utf8_lossy(&self.header).trim().to_string(),
            read: self.since,
            limit: self.limit,
        };
        *self.overflow.lock().unwrap_or_else(|e| e.into_inner()) = Some(o);
        io::Error::other("a record longer than the memory allows")
    }

    fn keep_header(&mut self, bytes: &[u8]) {
        let end = memchr::memchr(b'\n', bytes);
        let line = &bytes[..end.unwrap_or(bytes.len())];
        let room = HEADER_KEPT.saturating_sub(self.header.len());
        self.header.extend_from_slice(&line[..line.len().min(room)]);
        self.in_header = end.is_none();
    }
}

impl<R: Read> Read for RecordLimit<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let chunk = &buf[..n];
        if self.in_header {
            self.keep_header(chunk);
        }
        let starts: Vec<usize> = memchr::memchr_iter(b'>', chunk)
            .filter(|&i| (if i == 0 { self.prev } else { chunk[i - 1] }) == b'\n')
            .collect();
        // Each record that ends in this chunk is checked whole; then the one still open.
        let mut from = 0;
        for i in starts {
            self.since += (i - from) as u64;
            if self.since > self.limit {
                return Err(self.overflowed());
            }
            (self.since, from) = (0, i);
            self.header.clear();
            self.keep_header(&chunk[i + 1..]);
        }
        self.since += (n - from) as u64;
        if let Some(&last) = chunk.last() {
            self.prev = last;
        }
        if self.since > self.limit {
            return Err(self.overflowed());
        }
        Ok(n)
    }
}

const GZ_MAGIC: [u8; 2] = [0x1F, 0x8B];
const BZ_MAGIC: [u8; 2] = *b"BZ";
const XZ_MAGIC: [u8; 2] = [0xFD, 0x37];
const ZST_MAGIC: [u8; 2] = [0x28, 0xB5];

/// A zstd skippable frame's magic, 0x184D2A5? little-endian (pzstd starts its files with
/// one), which `zstd -dc` passes over: all four bytes, since "P*" could begin a text file.
fn skippable_frame(head: &[u8]) -> bool {
    head.len() >= 4 && head[0] & 0xF0 == 0x50 && head[1..4] == [0x2A, 0x4D, 0x18]
}

/// The first two bytes of `head` (zeros where it is shorter: no magic starts with one).
fn magic(head: &[u8]) -> [u8; 2] {
    [
        head.first().copied().unwrap_or(0),
        head.get(1).copied().unwrap_or(0),
    ]
}

/// What a file whose decompressed text starts compressed again is told (FASTA and VCF).
pub const COMPRESSED_TWICE: &str = "compressed twice (its decompressed text is compressed \
     again, as a .gz.gz is): decompress it once";

/// Whether a file whose first bytes are `head` (up to 4) is read through a decompressor.
pub fn is_compressed(head: &[u8]) -> bool {
    matches!(magic(head), GZ_MAGIC | BZ_MAGIC | XZ_MAGIC | ZST_MAGIC) || skippable_frame(head)
}

/// The text of a file whose first bytes are `head` (up to 4; `raw` still holds them),
/// decompressed by what they say (gzip, bzip2, xz, zstd; anything else is read as it is),
/// whatever the file's name.
pub fn decoder<R: Read + Send + 'static>(head: &[u8], raw: R) -> io::Result<Box<dyn Read + Send>> {
    if skippable_frame(head) {
        return Ok(Box::new(zstd::stream::read::Decoder::new(raw)?));
    }
    Ok(match magic(head) {
        GZ_MAGIC => Box::new(flate2::read::MultiGzDecoder::new(raw)),
        // Every stream of the file, as `bzip2 -dc` and `xz -dc` read it: pbzip2, lbzip2,
        // `xz -T` and `cat a.bz2 b.bz2` write several, and the single-stream decoders stopped
        // after the first without a word (the rest of the records lost). Bytes after the last
        // stream that start no new one are an error, as for gzip and zstd.
        BZ_MAGIC => Box::new(bzip2::read::MultiBzDecoder::new(raw)),
        XZ_MAGIC => Box::new(liblzma::read::XzDecoder::new_multi_decoder(raw)),
        ZST_MAGIC => Box::new(zstd::stream::read::Decoder::new(raw)?),
        _ => Box::new(raw),
    })
}

/// The text of `raw`, decompressed by what its first bytes say (see [`decoder`]), whether a
/// decompressor reads it, and how many first bytes there were (up to 4: fewer than 2 is a
/// file too short to hold a magic, read as it is). They are read once and put back in front:
/// a pipe or FIFO cannot be opened and read a second time, and may hand over fewer bytes per
/// read than asked.
pub fn text_of<R: Read + Send + 'static>(
    mut raw: R,
) -> io::Result<(Box<dyn Read + Send>, bool, usize)> {
    let mut head = Vec::with_capacity(4);
    (&mut raw).take(4).read_to_end(&mut head)?;
    let compressed = head.len() >= 2 && is_compressed(&head);
    let n = head.len();
    let text = decoder(&head, Cursor::new(head.clone()).chain(raw))?;
    Ok((text, compressed, n))
}

/// A regular file's size and modification time when reading began, to tell afterwards whether
/// it changed meanwhile: a FASTA cut short while read (a download restarted, a truncate) was
/// stored with its last record cut and exit 0.
pub struct Unchanged {
    file: std::fs::File,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl Unchanged {
    /// `None` for anything but a regular file (a pipe has no size to compare).
    pub fn watch(file: &std::fs::File) -> Option<Self> {
        let m = file.metadata().ok().filter(|m| m.is_file())?;
        Some(Unchanged {
            file: file.try_clone().ok()?,
            len: m.len(),
            modified: m.modified().ok(),
        })
    }

    /// What changed since [`Unchanged::watch`], in words; `None` when nothing did.
    pub fn changed(&self) -> Option<String> {
        let m = self.file.metadata().ok()?;
        let len = m.len();
        if len != self.len {
            return Some(format!(
                "the file changed while it was read ({} → {len} bytes): its last records may \
                 be cut short; read it again once it is complete",
                self.len
            ));
        }
        (m.modified().ok() != self.modified).then(|| {
            "the file was modified while it was read: its records may mix two versions; read \
             it again once it is complete"
                .to_string()
        })
    }
}

/// needletail's reader over `file` (compressed or not, FASTA or FASTQ: the caller refuses
/// FASTQ), whose records may not pass `limit` bytes; an overflow is recorded in `overflow`.
/// The errors are needletail's own, for the same files, as `parse_fastx_reader` gives.
/// `compressed` is set once the first bytes are read: whether a decompressor reads the file.
pub fn open(
    file: std::fs::File,
    limit: u64,
    overflow: &OverflowCell,
    compressed: &mut bool,
) -> Result<Box<dyn FastxReader>, ParseError> {
    let (text, is, head) = text_of(BufReader::with_capacity(1 << 20, file))?;
    if head < 2 {
        return Err(ParseError::new_empty_file());
    }
    *compressed = is;
    let mut limited = RecordLimit {
        inner: text,
        limit,
        since: 0,
        prev: b'\n',
        header: Vec::new(),
        in_header: false,
        overflow: overflow.clone(),
    };
    // Not `read_exact`: it reports a decoder's own error of kind UnexpectedEof (a bzip2 or
    // zstd stream cut before its first block ends) as the end of an empty file.
    let mut first = [0u8; 1];
    loop {
        match limited.read(&mut first) {
            Ok(0) => return Err(ParseError::new_empty_file()),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let text = Cursor::new(first).chain(limited);
    match first[0] {
        b'>' => Ok(Box::new(FastaReader::new(text))),
        b'@' => Ok(Box::new(FastqReader::new(text))),
        b => Err(ParseError::new_unknown_format(b)),
    }
}

/// The longest record a file may hold here: a quarter of the memory available, never less
/// than 64 MiB; no bound where the memory available cannot be read. Ingest's resident peak is
/// about 1.5 bytes per base of its longest record (README), but the parser's buffer doubles
/// as it grows, so its reserved size reaches twice the record.
pub fn record_limit() -> u64 {
    crate::host_memory::available_bytes().map_or(u64::MAX, |a| ((a / 4.0) as u64).max(64 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file cut short, grown, or rewritten in place while read is seen; an untouched one
    /// and a pipe (nothing to compare) are not.
    #[test]
    fn a_file_changed_while_read_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.fa");
        std::fs::write(&path, b">a\nACGTACGT\n").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let w = Unchanged::watch(&file).unwrap();
        assert_eq!(w.changed(), None);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(5)
            .unwrap();
        let said = w.changed().unwrap();
        assert!(said.contains("(12 → 5 bytes)"), "{said}");
        let w = Unchanged::watch(&file).unwrap();
        let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        writer
            .set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(9))
            .unwrap();
        assert!(w.changed().unwrap().contains("modified while it was read"));
        let (r, _w) = std::io::pipe().unwrap();
        let fd: std::os::fd::OwnedFd = r.into();
        assert!(Unchanged::watch(&std::fs::File::from(fd)).is_none());
    }

    /// Reads `text` through the limit in reads of `step` bytes; the overflow if any.
    fn through(text: &[u8], limit: u64, step: usize) -> Option<Overflow> {
        let cell = OverflowCell::default();
        let mut r = RecordLimit {
            inner: text,
            limit,
            since: 0,
            prev: b'\n',
            header: Vec::new(),
            in_header: false,
            overflow: cell.clone(),
        };
        let mut buf = vec![0u8; step];
        loop {
            match r.read(&mut buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(_) => return cell.lock().unwrap().clone(),
            }
        }
    }

    #[test]
    fn the_limit_counts_one_record_from_its_gt_at_a_line_start() {
        // Three records of 13, 31 and 12 bytes (header line included); a '>' inside a header
        // is not a record start.
        let text = b">a x>y\nACGTA\n>big one\nACGTACGTACGTACGTACGTA\n>c\nACGTACGT\n";
        for step in [1, 2, 3, 7, 64] {
            assert!(through(text, 31, step).is_none(), "step {step}");
            let o = through(text, 30, step).expect("the 31-byte record passes 30");
            assert_eq!(o.header, "big one", "step {step}");
            assert_eq!((o.read, o.limit), (31, 30), "step {step}");
        }
        // A file whose one record never ends.
        let mut bomb = b">chr1 huge\n".to_vec();
        bomb.extend(std::iter::repeat_n(b'A', 100_000));
        let o = through(&bomb, 50_000, 4096).unwrap();
        assert_eq!(o.header, "chr1 huge");
        assert!(o.read > 50_000 && o.read <= 50_000 + 4096, "{}", o.read);
    }

    /// Every compression's file of two streams (parallel compressors, `cat a.bz2 b.bz2`) is
    /// read whole, and bytes after the last stream that begin no stream are an error, as
    /// `gzip -dc`, `bzip2 -dc`, `xz -dc` and `zstd -dc` treat them.
    #[test]
    fn every_stream_of_a_concatenated_file_is_read() {
        use std::io::Write;
        let part = |from: usize| {
            let mut fasta = Vec::new();
            for i in from..from + 50 {
                writeln!(fasta, ">r{i}\n{}", "ACGTTGCAAC".repeat(20 + i)).unwrap();
            }
            fasta
        };
        let compress = |name: &str, text: &[u8]| -> Vec<u8> {
            match name {
                "gz" => {
                    let mut e = flate2::write::GzEncoder::new(Vec::new(), Default::default());
                    e.write_all(text).unwrap();
                    e.finish().unwrap()
                }
                "bz2" => {
                    let mut e = bzip2::write::BzEncoder::new(Vec::new(), Default::default());
                    e.write_all(text).unwrap();
                    e.finish().unwrap()
                }
                "xz" => {
                    let mut e = liblzma::write::XzEncoder::new(Vec::new(), 1);
                    e.write_all(text).unwrap();
                    e.finish().unwrap()
                }
                _ => zstd::encode_all(text, 1).unwrap(),
            }
        };
        let dir = tempfile::tempdir().unwrap();
        for name in ["gz", "bz2", "xz", "zst"] {
            let mut two = compress(name, &part(0));
            two.extend(compress(name, &part(50)));
            let path = dir.path().join(format!("two.{name}"));
            std::fs::write(&path, &two).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            let mut r = open(file, 1 << 30, &Default::default(), &mut false).unwrap();
            let mut ids = Vec::new();
            while let Some(rec) = r.next() {
                let rec = rec.unwrap_or_else(|e| panic!("{name}: {e}"));
                ids.push(String::from_utf8(rec.id().to_vec()).unwrap());
            }
            let want: Vec<String> = (0..100).map(|i| format!("r{i}")).collect();
            assert_eq!(ids, want, "{name}");
            two.extend(b"trailing garbage, not a stream");
            std::fs::write(&path, &two).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            let mut r = open(file, 1 << 30, &Default::default(), &mut false).unwrap();
            let mut failed = false;
            while let Some(rec) = r.next() {
                failed |= rec.is_err();
            }
            assert!(failed, "{name}: trailing bytes read without an error");
        }
    }

    /// Each compression's stream, whole and cut short of its first block's end. The cut one
    /// must be a read error (the file is damaged), never "empty file": bzip2 and zstd report
    /// the cut as an error of kind UnexpectedEof, which `read_exact` took for the end of an
    /// empty file.
    #[test]
    fn a_stream_cut_before_its_first_record_is_a_read_error_not_an_empty_file() {
        use std::io::Write;
        let mut fasta = Vec::new();
        for i in 0..200 {
            writeln!(fasta, ">r{i}\n{}", "ACGTTGCAAC".repeat(50 + i)).unwrap();
        }
        let gz = {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&fasta).unwrap();
            e.finish().unwrap()
        };
        let bz = {
            let mut e = bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::fast());
            e.write_all(&fasta).unwrap();
            e.finish().unwrap()
        };
        let xz = {
            let mut e = liblzma::write::XzEncoder::new(Vec::new(), 1);
            e.write_all(&fasta).unwrap();
            e.finish().unwrap()
        };
        let zst = zstd::encode_all(&fasta[..], 1).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in [("gz", gz), ("bz2", bz), ("xz", xz), ("zst", zst)] {
            let whole = dir.path().join(format!("whole.{name}"));
            std::fs::write(&whole, &bytes).unwrap();
            let mut r = open(
                std::fs::File::open(&whole).unwrap(),
                1 << 30,
                &Default::default(),
                &mut false,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let mut n = 0;
            while let Some(rec) = r.next() {
                rec.unwrap_or_else(|e| panic!("{name}: {e}"));
                n += 1;
            }
            assert_eq!(n, 200, "{name}");
            let cut = dir.path().join(format!("cut.{name}"));
            std::fs::write(&cut, &bytes[..bytes.len() / 3]).unwrap();
            let err = open(
                std::fs::File::open(&cut).unwrap(),
                1 << 30,
                &Default::default(),
                &mut false,
            )
            .err()
            .and_then(|e| (e.kind != needletail::errors::ParseErrorKind::Io).then_some(e));
            // Either it opened (the first records were readable) or the error is the read's.
            assert!(err.is_none(), "{name}: {err:?}");
        }
    }
}
