//! ZeRO-2 and ZeRO-3 over the DP×SP group on threads give the one-rank run: the loss curve
//! over 8 optimizer steps (≤ 1e-5 relative), the gradient norm, and the checkpoint's weights
//! and moments, with and without activation checkpointing, with SP, for every position kind.

mod curves;

use curves::{data, same_checkpoint, same_curve, tiny};
use genslm::config::{Config, Position};
use genslm::train::metrics::read_metrics;
use genslm::train::trainer::{train, train_threads, RunOptions};

const SEQ: usize = 32;

fn config(pos: Position) -> Config {
    tiny(pos, SEQ)
}

fn run_layouts(pos: Position, layouts: &[(usize, usize, u8, bool)], grad_accum: usize) {
    let mut cfg = config(pos);
    cfg.train.grad_accum = grad_accum;
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(&cfg, &data(), &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for &(dp, sp, zero, ckpt) in layouts {
        let mut c = cfg.clone();
        c.train.zero = zero;
        c.train.checkpoint_activations = ckpt;
        let what = format!("{pos} dp {dp} sp {sp} zero {zero} ckpt {ckpt} accum {grad_accum}");
        let out = dir.path().join(format!("dp{dp}sp{sp}z{zero}c{ckpt}"));
        train_threads(&c, &data(), &out, &RunOptions::default(), dp, sp).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        same_curve(&m, &reference, &what);
        same_checkpoint(&out, &one, &what);
    }
}

#[test]
fn zero2_and_zero3_on_2_and_4_data_ranks_match_one_rank() {
    run_layouts(
        Position::Rotary,
        &[
            (2, 1, 2, false),
            (2, 1, 3, false),
            (2, 1, 3, true),
            (4, 1, 2, true),
            (4, 1, 3, false),
            (4, 1, 3, true),
        ],
        1,
    );
}

/// With SP the sharding group is DP×SP; the learned position table is split by rows over SP
/// and sharded over DP.
#[test]
fn zero_over_dp_times_sp_matches_one_rank() {
    for pos in [Position::Learned, Position::Alibi] {
        run_layouts(
            pos,
            &[
                (1, 2, 3, false),
                (2, 2, 2, false),
                (2, 2, 3, true),
                (2, 2, 3, false),
            ],
            1,
        );
    }
}

/// Several micro-batches: each one's reduce-scattered chunk adds into the step's.
#[test]
fn zero3_with_gradient_accumulation_matches_one_rank() {
    run_layouts(Position::Rotary, &[(2, 1, 3, true), (2, 2, 2, false)], 2);
}

/// A ZeRO-3 run saved on 4 ranks resumes on 2 and on 1 with the uninterrupted one-rank
/// losses: the checkpoint is layout-free.
#[test]
fn zero3_checkpoint_resumes_on_other_world_sizes() {
    let cfg = config(Position::Learned);
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(&cfg, &data(), &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for (dp, sp) in [(2, 1), (1, 1)] {
        let mut c = cfg.clone();
        c.train.zero = 3;
        let out = dir.path().join(format!("to{dp}x{sp}"));
        let first = RunOptions {
            stop_after: Some(3),
            ..Default::default()
        };
        train_threads(&c, &data(), &out, &first, 2, 2).unwrap();
        let resume = RunOptions {
            resume: true,
            ..Default::default()
        };
        train_threads(&c, &data(), &out, &resume, dp, sp).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        same_curve(&m, &reference, &format!("4 ranks → {dp}x{sp}"));
        same_checkpoint(&out, &one, &format!("4 ranks → {dp}x{sp}"));
    }
}

/// `zero` beyond 3 is refused before any work; ZeRO-3 on one rank trains like ZeRO-0.
#[test]
fn zero_stage_edges() {
    let mut cfg = config(Position::Rotary);
    cfg.train.zero = 4;
    let e = cfg.train.validate().unwrap_err();
    assert!(e.contains("zero") && e.contains("0, 1, 2 and 3"), "{e}");
    let mut cfg = config(Position::Rotary);
    cfg.train.steps = 2;
    let dir = tempfile::tempdir().unwrap();
    train(
        &cfg,
        &data(),
        &dir.path().join("z0"),
        &RunOptions::default(),
    )
    .unwrap();
    cfg.train.zero = 3;
    train_threads(
        &cfg,
        &data(),
        &dir.path().join("z3"),
        &RunOptions::default(),
        1,
        1,
    )
    .unwrap();
    let a = read_metrics(&dir.path().join("z3/metrics.jsonl")).unwrap();
    let b = read_metrics(&dir.path().join("z0/metrics.jsonl")).unwrap();
    assert_eq!(
        a.iter().map(|m| m.loss).collect::<Vec<_>>(),
        b.iter().map(|m| m.loss).collect::<Vec<_>>()
    );
}

/// metrics.jsonl's per-rank accounting against the closed form for N parameters on R ranks:
/// ZeRO-0 holds N weights, N gradients and 2N moments; ZeRO-1 2N/R moments; ZeRO-2 also N/R
/// gradients; ZeRO-3 N/R of everything (up to one padding element per rank and unit).
#[test]
fn per_rank_state_falls_with_the_stage() {
    use genslm::model::params::Layout;
    let cfg = config(Position::Rotary);
    let n = Layout::new(&cfg.model).num_params() as f64;
    let units = cfg.model.num_layers as f64 + 2.0;
    let dir = tempfile::tempdir().unwrap();
    for (zero, r) in [(0u8, 4usize), (1, 4), (2, 4), (3, 4), (3, 2)] {
        let m = curves::first_step_memory(&cfg, zero, r, dir.path());
        let rf = r as f64;
        let (p, g, o) = match zero {
            0 => (n, n, 2.0 * n),
            1 => (n, n, 2.0 * n / rf),
            2 => (n, n / rf, 2.0 * n / rf),
            _ => (n / rf, n / rf, 2.0 * n / rf),
        };
        for (what, got, want) in [
            ("params", m.params_bytes, p),
            ("grads", m.grads_bytes, g),
            ("optimizer", m.optimizer_bytes, o),
        ] {
            let got = got as f64 / 4.0;
            assert!(
                (got - want).abs() <= 2.0 * units,
                "zero {zero}, {r} ranks: {what} {got} elements, expected {want}"
            );
        }
    }
}
