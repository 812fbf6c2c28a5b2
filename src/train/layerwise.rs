//! One micro-batch's loss and gradients computed one unit of parameters at a time, so that a
//! unit's weights need to exist only while it runs and its gradients only until they are
//! handed on (ZeRO-2/3, and full activation checkpointing).
//!
//! The model is cut into units (embeddings, each layer, the head). The forward runs unit by
//! unit, each layer in its own small autodiff graph whose input is a fresh leaf; the backward
//! walks the units from the top, applying the gradient of each unit's output through the
//! surrogate `Σ out ⊙ g` (whose gradient with respect to `out` is exactly `g`) and handing the
//! unit's parameter gradients to [`UnitWeights::take_grads`] as soon as they exist. The chain
//! rule makes this equal to one whole-graph backward up to float rounding.
//!
//! With checkpointing ([`Keep::Inputs`]), the forward records no graph and keeps only each
//! layer's input; the backward recomputes each layer from it (one layer's graph alive at a
//! time). [`Keep::HostInputs`] keeps those inputs in host memory (ALST's activation offload):
//! each is copied out after its layer's forward and back before its recompute. Without it,
//! every layer's graph (and, under ZeRO-3, the gathered weights it references) stays alive
//! until that layer's backward: burn's autodiff keeps what a backward needs, and unlike
//! PyTorch a tensor's storage cannot be swapped out under the graph.

use burn::tensor::{Device, Gradients, Tensor};

use crate::backend::{sample_device_memory, to_host};
use crate::error::{Error, Result};
use crate::model::cache::Past;
use crate::model::params::Layout;
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::train::master::fp32;
use crate::train::shard::{local_nll, LocalBatch};

/// What the forward keeps of each layer for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every layer's autodiff graph (nothing recomputed).
    Graphs,
    /// Full activation checkpointing: each layer's input, where it was computed.
    Inputs,
    /// Full activation checkpointing with the inputs in host memory (`--offload
    /// activations`): the device holds one layer's input at a time.
    HostInputs,
}

impl Keep {
    /// From `--checkpoint-activations` and whether activations are offloaded (which only
    /// applies to checkpointed inputs; the configuration refuses it without).
    pub fn of(checkpoint: bool, offload: bool) -> Self {
        match (checkpoint, offload) {
            (false, _) => Keep::Graphs,
            (true, false) => Keep::Inputs,
            (true, true) => Keep::HostInputs,
        }
    }

    /// Whether the backward recomputes each layer's forward.
    pub fn recomputes(self) -> bool {
        self != Keep::Graphs
    }
}

/// A group of parameters gathered and reduced together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// The token embedding table.
    Embed,
    /// The learned position table (its own unit: under SP each rank holds different rows).
    Pos,
    Layer(usize),
    /// The final LayerNorm and the output head.
    Head,
}

impl Unit {
    /// Every unit of a model, in forward order.
    pub fn all(layout: &Layout) -> Vec<Unit> {
        let mut units = embed_units(layout);
        units.extend((0..layout.layers.len()).map(Unit::Layer));
        units.push(Unit::Head);
        units
    }

    /// The unit's parameter indices (in the model's flat list).
    pub fn params(self, layout: &Layout) -> Vec<usize> {
        match self {
            Unit::Embed => vec![layout.embed_in],
            Unit::Pos => layout.embed_pos.into_iter().collect(),
            Unit::Layer(li) => layout.layers[li].all().to_vec(),
            Unit::Head => vec![layout.final_ln_w, layout.final_ln_b, layout.embed_out],
        }
    }
}

/// The units the embedding step reads.
pub(crate) fn embed_units(layout: &Layout) -> Vec<Unit> {
    let mut u = vec![Unit::Embed];
    if layout.embed_pos.is_some() {
        u.push(Unit::Pos);
    }
    u
}

/// Where the executor gets weights and sends gradients.
pub trait UnitWeights {
    /// The groups of units [`UnitWeights::model`] will be asked for next, in order (so their
    /// weights can be fetched ahead). A request out of this order is still served.
    fn will_ask(&mut self, _order: Vec<Vec<Unit>>) {}
    /// A model whose parameters of `units` are present as autodiff leaves that require
    /// gradients (other parameters may be absent).
    fn model(&mut self, units: &[Unit]) -> Result<GenSlm>;
    /// The gradients of `unit`'s parameters from one micro-batch (in [`Unit::params`] order).
    fn take_grads(&mut self, unit: Unit, grads: Vec<Tensor<1>>) -> Result<()>;
}

