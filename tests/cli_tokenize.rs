//! `genslm tokenize` end to end: the bundled genomes, independent checks of GC and md5, and one
//! test per class of bad input.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use common::{gzip, listing, repo, run, write};
use genslm::data::dataset::read_dataset;
use genslm::data::digest::DigestKind;
use genslm::tokenizer::{CodonTokenizer, VocabKind};

/// `genslm tokenize --fasta INPUT --out OUT EXTRA…`: (exit ok, stdout, stderr).
fn tokenize(input: &Path, out: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["tokenize", "--fasta", input.to_str().unwrap(), "--out"];
    args.push(out.to_str().unwrap());
    args.extend(extra);
    run(&args)
}

/// A deliberately naive FASTA reader for the reference side: (header, sequence) pairs.
fn naive_fasta(path: &Path) -> Vec<(String, String)> {
    let mut bytes = Vec::new();
    let f = std::fs::File::open(path).unwrap();
    if path.extension().is_some_and(|e| e == "gz") {
        flate2::read::MultiGzDecoder::new(f)
            .read_to_end(&mut bytes)
            .unwrap();
    } else {
        std::io::BufReader::new(f).read_to_end(&mut bytes).unwrap();
    }
    let text = String::from_utf8(bytes).unwrap();
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if let Some(h) = line.strip_prefix('>') {
            out.push((h.to_string(), String::new()));
        } else {
            out.last_mut().unwrap().1.push_str(&line.to_uppercase());
        }
    }
    out
}

/// md5 from coreutils' `md5sum`, an implementation independent of ours.
fn md5sum(data: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("md5sum (coreutils) is installed");
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..32].to_string()
}

#[test]
fn bundled_genomes_tokenize_with_correct_columns() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("data.parquet");
    let data = repo().join("data");
    // MD5 here, against coreutils' md5sum; the default digest (XXH3-128) is checked against
    // Python's xxhash by scripts/check_dataset.py in scripts/test.sh.
    let (ok, _, err) = tokenize(&data, &out, &["--digest", "md5"]);
    assert!(ok, "{err}");
    assert!(
        err.contains("records") && err.contains("MB/s"),
        "summary: {err}"
    );
    let (vocab, rows) = read_dataset(&out).unwrap();
    assert_eq!(vocab, VocabKind::Genslm69);

    let mut expected = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "md"))
        .collect();
    files.sort();
    for f in &files {
        for (h, s) in naive_fasta(f) {
            expected.push((f.clone(), h, s));
        }
    }
    assert_eq!(rows.len(), expected.len());
    assert!(rows.len() >= 25);
    let tok = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
    for (row, (file, header, seq)) in rows.iter().zip(&expected) {
        let id = header.split_whitespace().next().unwrap();
        assert_eq!(row.id, id);
        assert_eq!(row.description, header[id.len()..].trim());
        assert_eq!(Path::new(&row.source), file.as_path());
        assert_eq!(row.length as usize, seq.len());
        let gc = seq.chars().filter(|&c| c == 'G' || c == 'C').count() as f64 / seq.len() as f64;
        assert!((row.gc_content - gc).abs() < 1e-12, "{id}");
        assert_eq!(row.digest_kind, DigestKind::Md5);
        assert_eq!(row.digest, md5sum(seq.as_bytes()), "{id}");
        assert_eq!(row.tokens.len(), seq.len().div_ceil(3));
        // Whole codons decode to themselves, or NNN when any base is not ACGT; a partial
        // trailing codon is [UNK], which also decodes to NNN.
        let expect_dna: String = seq
            .as_bytes()
            .chunks(3)
            .map(|c| {
                if c.len() == 3 && c.iter().all(|b| b"ACGT".contains(b)) {
                    String::from_utf8(c.to_vec()).unwrap()
                } else {
                    "NNN".to_string()
                }
            })
            .collect();
        assert_eq!(tok.decode(&row.tokens).unwrap(), expect_dna, "{id}");
    }
    // Lambda's GC content is a published figure: 49.86%.
    let lambda = rows.iter().find(|r| r.id.contains("NC_001416")).unwrap();
    assert!(
        (lambda.gc_content - 0.4986).abs() < 5e-4,
        "{}",
        lambda.gc_content
    );
}

