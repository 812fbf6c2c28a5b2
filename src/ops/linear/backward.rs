//! Linear layers under autodiff: one node (`ops::autodiff::differentiable`) that saves the
//! input and the weight and runs the inner backend's kernels for the inputs that need a
//! gradient; with a [`DeferTo`], the weight's product is queued for later instead, and with a
//! [`PartOf`], gathered with the other parts' into one product.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{tensor::FloatTensor, DispatchKindConversion, DispatchTensor};

use super::*;
use crate::ops::autodiff::{differentiable, HandBackward};

/// The op as a [`HandBackward`] one; its argument is where a deferred weight gradient goes.
#[derive(Debug, Clone)]
struct Linear(Option<WeightRoute>);

impl<B: LinearKernels> HandBackward<B, 3> for Linear
where
    DispatchTensor: DispatchKindConversion<B>,
{
    // The input and the weight.
    type Saved = [FloatTensor<B>; 2];

    fn forward(
        &self,
        [x, w, b]: [FloatTensor<B>; 3],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        if !save {
            return (B::linear_fwd(x, w, b), None);
        }
        let y = B::linear_fwd(x.clone(), w.clone(), b);
        (y, Some([x, w]))
    }

    fn backward(&self, [x, w]: Self::Saved, dy: FloatTensor<B>) -> [FloatTensor<B>; 3] {
        let (dx, dw, db) = B::linear_bwd(x, w, dy);
        [dx, dw, db]
    }

    fn backward_needed(
        &self,
        [x, w]: Self::Saved,
        dy: FloatTensor<B>,
        [need_x, need_w, need_b]: [bool; 3],
    ) -> [Option<FloatTensor<B>>; 3] {
        let db = need_b.then(|| B::linear_bwd_bias(dy.clone()));
        let dx = need_x.then(|| B::linear_bwd_input(w, dy.clone()));
        let dw = match (&self.0, need_w) {
            (Some(WeightRoute::Part(part)), true) => part.gather::<B>(x, dy),
            (_, true) => Some(B::linear_bwd_weight(x, dy)),
            (Some(WeightRoute::Defer(to)), false) => {
                let product = move || Tensor::from_primitive::<B>(B::linear_bwd_weight(x, dy));
                to.sink.push(to.param, Box::new(product));
                None
            }
            (None | Some(WeightRoute::Part(_)), false) => None,
        };
        [dx, dw, db]
    }
}

impl<B: LinearKernels, Ck: CheckpointStrategy> LinearOps for Autodiff<B, Ck>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        route: Option<WeightRoute>,
    ) -> FloatTensor<Self> {
        differentiable::<B, Ck, _, 3>([x, w, b], Linear(route))
    }
}
