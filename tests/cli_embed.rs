//! `genslm embed` (and `embed --plot`): embeddings against hidden states computed independently
//! (padding excluded), the parquet's shape (arrow and pyarrow), FASTA and parquet input, the
//! PNG, and the error messages for bad input. `genslm plot` alone: tests/cli_plot.rs.

mod common;

use std::path::Path;

use burn::tensor::Device;
use common::{repo, run};
use genslm::infer::embed::{embed_tokens, Pool};
use genslm::model::io::load_model_dir;
use genslm::model::neox::ForwardOptions;
use genslm::model::GenSlm;
use genslm::ops::primitive::{tensor_to_vec, tokens_tensor};
use genslm::tokenizer::CodonTokenizer;

fn s(p: &Path) -> String {
    common::arg(p)
}

fn trained() -> &'static Path {
    common::trained_tiny()
}

/// Mean over tokens (or the last token) of hidden state `layer`, each window of `w` tokens
/// run on its own, unpadded: the reference for `embed_tokens`.
fn reference_embedding(
    model: &GenSlm,
    toks: &[u32],
    layer: usize,
    w: usize,
    pool: Pool,
) -> Vec<f64> {
    let h = model.cfg.hidden_size;
    let mut sum = vec![0f64; h];
    let mut n = 0usize;
    for win in toks.chunks(w) {
        let t = tokens_tensor(win, 1, win.len(), &model.device);
        let opts = ForwardOptions {
            offset: 0,
            collect_hidden: true,
        };
        let (fin, hidden) = model.hidden_states(t, opts).unwrap();
        let states = if layer == model.cfg.num_layers {
            fin
        } else {
            hidden[layer].clone()
        };
        let v = tensor_to_vec(&states); // [1, len, h]
        match pool {
            Pool::Mean => {
                for row in v.chunks(h) {
                    for (a, x) in sum.iter_mut().zip(row) {
                        *a += *x as f64;
                    }
                    n += 1;
                }
            }
            Pool::Last => {
                sum = v[v.len() - h..].iter().map(|&x| x as f64).collect();
                n = 1;
            }
            Pool::None => unreachable!("per-token states are tests/cli_embed_tokens.rs's"),
        }
    }
    sum.iter().map(|x| x / n as f64).collect()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn embedding_is_the_mean_of_hidden_states_over_real_tokens() {
    let model = load_model_dir(trained(), &Device::flex()).unwrap();
    let tok = CodonTokenizer::new(model.cfg.vocab).unwrap();
    let fasta = std::fs::read_to_string(repo().join("data/lambda_virus.fa")).unwrap();
    let dna: String = fasta.lines().skip(1).collect();
    let all = tok.encode(dna.as_bytes());
    // Lengths 150 (windows 64 + 64 + 22), 37, 5, 64, 1: batches mix lengths, so padding is used.
    let recs: Vec<&[u32]> = vec![
        &all[..150],
        &all[200..237],
        &all[300..305],
        &all[400..464],
        &all[500..501],
    ];
    for (layer, pool) in [
        (2, Pool::Mean),
        (1, Pool::Mean),
        (0, Pool::Mean),
        (2, Pool::Last),
    ] {
        let got = embed_tokens(&model, &recs, layer, pool, Some(64), 3).unwrap();
        for (r, toks) in recs.iter().enumerate() {
            let want = reference_embedding(&model, toks, layer, 64, pool);
            let d = max_diff(&got[r], &want);
            assert!(d < 1e-4, "layer {layer} {pool:?} record {r}: max diff {d}");
        }
    }
    // Layer 0 is the embedding table itself: the mean of its rows for the record's tokens.
    let emb = &model.params[model.layout.embed_in];
    let table = tensor_to_vec(emb);
    let h = model.cfg.hidden_size;
    let got = embed_tokens(&model, &recs[1..2], 0, Pool::Mean, Some(64), 2).unwrap();
    let mut want = vec![0f64; h];
    for &t in recs[1] {
        for (a, x) in want
            .iter_mut()
            .zip(&table[t as usize * h..(t as usize + 1) * h])
        {
            *a += *x as f64 / recs[1].len() as f64;
        }
    }
    assert!(max_diff(&got[0], &want) < 1e-5);
}

#[test]
fn embed_and_plot_on_the_bundled_genomes() {
    let dir = tempfile::tempdir().unwrap();
    let emb = dir.path().join("emb.parquet");
    let png = dir.path().join("latent.png");
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--fasta",
        &s(&repo().join("data")),
        "--out",
        &s(&emb),
        "--seq-len",
        "64",
        "--plot",
        &s(&png),
        "--quiet",
    ]);
    assert!(ok, "embed failed: {err}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    // Read back with arrow: 29 records (5 viral genomes, 24 Leptospira contigs), hidden size 64.
    let t = genslm::infer::embed_io::read_embeddings(&emb, "length").unwrap();
    assert_eq!((t.n, t.dim), (29, 64));
    assert_eq!(t.layer, Some(2));
    assert!(t.values.iter().all(|v| v.is_finite()));
    // The same rows from a tokenized dataset (--data) give the same embeddings.
    let data = dir.path().join("data.parquet");
    let (ok, _, err) = run(&[
        "tokenize",
        "--fasta",
        &s(&repo().join("data")),
        "--out",
        &s(&data),
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let emb2 = dir.path().join("emb2.parquet");
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--data",
        &s(&data),
        "--out",
        &s(&emb2),
        "--seq-len",
        "64",
        "--batch-size",
        "3",
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let t2 = genslm::infer::embed_io::read_embeddings(&emb2, "length").unwrap();
    assert_eq!(t.color, t2.color);
    let d = t
        .values
        .iter()
        .zip(&t2.values)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-4, "fasta vs parquet input: {d}");
    // Without --seq-len the window is the one the model was trained with (64, genslm.toml).
    let emb3 = dir.path().join("emb3.parquet");
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--fasta",
        &s(&repo().join("data")),
        "--out",
        &s(&emb3),
        "--quiet",
    ]);
    assert!(ok, "{err}");
    let t3 = genslm::infer::embed_io::read_embeddings(&emb3, "length").unwrap();
    let d = t
        .values
        .iter()
        .zip(&t3.values)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-4, "default window: {d}");
    // pyarrow sees the right shape. pyarrow is a required reference tool (scripts/test.sh
    // installs it): its absence fails the test instead of skipping the check.
    let script = repo().join("scripts/check_embeddings.py");
    let o = std::process::Command::new("python3")
        .arg(&script)
        .arg(&emb)
        .args(["29", "64"])
        .output()
        .expect("python3 is required for the pyarrow check (./scripts/test.sh installs it)");
    assert!(
        o.status.success(),
        "pyarrow check failed (./scripts/test.sh installs pyarrow): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // genslm plot: numeric and text colour columns; a missing column is a clear error.
    for color in ["length", "source"] {
        let out = dir.path().join(format!("{color}.png"));
        let (ok, _, err) = run(&[
            "plot",
            "--embeddings",
            &s(&emb),
            "--out",
            &s(&out),
            "--color",
            color,
        ]);
        assert!(ok, "plot --color {color}: {err}");
        assert!(err.contains("plotted 29 points"), "{err}");
    }
    // A colour column spanning f64's range (rewritten by pyarrow): the colour scale's span
    // overflowed, and the colormap panicked on NaN.
    let wide = dir.path().join("wide.parquet");
    let o = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, pyarrow as pa, pyarrow.parquet as pq; t = pq.read_table(sys.argv[1]); \
             g = [1e308 if i % 2 else -1e308 for i in range(t.num_rows)]; \
             i = t.schema.get_field_index('gc_content'); \
             pq.write_table(t.set_column(i, 'gc_content', pa.array(g)), sys.argv[2])",
            &s(&emb),
            &s(&wide),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let png = dir.path().join("wide.png");
    let (ok, _, err) = run(&[
        "plot",
        "--embeddings",
        &s(&wide),
        "--out",
        &s(&png),
        "--color",
        "gc_content",
    ]);
    assert!(ok && png.is_file(), "{err}");
    // Rewritten by pyarrow with zstd pages (polars' default): plotted as written; with gzip
    // pages (inflated without a bound by the parquet library): refused by name, unread.
    for (codec, readable) in [("zstd", true), ("gzip", false)] {
        let copy = dir.path().join(format!("{codec}.parquet"));
        let o = std::process::Command::new("python3")
            .args([
                "-c",
                "import sys, pyarrow.parquet as pq; \
                 pq.write_table(pq.read_table(sys.argv[1]), sys.argv[2], compression=sys.argv[3])",
                &s(&emb),
                &s(&copy),
                codec,
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let png = dir.path().join(format!("{codec}.png"));
        let (ok, _, err) = run(&["plot", "--embeddings", &s(&copy), "--out", &s(&png)]);
        match readable {
            true => assert!(ok && err.contains("plotted 29 points"), "{err}"),
            false => assert!(!ok && err.contains("compressed with GZIP"), "{err}"),
        }
    }
    let out = dir.path().join("bad.png");
    let (ok, _, err) = run(&[
        "plot",
        "--embeddings",
        &s(&emb),
        "--out",
        &s(&out),
        "--color",
        "host_species",
    ]);
    assert!(!ok);
    assert!(
        err.contains("no column `host_species`") && err.contains("gc_content"),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn embed_bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let fa = s(&repo().join("data/lambda_virus.fa"));
    let out = s(&dir.path().join("e.parquet"));
    for (args, want) in [
        (
            vec![
                "embed",
                "--model",
                &s(&empty),
                "--fasta",
                &fa,
                "--out",
                &out,
            ],
            "not a model directory",
        ),
        (
            vec![
                "embed",
                "--model",
                &s(trained()),
                "--fasta",
                &fa,
                "--out",
                &out,
                "--layer",
                "7",
            ],
            "layer 7 (--layer/--layers)",
        ),
        (
            vec![
                "embed",
                "--model",
                &s(trained()),
                "--fasta",
                &fa,
                "--out",
                &out,
                "--layer",
                "-4",
            ],
            "layer -4 (--layer/--layers)",
        ),
    ] {
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    assert_eq!(
        common::listing(dir.path()),
        vec!["empty"],
        "nothing half-written"
    );
}

/// A genslm69 dataset of `(id, tokens, length)` rows, as a foreign tool could write one.
fn dataset(path: &Path, rows: &[(&str, Vec<u8>, u64)]) {
    use genslm::data::dataset::{DatasetWriter, Row};
    let mut w = DatasetWriter::create(
        path,
        genslm::tokenizer::VocabKind::Genslm69,
        genslm::data::digest::DigestKind::Xxh3,
    )
    .unwrap();
    for (id, tokens, length) in rows {
        w.push(&Row {
            id,
            description: "",
            source: "test",
            length: *length,
            gc_content: 0.5,
            digest: "",
            tokens,
        })
        .unwrap();
    }
    w.finish().unwrap();
}

/// A dataset whose token ids do not fit the model, or that carries no vocabulary, is refused
/// with the file and record named (dc757c5 panicked in the gather, or assumed genslm69).
#[test]
fn embed_refuses_foreign_datasets() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("foreign.parquet");
    dataset(
        &bad,
        &[("fine", vec![5u8, 6, 7], 9), ("alien", vec![5, 200, 7], 9)],
    );
    let out = dir.path().join("e.parquet");
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--data",
        &s(&bad),
        "--out",
        &s(&out),
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("foreign.parquet") && err.contains("'alien'") && err.contains("token id 200"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists());
    // train names the row and the token too (it gave the id alone).
    let (ok, _, err) = run(&[
        "train",
        "--data",
        &s(&bad),
        "--config",
        "tiny",
        "--out",
        &s(&dir.path().join("run")),
    ]);
    assert!(
        !ok && err.contains("foreign.parquet: row 1, token 1: id 200 does not fit"),
        "{err}"
    );
    // A [PAD] id inside a record is trained on as a target (the loss mask is the lengths'):
    // said, with its place.
    let pad = genslm::tokenizer::CodonTokenizer::new(genslm::tokenizer::VocabKind::Genslm69)
        .unwrap()
        .pad_id() as u8;
    let padded = dir.path().join("padded.parquet");
    let tokens: Vec<u8> = (0..40)
        .map(|i| if i == 7 { pad } else { 5 + i % 60 })
        .collect();
    dataset(&padded, &[("p", tokens, 120)]);
    let (ok, _, err) = run(&[
        "train",
        "--data",
        &s(&padded),
        "--config",
        "tiny",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--quiet",
        "--out",
        &s(&dir.path().join("run-pad")),
    ]);
    assert!(
        ok && err.contains("1 token(s) inside records are special ids")
            && err.contains("row 0, token 7"),
        "{err}"
    );

    // A record without an id (which tokenize no longer writes): its rows could not be told
    // apart from another's.
    let noid = dir.path().join("noid.parquet");
    dataset(&noid, &[("fine", vec![5, 6, 7], 9), ("", vec![5, 6, 7], 9)]);
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--data",
        &s(&noid),
        "--out",
        &s(&out),
    ]);
    assert!(
        !ok && err.contains("noid.parquet: row 1 has an empty id"),
        "{err}"
    );
    assert!(!out.exists());
    // An id holding a terminal escape is refused as tokenize refuses it; a repeated id is
    // written with the warning `embed --fasta` gives (it was silent).
    let escape = dir.path().join("escape.parquet");
    dataset(
        &escape,
        &[("ok", vec![5, 6, 7], 9), ("a\x1b[2J", vec![5, 6, 7], 9)],
    );
    let twice = dir.path().join("twice.parquet");
    dataset(
        &twice,
        &[("same", vec![5, 6, 7], 9), ("same", vec![8, 9, 10], 9)],
    );
    let embed = |data: &std::path::Path| {
        run(&[
            "embed",
            "--model",
            &s(trained()),
            "--data",
            &s(data),
            "--out",
            &s(&out),
        ])
    };
    let (ok, _, err) = embed(&escape);
    assert!(
        !ok && err.contains("row 1's id") && err.contains("control character"),
        "{err}"
    );
    assert!(!out.exists());
    let (ok, _, err) = embed(&twice);
    assert!(
        ok && err.contains("1 record(s) repeat an id seen before (the first: 'same')"),
        "{err}"
    );
    std::fs::remove_file(&out).unwrap();

    // The same file without genslm's vocabulary metadata (rewritten by pyarrow).
    let bare = dir.path().join("bare.parquet");
    let o = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, pyarrow.parquet as pq; t = pq.read_table(sys.argv[1]); \
             pq.write_table(t.replace_schema_metadata(None), sys.argv[2])",
            &s(&bad),
            &s(&bare),
        ])
        .output()
        .expect("python3 with pyarrow is required (./scripts/test.sh installs it)");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &s(trained()),
        "--data",
        &s(&bare),
        "--out",
        &s(&out),
    ]);
    assert!(
        !ok && err.contains("bare.parquet") && err.contains("genslm.vocab"),
        "{err}"
    );
}

