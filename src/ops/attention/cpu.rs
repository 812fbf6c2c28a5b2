//! FlashAttention-2 on CPU as one kernel over f32 slices: the `Flex` implementation of
//! [`FlashAttentionOps`](super::flash::FlashAttentionOps) for f32 tensors.
//!
//! The same algorithm as the tiled tensor-op version in `flash.rs` (which stays the reference
//! for other dtypes and the GPU fallback), without its costs: there each tile step was a dozen
//! burn ops allocating `[b, h, bq, bk]` tensors, libm's scalar `expf` per score, and a thread
//! hand-off per op. Here a task owns a (batch·head, query block) in the forward and a
//! batch·head in the backward; its tile matmuls are gemm calls (the kernels burn's own matmul
//! uses), the softmax arithmetic runs on rows with a vectorised exp, and the only buffers are
//! tiles of at most `block_q × block_k`.

use burn::backend::{tensor::FloatTensor, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::flash::{FlashAttentionOps, FlashParams};
use super::probe::record;
use super::tiled::{key_end, tiled_backward, tiled_forward};
use crate::ops::primitive::Primitive;
use crate::ops::simd::{dispatched, exp_neg, exp_neg_fused, host_f32 as host, values};
use crate::ops::tile::{panels_len, tile_matmul, times_transposed, transposed_panels, PANEL};

/// Shapes: q `[bh, sq, d]`, k `[bh, sk, d]`, v `[bh, sk, dv]` (batch and heads flattened).
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub dv: usize,
}

/// Global positions and what a score at (query `qp`, key `kp`) gets added or masked.
struct Scores<'a> {
    p: &'a FlashParams,
    scale: f32,
    /// −slope of this head, when ALiBi.
    neg_slope: Option<f32>,
}

impl Scores<'_> {
    /// How many keys of `[ks, ks + len)` query `qi` sees: all, or (causal) those up to itself.
    fn visible(&self, qi: usize, ks: usize, len: usize) -> usize {
        if self.p.opts.causal {
            let qp = (self.p.opts.q_offset + qi) as i64;
            let k0 = (self.p.opts.k_offset + ks) as i64;
            (qp + 1 - k0).clamp(0, len as i64) as usize
        } else {
            len
        }
    }

    /// Splits the raw `q·k` row of query `qi` over keys from `ks` into the keys it sees and
    /// the masked rest, which gets probability 0; scales the seen scores, adds the bias, and
    /// returns the seen part and its max (−∞ when nothing is seen).
    fn finish_row<'r>(&self, row: &'r mut [f32], qi: usize, ks: usize) -> (&'r mut [f32], f32) {
        let visible = self.visible(qi, ks, row.len());
        let (row, masked) = row.split_at_mut(visible);
        masked.fill(0.0);
        let max = match self.neg_slope {
            Some(ns) => {
                let qp = (self.p.opts.q_offset + qi) as i64;
                let k0 = (self.p.opts.k_offset + ks) as i64;
                for (j, s) in row.iter_mut().enumerate() {
                    let dist = (qp - k0 - j as i64) as f32;
                    let dist = if self.p.opts.causal { dist } else { dist.abs() };
                    *s = *s * self.scale + ns * dist;
                }
                row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
            }
            None => scale_max(row, self.scale),
        };
        (row, max)
    }
}

// `row[j] *= scale`; returns the max (sixteen lanes of compares, so the loop vectorises: a
// fold over `f32::max` is a chain of dependent scalar ops, as slow per tile as its products).
dispatched!(scale_max, (row: &mut [f32], scale: f32) -> f32, {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact_mut(16);
    for c in &mut chunks {
        for (x, m) in c.iter_mut().zip(lanes.iter_mut()) {
            *x *= scale;
            *m = if *x > *m { *x } else { *m };
        }
    }
    let mut max = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    for x in chunks.into_remainder() {
        *x *= scale;
        max = if *x > max { *x } else { max };
    }
    max
});

