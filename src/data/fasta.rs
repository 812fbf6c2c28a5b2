//! FASTA discovery, streaming and validation.
//!
//! Files are read with needletail, which detects gzip/bzip2/xz/zstd compression from the first
//! bytes, so a file's name never decides how it is decoded. Each record's sequence is checked
//! against the IUPAC nucleotide alphabet in one pass that also upper-cases it and drops line
//! breaks; only what passes reaches the caller.

use std::path::{Path, PathBuf};

use needletail::errors::ParseErrorKind;

use crate::error::{Error, Result};

/// Extensions of nucleotide FASTA files picked up when walking a directory.
pub const FASTA_EXTENSIONS: [&str; 5] = ["fa", "fasta", "fna", "ffn", "fas"];
/// Compression suffixes accepted after a FASTA extension (decoding is by content).
pub const COMPRESSION_EXTENSIONS: [&str; 4] = ["gz", "bz2", "xz", "zst"];

/// What to do with an unusable record or file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnInvalid {
    /// Stop with an error naming the file, record and position.
    #[default]
    Error,
    /// Skip it with a warning and go on.
    Skip,
}

impl std::str::FromStr for OnInvalid {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "error" => Ok(OnInvalid::Error),
            "skip" => Ok(OnInvalid::Skip),
            o => Err(Error::Invalid(format!(
                "unknown --on-invalid value '{o}': expected error or skip"
            ))),
        }
    }
}

/// True when `path`'s name ends in a FASTA extension, optionally followed by a compression one.
pub fn has_fasta_extension(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    let name = name.to_ascii_lowercase();
    let mut parts = name.rsplit('.');
    let mut last = parts.next().unwrap_or("");
    if COMPRESSION_EXTENSIONS.contains(&last) {
        last = parts.next().unwrap_or("");
    }
    name.contains('.') && FASTA_EXTENSIONS.contains(&last)
}

/// Expands the user's paths: files are taken as given, directories are walked recursively for
/// FASTA files (sorted, so runs are reproducible).
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        let meta = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
        if meta.is_dir() {
            let mut found = Vec::new();
            for entry in walkdir::WalkDir::new(p).follow_links(true) {
                let entry = entry.map_err(|e| {
                    let path = e.path().unwrap_or(p).to_path_buf();
                    Error::io(path, e.into())
                })?;
                if entry.file_type().is_file() && has_fasta_extension(entry.path()) {
                    found.push(entry.into_path());
                }
            }
            if found.is_empty() {
                return Err(Error::Invalid(format!(
                    "{}: no FASTA files found (extensions .{} optionally followed by .{})",
                    p.display(),
                    FASTA_EXTENSIONS.join(" ."),
                    COMPRESSION_EXTENSIONS.join(" .")
                )));
            }
            found.sort();
            out.extend(found);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// One validated record, borrowed from the reader's buffers.
#[derive(Debug)]
pub struct Record<'a> {
    /// First word of the header.
    pub id: &'a str,
    /// Rest of the header after the id (may be empty).
    pub description: &'a str,
    /// Upper-cased bases without line breaks.
    pub seq: &'a [u8],
    /// Count of G and C bases.
    pub gc: u64,
}

/// One record before its sequence is cleaned: for callers that stream the bases (see
/// [`read_raw`]) instead of holding a cleaned copy.
#[derive(Debug)]
pub struct RawRecord<'a> {
    pub id: &'a str,
    pub description: &'a str,
    /// The sequence lines as stored (line breaks included).
    pub raw: &'a [u8],
    /// File line of the first sequence line.
    pub first_line: u64,
}

impl RawRecord<'_> {
    /// Cleans the sequence piece by piece into `sink` (see [`clean_chunks`]).
    pub fn clean_chunks(
        &self,
        scratch: &mut Vec<u8>,
        sink: &mut dyn FnMut(&[u8]),
    ) -> std::result::Result<Cleaned, SeqProblem> {
        clean_chunks(self.raw, self.first_line, scratch, sink)
    }
}

