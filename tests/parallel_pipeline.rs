//! Pipeline stages on threads give the single-rank loss and gradients: every schedule (GPipe,
//! 1F1B, interleaved, ZB-H1), 2 and 4 stages, uneven chunks, with and without activation
//! checkpointing, rotary, learned and ALiBi positions. Each stage holds only its own units'
//! parameters (the others are empty), so a stage that read another's weights would fail.

use std::path::Path;
use std::time::Duration;

use burn::tensor::{Device, Tensor};
use genslm::config::{Config, Position, Precision};
use genslm::data::loader::{Batch, Corpus, Loader};
use genslm::model::GenSlm;
use genslm::ops::primitive::{host_to_param, tensor_to_vec};
use genslm::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use genslm::parallel::pipeline::stages::Stages;
use genslm::parallel::ranks::Ranks;
use genslm::parallel::threads::thread_group;
use genslm::rng::SplitMix64;
use genslm::train::layerwise::Keep;
use genslm::train::pipeline::{stage_loss_and_grads, stage_units, Pipeline};
use genslm::train::shard::local_batch;
use genslm::train::step::loss_and_grads;

const SEQ: usize = 24;

thread_local! {
    /// The compute precision of the models this thread builds (bf16 in one test).
    static PRECISION: std::cell::Cell<Precision> = const { std::cell::Cell::new(Precision::Fp32) };
}
/// Divides evenly by none of the chunk counts tested (2, 4, 8).
const LAYERS: usize = 9;

fn config(pos: Position) -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    let mut cfg = Config::load(&path).unwrap();
    cfg.model.position = pos;
    cfg.model.num_layers = LAYERS;
    cfg.model.hidden_size = 32;
    cfg.model.intermediate_size = 64;
    cfg.model.max_position_embeddings = SEQ;
    cfg
}

/// `m` micro-batches of 2 rows; one record is short, so some rows are padded.
fn batches(m: usize) -> Vec<Batch> {
    let mut g = SplitMix64::new(3);
    let recs: Vec<Vec<u32>> = (0..2 * m + 1)
        .map(|i| {
            (0..if i == 1 { 15 } else { SEQ })
                .map(|_| 5 + g.below(64) as u32)
                .collect()
        })
        .collect();
    let corpus = Corpus::new(recs, SEQ, 3, 0.0, 1).unwrap();
    let mut loader = Loader::new(7, 0);
    (0..m).map(|_| loader.next_batch(&corpus, 2)).collect()
}

fn model(pos: Position) -> GenSlm {
    let ad = Device::flex().autodiff();
    let mut m = GenSlm::init(config(pos).model, 17, &ad)
        .unwrap()
        .with_precision(PRECISION.with(|p| p.get()));
    m.params = m.params.into_iter().map(|p| p.require_grad()).collect();
    m
}

fn denom(b: &[Batch]) -> usize {
    b.iter().map(Batch::n_targets).sum()
}

/// One rank's loss and gradients (the whole graph per micro-batch).
fn reference(pos: Position, m: usize) -> (f64, Vec<Vec<f32>>) {
    let b = batches(m);
    let (loss, g) =
        loss_and_grads(&model(pos), &b, denom(&b), &Ranks::single(), Keep::Graphs).unwrap();
    (loss, g.iter().map(tensor_to_vec).collect())
}

/// Per stage: the loss it reports and its gradients (`None` where it has none).
type StageOut = (f64, Vec<Option<Vec<f32>>>);

