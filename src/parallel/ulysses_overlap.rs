//! Ulysses' all-to-alls overlapped with the MLP (issue 42). GPT-NeoX's parallel residual,
//! `x + attn(ln1(x)) + mlp(ln2(x))`, makes the MLP independent of attention, so each of a
//! layer's two exchanges (Q, K, V to head-sharded before attention; the output back after it)
//! is started, half of the MLP computed while it travels, and only then waited for.
//!
//! An exchange is two autodiff ops around that work:
//! - [`UlyssesOverlapOps::ulysses_start`] starts it on the group's communication thread
//!   (`parallel::progress`) and returns a one-element token;
//! - the work's input is tied to the token ([`UlyssesOverlapOps::ulysses_tie`], the identity),
//!   and [`UlyssesOverlapOps::ulysses_finish`] takes the token and the work's output and waits
//!   for the exchange.
//!
//! Why the ties: burn's autodiff runs the backward by depth in the graph, deepest first. The tie
//! puts the work above the start and below the finish, so the backward runs the finish (which
//! starts the gradient's exchange the other way), then the work's backward, then the start's
//! (which waits for that exchange): the backward overlaps as the forward does. Neither the
//! token nor the finish's `after` input carries a gradient. Every rank builds the same graph,
//! so the exchanges run in the same order on every rank.
//!
//! Where the group has no communication thread (`--no-overlap`, NCCL) [`start`] runs the
//! exchange at once: the same values, blocking.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{
    backend_extension, tensor::FloatTensor, Backend, Dispatch, DispatchKindConversion,
    DispatchTensor, Flex,
};
use burn::tensor::Tensor;

use crate::model::attention::{LocalAttention, SequenceParallel, SideWork};
use crate::ops::attention::options::AttnOptions;
use crate::ops::autodiff::{differentiable, HandBackward};
use crate::parallel::progress::{start, Pending};
use crate::parallel::ulysses::{
    drop_padding_heads, exchange_parts, fuse_qkv, head_group_options, ulysses_attention,
    unfuse_qkv, Direction, ExchangeParams, SpGroup,
};

/// An exchange started and not yet waited for: its pieces from every rank and the dimension
/// they join along.
type Started = (Pending<Vec<Tensor<4>>>, usize);

/// Where a started exchange waits for the op that finishes it.
#[derive(Clone, Default)]
pub struct Slot(Arc<Mutex<Option<Started>>>);

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Slot")
    }
}

impl Slot {
    fn put(&self, started: Started) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(started);
    }

    /// The exchange's result (the op cannot return an error: a failed exchange ends the rank,
    /// whose peers then stop with its message).
    fn wait(&self) -> Tensor<4> {
        let started = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (pending, cat_dim) =
            started.expect("a Ulysses exchange is finished after it was started");
        let parts = pending
            .wait()
            .unwrap_or_else(|e| panic!("sequence-parallel exchange failed: {e}"));
        Tensor::cat(parts, cat_dim)
    }
}

/// One overlapped exchange: which way it goes, and where its forward and its gradient's
/// exchanges wait between the ops.
#[derive(Debug, Clone)]
pub struct Overlapped {
    pub exchange: ExchangeParams,
    forward: Slot,
    backward: Slot,
}

impl Overlapped {
    pub fn new(exchange: ExchangeParams) -> Self {
        Self {
            exchange,
            forward: Slot::default(),
            backward: Slot::default(),
        }
    }
}

/// Starts the exchange of `x` with `params` into `slot`.
fn start_into(x: Tensor<4>, params: &ExchangeParams, slot: &Slot) {
    let (send, cat_dim) = exchange_parts(x, params);
    let pending = start(params.group.comm.as_ref(), move |c| {
        c.all_to_all_tensors(send)
    });
    slot.put((pending, cat_dim));
}

#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait UlyssesOverlapOps: Backend {
    /// Starts the exchange of `x: [b, h, s, d]` (its result waits in `op`); returns a
    /// one-element zero token for the ops that follow it.
    fn ulysses_start(x: FloatTensor<Self>, op: Overlapped) -> FloatTensor<Self>;
    /// `x`, made to depend on `token` (its gradient passes through; the token gets none).
    fn ulysses_tie(x: FloatTensor<Self>, token: FloatTensor<Self>) -> FloatTensor<Self>;
    /// The exchange started with `token`, waited for once `after` (the work it hides) exists.
    fn ulysses_finish(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: Overlapped,
    ) -> FloatTensor<Self>;
}

