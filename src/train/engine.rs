//! What a rank trains with: a whole replica (ZeRO 0/1: the gradients of the whole model, then
//! one optimizer step) or ZeRO-2/3 units (gradients reduce-scattered layer by layer during the
//! backward). The trainer's loop talks to this one type whatever the stage.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};

use crate::backend::host_device;
use crate::config::{ModelConfig, Precision};
use crate::data::loader::Batch;
use crate::error::{Error, Result};
use crate::model::attention::SequenceParallel;
use crate::model::GenSlm;
use crate::ops::primitive::{host_to_param, tensor_to_vec, tokens_tensor};
use crate::parallel::parallelize::parallelize;
use crate::parallel::ranks::Ranks;
use crate::parallel::tensor_slices::{cut, split_of};
use crate::parallel::topology::Topology;
use crate::train::dist_optim::{DistOptim, StepOutcome};
use crate::train::layerwise::{forward_logits, loss_and_grads as layerwise, Keep};
use crate::train::master::{fp32, layout_on, working};
use crate::train::optim::{AdamW, AdamWConfig};
use crate::train::optim_shards::MomentRun;
use crate::train::param_source::ParamSource;
use crate::train::pipeline::{
    stage_eval_nll, stage_loss_and_grads, Pipe, Pipeline, StageStep, StageTimes,
};
use crate::train::replica_reduce::{reduced_loss_and_grads, reduces_by_unit};
use crate::train::shard::{local_batch, local_nll, LocalBatch};
use crate::train::step::{loss_and_grads, require_micro_batches};
use crate::train::zero_units::{Fetched, ZeroUnits};

/// What a rank's engine starts from.
pub struct Start<'a> {
    /// The model's configuration (a resume: the checkpoint's `config.json`).
    pub model: ModelConfig,
    pub precision: Precision,
    pub source: &'a ParamSource,
    pub adamw: AdamWConfig,
    /// AdamW's bias-correction step count so far.
    pub step: u64,
    /// The autodiff device the model trains on.
    pub device: &'a Device,
    /// Pipeline stages (`None`: one stage).
    pub pipe: Option<Pipe>,
    /// AdamW's state in host memory (`--offload optimizer`).
    pub offload_optimizer: bool,
}

// One per rank, built once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Engine {
    Whole {
        model: GenSlm,
        opt: DistOptim,
        /// The step's gradients, between `compute` and `step`, and whether they are summed over
        /// the ranks already (`train::replica_reduce`) or are this rank's own.
        grads: Option<(Vec<Tensor<1>>, bool)>,
        /// Under PP, the pipeline; the model then holds this stage's parameters only.
        pipe: Option<Box<Pipe>>,
        /// Under PP, every stage's busy and idle time in the last step.
        times: Option<StageTimes>,
    },
    Units(ZeroUnits),
}

impl Engine {
    /// `model` already cut for SP; `moments` its full optimizer state (position rows cut).
    /// ZeRO-2/3 need more than one rank; with one, the whole model is kept (ZeRO-0 in effect).
    /// Under the bf16 layout (`train::master`) the fp32 values become the optimizer's masters
    /// and the model keeps their bf16 rounding.
    pub fn new(model: GenSlm, mut moments: AdamW, zero: u8, ranks: &Ranks) -> Self {
        if zero >= 2 && ranks.topo.world > 1 {
            return Engine::Units(ZeroUnits::new(model, moments, zero, ranks));
        }
        let mut model = model;
        if layout_on(&model) {
            moments.set_master(model.params.clone());
        }
        let opt = DistOptim::new(moments, &model, ranks, zero >= 1);
        let params = std::mem::take(&mut model.params);
        model.params = params
            .into_iter()
            .map(|p| working(&model, p).autodiff().require_grad())
            .collect();
        Engine::Whole {
            model,
            opt,
            grads: None,
            pipe: None,
            times: None,
        }
    }