/// Byte classes for the validation pass.
const SKIP: u8 = 0; // line breaks and blanks: formatting, not sequence
const BAD: u8 = 1; // outside the IUPAC nucleotide alphabet
const NUL: u8 = 2;
const GAP: u8 = 3; // alignment gap ('-' or '.'): removed, so later codons stay in frame
/// Maps each byte to its upper-case IUPAC letter, or to SKIP / BAD / NUL / GAP. RNA's U reads
/// as T: the codon vocabulary is DNA's, and an RNA genome is the same sequence of codons.
const fn class_table() -> [u8; 256] {
    let mut t = [BAD; 256];
    t[0] = NUL;
    t[b'\n' as usize] = SKIP;
    t[b'\r' as usize] = SKIP;
    t[b' ' as usize] = SKIP;
    t[b'\t' as usize] = SKIP;
    let iupac = b"ACGTRYSWKMBDHVN";
    let mut i = 0;
    while i < iupac.len() {
        let u = iupac[i];
        t[u as usize] = u;
        t[u.to_ascii_lowercase() as usize] = u;
        i += 1;
    }
    t[b'U' as usize] = b'T';
    t[b'u' as usize] = b'T';
    t[b'-' as usize] = GAP;
    t[b'.' as usize] = GAP;
    t
}
static CLASS: [u8; 256] = class_table();

/// Why a record's sequence was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqProblem {
    pub msg: String,
}

/// What cleaning a sequence found besides the bases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Bases kept.
    pub bases: u64,
    /// Count of G and C bases.
    pub gc: u64,
    /// Alignment gaps ('-', '.') removed.
    pub gaps: u64,
}

/// Raw sequence bytes cleaned at a time: the cleaned copy of a record never exceeds this, so
/// a chromosome-sized record costs no second copy of itself.
const CLEAN_BLOCK: usize = 1 << 16;

/// Upper-cases `raw` into `out` (cleared first), dropping line breaks and blanks, reading U as
/// T and removing alignment gaps. `first_line` is the file line of the first sequence line,
/// for messages.
pub fn clean_sequence(
    raw: &[u8],
    first_line: u64,
    out: &mut Vec<u8>,
) -> std::result::Result<Cleaned, SeqProblem> {
    out.clear();
    out.reserve(raw.len());
    let mut scratch = Vec::new();
    clean_chunks(raw, first_line, &mut scratch, &mut |c| {
        out.extend_from_slice(c)
    })
}

/// Cleans `raw` as [`clean_sequence`] does, handing the bases to `sink` in pieces of at most
/// [`CLEAN_BLOCK`] bytes (`scratch` holds the piece). On a problem, `sink` may already have seen
/// the bases before it.
pub fn clean_chunks(
    raw: &[u8],
    first_line: u64,
    scratch: &mut Vec<u8>,
    sink: &mut dyn FnMut(&[u8]),
) -> std::result::Result<Cleaned, SeqProblem> {
    let mut c = Cleaned::default();
    let mut line = first_line;
    for (k, block) in raw.chunks(CLEAN_BLOCK).enumerate() {
        scratch.clear();
        match clean_fast(block, scratch) {
            Some((newlines, gc)) => {
                line += newlines;
                c.gc += gc;
            }
            None => {
                let at = Position {
                    line,
                    base: c.bases,
                    byte: (k * CLEAN_BLOCK) as u64,
                };
                scratch.clear();
                line = clean_slow(block, at, &mut c.gaps, scratch)?;
                c.gc += scratch.iter().filter(|&&b| b == b'G' || b == b'C').count() as u64;
            }
        }
        c.bases += scratch.len() as u64;
        sink(scratch);
    }
    if c.bases == 0 {
        return Err(SeqProblem {
            msg: if c.gaps > 0 {
                "record holds only alignment gaps, no bases".into()
            } else {
                "record has a header but no sequence".into()
            },
        });
    }
    Ok(c)
}

/// Where a block starts within its record, for messages.
struct Position {
    line: u64,
    base: u64,
    byte: u64,
}

