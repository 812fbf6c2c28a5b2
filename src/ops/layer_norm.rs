//! LayerNorm over the last dimension as one fused op with a hand-written backward.
//!
//! Under autodiff, burn composes LayerNorm from nine tensor ops (mean, centre, square, mean,
//! add ε, square root, divide, scale, shift): each writes a temporary as large as the input,
//! autodiff keeps several of them for the backward, and the backward runs one more op per
//! recorded one. Fused, the forward is one pass per row that keeps only the row's mean and
//! 1/σ, and the backward one pass per row for the input's gradient, with per-task column sums
//! for the weight's and the bias's:
//!   x̂ = (x − μ)·r,  y = x̂·γ + β;
//!   dx = r·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·γ;  dγ = Σ dy·x̂;  dβ = Σ dy.
//!
//! Same extension pattern as `gelu.rs`: the loops below for `Flex`, a [`Backward`] for
//! `Autodiff`, and the formulas as tensor ops for CubeCL backends.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
    Autodiff,
};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::primitive::Primitive;
use super::simd::{dispatched, host_f32, values};

/// The op on `[b, s, h]` inputs with `[h]` weight and bias: under autodiff it saves the input,
/// the weight and the statistics, and its backward is [`LayerNormKernels::layer_norm_bwd`];
/// elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait LayerNormOps: Backend {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self>;
}

/// The op's kernels, on the backends that compute.
pub trait LayerNormKernels: Backend {
    /// `(y, μ, r)`: the output and each row's mean and 1/√(var + ε) (`[b, s, 1]`).
    fn layer_norm_fwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
    /// `(dx, dγ, dβ)` from the input, the weight, the forward's statistics and `dy`.
    fn layer_norm_bwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl<B: LayerNormKernels> LayerNormOps for B {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        B::layer_norm_fwd(x, gamma, beta, eps).0
    }
}

/// LayerNorm of `x: [b, s, h]` with weight and bias `[h]`, differentiable on an autodiff
/// device.
pub fn layer_norm(x: Tensor<3>, gamma: Tensor<1>, beta: Tensor<1>, eps: f64) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as LayerNormOps>::layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        eps,
    ))
}

/// The composed forward (CubeCL backends and non-f32 CPU tensors): `(y, μ, r)`.
fn fwd_composed(
    x: Tensor<3>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    eps: f64,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let mean = x.clone().mean_dim(2);
    let c = x - mean.clone();
    let rstd = ((c.clone() * c.clone()).mean_dim(2) + eps).sqrt().recip();
    let y = c * rstd.clone() * gamma.unsqueeze::<3>() + beta.unsqueeze::<3>();
    (y, mean, rstd)
}

/// The composed backward: `(dx, dγ, dβ)`.
fn bwd_composed(
    x: Tensor<3>,
    gamma: Tensor<1>,
    mean: Tensor<3>,
    rstd: Tensor<3>,
    dy: Tensor<3>,
) -> (Tensor<3>, Tensor<1>, Tensor<1>) {
    let h = x.dims()[2];
    let xhat = (x - mean) * rstd.clone();
    let g = dy.clone() * gamma.unsqueeze::<3>();
    let a = g.clone().mean_dim(2);
    let b = (g.clone() * xhat.clone()).mean_dim(2);
    let dx = (g - a - xhat.clone() * b) * rstd;
    let col_sum = |t: Tensor<3>| t.reshape([-1, h as i64]).sum_dim(0).reshape([h]);
    (dx, col_sum(dy.clone() * xhat), col_sum(dy))
}

/// Rows per task: enough work to amortise the hand-off, and few column-sum partials.
const ROWS: usize = 32;

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
struct Stats<T> {
    mean: T,
    rstd: T,
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

fn fwd_slices(x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) -> (Vec<f32>, Stats<Vec<f32>>) {
    let h = gamma.len();
    let mut y = vec![0.0; x.len()];
    let (mut mean, mut rstd) = (vec![0.0; x.len() / h], vec![0.0; x.len() / h]);
    y.par_chunks_mut(ROWS * h)
        .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
        .zip(x.par_chunks(ROWS * h))
        .for_each(|((y, (mean, rstd)), x)| fwd_rows(x, gamma, beta, eps, y, Stats { mean, rstd }));
    (y, Stats { mean, rstd })
}

fn bwd_slices(x: &[f32], gamma: &[f32], st: Stats<&[f32]>, dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
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

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl LayerNormKernels for burn::backend::Cube {
    fn layer_norm_fwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (y, m, r) = fwd_composed(
            Self::tensor(x),
            Self::tensor(gamma),
            Self::tensor(beta),
            eps,
        );
        (Self::prim(y), Self::prim(m), Self::prim(r))
    }

    fn layer_norm_bwd(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, dg, db) = bwd_composed(
            Self::tensor(x),
            Self::tensor(gamma),
            Self::tensor(mean),
            Self::tensor(rstd),
            Self::tensor(dy),
        );
        (Self::prim(dx), Self::prim(dg), Self::prim(db))
    }
}

impl<B: LayerNormKernels, Ck: CheckpointStrategy> LayerNormOps for Autodiff<B, Ck> {
    fn layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct LayerNormBackward;

