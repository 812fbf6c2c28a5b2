//! FlashAttention (the FlashAttention-2 algorithm) as a burn backend extension.
//!
//! Same semantics as [`naive_attention`](super::attention::naive_attention), but the scores are
//! only ever formed one `[b, h, block_q, block_k]` tile at a time:
//!
//! - **Forward**: query blocks outer, key blocks inner, with a running row max `m`, running sum
//!   `l` and accumulator (online softmax). Returns `O = acc / l` and the row log-sum-exp
//!   `L = m + ln l` (`[b, h, sq]`), which the backward needs.
//! - **Backward**: `D = rowsum(dO ∘ O)`; key blocks outer, query blocks inner; each tile's
//!   probabilities are recomputed as `P = exp(S − L)` and `dQ`, `dK`, `dV` are accumulated.
//! - **Causal**: tiles whose keys all come after all of their queries (global positions
//!   `q_offset + i`, `k_offset + j`) are skipped; only tiles crossing the diagonal get a mask.
//! - **ALiBi**: the bias of a tile is built inside the loop from the per-head slopes and the
//!   tile's positions (`[1, h, bq, bk]`); no `[sq, sk]` bias exists.
//!
//! Nothing of size `sq × sk` is allocated: every tensor is either an input/output-sized tensor
//! (`[b, h, s, d]`, `[b, h, s]`) or a tile with at most `block_q` rows and `block_k` columns on
//! its last two dims, all created by [`Tile`] helpers that `debug_assert!` those bounds.
//!
//! The op boundary is [`FlashAttentionOps`]: `flash_attention_fwd(q, k, v, params) -> (o, lse)`
//! and `flash_attention_bwd(q, k, v, o, lse, do, params) -> (dq, dk, dv)`, implemented for
//! `Flex` with burn tensor ops on tiles (this file, the CPU path) and for `Autodiff<B, C>` with a
//! hand-written backward (`attention_op.rs`) that calls the inner backend's
//! `flash_attention_bwd`, so autodiff never differentiates through the tile ops. A fused GPU kernel plugs in as another backend
//! implementation of the same trait.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use super::attention_op::{differentiable, AttentionKernels};
use super::attn_options::AttnOptions;

/// Default query block (rows of a score tile). 256 × 256 tiles (256 KiB of f32 per task) ran
/// the CPU kernel's forward and backward 6% faster than 128 × 128 at 2048 tokens, head dim 64
/// (fewer gemm calls, each packing its operands; 2-core dev VM, 2026-11-24). The CubeCL kernels
/// choose their own tiles.
pub const DEFAULT_BLOCK_Q: usize = 256;
/// Default key block (columns of a score tile).
pub const DEFAULT_BLOCK_K: usize = 256;

/// Per-thread counters of what the tiled CPU path did, for tests: the largest score tile
/// (rows × columns) it formed and how many times the forward and backward ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileStats {
    pub max_tile_rows: usize,
    pub max_tile_cols: usize,
    pub forward_calls: usize,
    pub backward_calls: usize,
}

thread_local! {
    static STATS: std::cell::Cell<TileStats> = const {
        std::cell::Cell::new(TileStats {
            max_tile_rows: 0,
            max_tile_cols: 0,
            forward_calls: 0,
            backward_calls: 0,
        })
    };
}

/// This thread's counters since the last [`reset_tile_stats`].
pub fn tile_stats() -> TileStats {
    STATS.with(|s| s.get())
}

pub fn reset_tile_stats() {
    STATS.with(|s| s.set(TileStats::default()));
}

pub(crate) fn record(f: impl FnOnce(&mut TileStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}

/// Everything besides the tensors that the op needs: [`AttnOptions`] plus the block sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct FlashParams {
    pub opts: AttnOptions,
    pub block_q: usize,
    pub block_k: usize,
}

impl FlashParams {
    pub fn new(opts: &AttnOptions, block_q: usize, block_k: usize) -> Self {
        assert!(
            block_q > 0 && block_k > 0,
            "flash attention blocks must be non-empty"
        );
        Self {
            opts: opts.clone(),
            block_q,
            block_k,
        }
    }
}

