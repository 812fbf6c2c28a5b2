//! FASTA files → tokenized parquet dataset (`genslm tokenize`).

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::data::dataset::{DatasetWriter, Row};
use crate::data::digest::{DigestKind, Hasher};
use crate::data::fasta::{self, OnInvalid};
use crate::data::ingest_queue::{self, Budget, Item};
use crate::error::{Error, Result};
use crate::tokenizer::{CodonTokenizer, Trailing, VocabKind};

/// Settings of one ingest run (the default: GenSLM's vocabulary and trailing `[UNK]`, stop on
/// an invalid record, no progress bar).
#[derive(Debug, Clone, Default)]
pub struct IngestOptions {
    pub vocab: VocabKind,
    pub on_invalid: OnInvalid,
    pub trailing: Trailing,
    /// Show a progress bar (it still hides itself when stderr is not a terminal).
    pub progress: bool,
    /// The per-record digest column (`data::digest`).
    pub digest: DigestKind,
}

/// What an ingest run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IngestSummary {
    pub files: u64,
    pub records: u64,
    /// Records left out (`--on-invalid skip`).
    pub skipped: u64,
    /// Files left out whole (not FASTA, unreadable, no records), and files whose rest was
    /// left out after a record that could not be read.
    pub files_skipped: u64,
    pub files_cut: u64,
    pub duplicate_ids: u64,
    pub bases: u64,
    /// Codon tokens (BOS/EOS not counted).
    pub codons: u64,
    pub unk: u64,
    /// Bytes of the input files as stored on disk.
    pub input_bytes: u64,
    /// Inputs whose size is unknown (named pipes): no MB/s of input is reported then.
    pub unsized_inputs: u64,
    pub elapsed: Duration,
    pub warnings: Vec<String>,
}

impl IngestSummary {
    pub fn unk_share(&self) -> f64 {
        if self.codons == 0 {
            0.0
        } else {
            self.unk as f64 / self.codons as f64
        }
    }
    /// Input megabytes (on disk, 10^6 bytes) per second.
    pub fn mb_per_s(&self) -> f64 {
        self.input_bytes as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
    /// Sequence megabases per second.
    pub fn mbases_per_s(&self) -> f64 {
        self.bases as f64 / 1e6 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for IngestSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "files      {}", self.files - self.files_skipped)?;
        let file_notes: Vec<String> = [
            (self.files_skipped, "skipped"),
            (self.files_cut, "cut short by a bad record"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, what)| format!("{n} {what}"))
        .collect();
        if !file_notes.is_empty() {
            write!(f, " ({})", file_notes.join(", "))?;
        }
        writeln!(f)?;
        write!(f, "records    {}", self.records)?;
        if self.skipped > 0 {
            write!(f, " ({} skipped)", self.skipped)?;
        }
        if self.duplicate_ids > 0 {
            write!(f, " ({} duplicate ids)", self.duplicate_ids)?;
        }
        writeln!(f)?;
        writeln!(f, "bases      {}", self.bases)?;
        writeln!(f, "codons     {}", self.codons)?;
        writeln!(f, "[UNK]      {:.4}%", 100.0 * self.unk_share())?;
        writeln!(f, "time       {:.3} s", self.elapsed.as_secs_f64())?;
        if self.unsized_inputs > 0 {
            return write!(
                f,
                "throughput {:.1} Mbases/s (MB/s of input unknown: read from a pipe)",
                self.mbases_per_s()
            );
        }
        write!(
            f,
            "throughput {:.1} MB/s of input, {:.1} Mbases/s",
            self.mb_per_s(),
            self.mbases_per_s()
        )
    }
}

/// A file whose [UNK] share of codons passes this gets a warning.
pub const UNK_WARN_SHARE: f64 = 0.05;

/// At most this many warnings are kept in the summary (the count is always exact).
const MAX_WARNINGS: usize = 20;

