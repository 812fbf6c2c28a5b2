//! `genslm variants` inputs and outputs: a VCF through a pipe, outputs that clash or cannot be
//! written, flags with impossible ranges, windows stretched past the trained positions.

mod common;

use common::variants_cli::{fasta, table, variants, VCF};
use common::{arg, gzip, run, trained_tiny, write};

/// A VCF read from a pipe is read whole: its first bytes (read to recognise compression) were
/// lost to a second open, and a named pipe hung on it.
#[test]
fn a_vcf_from_a_pipe_reads_as_the_file_does() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let vcf = write(dir.path(), "v.vcf", VCF.as_bytes());
    let (file_out, pipe_out) = (dir.path().join("file.tsv"), dir.path().join("pipe.tsv"));
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&vcf),
        "--out",
        &arg(&file_out),
    ]);
    assert!(ok, "{err}");
    let model = arg(trained_tiny());
    let mut child = common::bin()
        .args(["variants", "--model", &model, "--quiet", "--fasta", &fa])
        .args(["--vcf", "/dev/stdin", "--out", &arg(&pipe_out)])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&gzip(VCF.as_bytes()))
        .unwrap();
    let done = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{err}");
    assert_eq!(table(&pipe_out), table(&file_out));
    // Bytes after the last gzip member: the line read is named with the likely cause (the
    // decompressor's bare "unexpected end of file" was all it said).
    let mut damaged = gzip(VCF.as_bytes());
    damaged.extend_from_slice(b"garbage\n");
    let bad = write(dir.path(), "bad.vcf.gz", &damaged);
    let none = dir.path().join("none.tsv");
    let (ok, _, err) = variants(&["--fasta", &fa, "--vcf", &arg(&bad), "--out", &arg(&none)]);
    assert!(
        !ok && err.contains("bad.vcf.gz: line ") && err.contains("compression corrupt"),
        "{err}"
    );
    assert!(!none.exists());
    // Compressed twice: named (it was "not UTF-8 text").
    let twice = write(dir.path(), "twice.vcf.gz", &gzip(&gzip(VCF.as_bytes())));
    let (ok, _, err) = variants(&["--fasta", &fa, "--vcf", &arg(&twice), "--out", &arg(&none)]);
    assert!(
        !ok && err.contains("twice.vcf.gz: line 1: compressed twice"),
        "{err}"
    );
}

/// Two outputs of one command at one path: refused before any work (the heatmap replaced the
/// table, and `embed --plot` the embeddings, exit 0), under another spelling too.
#[test]
fn two_outputs_at_one_path_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let out = dir.path().join("sat.tsv");
    let again = dir.path().join(".").join("sat.tsv");
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--saturate",
        "4..9",
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&again),
    ]);
    assert!(
        !ok && err.contains("--out and --heatmap are the same file"),
        "{err}"
    );
    assert!(!out.exists());
    // Each output's directory is checked before the first is written (the table was written,
    // then the heatmap failed).
    let lost = dir.path().join("nodir").join("x.png");
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--saturate",
        "4..9",
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&lost),
    ]);
    assert!(!ok && err.contains("does not exist"), "{err}");
    assert!(!out.exists());
    let emb = dir.path().join("e.parquet");
    let model = arg(trained_tiny());
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &model,
        "--fasta",
        &fa,
        "--out",
        &arg(&emb),
        "--plot",
        &arg(&emb),
    ]);
    assert!(
        !ok && err.contains("--out and --plot are the same file"),
        "{err}"
    );
    assert!(!emb.exists());
    // A --plot whose directory is a file: refused before the embeddings are written (they
    // were written, then the picture failed), and the file is not called missing.
    let inside = dir.path().join("ref.fa").join("e.png");
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &model,
        "--fasta",
        &fa,
        "--out",
        &arg(&emb),
        "--plot",
        &arg(&inside),
    ]);
    assert!(!ok && err.contains("is a file, not a directory"), "{err}");
    assert!(!emb.exists());
    // Outputs spelled as directories (`x.png/`): refused by flag before any work (the main
    // output was written, then the rename of the picture failed with "Not a directory").
    let slashed = format!("{}/", arg(&dir.path().join("e.png")));
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &model,
        "--fasta",
        &fa,
        "--out",
        &arg(&emb),
        "--plot",
        &slashed,
    ]);
    assert!(
        !ok && err.contains("--plot ") && err.contains("names a directory"),
        "{err}"
    );
    assert!(!emb.exists());
    let table = format!("{}/", arg(&dir.path().join("v.tsv")));
    let (ok, _, err) = variants(&["--fasta", &fa, "--saturate", "4..9", "--out", &table]);
    assert!(
        !ok && err.contains("--out ") && err.contains("names a directory"),
        "{err}"
    );
    let tsv = dir.path().join("sat2.tsv");
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--saturate",
        "4..9",
        "--out",
        &arg(&tsv),
        "--heatmap",
        &format!("{}/", arg(&dir.path().join("h.png"))),
    ]);
    assert!(
        !ok && err.contains("--heatmap ") && err.contains("names a directory"),
        "{err}"
    );
    assert!(!tsv.exists());
}

