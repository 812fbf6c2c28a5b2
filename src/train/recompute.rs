//! Full activation checkpointing on one replica: one micro-batch's loss and parameter
//! gradients while keeping only each layer's input between the forward and the backward.
//!
//! The forward runs without autodiff and keeps the input of every layer (`L·b·s·h` values);
//! the backward recomputes one layer at a time from it ([`crate::train::layerwise`]). Peak
//! activation memory is one layer's graph plus the kept inputs, instead of every layer's
//! graph. The pieces are the model's own (`GenSlm::embed`, `layer`, `final_norm`), so the
//! gradients equal those of the whole-graph backward up to float rounding (tests/parallel_ulysses.rs,
//! `checkpointing_matches_the_whole_graph`), for one rank and under sequence parallelism alike:
//! the Ulysses exchanges run again in the recomputed forward and in reverse in each layer's
//! backward, in the same order on every rank.

use burn::tensor::{Gradients, Tensor};

use crate::error::Result;
use crate::model::GenSlm;
use crate::train::layerwise::{loss_and_grads, Keep, Unit, UnitWeights};
use crate::train::master::fp32;
use crate::train::shard::LocalBatch;

/// A whole model on this rank; gradients summed into one slot per parameter.
struct Whole<'a> {
    model: &'a GenSlm,
    acc: &'a mut [Option<Tensor<1>>],
}

impl UnitWeights for Whole<'_> {
    fn model(&mut self, _units: &[Unit]) -> Result<GenSlm> {
        Ok(self.model.clone())
    }

    fn take_grads(&mut self, unit: Unit, grads: Vec<Tensor<1>>) -> Result<()> {
        for (i, g) in unit.params(&self.model.layout).into_iter().zip(grads) {
            add_into(&mut self.acc[i], g);
        }
        Ok(())
    }
}

pub(crate) fn add_into(slot: &mut Option<Tensor<1>>, g: Tensor<1>) {
    // bf16 working copies' gradients are accumulated in fp32 (`train::master`).
    let g = fp32(g);
    *slot = Some(match slot.take() {
        Some(a) => a + g,
        None => g,
    });
}

/// This rank's loss term `Σ nll / denom` of one micro-batch and its gradient, added into
/// `acc` (one slot per parameter), computed with full activation checkpointing (`keep`: the
/// inputs on the device or in host memory). `model`'s parameters must be autodiff leaves that
/// require gradients.
pub fn checkpointed_loss_and_grads(
    model: &GenSlm,
    lb: &LocalBatch,
    denom: f64,
    acc: &mut [Option<Tensor<1>>],
    keep: Keep,
) -> Result<f64> {
    let layout = model.layout.clone();
    loss_and_grads(&mut Whole { model, acc }, &layout, lb, denom, keep)
}

/// Adds the gradients `grads` holds for `model`'s parameters into `acc` (one slot per
/// parameter; parameters that took no part have none).
pub fn accumulate(model: &GenSlm, grads: &Gradients, acc: &mut [Option<Tensor<1>>]) {
    for (i, p) in model.params.iter().enumerate() {
        if let Some(g) = p.grad(grads) {
            add_into(&mut acc[i], g);
        }
    }
}