/// Tokenizes every record of `inputs` (files or directories) into the parquet file `out`.
pub fn tokenize_to_parquet(
    inputs: &[PathBuf],
    out: &Path,
    opts: &IngestOptions,
) -> Result<IngestSummary> {
    let start = Instant::now();
    let mut skipped = Vec::new();
    let files = fasta::discover_or_skip(inputs, opts.on_invalid, &mut |w| {
        eprintln!("warning: {w}");
        skipped.push(w);
    })?;
    let tokenizer = CodonTokenizer::new(opts.vocab)?.with_trailing(opts.trailing);
    let specials = [tokenizer.bos_id(), tokenizer.eos_id()]
        .iter()
        .flatten()
        .count() as u64;
    let mut summary = IngestSummary {
        files: files.len() as u64,
        ..Default::default()
    };
    for f in &files {
        let meta = std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
        summary.input_bytes += meta.len();
        summary.unsized_inputs += u64::from(!meta.is_file());
    }
    // Small inputs finish before a bar would be readable.
    let bar = crate::progress::bar(
        opts.progress && summary.input_bytes >= 32 << 20,
        Some(summary.input_bytes),
        "tokenize {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    );
    let writer = DatasetWriter::create(out, opts.vocab, opts.digest)?;
    // Three threads in a line (see ingest_queue): this one parses, validates and tokenizes;
    // the next hashes each record's cleaned bases (a hash is serial within a record, and MD5
    // is as much work as the first thread's, so it gets a thread to itself); the last encodes
    // parquet.
    // On any error the writer is dropped unfinished, which removes its temporary file.
    let digest_kind = opts.digest;
    let (budget, hashed_budget) = (Budget::default(), Budget::default());
    let (mut tx, rx) = ingest_queue::queue::<OwnedRow>(&budget);
    let (mut hashed_tx, hashed_rx) = ingest_queue::queue::<OwnedRow>(&hashed_budget);
    std::thread::scope(|scope| {
        let writing = scope.spawn(move || -> Result<DatasetWriter> {
            let mut writer = writer;
            hashed_rx.drain(|item| match item {
                Item::End(Some(row)) => writer.push(&row.row()),
                _ => Ok(()),
            })?;
            Ok(writer)
        });
        let hashing = scope.spawn(move || -> Result<()> {
            let mut hasher = Hasher::new(digest_kind);
            rx.drain(|item| {
                match item {
                    Item::Bases(b) => hasher.update(b),
                    Item::End(row) => {
                        let digest = hasher.finish_hex();
                        if let Some(mut row) = row {
                            row.digest = digest;
                            let cost = row.tokens.len();
                            hashed_tx.end(Some(row), cost)?;
                        }
                    }
                }
                Ok(())
            })?;
            hashed_tx.flush()
        });
        let read = read_all(
            &files,
            &tokenizer,
            specials,
            opts,
            &bar,
            &mut summary,
            &mut tx,
        )
        .and_then(|()| tx.flush());
        drop(tx);
        // The last stage's error explains a closed queue better than the stages before it.
        let hashed = hashing.join().map_err(panicked);
        let writer = writing.join().map_err(panicked)?;
        let writer = writer?;
        hashed??;
        read?;
        // Files left out before reading are counted among the files, not the records.
        summary.files += skipped.len() as u64;
        summary.files_skipped += skipped.len() as u64;
        summary.warnings.splice(0..0, skipped.drain(..));
        if summary.records == 0 {
            return Err(Error::Invalid(format!(
                "no usable FASTA records in {} file(s); nothing written to {}",
                files.len(),
                out.display()
            )));
        }
        writer.finish()
    })?;
    bar.finish_and_clear();
    summary.elapsed = start.elapsed();
    Ok(summary)
}

/// A record's row, owned so it can cross to the writer thread.
struct OwnedRow {
    id: String,
    description: String,
    source: std::sync::Arc<str>,
    length: u64,
    gc_content: f64,
    digest: String,
    tokens: Vec<u8>,
}

impl OwnedRow {
    fn row(&self) -> Row<'_> {
        Row {
            id: &self.id,
            description: &self.description,
            source: &self.source,
            length: self.length,
            gc_content: self.gc_content,
            digest: &self.digest,
            tokens: &self.tokens,
        }
    }
}

