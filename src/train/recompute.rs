//! Full activation checkpointing: one micro-batch's loss and parameter gradients while keeping
//! only each layer's input between the forward and the backward.
//!
//! The forward runs without autodiff and keeps the input of every layer (`L·b·s·h` values).
//! The backward then walks the model from the top, one piece at a time, each in its own small
//! autodiff graph: the final LayerNorm, LM head and loss first (giving the gradient of the last
//! layer's output), then each layer recomputed from its kept input with the gradient of its
//! output applied through the surrogate `Σ out ⊙ g` (whose gradient with respect to `out` is
//! exactly `g`), then the embeddings. Peak activation memory is one layer's graph plus the
//! kept inputs, instead of every layer's graph.
//!
//! The pieces are the model's own (`GenSlm::embed`, `layer`, `final_norm`), so the gradients
//! equal those of the whole-graph backward up to float rounding (tests/parallel.rs,
//! `checkpointing_matches_the_whole_graph`), for
//! one rank and under sequence parallelism alike: the Ulysses exchanges run again in the
//! recomputed forward and in reverse in each layer's backward, in the same order on every rank.

use burn::tensor::{Gradients, Tensor};

use crate::error::{Error, Result};
use crate::model::neox::{tensor_to_vec, tokens_tensor, Past};
use crate::model::GenSlm;
use crate::train::shard::{local_nll, LocalBatch};

/// Takes the gradient of `x` (an autodiff leaf) out of `grads`, named for errors.
fn input_grad(x: &Tensor<3>, grads: &mut Gradients, what: &str) -> Result<Tensor<3>> {
    x.grad_remove(grads)
        .ok_or_else(|| Error::Invalid(format!("checkpointing: no gradient reached {what}")))
}

/// This rank's loss term `Σ nll / denom` of one micro-batch and its gradient, added into
/// `acc` (one slot per parameter), computed with full activation checkpointing. `model`'s
/// parameters must be autodiff leaves that require gradients.
pub fn checkpointed_loss_and_grads(
    model: &GenSlm,
    lb: &LocalBatch,
    denom: f64,
    acc: &mut [Option<Tensor<1>>],
) -> Result<f64> {
    let tokens =
        |device: &burn::tensor::Device| tokens_tensor(&lb.tokens, lb.rows, lb.cols, device);
    let n_layers = model.layout.layers.len();
    // The forward without a graph (the same parameters, no autodiff), keeping layer inputs.
    let mut kept = Vec::with_capacity(n_layers);
    let x = {
        let frozen = model.without_autodiff();
        let ctx = frozen.layer_context(lb.offset, lb.cols);
        let mut x = frozen.embed(tokens(&frozen.device), lb.offset)?;
        for li in 0..n_layers {
            kept.push(x.clone());
            x = frozen.layer(li, x, &ctx, Past::None).0;
        }
        x
    };

    // The loss from the last layer's output. Leaves re-enter autodiff with burn's default
    // checkpointing strategy, which is the one every genslm device uses (`Device::autodiff`).
    // Each piece's graph and gradients are dropped before the next piece runs.
    let (loss, mut g) = {
        let top = x.autodiff().require_grad();
        let scaled = local_nll(model.logits(model.final_norm(top.clone())), lb) / denom;
        let loss = tensor_to_vec(&scaled)[0] as f64;
        let mut grads = scaled.backward();
        accumulate(model, &grads, acc);
        (
            loss,
            input_grad(&top, &mut grads, "the last layer's output")?,
        )
    };

    // Each layer from the top, recomputed from its kept input.
    let ctx = model.layer_context(lb.offset, lb.cols);
    for li in (0..n_layers).rev() {
        let input = kept
            .pop()
            .expect("one kept input per layer")
            .autodiff()
            .require_grad();
        let out = model.layer(li, input.clone(), &ctx, Past::None).0;
        let mut grads = (out * g).sum().backward();
        accumulate(model, &grads, acc);
        g = input_grad(&input, &mut grads, &format!("the input of layer {li}"))?;
    }

    // The embeddings (token table and learned positions).
    let x0 = model.embed(tokens(&model.device), lb.offset)?;
    let grads = (x0 * g).sum().backward();
    accumulate(model, &grads, acc);
    Ok(loss)
}

/// Adds the gradients `grads` holds for `model`'s parameters into `acc` (one slot per
/// parameter; parameters that took no part have none).
pub fn accumulate(model: &GenSlm, grads: &Gradients, acc: &mut [Option<Tensor<1>>]) {
    for (i, p) in model.params.iter().enumerate() {
        if let Some(g) = p.grad(grads) {
            acc[i] = Some(match acc[i].take() {
                Some(a) => a + g,
                None => g,
            });
        }
    }
}
