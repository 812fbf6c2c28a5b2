//! Sequence and data parallelism on threads give the single-rank loss and gradients
//! (rotary, sharded learned, ALiBi positions), and keep matching over optimizer steps.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use burn::tensor::Tensor;
use genslm::config::{Config, Position};
use genslm::data::loader::{Batch, Corpus, Loader};
use genslm::model::tensors::read_safetensors;
use genslm::model::GenSlm;
use genslm::ops::primitive::host_to_param;
use genslm::ops::primitive::tensor_to_vec;
use genslm::parallel::parallelize::{gather_shard, parallelize};
use genslm::parallel::ranks::thread_grid;
use genslm::parallel::ranks::{thread_ranks, Ranks};
use genslm::parallel::Degrees;
use genslm::rng::SplitMix64;
use genslm::train::checkpoint::moment_tensors;
use genslm::train::engine::Engine;
use genslm::train::layerwise::Keep;
use genslm::train::metrics::{read_metrics, StepMetrics};
use genslm::train::optim::{AdamW, AdamWConfig};
use genslm::train::optim_shards::{write_shard, MomentShards};
use genslm::train::step::step_loss_and_grads;
use genslm::train::trainer::{train, train_threads, DataSource, RunOptions};

const SEQ: usize = 32;

fn config(pos: Position) -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let mut cfg = Config::load(&path).unwrap();
    cfg.model.position = pos;
    // Learned positions are sharded by table rows: the table is as long as the sequence.
    cfg.model.max_position_embeddings = SEQ;
    cfg.train.seq_len = SEQ;
    cfg.train.batch_size = 4;
    cfg
}

/// Two micro-batches of 4 rows with a padded row, from random codons.
fn batches() -> Vec<Batch> {
    let mut g = SplitMix64::new(11);
    let recs: Vec<Vec<u32>> = (0..9)
        .map(|i| {
            (0..if i == 3 { 20 } else { SEQ })
                .map(|_| 5 + g.below(64) as u32)
                .collect()
        })
        .collect();
    let corpus = Corpus::new(recs, SEQ, 3, 0.0, 1).unwrap();
    let mut loader = Loader::new(2, 0);
    vec![loader.next_batch(&corpus, 4), loader.next_batch(&corpus, 4)]
}

/// Loss and full gradients (position table gathered) of one step under `dp × sp`, with full
/// activation checkpointing when `ckpt`.
fn step(pos: Position, dp: usize, sp: usize, ckpt: bool) -> (f64, Vec<Vec<f32>>) {
    let cfg = config(pos);
    let run = move |ranks: Ranks| {
        let ad = Device::flex().autodiff();
        let model = GenSlm::init(cfg.model.clone(), 5, &ad).unwrap();
        let mut model = parallelize(model, None, &ranks, SEQ).unwrap();
        model.params = model.params.into_iter().map(|p| p.require_grad()).collect();
        let (loss, grads) =
            step_loss_and_grads(&model, &batches(), &ranks, Keep::of(ckpt, false)).unwrap();
        let full: Vec<Vec<f32>> = grads
            .iter()
            .enumerate()
            .map(|(i, g)| {
                if model.sp.is_some() && Some(i) == model.layout.embed_pos {
                    tensor_to_vec(&gather_shard(g, &ranks).unwrap())
                } else {
                    tensor_to_vec(g)
                }
            })
            .collect();
        (loss, full)
    };
    if dp * sp == 1 {
        return run(Ranks::single());
    }
    let run = Arc::new(run);
    let hs: Vec<_> = thread_ranks(dp, sp, Duration::from_secs(60))
        .into_iter()
        .map(|r| {
            let run = run.clone();
            std::thread::spawn(move || run(r))
        })
        .collect();
    let mut out: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    // Every rank must agree on the loss and the replicated gradients.
    for o in &out[1..] {
        assert!((o.0 - out[0].0).abs() <= 1e-6 * out[0].0.abs());
    }
    out.swap_remove(0)
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn sp_and_dp_match_one_rank() {
    for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
        let (loss1, g1) = step(pos, 1, 1, false);
        for (dp, sp) in [(1, 2), (1, 4), (2, 1), (2, 2)] {
            let (loss, g) = step(pos, dp, sp, false);
            assert!(
                (loss - loss1).abs() / loss1 <= 1e-5,
                "{pos} dp={dp} sp={sp}: loss {loss} vs {loss1}"
            );
            for (i, (a, b)) in g.iter().zip(&g1).enumerate() {
                assert_eq!(a.len(), b.len());
                let e = rel(a, b);
                assert!(
                    e <= 1e-4,
                    "{pos} dp={dp} sp={sp}: gradient {i} differs by {e}"
                );
            }
        }
    }
}