macro_rules! overlap_for {
    ($backend:ty) => {
        impl UlyssesOverlapOps for $backend {
            fn ulysses_start(x: FloatTensor<Self>, op: Overlapped) -> FloatTensor<Self> {
                let x = Tensor::<4>::from_primitive::<Self>(x);
                let token = Tensor::<1>::zeros([1], (&x.device(), x.dtype()));
                start_into(x, &op.exchange, &op.forward);
                token
                    .try_into_primitive::<Self>()
                    .expect("ulysses: the token left the backend of its input")
            }

            fn ulysses_tie(x: FloatTensor<Self>, _token: FloatTensor<Self>) -> FloatTensor<Self> {
                x
            }

            fn ulysses_finish(
                _token: FloatTensor<Self>,
                _after: FloatTensor<Self>,
                op: Overlapped,
            ) -> FloatTensor<Self> {
                op.forward
                    .wait()
                    .try_into_primitive::<Self>()
                    .expect("ulysses: the result left the backend of its input")
            }
        }
    };
}

overlap_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
overlap_for!(burn::backend::Cube);

/// The start as an autodiff op: its backward waits for the gradient's exchange, which the
/// finish's backward started.
#[derive(Debug, Clone)]
struct StartOp(Overlapped);

impl<B: UlyssesOverlapOps> HandBackward<B, 1> for StartOp
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type Saved = ();

    fn forward(&self, [x]: [FloatTensor<B>; 1], save: bool) -> (FloatTensor<B>, Option<()>) {
        (B::ulysses_start(x, self.0.clone()), save.then_some(()))
    }

    fn backward(&self, _: (), _token_grad: FloatTensor<B>) -> [FloatTensor<B>; 1] {
        let dx = self.0.backward.wait();
        [dx.try_into_primitive::<B>()
            .expect("ulysses: the gradient left the backend of its input")]
    }
}

/// The tie as an autodiff op: the identity on `x`; the token gets no gradient.
#[derive(Debug, Clone)]
struct TieOp;

impl<B: UlyssesOverlapOps> HandBackward<B, 2> for TieOp
where
    DispatchTensor: DispatchKindConversion<B>,
{
    /// The token (zero), which is also its own gradient.
    type Saved = FloatTensor<B>;

    fn forward(
        &self,
        [x, token]: [FloatTensor<B>; 2],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        let saved = save.then(|| token.clone());
        (B::ulysses_tie(x, token), saved)
    }

    fn backward(&self, token: Self::Saved, grad: FloatTensor<B>) -> [FloatTensor<B>; 2] {
        [grad, token]
    }

    fn backward_needed(
        &self,
        _: Self::Saved,
        grad: FloatTensor<B>,
        [need_x, _]: [bool; 2],
    ) -> [Option<FloatTensor<B>>; 2] {
        [need_x.then_some(grad), None]
    }
}

/// What an op over `(token, after)` saves (the finish here, the ring's steps in
/// `ring_overlap`): the token (zero, its own gradient) and `after`'s shape.
pub(crate) type TokenSaved<B> = (FloatTensor<B>, [usize; 3]);

pub(crate) fn token_saved<B: Backend>(
    token: &FloatTensor<B>,
    after: &FloatTensor<B>,
) -> TokenSaved<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let dims = Tensor::<3>::from_primitive::<B>(after.clone()).dims();
    (token.clone(), dims)
}

/// `after`'s gradient when one is asked for all inputs: zeros (it carries none).
pub(crate) fn after_zeros<B: Backend>((token, dims): &TokenSaved<B>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let t = Tensor::<1>::from_primitive::<B>(token.clone());
    Tensor::<3>::zeros(*dims, (&t.device(), t.dtype()))
        .try_into_primitive::<B>()
        .expect("zeros on the backend of their input")
}

/// The finish as an autodiff op: its backward starts the gradient's exchange the other way
/// (waited for by the start's backward) and hands the token a zero gradient, so that the
/// start's backward runs; `after` gets none.
#[derive(Debug, Clone)]
struct FinishOp(Overlapped);

