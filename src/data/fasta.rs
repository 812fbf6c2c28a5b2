//! FASTA discovery, streaming and validation.
//!
//! Files are read with needletail, which detects gzip/bzip2/xz/zstd compression from the first
//! bytes, so a file's name never decides how it is decoded. Each record's sequence is checked
//! against the IUPAC nucleotide alphabet in one pass that also upper-cases it and drops line
//! breaks; only what passes reaches the caller.

use std::path::{Path, PathBuf};

use needletail::errors::ParseErrorKind;

use super::fasta_errors::describe_parse_error;
use super::fastx_open::{self, Overflow, OverflowCell};

pub use crate::data::clean::{clean_chunks, clean_sequence, Cleaned, SeqProblem};
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
/// Each file found is noted as an input of this command ([`crate::atomic::note_input`]): an
/// output created before the file is read is refused then, not after the work.
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let files = discover_or_skip(paths, OnInvalid::Error, &mut |_| {})?;
    files.iter().for_each(|f| crate::atomic::note_input(f));
    Ok(files)
}

/// [`discover`], where with [`OnInvalid::Skip`] an entry of a directory that cannot be read
/// (a dangling link, a subdirectory without permission) is reported through `warn` and
/// skipped, as an unreadable file is by [`read_file`]. The paths given are always required.
pub fn discover_or_skip(
    paths: &[PathBuf],
    on_invalid: OnInvalid,
    warn: &mut dyn FnMut(String),
) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for p in paths {
        if p.as_os_str() == "-" && !p.exists() {
            // The Unix convention for standard input: inputs here are named files (their names
            // go into the dataset's sources); a named pipe works, so point to one.
            return Err(Error::Invalid(
                "-: '-' is not read as standard input; give the file, /dev/stdin (`zcat \
                 genome.fa.gz | genslm … --fasta /dev/stdin`), or a process substitution such \
                 as <(zcat genome.fa.gz)"
                    .into(),
            ));
        }
        let meta = std::fs::metadata(p).map_err(|e| Error::io(p, e))?;
        if meta.is_dir() {
            let (mut found, mut passed_over) = (Vec::new(), None);
            for entry in walkdir::WalkDir::new(p).follow_links(true) {
                let entry = match entry {
                    Ok(entry) => entry,
                    Err(e) => {
                        let path = e.path().unwrap_or(p).to_path_buf();
                        let err = Error::io(path, e.into());
                        match on_invalid {
                            OnInvalid::Error => return Err(err),
                            OnInvalid::Skip => {
                                warn(format!("skipping: {err}"));
                                continue;
                            }
                        }
                    }
                };
                if entry.file_type().is_file() && has_fasta_extension(entry.path()) {
                    found.push(entry.into_path());
                } else if !entry.file_type().is_dir() && has_fasta_extension(entry.path()) {
                    // A named pipe or device under a FASTA name: never read from a walk (a
                    // pipe would block it), named below if nothing else is found.
                    passed_over.get_or_insert(entry.into_path());
                }
            }
            if found.is_empty() {
                let passed = match &passed_over {
                    Some(f) => format!(
                        "; passed over {} ({}): name it directly to read it",
                        f.display(),
                        crate::error::not_a_file(f)
                    ),
                    None => String::new(),
                };
                return Err(Error::Invalid(format!(
                    "{}: no FASTA files found (extensions .{} optionally followed by .{}){passed}",
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
    refuse_repeats(&out)?;
    Ok(out)
}

/// Refuses a file reached twice (named twice, under another spelling, or inside a directory
/// also given): its records would count twice, and in training land in both the training
/// and the validation split.
fn refuse_repeats(files: &[PathBuf]) -> Result<()> {
    let mut seen: Vec<((u64, u64), &PathBuf)> = Vec::with_capacity(files.len());
    for f in files {
        let Some(id) = crate::atomic::identity(f) else {
            continue;
        };
        if let Some((_, first)) = seen.iter().find(|(i, _)| *i == id) {
            return Err(Error::Invalid(format!(
                "{} and {} are the same file, given twice (directly, or within a directory \
                 also given): its records would count twice; give it once",
                first.display(),
                f.display()
            )));
        }
        seen.push((id, f));
    }
    Ok(())
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

/// What a [`read_raw`] callback found in a record's sequence.
pub type Cleaning = std::result::Result<Cleaned, SeqProblem>;

/// Record ids seen more than once across the inputs, for one warning at the end. Each id is
/// kept as a 64-bit hash (8 bytes per record, whatever the ids' length).
#[derive(Default)]
pub struct DuplicateIds {
    seen: std::collections::HashSet<u64>,
    hasher: std::hash::RandomState,
    count: u64,
    first: Option<String>,
}

impl DuplicateIds {
    pub fn see(&mut self, id: &str) {
        use std::hash::BuildHasher;
        if !self.seen.insert(self.hasher.hash_one(id)) {
            self.count += 1;
            self.first.get_or_insert_with(|| id.to_string());
        }
    }

    /// The warning to print, if any id repeated; `rows` says what the output holds per record.
    pub fn warning(&self, rows: &str) -> Option<String> {
        let first = self.first.as_ref()?;
        Some(format!(
            "{} record(s) repeat an id seen before (the first: '{}'); {rows} in input \
             order, so rows of one id are told apart only by their position",
            self.count,
            crate::error::short_id(first)
        ))
    }
}

/// Per-file outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileStats {
    pub records: u64,
    /// Records left out (`--on-invalid skip`).
    pub skipped: u64,
    /// The whole file left out (unreadable before its first record, or holding none), or the
    /// rest of it after a record it could not read: counted apart from records, which such a
    /// skip does not count ("records 1 (2 skipped)" counted two files).
    pub file_skipped: bool,
    pub rest_skipped: bool,
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
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        // An unreadable file (no permission) is one of the things skip skips.
        Err(e) if on_invalid == OnInvalid::Skip => {
            warn(format!("skipping the file: {}", Error::io(path, e)));
            stats.file_skipped = true;
            return Ok(stats);
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    crate::atomic::note_input(path);
    let mut compressed = false;
    let overflow = OverflowCell::default();
    let limit = fastx_open::record_limit();
    let watch = fastx_open::Unchanged::watch(&file);
    let mut reader = match fastx_open::open(file, limit, &overflow, &mut compressed) {
        Ok(r) => r,
        Err(e) => {
            let err = file_err(describe_parse_error(&e, path, compressed));
            return skip_or_fail(on_invalid, err, warn, stats);
        }
    };
    let mut last_id = String::new();
    let (mut non_utf8, mut first_non_utf8) = (0u64, String::new());
    while let Some(rec) = reader.next() {
        let rec = match rec {
            Ok(r) => r,
            Err(e) => {
                let taken = overflow.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(o) = taken {
                    // Not skippable: the memory is the machine's, not the record's fault.
                    return Err(too_long(path, &o));
                }
                let mut msg = describe_parse_error(&e, path, compressed);
                let record = e
                    .position
                    .id
                    .as_ref()
                    .map(|h| h.split_whitespace().next().unwrap_or_default().to_string());
                if record.is_none() && !last_id.is_empty() {
                    msg.push_str(&format!(
                        " (after record '{}')",
                        crate::error::short_id(&last_id)
                    ));
                }
                // gzip and zstd check their data only at the end of a stream, bzip2 after a
                // block is handed on: the records read before the damage may be damaged too
                // (bit flips kept altered sequences and garbled ids with exit 0), so the file
                // cannot be skipped from here on; the run stops and writes nothing.
                let damaged = compressed && e.kind == ParseErrorKind::Io;
                if damaged {
                    msg.push_str(
                        "; a damaged compressed file is not skipped, since its decompressor \
                         checks the data only after handing it on and the records before the \
                         damage cannot be trusted: repair or remove the file",
                    );
                }
                let err = Error::Fasta {
                    file: path.to_path_buf(),
                    record,
                    msg,
                };
                if damaged {
                    return Err(err);
                }
                return skip_or_fail(on_invalid, err, warn, stats);
            }
        };
        if rec.format() != needletail::parser::Format::Fasta {
            let err = file_err("this is FASTQ, not FASTA: convert it first".into());
            return skip_or_fail(on_invalid, err, warn, stats);
        }
        let header = String::from_utf8_lossy(rec.id());
        if matches!(header, std::borrow::Cow::Owned(_)) {
            non_utf8 += 1;
            if non_utf8 == 1 {
                first_non_utf8 = header.split_whitespace().next().unwrap_or("").to_string();
            }
        }
        let header = header.trim();
        let (id, description) = match header.split_once(char::is_whitespace) {
            Some((id, rest)) => (id, rest.trim()),
            None => (header, ""),
        };
        // Every output (the dataset, score's and embed's rows, variants' CHROM) is keyed by
        // the id; a record without one could not be told apart from another, and one holding
        // control characters (NUL, a terminal's escape sequences) was written raw into TSV
        // rows and printed to terminals.
        let control = id.chars().find(|c| c.is_control());
        if id.is_empty() || control.is_some() {
            let line = rec.start_line_number();
            let after = if last_id.is_empty() {
                String::new()
            } else {
                format!(", after record '{}',", crate::error::short_id(&last_id))
            };
            let err = file_err(match control {
                None => format!(
                    "the record at line {line}{after} has an empty header (no id after '>'); \
                     give it a name"
                ),
                Some(c) => format!(
                    "the record at line {line}{after} has a control character ({}) in its id \
                     '{}'; ids are written into tables and printed, so rename it",
                    c.escape_unicode(),
                    crate::error::short_id(id)
                ),
            });
            match on_invalid {
                OnInvalid::Error => return Err(err),
                OnInvalid::Skip => {
                    warn(format!("skipping record: {err}"));
                    stats.skipped += 1;
                    continue;
                }
            }
        }
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
    // Not skippable: the records already handed on are the ones that may be cut.
    if let Some(msg) = watch.and_then(|w| w.changed()) {
        return Err(file_err(msg));
    }
    if stats.records == 0 && stats.skipped == 0 && !stats.rest_skipped {
        let err = file_err("no records".into());
        return skip_or_fail(on_invalid, err, warn, stats);
    }
    if non_utf8 > 0 {
        warn(format!(
            "{}: {non_utf8} record header(s) hold bytes that are not UTF-8 (the first: \
             '{first_non_utf8}'); they are stored with U+FFFD (\u{FFFD}) in place of those \
             bytes. Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) to keep them",
            path.display()
        ));
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

/// A record that outgrew the memory available, named with how far it got.
fn too_long(path: &Path, o: &Overflow) -> Error {
    let gb = |b: u64| b as f64 / 1e9;
    Error::Fasta {
        file: path.to_path_buf(),
        record: Some(
            o.header
                .split_whitespace()
                .next()
                .unwrap_or("?")
                .to_string(),
        ),
        msg: format!(
            "this record is longer than this machine's memory allows: stopped after {:.2} GB \
             of it, past the limit of {:.2} GB (a quarter of the memory available, for the \
             reader's buffers). Split it, or read it where there is more memory",
            gb(o.read),
            gb(o.limit)
        ),
    }
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
            // Nothing read yet: the whole file is skipped (and nothing of it was kept).
            if stats.records == 0 && stats.skipped == 0 {
                warn(format!("skipping the file: {err}"));
                stats.file_skipped = true;
            } else {
                warn(format!("skipping the rest of the file: {err}"));
                stats.rest_skipped = true;
            }
            Ok(stats)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first problem `read_raw` reports for a file holding `bytes`.
    fn problem(bytes: &[u8]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.fa");
        std::fs::write(&p, bytes).unwrap();
        let r = read_raw(&p, OnInvalid::Error, &mut |_| {}, &mut |_, _| {
            Ok(Ok(Default::default()))
        });
        r.unwrap_err().to_string()
    }

    #[test]
    fn files_a_user_hit_get_messages_that_say_what_is_wrong() {
        let e = problem(b"\xEF\xBB\xBF>a\nACGT\n");
        assert!(e.contains("byte-order mark"), "{e}");
        let e = problem(b"\n\n  >a\nACGT\n");
        assert!(
            e.contains("blank lines or spaces before its first '>'"),
            "{e}"
        );
        let e = problem(b">a\rACGT\r>b\rACGT\r");
        assert!(e.contains("lines end in CR alone"), "{e}");
        let e = problem(b">");
        assert!(e.contains("no record"), "{e}");
        let e = problem(b"");
        assert!(e.contains("file is empty"), "{e}");
        let e = problem(b"hello\n");
        assert!(e.contains("does not start with '>'"), "{e}");
    }

    #[test]
    fn a_record_without_an_id_is_invalid() {
        let e = problem(b">\nACGT\n");
        assert!(e.contains("line 1 has an empty header"), "{e}");
        // Control characters in an id: refused, and named without being printed raw.
        let e = problem(b">a\x1b[31mred\nACGT\n");
        assert!(
            e.contains("a control character (\\u{1b}) in its id 'a\\u{1b}[31mred'"),
            "{e}"
        );
        assert!(!e.contains('\x1b'), "{e}");
        let e = problem(b">nul\x00id\nACGT\n");
        assert!(e.contains("control character (\\u{0})"), "{e}");
        let e = problem(b">a\nACGT\n>  \t\nACGT\n");
        assert!(
            e.contains("line 3, after record 'a', has an empty header"),
            "{e}"
        );
        // Skipped with --on-invalid skip: the named records are read, the other counted.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.fa");
        std::fs::write(&p, b">a\nACGT\n>\nACGT\n>b\nACGT\n").unwrap();
        let (mut ids, mut warnings) = (Vec::new(), Vec::new());
        let stats = read_file(
            &p,
            OnInvalid::Skip,
            &mut |w| warnings.push(w),
            &mut |r, _| {
                ids.push(r.id.to_string());
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!((stats.records, stats.skipped), (2, 1));
        assert!(warnings[0].contains("line 3"), "{warnings:?}");
    }

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
}