/// Full activation checkpointing (forward without a graph, then one recomputed layer at a time)
/// gives the whole-graph backward's loss and gradients, on one rank and under SP/DP.
#[test]
fn checkpointing_matches_the_whole_graph() {
    for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
        let (loss1, g1) = step(pos, 1, 1, false);
        for (dp, sp) in [(1, 1), (1, 2), (2, 2)] {
            let (loss, g) = step(pos, dp, sp, true);
            assert!(
                (loss - loss1).abs() / loss1 <= 1e-5,
                "{pos} dp={dp} sp={sp} checkpointed: loss {loss} vs {loss1}"
            );
            for (i, (a, b)) in g.iter().zip(&g1).enumerate() {
                assert_eq!(a.len(), b.len());
                let e = rel(a, b);
                assert!(
                    e <= 1e-4,
                    "{pos} dp={dp} sp={sp} checkpointed: gradient {i} differs by {e}"
                );
            }
        }
    }
}

#[test]
fn layouts_rejected_before_any_work() {
    let mut cfg = config(Position::Rotary);
    cfg.train.steps = 1;
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    let dir = tempfile::tempdir().unwrap();
    // (Head counts SP does not divide are no longer refused: Ulysses pads the heads, see
    // tests/parallel_ring.rs.) A zero degree is.
    let e = train_threads(&cfg, &data, dir.path(), &RunOptions::default(), 1, 0).unwrap_err();
    assert!(e.to_string().contains("degrees must be positive"), "{e}");
    // (A sequence length SP does not divide is no longer refused: it is padded, see
    // tests/parallel_ring.rs.) A global batch DP does not divide still is.
    cfg.train.batch_size = 3;
    let e = train_threads(&cfg, &data, dir.path(), &RunOptions::default(), 2, 1).unwrap_err();
    assert!(e.to_string().contains("--batch-size 3"), "{e}");
    // A learned table that SP would leave a rank no rows of (6 rows, 6 tokens padded to 8 on
    // 4 ranks: rank 3 starts at row 6).
    let mut short = config(Position::Learned);
    (short.model.max_position_embeddings, short.train.seq_len) = (6, 6);
    let e = train_threads(&short, &data, dir.path(), &RunOptions::default(), 1, 4).unwrap_err();
    assert!(e.to_string().contains("leaves SP rank 3 none"), "{e}");
    assert!(!dir.path().join("metrics.jsonl").exists());
}

#[test]
fn several_steps_keep_matching() {
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
        let mut cfg = config(pos);
        cfg.train.steps = 4;
        cfg.train.val_every = 2;
        cfg.train.lr = 3e-3;
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one");
        train(&cfg, &data, &one, &RunOptions::default()).unwrap();
        let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
        // DP layouts run ZeRO-1 (the default); (2, 1, 0) keeps the optimizer replicated. Two
        // runs use full activation checkpointing.
        for (dp, sp, zero, ckpt) in [
            (1, 1, 1, true),
            (1, 2, 1, false),
            (2, 1, 1, false),
            (2, 2, 1, true),
            (2, 1, 0, false),
        ] {
            let mut cfg = cfg.clone();
            cfg.train.zero = zero;
            cfg.train.checkpoint_activations = ckpt;
            let out = dir.path().join(format!("dp{dp}sp{sp}z{zero}c{ckpt}"));
            train_threads(&cfg, &data, &out, &RunOptions::default(), dp, sp).unwrap();
            let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
            assert_eq!(m.len(), reference.len());
            same_losses(&m, &reference, &format!("{pos} {dp}x{sp} ckpt {ckpt}"));
            for (a, b) in m.iter().zip(&reference) {
                let (va, vb) = (a.val_loss.unwrap_or(0.0), b.val_loss.unwrap_or(0.0));
                assert!((va - vb).abs() <= 1e-5 * vb.abs().max(1.0));
            }
            // Time in communication: counted on several ranks (some, less than the step: the
            // step's elapsed time bounds it), absent on one.
            for x in &m {
                match (dp * sp, x.comm_wait_s) {
                    (1, w) => assert_eq!(w, None),
                    (_, Some(w)) => {
                        let step_s = x.tokens as f64 / x.tokens_per_s;
                        assert!(
                            w > 0.0 && w < step_s,
                            "{dp}x{sp}: {w} s of a {step_s} s step"
                        );
                    }
                    (_, None) => panic!("{dp}x{sp}: no comm_wait_s"),
                }
            }
            assert_eq!(reference[0].comm_wait_s, None);
            // Ulysses traffic: 4 exchanges of [b/D, H, s/P, d] per layer = 4·(b/D)·s·h/P.
            if sp > 1 {
                let expect = 4 * (4 / dp) * SEQ * 64 / sp;
                assert_eq!(m[0].sp_sent_per_layer, Some(expect as u64));
            }
            // The checkpoint holds the same weights and Adam moments whatever the layout.
            same_checkpoint(&out, &one, 4, &format!("{pos} {dp}x{sp} zero {zero}"));
        }
    }
}

