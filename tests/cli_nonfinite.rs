//! `genslm train` at the optimizer's edge: updates that overflow the weights or AdamW's
//! moments are never saved, and `--skip-nonfinite` stops after too many skips in a row.

mod common;

use std::path::Path;

use common::{arg, repo, run};
use genslm::train::metrics::read_metrics;

/// Tiny on the bundled genomes at seq 64, batch 4 (`train_cli::try_train`), quietly; never a
/// panic.
fn train(out: &Path, extra: &[&str]) -> (bool, String) {
    let args = [&["--quiet"][..], extra].concat();
    let (ok, err) = common::train_cli::try_train(out, &common::train_cli::data(), &args);
    assert!(!err.contains("panicked"), "{err}");
    (ok, err)
}

/// An update that breaks the weights (finite loss and gradient, absurd lr: weights of ~1e30
/// whose forward is NaN) stops the run before it is saved: `latest` still names a checkpoint
/// that loads (dc757c5 saved non-finite weights and moved `latest` to them, so the run could
/// never resume). An lr past f32 (1e39) is refused before any work.
#[test]
fn an_overflowing_update_is_never_saved() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("lr");
    let (ok, err) = train(
        &out,
        &[
            "--steps",
            "3",
            "--lr",
            "1e30",
            "--warmup",
            "0",
            "--checkpoint-every",
            "1",
        ],
    );
    assert!(
        !ok && err.contains("non-finite") && err.contains("--lr"),
        "{err}"
    );
    assert!(
        !out.join("checkpoints/latest").exists(),
        "nothing finite was ever saved"
    );

    // After a good step 1, the bad update of step 2 leaves step 1 as `latest`, which loads.
    let out = dir.path().join("lr2");
    let (ok, err) = train(
        &out,
        &[
            "--steps",
            "3",
            "--warmup",
            "0",
            "--checkpoint-every",
            "1",
            "--stop-after",
            "1",
        ],
    );
    assert!(ok, "{err}");
    let mut cfg = std::fs::read_to_string(out.join("config.toml")).unwrap();
    cfg = cfg.replace("lr = 0.001", "lr = 1e39");
    assert!(cfg.contains("lr = 1e39"), "{cfg}");
    let forged = dir.path().join("forged.toml");
    std::fs::write(&forged, cfg).unwrap();
    let (data, f, o) = (arg(&repo().join("data")), arg(&forged), arg(&out));
    let (ok, _, err) = run(&[
        "train", "--fasta", &data, "--config", &f, "--out", &o, "--resume", "--quiet",
    ]);
    // lr is a refused change on resume: the checkpoint is untouched either way.
    assert!(!ok, "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step-1"
    );
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &o,
        "--fasta",
        &arg(&repo().join("data/dwv.fasta.gz")),
    ]);
    assert!(ok, "latest loads: {err}");
}

/// Unclipped, a finite gradient of norm ~1e27 overflowed AdamW's f32 second moment: the
/// weights stayed finite, the run saved and exited 0, and its resume refused the run's own
/// checkpoint as corrupt. Such a step is skipped (or stops the run, saying why) like a
/// non-finite one, and what is saved resumes.
#[test]
fn a_gradient_whose_square_overflows_is_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big");
    let args = [
        "--steps",
        "4",
        "--lr",
        "1e3",
        "--warmup",
        "1",
        "--max-grad-norm",
        "0",
        "--checkpoint-every",
        "2",
    ];
    let (ok, err) = train(&out, &args);
    assert!(
        !ok && err.contains("too large for the optimizer") && err.contains("--max-grad-norm"),
        "{err}"
    );
    let (ok, err) = train(
        &out,
        &[&args[..], &["--skip-nonfinite", "--overwrite"]].concat(),
    );
    assert!(ok && err.contains("step skipped"), "{err}");
    let more = ["--steps", "6", "--skip-nonfinite", "--resume"];
    let (ok, err) = train(&out, &[&args[2..], &more[..]].concat());
    assert!(ok, "{err}");
}

/// `--skip-nonfinite` stops, exit ≠ 0, after more than `--max-consecutive-skips` skipped steps
/// in a row (dc757c5 skipped 37 of 40 and exited 0 with "loss NaN").
#[test]
fn endless_skips_stop_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("skip");
    let (ok, err) = train(
        &out,
        &[
            "--steps",
            "8",
            "--lr",
            "1e30",
            "--warmup",
            "0",
            "--skip-nonfinite",
            "--max-consecutive-skips",
            "2",
        ],
    );
    assert!(
        !ok && err.contains("step 4: 3 consecutive steps") && err.contains("max_consecutive_skips"),
        "{err}"
    );
    // Step 1 applied, steps 2 and 3 skipped and logged; the third skip (step 4) stops the run.
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.len(), 3);
    assert!(!m[0].skipped_nonfinite && m[1].skipped_nonfinite && m[2].skipped_nonfinite);
}
