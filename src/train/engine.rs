//! What a rank trains with: a whole replica (ZeRO 0/1: the gradients of the whole model, then
//! one optimizer step) or ZeRO-2/3 units (gradients reduce-scattered layer by layer during the
//! backward). The trainer's loop talks to this one type whatever the stage.

use std::sync::Arc;

use burn::tensor::Tensor;

use crate::data::loader::Batch;
use crate::error::{Error, Result};
use crate::model::attention::SequenceParallel;
use crate::model::neox::tokens_tensor;
use crate::model::GenSlm;
use crate::parallel::ranks::Ranks;
use crate::parallel::topology::Topology;
use crate::train::dist_optim::{DistOptim, StepOutcome};
use crate::train::layerwise::{forward_logits, loss_and_grads as layerwise};
use crate::train::optim::AdamW;
use crate::train::optim_shards::MomentRun;
use crate::train::shard::{local_batch, LocalBatch};
use crate::train::step::{loss_and_grads, require_micro_batches};
use crate::train::zero_units::ZeroUnits;

// One per rank, built once: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Engine {
    Whole {
        model: GenSlm,
        opt: DistOptim,
        /// The step's reduced-later gradients, between `compute` and `step`.
        grads: Option<Vec<Tensor<1>>>,
    },
    Units(ZeroUnits),
}

impl Engine {
    /// `model` already cut for SP; `moments` its full optimizer state (position rows cut).
    /// ZeRO-2/3 need more than one rank; with one, the whole model is kept (ZeRO-0 in effect).
    pub fn new(model: GenSlm, moments: AdamW, zero: u8, ranks: &Ranks) -> Self {
        if zero >= 2 && ranks.topo.world > 1 {
            return Engine::Units(ZeroUnits::new(model, moments, zero, ranks));
        }
        let mut model = model;
        model.params = model
            .params
            .into_iter()
            .map(|p| p.autodiff().require_grad())
            .collect();
        let opt = DistOptim::new(moments, &model, ranks, zero >= 1);
        Engine::Whole {
            model,
            opt,
            grads: None,
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
        checkpoint: bool,
    ) -> Result<f64> {
        match self {
            Engine::Whole { model, grads, .. } => {
                let (loss, g) = loss_and_grads(model, batches, total_targets, ranks, checkpoint)?;
                *grads = Some(g);
                Ok(loss)
            }
            Engine::Units(z) => {
                require_micro_batches(batches)?;
                let denom = total_targets.max(1) as f64;
                let layout = z.model.layout.clone();
                let mut loss = 0.0;
                for b in batches {
                    let lb = local_batch(b, ranks);
                    loss += layerwise(z, &layout, &lb, denom, checkpoint)?;
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
            Engine::Whole { model, opt, grads } => {
                let g = grads
                    .take()
                    .ok_or_else(|| Error::Invalid("step without gradients".into()))?;
                opt.step(model, g, lr, max_norm, loss_finite, ranks)
            }
            Engine::Units(z) => z.step(lr, max_norm, loss_finite, ranks),
        }
    }

    /// Logits of `lb` without autodiff. Under ZeRO-3 every rank of the group must call it
    /// with a batch of the same shape (the layers' weights are gathered one by one).
    pub fn eval_logits(&mut self, lb: &LocalBatch) -> Result<Tensor<3>> {
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

    /// Elements of (parameters, gradients, optimizer state) this rank holds after a step's
    /// update, for the memory accounting.
    pub fn held_elements(&self) -> (usize, usize, usize) {
        match self {
            Engine::Whole { model, opt, .. } => opt.held_elements(model),
            Engine::Units(z) => z.held_elements(),
        }
    }

    /// The moments this rank writes into a checkpoint (see `train::optim_shards`).
    pub fn moment_runs(&self, topo: &Topology) -> Vec<MomentRun> {
        match self {
            Engine::Whole { model, opt, .. } => opt.moment_runs(model, topo),
            Engine::Units(z) => z.moment_runs(),
        }
    }
}
