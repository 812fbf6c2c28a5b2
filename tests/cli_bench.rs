//! `genslm bench attention` and its hidden `bench step` run their cases and report numbers.

mod common;

use common::{repo, run};

#[test]
fn bench_attention_runs_every_case() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = run(&[
        "bench",
        "attention",
        "--config",
        cfg,
        "--seq-lens",
        "64",
        "--checkpoint-activations",
    ]);
    assert!(ok, "{err}");
    // One row per case: seq_len, case, step seconds, tokens/s, peak MiB.
    for case in ["flash", "flash+ckpt", "naive"] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(case))
            .unwrap_or_else(|| panic!("no {case} row in:\n{out}"));
        let nums: Vec<f64> = row
            .split_whitespace()
            .skip(2)
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(nums.len(), 3, "{row}");
        assert!(nums.iter().all(|x| *x > 0.0), "{row}");
    }
    // A step needs two tokens: a clear error, no panic.
    let (ok, _, err) = run(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--seq-len",
        "1",
        "--attention",
        "flash",
    ]);
    assert!(!ok && err.contains("at least 2 tokens"), "{err}");
}

#[test]
fn bench_train_reports_throughput_and_threads() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = run(&[
        "bench",
        "train",
        "--config",
        cfg,
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--threads",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("threads 1:") && out.contains("tokens/s") && out.contains("GFLOP/s"),
        "{out}"
    );
    // The thread count and the step count must be positive: clear errors, no panic.
    for bad in [["--threads", "0"], ["--steps", "0"]] {
        let (ok, _, err) = run(&[
            "bench",
            "train",
            "--config",
            cfg,
            "--seq-len",
            "32",
            bad[0],
            bad[1],
        ]);
        assert!(
            !ok && err.contains(bad[0]) && !err.contains("panicked"),
            "{err}"
        );
    }
}
