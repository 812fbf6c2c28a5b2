//! DeepSpeed's mixed-precision layout (issue 41, `--precision bf16`, `train::master`): bf16
//! working weights, fp32 master weights beside the Adam moments, sharded with them. ZeRO 1/2/3
//! give the replicated optimizer's curve and checkpoint, a DP split follows one bf16 rank
//! within bf16 rounding, a bf16 run resumes exactly, and each
//! rank holds the bytes per parameter the layout's table gives (closed form from the
//! parameter count).

mod curves;

use std::path::Path;

use curves::{data, first_step_memory, grid, same_checkpoint, same_curve, tiny};
use genslm::config::{Config, Position, Precision};
use genslm::model::params::Layout;
use genslm::parallel::Degrees;
use genslm::train::metrics::{read_metrics, StepMetrics};
use genslm::train::trainer::{train_grid, RunOptions};

fn bf16(pos: Position) -> Config {
    let mut cfg = tiny(pos, 32);
    cfg.train.precision = Some(Precision::Bf16);
    cfg
}

/// `dp` data ranks of `pp` pipeline stages.
fn stages(dp: usize, pp: usize) -> Degrees {
    Degrees {
        pp,
        ..grid(dp, 1, 1, 1)
    }
}

/// Trains `cfg` under `d` with ZeRO `zero` (activation checkpointing `ckpt`) into `dir`.
fn run(cfg: &Config, d: Degrees, zero: u8, ckpt: bool, dir: &Path) -> Vec<StepMetrics> {
    let mut c = cfg.clone();
    c.train.zero = zero;
    c.train.checkpoint_activations = ckpt;
    train_grid(&c, &data(), dir, &RunOptions::default(), d).unwrap();
    read_metrics(&dir.join("metrics.jsonl")).unwrap()
}

/// The largest relative difference of the losses and gradient norms of two curves.
fn worst(a: &[StepMetrics], b: &[StepMetrics]) -> f64 {
    assert_eq!(a.len(), b.len());
    let rel = |x: f64, y: f64| (x - y).abs() / y.abs().max(1e-3);
    a.iter()
        .zip(b)
        .map(|(a, b)| rel(a.loss, b.loss).max(rel(a.grad_norm, b.grad_norm)))
        .fold(0.0, f64::max)
}

/// ZeRO-1/2/3 shard the masters with the moments: on each layout they give the replicated
/// optimizer's (ZeRO-0's) curve and checkpoint, DP, TP × DP, TP × SP, DP × SP and PP × DP, learned
/// positions (whose SP-split table keeps its own master) and rotary.
#[test]
fn bf16_layout_under_zero_1_2_3_matches_the_replicated_optimizer() {
    for (pos, d, stages) in [
        (Position::Rotary, grid(2, 1, 1, 1), &[1u8, 2, 3][..]),
        (Position::Rotary, grid(4, 1, 1, 1), &[3][..]),
        (Position::Learned, grid(2, 1, 1, 2), &[3][..]),
        (Position::Learned, grid(1, 1, 2, 2), &[2][..]),
        (Position::Learned, grid(2, 1, 2, 1), &[1, 3][..]),
        (Position::Rotary, stages(2, 2), &[1][..]),
    ] {
        let mut cfg = bf16(pos);
        cfg.train.grad_accum = d.pp;
        let dir = tempfile::tempdir().unwrap();
        let reference = run(&cfg, d, 0, false, &dir.path().join("z0"));
        for &zero in stages {
            let ckpt = zero == 3;
            let what = format!("{pos} {d:?} zero {zero} ckpt {ckpt}");
            let out = dir.path().join(format!("z{zero}"));
            let m = run(&cfg, d, zero, ckpt, &out);
            same_curve(&m, &reference, &what);
            same_checkpoint(&out, &dir.path().join("z0"), &what);
        }
    }
}

/// Against one bf16 rank, a DP split differs only by where the weight gradients' bf16
/// rounding happens (each rank rounds its partial sum, as DeepSpeed's bf16 gradients do):
/// within bf16's relative rounding (2⁻⁸) over the 8 steps, and well above fp32's 1e-5 (so the
/// runs did compute in bf16).
#[test]
fn bf16_layout_on_data_ranks_follows_one_bf16_rank_within_bf16_rounding() {
    let cfg = bf16(Position::Rotary);
    let dir = tempfile::tempdir().unwrap();
    let one = run(&cfg, grid(1, 1, 1, 1), 0, false, &dir.path().join("one"));
    for zero in [1u8, 3] {
        let m = run(
            &cfg,
            grid(2, 1, 1, 1),
            zero,
            false,
            &dir.path().join(format!("z{zero}")),
        );
        let w = worst(&m, &one);
        eprintln!("zero {zero} dp 2 vs one bf16 rank: worst relative difference {w:.2e}");
        assert!(w < 2f64.powi(-8) && w > 1e-5, "zero {zero}: {w}");
    }
}

