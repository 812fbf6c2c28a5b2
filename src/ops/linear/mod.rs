//! Linear layers with a bias, `y = x·W + b`, as one op with a hand-written backward.
//!
//! burn composes `linear` from a matmul and a broadcast add, and on CPU the matmul pays twice
//! for its output: flex allocates it as a byte vector, then copies that into a 16-byte-aligned
//! buffer (`FlexTensor::empty` → `Bytes::from_bytes_vec`), so every product is written, copied
//! and page-faulted twice: about a tenth of a genslm-25m training step at 2048 tokens on the
//! 2-core dev VM (perf, 2026-11-24). Here the forward writes each row's bias into a buffer it
//! owns and lets gemm accumulate the product onto it; the backward is two gemm calls into new
//! buffers (`dx = dy·Wᵀ`, `dW = xᵀ·dy` over all rows at once) and one pass of column sums
//! for `db`. Products without a bias (the output head, tensor-parallel row slices) stay burn's
//! `linear` (the extension macro takes no optional tensors).
//!
//! Same extension pattern as `gelu.rs`, one role per file: the traits, the public function and
//! the composed backward here; the loops for f32 `Flex` tensors in `cpu.rs`, the autodiff node
//! in `backward.rs`, burn's own linear ops for CubeCL backends in `cube.rs`, the tests in
//! `tests.rs`.

use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::Tensor;

mod backward;
mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube;
#[cfg(test)]
mod tests;

/// The op on `x: [b, s, n]`, `w: [n, m]`, `b: [m]`: under autodiff it saves the input and the
/// weight, and its backward is [`LinearKernels::linear_bwd`]; elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait LinearOps: Backend {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// The op's kernels, on the backends that compute.
pub trait LinearKernels: Backend {
    /// `x·w + b`: `[b, s, m]`.
    fn linear_fwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `(dx, dw, db)` from the input, the weight and `dy`.
    fn linear_bwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

impl<B: LinearKernels> LinearOps for B {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        B::linear_fwd(x, w, b)
    }
}

/// `x·w (+ b)` for `x: [b, s, n]`, `w: [n, m]`, `b: [m]`, differentiable on an autodiff device.
pub fn linear(x: Tensor<3>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<3> {
    match b {
        Some(b) => Tensor::from_dispatch(<Dispatch as LinearOps>::linear(
            x.into_dispatch(),
            w.into_dispatch(),
            b.into_dispatch(),
        )),
        None => burn::tensor::module::linear(x, w, None),
    }
}

/// The backward from burn's tensor ops (CubeCL backends and non-f32 CPU tensors).
fn bwd_composed(x: Tensor<3>, w: Tensor<2>, dy: Tensor<3>) -> (Tensor<3>, Tensor<2>, Tensor<1>) {
    let [b, s, n] = x.dims();
    let m = w.dims()[1];
    let dx = dy.clone().matmul(w.transpose().unsqueeze::<3>());
    let rows = dy.reshape([b * s, m]);
    let dw = x.reshape([b * s, n]).transpose().matmul(rows.clone());
    let db = rows.sum_dim(0).reshape([m]);
    (dx, dw, db)
}
