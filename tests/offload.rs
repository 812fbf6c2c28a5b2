//! `--offload` (issue 41): on the CPU backend the host is the device, so offloading moves
//! nothing and every step must equal the run without it bit for bit, whatever the layout
//! (the optimizer's state placed "on the host" and ZeRO-3's fp32 shard with it, the kept layer
//! inputs parked and brought back). The device side — the same losses on wgpu and the
//! moments' bytes leaving the device — is checked by scripts/test-kernels.sh on lavapipe.

mod curves;

use curves::{data, grid, tiny};
use genslm::config::{Config, Offload, Position, Precision};
use genslm::parallel::Degrees;
use genslm::train::metrics::{read_metrics, StepMetrics};
use genslm::train::trainer::{train_grid, RunOptions};

fn run(d: Degrees, zero: u8, offload: Offload, dir: &std::path::Path) -> Vec<StepMetrics> {
    run_in(Precision::Fp32, d, zero, offload, dir)
}

fn run_in(
    precision: Precision,
    d: Degrees,
    zero: u8,
    offload: Offload,
    dir: &std::path::Path,
) -> Vec<StepMetrics> {
    let mut c: Config = tiny(Position::Rotary, 64);
    c.train.precision = Some(precision);
    c.train.steps = 6;
    c.train.val_every = 0;
    c.train.warmup = 2;
    c.train.lr = 1e-2;
    c.train.zero = zero;
    c.train.checkpoint_activations = true;
    c.train.offload = offload;
    let out = dir.join(format!("{precision}-{d:?}-{zero}-{offload}"));
    train_grid(&c, &data(), &out, &RunOptions::default(), d).unwrap();
    read_metrics(&out.join("metrics.jsonl")).unwrap()
}

#[test]
fn offload_on_the_cpu_backend_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (one, dp2, sp2) = (grid(1, 1, 1, 1), grid(2, 1, 1, 1), grid(2, 1, 2, 1));
    for (d, zero) in [(one, 0), (dp2, 1), (dp2, 3), (sp2, 2)] {
        let base = run(d, zero, Offload::None, dir.path());
        assert_eq!(base.len(), 6);
        assert!(
            base[5].loss < base[0].loss,
            "{d:?} zero {zero}: the curve must move"
        );
        for o in [Offload::Optimizer, Offload::Activations, Offload::All] {
            let got = run(d, zero, o, dir.path());
            for (a, b) in base.iter().zip(&got) {
                assert_eq!(
                    (a.loss.to_bits(), a.grad_norm.to_bits()),
                    (b.loss.to_bits(), b.grad_norm.to_bits()),
                    "{d:?} zero {zero} --offload {o}, step {}",
                    a.step
                );
            }
        }
    }
}

/// Under the bf16 layout the fp32 masters are offloaded with the moments (ZeRO-2's shard of
/// them, the whole set without ZeRO): the same bits again.
#[test]
fn bf16_layout_offload_changes_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (one, dp2) = (grid(1, 1, 1, 1), grid(2, 1, 1, 1));
    for (d, zero) in [(one, 0), (dp2, 1), (dp2, 2)] {
        let base = run_in(Precision::Bf16, d, zero, Offload::None, dir.path());
        let got = run_in(Precision::Bf16, d, zero, Offload::Optimizer, dir.path());
        let bits = |m: &[StepMetrics]| {
            let m = m.iter().map(|m| (m.loss.to_bits(), m.grad_norm.to_bits()));
            m.collect::<Vec<_>>()
        };
        assert_eq!(bits(&base), bits(&got), "{d:?} zero {zero}");
    }
}

#[test]
fn activation_offload_without_checkpointing_is_refused_by_name() {
    let mut c: Config = tiny(Position::Rotary, 64);
    c.train.offload = Offload::Activations;
    let e = c.train.validate().unwrap_err();
    assert!(e.contains("checkpoint_activations"), "{e}");
    c.train.checkpoint_activations = true;
    assert!(c.train.validate().is_ok());
}