    /// This rank's engine for a model configured `start.model`, built from `start.source` one
    /// parameter at a time. ZeRO-2/3 over several ranks start from a skeleton joined to its
    /// groups and build their shards unit by unit, so no rank holds more than one unit's full
    /// values (nor, resuming, its full moments); otherwise the whole model is built, then cut
    /// for TP/SP.
    pub fn build(start: Start<'_>, zero: u8, ranks: &Ranks, seq_len: usize) -> Result<Self> {
        let Start {
            model: cfg,
            precision,
            source,
            adamw,
            step,
            device,
            pipe,
            offload_optimizer: offload,
        } = start;
        let plain = device.clone().without_autodiff();
        // Where resumed moments are placed: beside the parameters, or offloaded.
        let state_device = if offload {
            host_device()
        } else {
            plain.clone()
        };
        if zero >= 2 && ranks.topo.world > 1 {
            let skeleton = GenSlm::empty(cfg, device)?.with_precision(precision);
            let skeleton = parallelize(skeleton, None, ranks, seq_len)?;
            // Under TP this rank keeps its slices; under SP its rows of the learned-position
            // table (never a TP-split parameter).
            let pos = skeleton.layout.embed_pos.zip(skeleton.position_shard());
            let (t, full) = (&ranks.topo, source.layout());
            let rows = |i: usize, x: Vec<f32>| match (split_of(full, i).filter(|_| t.tp > 1), pos) {
                (Some(split), _) => {
                    let x = host_to_param(x, &plain);
                    tensor_to_vec(&cut(&x, &full.specs[i].shape, split, t.tp, t.tp_rank()))
                }
                (None, Some((p, first))) if p == i => {
                    let [n, h] = [
                        skeleton.layout.specs[p].shape[0],
                        skeleton.layout.specs[p].shape[1],
                    ];
                    x[first * h..(first + n) * h].to_vec()
                }
                _ => x,
            };
            let mut fetch = |i: usize| -> Result<Fetched> {
                let x = host_to_param(rows(i, source.values(i)?), device);
                let moments = source.moments(i)?.map(|(m, v)| {
                    (
                        host_to_param(rows(i, m), &state_device),
                        host_to_param(rows(i, v), &state_device),
                    )
                });
                Ok((x, moments))
            };
            let units = ZeroUnits::build(
                skeleton.clone(),
                (adamw, step, offload),
                &mut fetch,
                zero,
                ranks,
            )?;
            return Ok(Engine::Units(units));
        }
        // Under PP a stage reads and holds its own parameters only (the others stay empty).
        let held = pipe
            .as_ref()
            .map(|p| p.params_of(source.layout(), ranks.topo.pp_rank()));
        let holds = |i: usize| held.as_ref().is_none_or(|h| h.contains(&i));
        let model = stage_model(cfg, source, device, &holds)?.with_precision(precision);
        let mut moments = AdamW::placed(adamw, &model.params, offload);
        moments.step = step;
        for i in (0..model.params.len()).filter(|&i| holds(i)) {
            if let Some((m, v)) = source.moments(i)? {
                let d = &state_device;
                (moments.m[i], moments.v[i]) = (host_to_param(m, d), host_to_param(v, d));
            }
        }
        let model = parallelize(
            model,
            Some((&mut moments.m, &mut moments.v)),
            ranks,
            seq_len,
        )?;
        let mut engine = Engine::new(model, moments, zero, ranks);
        if let (Engine::Whole { pipe: p, .. }, Some(pipe)) = (&mut engine, pipe) {
            *p = Some(Box::new(pipe));
        }
        Ok(engine)
    }

    /// Layers this rank runs: its stage's under PP (`stage`), else all `layers`.
    pub fn layers_run(&self, stage: usize, layers: usize) -> usize {
        match self {
            Engine::Whole {
                pipe: Some(pipe), ..
            } => pipe.stages.stage_layers(stage),
            _ => layers,
        }
    }

