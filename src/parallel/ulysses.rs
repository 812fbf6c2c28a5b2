//! Ulysses sequence parallelism (docs/ARCHITECTURE.md §5): before attention one all-to-all turns
//! Q, K and V together from sequence-sharded `[b, H, s/P, d]` into head-sharded `[b, H/P, s, d]`
//! (rank r gets heads `[r·H/P, (r+1)·H/P)` over the whole sequence, chunks in source-rank order);
//! after attention the inverse all-to-all restores `[b, H, s/P, d]`. Each exchange is a
//! differentiable op whose backward is the exchange in the other direction.
//!
//! Head counts P does not divide: Q, K, V get empty heads (zeros, ALiBi slope 0) up to the next
//! multiple of P before the exchange, and the output's padding heads are dropped after it. An
//! empty head attends uniformly to zero values, so it outputs zeros and passes no gradient; the
//! cost is `(⌈H/P⌉·P − H)/H` more attention work (3 heads on SP 2: one empty head, +33%).
//!
//! The group's `SequenceParallel` (in `ulysses_overlap.rs`) runs these blocking exchanges, or,
//! where the group has a communication thread, overlaps them with the MLP.
//!
//! The exchange goes through the [`Communicator`]'s tensor all-to-all (host buffers for threads
//! and MPI, device memory for NCCL on CUDA); a communication failure inside
//! the op panics with the communicator's message (an op cannot return an error), and the rank
//! runner turns that panic into this rank's error and aborts the others.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;

use crate::model::attention::LocalAttention;
use crate::ops::attention::options::AttnOptions;
use crate::ops::autodiff::{differentiable_collective as differentiable, Transposable};
use crate::parallel::comm::Communicator;

/// The SP group of one rank, shared by every layer's exchanges.
#[derive(Debug, Clone)]
pub struct SpGroup {
    pub comm: Arc<dyn Communicator>,
    /// Elements this rank passed to forward all-to-alls (q, k, v and the output), all layers.
    pub sent_forward: Arc<AtomicU64>,
    /// With learned positions split over SP: the first table row of this rank's shard (see
    /// `parallel::parallelize::position_rows`); `None` when every rank holds the whole table.
    pub pos_shard: Option<usize>,
}

impl SpGroup {
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            sent_forward: Arc::new(AtomicU64::new(0)),
            pos_shard: None,
        }
    }
}

/// Which way an exchange goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// `[b, H, s/P, d]` → `[b, H/P, s, d]`.
    SeqToHeads,
    /// `[b, H/P, s, d]` → `[b, H, s/P, d]`.
    HeadsToSeq,
}

impl Direction {
    pub fn reverse(self) -> Self {
        match self {
            Direction::SeqToHeads => Direction::HeadsToSeq,
            Direction::HeadsToSeq => Direction::SeqToHeads,
        }
    }
}

/// The op's non-tensor argument.
#[derive(Debug, Clone)]
pub struct ExchangeParams {
    pub group: SpGroup,
    pub direction: Direction,
    /// Count the elements sent (forward exchanges only).
    pub count: bool,
}

#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait UlyssesOps: Backend {
    /// The all-to-all of one 4-D tensor in `params.direction`.
    fn ulysses_exchange(x: FloatTensor<Self>, params: ExchangeParams) -> FloatTensor<Self>;
}

/// The exchange on a concrete backend (CPU; CUDA and wgpu through the communicator's tensor
/// collectives).
macro_rules! exchange_for {
    ($backend:ty) => {
        impl UlyssesOps for $backend {
            fn ulysses_exchange(x: FloatTensor<Self>, params: ExchangeParams) -> FloatTensor<Self> {
                let x = Tensor::<4>::from_primitive::<Self>(x);
                exchange(x, &params)
                    .try_into_primitive::<Self>()
                    .expect("ulysses: the result left the backend of its input")
            }
        }
    };
}

exchange_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
exchange_for!(burn::backend::Cube);

impl<B: Backend + UlyssesOps> Transposable<B> for ExchangeParams {
    fn apply(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        B::ulysses_exchange(x, self.clone())
    }

    /// The exchange the other way, uncounted (only forward traffic is logged).
    fn transposed(&self) -> Self {
        Self {
            direction: self.direction.reverse(),
            count: false,
            ..self.clone()
        }
    }
}

impl<B: Backend + UlyssesOps, C: CheckpointStrategy> UlyssesOps for Autodiff<B, C> {
    fn ulysses_exchange(x: FloatTensor<Self>, params: ExchangeParams) -> FloatTensor<Self> {
        differentiable::<B, C, _>(x, params)
    }
}

