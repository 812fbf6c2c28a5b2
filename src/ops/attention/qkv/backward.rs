//! The fused QKV attention under autodiff: one node that saves the projection and calls the
//! inner backend's backward.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::tensor::FloatTensor;

use super::*;

impl<B: QkvAttentionKernels, Ck: CheckpointStrategy> QkvAttentionOps for Autodiff<B, Ck> {
    fn qkv_attention(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct QkvBackward;

        impl<B: QkvAttentionKernels> Backward<B, 1> for QkvBackward {
            // qkv, cos, sin, o, lse, and the parameters.
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                QkvParams,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node] = ops.parents;
                let d_o = grads.consume::<B>(&ops.node);
                let (qkv, cos, sin, o, lse, params) = ops.state;
                if let Some(node) = node {
                    let g = B::qkv_attention_bwd(qkv, cos, sin, o, lse, d_o, params);
                    grads.register::<B>(node.id, g);
                }
            }
        }

        // The tables are constants: only qkv is a parent.
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match QkvBackward
            .prepare::<Ck>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let qp = qkv.primitive().clone();
                let (o, lse) =
                    B::qkv_attention_fwd(qp.clone(), cos.clone(), sin.clone(), params.clone());
                prep.finish((qp, cos, sin, o.clone(), lse, params), o)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as QkvAttentionOps>::qkv_attention(
                qkv.into_primitive(),
                cos,
                sin,
                params,
            )),
        }
    }
}