fn pipeline(
    pos: Position,
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    checkpoint: bool,
) -> Vec<StageOut> {
    let sched = Schedule::build(kind, p, m, v).unwrap();
    let stages = Stages::balanced(LAYERS, p, v).unwrap();
    let precision = PRECISION.with(|p| p.get());
    let hs: Vec<_> = thread_group(p, Duration::from_secs(60))
        .into_iter()
        .enumerate()
        .map(|(stage, comm)| {
            let (sched, stages) = (sched.clone(), stages.clone());
            std::thread::spawn(move || {
                PRECISION.with(|p| p.set(precision));
                let mut model = model(pos);
                // Only this stage's parameters are present.
                let mine: Vec<usize> = stage_units(&stages, &model.layout, stage)
                    .into_iter()
                    .flat_map(|u| u.params(&model.layout))
                    .collect();
                let ad = model.device.clone();
                for (i, p) in model.params.iter_mut().enumerate() {
                    if !mine.contains(&i) {
                        *p = host_to_param(Vec::new(), &ad).require_grad();
                    }
                }
                let b = batches(m);
                let micro: Vec<_> = b.iter().map(|x| local_batch(x, &Ranks::single())).collect();
                let pipe = Pipeline {
                    schedule: &sched,
                    stages: &stages,
                    comm: &comm,
                    checkpoint,
                };
                let mut acc: Vec<Option<Tensor<1>>> = vec![None; model.params.len()];
                let step = stage_loss_and_grads(&pipe, &model, &micro, denom(&b) as f64, &mut acc)
                    .unwrap();
                assert!(step.busy_s > 0.0 && step.idle_s >= 0.0);
                let loss = step.loss;
                let grads = acc.iter().map(|g| g.as_ref().map(tensor_to_vec)).collect();
                (loss, grads)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Every stage reports the reference loss, and every parameter's gradient lives on exactly
/// one stage and equals the reference.
fn check(out: &[StageOut], reference: &(f64, Vec<Vec<f32>>), what: &str) {
    let (loss, grads) = reference;
    for (s, (l, _)) in out.iter().enumerate() {
        assert!(
            (l - loss).abs() <= 1e-5 * loss.abs(),
            "{what}: stage {s} loss {l} vs one rank {loss}"
        );
    }
    for (i, g) in grads.iter().enumerate() {
        let holders: Vec<usize> = (0..out.len()).filter(|&s| out[s].1[i].is_some()).collect();
        assert_eq!(
            holders.len(),
            1,
            "{what}: parameter {i} on stages {holders:?}"
        );
        let got = out[holders[0]].1[i].as_ref().unwrap();
        assert_eq!(got.len(), g.len(), "{what}: parameter {i}");
        let r = rel(got, g);
        assert!(r < 1e-5, "{what}: parameter {i} off by {r:e} (relative)");
    }
}

#[test]
fn every_schedule_matches_one_rank() {
    for p in [2, 4] {
        for m in [p, 2 * p] {
            let want = reference(Position::Rotary, m);
            for kind in ScheduleKind::ALL {
                let v = if kind == ScheduleKind::Interleaved {
                    2
                } else {
                    1
                };
                let out = pipeline(Position::Rotary, kind, p, m, v, false);
                check(&out, &want, &format!("{kind} P {p} m {m} V {v}"));
            }
        }
    }
}

#[test]
fn checkpointed_stages_match_one_rank() {
    let want = reference(Position::Rotary, 4);
    for kind in ScheduleKind::ALL {
        let v = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        let out = pipeline(Position::Rotary, kind, 2, 4, v, true);
        check(&out, &want, &format!("{kind} checkpointed"));
    }
}

#[test]
fn every_position_kind_matches_one_rank() {
    for pos in [Position::Learned, Position::Alibi] {
        let want = reference(pos, 4);
        for ckpt in [false, true] {
            let out = pipeline(pos, ScheduleKind::OneFOneB, 4, 4, 1, ckpt);
            check(&out, &want, &format!("{pos:?} 1f1b checkpoint {ckpt}"));
        }
        let out = pipeline(pos, ScheduleKind::Interleaved, 2, 4, 2, false);
        check(&out, &want, &format!("{pos:?} interleaved"));
    }
}

/// GPipe with fewer micro-batches than stages (the only schedule that allows it), and one
/// stage holding every chunk.
#[test]
fn degenerate_pipelines_match_one_rank() {
    let want = reference(Position::Rotary, 1);
    check(
        &pipeline(Position::Rotary, ScheduleKind::GPipe, 2, 1, 1, false),
        &want,
        "gpipe, one micro-batch",
    );
    let want = reference(Position::Rotary, 3);
    check(
        &pipeline(Position::Rotary, ScheduleKind::OneFOneB, 1, 3, 1, false),
        &want,
        "one stage",
    );
}

/// bf16 compute: activations cross the stages as fp32 copies of bf16 values (exact both
/// ways), so the stages compute what one bf16 rank computes.
#[test]
fn bf16_stages_match_one_bf16_rank() {
    PRECISION.with(|p| p.set(Precision::Bf16));
    let want = reference(Position::Rotary, 4);
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubble,
    ] {
        let v = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        check(
            &pipeline(Position::Rotary, kind, 2, 4, v, false),
            &want,
            &format!("bf16 {kind}"),
        );
    }
}
