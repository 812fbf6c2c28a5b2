//! LayerNorm under autodiff: one node (`ops::autodiff::differentiable`) that saves the input,
//! the weight and the row statistics and calls the inner backend's `layer_norm_bwd`.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::tensor::FloatTensor;

use super::*;
use crate::ops::autodiff::{differentiable, HandBackward};

/// The op as a [`HandBackward`] one: its argument is ε.
#[derive(Debug, Clone)]
struct LayerNorm {
    eps: f64,
}

impl<B: LayerNormKernels> HandBackward<B, 3> for LayerNorm {
    // The input, the weight, and the row statistics (mean, 1/σ).
    type Saved = [FloatTensor<B>; 4];

    fn forward(
        &self,
        [x, gamma, beta]: [FloatTensor<B>; 3],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        if !save {
            return (B::layer_norm_fwd(x, gamma, beta, self.eps).0, None);
        }
        let (y, mean, rstd) = B::layer_norm_fwd(x.clone(), gamma.clone(), beta, self.eps);
        (y, Some([x, gamma, mean, rstd]))
    }

    fn backward(
        &self,
        [x, gamma, mean, rstd]: Self::Saved,
        dy: FloatTensor<B>,
    ) -> [FloatTensor<B>; 3] {
        let (dx, dg, db) = B::layer_norm_bwd(x, gamma, mean, rstd, dy);
        [dx, dg, db]
    }
}

impl<B: LayerNormKernels, Ck: CheckpointStrategy> LayerNormOps for Autodiff<B, Ck> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        differentiable::<B, Ck, _, 3>([x, gamma, beta], LayerNorm { eps })
    }
}
