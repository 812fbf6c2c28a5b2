//! Pipeline stages in the plan (issue 40): what each stage holds and keeps, from the same
//! schedule and layer cut the trainer runs (`parallel::pipeline`).
//!
//! Stage `s` holds the weights, gradients and optimizer states of its layers (plus the input
//! embedding and a learned position table on the first stage, the final LayerNorm and the head
//! on the last), and at its peak the activations of the micro-batch chunks in flight there:
//! the schedule's simulation counts them (1F1B: `P − s` on stage `s`; GPipe: all `m`), each
//! chunk's layers' worth of one micro-batch. Only the last stage computes logits and the loss.
//! Every stage also receives an activation and a gradient per pass (fp32 host copies in genslm).

use serde::Serialize;

use super::Parallelism;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::parallel::pipeline::cut_and_schedule;
use crate::parallel::pipeline::schedule::{simulate, Pass, Schedule, ScheduleKind};
use crate::parallel::pipeline::stages::Stages;

/// How the pipeline runs (when `pp` > 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PipePlan {
    pub schedule: ScheduleKind,
    /// Chunks of layers per stage (interleaved).
    pub virtual_stages: usize,
    /// Micro-batches per optimizer step (`--grad-accum`).
    pub micro_batches: usize,
}

impl Default for PipePlan {
    fn default() -> Self {
        Self {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            micro_batches: 1,
        }
    }
}

/// The share of the model one rank holds and keeps activations for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StageView {
    pub stage: usize,
    /// Layers whose weights the rank holds.
    pub layers: usize,
    /// Layers' activations of one micro-batch the rank keeps at its peak (micro-batch chunks
    /// in flight × layers per chunk).
    pub kept_layers: usize,
    /// Holds the input embedding (and a learned position table).
    pub embeddings: bool,
    /// Holds the final LayerNorm and the output head, and computes the loss.
    pub head: bool,
}

impl StageView {
    /// No pipeline: the whole model, one micro-batch's activations of every layer.
    pub fn whole(m: &ModelConfig) -> Self {
        Self {
            stage: 0,
            layers: m.num_layers,
            kept_layers: m.num_layers,
            embeddings: true,
            head: true,
        }
    }
}

/// Relative costs of the passes in the simulations: the backward is about twice the forward
/// (split evenly into B and W when the schedule splits it).
fn cost(kind: ScheduleKind) -> impl Fn(Pass) -> u64 {
    move |p| match p {
        Pass::F => 1,
        Pass::B if kind.splits_backward() => 1,
        Pass::B => 2,
        Pass::W => 1,
    }
}

/// The schedule and the cut of the layers: `cut` (layers per chunk, `--pp-layers`) or the
/// balanced one.
fn schedule(m: &ModelConfig, l: &Parallelism, cut: Option<&[usize]>) -> Result<(Schedule, Stages)> {
    let p = &l.pipeline;
    cut_and_schedule(
        m.num_layers,
        cut,
        p.schedule,
        l.pp,
        p.micro_batches,
        p.virtual_stages,
    )
}

/// Every stage's view of layout `l` with the layers cut by `cut` (`--pp-layers`; `None`:
/// balanced), one whole view without a pipeline, or why the pipeline cannot run (too few
/// micro-batches, more chunks than layers, a cut that does not fit the model).
pub fn stage_views(
    m: &ModelConfig,
    l: &Parallelism,
    cut: Option<&[usize]>,
) -> Result<Vec<StageView>> {
    if l.pp <= 1 {
        return Ok(vec![StageView::whole(m)]);
    }
    let p = &l.pipeline;
    let key: ViewKey = (
        m.num_layers,
        cut.map(<[usize]>::to_vec),
        p.schedule,
        l.pp,
        p.micro_batches,
        p.virtual_stages,
    );
    if let Some(hit) = VIEWS.with(|v| {
        v.borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, views)| views.clone())
    }) {
        return Ok(hit);
    }
    let views = simulate_views(m, l, cut)?;
    VIEWS.with(|v| {
        let mut v = v.borrow_mut();
        if v.len() >= 64 {
            v.clear();
        }
        v.push((key, views.clone()));
    });
    Ok(views)
}

/// What a stage's view depends on: the layers, the cut, and the pipeline's shape.
type ViewKey = (usize, Option<Vec<usize>>, ScheduleKind, usize, usize, usize);

thread_local! {
    /// The views of the pipelines simulated so far: the plan's search asks for the same
    /// pipeline under every candidate layout and sequence length, and simulating 2²¹
    /// micro-batches anew each time took minutes and a gigabyte (`plan --gpus 4096 --pp 2
    /// --grad-accum 2097151`).
    static VIEWS: std::cell::RefCell<Vec<(ViewKey, Vec<StageView>)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn simulate_views(
    m: &ModelConfig,
    l: &Parallelism,
    cut: Option<&[usize]>,
) -> Result<Vec<StageView>> {
    let (sched, stages) = schedule(m, l, cut)?;
    let timeline = simulate(&sched, cost(sched.kind))?;
    Ok((0..l.pp)
        .map(|s| {
            let per_chunk = stages
                .chunks_of(s)
                .into_iter()
                .map(|c| stages.layers(c).len());
            StageView {
                stage: s,
                layers: stages.stage_layers(s),
                kept_layers: timeline.peak_in_flight[s] * per_chunk.max().unwrap_or(0),
                embeddings: s == 0,
                head: s + 1 == l.pp,
            }
        })
        .collect())
}

/// The schedule's bubble, idle over busy summed over the stages, with the backward twice the
/// forward (`None` without a pipeline); what the trainer's `pp_bubble` measures.
pub fn bubble(m: &ModelConfig, l: &Parallelism) -> Option<f64> {
    if l.pp <= 1 {
        return None;
    }
    let (sched, _) = schedule(m, l, None).ok()?;
    let t = simulate(&sched, cost(sched.kind)).ok()?;
    let busy: u64 = t.busy.iter().sum();
    let idle: u64 = (0..l.pp).map(|s| t.idle(s)).sum();
    Some(idle as f64 / busy.max(1) as f64)
}