#[test]
fn crlf_and_lowercase_read_like_lf() {
    let dir = tempfile::tempdir().unwrap();
    let lf = write(
        dir.path(),
        "lf.fa",
        b">r1 first\nACGTAC\nGGT\n>r2\nTTTAAA\n",
    );
    let crlf = write(
        dir.path(),
        "crlf.fa",
        b">r1 first\r\nacgtac\r\nggt\r\n>r2\r\ntttaaa\r\n",
    );
    let mut rows = Vec::new();
    for p in [&lf, &crlf] {
        let out = dir.path().join("o.parquet");
        let (ok, _, err) = tokenize(p, &out, &[]);
        assert!(ok, "{err}");
        rows.push(read_dataset(&out).unwrap().1);
    }
    for (a, b) in rows[0].iter().zip(&rows[1]) {
        assert_eq!(
            (&a.id, &a.description, &a.tokens, &a.digest),
            (&b.id, &b.description, &b.tokens, &b.digest)
        );
    }
    assert_eq!(rows[0][0].description, "first");
    assert_eq!(rows[0][0].length, 9);
}

#[test]
fn compression_detected_by_content_not_name() {
    let dir = tempfile::tempdir().unwrap();
    // A gzip file without .gz in its name.
    let p = write(dir.path(), "x.fa", &gzip(b">r\nATGAAA\n"));
    let out = dir.path().join("o.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(ok, "{err}");
    assert_eq!(read_dataset(&out).unwrap().1[0].tokens, vec![10, 16]);
}

#[test]
fn duplicate_ids_are_kept_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "d.fa", b">same\nATG\n>same\nAAA\n");
    let out = dir.path().join("o.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(ok, "{err}");
    assert!(err.contains("duplicate record id 'same'"), "{err}");
    assert_eq!(read_dataset(&out).unwrap().1.len(), 2);
}

/// Tokenizes one FASTA text; returns (tokens of each record, stderr).
fn tokenize_text(text: &[u8]) -> (Vec<Vec<u32>>, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "in.fa", text);
    let out = dir.path().join("o.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(ok, "{err}");
    let rows = read_dataset(&out).unwrap().1;
    (rows.into_iter().map(|r| r.tokens).collect(), err)
}

/// An RNA genome (U) gives the ids of the same sequence written with T (dc757c5 turned every
/// codon with a U into [UNK], silently).
#[test]
fn rna_tokenizes_like_dna() {
    let (rna, err) = tokenize_text(b">r\nAUGGCUuuaCCGUAA\n");
    let (dna, _) = tokenize_text(b">r\nATGGCTttaCCGTAA\n");
    assert_eq!(rna, dna);
    let tok = CodonTokenizer::new(VocabKind::Genslm69).unwrap();
    assert_eq!(rna[0], tok.encode(b"ATGGCTTTACCGTAA"));
    assert!(!rna[0].contains(&tok.unk_id()));
    assert!(!err.contains("codons are [UNK]"), "{err}");
}

/// Alignment gaps are removed with a warning naming the file; the codons after a gap stay in
/// frame (dc757c5 counted '-' as a base and shifted every later codon).
#[test]
fn gaps_are_removed_with_a_warning_and_keep_the_frame() {
    let (gapped, err) = tokenize_text(b">a\nATG-GCT--TTA\n>b\nCCG\n");
    let (plain, _) = tokenize_text(b">a\nATGGCTTTA\n>b\nCCG\n");
    assert_eq!(gapped, plain);
    assert!(
        err.contains("in.fa") && err.contains("removed 3 alignment gap"),
        "{err}"
    );
    assert!(err.contains("from 1 records"), "{err}");
}

/// A file that is mostly ambiguous bases gets a warning with its [UNK] share.
#[test]
fn a_high_unk_share_is_reported() {
    let (_, err) = tokenize_text(b">n\nATGNNNNNNNNNGCT\n");
    assert!(err.contains("60.0% of its codons are [UNK]"), "{err}");
    let (_, err) = tokenize_text(b">ok\nATGGCTTTACCGTAA\n");
    assert!(!err.contains("codons are [UNK]"), "{err}");
}

