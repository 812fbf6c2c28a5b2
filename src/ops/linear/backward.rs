//! Linear layers under autodiff: one node that saves the input and the weight and calls the
//! inner backend's `linear_bwd`.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::tensor::FloatTensor;

use super::*;

impl<B: LinearKernels, Ck: CheckpointStrategy> LinearOps for Autodiff<B, Ck> {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LinearBackward;

        impl<B: LinearKernels> Backward<B, 3> for LinearBackward {
            // The input and the weight.
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let dy = grads.consume::<B>(&ops.node);
                let (x, w) = ops.state;
                let (dx, dw, db) = B::linear_bwd(x, w, dy);
                for (node, g) in ops.parents.into_iter().zip([dx, dw, db]) {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, g);
                    }
                }
            }
        }

        match LinearBackward
            .prepare::<Ck>([x.node(), w.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, wp) = (x.primitive().clone(), w.primitive().clone());
                let y = B::linear_fwd(xp.clone(), wp.clone(), b.into_primitive());
                prep.finish((xp, wp), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as LinearOps>::linear(
                x.into_primitive(),
                w.into_primitive(),
                b.into_primitive(),
            )),
        }
    }
}
