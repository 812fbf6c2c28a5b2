//! FlashAttention (the FlashAttention-2 algorithm) as a burn backend extension.
//!
//! Same semantics as [`naive_attention`](super::naive::naive_attention), but the scores are
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
//! its last two dims, all created by `tiled.rs`'s `Tile` helpers that `debug_assert!` those
//! bounds.
//!
//! The op boundary is [`FlashAttentionOps`]: `flash_attention_fwd(q, k, v, params) -> (o, lse)`
//! and `flash_attention_bwd(q, k, v, o, lse, do, params) -> (dq, dk, dv)`, implemented for
//! `Flex` (`cpu.rs`: the fused f32 kernel, the tiled burn-op algorithm of `tiled.rs` for other
//! dtypes), for CubeCL backends (`cube.rs`: the fused kernels of `genslm-kernels`) and, in this
//! file, for `Autodiff<B, C>` through `ops::autodiff::differentiable`, which calls the inner
//! backend's `flash_attention_bwd`, so autodiff never differentiates through the tile ops.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::Tensor;

use super::options::AttnOptions;
use crate::ops::autodiff::{differentiable_attention as differentiable, AttentionKernels};

/// Default query block (rows of a score tile). 256 × 256 tiles (256 KiB of f32 per task) ran
/// the CPU kernel's forward and backward 6% faster than 128 × 128 at 2048 tokens, head dim 64
/// (fewer gemm calls, each packing its operands; 2-core dev VM, 2026-11-24). The CubeCL kernels
/// choose their own tiles.
pub const DEFAULT_BLOCK_Q: usize = 256;
/// Default key block (columns of a score tile).
pub const DEFAULT_BLOCK_K: usize = 256;

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