/// `row[j] = e^(row[j] − shift)`; returns the sum (sixteen lanes, so the loop vectorises). The
/// AVX-512 and AVX2 builds fuse the exp's multiply-adds ([`exp_neg_fused`]): after the tile
/// products this is the largest part of a FlashAttention step.
fn exp_shift_sum(row: &mut [f32], shift: f32) -> f32 {
    macro_rules! body {
        ($exp:ident, $row:ident, $shift:ident) => {{
            let mut lanes = [0f32; 16];
            let mut chunks = $row.chunks_exact_mut(16);
            for c in &mut chunks {
                for (x, acc) in c.iter_mut().zip(lanes.iter_mut()) {
                    *x = $exp(*x - $shift);
                    *acc += *x;
                }
            }
            let mut sum: f32 = lanes.iter().sum();
            for x in chunks.into_remainder() {
                *x = $exp(*x - $shift);
                sum += *x;
            }
            sum
        }};
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn v4(row: &mut [f32], shift: f32) -> f32 {
            body!(exp_neg_fused, row, shift)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn v3(row: &mut [f32], shift: f32) -> f32 {
            body!(exp_neg_fused, row, shift)
        }
        if crate::isa::avx512() {
            // SAFETY: the tier in effect guarantees AVX-512F and FMA.
            return unsafe { v4(row, shift) };
        }
        if crate::isa::avx2() {
            // SAFETY: the tier in effect guarantees AVX2 and FMA.
            return unsafe { v3(row, shift) };
        }
    }
    body!(exp_neg, row, shift)
}

// `ds[j] = p[j]·(dp[j] − delta)·scale`, in place over `dp`.
dispatched!(softmax_grad_row, (p: &[f32], dp: &mut [f32], delta: f32, scale: f32), {
    for (g, &pj) in dp.iter_mut().zip(p) {
        *g = pj * (*g - delta) * scale;
    }
});

/// The first query index that sees any key of `[ks, ..)`.
fn query_start(ks: usize, p: &FlashParams) -> usize {
    if p.opts.causal {
        (p.opts.k_offset + ks).saturating_sub(p.opts.q_offset)
    } else {
        0
    }
}

fn scores_of(p: &FlashParams, d: usize, head: usize) -> Scores<'_> {
    Scores {
        p,
        scale: 1.0 / (d as f32).sqrt(),
        neg_slope: p.opts.alibi.as_ref().map(|s| -(s[head] as f32)),
    }
}

/// Counts one call and the largest tile it forms in the tests' tile counters (on the calling
/// thread; the tiles themselves are made on pool threads).
fn record_call(n: Dims, p: &FlashParams, backward: bool) {
    let mut cols = 0;
    for qs in (0..n.sq).step_by(p.block_q) {
        let nq = p.block_q.min(n.sq - qs);
        cols = cols.max(p.block_k.min(key_end(qs, nq, n.sk, p)));
    }
    let rows = p.block_q.min(n.sq);
    record(|s| {
        s.max_tile_rows = s.max_tile_rows.max(rows);
        s.max_tile_cols = s.max_tile_cols.max(cols);
        if backward {
            s.backward_calls += 1;
        } else {
            s.forward_calls += 1;
        }
    });
}

/// Rows of a query block that share one key range: the products of a tile run per group, each
/// over the keys its last row sees, so a causal diagonal tile computes little more than its
/// visible triangle (a whole tile of 256 keys per query block computed and masked half of
/// every diagonal tile: a fifth of the products at seq 1024).
const GROUP: usize = PANEL;

/// Each head's keys `[bh, sk, d]` as [`transposed_panels`], head after head.
fn key_panels(k: &[f32], heads: usize, sk: usize, d: usize) -> Vec<f32> {
    let per = panels_len(sk, d);
    let mut out = vec![0f32; heads * per];
    out.par_chunks_mut(per.max(1))
        .enumerate()
        .for_each(|(bh, panels)| {
            transposed_panels(&k[bh * sk * d..(bh + 1) * sk * d], sk, d, panels)
        });
    out
}

/// A score tile's row stride: block widths rounded up to whole panels, so a row group's
/// columns up to its next panel boundary fit.
fn score_stride(bk: usize) -> usize {
    bk.next_multiple_of(PANEL)
}

