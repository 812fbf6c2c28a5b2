//! The one autodiff helper for ops whose backward is written by hand: autodiff records a single
//! node for the op and calls the op's own backward, never differentiating through the tensor
//! ops inside its kernels. Two kinds of op use it:
//! - attention ops whose kernels come as a forward returning the output and the row
//!   log-sum-exp and a backward taking them ([`AttentionKernels`]: FlashAttention on one
//!   device, ring attention across a CP group);
//! - collectives whose backward is the same collective transposed ([`Transposable`]: the
//!   Ulysses all-to-all, whose backward is the exchange the other way, and Megatron's `f` and
//!   `g`, each the other's backward).

use std::marker::PhantomData;

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{tensor::FloatTensor, Backend};

/// An op of `N` float inputs and one output on backend `B`, with a hand-written backward. The
/// implementor is the op's non-tensor argument (block sizes, masks, a communicator).
pub trait HandBackward<B: Backend, const N: usize>:
    Clone + Send + std::fmt::Debug + 'static
{
    /// What the backward needs from the forward.
    type Saved: Clone + Send + std::fmt::Debug + 'static;
    /// The output and, when `save` (some input requires a gradient), what the backward needs.
    fn forward(
        &self,
        inputs: [FloatTensor<B>; N],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>);
    /// The inputs' gradients from the output's.
    fn backward(&self, saved: Self::Saved, grad: FloatTensor<B>) -> [FloatTensor<B>; N];
    /// The gradients of the inputs in `needed` (those autodiff tracks; the others' are never
    /// used). By default all are computed and the unneeded dropped; an op whose gradients are
    /// separate products overrides it to skip them.
    fn backward_needed(
        &self,
        saved: Self::Saved,
        grad: FloatTensor<B>,
        needed: [bool; N],
    ) -> [Option<FloatTensor<B>>; N] {
        let mut i = 0;
        self.backward(saved, grad).map(|g| {
            i += 1;
            needed[i - 1].then_some(g)
        })
    }
}

#[derive(Debug)]
struct Node<Op>(PhantomData<Op>);

impl<B: Backend, Op: HandBackward<B, N>, const N: usize> Backward<B, N> for Node<Op> {
    type State = (Op::Saved, Op);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (saved, op) = ops.state;
        let needed = ops.parents.each_ref().map(Option::is_some);
        let input_grads = op.backward_needed(saved, grad, needed);
        for (node, g) in ops.parents.into_iter().zip(input_grads) {
            if let (Some(node), Some(g)) = (node, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// The op's output on an autodiff backend: tracked, it saves what the backward needs;
/// untracked (no input requires a gradient), it runs the forward alone.
pub fn differentiable<B, C, Op, const N: usize>(
    inputs: [FloatTensor<Autodiff<B, C>>; N],
    op: Op,
) -> FloatTensor<Autodiff<B, C>>
where
    B: Backend,
    C: CheckpointStrategy,
    Op: HandBackward<B, N>,
{
    match Node::<Op>(PhantomData)
        .prepare::<C>(inputs.each_ref().map(|x| x.node()))
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (out, saved) = op.forward(inputs.map(|x| x.primitive().clone()), true);
            let saved = saved.expect("a tracked forward saves its state");
            prep.finish((saved, op), out)
        }
        OpsKind::UnTracked(prep) => {
            let (out, _) = op.forward(inputs.map(|x| x.into_primitive()), false);
            prep.finish(out)
        }
    }
}

/// The two kernels of an attention op on backend `B`.
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

/// An attention op as a [`HandBackward`] op: it saves q, k, v, o and lse.
#[derive(Debug, Clone)]
struct Attention<K>(K);

type AttentionSaved<B> = [FloatTensor<B>; 5];

impl<B: Backend, K: AttentionKernels<B>> HandBackward<B, 3> for Attention<K> {
    type Saved = AttentionSaved<B>;

    fn forward(
        &self,
        [q, k, v]: [FloatTensor<B>; 3],
        save: bool,
    ) -> (FloatTensor<B>, Option<AttentionSaved<B>>) {
        if !save {
            return (self.0.forward(q, k, v).0, None);
        }
        let (o, lse) = self.0.forward(q.clone(), k.clone(), v.clone());
        (o.clone(), Some([q, k, v, o, lse]))
    }

    fn backward(
        &self,
        [q, k, v, o, lse]: AttentionSaved<B>,
        d_o: FloatTensor<B>,
    ) -> [FloatTensor<B>; 3] {
        let (dq, dk, dv) = self.0.backward(q, k, v, o, lse, d_o);
        [dq, dk, dv]
    }
}

/// An attention op's output on an autodiff backend (see [`differentiable`]).
pub fn differentiable_attention<B: Backend, C: CheckpointStrategy, K: AttentionKernels<B>>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    kernels: K,
) -> FloatTensor<Autodiff<B, C>> {
    differentiable::<B, C, _, 3>([q, k, v], Attention(kernels))
}

/// A collective on backend `B` whose backward is itself with another argument; the
/// implementor is its non-tensor argument (group, direction).
pub trait Transposable<B: Backend>: Clone + Send + std::fmt::Debug + 'static {
    /// The collective on `x`.
    fn apply(&self, x: FloatTensor<B>) -> FloatTensor<B>;
    /// The argument of the collective that carries the gradient back.
    fn transposed(&self) -> Self;
}

/// A transposable collective as a [`HandBackward`] op: it saves nothing.
#[derive(Debug, Clone)]
struct Transposed<P>(P);

impl<B: Backend, P: Transposable<B>> HandBackward<B, 1> for Transposed<P> {
    type Saved = ();

    fn forward(&self, [x]: [FloatTensor<B>; 1], save: bool) -> (FloatTensor<B>, Option<()>) {
        (self.0.apply(x), save.then_some(()))
    }

    fn backward(&self, _: (), grad: FloatTensor<B>) -> [FloatTensor<B>; 1] {
        [self.0.transposed().apply(grad)]
    }
}

/// A collective's output on an autodiff backend (see [`differentiable`]).
pub fn differentiable_collective<B: Backend, C: CheckpointStrategy, P: Transposable<B>>(
    x: FloatTensor<Autodiff<B, C>>,
    params: P,
) -> FloatTensor<Autodiff<B, C>> {
    differentiable::<B, C, _, 1>([x], Transposed(params))
}
