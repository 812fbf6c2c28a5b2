//! Context parallelism: ring attention over the CP group (docs/ARCHITECTURE.md §5).
//!
//! Each CP rank c holds two chunks of every sequence, c and 2C−1−c of 2C equal chunks
//! ([`crate::parallel::Topology::spans`]): under a causal mask chunk k attends to chunks ≤ k,
//! so the pair gives every rank the same work. Attention runs in C steps: at each a rank holds
//! the K/V block of one rank (in the backward, at step t that of rank (c − t) mod C),
//! computes FlashAttention of each of its query chunks against each key chunk that is not
//! entirely in the future (global positions as offsets, so
//! ALiBi and causality are exact), and merges the partial results with their log-sum-exps
//! (online softmax across blocks). In the forward the blocks travel both ways round the ring
//! (`parallel::ring_passes`): the blocks of the ranks d behind and d ahead arrive after d
//! exchanges, all of them after ⌈(C − 1)/2⌉, where one way took C − 1.
//!
//! The backward walks the same ring: each block travels with its dK/dV accumulators, every rank
//! adds its queries' contribution (FlashAttention-2's backward with the final output and
//! log-sum-exp, so the merge needs no gradient of its own), and one last step brings each
//! block's gradients home. dQ stays local.
//!
//! Double buffering (issue 42): the forward's exchanges run on the CP group's communication
//! thread (`parallel::progress`), each started ahead and handing on what the one before it
//! brought as soon as it arrives, while attention computes. In the backward each block's pass
//! to the next rank is started before the rank computes with it and waited for after; a
//! step's dK/dV accumulators, which the step adds to, leave once it is done, in one message
//! with the K/V block the neighbour uses a step later (see [`RingBackward`]). Forward and
//! backward are step machines ([`RingForward`], [`RingBackward`]): the op here runs their steps
//! back to back; `parallel::ring_overlap` puts parts of the MLP between them. Without a
//! communication thread (`--no-overlap`, NCCL) the same passes run in the same order, blocking:
//! the same numbers either way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;

use crate::model::attention::{LocalAttention, SequenceParallel};
use crate::ops::attention::flash::{
    flash_attention_backward, flash_attention_forward, DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q,
};
use crate::ops::attention::options::AttnOptions;
use crate::ops::autodiff::{differentiable_attention as differentiable, AttentionKernels};
use crate::ops::primitive::Primitive;
use crate::parallel::comm::Communicator;
use crate::parallel::progress::{start, Pending};
use crate::parallel::ring_passes::BlockPasses;
use crate::parallel::ulysses::{ulysses_attention, SpGroup};

/// The CP ring of one rank, shared by every layer.
#[derive(Debug, Clone)]
pub struct RingGroup {
    pub comm: Arc<dyn Communicator>,
    /// Elements this rank passed along the ring in forwards (all layers).
    pub sent_forward: Arc<AtomicU64>,
    /// Query–key pairs inside the causal mask this rank scored in forwards, summed over batch
    /// and heads (all layers): the attention work, equal across ranks under the zigzag.
    pub scored: Arc<AtomicU64>,
}

impl RingGroup {
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            sent_forward: Arc::new(AtomicU64::new(0)),
            scored: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// The op's non-tensor argument.
#[derive(Debug, Clone)]
pub struct RingParams {
    pub group: RingGroup,
    pub causal: bool,
    /// Per-head ALiBi slopes of the heads in this call.
    pub alibi: Option<Vec<f64>>,
}

impl RingParams {
    /// The ring of `group` for attention with `opts`' mask and ALiBi slopes (its offsets are
    /// the ring's own layout's).
    pub fn new(group: &RingGroup, opts: &AttnOptions) -> Self {
        Self {
            group: group.clone(),
            causal: opts.causal,
            alibi: opts.alibi.clone(),
        }
    }
}

/// The differentiable op, dispatched per backend.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait RingOps: Backend {
    /// This rank's attention output over the whole sequence.
    fn ring_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: RingParams,
    ) -> FloatTensor<Self>;
}