/// Forward: `(o [bh, sq, dv], lse [bh, sq])`.
pub fn forward(q: &[f32], k: &[f32], v: &[f32], n: Dims, p: &FlashParams) -> (Vec<f32>, Vec<f32>) {
    let (bq, bk) = (p.block_q, p.block_k);
    let mut o = vec![0f32; n.b * n.h * n.sq * n.dv];
    let mut lse = vec![0f32; n.b * n.h * n.sq];
    if n.sq == 0 || n.d == 0 || n.dv == 0 {
        return (o, lse); // nothing to attend with (chunking by zero would panic)
    }
    let kt = key_panels(k, n.b * n.h, n.sk, n.d);
    let per = panels_len(n.sk, n.d);
    o.par_chunks_mut(n.sq * n.dv)
        .zip(lse.par_chunks_mut(n.sq))
        .enumerate()
        .for_each(|(bh, (o, lse))| {
            let q = &q[bh * n.sq * n.d..(bh + 1) * n.sq * n.d];
            let kt = &kt[bh * per..(bh + 1) * per];
            let v = &v[bh * n.sk * n.dv..(bh + 1) * n.sk * n.dv];
            let sc = scores_of(p, n.d, bh % n.h);
            o.par_chunks_mut(bq * n.dv)
                .zip(lse.par_chunks_mut(bq))
                .enumerate()
                .for_each(|(blk, (o, lse))| {
                    forward_block(q, kt, v, n, &sc, blk * bq, bk, o, lse);
                });
        });
    (o, lse)
}

/// One query block of one head: online softmax over its key blocks, `o` and `lse` in place.
/// `kt`: the head's keys as transposed panels.
#[allow(clippy::too_many_arguments)]
fn forward_block(
    q: &[f32],
    kt: &[f32],
    v: &[f32],
    n: Dims,
    sc: &Scores<'_>,
    qs: usize,
    bk: usize,
    acc: &mut [f32],
    lse: &mut [f32],
) {
    let nq = lse.len();
    let (d, dv) = (n.d, n.dv);
    let lds = score_stride(bk);
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0f32; nq];
    let mut s = vec![0f32; nq * lds];
    let end = key_end(qs, nq, n.sk, sc.p);
    for ks in (0..end).step_by(bk) {
        let nk = bk.min(end - ks);
        for r0 in (0..nq).step_by(GROUP) {
            let r1 = (r0 + GROUP).min(nq);
            // The keys the group needs: those its last row sees (causal rows see a prefix).
            let cols = sc.visible(qs + r1 - 1, ks, nk);
            if cols == 0 {
                continue; // no row of the group sees these keys yet
            }
            // S = Q_rows · K_blkᵀ.
            let s = &mut s[r0 * lds..r1 * lds];
            times_transposed(s, lds, (r1 - r0, d), &q[(qs + r0) * d..], kt, (ks, cols));
            for i in r0..r1 {
                let row = &mut s[(i - r0) * lds..(i - r0) * lds + cols];
                let (row, row_max) = sc.finish_row(row, qs + i, ks);
                let m_new = m[i].max(row_max);
                if m_new == f32::NEG_INFINITY {
                    row.fill(0.0); // nothing visible yet in this row
                    continue;
                }
                let alpha = exp_neg(m[i] - m_new);
                l[i] = l[i] * alpha + exp_shift_sum(row, m_new);
                m[i] = m_new;
                acc[i * dv..(i + 1) * dv]
                    .iter_mut()
                    .for_each(|a| *a *= alpha);
            }
            // acc_rows += P · V_blk.
            let (acc, vb) = (&mut acc[r0 * dv..r1 * dv], &v[ks * dv..]);
            tile_matmul((r1 - r0, dv, cols), acc, dv, true, s, (lds, 1), vb, dv);
        }
    }
    for i in 0..nq {
        let inv = 1.0 / l[i];
        acc[i * dv..(i + 1) * dv].iter_mut().for_each(|a| *a *= inv);
        lse[i] = m[i] + l[i].ln();
    }
}

