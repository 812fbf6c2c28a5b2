//! `genslm score --per-token` and `--stride`: the parquet file's rows against the FASTA and
//! the record scores, and the bad flags. (Against transformers: scripts/check_per_token.py.)

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int32Type, Int64Type};
use common::{arg, listing, run, trained_tiny, write};

const SEQ: &str = "ATGGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCCGTTACGCTAAACTGGAATTCCGTTACTAA";

fn read(path: &std::path::Path) -> arrow_array::RecordBatch {
    let f = std::fs::File::open(path).unwrap();
    let r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
        .unwrap()
        .with_batch_size(1 << 20)
        .build()
        .unwrap();
    let mut batches: Vec<_> = r.map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 1);
    batches.pop().unwrap()
}

#[test]
fn per_token_rows_match_the_fasta_and_the_record_scores() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(
        dir.path(),
        "two.fa",
        format!(">a\n{SEQ}\n>b short\n{}\n", &SEQ[..20]).as_bytes(),
    );
    let model = arg(trained_tiny());
    for (stride, window) in [(None, "8"), (Some("3"), "8"), (Some("8"), "8")] {
        let out = dir.path().join("tok.parquet");
        let (o, f) = (arg(&out), arg(&fa));
        let mut a = vec![
            "score",
            "--model",
            &model,
            "--fasta",
            &f,
            "--seq-len",
            window,
        ];
        a.extend(["--per-token", &o, "--top-k", "4", "--full-distribution"]);
        if let Some(s) = stride {
            a.extend(["--stride", s]);
        }
        let (ok, tsv, err) = run(&a);
        assert!(ok, "{err}");
        let b = read(&out);
        let ids = b.column_by_name("id").unwrap().as_string::<i32>();
        let codon_index = b
            .column_by_name("codon_index")
            .unwrap()
            .as_primitive::<Int64Type>();
        let base = b
            .column_by_name("base_offset")
            .unwrap()
            .as_primitive::<Int64Type>();
        let codon = b.column_by_name("codon").unwrap().as_string::<i32>();
        let lp = b
            .column_by_name("log_prob")
            .unwrap()
            .as_primitive::<Float64Type>();
        let ctx = b
            .column_by_name("context")
            .unwrap()
            .as_primitive::<Int32Type>();
        let rank = b
            .column_by_name("rank")
            .unwrap()
            .as_primitive::<Int32Type>();
        let full = b.column_by_name("log_probs").unwrap().as_fixed_size_list();
        let top = b.column_by_name("top_codons").unwrap().as_fixed_size_list();
        assert_eq!((full.value_length(), top.value_length()), (69, 4));
        for line in tsv.lines().skip(1) {
            let f: Vec<&str> = line.split('\t').collect();
            let (rid, n, mean): (&str, usize, f64) =
                (f[0], f[1].parse().unwrap(), f[2].parse().unwrap());
            let rows: Vec<usize> = (0..b.num_rows()).filter(|&i| ids.value(i) == rid).collect();
            assert_eq!(rows.len(), n, "{rid} {stride:?}");
            let sum: f64 = rows.iter().map(|&i| -lp.value(i)).sum();
            assert!(
                (sum / n as f64 - mean).abs() < 1e-5,
                "{rid}: {} vs {mean}",
                sum / n as f64
            );
            let seq = if rid == "a" { SEQ } else { &SEQ[..20] };
            for &i in &rows {
                let c = codon_index.value(i) as usize;
                assert_eq!(base.value(i), 3 * c as i64);
                let want = seq.get(3 * c..3 * c + 3).unwrap_or("[UNK]");
                assert_eq!(codon.value(i), want, "{rid} codon {c}");
                assert!(rank.value(i) >= 1);
                // The full distribution sums to one and holds the token's log-probability.
                let row = full.value(i);
                let v = row.as_primitive::<arrow_array::types::Float32Type>();
                let total: f64 = v.values().iter().map(|&x| (x as f64).exp()).sum();
                assert!((total - 1.0).abs() < 1e-4);
                if let Some(s) = stride.filter(|_| c >= 8) {
                    let s: i32 = s.parse().unwrap();
                    assert!(ctx.value(i) >= 8 - s, "context {} at {c}", ctx.value(i));
                }
            }
            // Consecutive windows of 8 leave every window's first codon unpredicted; a stride
            // of 3 predicts every codon but the first.
            let tokens = seq.len().div_ceil(3);
            let expect = match stride {
                Some("3") => tokens - 1,
                _ => tokens - tokens.div_ceil(8),
            };
            assert_eq!(n, expect, "{rid} {stride:?}");
        }
    }
}