/// Run `m` logged the reference run's losses, step for step (≤ 1e-5 relative).
fn same_losses(m: &[StepMetrics], reference: &[StepMetrics], what: &str) {
    assert_eq!(m.len(), reference.len(), "{what}: steps logged");
    for (a, b) in m.iter().zip(reference) {
        assert!(
            (a.loss - b.loss).abs() / b.loss <= 1e-5,
            "{what} step {}: {} vs {}",
            a.step,
            a.loss,
            b.loss
        );
    }
}

/// Every tensor of step `step`'s weights and optimizer state in run `a` equals run `b`'s:
/// names and shapes exactly; weights within 1e-4 absolute (under AdamW at lr 3e-3 a weight
/// moves up to ~3e-3 a step whatever its gradient, so sub-ulp gradient differences between
/// layouts can move a weight by a fraction of a step: 1e-4 is 3% of one); moments within 1e-3
/// of the tensor's largest magnitude.
fn same_checkpoint(a: &Path, b: &Path, step: u64, what: &str) {
    for (file, moments) in [("model.safetensors", false), ("optimizer", true)] {
        // The optimizer state is sharded by rank: compare it assembled, by name.
        let read = |d: &Path| {
            let dir = d.join(format!("checkpoints/step-{step}"));
            if moments {
                moment_tensors(&dir).unwrap()
            } else {
                read_safetensors(&dir.join(file)).unwrap().0
            }
        };
        let (ta, tb) = (read(a), read(b));
        let mut names: Vec<&String> = tb.keys().collect();
        names.sort();
        assert_eq!(ta.len(), tb.len(), "{what}: {file} tensor count");
        for name in names {
            let (x, y) = (&ta[name], &tb[name]);
            assert_eq!(x.shape, y.shape, "{what}: {file} {name}");
            let (e, tol) = if moments {
                (rel(&x.data, &y.data), 1e-3)
            } else {
                let d = x
                    .data
                    .iter()
                    .zip(&y.data)
                    .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
                (d, 1e-4)
            };
            assert!(e <= tol, "{what}: {file} {name} differs by {e}");
        }
    }
}