/// What an exchange of `x` sends to each rank (split along one dim; counted when the params
/// say so) and the dim the received pieces join along.
pub(crate) fn exchange_parts(x: Tensor<4>, params: &ExchangeParams) -> (Vec<Tensor<4>>, usize) {
    let p = params.group.comm.size();
    let (split_dim, cat_dim) = match params.direction {
        Direction::SeqToHeads => (1, 2),
        Direction::HeadsToSeq => (2, 1),
    };
    let part = x.dims()[split_dim] / p;
    let send: Vec<Tensor<4>> = (0..p)
        .map(|j| x.clone().narrow(split_dim, j * part, part))
        .collect();
    if params.count {
        let n: usize = send.iter().map(|t| t.shape().num_elements()).sum();
        params
            .group
            .sent_forward
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    (send, cat_dim)
}

/// The exchange on plain tensors: split along one dim, all-to-all, concatenate along the other.
fn exchange(x: Tensor<4>, params: &ExchangeParams) -> Tensor<4> {
    let (send, cat_dim) = exchange_parts(x, params);
    // Host buffers for threads and MPI; device memory for NCCL on CUDA tensors.
    let parts = params
        .group
        .comm
        .all_to_all_tensors(send)
        .unwrap_or_else(|e| panic!("sequence-parallel exchange failed: {e}"));
    Tensor::cat(parts, cat_dim)
}

fn exchange_op(x: Tensor<4>, group: &SpGroup, direction: Direction) -> Tensor<4> {
    let params = ExchangeParams {
        group: group.clone(),
        direction,
        count: true,
    };
    Tensor::from_dispatch(<Dispatch as UlyssesOps>::ulysses_exchange(
        x.into_dispatch(),
        params,
    ))
}

/// Attention over this rank's sequence shard: q, k, v `[b, H, s/P, d]` (rotary already applied
/// at global positions) → `[b, H, s/P, d]`. `opts.alibi` holds the slopes of all H heads; this
/// rank uses those of its head group.
pub fn ulysses_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    group: &SpGroup,
    attend: LocalAttention<'_>,
) -> Tensor<4> {
    let p = group.comm.size();
    let heads = q.dims()[1];
    let hp = heads.div_ceil(p);
    let r = group.comm.rank();
    let (q, k, v) = scatter_qkv(q, k, v, hp, group);
    let local = head_group_options(opts, r, hp, p, (q.dims()[2], k.dims()[2]));
    let o = exchange_op(attend(q, k, v, &local), group, Direction::HeadsToSeq);
    drop_padding_heads(o, heads)
}

/// The attention options of rank `r`'s group of `hp` heads over the whole sequence (`lens`:
/// the gathered query and key lengths), from the sequence shard's `opts` on `p` ranks.
pub(crate) fn head_group_options(
    opts: &AttnOptions,
    r: usize,
    hp: usize,
    p: usize,
    (q_len, k_len): (usize, usize),
) -> AttnOptions {
    AttnOptions {
        causal: opts.causal,
        alibi: opts.alibi.as_ref().map(|s| {
            (r * hp..(r + 1) * hp)
                .map(|h| s.get(h).copied().unwrap_or(0.0))
                .collect()
        }),
        // The whole sequence is present now: global positions start at the shard group's base.
        // (Inside a CP ring the tokens are two chunks and the ring reads its own positions;
        // saturating keeps this harmless there.)
        q_offset: opts.q_offset.saturating_sub(r * q_len / p),
        k_offset: opts.k_offset.saturating_sub(r * k_len / p),
    }
}

/// `o: [b, H', s, d]` without the empty heads padded up to `H'` (the first `heads` kept).
pub(crate) fn drop_padding_heads(o: Tensor<4>, heads: usize) -> Tensor<4> {
    if o.dims()[1] == heads {
        o
    } else {
        o.narrow(1, 0, heads)
    }
}

/// q, k, v `[b, H, s/P, d]` padded to `hp·P` heads and scattered in one exchange: the message
/// to rank j holds its `hp` heads of q, then of k, then of v. One round of messages instead of
/// three, forward and (the exchange's transpose) backward: on a link where latency dominates,
/// the round is the cost; the bytes are the same.
fn scatter_qkv(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    hp: usize,
    group: &SpGroup,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let p = group.comm.size();
    if k.dims() != q.dims() || v.dims() != q.dims() {
        // Shapes that do not stack (a value head size of its own): one exchange each.
        let scatter = |x| exchange_op(pad_heads(x, hp * p), group, Direction::SeqToHeads);
        return (scatter(q), scatter(k), scatter(v));
    }
    let all = exchange_op(fuse_qkv(q, k, v, hp, p), group, Direction::SeqToHeads);
    unfuse_qkv(all, hp)
}

/// q, k, v (same shapes) `[b, H, s, d]` as one `[b, 3·hp·p, s, d]` tensor whose `p` head
/// groups along dim 1 each hold one rank's `hp` heads of q, then of k, then of v (padded).
pub(crate) fn fuse_qkv(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, hp: usize, p: usize) -> Tensor<4> {
    let [b, _, s, d] = q.dims();
    let by_rank = |x: Tensor<4>| pad_heads(x, hp * p).reshape([b, p, hp, s, d]);
    let fused = Tensor::cat(vec![by_rank(q), by_rank(k), by_rank(v)], 2);
    fused.reshape([b, 3 * hp * p, s, d])
}

/// A rank's `[b, 3·hp, s, d]` after the fused exchange as its q, k and v heads.
pub(crate) fn unfuse_qkv(all: Tensor<4>, hp: usize) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    (
        all.clone().narrow(1, 0, hp),
        all.clone().narrow(1, hp, hp),
        all.narrow(1, 2 * hp, hp),
    )
}

/// `x: [b, H, s, d]` with empty heads appended up to `to` heads.
fn pad_heads(x: Tensor<4>, to: usize) -> Tensor<4> {
    let [b, h, s, d] = x.dims();
    if h == to {
        return x;
    }
    let zeros = Tensor::zeros([b, to - h, s, d], (&x.device(), x.dtype()));
    Tensor::cat(vec![x, zeros], 1)
}