/// The ring's forward and backward on a concrete backend, through the tensor-level ring below;
/// autodiff reaches them through [`AttentionKernels`].
macro_rules! ring_for {
    ($backend:ty) => {
        impl AttentionKernels<$backend> for RingParams {
            fn forward(
                &self,
                q: FloatTensor<$backend>,
                k: FloatTensor<$backend>,
                v: FloatTensor<$backend>,
            ) -> (FloatTensor<$backend>, FloatTensor<$backend>) {
                let (o, lse) = ring_forward(
                    <$backend>::tensor(q),
                    <$backend>::tensor(k),
                    <$backend>::tensor(v),
                    self,
                );
                (<$backend>::prim(o), <$backend>::prim(lse))
            }

            fn backward(
                &self,
                q: FloatTensor<$backend>,
                k: FloatTensor<$backend>,
                v: FloatTensor<$backend>,
                o: FloatTensor<$backend>,
                lse: FloatTensor<$backend>,
                d_o: FloatTensor<$backend>,
            ) -> (
                FloatTensor<$backend>,
                FloatTensor<$backend>,
                FloatTensor<$backend>,
            ) {
                let (dq, dk, dv) = ring_backward(
                    <$backend>::tensor(q),
                    <$backend>::tensor(k),
                    <$backend>::tensor(v),
                    <$backend>::tensor(o),
                    <$backend>::tensor(lse),
                    <$backend>::tensor(d_o),
                    self,
                );
                (
                    <$backend>::prim(dq),
                    <$backend>::prim(dk),
                    <$backend>::prim(dv),
                )
            }
        }

        impl RingOps for $backend {
            fn ring_attention(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                params: RingParams,
            ) -> FloatTensor<Self> {
                <RingParams as AttentionKernels<$backend>>::forward(&params, q, k, v).0
            }
        }
    };
}

ring_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
ring_for!(burn::backend::Cube);

impl<B: Backend, C: CheckpointStrategy> RingOps for Autodiff<B, C>
where
    RingParams: AttentionKernels<B>,
{
    fn ring_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: RingParams,
    ) -> FloatTensor<Self> {
        // Every rank of the ring runs the backward (the same layers in the same order), so
        // its ring passes pair up.
        differentiable::<B, C, _>(q, k, v, params)
    }
}

// ---------------------------------------------------------------------------------------------
// The ring on plain tensors.

/// Global start of each of a rank's two chunks of length `len`.
fn chunk_starts(rank: usize, size: usize, len: usize) -> [usize; 2] {
    [rank * len, (2 * size - 1 - rank) * len]
}

/// The (query chunk, key chunk) pairs this rank scores when it holds the K/V block of rank
/// `src`, with both chunks' global positions in the options. Key chunks entirely in the future
/// are skipped (chunks have equal lengths, so a key chunk is entirely before, the same as, or
/// entirely after a query chunk).
fn step_pairs(p: &RingParams, src: usize, len: usize) -> Vec<(usize, usize, AttnOptions)> {
    let (c, n) = (p.group.comm.rank(), p.group.comm.size());
    let qs = chunk_starts(c, n, len);
    let ks = chunk_starts(src, n, len);
    let mut out = Vec::with_capacity(4);
    for (qi, &q_offset) in qs.iter().enumerate() {
        for (ki, &k_offset) in ks.iter().enumerate() {
            if !p.causal || k_offset <= q_offset {
                let opts = AttnOptions {
                    causal: p.causal,
                    alibi: p.alibi.clone(),
                    q_offset,
                    k_offset,
                };
                out.push((qi, ki, opts));
            }
        }
    }
    out
}