/// Backward: `(dq, dk, dv)` from the forward's inputs, `o`, `lse` and `do`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    n: Dims,
    p: &FlashParams,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, dv) = (n.d, n.dv);
    let mut dq = vec![0f32; n.b * n.h * n.sq * d];
    let mut dk = vec![0f32; n.b * n.h * n.sk * d];
    let mut dvv = vec![0f32; n.b * n.h * n.sk * dv];
    if n.sq == 0 || n.sk == 0 || d == 0 || dv == 0 {
        return (dq, dk, dvv);
    }
    // One task per batch·head: it owns that head's dq, dk and dv, so nothing is shared.
    dq.par_chunks_mut(n.sq * d)
        .zip(dk.par_chunks_mut(n.sk * d))
        .zip(dvv.par_chunks_mut(n.sk * dv))
        .enumerate()
        .for_each(|(bh, ((dq, dk), dvh))| {
            backward_head(
                &q[bh * n.sq * d..(bh + 1) * n.sq * d],
                &k[bh * n.sk * d..(bh + 1) * n.sk * d],
                &v[bh * n.sk * dv..(bh + 1) * n.sk * dv],
                &o[bh * n.sq * dv..(bh + 1) * n.sq * dv],
                &lse[bh * n.sq..(bh + 1) * n.sq],
                &d_o[bh * n.sq * dv..(bh + 1) * n.sq * dv],
                n,
                &scores_of(p, d, bh % n.h),
                (dq, dk, dvh),
            );
        });
    (dq, dk, dvv)
}

/// One head's backward: key blocks outer (their dK, dV accumulate in place), query blocks inner,
/// each tile's products per group of query rows (over the keys the group sees) and per group of
/// keys (over the queries that see them).
#[allow(clippy::too_many_arguments)]
fn backward_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    n: Dims,
    sc: &Scores<'_>,
    (dq, dk, dv_out): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let (d, dv) = (n.d, n.dv);
    let (bq, bk) = (sc.p.block_q, sc.p.block_k);
    // D_i = rowsum(dO ∘ O).
    let delta: Vec<f32> = (0..n.sq)
        .map(|i| {
            let r = i * dv..(i + 1) * dv;
            d_o[r.clone()].iter().zip(&o[r]).map(|(a, b)| a * b).sum()
        })
        .collect();
    let panels = |x: &[f32], e: usize| {
        let mut out = vec![0f32; panels_len(n.sk, e)];
        transposed_panels(x, n.sk, e, &mut out);
        out
    };
    let (kt, vt) = (panels(k, d), panels(v, dv));
    let lds = score_stride(bk);
    let mut pt = vec![0f32; bq * lds];
    let mut dpt = vec![0f32; bq * lds];
    for ks in (0..n.sk).step_by(bk) {
        let nk = bk.min(n.sk - ks);
        let first = query_start(ks, sc.p).min(n.sq);
        // Query blocks aligned to the forward's, from the first that sees these keys.
        for qs in ((first / bq) * bq..n.sq).step_by(bq) {
            let nq = bq.min(n.sq - qs);
            let qb = &q[qs * d..(qs + nq) * d];
            let dob = &d_o[qs * dv..(qs + nq) * dv];
            for r0 in (0..nq).step_by(GROUP) {
                let r1 = (r0 + GROUP).min(nq);
                let cols = sc.visible(qs + r1 - 1, ks, nk); // as in the forward
                if cols == 0 {
                    continue;
                }
                // The columns the key groups below read for these rows: to the next group
                // boundary, zero where not visible.
                let fill = cols.next_multiple_of(GROUP).min(nk);
                let s = &mut pt[r0 * lds..r1 * lds];
                let dp = &mut dpt[r0 * lds..r1 * lds];
                // P = exp(S − L).
                times_transposed(s, lds, (r1 - r0, d), &qb[r0 * d..], &kt, (ks, cols));
                // dP = dO_rows · V_blkᵀ.
                times_transposed(dp, lds, (r1 - r0, dv), &dob[r0 * dv..], &vt, (ks, cols));
                for i in r0..r1 {
                    let at = (i - r0) * lds;
                    let (row, _) = sc.finish_row(&mut s[at..at + fill], qs + i, ks);
                    exp_shift_sum(row, lse[qs + i]);
                    // dS = P ∘ (dP − D)·scale, zero where P is.
                    let (dpr, pr) = (&mut dp[at..at + fill], &s[at..at + fill]);
                    softmax_grad_row(&pr[..cols], &mut dpr[..cols], delta[qs + i], sc.scale);
                    dpr[cols..].fill(0.0);
                }
                // dQ_rows += dS · K_blk.
                let dqb = &mut dq[(qs + r0) * d..(qs + r1) * d];
                tile_matmul(
                    (r1 - r0, d, cols),
                    dqb,
                    d,
                    true,
                    dp,
                    (lds, 1),
                    &k[ks * d..],
                    d,
                );
            }
            // dV_keys += Pᵀ · dO and dK_keys += dSᵀ · Q, over the queries that see the keys.
            for g0 in (0..nk).step_by(GROUP) {
                let g1 = (g0 + GROUP).min(nk);
                let q0 = query_start(ks + g0, sc.p).saturating_sub(qs).min(nq);
                if q0 == nq {
                    continue;
                }
                let (rows, inner) = (g1 - g0, nq - q0);
                let (pa, da) = (&pt[q0 * lds + g0..], &dpt[q0 * lds + g0..]);
                let dvb = &mut dv_out[(ks + g0) * dv..(ks + g1) * dv];
                tile_matmul(
                    (rows, dv, inner),
                    dvb,
                    dv,
                    true,
                    pa,
                    (1, lds),
                    &dob[q0 * dv..],
                    dv,
                );
                let dkb = &mut dk[(ks + g0) * d..(ks + g1) * d];
                tile_matmul(
                    (rows, d, inner),
                    dkb,
                    d,
                    true,
                    da,
                    (1, lds),
                    &qb[q0 * d..],
                    d,
                );
            }
        }
    }
}

