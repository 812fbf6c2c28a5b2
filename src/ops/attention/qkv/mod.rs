//! Self-attention from the fused QKV projection as one op: `[b, s, heads·3d]` (per head
//! `[q | k | v]`, Hugging Face's layout) → rotary on q and k → FlashAttention → `[b, s, heads·d]`,
//! with a hand-written backward.
//!
//! Composed, the step between the QKV linear and the attention output is a dozen tensor ops:
//! a head transpose, three slices, rotary as slices, a negation, two concatenations and three
//! products per tensor, the kernel's contiguous copies of its strided inputs, and a transpose
//! back. Their backward is worse: each slice's gradient is a zero tensor as large as the whole
//! QKV output with the slice written in, and the three are added. On CPU that was about a tenth
//! of a genslm-25m step at 2048 tokens (perf, 2026-11-24). Fused, the forward is one pass that
//! writes q, k (rotated) and v head-major, the kernel, and one transpose of the output; the
//! backward rebuilds q, k, v from the saved QKV output the same way, runs the kernel's backward,
//! and writes the QKV gradient in one pass that also rotates dq and dk back (the transpose of a
//! rotation by θ is the rotation by −θ).
//!
//! The loops are for f32 `Flex` tensors (`cpu.rs`); other dtypes and CubeCL backends (`cube.rs`)
//! run the same steps as tensor ops around the FlashAttention op (the composed functions here),
//! so the op means the same on every backend. The autodiff node is `backward.rs`'s, the tests
//! (against naive attention with composed rotary) `tests.rs`'s.

use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::Tensor;

use super::flash::{
    flash_attention_backward, flash_attention_forward, FlashParams, DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
};
use super::options::AttnOptions;
use crate::ops::rotary::apply_rotary;

mod backward;
mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube;
#[cfg(test)]
mod tests;

/// What the op needs besides its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct QkvParams {
    pub heads: usize,
    /// Rotary dims at the start of each head (even; at most the head dim).
    pub rot: usize,
    pub flash: FlashParams,
}

/// Shapes: qkv `[b, s, heads·3d]`, cos and sin `[1, 1, s, rot]` (Hugging Face's tables, halves
/// repeated), output and its gradient `[b, s, heads·d]`, lse `[b, heads, s]`. Under autodiff
/// the op saves qkv, the tables, o and lse, and its backward is
/// [`QkvAttentionKernels::qkv_attention_bwd`]; elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait QkvAttentionOps: Backend {
    fn qkv_attention(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self>;
}

/// The op's kernels, on the backends that compute.
pub trait QkvAttentionKernels: Backend {
    /// `(o, lse)`.
    fn qkv_attention_fwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The QKV gradient from the forward's input, output and lse, and `do`.
    fn qkv_attention_bwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self>;
}

impl<B: QkvAttentionKernels> QkvAttentionOps for B {
    fn qkv_attention(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        B::qkv_attention_fwd(qkv, cos, sin, params).0
    }
}

/// Rotary self-attention (FlashAttention with `opts`) of the fused projection `qkv`, with
/// `heads` heads on this rank and `rot` rotary dims: `[b, s, heads·d]`. Differentiable on an
/// autodiff device.
pub fn qkv_attention(
    qkv: Tensor<3>,
    (cos, sin): (&Tensor<4>, &Tensor<4>),
    heads: usize,
    rot: usize,
    opts: &AttnOptions,
) -> Tensor<3> {
    let params = QkvParams {
        heads,
        rot,
        flash: FlashParams::new(opts, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K),
    };
    Tensor::from_dispatch(<Dispatch as QkvAttentionOps>::qkv_attention(
        qkv.into_dispatch(),
        cos.clone().into_dispatch(),
        sin.clone().into_dispatch(),
        params,
    ))
}

/// q, k (rotated) and v `[b, heads, s, d]` of `qkv`, as tensor ops.
fn split_composed(
    qkv: Tensor<3>,
    cos: &Tensor<4>,
    sin: &Tensor<4>,
    p: &QkvParams,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let d = qkv.dims()[2] / (3 * p.heads);
    let qkv = heads_composed(qkv, p.heads);
    let q = apply_rotary(qkv.clone().narrow(3, 0, d), cos, sin, p.rot);
    let k = apply_rotary(qkv.clone().narrow(3, d, d), cos, sin, p.rot);
    (q, k, qkv.narrow(3, 2 * d, d))
}

/// `[b, heads, s, d]` → `[b, s, heads·d]` (the inverse of [`heads_composed`]).
fn merge_composed(x: Tensor<4>) -> Tensor<3> {
    let [b, h, s, d] = x.dims();
    x.swap_dims(1, 2).reshape([b, s, h * d])
}

/// `[b, s, heads·w]` → `[b, heads, s, w]`.
fn heads_composed(x: Tensor<3>, heads: usize) -> Tensor<4> {
    let [b, s, w] = x.dims();
    x.reshape([b, s, heads, w / heads]).swap_dims(1, 2)
}

fn fwd_composed(
    qkv: Tensor<3>,
    cos: &Tensor<4>,
    sin: &Tensor<4>,
    p: &QkvParams,
) -> (Tensor<3>, Tensor<3>) {
    let (q, k, v) = split_composed(qkv, cos, sin, p);
    let (bq, bk) = (p.flash.block_q, p.flash.block_k);
    let (o, lse) = flash_attention_forward(q, k, v, &p.flash.opts, bq, bk);
    (merge_composed(o), lse)
}

#[allow(clippy::too_many_arguments)]
fn bwd_composed(
    qkv: Tensor<3>,
    cos: &Tensor<4>,
    sin: &Tensor<4>,
    o: Tensor<3>,
    lse: Tensor<3>,
    d_o: Tensor<3>,
    p: &QkvParams,
) -> Tensor<3> {
    let (q, k, v) = split_composed(qkv, cos, sin, p);
    let (o, d_o) = (heads_composed(o, p.heads), heads_composed(d_o, p.heads));
    let (bq, bk) = (p.flash.block_q, p.flash.block_k);
    let (dq, dk, dv) = flash_attention_backward(q, k, v, o, lse, d_o, &p.flash.opts, bq, bk);
    // Rotary's transpose: the rotation by −θ.
    let neg_sin = sin.clone().neg();
    let dq = apply_rotary(dq, cos, &neg_sin, p.rot);
    let dk = apply_rotary(dk, cos, &neg_sin, p.rot);
    merge_composed(Tensor::cat(vec![dq, dk, dv], 3))
}