/// An insertion longer than the trained positions stretches its window past them: scored, and
/// said (it ran without a word, 10,067 codons on a 2,048-position model).
#[test]
fn a_window_stretched_past_the_trained_positions_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let long = format!("C{}", "GCT".repeat(2100));
    let vcf = write(
        dir.path(),
        "ins.vcf",
        format!("#CHROM\tPOS\tID\tREF\tALT\ngene\t5\tbig\tC\t{long}\n").as_bytes(),
    );
    let out = dir.path().join("out.tsv");
    let (ok, _, err) = variants(&["--fasta", &fa, "--vcf", &arg(&vcf), "--out", &arg(&out)]);
    assert!(ok, "{err}");
    assert!(
        err.contains("ins.vcf: line 2: a window stretched to 2130 codons")
            && err.contains("past the model's training length (2048")
            && !err.contains("  "),
        "{err}"
    );
}

/// Impossible ranges say what is wrong with them (START past END, or 0, was "expected
/// START..END"), and a --chrom that names no record says so (it blamed the VCF: "no variant
/// lines on CHROM").
#[test]
fn impossible_ranges_and_a_missing_chrom_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let vcf = arg(&write(dir.path(), "v.vcf", VCF.as_bytes()));
    let out = arg(&dir.path().join("o.tsv"));
    let base = ["--fasta", &fa, "--vcf", &vcf, "--out", &out];
    for (extra, want) in [
        (["--cds", "0..9"], "--cds '0..9': positions count from 1"),
        (
            ["--chrom", "nosuch"],
            "--chrom 'nosuch' is not a record of the FASTA input (records: gene)",
        ),
    ] {
        let (ok, _, err) = variants(&[&base[..], &extra[..]].concat());
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
    }
    let (ok, _, err) = variants(&["--fasta", &fa, "--saturate", "9..3", "--out", &out]);
    assert!(!ok && err.contains("START 9 is past END 3"), "{err}");
}

/// Skipped lines are said in the VCF's order: a line that does not parse (5) was said before
/// one that does not place (3).
#[test]
fn skipped_lines_are_said_in_line_order() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let vcf = write(
        dir.path(),
        "v.vcf",
        b"#CHROM\tPOS\tID\tREF\tALT\ngene\t5\tok\tC\tT\ngene\t5\twrong_ref\tG\tT\nnosuch\t5\tno_chrom\tC\tT\ngene\tfive\tbad_pos\tC\tT\nchr\x1b]0;x\x07\t5\tesc\tC\tT\n",
    );
    let out = arg(&dir.path().join("o.tsv"));
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&vcf),
        "--out",
        &out,
        "--on-invalid",
        "skip",
    ]);
    assert!(ok, "{err}");
    let at = |line: &str| {
        err.find(&format!("v.vcf: line {line}: "))
            .unwrap_or_else(|| panic!("{err}"))
    };
    assert!(at("3") < at("4") && at("4") < at("5"), "{err}");
    // A warning quotes the line's CHROM with its escape sequence escaped (a terminal-title
    // sequence reached the terminal raw; errors were escaped, warnings were not).
    assert!(
        err.contains("chr\\u{1b}]0;x\\u{7}") && !err.contains('\u{1b}'),
        "{err:?}"
    );
}