#[test]
fn bad_score_flags_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&write(
        dir.path(),
        "a.fa",
        format!(">a\n{SEQ}\n").as_bytes(),
    ));
    let model = arg(trained_tiny());
    let out = arg(&dir.path().join("t.parquet"));
    let tsv_name = arg(&dir.path().join("t.tsv"));
    for (extra, want) in [
        (
            vec!["--stride", "0"],
            "--stride 0: must be between 1 and the window (8 tokens)",
        ),
        (
            vec!["--stride", "9"],
            "--stride 9: must be between 1 and the window (8 tokens)",
        ),
        (
            vec!["--per-token", &out, "--top-k", "70"],
            "--top-k 70: the model has only 69 tokens",
        ),
        (
            vec!["--full-distribution"],
            "--full-distribution adds a column to the --per-token file",
        ),
        (
            vec!["--top-k", "4"],
            "--top-k lists the most likely codons in the --per-token file",
        ),
        (
            vec!["--per-token", &tsv_name],
            "this file is written as parquet, and its .tsv name says otherwise",
        ),
    ] {
        let mut a = vec!["score", "--model", &model, "--fasta", &fa, "--seq-len", "8"];
        a.extend(extra.iter().copied());
        let (ok, _, err) = run(&a);
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert_eq!(listing(dir.path()), ["a.fa"], "nothing written on error");
}

/// `--top-k 0` writes the per-token file without the top-k columns: one row per predicted
/// token, as many as the TSV counts, with the same log-probabilities.
#[test]
fn per_token_rows_without_top_k() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(dir.path(), "a.fa", format!(">a\n{SEQ}\n").as_bytes());
    let out = dir.path().join("tok.parquet");
    let (model, f, o) = (arg(trained_tiny()), arg(&fa), arg(&out));
    let args = ["score", "--model", &model, "--fasta", &f, "--seq-len", "8"];
    let (ok, tsv, err) = run(&[&args[..], &["--per-token", &o, "--top-k", "0"]].concat());
    assert!(ok, "{err}");
    let b = read(&out);
    assert!(b.column_by_name("top_codons").is_none() && b.column_by_name("top_probs").is_none());
    let line = tsv.lines().nth(1).unwrap();
    let f: Vec<&str> = line.split('\t').collect();
    let (n, mean): (usize, f64) = (f[1].parse().unwrap(), f[2].parse().unwrap());
    assert_eq!(b.num_rows(), n);
    let lp = b
        .column_by_name("log_prob")
        .unwrap()
        .as_primitive::<Float64Type>();
    let sum: f64 = lp.values().iter().map(|x| -x).sum();
    assert!(
        (sum / n as f64 - mean).abs() < 1e-5,
        "{} vs {mean}",
        sum / n as f64
    );
}

/// A record of one codon has nothing to predict: its row says NA (it printed NaN, a mean of
/// nothing) and a note counts it; the records beside it keep their scores.
#[test]
fn a_record_too_short_to_score_is_na_not_nan() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(
        dir.path(),
        "a.fa",
        format!(">short\nATG\n>long\n{SEQ}\n>two\nAT\n").as_bytes(),
    );
    let (model, f) = (arg(trained_tiny()), arg(&fa));
    let (ok, tsv, err) = run(&["score", "--model", &model, "--fasta", &f, "--quiet"]);
    assert!(ok, "{err}");
    let rows: Vec<Vec<&str>> = tsv
        .lines()
        .skip(1)
        .map(|l| l.split('\t').collect())
        .collect();
    assert_eq!(rows[0], ["short", "0", "NA", "NA"], "{tsv}");
    assert_eq!(rows[2], ["two", "0", "NA", "NA"], "{tsv}");
    assert_eq!(rows[1][1], (SEQ.len() / 3 - 1).to_string(), "{tsv}");
    assert!(rows[1][2].parse::<f64>().unwrap().is_finite(), "{tsv}");
    assert!(!tsv.contains("NaN"), "{tsv}");
    // `AT` is no codon at all: counted with the records of no A/C/G/T codon.
    assert!(err.contains("1 record(s) shorter than 2 codons"), "{err}");
    assert!(err.contains("1 record(s) hold no A/C/G/T codon"), "{err}");
}

