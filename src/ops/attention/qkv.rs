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
//! The loops are for f32 `Flex` tensors; other dtypes and CubeCL backends run the same steps as
//! tensor ops around the FlashAttention op, so the op means the same on every backend.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::cpu::{self as flash_cpu, Dims};
use super::flash::{
    flash_attention_backward, flash_attention_forward, FlashParams, DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
};
use super::options::AttnOptions;
use crate::ops::primitive::Primitive;
use crate::ops::rotary::apply_rotary;
use crate::ops::simd::{host_f32, values};

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

/// The loops' view of a call: batch `b`, `h` heads, `s` tokens, head dim `d`, `rot` rotary dims.
#[derive(Debug, Clone, Copy)]
struct Shape {
    b: usize,
    h: usize,
    s: usize,
    d: usize,
    rot: usize,
}

impl Shape {
    fn dims(&self) -> Dims {
        Dims {
            b: self.b,
            h: self.h,
            sq: self.s,
            sk: self.s,
            d: self.d,
            dv: self.d,
        }
    }
}

/// `out[..rot] = x·cos + rotate_half(x)·sin` (with `sign` −1 on sin: the inverse rotation), the
/// rest of the head copied. `cos`, `sin`: this token's `rot` table entries.
#[inline]
fn rotate(out: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32], sign: f32) {
    let half = cos.len() / 2;
    for i in 0..half {
        let (x1, x2) = (x[i], x[half + i]);
        out[i] = x1 * cos[i] - sign * x2 * sin[i];
        out[half + i] = x2 * cos[half + i] + sign * x1 * sin[half + i];
    }
    out[2 * half..].copy_from_slice(&x[2 * half..]);
}

/// q, k (rotated) and v of the fused projection, head-major `[b·heads, s, d]` each.
fn split_heads(qkv: &[f32], cos: &[f32], sin: &[f32], n: Shape) -> [Vec<f32>; 3] {
    let (s, d, rot) = (n.s, n.d, n.rot);
    let len = n.b * n.h * s * d;
    let mut out = [vec![0f32; len], vec![0f32; len], vec![0f32; len]];
    let [q, k, v] = &mut out;
    q.par_chunks_mut(s * d)
        .zip(k.par_chunks_mut(s * d))
        .zip(v.par_chunks_mut(s * d))
        .enumerate()
        .for_each(|(bh, ((q, k), v))| {
            let (bi, hi) = (bh / n.h, bh % n.h);
            for t in 0..s {
                let src = &qkv[((bi * s + t) * n.h + hi) * 3 * d..][..3 * d];
                let (c, sn) = (&cos[t * rot..(t + 1) * rot], &sin[t * rot..(t + 1) * rot]);
                let row = t * d..(t + 1) * d;
                rotate(&mut q[row.clone()], &src[..d], c, sn, 1.0);
                rotate(&mut k[row.clone()], &src[d..2 * d], c, sn, 1.0);
                v[row].copy_from_slice(&src[2 * d..]);
            }
        });
    out
}

/// The QKV gradient `[b, s, heads·3d]` from dq, dk, dv `[b·heads, s, d]`, rotating dq and dk
/// back.
fn merge_grads(dq: &[f32], dk: &[f32], dv: &[f32], cos: &[f32], sin: &[f32], n: Shape) -> Vec<f32> {
    let (s, d, rot) = (n.s, n.d, n.rot);
    let mut out = vec![0f32; n.b * s * n.h * 3 * d];
    out.par_chunks_mut(n.h * 3 * d)
        .enumerate()
        .for_each(|(bt, row)| {
            let (bi, t) = (bt / s, bt % s);
            let (c, sn) = (&cos[t * rot..(t + 1) * rot], &sin[t * rot..(t + 1) * rot]);
            for (hi, dst) in row.chunks_exact_mut(3 * d).enumerate() {
                let at = ((bi * n.h + hi) * s + t) * d;
                let src = at..at + d;
                rotate(&mut dst[..d], &dq[src.clone()], c, sn, -1.0);
                rotate(&mut dst[d..2 * d], &dk[src.clone()], c, sn, -1.0);
                dst[2 * d..].copy_from_slice(&dv[src]);
            }
        });
    out
}

