//! `genslm train` on the bundled genomes with the tiny config, for the CLI tests of training
//! and of resuming.

use std::path::Path;

use genslm::train::metrics::read_metrics;

use super::{repo, run};

pub fn tiny() -> String {
    repo().join("configs/tiny.toml").display().to_string()
}

pub fn data() -> String {
    repo().join("data").display().to_string()
}

/// Trains into `out` with `extra` flags (quietly, through `try_train`); panics with stderr on
/// failure.
pub fn train(out: &Path, extra: &[&str]) -> String {
    let args: Vec<&str> = ["--quiet"].iter().chain(extra).copied().collect();
    let (ok, err) = try_train(out, &data(), &args);
    assert!(ok, "train failed: {err}");
    err
}

pub fn losses(out: &Path) -> Vec<f64> {
    read_metrics(&out.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| m.loss)
        .collect()
}

pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `train` with `extra` flags; returns (success, stderr) instead of panicking.
pub fn try_train(out: &Path, fasta: &str, extra: &[&str]) -> (bool, String) {
    let mut args: Vec<String> = ["train", "--fasta", fasta, "--config", &tiny()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--out".into(), out.display().to_string()]);
    args.extend(
        ["--seq-len", "64", "--batch-size", "4"]
            .iter()
            .map(|s| s.to_string()),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    let (ok, _, err) = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    (ok, err)
}
