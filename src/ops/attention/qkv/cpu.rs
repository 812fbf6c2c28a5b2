//! The fused QKV attention on f32 `Flex` tensors: one pass that writes q, k (rotated) and v
//! head-major from the projection, the CPU FlashAttention kernel, one transpose back; the
//! backward rebuilds q, k, v the same way and writes the projection's gradient in one pass that
//! rotates dq and dk back.

use burn::backend::{tensor::FloatTensor, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::ops::attention::cpu::{self as flash_cpu, Dims};
use crate::ops::primitive::Primitive;
use crate::ops::simd::{host_f32, values};

use super::*;

/// The loops' view of a call: batch `b`, `h` heads, `s` tokens, head dim `d`, `rot` rotary dims.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) b: usize,
    pub(super) h: usize,
    pub(super) s: usize,
    pub(super) d: usize,
    pub(super) rot: usize,
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
pub(super) fn transpose_heads(x: &[f32], n: Shape, to_tokens: bool) -> Vec<f32> {
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