        impl<B: LayerNormKernels> Backward<B, 3> for LayerNormBackward {
            // The input, the weight, and the row statistics.
            type State = (
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
                FloatTensor<B>,
            );

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_g, node_b] = ops.parents;
                let dy = grads.consume::<B>(&ops.node);
                let (x, gamma, mean, rstd) = ops.state;
                let (dx, dg, db) = B::layer_norm_bwd(x, gamma, mean, rstd, dy);
                for (node, g) in [(node_x, dx), (node_g, dg), (node_b, db)] {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, g);
                    }
                }
            }
        }

        match LayerNormBackward
            .prepare::<Ck>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, gp) = (x.primitive().clone(), gamma.primitive().clone());
                let (y, m, r) =
                    B::layer_norm_fwd(xp.clone(), gp.clone(), beta.into_primitive(), eps);
                prep.finish((xp, gp, m, r), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as LayerNormOps>::layer_norm(
                x.into_primitive(),
                gamma.into_primitive(),
                beta.into_primitive(),
                eps,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn data(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.618_034 + seed).fract() - 0.5) * 6.0 + seed)
            .collect()
    }

    /// The loops against the formulas in f64, over more rows than one task and a width that
    /// is not a multiple of the vector lanes.
    #[test]
    fn slices_match_f64_formulas() {
        let (rows, h) = (2 * ROWS + 5, 37);
        let (x, dy) = (data(rows * h, 0.3), data(rows * h, -0.1));
        let (g, b) = (data(h, 1.0), data(h, 0.2));
        let eps = 1e-5;
        let (y, st) = fwd_slices(&x, &g, &b, eps as f32);
        let stats = Stats {
            mean: &st.mean[..],
            rstd: &st.rstd[..],
        };
        let (dx, cols) = bwd_slices(&x, &g, stats, &dy);
        let (mut dg, mut db) = (vec![0f64; h], vec![0f64; h]);
        for r in 0..rows {
            let xr: Vec<f64> = x[r * h..(r + 1) * h].iter().map(|&v| v.into()).collect();
            let dyr: Vec<f64> = dy[r * h..(r + 1) * h].iter().map(|&v| v.into()).collect();
            let mean = xr.iter().sum::<f64>() / h as f64;
            let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / h as f64;
            let rs = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = xr.iter().map(|v| (v - mean) * rs).collect();
            let gg: Vec<f64> = (0..h).map(|i| dyr[i] * g[i] as f64).collect();
            let a = gg.iter().sum::<f64>() / h as f64;
            let bb = (0..h).map(|i| gg[i] * xhat[i]).sum::<f64>() / h as f64;
            for i in 0..h {
                let want_y = xhat[i] * g[i] as f64 + b[i] as f64;
                let want_dx = rs * (gg[i] - a - xhat[i] * bb);
                let (got_y, got_dx) = (y[r * h + i] as f64, dx[r * h + i] as f64);
                assert!(
                    (got_y - want_y).abs() < 1e-5 * (1.0 + want_y.abs()),
                    "y {r},{i}"
                );
                assert!(
                    (got_dx - want_dx).abs() < 1e-5 * (1.0 + want_dx.abs()),
                    "dx {r},{i}"
                );
                dg[i] += dyr[i] * xhat[i];
                db[i] += dyr[i];
            }
        }
        for i in 0..h {
            assert!(
                (cols[i] as f64 - dg[i]).abs() < 1e-4 * (1.0 + dg[i].abs()),
                "dγ {i}"
            );
            assert!(
                (cols[h + i] as f64 - db[i]).abs() < 1e-4 * (1.0 + db[i].abs()),
                "dβ {i}"
            );
        }
    }

    /// Under autodiff, the output and all three gradients equal burn differentiating its own
    /// (composed) LayerNorm.
    #[test]
    fn autodiff_gradients_equal_burns_layer_norm() {
        let ad = Device::flex().autodiff();
        let (b, s, h) = (2, 3, 50);
        let (xv, wv) = (data(b * s * h, 0.7), data(b * s * h, -0.4));
        let (gv, bv) = (data(h, 1.1), data(h, 0.05));
        type Norm = fn(Tensor<3>, Tensor<1>, Tensor<1>, f64) -> Tensor<3>;
        let run = |f: Norm| {
            let x =
                Tensor::<3>::from_data(TensorData::new(xv.clone(), [b, s, h]), &ad).require_grad();
            let g = Tensor::<1>::from_data(TensorData::new(gv.clone(), [h]), &ad).require_grad();
            let be = Tensor::<1>::from_data(TensorData::new(bv.clone(), [h]), &ad).require_grad();
            let w = Tensor::<3>::from_data(TensorData::new(wv.clone(), [b, s, h]), &ad);
            let y = f(x.clone(), g.clone(), be.clone(), 1e-5);
            let grads = (y.clone() * w).sum().backward();
            let v = |t: burn::tensor::TensorData| t.try_into_vec::<f32>().unwrap();
            [
                v(y.without_autodiff().into_data()),
                v(x.grad(&grads).expect("dx").into_data()),
                v(g.grad(&grads).expect("dγ").into_data()),
                v(be.grad(&grads).expect("dβ").into_data()),
            ]
        };
        let ours = run(layer_norm);
        let burns = run(|x, g, b, eps| burn::tensor::module::layer_norm(x, g, Some(b), eps));
        for (k, (o, r)) in ours.iter().zip(&burns).enumerate() {
            for (i, (o, r)) in o.iter().zip(r).enumerate() {
                assert!(
                    (o - r).abs() < 2e-5 * (1.0 + r.abs()),
                    "output {k} at {i}: {o} vs {r}"
                );
            }
        }
    }
}
