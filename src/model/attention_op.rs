//! The autodiff side shared by attention ops whose kernels come as a forward returning the
//! output and the row log-sum-exp, and a backward taking them (FlashAttention on one device,
//! ring attention across a CP group): autodiff records one node for the op and calls the
//! hand-written backward, never differentiating through the kernels' own tensor ops.

use std::marker::PhantomData;

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{tensor::FloatTensor, Backend};

/// The two kernels of an attention op on backend `B`; the implementor is the op's non-tensor
/// argument (block sizes, masks, a communicator).
pub trait AttentionKernels<B: Backend>: Clone + Send + std::fmt::Debug + 'static {
    /// `(o, lse)` of q, k, v.
    fn forward(
        &self,
        q: FloatTensor<B>,
        k: FloatTensor<B>,
        v: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>);

    /// `(dq, dk, dv)` from the forward's inputs, `o`, `lse` and `do`.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        q: FloatTensor<B>,
        k: FloatTensor<B>,
        v: FloatTensor<B>,
        o: FloatTensor<B>,
        lse: FloatTensor<B>,
        d_o: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);
}

/// Saved for the backward: q, k, v, o, lse (inner-backend tensors) and the kernels.
type Saved<B, K> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    K,
);

#[derive(Debug)]
struct KernelBackward<K>(PhantomData<K>);

impl<B: Backend, K: AttentionKernels<B>> Backward<B, 3> for KernelBackward<K> {
    type State = Saved<B, K>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (q, k, v, o, lse, kernels) = ops.state;
        let (dq, dk, dv) = kernels.backward(q, k, v, o, lse, d_o);
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// The op's output on an autodiff backend: tracked, it saves what the backward needs;
/// untracked (no input requires a gradient), it runs the forward alone.
pub fn differentiable<B: Backend, C: CheckpointStrategy, K: AttentionKernels<B>>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    kernels: K,
) -> FloatTensor<Autodiff<B, C>> {
    match KernelBackward::<K>(PhantomData)
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (qp, kp, vp) = (
                q.primitive().clone(),
                k.primitive().clone(),
                v.primitive().clone(),
            );
            let (o, lse) = kernels.forward(qp.clone(), kp.clone(), vp.clone());
            prep.finish((qp, kp, vp, o.clone(), lse, kernels), o)
        }
        OpsKind::UnTracked(prep) => {
            let (o, _) =
                kernels.forward(q.into_primitive(), k.into_primitive(), v.into_primitive());
            prep.finish(o)
        }
    }
}