/// The two chunks of `x: [b, h, 2·len, d]` along the sequence.
fn halves(x: &Tensor<4>) -> [Tensor<4>; 2] {
    let len = x.dims()[2] / 2;
    [x.clone().narrow(2, 0, len), x.clone().narrow(2, len, len)]
}

/// Starts sending `parts` one step along the ring; the wait gives the neighbour's, same shapes.
fn start_pass(group: &RingGroup, parts: Vec<Tensor<4>>) -> Pending<Vec<Tensor<4>>> {
    start(group.comm.as_ref(), move |c| c.ring_pass_tensors(parts))
}

/// The neighbour's block of a started pass (the op cannot return an error: a failed pass ends
/// the rank, whose peers then stop with its message).
fn arrived(p: Pending<Vec<Tensor<4>>>) -> Vec<Tensor<4>> {
    p.wait()
        .unwrap_or_else(|e| panic!("context-parallel ring pass failed: {e}"))
}

/// Merges two partial attention results over disjoint keys by their log-sum-exps:
/// `lse = log(e^la + e^lb)`, `o = oa·e^(la − lse) + ob·e^(lb − lse)`.
fn merge(a: (Tensor<4>, Tensor<3>), b: (Tensor<4>, Tensor<3>)) -> (Tensor<4>, Tensor<3>) {
    let ((oa, la), (ob, lb)) = (a, b);
    let dims = oa.dims();
    let m = la.clone().max_pair(lb.clone());
    let lse = m.clone() + ((la.clone() - m.clone()).exp() + (lb.clone() - m).exp()).log();
    let weight = |l: Tensor<3>| (l - lse.clone()).exp().unsqueeze_dim::<4>(3).expand(dims);
    (oa * weight(la) + ob * weight(lb), lse)
}

/// The ring's forward in steps: [`RingForward::begin`] starts this rank's block round the
/// ring both ways (`parallel::ring_passes`) and scores it, each [`RingForward::step`] scores
/// the next block as it arrives, [`RingForward::finish`] scores what is left and merges.
/// [`ring_forward`] runs them back to back; `parallel::ring_overlap` puts work between them.
/// The blocks come in `ring_passes::block_order` and are merged in that order.
pub(crate) struct RingForward {
    p: RingParams,
    len: usize,
    qc: [Tensor<4>; 2],
    passes: BlockPasses,
    acc: [Option<(Tensor<4>, Tensor<3>)>; 2],
}

impl RingForward {
    pub(crate) fn begin(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, p: &RingParams) -> Self {
        let kv = vec![k, v];
        let passes = BlockPasses::start(
            p.group.comm.clone(),
            p.group.sent_forward.clone(),
            kv.clone(),
        );
        let mut f = Self {
            p: p.clone(),
            len: q.dims()[2] / 2,
            qc: halves(&q),
            passes,
            acc: [None, None],
        };
        f.score(p.group.comm.rank(), kv);
        f
    }

    /// Scores block `kv` of rank `src` against this rank's query chunks.
    fn score(&mut self, src: usize, kv: Vec<Tensor<4>>) {
        let len = self.len;
        let [b, h, _, _] = self.qc[0].dims();
        let (kc, vc) = (halves(&kv[0]), halves(&kv[1]));
        for (qi, ki, opts) in step_pairs(&self.p, src, len) {
            let pairs = if self.p.causal && opts.q_offset == opts.k_offset {
                len * (len + 1) / 2
            } else {
                len * len
            };
            self.p
                .group
                .scored
                .fetch_add((b * h * pairs) as u64, Ordering::Relaxed);
            let part = flash_attention_forward(
                self.qc[qi].clone(),
                kc[ki].clone(),
                vc[ki].clone(),
                &opts,
                DEFAULT_BLOCK_Q,
                DEFAULT_BLOCK_K,
            );
            self.acc[qi] = Some(match self.acc[qi].take() {
                None => part,
                Some(prev) => merge(prev, part),
            });
        }
    }