/// Runs tokenize on one bad file; checks the failure, the message and that no output is left.
fn expect_failure(name: &str, bytes: &[u8], must_contain: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), name, bytes);
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(!ok, "{name} should fail");
    assert!(err.contains(name), "message names the file: {err}");
    for m in must_contain {
        assert!(err.contains(m), "message for {name} lacks '{m}': {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        listing(dir.path()),
        vec![name.to_string()],
        "nothing half-written left"
    );
}

/// A file compressed twice is named as such (its decompressed text "did not start with '>'").
#[test]
fn a_file_compressed_twice_is_named() {
    expect_failure(
        "twice.fa.gz.gz",
        &gzip(&gzip(b">r\nATGAAA\n")),
        &["compressed twice"],
    );
}

#[test]
fn bad_character_names_record_and_position() {
    expect_failure(
        "bad.fa",
        b">ok\nACGT\n>broken some text\nACGTACGT\nACG*T\n",
        &["record 'broken'", "'*' at base 12", "line 5"],
    );
}

#[test]
fn nul_byte() {
    expect_failure(
        "nul.fa",
        b">r1\nACG\0TT\n",
        &["record 'r1'", "NUL byte at base 4"],
    );
}

#[test]
fn record_without_an_id() {
    expect_failure(
        "noid.fa",
        b">r1\nACGT\n> \nACGT\n",
        &["line 3, after record 'r1', has an empty header"],
    );
}

#[test]
fn empty_file() {
    expect_failure("empty.fa", b"", &["empty"]);
}

#[test]
fn header_only_file() {
    expect_failure(
        "header.fa",
        b">lonely header\n",
        &["header with no sequence", "line 1"],
    );
}

#[test]
fn truncated_gzip() {
    let mut seq = b">r\n".to_vec();
    for i in 0..20000 {
        seq.extend_from_slice(if i % 7 == 0 {
            b"ACGTTGCA\n"
        } else {
            b"GGCATTAC\n"
        });
    }
    let gz = gzip(&seq);
    expect_failure("cut.fa.gz", &gz[..gz.len() / 2], &["truncated"]);
}

#[test]
fn not_fasta() {
    expect_failure(
        "picture.fa",
        b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
        &["not a FASTA file"],
    );
    expect_failure("table.fa", b"id,sequence\nr1,ACGT\n", &["not a FASTA file"]);
    expect_failure("reads.fa", b"@read1\nACGT\n+\nIIII\n", &["FASTQ"]);
}

/// A compressed file's first bytes decide how it is read, and messages say what failed: one
/// byte that is no '>' is not FASTA (it read as "holds no record"), and text inside a gzip
/// that is not FASTA says so (it blamed the gzip header, which is fine).
#[test]
fn a_one_byte_file_and_a_compressed_non_fasta_are_named() {
    expect_failure(
        "onex.fa",
        b"x",
        &["not a FASTA file: it does not start with '>'"],
    );
    expect_failure(
        "xy.fa.gz",
        &gzip(b"xy\n"),
        &["its decompressed text does not start with '>'"],
    );
}

/// A zstd file that starts with a skippable frame (pzstd writes one) reads as `zstd -dc` reads
/// it: it was refused as "not a FASTA file".
#[test]
fn a_zstd_file_starting_with_a_skippable_frame_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let fasta = b">a\nACGTTT\n>b\nGGGCCC\n";
    // Magic 0x184D2A50 (little-endian), a 4-byte frame size, 4 bytes of user data.
    let mut bytes = vec![0x50, 0x2A, 0x4D, 0x18, 4, 0, 0, 0, 1, 2, 3, 4];
    bytes.extend(zstd::encode_all(&fasta[..], 3).unwrap());
    let p = write(dir.path(), "pz.fa.zst", &bytes);
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(ok, "{err}");
    let (_, rows) = read_dataset(&out).unwrap();
    assert_eq!(
        rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
}

