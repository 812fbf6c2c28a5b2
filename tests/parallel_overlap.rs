//! Overlapped communication (issue 42) changes when collectives run, not what they compute:
//! every layout's 8-step curve — losses, validation losses, gradient norms — and its final
//! checkpoint are bit-identical with overlap on (the default) and with `--no-overlap`, on
//! thread ranks; under Ulysses SP and the CP ring, whose overlap computes the MLP in parts
//! (two; CP + 1), within 1e-6. The layouts cover ZeRO-2 and ZeRO-3 (with and without activation
//! checkpointing, prefetching 1 or 2 layers ahead, with gradient accumulation), DP, SP, CP,
//! SP × CP and TP.

mod curves;

use curves::{data, grid, tiny};
use genslm::config::{Config, Position};
use genslm::model::tensors::read_safetensors;
use genslm::parallel::Degrees;
use genslm::train::metrics::read_metrics;
use genslm::train::trainer::{train_grid, RunOptions};

/// (degrees, zero, checkpoint_activations, prefetch_layers, grad_accum)
type Case = (Degrees, u8, bool, usize, usize);

fn run(cfg: &Config, case: Case, overlap: bool, dir: &std::path::Path) -> std::path::PathBuf {
    let (d, zero, ckpt, prefetch, accum) = case;
    let mut c = cfg.clone();
    c.train.zero = zero;
    c.train.checkpoint_activations = ckpt;
    c.train.prefetch_layers = prefetch;
    c.train.grad_accum = accum;
    c.train.overlap = overlap;
    let out = dir.join(format!("{d:?}-{zero}-{ckpt}-{prefetch}-{accum}-{overlap}"));
    train_grid(&c, &data(), &out, &RunOptions::default(), d).unwrap();
    out
}

/// Overlap changes when collectives run; where it also changes a summation order (Ulysses
/// computes the MLP in two halves of the rows beside its exchanges, the CP ring in CP + 1
/// parts beside its passes, so each MLP weight's gradient is partial sums added), `close` asks
/// for 1e-6 relative instead of the same bits.
fn same_with_and_without_overlap(cfg: &Config, cases: &[(Case, bool)]) {
    let dir = tempfile::tempdir().unwrap();
    for &(case, close) in cases {
        let on = run(cfg, case, true, dir.path());
        let off = run(cfg, case, false, dir.path());
        let what = format!("{case:?}");
        let (a, b) = (
            read_metrics(&on.join("metrics.jsonl")).unwrap(),
            read_metrics(&off.join("metrics.jsonl")).unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{what}");
        assert_eq!(a.len(), curves::STEPS as usize, "{what}");
        let same = |x: f64, y: f64| match close {
            false => x.to_bits() == y.to_bits(),
            true => (x - y).abs() <= 1e-6 * y.abs().max(1e-3),
        };
        for (x, y) in a.iter().zip(&b) {
            assert!(
                same(x.loss, y.loss),
                "{what} step {}: {} vs {}",
                x.step,
                x.loss,
                y.loss
            );
            assert!(
                same(x.grad_norm, y.grad_norm),
                "{what}: {} vs {}",
                x.grad_norm,
                y.grad_norm
            );
            let (vx, vy) = (x.val_loss.unwrap_or(0.0), y.val_loss.unwrap_or(0.0));
            assert!(same(vx, vy), "{what}: val {vx} vs {vy}");
            assert!(x.comm_wait_s.is_some(), "{what}: comm_wait_s is measured");
        }
        let weights = |run: &std::path::Path| {
            let file = format!("checkpoints/step-{}/model.safetensors", curves::STEPS);
            read_safetensors(&run.join(file)).unwrap().0
        };
        let (wa, wb) = (weights(&on), weights(&off));
        assert_eq!(wa.len(), wb.len(), "{what}");
        for (name, t) in &wa {
            if close {
                let worst = t
                    .data
                    .iter()
                    .zip(&wb[name].data)
                    .map(|(p, q)| (p - q).abs());
                let worst = worst.fold(0f32, f32::max);
                // AdamW moves a weight by up to lr per step whatever the gradient's size (as
                // curves::same_checkpoint).
                assert!(worst <= 1e-4, "{what}: {name} differs by {worst}");
            } else {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&t.data), bits(&wb[name].data), "{what}: {name}");
            }
        }
    }
}

#[test]
fn zero2_and_zero3_curves_are_bit_identical_with_and_without_overlap() {
    let cfg = tiny(Position::Rotary, 32);
    same_with_and_without_overlap(
        &cfg,
        &[
            ((grid(2, 1, 1, 1), 2, false, 1, 1), false),
            ((grid(2, 1, 1, 1), 3, true, 1, 1), false),
            ((grid(4, 1, 1, 1), 3, true, 2, 1), false),
            ((grid(2, 1, 1, 1), 3, false, 1, 2), false),
            ((grid(2, 1, 1, 1), 3, true, 0, 1), false),
        ],
    );
}

#[test]
fn dp_sp_cp_and_tp_curves_match_with_and_without_overlap() {
    let cfg = tiny(Position::Learned, 32);
    same_with_and_without_overlap(
        &cfg,
        &[
            ((grid(2, 1, 1, 1), 1, false, 1, 1), false),
            ((grid(1, 1, 2, 1), 3, true, 1, 1), true),
            ((grid(1, 1, 4, 1), 0, false, 1, 1), true),
            ((grid(1, 2, 1, 1), 1, false, 1, 1), true),
            ((grid(1, 4, 1, 1), 0, true, 1, 1), true),
            ((grid(1, 2, 2, 1), 2, false, 1, 1), false),
            ((grid(2, 1, 1, 2), 3, true, 1, 1), false),
        ],
    );
}
