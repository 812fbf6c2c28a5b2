//! Ring attention beside the MLP (issue 42). GPT-NeoX's parallel residual,
//! `x + attn(ln1(x)) + mlp(ln2(x))`, makes the MLP independent of attention, so the MLP's rows,
//! cut in n + 1 parts on a ring of n ranks, are computed between the ring's steps: parts run
//! while the blocks travel, forward and backward. Without them a pass hides only the attention
//! of the block before it, which at 512 tokens a rank is shorter than a message behind a slow
//! link.
//!
//! The ring becomes three kinds of autodiff op with the parts between them, sharing one
//! [`RingBeside`]:
//! - `ring_begin(q, k, v)` starts this rank's block round the ring both ways
//!   (`parallel::ring_passes`), scores it (`RingForward::begin`) and returns a one-element
//!   token;
//! - `ring_step(token, after)`, n of them, each once `after` (the part before it) exists: the
//!   first n − 1 take the next block (waiting only where it has not arrived) and score it;
//!   the last has nothing left to score (its part is there for the backward);
//! - `ring_end(token, after)` merges the blocks' results: the attention output.
//!
//! Each part's input is tied to the token before it (`ulysses_overlap::tie`, the identity), so
//! burn's autodiff, which runs the backward deepest node first, runs the ops' backwards in
//! reverse with each part's backward between two of them: `ring_end`'s starts the ring's
//! backward (the first K/V pass, block 0's gradients); each `ring_step`'s takes the block's
//! arrived accumulators, adds this rank's share, sends them on with the next K/V (the last
//! step's: home) and computes the next block's gradients (`RingBackward::step`); `ring_begin`'s
//! waits for this rank's own block's gradients and returns them as q, k and v's. So each of
//! the backward's n + 1 messages and the forward's ⌈(n − 1)/2⌉ exchanges travels while parts
//! compute.
//! The tokens and the `after` inputs carry no gradient. Every rank builds the same graph, so
//! the passes pair up on every rank.
//!
//! The ring computes what `ring::ring_forward`/`ring_backward` compute (the same steps in the
//! same order). The MLP's weight gradients are gathered from the parts into the whole layer's
//! product (`ops::linear::linear_part`), but the biases' gradients and the input's still add
//! up part by part, so curves agree with `--no-overlap` within 1e-6, not bit for bit, as under
//! Ulysses.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{
    backend_extension, tensor::FloatTensor, Backend, Dispatch, DispatchKindConversion,
    DispatchTensor, Flex,
};
use burn::tensor::Tensor;

use crate::model::attention::{LocalAttention, SequenceParallel, SideWork};
use crate::ops::attention::options::AttnOptions;
use crate::ops::autodiff::{differentiable, HandBackward};
use crate::parallel::ring::{ring_attention, RingBackward, RingForward, RingGroup, RingParams};
use crate::parallel::ulysses_overlap::{after_zeros, tie, token_saved, TokenSaved};

/// One layer's ring between its ops: the forward in progress, what the backward needs from it,
/// and the backward in progress.
#[derive(Default)]
struct Run {
    forward: Option<RingForward>,
    /// q, k, v (from `ring_begin`), then o and lse (from `ring_end`).
    inputs: Option<[Tensor<4>; 3]>,
    output: Option<(Tensor<4>, Tensor<3>)>,
    backward: Option<RingBackward>,
}

/// The ring of one layer's attention, shared by its ops.
#[derive(Clone)]
pub struct RingBeside {
    params: RingParams,
    run: Arc<Mutex<Run>>,
}

impl std::fmt::Debug for RingBeside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RingBeside")
    }
}

impl RingBeside {
    fn run(&self) -> MutexGuard<'_, Run> {
        self.run.lock().unwrap_or_else(|p| p.into_inner())
    }
}

const ORDER: &str = "ring attention's ops run in graph order";

