//! Megatron tensor parallelism's collectives (docs/ARCHITECTURE.md §5): the conjugate pairs `f`
//! (identity forward, all-reduce backward) and `g` (all-reduce forward, identity backward), and
//! under Megatron sequence parallelism all-gather and reduce-scatter, as one differentiable op
//! whose backward is its conjugate, and the group that gives them to the model through
//! [`TensorParallel`]. Which slice of each weight a rank holds is
//! [`crate::parallel::tensor_slices`].
//!
//! The sums go through the [`Communicator`]'s tensor all-reduce (host buffers for threads and
//! MPI, device memory for NCCL on CUDA). They block: nothing overlaps a layer's matmuls. A
//! communication failure inside the op panics with the communicator's message (an op cannot
//! return an error); the rank runner turns that into this rank's error and aborts the others.

use std::sync::Arc;

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{Tensor, TensorData};

use crate::model::tensor_parallel::TensorParallel;
use crate::ops::autodiff::{differentiable_collective as differentiable, Transposable};
use crate::parallel::comm::Communicator;
use crate::parallel::seq_linear::{along_sequence, seq_linear, SeqParams};

/// Which of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conjugate {
    /// `f`: identity forward, sum of the gradient backward.
    CopyIn,
    /// `g`: sum forward, identity backward.
    SumOut,
    /// All-gather of equal blocks forward, reduce-scatter backward.
    Gather,
    /// Reduce-scatter forward (this rank's block of the sum), all-gather backward.
    Scatter,
}

impl Conjugate {
    fn other(self) -> Self {
        match self {
            Conjugate::CopyIn => Conjugate::SumOut,
            Conjugate::SumOut => Conjugate::CopyIn,
            Conjugate::Gather => Conjugate::Scatter,
            Conjugate::Scatter => Conjugate::Gather,
        }
    }
}

/// The op's non-tensor argument.
#[derive(Debug, Clone)]
pub struct ConjugateParams {
    pub comm: Arc<dyn Communicator>,
    pub op: Conjugate,
}

#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait TensorParallelOps: Backend {
    /// `params.op` on one flat tensor.
    fn tp_conjugate(x: FloatTensor<Self>, params: ConjugateParams) -> FloatTensor<Self>;
}

/// The op on a concrete backend: the forward of `f` is the identity, that of `g` a sum.
macro_rules! conjugate_for {
    ($backend:ty) => {
        impl TensorParallelOps for $backend {
            fn tp_conjugate(x: FloatTensor<Self>, params: ConjugateParams) -> FloatTensor<Self> {
                if params.op == Conjugate::CopyIn {
                    return x;
                }
                let x = Tensor::<1>::from_primitive::<Self>(x);
                let c = &params.comm;
                let out = match params.op {
                    Conjugate::CopyIn | Conjugate::SumOut => c.all_reduce_tensor(x),
                    Conjugate::Gather => c.all_gather_tensor(x),
                    Conjugate::Scatter => c.reduce_scatter_tensor(x),
                };
                out.unwrap_or_else(|e| panic!("tensor-parallel {:?} failed: {e}", params.op))
                    .try_into_primitive::<Self>()
                    .expect("tensor parallel: the collective left the backend of its input")
            }
        }
    };
}

conjugate_for!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
conjugate_for!(burn::backend::Cube);

impl<B: Backend + TensorParallelOps> Transposable<B> for ConjugateParams {
    fn apply(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        B::tp_conjugate(x, self.clone())
    }

    fn transposed(&self) -> Self {
        Self {
            op: self.op.other(),
            ..self.clone()
        }
    }
}

impl<B: Backend + TensorParallelOps, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tp_conjugate(x: FloatTensor<Self>, params: ConjugateParams) -> FloatTensor<Self> {
        differentiable::<B, C, _>(x, params)
    }
}

/// A TP group as the model sees it.
#[derive(Debug, Clone)]
pub struct TpGroup {
    pub comm: Arc<dyn Communicator>,
    /// Megatron sequence parallelism: the region between the layers' blocks split over the
    /// sequence.
    pub seq_split: bool,
}

impl TpGroup {
    fn flat(&self, x: Tensor<1>, op: Conjugate) -> Tensor<1> {
        let params = ConjugateParams {
            comm: self.comm.clone(),
            op,
        };
        Tensor::<1>::from_dispatch(<Dispatch as TensorParallelOps>::tp_conjugate(
            x.into_dispatch(),
            params,
        ))
    }

    fn apply(&self, x: Tensor<3>, op: Conjugate) -> Tensor<3> {
        let dims = x.dims();
        let flat = x.reshape([dims.iter().product::<usize>()]);
        self.flat(flat, op).reshape(dims)
    }

    /// Gather or scatter along the sequence of `x: [b, c, h]` (differentiable).
    fn along_seq(&self, x: Tensor<3>, op: Conjugate) -> Tensor<3> {
        let (c, t) = (x.dims()[1], self.comm.size());
        let out = along_sequence(x, |flat| self.flat(flat, op));
        let rows = out.dims()[1];
        debug_assert!(rows == c * t || rows * t == c);
        out
    }
}

impl TensorParallel for TpGroup {
    fn degree(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn copy_in(&self, x: Tensor<3>) -> Tensor<3> {
        self.apply(x, Conjugate::CopyIn)
    }

    fn sum_out(&self, x: Tensor<3>) -> Tensor<3> {
        self.apply(x, Conjugate::SumOut)
    }

    fn seq_split(&self) -> bool {
        self.seq_split
    }

    fn gather_seq(&self, x: Tensor<3>) -> Tensor<3> {
        self.along_seq(x, Conjugate::Gather)
    }

    fn scatter_seq(&self, x: Tensor<3>) -> Tensor<3> {
        self.along_seq(x, Conjugate::Scatter)
    }

    fn sum_grad(&self, p: Tensor<1>) -> Tensor<1> {
        self.flat(p, Conjugate::CopyIn)
    }

    fn seq_linear(&self, x: Tensor<3>, w: Tensor<2>, b: Tensor<1>) -> Tensor<3> {
        let params = SeqParams {
            comm: self.comm.clone(),
        };
        seq_linear(x, w, b, params)
    }

    fn max_over(&self, x: Tensor<3>) -> Tensor<3> {
        let (dims, device) = (x.dims(), x.device());
        let mine = crate::ops::primitive::tensor_to_vec(&x.detach());
        let all = self
            .comm
            .all_gather(&mine)
            .unwrap_or_else(|e| panic!("tensor-parallel max failed: {e}"));
        let max = (0..mine.len())
            .map(|i| all.iter().map(|v| v[i]).fold(f32::NEG_INFINITY, f32::max))
            .collect::<Vec<_>>();
        Tensor::from_data(TensorData::new(max, dims), &device)
    }
}