/// `[b·heads, s, d]` → `[b, s, heads·d]` (`to_tokens`), or back.
fn transpose_heads(x: &[f32], n: Shape, to_tokens: bool) -> Vec<f32> {
    let (s, d, h) = (n.s, n.d, n.h);
    let mut out = vec![0f32; x.len()];
    if to_tokens {
        out.par_chunks_mut(h * d).enumerate().for_each(|(bt, row)| {
            let (bi, t) = (bt / s, bt % s);
            for (hi, dst) in row.chunks_exact_mut(d).enumerate() {
                let at = ((bi * h + hi) * s + t) * d;
                dst.copy_from_slice(&x[at..at + d]);
            }
        });
    } else {
        out.par_chunks_mut(s * d)
            .enumerate()
            .for_each(|(bh, head)| {
                let (bi, hi) = (bh / h, bh % h);
                for (t, dst) in head.chunks_exact_mut(d).enumerate() {
                    let at = (bi * s + t) * h * d + hi * d;
                    dst.copy_from_slice(&x[at..at + d]);
                }
            });
    }
    out
}

/// The loops' shape of a call (the caller has checked that every tensor is f32).
fn shape_of(qkv: &Tensor<3>, cos: &Tensor<4>, p: &QkvParams) -> Shape {
    let [b, s, w] = qkv.dims();
    assert_eq!(
        cos.dims()[2..],
        [s, p.rot],
        "rotary tables for {s} tokens of {} dims",
        p.rot
    );
    Shape {
        b,
        h: p.heads,
        s,
        d: w / (3 * p.heads),
        rot: p.rot,
    }
}

impl QkvAttentionKernels for Flex {
    fn qkv_attention_fwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (qkv, cos, sin): (Tensor<3>, Tensor<4>, Tensor<4>) =
            (Self::tensor(qkv), Self::tensor(cos), Self::tensor(sin));
        let (o, lse) = if [qkv.dtype(), cos.dtype(), sin.dtype()] == [DType::F32; 3] {
            let (n, device) = (shape_of(&qkv, &cos, &params), qkv.device());
            let (qkv, cos, sin) = (host_f32(qkv), host_f32(cos), host_f32(sin));
            let [q, k, v] = split_heads(values(&qkv), values(&cos), values(&sin), n);
            let (o, lse) = flash_cpu::forward(&q, &k, &v, n.dims(), &params.flash);
            let o = transpose_heads(&o, n, true);
            (
                Tensor::<3>::from_data(TensorData::new(o, [n.b, n.s, n.h * n.d]), &device),
                Tensor::<3>::from_data(TensorData::new(lse, [n.b, n.h, n.s]), &device),
            )
        } else {
            fwd_composed(qkv, &cos, &sin, &params)
        };
        (Self::prim(o), Self::prim(lse))
    }

    fn qkv_attention_bwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        let (qkv, o, lse, d_o): (Tensor<3>, Tensor<3>, Tensor<3>, Tensor<3>) = (
            Self::tensor(qkv),
            Self::tensor(o),
            Self::tensor(lse),
            Self::tensor(d_o),
        );
        let (cos, sin): (Tensor<4>, Tensor<4>) = (Self::tensor(cos), Self::tensor(sin));
        let f32s = [&qkv, &o, &lse, &d_o]
            .iter()
            .all(|t| t.dtype() == DType::F32)
            && [cos.dtype(), sin.dtype()] == [DType::F32; 2];
        Self::prim(if f32s {
            let (n, device) = (shape_of(&qkv, &cos, &params), qkv.device());
            let dims = qkv.dims();
            let (qkv, cos, sin) = (host_f32(qkv), host_f32(cos), host_f32(sin));
            let (o, lse, d_o) = (host_f32(o), host_f32(lse), host_f32(d_o));
            let (cos, sin) = (values(&cos), values(&sin));
            let [q, k, v] = split_heads(values(&qkv), cos, sin, n);
            let o = transpose_heads(values(&o), n, false);
            let d_o = transpose_heads(values(&d_o), n, false);
            let (dq, dk, dv) =
                flash_cpu::backward(&q, &k, &v, &o, values(&lse), &d_o, n.dims(), &params.flash);
            drop((q, k, v, o, d_o)); // the backward's peak is the kernel's, not the merge's
            let dqkv = merge_grads(&dq, &dk, &dv, cos, sin, n);
            Tensor::<3>::from_data(TensorData::new(dqkv, dims), &device)
        } else {
            bwd_composed(qkv, &cos, &sin, o, lse, d_o, &params)
        })
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl QkvAttentionKernels for burn::backend::Cube {
    fn qkv_attention_fwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = fwd_composed(
            Self::tensor(qkv),
            &Self::tensor(cos),
            &Self::tensor(sin),
            &params,
        );
        (Self::prim(o), Self::prim(lse))
    }

    fn qkv_attention_bwd(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        Self::prim(bwd_composed(
            Self::tensor(qkv),
            &Self::tensor(cos),
            &Self::tensor(sin),
            Self::tensor(o),
            Self::tensor(lse),
            Self::tensor(d_o),
            &params,
        ))
    }
}

