//! Helpers shared by the CLI tests.
#![allow(dead_code)]

pub mod train_cli;
pub mod variants_cli;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_genslm"))
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the binary with `args`; returns (exit ok, stdout, stderr).
pub fn run(args: &[&str]) -> (bool, String, String) {
    let out: Output = bin().args(args).output().expect("binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Names of the files in `dir` (to check nothing half-written was left).
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A path as a command-line argument.
pub fn arg(p: &Path) -> String {
    p.display().to_string()
}

/// The trained tiny model's latest checkpoint directory (config.json, model.safetensors).
pub fn tiny_checkpoint() -> PathBuf {
    let trained = trained_tiny();
    let step = std::fs::read_to_string(trained.join("checkpoints/latest")).unwrap();
    trained.join("checkpoints").join(step.trim())
}

/// A tiny model trained briefly (30 steps) on the bundled genomes, once per test process, in
/// the target's scratch directory.
pub fn trained_tiny() -> &'static Path {
    static RUN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    RUN.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("trained_tiny_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("run");
        let (ok, _, err) = run(&[
            "train",
            "--fasta",
            &arg(&repo().join("data")),
            "--config",
            &arg(&repo().join("configs/tiny.toml")),
            "--out",
            &arg(&out),
            "--quiet",
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--steps",
            "30",
            "--lr",
            "5e-3",
            "--warmup",
            "3",
        ]);
        assert!(ok, "train failed: {err}");
        out
    })
}

/// A GPT-NeoX shape with the codon vocabulary, rotary positions and flash attention (the
/// planner tests' models).
pub fn neox_shape(
    layers: usize,
    hidden: usize,
    heads: usize,
    intermediate: usize,
) -> genslm::config::ModelConfig {
    genslm::config::ModelConfig {
        name: "t".into(),
        num_layers: layers,
        hidden_size: hidden,
        num_heads: heads,
        intermediate_size: intermediate,
        vocab: genslm::tokenizer::VocabKind::Genslm69,
        vocab_size: 69,
        max_position_embeddings: 2048,
        position: genslm::config::Position::Rotary,
        rotary_pct: 0.25,
        rotary_base: 10000.0,
        layer_norm_eps: 1e-5,
        attention: genslm::config::AttentionKind::Flash,
    }
}
