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
//! Same extension pattern as `gelu.rs`, one role per file: the traits, the public function
//! and the composed reference here; the loops for `Flex` in `cpu.rs`, the autodiff node in
//! `backward.rs`, the formulas as tensor ops for CubeCL backends in `cube.rs`, the tests
//! against the composed reference and an f64 one in `tests.rs`.

use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::Tensor;

mod backward;
mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube;
#[cfg(test)]
mod tests;

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
    let col_sum = |t: Tensor<3>| crate::ops::reduce::col_sum(t.reshape([-1, h as i64]));
    (dx, col_sum(dy.clone() * xhat), col_sum(dy))
}