/// Reads, validates, hashes and tokenizes every record of `files`, sending the rows to the
/// writer; fills `summary` (records, warnings, counts).
fn read_all(
    files: &[PathBuf],
    tokenizer: &CodonTokenizer,
    specials: u64,
    opts: &IngestOptions,
    bar: &indicatif::ProgressBar,
    summary: &mut IngestSummary,
    queue: &mut ingest_queue::Sender<'_, OwnedRow>,
) -> Result<()> {
    // Ids are remembered by 64-bit hash: 8 bytes per record, enough to warn on duplicates.
    let hasher = std::collections::hash_map::RandomState::new();
    let mut seen: HashSet<u64> = HashSet::new();
    let mut warnings = Vec::new();
    let mut n_warnings = 0u64;
    let mut done_bytes = 0u64;
    let mut scratch = Vec::new();
    // One-byte ids (checked by `stream` below).
    let unk = tokenizer.unk_id() as u8;
    for file in files {
        let source: std::sync::Arc<str> = file.display().to_string().into();
        let file_bytes = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
        let mut warn = |w: String| {
            n_warnings += 1;
            if warnings.len() < MAX_WARNINGS {
                bar.suspend(|| eprintln!("warning: {w}"));
                warnings.push(w);
            }
        };
        // At most as many as are printed, the rest counted (a file of a million repeated ids
        // kept a message for each).
        let (mut dup_warnings, mut dup_more) = (Vec::new(), 0u64);
        // Records with no whole codon (shorter than 3 bases, --drop-partial-codon): stored as
        // rows of no codons, which no command learns from or scores; said, not silent.
        let (mut no_codon, mut n_no_codon) = (Vec::new(), 0u64);
        let (codons_before, unk_before) = (summary.codons, summary.unk);
        // One streaming pass per record: cleaned pieces go to the tokenizer and, through the
        // queue, to the hash on the writer thread, so no cleaned copy of a chromosome is held.
        let stats = fasta::read_raw(file, opts.on_invalid, &mut warn, &mut |rec, pos| {
            // Cleaning only drops bytes: the raw length bounds the tokens.
            let mut tokens = Vec::with_capacity(tokenizer.n_tokens(rec.raw.len()));
            let mut codons = tokenizer.stream()?;
            let cleaned = rec.clean_chunks(&mut scratch, &mut |piece| {
                queue.bases(piece);
                codons.push(piece, &mut tokens);
            });
            let cleaned = match cleaned {
                Ok(c) => c,
                Err(problem) => {
                    queue.end(None, 0)?;
                    return Ok(Err(problem));
                }
            };
            codons.finish(&mut tokens);
            if !seen.insert(hasher.hash_one(rec.id)) {
                summary.duplicate_ids += 1;
                if dup_warnings.len() < MAX_WARNINGS {
                    dup_warnings.push(format!(
                        "{}: duplicate record id '{}' (kept)",
                        file.display(),
                        crate::error::short_id(rec.id)
                    ));
                } else {
                    dup_more += 1;
                }
            }
            if tokens.len() as u64 == specials && no_codon.len() < 5 {
                no_codon.push(rec.id.to_string());
            }
            n_no_codon += u64::from(tokens.len() as u64 == specials);
            summary.codons += tokens.len() as u64 - specials;
            summary.unk += count_id(&tokens, unk);
            let row = OwnedRow {
                id: rec.id.to_string(),
                description: rec.description.to_string(),
                source: source.clone(),
                length: cleaned.bases,
                gc_content: cleaned.gc as f64 / cleaned.bases as f64,
                digest: String::new(), // hashed on the hashing thread
                tokens,
            };
            // A closed queue means the writer failed; its error is reported instead.
            let cost = row.tokens.len();
            queue.end(Some(row), cost)?;
            bar.set_position(done_bytes + pos.min(file_bytes));
            Ok(Ok(cleaned))
        })?;
        for w in dup_warnings {
            warn(w);
        }
        // Counted only: the warnings above filled what is printed.
        for _ in 0..dup_more {
            warn(String::new());
        }
        if n_no_codon > 0 {
            warn(format!(
                "{}: {n_no_codon} record(s) hold no whole codon ({}{}): stored with no codons \
                 (nothing to learn from or score)",
                file.display(),
                no_codon.join(", "),
                if n_no_codon > 5 { ", …" } else { "" }
            ));
        }
        let (codons, unk) = (summary.codons - codons_before, summary.unk - unk_before);
        if codons > 0 && unk as f64 > UNK_WARN_SHARE * codons as f64 {
            warn(format!(
                "{}: {:.1}% of its codons are [UNK] (ambiguous bases such as N, or protein \
                 rather than nucleotide sequence?); the model learns nothing from them",
                file.display(),
                100.0 * unk as f64 / codons as f64
            ));
        }
        summary.records += stats.records;
        summary.skipped += stats.skipped;
        summary.files_skipped += u64::from(stats.file_skipped);
        summary.files_cut += u64::from(stats.rest_skipped);
        summary.bases += stats.bases;
        done_bytes += file_bytes;
        bar.set_position(done_bytes);
    }
    if n_warnings as usize > warnings.len() {
        // Said, not only kept: nothing printed the summary's copy, so a capped list ended
        // without a word of the rest.
        let more = format!(
            "... {} more warnings not shown",
            n_warnings as usize - warnings.len()
        );
        bar.suspend(|| eprintln!("warning: {more}"));
        warnings.push(more);
    }
    summary.warnings = warnings;
    Ok(())
}

/// Occurrences of `id` in `ids`. Counted in byte lanes 255 ids at a time so that it vectorises
/// (a plain filter-count widened each byte to a 64-bit sum, 4% of the reading thread).
fn count_id(ids: &[u8], id: u8) -> u64 {
    ids.chunks(255)
        .map(|c| u64::from(c.iter().fold(0u8, |n, &t| n + u8::from(t == id))))
        .sum()
}

/// A worker thread's panic as an error.
fn panicked(p: Box<dyn std::any::Any + Send>) -> Error {
    let why = crate::error::panic_message(p.as_ref()).unwrap_or_default();
    Error::Invalid(format!("an ingest thread panicked: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_id_counts_across_its_lanes() {
        let ids: Vec<u8> = (0..2000u32).map(|i| (i * i % 7) as u8).collect();
        for id in 0..8 {
            let want = ids.iter().filter(|&&t| t == id).count() as u64;
            assert_eq!(count_id(&ids, id), want, "id {id}");
        }
        assert_eq!(count_id(&[3; 600], 3), 600);
    }
}
