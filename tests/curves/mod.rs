//! What the equivalence tests share: the tiny config at a sequence length, the repository's
//! FASTA, and the comparisons of a run's loss curve and final checkpoint with a reference run.
#![allow(dead_code)]

use std::path::Path;

use genslm::config::{Config, Position};
use genslm::model::tensors::read_safetensors;
use genslm::parallel::Degrees;
use genslm::train::checkpoint::moment_tensors;
use genslm::train::metrics::{read_metrics, RankMemory, StepMetrics};
use genslm::train::trainer::{train, train_grid, train_threads, DataSource, RunOptions};

pub const STEPS: u64 = 8;

pub fn data() -> DataSource {
    DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")])
}

/// The degrees of a layout without pipeline stages.
pub fn grid(dp: usize, cp: usize, sp: usize, tp: usize) -> Degrees {
    Degrees {
        dp,
        cp,
        sp,
        tp,
        pp: 1,
    }
}

/// configs/tiny.toml (4 heads) with `pos`, sequences of `seq` tokens, batch 4, 8 steps.
pub fn tiny(pos: Position, seq: usize) -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let mut cfg = Config::load(&path).unwrap();
    cfg.model.position = pos;
    cfg.model.max_position_embeddings = 2 * seq;
    cfg.train.seq_len = seq;
    cfg.train.batch_size = 4;
    cfg.train.steps = STEPS;
    cfg.train.val_every = 4;
    cfg.train.lr = 3e-3;
    cfg
}

/// Trains `cfg` on one rank, then on each layout `(degrees, zero, checkpoint_activations)`
/// as threads, and checks every layout's curve and final checkpoint against the one rank's.
pub fn layouts_match_one_rank(cfg: &Config, layouts: &[(Degrees, u8, bool)]) {
    let (pos, seq) = (cfg.model.position, cfg.train.seq_len);
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(cfg, &data(), &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for &(d, zero, ckpt) in layouts {
        let mut c = cfg.clone();
        c.train.zero = zero;
        c.train.checkpoint_activations = ckpt;
        let Degrees { dp, cp, sp, tp, pp } = d;
        let what = format!(
            "{pos} seq {seq} dp {dp} pp {pp} cp {cp} sp {sp} tp {tp} zero {zero} ckpt {ckpt}"
        );
        let out = dir
            .path()
            .join(format!("d{dp}p{pp}c{cp}s{sp}t{tp}z{zero}k{ckpt}"));
        train_grid(&c, &data(), &out, &RunOptions::default(), d).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        same_curve(&m, &reference, &what);
        same_checkpoint(&out, &one, &what);
    }
}

/// metrics.jsonl's memory accounting of rank 0 after one step of `cfg` under ZeRO `zero` on
/// `ranks` data-parallel thread ranks, run in `dir`.
pub fn first_step_memory(cfg: &Config, zero: u8, ranks: usize, dir: &Path) -> RankMemory {
    let mut c = cfg.clone();
    c.train.zero = zero;
    c.train.steps = 1;
    let out = dir.join(format!("z{zero}r{ranks}"));
    train_threads(&c, &data(), &out, &RunOptions::default(), ranks, 1).unwrap();
    read_metrics(&out.join("metrics.jsonl")).unwrap()[0]
        .memory
        .expect("memory accounting")
}

/// Losses, validation losses and gradient norms equal the reference's (≤ 1e-5 relative).
pub fn same_curve(m: &[StepMetrics], reference: &[StepMetrics], what: &str) {
    assert_eq!(m.len(), reference.len(), "{what}: steps logged");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1e-3);
    for (a, b) in m.iter().zip(reference) {
        assert!(
            close(a.loss, b.loss),
            "{what} step {}: loss {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
        assert!(
            close(a.grad_norm, b.grad_norm),
            "{what} step {}: grad norm {} vs {}",
            a.step,
            a.grad_norm,
            b.grad_norm
        );
        let (va, vb) = (a.val_loss.unwrap_or(0.0), b.val_loss.unwrap_or(0.0));
        assert!(close(va, vb), "{what} step {}: val {va} vs {vb}", a.step);
    }
}

/// The last checkpoint holds the one-rank weights (1e-4 absolute: AdamW moves a weight by up
/// to lr per step whatever the gradient's size, so sub-ulp gradient differences can move it
/// by a fraction of that) and moments (1e-3 of the tensor's largest magnitude), by name.
pub fn same_checkpoint(a: &Path, b: &Path, what: &str) {
    for (file, moments) in [("model.safetensors", false), ("optimizer", true)] {
        // The optimizer state is sharded by rank: compare it assembled, by name.
        let read = |d: &Path| {
            let dir = d.join(format!("checkpoints/step-{STEPS}"));
            if moments {
                moment_tensors(&dir).unwrap()
            } else {
                read_safetensors(&dir.join(file)).unwrap().0
            }
        };
        let (ta, tb) = (read(a), read(b));
        assert_eq!(ta.len(), tb.len(), "{what}: {file} tensor count");
        for (name, y) in &tb {
            let x = &ta[name];
            assert_eq!(x.shape, y.shape, "{what}: {file} {name}");
            let diff = x
                .data
                .iter()
                .zip(&y.data)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            let scale = y.data.iter().fold(0f32, |m, q| m.max(q.abs()));
            let tol = if moments {
                1e-3 * scale.max(1e-12)
            } else {
                1e-4
            };
            assert!(diff <= tol, "{what}: {file} {name} differs by {diff}");
        }
    }
}

/// Trains `cfg` on one rank; then, for each `(name, before, after)`, 3 steps under `before`
/// and the rest resumed under `after`: the curve and the final checkpoint must be the one
/// rank's (checkpoints do not depend on the layout).
pub fn resumes_match_one_rank(cfg: &Config, cases: &[(&str, Degrees, Degrees)]) {
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(cfg, &data(), &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for &(name, before, after) in cases {
        let out = dir.path().join(name);
        let first = RunOptions {
            stop_after: Some(3),
            ..Default::default()
        };
        train_grid(cfg, &data(), &out, &first, before).unwrap();
        let resume = RunOptions {
            resume: true,
            ..Default::default()
        };
        train_grid(cfg, &data(), &out, &resume, after).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        same_curve(&m, &reference, name);
        same_checkpoint(&out, &one, name);
    }
}
