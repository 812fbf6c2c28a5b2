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
//! For a layer whose rows run in parts (the MLP between the ring's or Ulysses' exchanges,
//! `parallel::ring_overlap`), [`linear_part`] gathers the parts' inputs and output gradients
//! ([`WeightParts`]) and computes the weight's gradient once, over all rows, when the last
//! part's backward runs: one product of full depth, where each part's own (a product of a
//! fifth of the rows, summed by autodiff into the weight) cost five output-sized writes and
//! four output-sized sums per weight, and the result is the whole layer's, summed in the same
//! order.
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
        route: Option<WeightRoute>,
    ) -> FloatTensor<Self>;
}

/// Where a linear op's weight gradient goes when not straight back to the weight.
#[derive(Clone, Debug)]
pub enum WeightRoute {
    /// Queued for later (the weight untracked).
    Defer(DeferTo),
    /// One part of the rows: the weight (tracked, the same tensor in every part) gets the
    /// gradient of all parts from the part whose backward completes the set.
    Part(PartOf),
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
        _route: Option<WeightRoute>,
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

/// The parts of one layer's rows that share a weight: each part's backward leaves its input
/// and output gradient here, and the one that completes the set computes the weight's gradient
/// over all rows (in part order, so the sum runs as over the whole).
#[derive(Clone)]
pub struct WeightParts(Arc<Mutex<Gathered>>);

struct Gathered {
    parts: usize,
    /// (part, its `(x, dy)` as the inner backend's primitives).
    got: Vec<(usize, Box<dyn std::any::Any + Send>)>,
}

impl WeightParts {
    /// A weight used by `parts` parts of the rows, each exactly once.
    pub fn new(parts: usize) -> Self {
        WeightParts(Arc::new(Mutex::new(Gathered {
            parts,
            got: Vec::new(),
        })))
    }

    /// Where part `index` (counted from 0 in row order) sends its weight gradient.
    pub fn part(&self, index: usize) -> WeightRoute {
        WeightRoute::Part(PartOf {
            index,
            group: self.clone(),
        })
    }
}

impl std::fmt::Debug for WeightParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        write!(f, "WeightParts({} of {} in)", g.got.len(), g.parts)
    }
}

/// One part of a [`WeightParts`] set.
#[derive(Clone, Debug)]
pub struct PartOf {
    index: usize,
    group: WeightParts,
}

impl PartOf {
    /// Leaves this part's `x` and `dy`; the weight's gradient over all parts' rows once every
    /// part has left its own, else `None` (the weight gets nothing from this part).
    fn gather<B: LinearKernels>(
        &self,
        x: FloatTensor<B>,
        dy: FloatTensor<B>,
    ) -> Option<FloatTensor<B>> {
        let mut g = self.group.0.lock().unwrap_or_else(|p| p.into_inner());
        g.got.push((self.index, Box::new((x, dy))));
        if g.got.len() < g.parts {
            return None;
        }
        let mut got = std::mem::take(&mut g.got);
        drop(g);
        got.sort_by_key(|(i, _)| *i);
        let (xs, dys): (Vec<_>, Vec<_>) = got
            .into_iter()
            .map(|(_, pair)| {
                *pair
                    .downcast::<(FloatTensor<B>, FloatTensor<B>)>()
                    .expect("a weight's parts run on one backend")
            })
            .unzip();
        // `[b, s_k, n]` parts: rows joined along the sequence, batch by batch as in the whole.
        Some(B::linear_bwd_weight(
            B::float_cat(xs, 1),
            B::float_cat(dys, 1),
        ))
    }
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
    // `detach` alone keeps a leaf that requires a gradient tracked (as a new leaf).
    let w = w.detach().set_require_grad(false);
    linear_routed(x, w, b, WeightRoute::Defer(to))
}

/// [`linear`] on one part of a layer's rows, `part` from a [`WeightParts`] that every part
/// shares, as they share `w` (one tensor: autodiff gives it only the gathered gradient).
pub fn linear_part(
    x: Tensor<3>,
    w: Tensor<2>,
    b: Option<Tensor<1>>,
    part: WeightRoute,
) -> Tensor<3> {
    linear_routed(x, w, b, part)
}

/// The op with its weight gradient sent along `route`; without a bias, a zero bias that needs
/// no gradient.
fn linear_routed(
    x: Tensor<3>,
    w: Tensor<2>,
    b: Option<Tensor<1>>,
    route: WeightRoute,
) -> Tensor<3> {
    let b = b.unwrap_or_else(|| Tensor::zeros([w.dims()[1]], (&x.device(), w.dtype())));
    Tensor::from_dispatch(<Dispatch as LinearOps>::linear(
        x.into_dispatch(),
        w.into_dispatch(),
        b.into_dispatch(),
        Some(route),
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