/// A bit flipped inside a gzip file: gzip checks its CRC only at the end, so under
/// `--on-invalid skip` the records read before the damage were kept — altered sequences and
/// garbled ids, exit 0. A damaged compressed file now stops the run, skip or not, and nothing
/// is written.
#[test]
fn a_damaged_compressed_file_is_not_skipped() {
    let mut text = Vec::new();
    let mut rng = genslm::rng::SplitMix64::new(9);
    for i in 0..400 {
        text.extend_from_slice(format!(">r{i}\n").as_bytes());
        text.extend((0..600).map(|_| b"ACGT"[rng.below(4) as usize]));
        text.push(b'\n');
    }
    let mut gz = gzip(&text);
    let mid = gz.len() / 2;
    gz[mid] ^= 8;
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "flip.fa.gz", &gz);
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(&p, &out, &["--on-invalid", "skip"]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("flip.fa.gz") && err.contains("damaged compressed file is not skipped"),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn skip_mode_skips_bad_records_with_warnings() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "a.fa",
        b">good1\nATGAAA\n>bad\nAT#G\n>empty\n>good2\nTTT\n",
    );
    write(dir.path(), "b.fasta", b"not fasta at all\n");
    write(dir.path(), "notes.txt", b"ignored: not a FASTA extension\n");
    // A link whose target is gone: skipped like an unreadable file (it stopped the walk).
    std::os::unix::fs::symlink(dir.path().join("moved.fa"), dir.path().join("gone.fa")).unwrap();
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(dir.path(), &out, &["--on-invalid", "skip"]);
    assert!(ok, "{err}");
    let summary = &err;
    // Counted as what they are: two records (bad, empty) and two files (b.fasta, gone.fa);
    // skipped files were counted as skipped records.
    assert!(
        summary.contains("files      1 (2 skipped)\n")
            && summary.contains("records    2 (2 skipped)\n"),
        "{summary}"
    );
    assert!(
        err.contains("warning: skipping record") && err.contains("'bad'"),
        "{err}"
    );
    assert!(err.contains("'empty'") && err.contains("b.fasta"), "{err}");
    assert!(
        err.contains("warning: skipping: ") && err.contains("gone.fa"),
        "{err}"
    );
    let ids: Vec<String> = read_dataset(&out)
        .unwrap()
        .1
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(ids, vec!["good1", "good2"]);
}

/// A record with no whole codon under --drop-partial-codon is kept as a row of no codons,
/// and said (it was silent).
#[test]
fn a_record_of_no_whole_codon_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "short.fa", b">a\nAT\n>b\nATGAAA\n");
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(&p, &out, &["--drop-partial-codon"]);
    assert!(ok, "{err}");
    assert!(err.contains("1 record(s) hold no whole codon (a)"), "{err}");
    let rows = read_dataset(&out).unwrap().1;
    assert_eq!((rows.len(), rows[0].tokens.len()), (2, 0));
    let (ok, _, err) = tokenize(&p, &dir.path().join("unk.parquet"), &[]);
    assert!(ok && !err.contains("no whole codon"), "{err}");
}

#[test]
fn nothing_usable_is_an_error_even_when_skipping() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "all_bad.fa", b">x\n12345\n");
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(&p, &out, &["--on-invalid", "skip"]);
    assert!(!ok);
    assert!(err.contains("no usable FASTA records"), "{err}");
    assert_eq!(listing(dir.path()), vec!["all_bad.fa"]);
}

#[test]
fn missing_input_and_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.parquet");
    let (ok, _, err) = tokenize(Path::new("/no/such/file.fa"), &out, &[]);
    assert!(!ok && err.contains("/no/such/file.fa"), "{err}");
    let empty = dir.path().join("empty_dir");
    std::fs::create_dir(&empty).unwrap();
    let (ok, _, err) = tokenize(&empty, &out, &[]);
    assert!(!ok && err.contains("no FASTA files found"), "{err}");
}

#[test]
fn vocab71_wraps_records() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "v.fa", b">r\nGGCTAG\n");
    let out = dir.path().join("o.parquet");
    let (ok, _, err) = tokenize(&p, &out, &["--vocab", "genslm71"]);
    assert!(ok, "{err}");
    let (vocab, rows) = read_dataset(&out).unwrap();
    assert_eq!(vocab, VocabKind::Genslm71);
    assert_eq!(rows[0].tokens, vec![2, 7, 70, 3]);
}