/// The FlashAttention op. Shapes: q `[b, h, sq, d]`, k `[b, h, sk, d]`, v `[b, h, sk, dv]`,
/// o / do `[b, h, sq, dv]`, lse `[b, h, sq]`.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait FlashAttentionOps: Backend {
    /// Forward: the output and the row log-sum-exp of the (scaled, biased, masked) scores.
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Backward: `(dq, dk, dv)` from the forward's inputs, output, log-sum-exp and `do`.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The differentiable op: the output only. Under autodiff its backward is
    /// `flash_attention_bwd`; elsewhere it is just the forward.
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        Self::flash_attention_fwd(q, k, v, params).0
    }
}

impl<B: Backend + FlashAttentionOps, C: CheckpointStrategy> FlashAttentionOps for Autodiff<B, C> {
    /// Not differentiable on its own (the output is untracked); use `flash_attention`.
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = B::flash_attention_fwd(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            params,
        );
        (FloatTensor::<Self>::new(o), FloatTensor::<Self>::new(lse))
    }

    /// The backward computed on the inner backend; the results are untracked.
    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = B::flash_attention_bwd(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            o.into_primitive(),
            lse.into_primitive(),
            d_o.into_primitive(),
            params,
        );
        (
            FloatTensor::<Self>::new(dq),
            FloatTensor::<Self>::new(dk),
            FloatTensor::<Self>::new(dv),
        )
    }

    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _>(q, k, v, params)
    }
}

impl<B: Backend + FlashAttentionOps> AttentionKernels<B> for FlashParams {
    fn forward(
        &self,
        q: FloatTensor<B>,
        k: FloatTensor<B>,
        v: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        B::flash_attention_fwd(q, k, v, self.clone())
    }

    fn backward(
        &self,
        q: FloatTensor<B>,
        k: FloatTensor<B>,
        v: FloatTensor<B>,
        o: FloatTensor<B>,
        lse: FloatTensor<B>,
        d_o: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
        B::flash_attention_bwd(q, k, v, o, lse, d_o, self.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Public tensor-level API.

fn check_shapes(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>, params: &FlashParams) {
    let [b, h, _, d] = q.dims();
    let [kb, kh, sk, kd] = k.dims();
    let [vb, vh, vs, _] = v.dims();
    assert!(
        (kb, kh, kd) == (b, h, d) && (vb, vh, vs) == (b, h, sk),
        "flash attention: q {:?}, k {:?}, v {:?} do not fit",
        q.dims(),
        k.dims(),
        v.dims()
    );
    if let Some(s) = &params.opts.alibi {
        assert_eq!(s.len(), h, "one ALiBi slope per head");
    }
}

/// Attention over `q: [b, h, sq, d]`, `k, v: [b, h, sk, d]` → `[b, h, sq, d]` with the same
/// semantics as `naive_attention`, in `block_q × block_k` tiles. Differentiable on an autodiff
/// device, with the hand-written FlashAttention-2 backward.
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    block_q: usize,
    block_k: usize,
) -> Tensor<4> {
    let params = FlashParams::new(opts, block_q, block_k);
    check_shapes(&q, &k, &v, &params);
    Tensor::from_dispatch(<Dispatch as FlashAttentionOps>::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        params,
    ))
}

/// The op's forward alone (not differentiable): `(o [b, h, sq, dv], lse [b, h, sq])`.
pub fn flash_attention_forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    block_q: usize,
    block_k: usize,
) -> (Tensor<4>, Tensor<3>) {
    let params = FlashParams::new(opts, block_q, block_k);
    check_shapes(&q, &k, &v, &params);
    let (o, lse) = <Dispatch as FlashAttentionOps>::flash_attention_fwd(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        params,
    );
    (Tensor::from_dispatch(o), Tensor::from_dispatch(lse))
}