/// Four steps, then a resume to eight, give the uninterrupted bf16 run's losses bit for bit,
/// on one rank and with the masters sharded by ZeRO-1/2/3 over two: the checkpoint holds the
/// fp32 masters, and the working copies are rebuilt from them.
#[test]
fn a_bf16_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (one_rank, dp2) = (grid(1, 1, 1, 1), grid(2, 1, 1, 1));
    for (d, zero) in [(one_rank, 0u8), (dp2, 1), (dp2, 2), (dp2, 3)] {
        let mut cfg = bf16(Position::Rotary);
        cfg.train.zero = zero;
        let (one, two) = (
            dir.path().join(format!("a{zero}")),
            dir.path().join(format!("b{zero}")),
        );
        train_grid(&cfg, &data(), &one, &RunOptions::default(), d).unwrap();
        let first = RunOptions {
            stop_after: Some(4),
            ..Default::default()
        };
        train_grid(&cfg, &data(), &two, &first, d).unwrap();
        let resume = RunOptions {
            resume: true,
            ..Default::default()
        };
        train_grid(&cfg, &data(), &two, &resume, d).unwrap();
        let losses = |d: &Path| {
            let m = read_metrics(&d.join("metrics.jsonl")).unwrap();
            m.iter()
                .map(|m| (m.step, m.loss.to_bits()))
                .collect::<Vec<_>>()
        };
        assert_eq!(losses(&two), losses(&one), "zero {zero}");
    }
}

/// Bytes per parameter per rank under the bf16 layout, N parameters over R ranks (see
/// `train::master`): ZeRO-0 2 + 4 + 12; ZeRO-1 2 + 4 + 12/R; ZeRO-2 2 + 4/R + 12/R; ZeRO-3
/// 4/R (the fp32 master pieces) + 4/R + 8/R; up to one padding element per rank and unit.
/// `genslm plan` gives the same bytes for the same rank.
#[test]
fn bf16_layout_holds_deepspeed_bytes_per_parameter() {
    let cfg = bf16(Position::Rotary);
    let n = Layout::new(&cfg.model).num_params() as f64;
    let units = cfg.model.num_layers as f64 + 2.0;
    let dir = tempfile::tempdir().unwrap();
    for (zero, r) in [(0u8, 2usize), (1, 4), (2, 4), (3, 4)] {
        let m = first_step_memory(&cfg, zero, r, dir.path());
        let rf = r as f64;
        let (p, g, o) = match zero {
            0 => (2.0 * n, 4.0 * n, 12.0 * n),
            1 => (2.0 * n, 4.0 * n, 12.0 * n / rf),
            2 => (2.0 * n, 4.0 * n / rf, 12.0 * n / rf),
            _ => (4.0 * n / rf, 4.0 * n / rf, 8.0 * n / rf),
        };
        // The planner's account of the same rank (`genslm plan --json`'s rank states).
        let planned = plan_states(zero, r);
        for (what, got, want) in [
            ("parameters", m.params_bytes, p),
            ("gradients", m.grads_bytes, g),
            ("optimizer_states", m.optimizer_bytes, o),
        ] {
            assert!(
                (got as f64 - want).abs() <= 12.0 * units,
                "zero {zero}, {r} ranks: {what} {got} bytes, expected {want}"
            );
            let plan = planned[what].as_f64().unwrap();
            assert!(
                (got as f64 - plan).abs() <= 12.0 * units,
                "zero {zero}, {r} ranks: {what} {got} bytes, the planner says {plan}"
            );
        }
    }
}

/// `genslm plan`'s per-rank weights, gradients and optimizer state for tiny in bf16 on `r`
/// CPU processes of one data-parallel group under ZeRO `zero`.
fn plan_states(zero: u8, r: usize) -> serde_json::Value {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let (r, zero) = (r.to_string(), zero.to_string());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_genslm"))
        .args([
            "plan",
            "--config",
            tiny.to_str().unwrap(),
            "--device",
            "cpu",
        ])
        .args([
            "--precision",
            "bf16",
            "--gpus",
            &r,
            "--dp",
            &r,
            "--zero",
            &zero,
        ])
        .args(["--seq-len", "32", "--gpu-mem-gib", "8", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["rank_states_at_seq_len"].clone()
}

/// ZeRO-1/2/3 over two data ranks against one bf16 rank within 1e-5 (curve and checkpoint):
/// the one rank runs the same four sequences per step as two micro-batches of two, so each of
/// its micro-batches rounds its weight gradients to bf16 over the rows one data rank holds, and
/// the micro-batches are summed in fp32 as the two ranks' gradients are.
#[test]
fn bf16_layout_under_zero_1_2_3_matches_one_bf16_rank_with_the_same_micro_batches() {
    let cfg = bf16(Position::Rotary);
    let dir = tempfile::tempdir().unwrap();
    let mut one = cfg.clone();
    (one.train.batch_size, one.train.grad_accum) = (cfg.train.batch_size / 2, 2);
    let reference = run(&one, grid(1, 1, 1, 1), 0, false, &dir.path().join("one"));
    for zero in [1u8, 2, 3] {
        let out = dir.path().join(format!("z{zero}"));
        let m = run(&cfg, grid(2, 1, 1, 1), zero, false, &out);
        let what = format!("dp 2 zero {zero} vs one bf16 rank, two micro-batches");
        same_curve(&m, &reference, &what);
        same_checkpoint(&out, &dir.path().join("one"), &what);
    }
}