/// On CPU: f32 tensors run the fused kernel of this file; other dtypes run the tiled algorithm
/// of `tiled.rs` (burn tensor ops on tiles, so any backend that runs burn's ops runs it).
/// CubeCL backends (CUDA, wgpu) launch the fused kernels of `cube.rs` instead and fall back to
/// the tiled functions only for shapes those kernels do not take.
impl FlashAttentionOps for Flex {
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v): (Tensor<4>, Tensor<4>, Tensor<4>) =
            (Self::tensor(q), Self::tensor(k), Self::tensor(v));
        let (o, lse) = if [&q, &k, &v].iter().all(|t| t.dtype() == DType::F32) {
            let n = dims_of(&q, &k, &v);
            record_call(n, &params, false);
            let device = q.device();
            let (q, k, v) = (host(q), host(k), host(v));
            let (o, lse) = forward(values(&q), values(&k), values(&v), n, &params);
            (
                Tensor::<4>::from_data(TensorData::new(o, [n.b, n.h, n.sq, n.dv]), &device),
                Tensor::<3>::from_data(TensorData::new(lse, [n.b, n.h, n.sq]), &device),
            )
        } else {
            tiled_forward(q, k, v, &params)
        };
        (Self::prim(o), Self::prim(lse))
    }

    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, o, d_o): (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<4>, Tensor<4>) = (
            Self::tensor(q),
            Self::tensor(k),
            Self::tensor(v),
            Self::tensor(o),
            Self::tensor(d_o),
        );
        let lse: Tensor<3> = Self::tensor(lse);
        let f32s = [&q, &k, &v, &o, &d_o]
            .iter()
            .all(|t| t.dtype() == DType::F32)
            && lse.dtype() == DType::F32;
        let (dq, dk, dv) = if f32s {
            let n = dims_of(&q, &k, &v);
            record_call(n, &params, true);
            let device = q.device();
            let (q, k, v, o, lse, d_o) = (host(q), host(k), host(v), host(o), host(lse), host(d_o));
            let (dq, dk, dv) = backward(
                values(&q),
                values(&k),
                values(&v),
                values(&o),
                values(&lse),
                values(&d_o),
                n,
                &params,
            );
            let t = |x: Vec<f32>, s: usize, e: usize| {
                Tensor::<4>::from_data(TensorData::new(x, [n.b, n.h, s, e]), &device)
            };
            (t(dq, n.sq, n.d), t(dk, n.sk, n.d), t(dv, n.sk, n.dv))
        } else {
            tiled_backward(q, k, v, o, lse, d_o, &params)
        };
        (Self::prim(dq), Self::prim(dk), Self::prim(dv))
    }
}

fn dims_of(q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>) -> Dims {
    let [b, h, sq, d] = q.dims();
    let [_, _, sk, dv] = v.dims();
    debug_assert_eq!(k.dims()[2], sk);
    Dims {
        b,
        h,
        sq,
        sk,
        d,
        dv,
    }
}