/// Translates a block line by line; `None` when anything besides IUPAC letters and line ends
/// (blanks inside a line, gaps, bad bytes, or a CR cut from its LF by the block edge) sends it
/// to [`clean_slow`]. Returns the line breaks passed and the G/C count.
fn clean_fast(block: &[u8], out: &mut Vec<u8>) -> Option<(u64, u64)> {
    let mut flags = 0u8;
    let (mut newlines, mut gc) = (0, 0);
    let mut rest = block;
    loop {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let start = out.len();
        if upper_acgt(line) {
            // The common line needs no translation: a copy and a count, both vectorised.
            out.extend_from_slice(line);
        } else {
            out.extend(line.iter().map(|&b| {
                let c = CLASS[b as usize];
                flags |= u8::from(c < b'-');
                c
            }));
        }
        gc += out[start..]
            .iter()
            .filter(|&&b| b == b'G' || b == b'C')
            .count() as u64;
        match next {
            Some(n) => {
                rest = n;
                newlines += 1;
            }
            None => break,
        }
    }
    (flags == 0).then_some((newlines, gc))
}

/// True when `line` holds only upper-case A, C, G and T (no early exit, so it vectorises).
fn upper_acgt(line: &[u8]) -> bool {
    line.iter()
        .fold(true, |ok, &b| ok & matches!(b, b'A' | b'C' | b'G' | b'T'))
}

/// Byte-by-byte cleaning of a block that needs it; returns the line after the block.
fn clean_slow(
    block: &[u8],
    at: Position,
    gaps: &mut u64,
    out: &mut Vec<u8>,
) -> std::result::Result<u64, SeqProblem> {
    let mut line = at.line;
    for (i, &b) in block.iter().enumerate() {
        let base = at.base + out.len() as u64 + 1;
        match CLASS[b as usize] {
            SKIP => line += u64::from(b == b'\n'),
            GAP => *gaps += 1,
            NUL => {
                return Err(SeqProblem {
                    msg: format!(
                        "NUL byte at base {base} (line {line}): the file looks binary or corrupt"
                    ),
                })
            }
            BAD => {
                let shown = if b.is_ascii_graphic() {
                    format!("'{}'", b as char)
                } else {
                    format!("byte 0x{b:02x}")
                };
                return Err(SeqProblem {
                    msg: format!(
                        "invalid character {shown} at base {base} (line {line}, byte {} of the \
                         sequence): not an IUPAC nucleotide code (ACGTURYSWKMBDHVN, gaps - .)",
                        at.byte + i as u64 + 1
                    ),
                });
            }
            c => out.push(c),
        }
    }
    Ok(line)
}

/// What a [`read_raw`] callback found in a record's sequence.
pub type Cleaning = std::result::Result<Cleaned, SeqProblem>;

/// Per-file outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileStats {
    pub records: u64,
    pub skipped: u64,
    pub bases: u64,
    /// Records that held alignment gaps, and the gaps removed from them.
    pub gapped_records: u64,
    pub gaps: u64,
}