/// A model whose config gives a default window of one codon (max_position_embeddings 1)
/// predicts nothing in any record: refused, naming the field, where every record scored NaN;
/// an explicit --seq-len (rotary extends past the table) scores.
#[test]
fn a_default_window_of_one_codon_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let from = common::tiny_checkpoint();
    std::fs::copy(
        from.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(from.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    cfg["max_position_embeddings"] = 1.into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let fa = write(dir.path(), "a.fa", format!(">a\n{SEQ}\n").as_bytes());
    let (m, f) = (arg(&model), arg(&fa));
    let (ok, _, err) = run(&["score", "--model", &m, "--fasta", &f, "--quiet"]);
    assert!(
        !ok && err.contains("max_position_embeddings 1") && err.contains("--seq-len"),
        "{err}"
    );
    let (ok, tsv, err) = run(&["score", "--model", &m, "--fasta", &f, "--seq-len", "8"]);
    assert!(ok, "{err}");
    assert!(tsv.lines().nth(1).unwrap().starts_with("a\t"), "{tsv}");
}

/// A record of only N (or only a partial codon) is [UNK] predicting [UNK]: NA with its own
/// note, not a score; a repeated
/// id is warned about (the rows are told apart only by their order), and both copies of one
/// sequence score alike.
#[test]
fn unknown_only_records_and_repeated_ids() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(
        dir.path(),
        "a.fa",
        format!(">n\n{}\n>b\n{SEQ}\n>b\n{SEQ}\n>p\nAC\n", "N".repeat(30)).as_bytes(),
    );
    let (model, f) = (arg(trained_tiny()), arg(&fa));
    let (ok, tsv, err) = run(&["score", "--model", &model, "--fasta", &f, "--quiet"]);
    assert!(ok, "{err}");
    let rows: Vec<Vec<&str>> = tsv
        .lines()
        .skip(1)
        .map(|l| l.split('\t').collect())
        .collect();
    assert_eq!(rows[0], ["n", "0", "NA", "NA"], "{tsv}");
    assert_eq!(rows[1], rows[2], "{tsv}");
    assert!(rows[1][2].parse::<f64>().unwrap().is_finite(), "{tsv}");
    // Only a partial codon is no A/C/G/T codon either, as embed counts it (a genslm71 model
    // scored it as [BOS] [UNK] [EOS]).
    assert_eq!(rows[3], ["p", "0", "NA", "NA"], "{tsv}");
    assert!(err.contains("2 record(s) hold no A/C/G/T codon"), "{err}");
    assert!(!err.contains("shorter than 2 codons"), "{err}");
    assert!(
        err.contains("1 record(s) repeat an id seen before (the first: 'b')"),
        "{err}"
    );
}

/// A record without an id cannot be told apart in the output: refused naming its line, and
/// nothing (not even the TSV header) is printed before the error.
#[test]
fn a_record_without_an_id_is_refused_before_any_output() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(
        dir.path(),
        "a.fa",
        format!(">\n{SEQ}\n>b\n{SEQ}\n").as_bytes(),
    );
    let (model, f) = (arg(trained_tiny()), arg(&fa));
    let (ok, tsv, err) = run(&["score", "--model", &model, "--fasta", &f, "--quiet"]);
    assert!(
        !ok && err.contains("the record at line 1 has an empty header"),
        "{err}"
    );
    assert_eq!(tsv, "", "stdout holds nothing");
}

/// A window past a rotary model's max_position_embeddings (2048 here) is taken with a warning
/// as `generate` gives for --max-codons (it was taken without a word); within it, none.
#[test]
fn a_window_past_a_rotary_models_positions_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(dir.path(), "a.fa", format!(">long\n{SEQ}\n").as_bytes());
    let (model, f) = (arg(trained_tiny()), arg(&fa));
    for (len, warned) in [("2049", true), ("2048", false)] {
        let (ok, _, err) = run(&["score", "--model", &model, "--fasta", &f, "--seq-len", len]);
        assert!(ok, "{err}");
        assert_eq!(
            err.contains("goes past the model's training length (2048"),
            warned,
            "--seq-len {len}: {err}"
        );
    }
    // The same warning names the flag that asked (variants' --window), and --quiet keeps it
    // (generate's was silenced by --quiet, which silences progress, not warnings).
    let out = arg(&dir.path().join("v.tsv"));
    let variants = [
        "variants",
        "--model",
        &model,
        "--fasta",
        &f,
        "--saturate",
        "4..6",
        "--window",
        "2049",
        "--out",
        &out,
        "--quiet",
    ];
    let (ok, _, err) = run(&variants);
    assert!(
        ok && err.contains("warning: --window 2049 goes past"),
        "{err}"
    );
    let generate = [
        "generate",
        "--model",
        &model,
        "--max-codons",
        "2049",
        "--quiet",
    ];
    let (ok, _, err) = run(&generate);
    assert!(
        ok && err.contains("warning: --max-codons 2049 goes past"),
        "{err}"
    );
}

