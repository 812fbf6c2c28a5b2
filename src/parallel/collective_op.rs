//! The autodiff side shared by collectives whose backward is the same collective transposed:
//! the Ulysses all-to-all (backward: the exchange the other way) and Megatron's `f` and `g`
//! (each the other's backward). Autodiff records one node per call and runs the transposed
//! collective on the gradient, never differentiating through the communicator.

use std::marker::PhantomData;

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{tensor::FloatTensor, Backend};

/// A collective on backend `B`; the implementor is its non-tensor argument (group, direction).
pub trait Transposable<B: Backend>: Clone + Send + std::fmt::Debug + 'static {
    /// The collective on `x`.
    fn apply(&self, x: FloatTensor<B>) -> FloatTensor<B>;
    /// The argument of the collective that carries the gradient back.
    fn transposed(&self) -> Self;
}

#[derive(Debug)]
struct TransposedBackward<P>(PhantomData<P>);

impl<B: Backend, P: Transposable<B>> Backward<B, 1> for TransposedBackward<P> {
    type State = P;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let g = ops.state.transposed().apply(grad);
        if let Some(node) = node {
            grads.register::<B>(node.id, g);
        }
    }
}

/// The collective's output on an autodiff backend: tracked, it keeps its argument for the
/// backward; untracked, it runs alone.
pub fn differentiable<B: Backend, C: CheckpointStrategy, P: Transposable<B>>(
    x: FloatTensor<Autodiff<B, C>>,
    params: P,
) -> FloatTensor<Autodiff<B, C>> {
    match TransposedBackward::<P>(PhantomData)
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = params.apply(x.primitive().clone());
            prep.finish(params, out)
        }
        OpsKind::UnTracked(prep) => prep.finish(params.apply(x.into_primitive())),
    }
}