impl<B: UlyssesOverlapOps> HandBackward<B, 2> for FinishOp
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
        (B::ulysses_finish(token, after, self.0.clone()), saved)
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
        let grad = Tensor::<4>::from_primitive::<B>(grad);
        let back = ExchangeParams {
            direction: self.0.exchange.direction.reverse(),
            count: false,
            ..self.0.exchange.clone()
        };
        start_into(grad, &back, &self.0.backward);
        [need_token.then_some(token), None]
    }
}

impl<B: UlyssesOverlapOps, C: CheckpointStrategy> UlyssesOverlapOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn ulysses_start(x: FloatTensor<Self>, op: Overlapped) -> FloatTensor<Self> {
        differentiable::<B, C, _, 1>([x], StartOp(op))
    }

    fn ulysses_tie(x: FloatTensor<Self>, token: FloatTensor<Self>) -> FloatTensor<Self> {
        differentiable::<B, C, _, 2>([x, token], TieOp)
    }

    fn ulysses_finish(
        token: FloatTensor<Self>,
        after: FloatTensor<Self>,
        op: Overlapped,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _, 2>([token, after], FinishOp(op))
    }
}

/// Starts the exchange of `x`; the token the other two calls take.
pub fn start_exchange(x: Tensor<4>, op: &Overlapped) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as UlyssesOverlapOps>::ulysses_start(
        x.into_dispatch(),
        op.clone(),
    ))
}

/// `x` tied to the exchange in flight (see the module's comment).
pub fn tie(x: Tensor<3>, token: &Tensor<1>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as UlyssesOverlapOps>::ulysses_tie(
        x.into_dispatch(),
        token.clone().into_dispatch(),
    ))
}

/// The exchange's result, after `after` (the work it hid).
pub fn finish_exchange(token: Tensor<1>, after: &Tensor<3>, op: &Overlapped) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as UlyssesOverlapOps>::ulysses_finish(
        token.into_dispatch(),
        after.clone().into_dispatch(),
        op.clone(),
    ))
}

/// Ulysses attention (as `ulysses::ulysses_attention`, Q, K and V in one exchange) with part 0
/// of `side` computed while Q, K and V travel and part 1 while the output travels back; q, k,
/// v of the same shape `[b, H, s/P, d]`.
pub fn attention_beside(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    group: &SpGroup,
    attend: LocalAttention<'_>,
    side: &mut SideWork<'_>,
) -> (Tensor<4>, Vec<Tensor<3>>) {
    let p = group.comm.size();
    let heads = q.dims()[1];
    let hp = heads.div_ceil(p);
    let exchange = |direction| {
        Overlapped::new(ExchangeParams {
            group: group.clone(),
            direction,
            count: true,
        })
    };
    let scatter = exchange(Direction::SeqToHeads);
    let token = start_exchange(fuse_qkv(q, k, v, hp, p), &scatter);
    let first = side(0, 2, &|x| tie(x, &token));
    let (q, k, v) = unfuse_qkv(finish_exchange(token, &first, &scatter), hp);
    let local = head_group_options(opts, group.comm.rank(), hp, p, (q.dims()[2], k.dims()[2]));
    let gather = exchange(Direction::HeadsToSeq);
    let token = start_exchange(attend(q, k, v, &local), &gather);
    let second = side(1, 2, &|x| tie(x, &token));
    let o = finish_exchange(token, &second, &gather);
    (drop_padding_heads(o, heads), vec![first, second])
}

/// The model's [`SequenceParallel`] for a Ulysses group: the blocking exchanges of `ulysses.rs`,
/// or, where the group has a communication thread, attention beside side work (above).
impl SequenceParallel for SpGroup {
    fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        local: LocalAttention<'_>,
    ) -> Tensor<4> {
        ulysses_attention(q, k, v, opts, self, local)
    }

    fn position_shard(&self) -> Option<usize> {
        self.pos_shard
    }

    fn elements_sent(&self) -> u64 {
        self.sent_forward.load(Ordering::Relaxed)
    }

    fn hides_work(&self) -> bool {
        self.comm.runs_jobs_apart()
    }

    fn attention_beside(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        local: LocalAttention<'_>,
        side: &mut SideWork<'_>,
    ) -> (Tensor<4>, Vec<Tensor<3>>) {
        if k.dims() != q.dims() || v.dims() != q.dims() {
            let o = ulysses_attention(q, k, v, opts, self, local);
            return (o, vec![side(0, 1, &|x| x)]);
        }
        attention_beside(q, k, v, opts, self, local, side)
    }
}