/// Learned positions under SP with a sequence shorter than the table (dc757c5 split the
/// table by M/P rows while rank r read positions from r·s/P, and failed at step 1): the same
/// losses and the same checkpoint, table rows past the sequence included, as one rank.
#[test]
fn learned_positions_shorter_than_the_table_match_one_rank() {
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    let mut cfg = config(Position::Learned);
    cfg.model.max_position_embeddings = 4 * SEQ;
    cfg.train.steps = 3;
    cfg.train.val_every = 0;
    cfg.train.lr = 3e-3;
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(&cfg, &data, &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for (dp, sp) in [(1, 2), (2, 2), (1, 4)] {
        let out = dir.path().join(format!("dp{dp}sp{sp}"));
        train_threads(&cfg, &data, &out, &RunOptions::default(), dp, sp).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        assert_eq!(m.len(), reference.len());
        same_losses(&m, &reference, &format!("{dp}x{sp}"));
        same_checkpoint(&out, &one, 3, &format!("learned, table 4·s, {dp}x{sp}"));
    }
    // So short a sequence that an SP rank holds only padding (5 tokens on 4 ranks: rank 3's
    // two slots are past the end). Its table gradient is zero, not missing: "no gradient for
    // gpt_neox.embed_pos.weight" stopped such layouts at step 1.
    let mut short = cfg.clone();
    short.train.seq_len = 5;
    let one = dir.path().join("short-one");
    train(&short, &data, &one, &RunOptions::default()).unwrap();
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    let out = dir.path().join("short-sp4");
    train_threads(&short, &data, &out, &RunOptions::default(), 1, 4).unwrap();
    same_losses(
        &read_metrics(&out.join("metrics.jsonl")).unwrap(),
        &reference,
        "5 on sp 4",
    );
    same_checkpoint(&out, &one, 3, "learned, 5 tokens on sp 4");
    // A sequence longer than the table is refused before any work.
    let mut long = cfg.clone();
    long.train.seq_len = 8 * SEQ;
    let out = dir.path().join("long");
    let e = train_threads(&long, &data, &out, &RunOptions::default(), 1, 2).unwrap_err();
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
    assert!(!out.join("metrics.jsonl").exists());
}

/// ZeRO-1 with a parameter count that does not divide by the DP degree (tiny: 3 ranks) gives
/// the one-rank run, under the thread group's MPI-equal-count contract, with buckets smaller
/// than a parameter so the bucketed paths are exercised.
#[test]
fn zero_with_uneven_shards_and_tiny_buckets_matches_one_rank() {
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    let mut cfg = config(Position::Rotary);
    cfg.train.steps = 3;
    cfg.train.val_every = 0;
    cfg.train.lr = 3e-3;
    cfg.train.batch_size = 6;
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one");
    train(&cfg, &data, &one, &RunOptions::default()).unwrap();
    let n = GenSlm::init(cfg.model.clone(), 0, &Device::flex())
        .unwrap()
        .layout
        .num_params();
    assert_ne!(
        n % 3,
        0,
        "the test needs a parameter count that 3 does not divide"
    );
    let reference = read_metrics(&one.join("metrics.jsonl")).unwrap();
    for (bucket, zero) in [(1000usize, 1u8), (1000, 0)] {
        let mut c = cfg.clone();
        c.train.reduce_bucket_size = bucket;
        c.train.zero = zero;
        let out = dir.path().join(format!("dp3b{bucket}z{zero}"));
        train_threads(&c, &data, &out, &RunOptions::default(), 3, 1).unwrap();
        let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
        same_losses(&m, &reference, &format!("dp 3 zero {zero}"));
        for (a, b) in m.iter().zip(&reference) {
            // The global gradient norm (summed in f64 from the shards) is the one-rank norm.
            assert!(
                (a.grad_norm - b.grad_norm).abs() / b.grad_norm <= 1e-5,
                "dp 3 zero {zero} step {}: norm {} vs {}",
                a.step,
                a.grad_norm,
                b.grad_norm
            );
        }
        same_checkpoint(
            &out,
            &one,
            3,
            &format!("dp 3, zero {zero}, bucket {bucket}"),
        );
    }
}

#[test]
fn resume_under_a_different_layout() {
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    for pos in [Position::Learned, Position::Rotary] {
        let mut cfg = config(pos);
        cfg.train.steps = 4;
        cfg.train.val_every = 0;
        cfg.train.lr = 3e-3;
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one");
        train(&cfg, &data, &one, &RunOptions::default()).unwrap();
        // Two steps with SP = 2, then two more with DP = 2 (ZeRO-1), then compare.
        let mixed = dir.path().join("mixed");
        let first = RunOptions {
            stop_after: Some(2),
            ..Default::default()
        };
        train_threads(&cfg, &data, &mixed, &first, 1, 2).unwrap();
        let resume = RunOptions {
            resume: true,
            ..Default::default()
        };
        train_threads(&cfg, &data, &mixed, &resume, 2, 1).unwrap();
        let (a, b) = (
            read_metrics(&mixed.join("metrics.jsonl")).unwrap(),
            read_metrics(&one.join("metrics.jsonl")).unwrap(),
        );
        assert_eq!(a.len(), 4);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x.loss - y.loss).abs() / y.loss <= 1e-5,
                "{pos} step {}: {} vs {}",
                x.step,
                x.loss,
                y.loss
            );
        }
    }
}