/// `score` and `embed` cut records by one rule: the training window recorded beside the
/// checkpoint (64 here), not `max_position_embeddings` (dc757c5's score default).
#[test]
fn score_defaults_to_the_training_window_like_embed() {
    let fa = s(&repo().join("data/lambda_virus.fa"));
    let model = s(trained());
    let score = |extra: &[&str]| {
        let mut args = vec!["score", "--model", &model, "--fasta", &fa];
        args.extend(extra);
        let (ok, out, err) = run(&args);
        assert!(ok, "{err}");
        out
    };
    let default = score(&[]);
    assert_eq!(default, score(&["--seq-len", "64"]));
    let cfg = load_model_dir(trained(), &Device::flex()).unwrap().cfg;
    assert!(cfg.max_position_embeddings > 64);
    assert_ne!(
        default,
        score(&["--seq-len", &cfg.max_position_embeddings.to_string()])
    );
}

/// `--plot` is checked before any work: a directory there is refused with nothing written
/// (it failed after the embeddings were written, saying "Nothing was written"); a plot that
/// cannot be drawn (one record) names --plot and says where the embeddings are.
#[test]
fn a_plot_that_cannot_be_written_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("e.parquet");
    let fasta = s(&repo().join("data/vdv1.fasta.gz"));
    let model = s(trained());
    let embed = |plot: &Path| {
        run(&[
            "embed",
            "--model",
            &model,
            "--fasta",
            &fasta,
            "--out",
            &s(&out),
            "--plot",
            &s(plot),
            "--quiet",
        ])
    };
    let (ok, _, err) = embed(dir.path());
    assert!(
        !ok && err.contains("--plot ")
            && err.contains("is a directory")
            && err.contains("Nothing was written"),
        "{err}"
    );
    assert!(
        !out.exists(),
        "the embeddings were written before the refusal"
    );
    let png = dir.path().join("p.png");
    let (ok, _, err) = embed(&png);
    assert!(
        !ok && err.contains("--plot") && err.contains("the embeddings are written"),
        "{err}"
    );
    assert!(out.exists() && !png.exists());
}
