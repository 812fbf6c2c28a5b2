//! `genslm embed --pool none`, `--layers` and `--stride`: per-token rows against the pooled
//! vectors `embed` has always written, and the flags that cannot work. (Against transformers'
//! `output_hidden_states`: scripts/check_token_states.py.)

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, Int64Type};
use common::{arg, run, trained_tiny, write};

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

/// Mean of a layer's per-token rows of record `id`.
fn mean_of(b: &arrow_array::RecordBatch, id: &str, layer: i32) -> (usize, Vec<f64>) {
    let ids = b.column_by_name("id").unwrap().as_string::<i32>();
    let layers = b
        .column_by_name("layer")
        .unwrap()
        .as_primitive::<Int32Type>();
    let emb = b.column_by_name("embedding").unwrap().as_fixed_size_list();
    let mut acc: Vec<f64> = Vec::new();
    let mut n = 0;
    for i in 0..b.num_rows() {
        if ids.value(i) != id || layers.value(i) != layer {
            continue;
        }
        let row = emb.value(i);
        let v = row.as_primitive::<Float32Type>().values();
        if acc.is_empty() {
            acc = vec![0.0; v.len()];
        }
        for (a, x) in acc.iter_mut().zip(v.iter()) {
            *a += *x as f64;
        }
        n += 1;
    }
    (n, acc.into_iter().map(|a| a / n as f64).collect())
}

#[test]
fn per_token_rows_pool_to_the_record_vectors() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&write(
        dir.path(),
        "two.fa",
        format!(">a\n{SEQ}\n>b\n{}\n", &SEQ[..30]).as_bytes(),
    ));
    let model = arg(trained_tiny());
    let (tok, pooled, multi) = (
        dir.path().join("tok.parquet"),
        dir.path().join("pooled.parquet"),
        dir.path().join("multi.parquet"),
    );
    let common = [
        "--model",
        model.as_str(),
        "--fasta",
        fa.as_str(),
        "--seq-len",
        "8",
        "--quiet",
    ];
    let go = |extra: &[&str]| {
        let mut a = vec!["embed"];
        a.extend(common);
        a.extend(extra);
        let (ok, _, err) = run(&a);
        assert!(ok, "{extra:?}: {err}");
    };
    go(&["--pool", "none", "--layers", "0,-1", "--out", &arg(&tok)]);
    go(&["--pool", "mean", "--out", &arg(&pooled)]);
    go(&["--pool", "mean", "--layers", "2,0", "--out", &arg(&multi)]);
    let t = read(&tok);
    assert_eq!(t.num_rows(), 2 * (23 + 10), "one row per token and layer");
    // Not quiet: what the command says (`common` has --quiet).
    let loud = |extra: &[&str]| {
        let mut a = vec!["embed", "--model", &model, "--fasta", &fa, "--seq-len", "8"];
        a.extend(extra);
        run(&a)
    };
    // The summary counts records as records (it said "66 records": the rows).
    let out = arg(&dir.path().join("again.parquet"));
    let (ok, _, err) = loud(&["--pool", "none", "--layers", "0,-1", "--out", &out]);
    assert!(
        ok && err.contains("embedded 2 records (33 tokens") && err.contains("66 rows"),
        "{err}"
    );
    // A layer named twice (-1 is the last, 2 in tiny) is written once, and said so (the file
    // held fewer layers than the flag listed, without a word).
    let twice = arg(&dir.path().join("twice.parquet"));
    let (ok, _, err) = loud(&["--layers", "2,-1,2", "--out", &twice]);
    assert!(
        ok && err.contains("--layers -1 names layer 2 again (as 2)"),
        "{err}"
    );
    assert_eq!(read(&dir.path().join("twice.parquet")).num_rows(), 2);
    let codon = t.column_by_name("codon").unwrap().as_string::<i32>();
    let ci = t
        .column_by_name("codon_index")
        .unwrap()
        .as_primitive::<Int64Type>();
    for i in 0..t.num_rows() {
        let c = ci.value(i) as usize;
        let ids = t.column_by_name("id").unwrap().as_string::<i32>();
        let seq = if ids.value(i) == "a" { SEQ } else { &SEQ[..30] };
        assert_eq!(codon.value(i), &seq[3 * c..3 * c + 3]);
    }
    // The per-token states of the last layer average to `--pool mean`'s vector (the same
    // consecutive windows; computed batched across records there, one record at a time here).
    let p = read(&pooled);
    let pe = p.column_by_name("embedding").unwrap().as_fixed_size_list();
    let m = read(&multi);
    let me = m.column_by_name("embedding").unwrap().as_fixed_size_list();
    let ml = m
        .column_by_name("layer")
        .unwrap()
        .as_primitive::<Int32Type>();
    assert_eq!(
        (m.num_rows(), ml.value(0), ml.value(1)),
        (4, 2, 0),
        "a row per record and layer, in the order asked"
    );
    for (r, id) in ["a", "b"].iter().enumerate() {
        let (n, mean) = mean_of(&t, id, 2);
        assert_eq!(n, if r == 0 { 23 } else { 10 });
        let row = pe.value(r);
        let want = row.as_primitive::<Float32Type>().values();
        let err = mean
            .iter()
            .zip(want.iter())
            .map(|(a, b)| (a - *b as f64).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-4, "{id}: {err}");
        // --layers 2,0 pooled: layer 0's row is the mean of the per-token layer-0 states.
        let (_, mean0) = mean_of(&t, id, 0);
        let row0 = me.value(2 * r + 1);
        let got0 = row0.as_primitive::<Float32Type>().values();
        let err0 = mean0
            .iter()
            .zip(got0.iter())
            .map(|(a, b)| (a - *b as f64).abs())
            .fold(0.0, f64::max);
        assert!(err0 < 1e-4, "{id} layer 0: {err0}");
    }
    // A file of two layers is not one latent space: `plot` refuses it, naming both.
    let png = dir.path().join("multi.png");
    let (ok, _, err) = run(&["plot", "--embeddings", &arg(&multi), "--out", &arg(&png)]);
    assert!(!ok && !png.exists(), "plotted two layers as one: {err}");
    assert!(
        err.contains("layer 2 and layer 0") && err.contains("multi.parquet"),
        "{err}"
    );
}