/// `--per-token` at the path of an input FASTA is refused before any record is scored: the
/// whole table reached stdout, then "nothing was written" and exit 1.
#[test]
fn a_per_token_file_that_is_an_input_is_refused_before_scoring() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(">a\n{SEQ}\n>b\n{SEQ}\n");
    let fa = write(dir.path(), "in.parquet", text.as_bytes());
    let (model, f) = (arg(trained_tiny()), arg(&fa));
    let (ok, tsv, err) = run(&[
        "score",
        "--model",
        &model,
        "--fasta",
        &f,
        "--per-token",
        &f,
        "--quiet",
    ]);
    assert!(!ok && err.contains("an input of this command"), "{err}");
    assert!(tsv.is_empty(), "printed before the refusal: {tsv}");
    assert_eq!(std::fs::read_to_string(&fa).unwrap(), text);
}

/// A rotary model trained at a longer window than its max_position_embeddings (train says so)
/// scores by default at the window it trained at, as `--seq-len` of that window does, with no
/// warning there: it was cut to max_position_embeddings, and the trained window was warned
/// about as untested.
#[test]
fn a_rotary_model_trained_past_its_table_scores_at_its_trained_window() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(common::repo().join("configs/tiny.toml")).unwrap();
    let short = text.replace(
        "max_position_embeddings = 2048",
        "max_position_embeddings = 31",
    );
    assert_ne!(short, text);
    let cfg = write(dir.path(), "mp31.toml", short.as_bytes());
    let out = dir.path().join("run");
    let lambda = common::repo().join("data/lambda_virus.fa");
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &arg(&lambda),
        "--config",
        &arg(&cfg),
        "--out",
        &arg(&out),
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("--seq-len 32 is longer than max_position_embeddings (31)"),
        "{err}"
    );
    let fa = write(
        dir.path(),
        "r.fa",
        format!(">r\n{}\n", SEQ.repeat(3)).as_bytes(),
    );
    let (m, f) = (arg(&out), arg(&fa));
    let (ok, default, err) = run(&["score", "--model", &m, "--fasta", &f]);
    assert!(ok, "{err}");
    let (ok, explicit, err) = run(&["score", "--model", &m, "--fasta", &f, "--seq-len", "32"]);
    assert!(ok && !err.contains("warning"), "{err}");
    assert_eq!(default, explicit);
    let (ok, cut, _) = run(&["score", "--model", &m, "--fasta", &f, "--seq-len", "31"]);
    assert!(ok);
    assert_ne!(default, cut, "the window did not matter");
}

/// `score | head -1`: a reader that stops early ends the command quietly with status 0, as
/// the shell's own tools do (it failed with "error: writing scores: Broken pipe"); with
/// --per-token, whose file is then not written, it stays an error that says so.
#[test]
fn a_reader_that_stops_early_ends_the_scores_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let model = arg(trained_tiny());
    // More rows than a pipe holds (64 KiB), so the command is still writing when its reader
    // goes.
    let records: String = (0..6000)
        .map(|i| format!(">record{i}\n{}\n", &SEQ[..60]))
        .collect();
    let data = arg(&write(dir.path(), "many.fa", records.as_bytes()));
    let per_token = arg(&dir.path().join("t.parquet"));
    for extra in [vec![], vec!["--per-token", per_token.as_str()]] {
        let mut child = common::bin()
            .args([
                "score",
                "--model",
                &model,
                "--fasta",
                &data,
                "--seq-len",
                "32",
            ])
            .args(&extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert!(first.starts_with("id\t"), "{first}");
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if extra.is_empty() {
            assert!(out.status.success() && !err.contains("error"), "{err}");
        } else {
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                err.contains("the --per-token file was not written"),
                "{err}"
            );
            assert!(!dir.path().join("t.parquet").exists());
        }
    }
}
