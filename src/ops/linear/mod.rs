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
//! For zero-bubble pipelines the backward splits: [`linear_deferred`] leaves the weight's
//! product to [`WeightGrads`], run later in the schedule's W pass, while the backward computes
//! only what the previous stage waits for.
//!
//! Same extension pattern as `gelu.rs`, one role per file: the traits, the public function and
//! the composed backward here; the loops for f32 `Flex` tensors in `cpu.rs`, the autodiff node
//! in `backward.rs`, burn's own linear ops for CubeCL backends in `cube.rs`, the tests in
//! `tests.rs`.

use std::sync::{Arc, Mutex};

use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch};
use burn::tensor::Tensor;

mod backward;
mod cpu;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube;
#[cfg(test)]
mod tests;

/// The op on `x: [b, s, n]`, `w: [n, m]`, `b: [m]`: under autodiff it saves the input and the
/// weight, and its backward is [`LinearKernels`]' three kernels, each run only for an input
/// that needs its gradient; with `defer`, the weight's is left to [`WeightGrads`] (the weight
/// must then be untracked); elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait LinearOps: Backend {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        defer: Option<DeferTo>,
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
    /// `dx = dy·wᵀ`: `[b, s, n]`.
    fn linear_bwd_input(w: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `dw = xᵀ·dy` summed over every row: `[n, m]`.
    fn linear_bwd_weight(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `db`, the column sums of `dy`: `[m]`.
    fn linear_bwd_bias(dy: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `(dx, dw, db)` from the input, the weight and `dy`.
    fn linear_bwd(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let db = Self::linear_bwd_bias(dy.clone());
        let dw = Self::linear_bwd_weight(x, dy.clone());
        (Self::linear_bwd_input(w, dy), dw, db)
    }
}

impl<B: LinearKernels> LinearOps for B {
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        _defer: Option<DeferTo>,
    ) -> FloatTensor<Self> {
        B::linear_fwd(x, w, b)
    }
}

/// Weight gradients left for later: zero-bubble pipeline schedules split a backward into B (the
/// input gradient, which the previous stage waits for) and W (the weight gradient, which fills
/// the schedule's bubbles). A linear op given a [`DeferTo`] computes `dx` (and `db`) in the
/// backward and queues here the product `dw = xᵀ·dy`, holding `x` and `dy` until
/// [`WeightGrads::take`] runs it.
#[derive(Clone, Default)]
pub struct WeightGrads(Arc<Mutex<Vec<(usize, DeferredProduct)>>>);

/// One queued weight-gradient product.
type DeferredProduct = Box<dyn FnOnce() -> Tensor<2> + Send>;

impl WeightGrads {
    /// Where a linear op of parameter `param` leaves its weight gradient.
    pub fn to(&self, param: usize) -> DeferTo {
        DeferTo {
            param,
            sink: self.clone(),
        }
    }

    fn push(&self, param: usize, product: DeferredProduct) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((param, product));
    }

    /// Runs the queued products: `(param, dw)` in the order the backward queued them.
    pub fn take(&self) -> Vec<(usize, Tensor<2>)> {
        let queued = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        queued.into_iter().map(|(i, f)| (i, f())).collect()
    }

    /// Products queued and not yet taken.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for WeightGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightGrads({} queued)", self.len())
    }
}

/// A linear op's deferred weight gradient: the parameter it belongs to and the queue.
#[derive(Clone, Debug)]
pub struct DeferTo {
    pub param: usize,
    sink: WeightGrads,
}

/// `x·w (+ b)` for `x: [b, s, n]`, `w: [n, m]`, `b: [m]`, differentiable on an autodiff device.
pub fn linear(x: Tensor<3>, w: Tensor<2>, b: Option<Tensor<1>>) -> Tensor<3> {
    match b {
        Some(b) => Tensor::from_dispatch(<Dispatch as LinearOps>::linear(
            x.into_dispatch(),
            w.into_dispatch(),
            b.into_dispatch(),
            None,
        )),
        None => burn::tensor::module::linear(x, w, None),
    }
}

/// [`linear`] whose weight gradient goes to `to` instead of the backward: `w` is used
/// untracked (detached here), so autodiff sends it no gradient; without a bias, a zero bias
/// that needs none.
pub fn linear_deferred(x: Tensor<3>, w: Tensor<2>, b: Option<Tensor<1>>, to: DeferTo) -> Tensor<3> {
    let b = b.unwrap_or_else(|| Tensor::zeros([w.dims()[1]], (&x.device(), w.dtype())));
    Tensor::from_dispatch(<Dispatch as LinearOps>::linear(
        x.into_dispatch(),
        // `detach` alone keeps a leaf that requires a gradient tracked (as a new leaf).
        w.detach().set_require_grad(false).into_dispatch(),
        b.into_dispatch(),
        Some(to),
    ))
}

/// `dx = dy·wᵀ` from burn's tensor ops (CubeCL backends and non-f32 CPU tensors).
fn dx_composed(w: Tensor<2>, dy: Tensor<3>) -> Tensor<3> {
    dy.matmul(w.transpose().unsqueeze::<3>())
}

/// `dw = xᵀ·dy` over every row, from burn's tensor ops.
fn dw_composed(x: Tensor<3>, dy: Tensor<3>) -> Tensor<2> {
    let [b, s, n] = x.dims();
    let m = dy.dims()[2];
    x.reshape([b * s, n])
        .transpose()
        .matmul(dy.reshape([b * s, m]))
}

/// `db`, from burn's tensor ops.
fn db_composed(dy: Tensor<3>) -> Tensor<1> {
    let [b, s, m] = dy.dims();
    crate::ops::reduce::col_sum(dy.reshape([b * s, m]))
}