/// The op's backward alone: `(dq, dk, dv)` from the forward's inputs, `o`, `lse` and `do`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    o: Tensor<4>,
    lse: Tensor<3>,
    d_o: Tensor<4>,
    opts: &AttnOptions,
    block_q: usize,
    block_k: usize,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let params = FlashParams::new(opts, block_q, block_k);
    check_shapes(&q, &k, &v, &params);
    let (dq, dk, dv) = <Dispatch as FlashAttentionOps>::flash_attention_bwd(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        o.into_dispatch(),
        lse.into_dispatch(),
        d_o.into_dispatch(),
        params,
    );
    (
        Tensor::from_dispatch(dq),
        Tensor::from_dispatch(dk),
        Tensor::from_dispatch(dv),
    )
}

// ---------------------------------------------------------------------------------------------
// The tiled CPU algorithm (burn tensor ops on non-autodiff tiles).

/// One score tile: query rows `[qs, qs + nq)` against key columns `[ks, ks + nk)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile {
    qs: usize,
    nq: usize,
    ks: usize,
    nk: usize,
}

/// What causality says about a tile.
#[derive(Debug, PartialEq)]
pub(crate) enum Causal {
    /// Every key is visible to every query (or the attention is not causal).
    Full,
    /// The tile crosses the diagonal: some keys come after some queries.
    Diagonal,
    /// Every key comes after every query: the tile contributes nothing.
    Skip,
}

impl Tile {
    pub(crate) fn new(qs: usize, nq: usize, ks: usize, nk: usize, p: &FlashParams) -> Self {
        // The bound that proves no sq × sk (or other oversized) score tensor exists.
        debug_assert!(
            nq <= p.block_q && nk <= p.block_k,
            "tile exceeds the blocks"
        );
        record(|s| {
            s.max_tile_rows = s.max_tile_rows.max(nq);
            s.max_tile_cols = s.max_tile_cols.max(nk);
        });
        Self { qs, nq, ks, nk }
    }

    pub(crate) fn causal(&self, p: &FlashParams) -> Causal {
        let p = &p.opts;
        if !p.causal {
            return Causal::Full;
        }
        let (q_first, q_last) = (p.q_offset + self.qs, p.q_offset + self.qs + self.nq - 1);
        let (k_first, k_last) = (p.k_offset + self.ks, p.k_offset + self.ks + self.nk - 1);
        if k_first > q_last {
            Causal::Skip
        } else if k_last > q_first {
            Causal::Diagonal
        } else {
            Causal::Full
        }
    }

    /// `pos_q − pos_k` over the tile, `[1, 1, nq, nk]` (exact integers, then float).
    fn distance(&self, p: &FlashParams, device: &Device) -> Tensor<4> {
        let q0 = (p.opts.q_offset + self.qs) as i64;
        let k0 = (p.opts.k_offset + self.ks) as i64;
        let shape = [1, 1, self.nq, self.nk];
        let qp = Tensor::<1, Int>::arange(q0..q0 + self.nq as i64, device)
            .reshape([1, 1, self.nq, 1])
            .expand(shape);
        let kp = Tensor::<1, Int>::arange(k0..k0 + self.nk as i64, device)
            .reshape([1, 1, 1, self.nk])
            .expand(shape);
        (qp - kp).float()
    }

    /// Scaled scores of the tile plus the ALiBi bias, with keys after queries set to −∞ on
    /// diagonal tiles: `[b, h, nq, nk]`.
    pub(crate) fn scores(
        &self,
        q_blk: &Tensor<4>,
        k_blk: &Tensor<4>,
        neg_slopes: Option<&Tensor<4>>,
        scale: f64,
        p: &FlashParams,
    ) -> Tensor<4> {
        let [b, h, _, _] = q_blk.dims();
        let shape = [b, h, self.nq, self.nk];
        let mut s = q_blk.clone().matmul(k_blk.clone().swap_dims(2, 3)) * scale;
        let diagonal = self.causal(p) == Causal::Diagonal;
        if neg_slopes.is_none() && !diagonal {
            return s;
        }
        let device = s.device();
        let dist = self.distance(p, &device).cast(s.dtype());
        if let Some(neg_slopes) = neg_slopes {
            // bias = −slope_h · (i − j) causal, −slope_h · |i − j| otherwise: [1, h, nq, nk].
            let d = if p.opts.causal {
                dist.clone()
            } else {
                dist.clone().abs()
            };
            let bias = d.expand([1, h, self.nq, self.nk]) * neg_slopes.clone();
            s = s + bias.expand(shape);
        }
        if diagonal {
            let mask: Tensor<4, Bool> = dist.lower_elem(0.0);
            s = s.mask_fill(mask.expand(shape), f32::NEG_INFINITY);
        }
        s
    }
}