#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait RingOverlapOps: Backend {
    /// Starts the ring on this rank's `q, k, v: [b, h, 2·len, d]`; returns a one-element
    /// zero token for the ops that follow.
    fn ring_begin(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self>;
    /// The ring's next step, once `after` (the work it hid) exists; returns the token.
    fn ring_step(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self>;
    /// The ring's last step, once `after` exists: the attention output `[b, h, 2·len, d]`.
    fn ring_end(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self>;
}

macro_rules! ring_overlap_for {
    ($backend:ty) => {
        impl RingOverlapOps for $backend {
            fn ring_begin(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                op: RingBeside,
            ) -> FloatTensor<Self> {
                let [q, k, v] = [q, k, v].map(|x| Tensor::<4>::from_primitive::<Self>(x));
                let token = Tensor::<1>::zeros([1], (&q.device(), q.dtype()));
                let forward = RingForward::begin(q.clone(), k.clone(), v.clone(), &op.params);
                let mut run = op.run();
                run.forward = Some(forward);
                run.inputs = Some([q, k, v]);
                token
                    .try_into_primitive::<Self>()
                    .expect("ring: the token left the backend of its input")
            }

            fn ring_step(
                token: FloatTensor<Self>,
                _after: FloatTensor<Self>,
                op: RingBeside,
            ) -> FloatTensor<Self> {
                op.run().forward.as_mut().expect(ORDER).step();
                token
            }

            fn ring_end(
                _token: FloatTensor<Self>,
                _after: FloatTensor<Self>,
                op: RingBeside,
            ) -> FloatTensor<Self> {
                let mut run = op.run();
                let (o, lse) = run.forward.take().expect(ORDER).finish();
                run.output = Some((o.clone(), lse));
                o.try_into_primitive::<Self>()
                    .expect("ring: the output left the backend of its input")
            }
        }
    };
}

ring_overlap_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
ring_overlap_for!(burn::backend::Cube);

/// `ring_begin` as an autodiff op: its backward finishes the ring's backward and gives q, k
/// and v their gradients.
#[derive(Debug, Clone)]
struct BeginOp(RingBeside);

impl<B: RingOverlapOps> HandBackward<B, 3> for BeginOp
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type Saved = ();

    fn forward(&self, [q, k, v]: [FloatTensor<B>; 3], save: bool) -> (FloatTensor<B>, Option<()>) {
        (B::ring_begin(q, k, v, self.0.clone()), save.then_some(()))
    }

    fn backward(&self, _: (), _token_grad: FloatTensor<B>) -> [FloatTensor<B>; 3] {
        let backward = std::mem::take(&mut *self.0.run()).backward;
        let (dq, dk, dv) = backward.expect(ORDER).finish();
        [dq, dk, dv].map(|g| {
            g.try_into_primitive::<B>()
                .expect("ring: the gradient left the backend of its input")
        })
    }
}

/// `ring_step` (`last`: `ring_end`) as an autodiff op. The step's backward computes the next
/// block's gradients; the end's starts the ring's backward from the output's gradient. Both
/// hand the token a zero gradient, so that the op before them runs its backward; `after` gets
/// none.
#[derive(Debug, Clone)]
struct StepOp {
    op: RingBeside,
    last: bool,
}

impl<B: RingOverlapOps> HandBackward<B, 2> for StepOp
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type Saved = TokenSaved<B>;

    fn forward(
        &self,
        [token, after]: [FloatTensor<B>; 2],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        let saved = save.then(|| token_saved::<B>(&token, &after));
        let out = match self.last {
            false => B::ring_step(token, after, self.op.clone()),
            true => B::ring_end(token, after, self.op.clone()),
        };
        (out, saved)
    }

    /// Every input's gradient: `after`'s is zeros (autodiff asks only for the token's, see
    /// [`HandBackward::backward_needed`]).
    fn backward(&self, saved: Self::Saved, grad: FloatTensor<B>) -> [FloatTensor<B>; 2] {
        let zeros = after_zeros::<B>(&saved);
        let [token_grad, _] = self.backward_needed(saved, grad, [true, false]);
        [token_grad.expect("asked for"), zeros]
    }

    fn backward_needed(
        &self,
        (token, _): Self::Saved,
        grad: FloatTensor<B>,
        [need_token, _]: [bool; 2],
    ) -> [Option<FloatTensor<B>>; 2] {
        let mut run = self.op.run();
        if self.last {
            let d_o = Tensor::<4>::from_primitive::<B>(grad);
            let [q, k, v] = run.inputs.take().expect(ORDER);
            let (o, lse) = run.output.take().expect(ORDER);
            run.backward = Some(RingBackward::begin([q, k, v, o, d_o], lse, &self.op.params));
        } else {
            run.backward.as_mut().expect(ORDER).step();
        }
        [need_token.then_some(token), None]
    }
}

impl<B: RingOverlapOps, C: CheckpointStrategy> RingOverlapOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn ring_begin(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _, 3>([q, k, v], BeginOp(op))
    }

    fn ring_step(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _, 2>([token, after], StepOp { op, last: false })
    }

    fn ring_end(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: RingBeside,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _, 2>([token, after], StepOp { op, last: true })
    }
}

/// Ring attention over this rank's two zigzag chunks (as `ring::ring_attention`) with the
/// n + 1 parts of `side` computed between its ops (see the module's comment); returns the
/// output and the parts' results in order.
pub fn attention_beside(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    group: &RingGroup,
    side: &mut SideWork<'_>,
) -> (Tensor<4>, Vec<Tensor<3>>) {
    let parts = group.comm.size() + 1;
    let op = RingBeside {
        params: RingParams::new(group, opts),
        run: Arc::default(),
    };
    let mut token = Tensor::<1>::from_dispatch(<Dispatch as RingOverlapOps>::ring_begin(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        op.clone(),
    ));
    let mut done = Vec::with_capacity(parts);
    for j in 0..parts - 1 {
        let part = side(j, parts, &|x| tie(x, &token));
        token = Tensor::from_dispatch(<Dispatch as RingOverlapOps>::ring_step(
            token.into_dispatch(),
            part.clone().into_dispatch(),
            op.clone(),
        ));
        done.push(part);
    }
    let part = side(parts - 1, parts, &|x| tie(x, &token));
    let o = <Dispatch as RingOverlapOps>::ring_end(
        token.into_dispatch(),
        part.clone().into_dispatch(),
        op,
    );
    done.push(part);
    (Tensor::from_dispatch(o), done)
}

/// The model's [`SequenceParallel`] for a CP ring: the blocking ring of `ring.rs`, or, where the
/// group has a communication thread, the ring beside side work (above).
impl SequenceParallel for RingGroup {
    /// Ring attention over this rank's two zigzag chunks; positions come from the ring's own
    /// layout, so `opts`' offsets are not read and `local` is not used (the ring runs the
    /// FlashAttention op itself, which its merge needs).
    fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        _local: LocalAttention<'_>,
    ) -> Tensor<4> {
        ring_attention(q, k, v, opts, self)
    }

    fn elements_sent(&self) -> u64 {
        self.sent_forward.load(Ordering::Relaxed)
    }

    /// With a communication thread, the ring's steps have the MLP's parts between them
    /// (`parallel::ring_overlap`).
    fn hides_work(&self) -> bool {
        self.comm.runs_jobs_apart() && self.comm.size() > 1
    }

    fn attention_beside(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        _local: LocalAttention<'_>,
        side: &mut SideWork<'_>,
    ) -> (Tensor<4>, Vec<Tensor<3>>) {
        attention_beside(q, k, v, opts, self, side)
    }
}