/// Streams the valid records of one FASTA file into `f`, cleaned (upper-cased, one line).
///
/// With [`OnInvalid::Error`] the first problem is returned as an error naming the file, the
/// record and the position; with [`OnInvalid::Skip`] bad records are reported through `warn`
/// and skipped, and a file that cannot be read at all is skipped as a whole.
pub fn read_file(
    path: &Path,
    on_invalid: OnInvalid,
    warn: &mut dyn FnMut(String),
    f: &mut dyn FnMut(&Record<'_>, u64) -> Result<()>,
) -> Result<FileStats> {
    let mut buf = Vec::new();
    read_raw(path, on_invalid, warn, &mut |raw, pos| {
        let c = match clean_sequence(raw.raw, raw.first_line, &mut buf) {
            Ok(c) => c,
            Err(p) => return Ok(Err(p)),
        };
        let record = Record {
            id: raw.id,
            description: raw.description,
            seq: &buf,
            gc: c.gc,
        };
        f(&record, pos)?;
        Ok(Ok(c))
    })
}

/// Streams the records of one FASTA file into `f` uncleaned; `f` cleans the sequence (e.g.
/// with [`RawRecord::clean_chunks`]) and returns what cleaning found, or the problem that makes
/// the record invalid, which is then handled as [`read_file`] describes. `f` also gets the
/// reader's byte position, for progress.
pub fn read_raw(
    path: &Path,
    on_invalid: OnInvalid,
    warn: &mut dyn FnMut(String),
    f: &mut dyn FnMut(&RawRecord<'_>, u64) -> Result<Cleaning>,
) -> Result<FileStats> {
    let mut stats = FileStats::default();
    let file_err = |msg: String| Error::Fasta {
        file: path.to_path_buf(),
        record: None,
        msg,
    };
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader =
        match needletail::parse_fastx_reader(std::io::BufReader::with_capacity(1 << 20, file)) {
            Ok(r) => r,
            Err(e) => {
                let err = file_err(describe_parse_error(&e));
                return skip_or_fail(on_invalid, err, warn, stats);
            }
        };
    let mut last_id = String::new();
    while let Some(rec) = reader.next() {
        let rec = match rec {
            Ok(r) => r,
            Err(e) => {
                let mut msg = describe_parse_error(&e);
                let record = e
                    .position
                    .id
                    .as_ref()
                    .map(|h| h.split_whitespace().next().unwrap_or_default().to_string());
                if record.is_none() && !last_id.is_empty() {
                    msg.push_str(&format!(" (after record '{last_id}')"));
                }
                let err = Error::Fasta {
                    file: path.to_path_buf(),
                    record,
                    msg,
                };
                return skip_or_fail(on_invalid, err, warn, stats);
            }
        };
        if rec.format() != needletail::parser::Format::Fasta {
            let err = file_err("this is FASTQ, not FASTA: convert it first".into());
            return skip_or_fail(on_invalid, err, warn, stats);
        }
        let header = String::from_utf8_lossy(rec.id());
        let header = header.trim();
        let (id, description) = match header.split_once(char::is_whitespace) {
            Some((id, rest)) => (id, rest.trim()),
            None => (header, ""),
        };
        last_id.clear();
        last_id.push_str(id);
        let raw = RawRecord {
            id,
            description,
            raw: rec.raw_seq(),
            first_line: rec.start_line_number() + 1,
        };
        match f(&raw, rec.position().byte())? {
            Ok(c) => {
                stats.records += 1;
                stats.gaps += c.gaps;
                stats.gapped_records += u64::from(c.gaps > 0);
                stats.bases += c.bases;
            }
            Err(p) => {
                let err = Error::Fasta {
                    file: path.to_path_buf(),
                    record: Some(id.to_string()),
                    msg: p.msg,
                };
                match on_invalid {
                    OnInvalid::Error => return Err(err),
                    OnInvalid::Skip => {
                        warn(format!("skipping record: {err}"));
                        stats.skipped += 1;
                    }
                }
            }
        }
    }
    if stats.records == 0 && stats.skipped == 0 {
        let err = file_err("no records".into());
        return skip_or_fail(on_invalid, err, warn, stats);
    }
    if stats.gaps > 0 {
        warn(format!(
            "{}: removed {} alignment gap characters ('-', '.') from {} records; codons are read \
             from the ungapped sequence",
            path.display(),
            stats.gaps,
            stats.gapped_records
        ));
    }
    Ok(stats)
}

fn skip_or_fail(
    on_invalid: OnInvalid,
    err: Error,
    warn: &mut dyn FnMut(String),
    mut stats: FileStats,
) -> Result<FileStats> {
    match on_invalid {
        OnInvalid::Error => Err(err),
        OnInvalid::Skip => {
            warn(format!("skipping the rest of the file: {err}"));
            stats.skipped += 1;
            Ok(stats)
        }
    }
}

fn describe_parse_error(e: &needletail::errors::ParseError) -> String {
    match e.kind {
        ParseErrorKind::EmptyFile => "file is empty".into(),
        ParseErrorKind::UnknownFormat => {
            "not a FASTA file: it does not start with '>' (nor with a gzip/bzip2/xz/zstd header)"
                .into()
        }
        ParseErrorKind::Io => format!(
            "read failed, the file may be truncated or its compression corrupt: {}",
            e.msg
        ),
        ParseErrorKind::UnexpectedEnd => {
            format!("file ends inside a record: a header with no sequence, or a truncated file (line {})", e.position.line)
        }
        _ => format!("not valid FASTA: {}", e.msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions() {
        for ok in [
            "a.fa",
            "b.FASTA",
            "c.fna.gz",
            "d.ffn.zst",
            "e.fas.xz",
            "f.fa.bz2",
        ] {
            assert!(has_fasta_extension(Path::new(ok)), "{ok}");
        }
        for no in ["a.txt", "fa", "b.gz", "c.fastq", "d.fa.zip"] {
            assert!(!has_fasta_extension(Path::new(no)), "{no}");
        }
    }

    #[test]
    fn cleans_and_counts() {
        let mut out = Vec::new();
        let c = clean_sequence(b"acgT\r\nNNgc\n", 2, &mut out).unwrap();
        assert_eq!(out, b"ACGTNNGC");
        assert_eq!(
            c,
            Cleaned {
                bases: 8,
                gc: 4,
                gaps: 0
            }
        );
        let err = clean_sequence(b"ACGT\nAC*T", 2, &mut out).unwrap_err();
        assert!(err.msg.contains("'*' at base 7 (line 3"), "{}", err.msg);
    }

    /// RNA reads as DNA (dc757c5 accepted U, then tokenized every codon holding one as
    /// [UNK]); alignment gaps are removed so the codons after them stay in frame.
    #[test]
    fn rna_reads_as_dna_and_gaps_leave_the_frame_intact() {
        let mut out = Vec::new();
        let c = clean_sequence(b"AUGgcu\nUAA", 2, &mut out).unwrap();
        assert_eq!(out, b"ATGGCTTAA");
        assert_eq!(c.gaps, 0);
        let c = clean_sequence(b"ATG--GC.T\nT-AA", 2, &mut out).unwrap();
        assert_eq!(out, b"ATGGCTTAA");
        assert_eq!(
            c,
            Cleaned {
                bases: 9,
                gc: 3,
                gaps: 4
            }
        );
        let e = clean_sequence(b"---\n..", 2, &mut out).unwrap_err();
        assert!(e.msg.contains("only alignment gaps"), "{}", e.msg);
    }

    /// Records longer than a cleaning block: CRLF cut by a block edge, lower case, gaps and U
    /// in later blocks, against a naive byte filter; an error in a later block names the
    /// global base, line and byte.
    #[test]
    fn long_records_clean_across_blocks() {
        let mut raw = Vec::new();
        let mut line = 0u64;
        while raw.len() < 3 * CLEAN_BLOCK {
            // A first line of 21 letters, then 59, each with CRLF: the first block ends between
            // a CR and its LF.
            let n = if line == 0 { 21 } else { 59 };
            let l: Vec<u8> = (0..n)
                .map(|i| b"acgtUGCA-N"[(i + line as usize) % 10])
                .collect();
            raw.extend_from_slice(&l);
            raw.extend_from_slice(b"\r\n");
            line += 1;
        }
        assert_eq!(raw[CLEAN_BLOCK - 1], b'\r');
        let want: Vec<u8> = raw
            .iter()
            .filter(|b| !b"\r\n-".contains(b))
            .map(|b| match b.to_ascii_uppercase() {
                b'U' => b'T',
                u => u,
            })
            .collect();
        let mut out = Vec::new();
        let c = clean_sequence(&raw, 5, &mut out).unwrap();
        assert!(out == want);
        assert_eq!(c.bases, want.len() as u64);
        assert_eq!(c.gaps, raw.iter().filter(|&&b| b == b'-').count() as u64);
        let gc = want.iter().filter(|&&b| b == b'G' || b == b'C').count();
        assert_eq!(c.gc, gc as u64);

        let at = 2 * CLEAN_BLOCK + 100;
        let mut bad = raw.clone();
        bad[at] = b'*';
        let line = 5 + bad[..at].iter().filter(|&&b| b == b'\n').count();
        let base = bad[..at].iter().filter(|b| !b"\r\n-".contains(b)).count() + 1;
        let e = clean_sequence(&bad, 5, &mut out).unwrap_err();
        let expect = format!("'*' at base {base} (line {line}, byte {} of", at + 1);
        assert!(e.msg.contains(&expect), "{} vs {expect}", e.msg);
    }
}
