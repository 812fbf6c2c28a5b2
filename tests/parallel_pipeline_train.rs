//! Training with pipeline stages (threads) follows the one-rank loss curve for 8 steps and
//! ends on the same checkpoint (weights gathered from the stages, moments assembled from the
//! stages' shards): every schedule, 2 and 4 stages over 5 layers (uneven), composed with TP,
//! SP, CP and DP × ZeRO-1, with activation checkpointing, rotary, learned and ALiBi positions.

mod curves;

use genslm::config::{Config, Position};
use genslm::model::GenSlm;
use genslm::parallel::pipeline::schedule::ScheduleKind;
use genslm::parallel::Degrees;
use genslm::train::metrics::read_metrics;
use genslm::train::pipeline::Pipe;
use genslm::train::trainer::{train_grid, RunOptions};

use curves::{data, layouts_match_one_rank, resumes_match_one_rank, tiny};

fn config(pos: Position, kind: ScheduleKind, v: usize) -> Config {
    let mut c = tiny(pos, 32);
    c.model.num_layers = 5;
    c.train.grad_accum = 4;
    c.train.pp_schedule = kind;
    c.train.pp_virtual = v;
    c
}

fn pp(pp: usize, dp: usize, cp: usize, sp: usize, tp: usize) -> Degrees {
    Degrees { dp, cp, sp, tp, pp }
}

#[test]
fn one_f_one_b_composes_with_every_layout() {
    let cfg = config(Position::Rotary, ScheduleKind::OneFOneB, 1);
    layouts_match_one_rank(
        &cfg,
        &[
            (pp(2, 1, 1, 1, 1), 0, false),
            (pp(4, 1, 1, 1, 1), 1, false),
            (pp(2, 1, 1, 1, 1), 1, true),
            (pp(2, 1, 1, 1, 2), 1, false),
            (pp(2, 1, 1, 2, 1), 1, false),
            (pp(2, 1, 2, 1, 1), 1, false),
            (pp(2, 2, 1, 1, 1), 1, false),
        ],
    );
}

#[test]
fn every_schedule_trains_like_one_rank() {
    for (kind, v, stages) in [
        (ScheduleKind::GPipe, 1, 4),
        (ScheduleKind::ZeroBubble, 1, 4),
        (ScheduleKind::Interleaved, 2, 2),
    ] {
        let cfg = config(Position::Rotary, kind, v);
        layouts_match_one_rank(
            &cfg,
            &[
                (pp(stages, 1, 1, 1, 1), 1, false),
                (pp(stages, 1, 1, 1, 1), 1, true),
            ],
        );
    }
    // ZB's deferred weight products under TP (row-parallel slices, which have no bias) and SP.
    let cfg = config(Position::Rotary, ScheduleKind::ZeroBubble, 1);
    layouts_match_one_rank(
        &cfg,
        &[(pp(2, 1, 1, 1, 2), 1, false), (pp(2, 1, 1, 2, 1), 1, false)],
    );
    // Interleaved over 4 stages: 8 chunks of 9 layers (the last one 2).
    let mut cfg = config(Position::Alibi, ScheduleKind::Interleaved, 2);
    cfg.model.num_layers = 9;
    layouts_match_one_rank(&cfg, &[(pp(4, 1, 1, 1, 1), 1, false)]);
}

#[test]
fn learned_and_alibi_positions_through_the_pipeline() {
    for pos in [Position::Learned, Position::Alibi] {
        let cfg = config(pos, ScheduleKind::OneFOneB, 1);
        layouts_match_one_rank(
            &cfg,
            &[(pp(2, 1, 1, 1, 1), 1, false), (pp(2, 1, 1, 2, 1), 1, true)],
        );
    }
}

#[test]
fn impossible_pipelines_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let run = |cfg: &Config, d: Degrees| {
        let out = dir.path().join("refused");
        let e = train_grid(cfg, &data(), &out, &RunOptions::default(), d).unwrap_err();
        assert!(!out.exists(), "a refused run wrote {}", out.display());
        e.to_string()
    };
    let cfg = config(Position::Rotary, ScheduleKind::OneFOneB, 1);
    let mut few = cfg.clone();
    few.train.grad_accum = 1;
    let e = run(&few, pp(2, 1, 1, 1, 1));
    // It says what would work: plan's 4·P micro-batches, or GPipe.
    assert!(
        e.contains("needs at least 2 micro-batches") && e.contains("--grad-accum 8"),
        "{e}"
    );
    let gpipe = config(Position::Rotary, ScheduleKind::GPipe, 1);
    assert!(run(&gpipe, pp(8, 1, 1, 1, 1)).contains("every chunk needs at least one"));
    // More stages than layers is named first: no --grad-accum or schedule would make it work
    // (it asked for more micro-batches, then for GPipe, which then refused the layers).
    let e = run(&few, pp(8, 1, 1, 1, 1));
    assert!(e.contains("every chunk needs at least one"), "{e}");
    let mut zero3 = cfg.clone();
    zero3.train.zero = 3;
    assert!(run(&zero3, pp(2, 1, 1, 1, 1)).contains("--zero 3"));
    let mut counts = cfg.clone();
    counts.train.pp_layers = Some(vec![1, 1]);
    assert!(run(&counts, pp(2, 1, 1, 1, 1)).contains("add up to the model's 5 layers"));
    let mut virt = cfg.clone();
    virt.train.pp_virtual = 2;
    assert!(run(&virt, pp(2, 1, 1, 1, 1)).contains("needs --pp-schedule interleaved"));
}

/// Stage 0 holds the embeddings and its layers only (the metrics' parameter bytes are rank 0's):
/// the curves above would match too if every stage trained the whole model.
#[test]
fn a_stage_holds_only_its_own_layers() {
    let cfg = config(Position::Rotary, ScheduleKind::OneFOneB, 1);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pp2");
    train_grid(
        &cfg,
        &data(),
        &out,
        &RunOptions::default(),
        pp(2, 1, 1, 1, 1),
    )
    .unwrap();
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let held = m[0].memory.as_ref().unwrap().params_bytes;
    let model = GenSlm::init(cfg.model.clone(), 0, &burn::tensor::Device::flex()).unwrap();
    let pipe = Pipe::plan(&cfg, 2).unwrap().unwrap();
    let numel = |i: usize| model.layout.specs[i].shape.iter().product::<usize>() as u64;
    let stage0: u64 = pipe
        .params_of(&model.layout, 0)
        .into_iter()
        .map(numel)
        .sum();
    let all: u64 = (0..model.params.len()).map(numel).sum();
    assert_eq!(held, 4 * stage0);
    let busy = m[0].pp_busy_s.as_ref().unwrap();
    assert_eq!(busy.len(), 2);
    assert!(m[0].pp_bubble.unwrap() >= 0.0);
    assert!(stage0 < all / 2, "stage 0 holds {stage0} of {all}");
}

/// A run saved under PP 4 resumes on one rank, and a one-rank run resumes under PP 2 × TP 2,
/// both with the uninterrupted one-rank losses and checkpoint (checkpoints are layout-free).
#[test]
fn pipeline_checkpoints_resume_on_other_layouts() {
    let cfg = config(Position::Learned, ScheduleKind::OneFOneB, 1);
    let single = Degrees::new(1, 1, 1);
    resumes_match_one_rank(
        &cfg,
        &[
            ("pp4-to-1", pp(4, 1, 1, 1, 1), single),
            ("1-to-pp2tp2", single, pp(2, 1, 1, 1, 2)),
        ],
    );
}
