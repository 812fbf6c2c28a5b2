//! LayerNorm on f32 `Flex` tensors: one pass per row for the forward (mean and 1/σ kept), one
//! per row for the input gradient with per-task column sums for dγ and dβ, in loops compiled
//! for the widest vectors the CPU has.

use burn::backend::{tensor::FloatTensor, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::ops::primitive::Primitive;
use crate::ops::simd::{dispatched, host_f32, values};

use super::*;

/// Rows per task: enough work to amortise the hand-off, and few column-sum partials.
pub(super) const ROWS: usize = 32;

/// Σ of a row in sixteen independent lanes (a single f32 sum would not vectorise).
#[inline(always)]
fn lane_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let full = n / 16 * 16;
    for base in (0..full).step_by(16) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a += f(base + j);
        }
    }
    acc.iter().sum::<f32>() + (full..n).map(f).sum::<f32>()
}

/// A row's statistics: its mean and 1/√(var + ε), one value per row each.
pub(super) struct Stats<T> {
    pub(super) mean: T,
    pub(super) rstd: T,
}

dispatched!(fwd_rows, (x: &[f32], gamma: &[f32], beta: &[f32], eps: f32, y: &mut [f32], st: Stats<&mut [f32]>), {
    let h = gamma.len();
    let rows = x.chunks_exact(h).zip(y.chunks_exact_mut(h));
    for (((x, y), mean), rstd) in rows.zip(st.mean.iter_mut()).zip(st.rstd.iter_mut()) {
        let m = lane_sum(h, |i| x[i]) / h as f32;
        let var = lane_sum(h, |i| (x[i] - m) * (x[i] - m)) / h as f32;
        let r = 1.0 / (var + eps).sqrt();
        for i in 0..h {
            y[i] = (x[i] - m) * r * gamma[i] + beta[i];
        }
        *mean = m;
        *rstd = r;
    }
});

// `cols` holds dγ's partial sums then dβ's (2·h).
dispatched!(bwd_rows, (x: &[f32], gamma: &[f32], st: Stats<&[f32]>, dy: &[f32], dx: &mut [f32], cols: &mut [f32]), {
    let h = gamma.len();
    let (dg, db) = cols.split_at_mut(h);
    let rows = x.chunks_exact(h).zip(dy.chunks_exact(h)).zip(dx.chunks_exact_mut(h));
    for (((x, dy), dx), (&mean, &r)) in rows.zip(st.mean.iter().zip(st.rstd)) {
        let a = lane_sum(h, |i| dy[i] * gamma[i]) / h as f32;
        let b = lane_sum(h, |i| dy[i] * gamma[i] * (x[i] - mean) * r) / h as f32;
        for i in 0..h {
            let xhat = (x[i] - mean) * r;
            dx[i] = r * (dy[i] * gamma[i] - a - xhat * b);
            dg[i] += dy[i] * xhat;
            db[i] += dy[i];
        }
    }
});

pub(super) fn fwd_slices(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) -> (Vec<f32>, Stats<Vec<f32>>) {
    let h = gamma.len();
    let mut y = vec![0.0; x.len()];
    let (mut mean, mut rstd) = (vec![0.0; x.len() / h], vec![0.0; x.len() / h]);
    y.par_chunks_mut(ROWS * h)
        .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
        .zip(x.par_chunks(ROWS * h))
        .for_each(|((y, (mean, rstd)), x)| fwd_rows(x, gamma, beta, eps, y, Stats { mean, rstd }));
    (y, Stats { mean, rstd })
}

pub(super) fn bwd_slices(
    x: &[f32],
    gamma: &[f32],
    st: Stats<&[f32]>,
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let h = gamma.len();
    let mut dx = vec![0.0; x.len()];
    let cols = dx
        .par_chunks_mut(ROWS * h)
        .zip(x.par_chunks(ROWS * h).zip(dy.par_chunks(ROWS * h)))
        .zip(st.mean.par_chunks(ROWS).zip(st.rstd.par_chunks(ROWS)))
        .map(|((dx, (x, dy)), (mean, rstd))| {
            let mut cols = vec![0.0f32; 2 * h];
            bwd_rows(x, gamma, Stats { mean, rstd }, dy, dx, &mut cols);
            cols
        })
        .reduce(
            || vec![0.0f32; 2 * h],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            },
        );
    (dx, cols)
}

impl LayerNormKernels for Flex {
    fn layer_norm_fwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, gamma, beta): (Tensor<3>, Tensor<1>, Tensor<1>) =
            (Self::tensor(x), Self::tensor(gamma), Self::tensor(beta));
        if [x.dtype(), gamma.dtype(), beta.dtype()] != [DType::F32; 3] {
            let (y, m, r) = fwd_composed(x, gamma, beta, eps);
            return (Self::prim(y), Self::prim(m), Self::prim(r));
        }
        let ([b, s, h], device) = (x.dims(), x.device());
        let (x, gamma, beta) = (host_f32(x), host_f32(gamma), host_f32(beta));
        let (y, st) = fwd_slices(values(&x), values(&gamma), values(&beta), eps as f32);
        let t3 = |v: Vec<f32>, w: usize| {
            Self::prim(Tensor::<3>::from_data(
                TensorData::new(v, [b, s, w]),
                &device,
            ))
        };
        (t3(y, h), t3(st.mean, 1), t3(st.rstd, 1))
    }

    fn layer_norm_bwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (x, gamma, dy): (Tensor<3>, Tensor<1>, Tensor<3>) =
            (Self::tensor(x), Self::tensor(gamma), Self::tensor(dy));
        let (mean, rstd): (Tensor<3>, Tensor<3>) = (Self::tensor(mean), Self::tensor(rstd));
        let f32s = [
            x.dtype(),
            gamma.dtype(),
            dy.dtype(),
            mean.dtype(),
            rstd.dtype(),
        ];
        if f32s != [DType::F32; 5] {
            let (dx, dg, db) = bwd_composed(x, gamma, mean, rstd, dy);
            return (Self::prim(dx), Self::prim(dg), Self::prim(db));
        }
        let ([b, s, h], device) = (x.dims(), x.device());
        let (x, gamma, dy) = (host_f32(x), host_f32(gamma), host_f32(dy));
        let (mean, rstd) = (host_f32(mean), host_f32(rstd));
        let st = Stats {
            mean: values(&mean),
            rstd: values(&rstd),
        };
        let (dx, mut cols) = bwd_slices(values(&x), values(&gamma), st, values(&dy));
        let db = cols.split_off(h);
        let t1 = |v: Vec<f32>| Self::prim(Tensor::<1>::from_data(TensorData::new(v, [h]), &device));
        let dx = Self::prim(Tensor::<3>::from_data(
            TensorData::new(dx, [b, s, h]),
            &device,
        ));
        (dx, t1(cols), t1(db))
    }
}