#[test]
fn bad_embed_flags_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&write(
        dir.path(),
        "a.fa",
        format!(">a\n{SEQ}\n").as_bytes(),
    ));
    let model = arg(trained_tiny());
    let out = arg(&dir.path().join("e.parquet"));
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
            vec!["--layers", "0,7"],
            "layer 7 (--layer/--layers): this model has 2 layers",
        ),
        (
            vec!["--pool", "none", "--plot", "x.png"],
            "--plot draws one pooled vector per record",
        ),
        (
            vec!["--layers", "0,1", "--plot", "x.png"],
            "--plot draws one pooled vector per record",
        ),
    ] {
        let mut a = vec![
            "embed",
            "--model",
            &model,
            "--fasta",
            &fa,
            "--seq-len",
            "8",
            "--out",
            &out,
        ];
        a.extend(extra.iter().copied());
        let (ok, _, err) = run(&a);
        assert!(!ok && err.contains(want), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!std::path::Path::new(&out).exists());
}

/// A record of only N is embedded, as before, but said to be vectors of [UNK] states (score
/// leaves the same record unscored with a note; embed gave a normal-looking vector silently).
#[test]
fn records_of_only_unknown_codons_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let n = "N".repeat(30);
    let fa = write(
        dir.path(),
        "n.fa",
        format!(">known\n{SEQ}\n>unknown\n{n}\n").as_bytes(),
    );
    let out = dir.path().join("e.parquet");
    let (ok, err) = embed_quietly("--fasta", &fa, &out);
    assert!(
        ok && err.contains("warning: 1 record(s) hold no A/C/G/T codon"),
        "{err}"
    );
    assert_eq!(read(&out).num_rows(), 2);
    let fa = write(dir.path(), "k.fa", format!(">known\n{SEQ}\n").as_bytes());
    let (ok, err) = embed_quietly("--fasta", &fa, &out);
    assert!(ok && !err.contains("A/C/G/T"), "{err}");
}

/// `embed --quiet` of the trained tiny model on `input` (given by `flag`) into `out`.
fn embed_quietly(flag: &str, input: &std::path::Path, out: &std::path::Path) -> (bool, String) {
    let model = arg(trained_tiny());
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &model,
        flag,
        &arg(input),
        "--out",
        &arg(out),
        "--quiet",
    ]);
    (ok, err)
}

/// A dataset row with no codon (tokenize --drop-partial-codon of a 1-base record) is left out
/// with a warning naming it, instead of stopping the whole run ("no tokens to embed").
#[test]
fn a_record_of_no_codon_is_left_out_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let fa = write(
        dir.path(),
        "a.fa",
        format!(">known\n{SEQ}\n>tiny\nA\n").as_bytes(),
    );
    let data = dir.path().join("d.parquet");
    let (ok, _, err) = run(&[
        "tokenize",
        "--fasta",
        &arg(&fa),
        "--out",
        &arg(&data),
        "--drop-partial-codon",
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let out = dir.path().join("e.parquet");
    let (ok, err) = embed_quietly("--data", &data, &out);
    assert!(
        ok && err.contains("1 record(s) hold no codon") && err.contains("'tiny'"),
        "{err}"
    );
    assert_eq!(read(&out).num_rows(), 1);
}