/// A one-record gzip bomb: 4 GiB of sequence from about 4 MB of file (concatenated gzip
/// members), read under an address-space limit of 2 GiB (`ulimit -v`, as some batch systems
/// set). The record limit, a quarter of the memory left, stops it with a message naming the
/// record, instead of memory growing until the process is killed.
#[test]
fn a_record_larger_than_memory_allows_is_refused_not_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let mut file = gzip(b">chr1 a bomb\n");
    let block = gzip(&vec![b'A'; 1 << 20]);
    for _ in 0..4096 {
        file.extend_from_slice(&block);
    }
    let bomb = write(dir.path(), "bomb.fa.gz", &file);
    let out = dir.path().join("bomb.parquet");
    let script = format!(
        "ulimit -v 2097152 && exec '{}' tokenize --fasta '{}' --out '{}' --quiet",
        env!("CARGO_BIN_EXE_genslm"),
        bomb.display(),
        out.display()
    );
    let o = Command::new("sh").args(["-c", &script]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bomb.fa.gz")
            && err.contains("chr1")
            && err.contains("longer than this machine's memory allows"),
        "{err}"
    );
    assert_eq!(listing(dir.path()), ["bomb.fa.gz"]);
}

/// A header in Latin-1 ('é' as the byte 0xE9): kept, with U+FFFD for the byte, and said so.
#[test]
fn non_utf8_headers_are_kept_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "l.fa", b">ok\nATG\n>caf\xe9 de Paris\nAAA\n");
    let out = dir.path().join("o.parquet");
    let (ok, _, err) = tokenize(&p, &out, &[]);
    assert!(ok, "{err}");
    assert!(
        err.contains("l.fa: 1 record header(s) hold bytes that are not UTF-8")
            && err.contains("'caf\u{FFFD}'"),
        "{err}"
    );
    let rows = read_dataset(&out).unwrap().1;
    assert_eq!(rows[1].id, "caf\u{FFFD}");
}

/// `--fasta -` (standard input, by the Unix convention) is named for what it is, with the way
/// that works (a named pipe), where it said "-: No such file or directory".
#[test]
fn standard_input_is_refused_with_the_alternative() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.parquet");
    let (ok, _, err) = run(&["tokenize", "--fasta", "-", "--out", out.to_str().unwrap()]);
    assert!(
        !ok && err.contains("standard input") && err.contains("<(zcat"),
        "{err}"
    );
    assert!(!out.exists());
}

/// A pipe (`<(zcat …)`, `cat x | … /dev/stdin`) is read once, as it streams: plain and gzip,
/// handed over a few bytes at a time. (Reading the first bytes a second time to tell the
/// compression lost them, and every piped FASTA was "not a FASTA file".)
#[cfg(unix)]
#[test]
fn fasta_through_a_pipe_is_read_once() {
    use std::io::Write;
    let text = b">a\nATGAAACCC\n>b\nGGGTTT\n".to_vec();
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [("plain", text.clone()), ("gzip", gzip(&text))] {
        let out = dir.path().join(format!("{name}.parquet"));
        let mut child = common::bin()
            .args(["--quiet", "tokenize", "--fasta", "/dev/stdin", "--out"])
            .arg(&out)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        for chunk in bytes.chunks(3) {
            stdin.write_all(chunk).unwrap();
            stdin.flush().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        drop(stdin);
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let (_, rows) = read_dataset(&out).unwrap();
        assert_eq!(
            rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"],
            "{name}"
        );
    }
}

/// One file reached twice (named twice, or within a directory also given) is refused: its
/// records would count twice (and in training fall on both sides of the validation split).
#[test]
fn a_file_given_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(dir.path(), "a.fa", b">a\nATGAAACCC\n");
    let out = dir.path().join("x.parquet");
    let spelled = dir.path().join(".").join("a.fa");
    for inputs in [
        [fa.to_str().unwrap(), fa.to_str().unwrap()],
        [fa.to_str().unwrap(), spelled.to_str().unwrap()],
        [dir.path().to_str().unwrap(), fa.to_str().unwrap()],
    ] {
        let (ok, _, err) = run(&[
            "tokenize",
            "--fasta",
            inputs[0],
            inputs[1],
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            !ok && err.contains("are the same file, given twice"),
            "{inputs:?}: {err}"
        );
        assert!(!out.exists());
    }
}