/// The negated slopes `−slope_h` as `[1, h, 1, 1]`, broadcast over a tile.
pub(crate) fn neg_slopes_tensor(p: &FlashParams, like: &Tensor<4>) -> Option<Tensor<4>> {
    p.opts.alibi.as_ref().map(|s| {
        let h = s.len();
        let data: Vec<f32> = s.iter().map(|&x| -x as f32).collect();
        Tensor::<4>::from_data(TensorData::new(data, [1, h, 1, 1]), &like.device())
            .cast(like.dtype())
    })
}

/// The last key index (exclusive) any query of `[qs, qs + nq)` can see.
pub(crate) fn key_end(qs: usize, nq: usize, sk: usize, p: &FlashParams) -> usize {
    let o = &p.opts;
    if o.causal {
        (o.q_offset + qs + nq).saturating_sub(o.k_offset).min(sk)
    } else {
        sk
    }
}

/// FlashAttention-2 forward over non-autodiff tensors: `(o, lse)`.
pub(crate) fn tiled_forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    p: &FlashParams,
) -> (Tensor<4>, Tensor<3>) {
    let [_, _, sq, d] = q.dims();
    let sk = k.dims()[2];
    let scale = 1.0 / (d as f64).sqrt();
    let neg_slopes = neg_slopes_tensor(p, &q);
    record(|s| s.forward_calls += 1);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for qs in (0..sq).step_by(p.block_q) {
        let nq = p.block_q.min(sq - qs);
        let q_blk = q.clone().narrow(2, qs, nq);
        // Running row max m, row sum l, accumulator acc; None until the first key block.
        let mut state: Option<(Tensor<4>, Tensor<4>, Tensor<4>)> = None;
        // Key blocks after `k_end` are entirely in the future of this query block: skipped.
        let k_end = key_end(qs, nq, sk, p);
        for ks in (0..k_end).step_by(p.block_k) {
            let nk = p.block_k.min(k_end - ks);
            let tile = Tile::new(qs, nq, ks, nk, p);
            if tile.causal(p) == Causal::Skip {
                continue;
            }
            let k_blk = k.clone().narrow(2, ks, nk);
            let v_blk = v.clone().narrow(2, ks, nk);
            let s = tile.scores(&q_blk, &k_blk, neg_slopes.as_ref(), scale, p);
            let row_max = s.clone().max_dim(3);
            state = Some(match state {
                None => {
                    let pr = (s - row_max.clone()).exp();
                    let l = pr.clone().sum_dim(3);
                    (row_max, l, pr.matmul(v_blk))
                }
                Some((m, l, acc)) => {
                    let m_new = m.clone().max_pair(row_max);
                    let pr = (s - m_new.clone()).exp();
                    let alpha = (m - m_new.clone()).exp();
                    let l = l * alpha.clone() + pr.clone().sum_dim(3);
                    let acc = acc * alpha + pr.matmul(v_blk);
                    (m_new, l, acc)
                }
            });
        }
        let (m, l, acc) = state.unwrap_or_else(|| {
            // No visible key at all (k_offset beyond every query): the naive softmax is 0/0.
            let [b, h, _, _] = q_blk.dims();
            let dv = v.dims()[3];
            let nan = Tensor::<4>::full([b, h, nq, 1], f32::NAN, &q.device());
            (nan.clone(), nan.clone(), nan.expand([b, h, nq, dv]))
        });
        outs.push(acc / l.clone());
        lses.push((m + l.log()).squeeze_dim::<3>(3));
    }
    (Tensor::cat(outs, 2), Tensor::cat(lses, 2))
}