    /// Under PP, every stage's busy and idle time in the last step.
    pub fn stage_times(&self) -> Option<&StageTimes> {
        match self {
            Engine::Whole { times, .. } => times.as_ref(),
            Engine::Units(_) => None,
        }
    }

    /// The model as this rank holds it (under ZeRO-3 every parameter is empty).
    pub fn model(&self) -> &GenSlm {
        match self {
            Engine::Whole { model, .. } => model,
            Engine::Units(z) => &z.model,
        }
    }

    pub fn sp(&self) -> Option<&Arc<dyn SequenceParallel>> {
        self.model().sp.as_ref()
    }

    pub fn step_count(&self) -> u64 {
        match self {
            Engine::Whole { opt, .. } => opt.step_count(),
            Engine::Units(z) => z.step_count(),
        }
    }

    /// This rank's share of the step's loss over `batches` (see `step::loss_and_grads`); the
    /// gradients wait inside for [`Engine::step`].
    pub fn compute(
        &mut self,
        batches: &[Batch],
        total_targets: usize,
        ranks: &Ranks,
        keep: Keep,
    ) -> Result<f64> {
        match self {
            Engine::Whole {
                model,
                grads,
                pipe: Some(pipe),
                times,
                ..
            } => {
                let (step, g) = pipeline_loss_and_grads(
                    pipe,
                    model,
                    batches,
                    total_targets,
                    ranks,
                    keep.recomputes(),
                )?;
                *grads = Some((g, false));
                *times = Some(StageTimes::gather(&step, ranks.pp.as_ref())?);
                Ok(step.loss)
            }
            Engine::Whole { model, grads, .. } if reduces_by_unit(model, ranks) => {
                let (loss, g) = reduced_loss_and_grads(model, batches, total_targets, ranks, keep)?;
                *grads = Some((g, true));
                Ok(loss)
            }
            Engine::Whole { model, grads, .. } => {
                let (loss, g) = loss_and_grads(model, batches, total_targets, ranks, keep)?;
                *grads = Some((g, false));
                Ok(loss)
            }
            Engine::Units(z) => {
                require_micro_batches(batches)?;
                let denom = total_targets.max(1) as f64;
                let layout = z.model.layout.clone();
                let mut loss = 0.0;
                for b in batches {
                    let lb = local_batch(b, ranks);
                    loss += layerwise(z, &layout, &lb, denom, keep)?;
                }
                Ok(loss)
            }
        }
    }

    /// Reduces (ZeRO 0/1), clips by the global norm and updates.
    pub fn step(
        &mut self,
        lr: f64,
        max_norm: f64,
        loss_finite: bool,
        ranks: &Ranks,
    ) -> Result<StepOutcome> {
        match self {
            Engine::Whole {
                model, opt, grads, ..
            } => {
                let (g, reduced) = grads
                    .take()
                    .ok_or_else(|| Error::Invalid("step without gradients".into()))?;
                opt.step(model, g, reduced, lr, max_norm, loss_finite, ranks)
            }
            Engine::Units(z) => z.step(lr, max_norm, loss_finite, ranks),
        }
    }

    /// This rank's Σ nll of `lb` without autodiff (its positions' terms; under PP non-zero on
    /// the last stage only). Under ZeRO-3 and PP every rank of the group must call it with a
    /// batch of the same shape (the layers' weights are gathered one by one; the stages hand
    /// activations on).
    pub fn eval_nll(&mut self, lb: &LocalBatch, ranks: &Ranks) -> Result<f64> {
        if let Engine::Whole {
            model,
            pipe: Some(pipe),
            ..
        } = self
        {
            return stage_eval_nll(&pipe.stages, ranks.pp.as_ref(), model, lb);
        }
        let logits = self.eval_logits(lb)?;
        Ok(tensor_to_vec(&local_nll(self.model(), logits, lb))[0] as f64)
    }