    /// Waits for the next block and scores it (nothing once the last block is scored).
    pub(crate) fn step(&mut self) {
        if let Some((src, kv)) = self.passes.next_block() {
            self.score(src, kv);
        }
    }

    /// `(o [b, h, 2·len, d], lse [b, h, 2·len])` once every block is scored.
    pub(crate) fn finish(mut self) -> (Tensor<4>, Tensor<3>) {
        while self.passes.pending() {
            self.step();
        }
        let [a0, a1] = self
            .acc
            .map(|a| a.expect("every query chunk sees at least its own chunk"));
        (
            Tensor::cat(vec![a0.0, a1.0], 2),
            Tensor::cat(vec![a0.1, a1.1], 2),
        )
    }
}

/// Forward of the ring: `(o [b, h, 2·len, d], lse [b, h, 2·len])`.
pub fn ring_forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    p: &RingParams,
) -> (Tensor<4>, Tensor<3>) {
    RingForward::begin(q, k, v, p).finish()
}

/// The ring's backward in steps, as [`RingForward`]. The travelling block is k and v and the
/// dK/dV accumulators of its two chunks, added to once this rank's gradients for the block
/// exist. One message per step carries both: after step t a rank sends the accumulators of
/// the block it used with the K/V of the block it uses next, which its neighbour needs a step
/// later still; only the first K/V pass travels alone. n + 1 messages where separate passes
/// took 2n − 1 (5 instead of 7 at 4 ranks: on a 20 ms link, 40 ms less per layer), and every
/// block still arrives a step before it is used.
pub(crate) struct RingBackward {
    p: RingParams,
    len: usize,
    qc: [Tensor<4>; 2],
    oc: [Tensor<4>; 2],
    doc: [Tensor<4>; 2],
    lc: [Tensor<3>; 2],
    dq: [Option<Tensor<4>>; 2],
    kv: Vec<Tensor<4>>,
    /// The first K/V pass, until it arrives.
    first: Option<Pending<Vec<Tensor<4>>>>,
    /// The held block's accumulators (and from step 1 on the next block's K/V), from the
    /// previous holder.
    incoming: Pending<Vec<Tensor<4>>>,
    /// This rank's gradients for the held block, not yet added to its accumulators.
    dkv: Vec<(usize, Tensor<4>, Tensor<4>)>,
    /// The ring step whose gradients were computed last.
    t: usize,
    /// Whether the last block's accumulators are on their way home.
    sent_home: bool,
}

impl RingBackward {
    pub(crate) fn begin([q, k, v, o, d_o]: [Tensor<4>; 5], lse: Tensor<3>, p: &RingParams) -> Self {
        let len = q.dims()[2] / 2;
        let [z0, z1] = halves(&k).map(|c| c.zeros_like());
        let kv = vec![k, v];
        let first = (p.group.comm.size() > 1).then(|| start_pass(&p.group, kv.clone()));
        let mut b = Self {
            p: p.clone(),
            len,
            qc: halves(&q),
            oc: halves(&o),
            doc: halves(&d_o),
            lc: [lse.clone().narrow(2, 0, len), lse.narrow(2, len, len)],
            dq: [None, None],
            kv,
            first,
            incoming: Pending::ready(Ok(vec![z0.clone(), z1.clone(), z0, z1])),
            dkv: Vec::new(),
            t: 0,
            sent_home: false,
        };
        b.grads();
        b
    }

    /// This rank's gradients for the held block: dQ added here, dK/dV kept for the block.
    fn grads(&mut self) {
        let (kc, vc) = (halves(&self.kv[0]), halves(&self.kv[1]));
        let (c, n) = (self.p.group.comm.rank(), self.p.group.comm.size());
        for (qi, ki, opts) in step_pairs(&self.p, (c + n - self.t) % n, self.len) {
            let (g_q, g_k, g_v) = flash_attention_backward(
                self.qc[qi].clone(),
                kc[ki].clone(),
                vc[ki].clone(),
                self.oc[qi].clone(),
                self.lc[qi].clone(),
                self.doc[qi].clone(),
                &opts,
                DEFAULT_BLOCK_Q,
                DEFAULT_BLOCK_K,
            );
            self.dq[qi] = Some(match self.dq[qi].take() {
                None => g_q,
                Some(d) => d + g_q,
            });
            self.dkv.push((ki, g_k, g_v));
        }
    }