impl<B: QkvAttentionKernels, Ck: CheckpointStrategy> QkvAttentionOps for Autodiff<B, Ck> {
    fn qkv_attention(
        qkv: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        params: QkvParams,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct QkvBackward;

        impl<B: QkvAttentionKernels> Backward<B, 1> for QkvBackward {
            // qkv, cos, sin, o, lse, and the parameters.
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                QkvParams,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node] = ops.parents;
                let d_o = grads.consume::<B>(&ops.node);
                let (qkv, cos, sin, o, lse, params) = ops.state;
                if let Some(node) = node {
                    let g = B::qkv_attention_bwd(qkv, cos, sin, o, lse, d_o, params);
                    grads.register::<B>(node.id, g);
                }
            }
        }

        // The tables are constants: only qkv is a parent.
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match QkvBackward
            .prepare::<Ck>([qkv.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let qp = qkv.primitive().clone();
                let (o, lse) =
                    B::qkv_attention_fwd(qp.clone(), cos.clone(), sin.clone(), params.clone());
                prep.finish((qp, cos, sin, o.clone(), lse, params), o)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as QkvAttentionOps>::qkv_attention(
                qkv.into_primitive(),
                cos,
                sin,
                params,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::position::rotary_tables;
    use crate::ops::attention::naive::naive_attention;

    /// Output and QKV gradient against burn differentiating the composed steps (head split,
    /// rotary as tensor ops, attention with every score materialised, merge), with partial rotary, a batch of
    /// two, a length that is not a multiple of the tiles, and an offset; with and without
    /// the causal mask.
    #[test]
    fn matches_autodiff_of_the_composed_steps() {
        let ad = burn::tensor::Device::flex().autodiff();
        let (b, s, h, d, rot) = (2, 37, 3, 8, 4);
        let n = b * s * h * 3 * d;
        let vals: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let wts: Vec<f32> = (0..b * s * h * d)
            .map(|i| (i as f32 * 0.11).cos())
            .collect();
        let (cos, sin) = rotary_tables(rot, 10_000.0, 5, s, &ad);
        for causal in [true, false] {
            let o = AttnOptions {
                causal,
                alibi: None,
                q_offset: 5,
                k_offset: 5,
            };
            let run = |fused: bool| {
                let qkv =
                    Tensor::<3>::from_data(TensorData::new(vals.clone(), [b, s, h * 3 * d]), &ad)
                        .require_grad();
                let p = QkvParams {
                    heads: h,
                    rot,
                    flash: FlashParams::new(&o, 16, 16),
                };
                let out = if fused {
                    qkv_attention(qkv.clone(), (&cos, &sin), h, rot, &o)
                } else {
                    let (q, k, v) = split_composed(qkv.clone(), &cos, &sin, &p);
                    merge_composed(naive_attention(q, k, v, &o))
                };
                let weights =
                    Tensor::<3>::from_data(TensorData::new(wts.clone(), [b, s, h * d]), &ad);
                let grads = (out.clone() * weights).sum().backward();
                let v = |t: Tensor<3>| t.into_data().try_into_vec::<f32>().unwrap();
                (
                    v(out.without_autodiff()),
                    v(qkv.grad(&grads).expect("dqkv")),
                )
            };
            let ((y, g), (y_ref, g_ref)) = (run(true), run(false));
            for (what, a, r) in [("o", &y, &y_ref), ("dqkv", &g, &g_ref)] {
                assert_eq!(a.len(), r.len());
                for (i, (x, want)) in a.iter().zip(r.iter()).enumerate() {
                    assert!(
                        (x - want).abs() < 2e-5 * (1.0 + want.abs()),
                        "{what} at {i} (causal {causal}): {x} vs {want}"
                    );
                }
            }
        }
    }

    /// The loops' head transposes are inverses, and the split's v is the input's v columns.
    #[test]
    fn transposes_round_trip() {
        let n = Shape {
            b: 2,
            h: 3,
            s: 5,
            d: 4,
            rot: 0,
        };
        let x: Vec<f32> = (0..2 * 3 * 5 * 4).map(|i| i as f32).collect();
        let heads = transpose_heads(&x, n, false);
        assert_eq!(transpose_heads(&heads, n, true), x);
        // Token 1 of batch 1, head 2, element 3 of a [b, s, h·d] input.
        assert_eq!(
            heads[((3 + 2) * 5 + 1) * 4 + 3],
            x[((5 + 1) * 3 + 2) * 4 + 3]
        );
    }
}