/// Every rank writes only the Adam moments it holds (nothing is gathered), and the shards of
/// every layout assemble into the full moments exactly once: moments whose value names their
/// parameter and element (a closed form) come back in place, for replicated state, ZeRO-1
/// over DP, the SP-split learned table, TP column and row slices, and ZeRO-3 units; a missing
/// rank's file is refused, naming the parameter.
#[test]
fn optimizer_shards_of_every_layout_assemble_the_full_moments() {
    let cfg = config(Position::Learned);
    let layout = genslm::model::params::Layout::new(&cfg.model);
    let value = |i: usize, e: usize, which: f32| which + i as f32 * 4096.0 + e as f32;
    for (d, zero) in [
        (Degrees::new(2, 1, 2), 0u8),
        (Degrees::new(2, 1, 2), 1),
        (Degrees::new(1, 2, 2), 1),
        (Degrees::new(2, 1, 2), 3),
        (
            Degrees {
                dp: 2,
                cp: 1,
                sp: 1,
                tp: 2,
                pp: 1,
            },
            1,
        ),
        (
            Degrees {
                dp: 1,
                cp: 1,
                sp: 2,
                tp: 2,
                pp: 1,
            },
            0,
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let run = {
            let (cfg, out) = (cfg.clone(), dir.path().to_path_buf());
            move |ranks: Ranks| {
                let ad = Device::flex().autodiff();
                let model = GenSlm::init(cfg.model.clone(), 5, &ad).unwrap();
                let dev = Device::flex();
                let full = |which: f32| -> Vec<Tensor<1>> {
                    (model.layout.specs.iter().enumerate())
                        .map(|(i, s)| {
                            let v = (0..s.numel()).map(|e| value(i, e, which)).collect();
                            host_to_param(v, &dev)
                        })
                        .collect()
                };
                let (mut m, mut v) = (full(0.0), full(0.5));
                let model = parallelize(model, Some((&mut m, &mut v)), &ranks, SEQ).unwrap();
                let mut moments = AdamW::new(AdamWConfig::default(), &model.params);
                (moments.m, moments.v) = (m, v);
                let engine = Engine::new(model, moments, zero, &ranks);
                let runs = engine.moment_runs(&ranks.topo);
                write_shard(
                    &out,
                    engine.model(),
                    &runs,
                    ranks.topo.rank,
                    ranks.topo.world,
                )
                .unwrap()
            }
        };
        let run = Arc::new(run);
        let hs: Vec<_> = thread_grid(d, Duration::from_secs(60))
            .into_iter()
            .map(|r| {
                let run = run.clone();
                std::thread::spawn(move || run(r))
            })
            .collect();
        let written: Vec<Option<String>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let what = format!("{d:?} zero {zero}");
        // Every parameter's moments, assembled from whichever shards hold its pieces.
        let assemble = |dir: &Path| -> genslm::error::Result<Vec<(Vec<f32>, Vec<f32>)>> {
            let shards = MomentShards::open(dir, &layout)?;
            (layout.specs.iter())
                .map(|s| shards.moments(&s.name, &s.shape))
                .collect()
        };
        let moments = assemble(dir.path()).expect(&what);
        for (i, (mi, vi)) in moments.iter().enumerate() {
            for (e, (&a, &b)) in mi.iter().zip(vi).enumerate() {
                assert_eq!(
                    a,
                    value(i, e, 0.0),
                    "{what}: m of parameter {i} element {e}"
                );
                assert_eq!(
                    b,
                    value(i, e, 0.5),
                    "{what}: v of parameter {i} element {e}"
                );
            }
        }
        // Under ZeRO-3 every rank holds a share; without it some ranks hold only replicas.
        let writers = written.iter().flatten().count();
        assert!(
            writers >= 1 && (zero < 3 || writers == written.len()),
            "{what}: {written:?}"
        );
        let last = written.iter().flatten().last().unwrap();
        std::fs::remove_file(dir.path().join(last)).unwrap();
        if writers > 1 {
            let err = assemble(dir.path()).unwrap_err().to_string();
            assert!(err.contains("a rank's file is missing"), "{what}: {err}");
        }
    }
}