    /// The block's accumulators arrive, take this rank's share in the same order as ever, and
    /// follow the block (after the last step: home to their owner), with the next block's K/V
    /// where the neighbour still needs it.
    fn close(&mut self) {
        let n = self.p.group.comm.size();
        let ready = Pending::ready(Ok(Vec::new()));
        let mut msg = arrived(std::mem::replace(&mut self.incoming, ready));
        let next_kv = match self.first.take() {
            Some(pass) => Some(arrived(pass)),
            None if msg.len() > 4 => Some(msg.split_off(4)),
            None => None,
        };
        for (ki, g_k, g_v) in self.dkv.drain(..) {
            msg[ki] = msg[ki].clone() + g_k;
            msg[2 + ki] = msg[2 + ki].clone() + g_v;
        }
        if let Some(next) = next_kv {
            self.kv = next;
            // The neighbour scores this block at step t + 2.
            if self.t + 2 < n {
                msg.extend(self.kv.iter().cloned());
            }
        }
        self.incoming = start_pass(&self.p.group, msg);
    }

    /// Sends the held block's accumulators on (after the last block: home) and computes the
    /// next block's gradients, where one is left.
    pub(crate) fn step(&mut self) {
        if self.sent_home {
            return;
        }
        self.close();
        if self.t + 1 < self.p.group.comm.size() {
            self.t += 1;
            self.grads();
        } else {
            self.sent_home = true;
        }
    }

    /// `(dq, dk, dv)` of this rank's chunks, once every block's gradients are home.
    pub(crate) fn finish(mut self) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        while !self.sent_home {
            self.step();
        }
        let g = arrived(self.incoming);
        let [dq0, dq1] = self
            .dq
            .map(|d| d.expect("every query chunk sees at least its own chunk"));
        (
            Tensor::cat(vec![dq0, dq1], 2),
            Tensor::cat(vec![g[0].clone(), g[1].clone()], 2),
            Tensor::cat(vec![g[2].clone(), g[3].clone()], 2),
        )
    }
}

/// Backward of the ring: `(dq, dk, dv)` of this rank's chunks.
pub fn ring_backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    o: Tensor<4>,
    lse: Tensor<3>,
    d_o: Tensor<4>,
    p: &RingParams,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    RingBackward::begin([q, k, v, o, d_o], lse, p).finish()
}

/// Ring attention on (possibly autodiff) tensors.
pub fn ring_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    group: &RingGroup,
) -> Tensor<4> {
    let params = RingParams::new(group, opts);
    Tensor::from_dispatch(<Dispatch as RingOps>::ring_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        params,
    ))
}

/// Ulysses inside the CP ring (USP's 2-D layout): the all-to-all over SP gathers this CP rank's
/// two chunks for a group of heads, the ring runs over CP on them, the inverse all-to-all
/// returns the sequence shard.
#[derive(Debug, Clone)]
pub struct UlyssesRing {
    pub ulysses: SpGroup,
    pub ring: RingGroup,
}

impl SequenceParallel for UlyssesRing {
    fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        _local: LocalAttention<'_>,
    ) -> Tensor<4> {
        let ring = |q, k, v, o: &AttnOptions| ring_attention(q, k, v, o, &self.ring);
        ulysses_attention(q, k, v, opts, &self.ulysses, &ring)
    }

    fn elements_sent(&self) -> u64 {
        self.ulysses.elements_sent() + self.ring.elements_sent()
    }
}
