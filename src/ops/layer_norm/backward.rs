//! LayerNorm under autodiff: one node that saves the input, the weight and the row statistics
//! and calls the inner backend's `layer_norm_bwd`.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::tensor::FloatTensor;

use super::*;

impl<B: LayerNormKernels, Ck: CheckpointStrategy> LayerNormOps for Autodiff<B, Ck> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LayerNormBackward;

        impl<B: LayerNormKernels> Backward<B, 3> for LayerNormBackward {
            // The input, the weight, and the row statistics.
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_g, node_b] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, gamma, mean, rstd) = ops.state;
                let (dx, dg, db) = B::layer_norm_bwd(x, gamma, mean, rstd, dy);
                for (node, g) in [(node_x, dx), (node_g, dg), (node_b, db)] {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, g);
                    }
                }
            }
        }

        match LayerNormBackward
            .prepare::<Ck>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, gp) = (x.primitive().clone(), gamma.primitive().clone());
                let (y, m, r) =
                    B::layer_norm_fwd(xp.clone(), gp.clone(), beta.into_primitive(), eps);
                prep.finish((xp, gp, m, r), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as LayerNormOps>::layer_norm(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                eps,
            )),
        }
    }
}