    /// Logits of `lb` without autodiff (not under PP: see [`Engine::eval_nll`]). Under ZeRO-3
    /// every rank of the group must call it with a batch of the same shape.
    fn eval_logits(&mut self, lb: &LocalBatch) -> Result<Tensor<3>> {
        match self {
            Engine::Units(z) if z.stage >= 3 => {
                let layout = z.model.layout.clone();
                forward_logits(z, &layout, lb)
            }
            _ => {
                let eval = self.model().without_autodiff();
                let tokens = tokens_tensor(&lb.tokens, lb.rows, lb.cols, &eval.device);
                eval.forward_at(tokens, &lb.positions)
            }
        }
    }

    /// Bytes of (parameters, gradients, optimizer state) this rank holds after a step's
    /// update, for the memory accounting.
    pub fn held_bytes(&self) -> (usize, usize, usize) {
        match self {
            Engine::Whole { model, opt, .. } => opt.held_bytes(model),
            Engine::Units(z) => z.held_bytes(),
        }
    }

    /// The moments this rank writes into a checkpoint (see `train::optim_shards`).
    pub fn moment_runs(&self, topo: &Topology) -> Vec<MomentRun> {
        match self {
            Engine::Whole { model, opt, .. } => opt.moment_runs(model, topo),
            Engine::Units(z) => z.moment_runs(topo),
        }
    }
}

/// This stage's step over `batches` through the pipeline, and a gradient for every parameter
/// (empty for the other stages' empty ones).
fn pipeline_loss_and_grads(
    pipe: &Pipe,
    model: &GenSlm,
    batches: &[Batch],
    total_targets: usize,
    ranks: &Ranks,
    checkpoint: bool,
) -> Result<(StageStep, Vec<Tensor<1>>)> {
    require_micro_batches(batches)?;
    let micro: Vec<LocalBatch> = batches.iter().map(|b| local_batch(b, ranks)).collect();
    let p = Pipeline {
        schedule: &pipe.schedule,
        stages: &pipe.stages,
        comm: ranks.pp.as_ref(),
        checkpoint,
    };
    let mut acc: Vec<Option<Tensor<1>>> = vec![None; model.params.len()];
    let denom = total_targets.max(1) as f64;
    let step = stage_loss_and_grads(&p, model, &micro, denom, &mut acc)?;
    // Another stage's parameters get an empty gradient; one of this stage's without a
    // gradient is an error, as without a pipeline.
    let held = pipe.params_of(&model.layout, ranks.topo.pp_rank());
    let grads = acc
        .into_iter()
        .zip(&model.params)
        .enumerate()
        .map(|(i, (g, p))| match g {
            Some(g) => Ok(g),
            None if !held.contains(&i) => Ok(fp32(p.clone().without_autodiff())),
            None => Err(Error::Invalid(format!(
                "no gradient for {}",
                model.layout.specs[i].name
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((step, grads))
}

/// The model of `cfg` from `source`, with the parameters `holds` names read and the others
/// empty (all of them without a pipeline).
fn stage_model(
    cfg: ModelConfig,
    source: &ParamSource,
    device: &Device,
    holds: &dyn Fn(usize) -> bool,
) -> Result<GenSlm> {
    let n = source.layout().specs.len();
    if (0..n).all(holds) {
        let values = (0..n).map(|i| source.values(i)).collect::<Result<_>>()?;
        return GenSlm::from_host(cfg, values, device);
    }
    let mut model = GenSlm::empty(cfg, device)?;
    for i in (0..n).filter(|&i| holds(i)) {
        let (v, spec) = (source.values(i)?, &model.layout.specs[i]);
        if v.len() != spec.numel() {
            return Err(Error::Invalid(format!(
                "parameter {}: expected {} values, got {}",
                spec.name,
                spec.numel(),
                v.len()
            )));
        }
        model.params[i] = host_to_param(v, device);
    }
    Ok(model)
}
