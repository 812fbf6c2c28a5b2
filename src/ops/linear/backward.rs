//! Linear layers under autodiff: one node (`ops::autodiff::differentiable`) that saves the
//! input and the weight and calls the inner backend's `linear_bwd`.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::tensor::FloatTensor;

use super::*;
use crate::ops::autodiff::{differentiable, HandBackward};

/// The op as a [`HandBackward`] one: no argument besides its tensors.
#[derive(Debug, Clone)]
struct Linear;

impl<B: LinearKernels> HandBackward<B, 3> for Linear {
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
}

impl<B: LinearKernels, Ck: CheckpointStrategy> LinearOps for Autodiff<B, Ck> {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        differentiable::<B, Ck, _, 3>([x, w, b], Linear)
    }
}