/// Hands `model`'s gradients of `units` out of `grads` to `w`.
fn hand_on(
    w: &mut dyn UnitWeights,
    model: &GenSlm,
    units: &[Unit],
    grads: &Gradients,
) -> Result<()> {
    for &u in units {
        let g = u
            .params(&model.layout)
            .into_iter()
            .map(|i| {
                // bf16 working copies' gradients go on in fp32 (`train::master`).
                model.params[i].grad(grads).map(fp32).ok_or_else(|| {
                    Error::Invalid(format!("no gradient for {}", model.layout.specs[i].name))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        w.take_grads(u, g)?;
    }
    Ok(())
}

/// Takes the gradient of `x` (an autodiff leaf) out of `grads`, named for errors.
fn input_grad(x: &Tensor<3>, grads: &mut Gradients, what: &str) -> Result<Tensor<3>> {
    x.grad_remove(grads)
        .ok_or_else(|| Error::Invalid(format!("layer-wise backward: no gradient reached {what}")))
}

/// What the forward keeps of one layer for its backward (tensors are a few hundred bytes of
/// handles; boxing would only add an allocation per layer).
#[allow(clippy::large_enum_variant)]
enum Kept {
    /// Checkpointing: the layer's input only (perhaps in host memory) and the device it
    /// returns to for the recompute.
    Input(Tensor<3>, Device),
    /// The layer's graph: its input leaf, its output and the model holding its weights.
    Graph(Tensor<3>, Tensor<3>, GenSlm),
}

/// This rank's loss term `Σ nll / denom` of one micro-batch; the gradients go to `w` unit by
/// unit, from the top.
pub fn loss_and_grads(
    w: &mut dyn UnitWeights,
    layout: &Layout,
    lb: &LocalBatch,
    denom: f64,
    keep: Keep,
) -> Result<f64> {
    let checkpoint = keep.recomputes();
    let tokens = |d: &Device| tokens_tensor(&lb.tokens, lb.rows, lb.cols, d);
    let embed = embed_units(layout);
    let n_layers = layout.layers.len();
    let layer = |li: usize| vec![Unit::Layer(li)];
    let mut order: Vec<Vec<Unit>> = vec![embed.clone()];
    order.extend((0..n_layers).map(layer));
    order.push(vec![Unit::Head]);
    if checkpoint {
        // The backward recomputes each layer from the top, then the embeddings.
        order.extend((0..n_layers).rev().map(layer));
        order.push(embed.clone());
    }
    w.will_ask(order);

    // Forward.
    let em = w.model(&embed)?;
    let ctx = em.layer_context_at(&lb.positions);
    let (mut x, mut embed_graph) = if checkpoint {
        let f = em.without_autodiff();
        (f.embed_at(tokens(&f.device), &lb.positions)?, None)
    } else {
        let x0 = em.embed_at(tokens(&em.device), &lb.positions)?;
        (x0.clone().detach(), Some((x0, em.clone())))
    };
    let frozen_ctx = checkpoint.then(|| em.without_autodiff().layer_context_at(&lb.positions));
    drop(em);
    let mut kept = Vec::with_capacity(n_layers);
    for li in 0..n_layers {
        let m = w.model(&[Unit::Layer(li)])?;
        if let Some(fctx) = &frozen_ctx {
            let home = x.device();
            let parked = match keep {
                Keep::HostInputs => to_host(x.clone()),
                _ => x.clone(),
            };
            kept.push(Kept::Input(parked, home));
            x = m.without_autodiff().layer(li, x, fctx, Past::None).0;
        } else {
            let input = x.require_grad();
            let out = m.layer(li, input.clone(), &ctx, Past::None).0;
            x = out.clone().detach();
            kept.push(Kept::Graph(input, out, m));
        }
    }

    // The head and the loss, giving the gradient of the last layer's output.
    let (loss, mut g) = {
        let hm = w.model(&[Unit::Head])?;
        let top = if checkpoint { x.autodiff() } else { x }.require_grad();
        let scaled = local_nll(&hm, hm.logits(hm.final_norm(top.clone())), lb) / denom;
        let loss = tensor_to_vec(&scaled)[0] as f64;
        sample_device_memory(&hm.device);
        let mut grads = scaled.backward();
        hand_on(w, &hm, &[Unit::Head], &grads)?;
        let g = input_grad(&top, &mut grads, "the last layer's output")?;
        (loss, g)
    };

    // Each layer from the top.
    for li in (0..n_layers).rev() {
        let (input, out, m) = match kept.pop().expect("one kept entry per layer") {
            Kept::Input(x, home) => {
                let m = w.model(&[Unit::Layer(li)])?;
                let input = x.to_device(&home).autodiff().require_grad();
                let out = m.layer(li, input.clone(), &ctx, Past::None).0;
                (input, out, m)
            }
            Kept::Graph(input, out, m) => (input, out, m),
        };
        sample_device_memory(&m.device);
        let mut grads = (out * g).sum().backward();
        hand_on(w, &m, &[Unit::Layer(li)], &grads)?;
        g = input_grad(&input, &mut grads, &format!("the input of layer {li}"))?;
    }

    // The embeddings.
    let (x0, em) = match embed_graph.take() {
        Some(pair) => pair,
        None => {
            let em = w.model(&embed)?;
            (em.embed_at(tokens(&em.device), &lb.positions)?, em)
        }
    };
    let grads = (x0 * g).sum().backward();
    hand_on(w, &em, &embed, &grads)?;
    Ok(loss)
}

/// Logits of a forward without autodiff, one unit at a time (ZeRO-3 validation).
pub fn forward_logits(
    w: &mut dyn UnitWeights,
    layout: &Layout,
    lb: &LocalBatch,
) -> Result<Tensor<3>> {
    let mut order = vec![embed_units(layout)];
    order.extend((0..layout.layers.len()).map(|li| vec![Unit::Layer(li)]));
    order.push(vec![Unit::Head]);
    w.will_ask(order);
    let m = w.model(&embed_units(layout))?.without_autodiff();
    let ctx = m.layer_context_at(&lb.positions);
    let mut x = m.embed_at(
        tokens_tensor(&lb.tokens, lb.rows, lb.cols, &m.device),
        &lb.positions,
    )?;
    for li in 0..layout.layers.len() {
        let m = w.model(&[Unit::Layer(li)])?.without_autodiff();
        x = m.layer(li, x, &ctx, Past::None).0;
    }
    let m = w.model(&[Unit::Head])?.without_autodiff();
    Ok(m.logits(m.final_norm(x)))
}
