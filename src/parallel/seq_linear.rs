//! Megatron sequence parallelism's column-parallel linear: `y = gather(x)·W + b`, where `x` is
//! this TP rank's part of the sequence and the gather joins the group's parts, as one op that
//! keeps only `x` for its backward and gathers it again there (Megatron-LM does the same), so
//! the `[b, T·c, n]` gathered input is never alive between the forward and the backward: the
//! activation saving Megatron SP exists for. Its backward reduce-scatters the input gradient
//! back over the sequence and returns the weight and bias gradients of the whole sequence.
//!
//! Composed from the TP group's gather and reduce-scatter of flat tensors (sequence-first, so a
//! rank's block is its run of tokens, as `parallel::tensor` lays them out) and the linear op's own kernels
//! (`ops::linear::LinearKernels`), so every backend computes it as it computes a linear layer.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::Tensor;

use std::sync::Arc;

use crate::ops::autodiff::{differentiable, HandBackward};
use crate::ops::linear::LinearKernels;
use crate::parallel::comm::Communicator;

/// The op's non-tensor argument: the TP group.
#[derive(Debug, Clone)]
pub struct SeqParams {
    pub comm: Arc<dyn Communicator>,
}

/// Which way a tensor travels along the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Along {
    /// Every rank's part joined, in rank order.
    Gather,
    /// This rank's part of the group's sum.
    Scatter,
}

#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait SeqLinearOps: Backend {
    /// `gather(x)·w + b` for `x: [b, c, n]` (this rank's tokens), `w: [n, m]`, `b: [m]`:
    /// `[b, T·c, m]`.
    fn seq_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        params: SeqParams,
    ) -> FloatTensor<Self>;
}

/// The gather and the reduce-scatter over the sequence of `[b, c, h]` tensors, on the backends
/// that compute (the op's forward and backward run there).
pub trait SeqCollectives: LinearKernels {
    /// Every rank's `x` joined along the sequence, or this rank's part of the group's sum.
    fn along_seq(x: FloatTensor<Self>, params: &SeqParams, way: Along) -> FloatTensor<Self>;
}

/// `collective` applied to `x: [b, c, h]` laid out sequence-first, so that a rank's block of the
/// flat tensor is its contiguous run of tokens (as Megatron lays activations out); the result
/// back as `[b, rows, h]`, `rows` = the tokens the collective returned (`T·c` gathered, `c/T`
/// reduce-scattered).
pub fn along_sequence(x: Tensor<3>, collective: impl FnOnce(Tensor<1>) -> Tensor<1>) -> Tensor<3> {
    let [b, c, h] = x.dims();
    let out = collective(x.swap_dims(0, 1).reshape([c * b * h]));
    let rows = out.dims()[0] / (b * h);
    out.reshape([rows, b, h]).swap_dims(0, 1)
}

macro_rules! seq_linear_for {
    ($backend:ty) => {
        impl SeqCollectives for $backend {
            fn along_seq(
                x: FloatTensor<Self>,
                params: &SeqParams,
                way: Along,
            ) -> FloatTensor<Self> {
                let x = Tensor::<3>::from_primitive::<Self>(x);
                along_sequence(x, |flat| {
                    match way {
                        Along::Gather => params.comm.all_gather_tensor(flat),
                        Along::Scatter => params.comm.reduce_scatter_tensor(flat),
                    }
                    .unwrap_or_else(|e| panic!("sequence-parallel linear: {way:?} failed: {e}"))
                })
                .try_into_primitive::<Self>()
                .expect("sequence-parallel linear: the collective left the backend")
            }
        }

        impl SeqLinearOps for $backend {
            fn seq_linear(
                x: FloatTensor<Self>,
                w: FloatTensor<Self>,
                b: FloatTensor<Self>,
                params: SeqParams,
            ) -> FloatTensor<Self> {
                <SeqLinear as HandBackward<Self, 3>>::forward(&SeqLinear(params), [x, w, b], false)
                    .0
            }
        }
    };
}

seq_linear_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
seq_linear_for!(burn::backend::Cube);

/// The op as a [`HandBackward`] one: it saves this rank's input and the weight.
#[derive(Debug, Clone)]
struct SeqLinear(SeqParams);

impl<B: SeqCollectives> HandBackward<B, 3> for SeqLinear {
    type Saved = [FloatTensor<B>; 2];

    fn forward(
        &self,
        [x, w, b]: [FloatTensor<B>; 3],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        let full = B::along_seq(x.clone(), &self.0, Along::Gather);
        let y = B::linear_fwd(full, w.clone(), b);
        (y, save.then_some([x, w]))
    }

    fn backward(&self, [x, w]: Self::Saved, dy: FloatTensor<B>) -> [FloatTensor<B>; 3] {
        // Every rank of the group runs the same layers' backwards in the same order, so these
        // collectives pair up as the forward's did.
        let full = B::along_seq(x, &self.0, Along::Gather);
        let (dx, dw, db) = B::linear_bwd(full, w, dy);
        [B::along_seq(dx, &self.0, Along::Scatter), dw, db]
    }
}

impl<B: SeqCollectives, C: CheckpointStrategy> SeqLinearOps for Autodiff<B, C> {
    fn seq_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        b: FloatTensor<Self>,
        params: SeqParams,
    ) -> FloatTensor<Self> {
        differentiable::<B, C, _, 3>([x, w, b], SeqLinear(params))
    }
}

/// [`SeqLinearOps::seq_linear`] on erased tensors.
pub fn seq_linear(x: Tensor<3>, w: Tensor<2>, b: Tensor<1>, params: SeqParams) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as SeqLinearOps>::seq_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        b.into_dispatch(),
        params,
    ))
}
