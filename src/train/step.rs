//! One step's loss and parameter gradients on a rank: the micro-batches' forward and backward
//! (whole-graph, or with full activation checkpointing), summed, then reduced over the ranks.

use burn::tensor::Tensor;

use crate::data::loader::Batch;
use crate::error::{Error, Result};
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::parallel::ranks::Ranks;
use crate::train::layerwise::Keep;
use crate::train::recompute::{accumulate, checkpointed_loss_and_grads};
use crate::train::shard::{local_batch, local_nll, reduce_gradients};

/// The step's loss and gradients as every rank sees them after the reductions: the loss of the
/// whole global batch, the full gradient of replicated parameters and this rank's rows of the
/// position table's gradient. Equal to the single-rank values (tests/parallel_ulysses.rs).
/// `keep`: whole graphs, or full activation checkpointing ([`crate::train::recompute`]), the
/// same values with one layer's activations alive at a time.
pub fn step_loss_and_grads(
    model: &GenSlm,
    batches: &[Batch],
    ranks: &Ranks,
    keep: Keep,
) -> Result<(f64, Vec<Tensor<1>>)> {
    let total_targets: usize = batches.iter().map(Batch::n_targets).sum();
    let (loss, mut grads) = loss_and_grads(model, batches, total_targets, ranks, keep)?;
    reduce_gradients(&mut grads, model, ranks)?;
    Ok((all_reduce_scalar(loss, ranks)?, grads))
}

/// Sum of a rank's loss share over the data group (the value itself on one rank, kept in f64):
/// the ranks of a TP group hold the same share, counted once.
pub fn all_reduce_scalar(x: f64, ranks: &Ranks) -> Result<f64> {
    if ranks.data.size() == 1 {
        return Ok(x);
    }
    let mut buf = [x];
    ranks.data.all_reduce_sum_f64(&mut buf)?;
    Ok(buf[0])
}

/// Refuses a step without micro-batches (`grad_accum` 0), whatever the engine.
pub fn require_micro_batches(batches: &[Batch]) -> Result<()> {
    if batches.is_empty() {
        return Err(Error::Invalid(
            "a step needs at least one micro-batch (grad_accum ≥ 1)".into(),
        ));
    }
    Ok(())
}

/// This rank's share of the step's loss (its positions' terms over the global target count)
/// and the gradient of it; summing both over the ranks gives the single-rank values.
pub fn loss_and_grads(
    model: &GenSlm,
    batches: &[Batch],
    total_targets: usize,
    ranks: &Ranks,
    keep: Keep,
) -> Result<(f64, Vec<Tensor<1>>)> {
    require_micro_batches(batches)?;
    let denom = total_targets.max(1) as f64;
    let mut loss = 0.0;
    let mut acc: Vec<Option<Tensor<1>>> = vec![None; model.params.len()];
    for b in batches {
        let lb = local_batch(b, ranks);
        if keep.recomputes() {
            loss += checkpointed_loss_and_grads(model, &lb, denom, &mut acc, keep)?;
            continue;
        }
        let tokens = tokens_tensor(&lb.tokens, lb.rows, lb.cols, &model.device);
        let logits = model.forward_at(tokens, &lb.positions)?;
        let scaled = local_nll(model, logits, &lb) / denom;
        loss += tensor_to_vec(&scaled)[0] as f64;
        crate::backend::sample_device_memory(&model.device);
        accumulate(model, &scaled.backward(), &mut acc);
    }
    Ok((loss, every_gradient(model, acc)?))
}

/// Every parameter's gradient out of `acc`, or an error naming one that received none.
pub fn every_gradient(model: &GenSlm, acc: Vec<Option<Tensor<1>>>) -> Result<Vec<Tensor<1>>> {
    acc.into_iter()
        .enumerate()
        .map(|(i, g)| g.ok_or_else(|| no_gradient(model, i)))
        .collect()
}

/// The error of parameter `i` without a gradient.
pub fn no_gradient(model: &GenSlm, i: usize) -> Error {
    Error::Invalid(format!("no gradient for {}", model.layout.specs[i].name))
}
