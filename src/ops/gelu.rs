//! `gelu_fast` (GPT-NeoX's tanh form) as one fused op with a hand-written backward.
//!
//! Composed of tensor ops, the activation is nine elementwise kernels whose intermediates
//! autodiff keeps for the backward (four tensors as wide as the MLP per layer), and its tanh is
//! libm's scalar `tanhf` (through `expm1f`): together about a sixth of a CPU training step.
//! Fused, the forward and the backward are one pass each over slices (threads over chunks, a
//! polynomial exp the compiler vectorises), and only the input is kept.
//!
//! The pattern LayerNorm, linear and QKV attention share: [`GeluKernels`] (forward and backward)
//! is implemented for `Flex` (the loops below) and for CubeCL backends (the composed tensor
//! formulas); [`GeluOps`], the backend extension, is the forward on those and, for `Autodiff`,
//! one node of `ops::autodiff::differentiable` that calls the inner backend's `gelu_fast_bwd`.

use burn::backend::autodiff::{checkpoint::strategy::CheckpointStrategy, Autodiff};
use burn::backend::{backend_extension, tensor::FloatTensor, Backend, Dispatch, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::autodiff::{differentiable, HandBackward};
use super::primitive::Primitive;
use super::simd::{dispatched, exp_neg, host_f32, values};

/// √(2/π), and the cubic coefficient, as transformers' `gelu_fast` writes them.
const C: f32 = 0.797_884_6;
const A: f32 = 0.044_715;

/// The activation op on `[b, s, i]` tensors: under autodiff it saves only `x` and its backward
/// is [`GeluKernels::gelu_fast_bwd`]; elsewhere it is the forward.
#[backend_extension(Flex, Autodiff, Cube: cfg(any(feature = "cuda", feature = "wgpu")))]
pub trait GeluOps: Backend {
    fn gelu_fast(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The op's kernels, on the backends that compute.
pub trait GeluKernels: Backend {
    /// `0.5·x·(1 + tanh(C·(x + A·x³)))`.
    fn gelu_fast_fwd(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `dy · d gelu/dx` at `x`.
    fn gelu_fast_bwd(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<B: GeluKernels> GeluOps for B {
    fn gelu_fast(x: FloatTensor<Self>) -> FloatTensor<Self> {
        B::gelu_fast_fwd(x)
    }
}

/// `gelu_fast(x)`, differentiable on an autodiff device.
pub fn gelu_fast(x: Tensor<3>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as GeluOps>::gelu_fast(x.into_dispatch()))
}

/// The composed forward (CubeCL backends, non-f32 CPU tensors, and the tests' reference).
pub fn gelu_fast_composed(x: Tensor<3>) -> Tensor<3> {
    let inner = (x.clone() * x.clone() * A + 1.0) * x.clone() * C;
    x * 0.5 * (inner.tanh() + 1.0)
}

/// The composed backward: `dy · (0.5·(1 + t) + 0.5·x·(1 − t²)·C·(1 + 3A·x²))`.
fn gelu_fast_bwd_composed(x: Tensor<3>, dy: Tensor<3>) -> Tensor<3> {
    let x2 = x.clone() * x.clone();
    let t = ((x2.clone() * A + 1.0) * x.clone() * C).tanh();
    let dt = (t.clone() * t.clone()).neg() + 1.0;
    let du = (x2 * (3.0 * A) + 1.0) * C;
    dy * ((t + 1.0) * 0.5 + x * dt * du * 0.5)
}

/// tanh(u) through e^(−2|u|): (1 − e)/(1 + e), sign restored.
#[inline(always)]
fn tanh_fast(u: f32) -> f32 {
    let e = exp_neg(-2.0 * u.abs());
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

#[inline(always)]
fn fwd_one(x: f32) -> f32 {
    let t = tanh_fast(C * (x + A * x * x * x));
    0.5 * x * (1.0 + t)
}

#[inline(always)]
fn bwd_one(x: f32, dy: f32) -> f32 {
    let x2 = x * x;
    let t = tanh_fast(C * x * (1.0 + A * x2));
    dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * A * x2))
}

/// Elements per task: big enough to amortise the thread hand-off, small enough to split a layer.
const CHUNK: usize = 1 << 15;

fn fwd_slices(x: &[f32], y: &mut [f32]) {
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| fwd_chunk(x, y));
}

fn bwd_slices(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    dx.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(dy.par_chunks(CHUNK)))
        .for_each(|(dx, (x, dy))| bwd_chunk(x, dy, dx));
}

// The chunk loops, compiled for the widest vectors the CPU has.
dispatched!(fwd_chunk, (x: &[f32], y: &mut [f32]), {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = fwd_one(x);
    }
});

dispatched!(bwd_chunk, (x: &[f32], dy: &[f32], dx: &mut [f32]), {
    for ((dx, &x), &dy) in dx.iter_mut().zip(x).zip(dy) {
        *dx = bwd_one(x, dy);
    }
});

impl GeluKernels for Flex {
    fn gelu_fast_fwd(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let x: Tensor<3> = Self::tensor(x);
        Self::prim(if x.dtype() == DType::F32 {
            let (dims, device) = (x.dims(), x.device());
            let xs = host_f32(x);
            let mut y = vec![0.0; values(&xs).len()];
            fwd_slices(values(&xs), &mut y);
            Tensor::<3>::from_data(TensorData::new(y, dims), &device)
        } else {
            gelu_fast_composed(x)
        })
    }

    fn gelu_fast_bwd(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, dy): (Tensor<3>, Tensor<3>) = (Self::tensor(x), Self::tensor(dy));
        Self::prim(if x.dtype() == DType::F32 && dy.dtype() == DType::F32 {
            let (dims, device) = (x.dims(), x.device());
            let (xs, dys) = (host_f32(x), host_f32(dy));
            let mut dx = vec![0.0; values(&xs).len()];
            bwd_slices(values(&xs), values(&dys), &mut dx);
            Tensor::<3>::from_data(TensorData::new(dx, dims), &device)
        } else {
            gelu_fast_bwd_composed(x, dy)
        })
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl GeluKernels for burn::backend::Cube {
    fn gelu_fast_fwd(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::prim(gelu_fast_composed(Self::tensor(x)))
    }

    fn gelu_fast_bwd(x: FloatTensor<Self>, dy: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::prim(gelu_fast_bwd_composed(Self::tensor(x), Self::tensor(dy)))
    }
}

/// The op as a [`HandBackward`] one (`ops::autodiff::differentiable`): it saves only `x`.
#[derive(Debug, Clone)]
struct Gelu;

impl<B: GeluKernels> HandBackward<B, 1> for Gelu {
    type Saved = FloatTensor<B>;

    fn forward(
        &self,
        [x]: [FloatTensor<B>; 1],
        save: bool,
    ) -> (FloatTensor<B>, Option<Self::Saved>) {
        if !save {
            return (B::gelu_fast_fwd(x), None);
        }
        (B::gelu_fast_fwd(x.clone()), Some(x))
    }

    fn backward(&self, x: Self::Saved, dy: FloatTensor<B>) -> [FloatTensor<B>; 1] {
        [B::gelu_fast_bwd(x, dy)]
    }
}

impl<B: GeluKernels, Ck: CheckpointStrategy> GeluOps for Autodiff<B, Ck> {
    fn gelu_fast(x: FloatTensor<Self>) -> FloatTensor<Self> {
        differentiable::<B, Ck, _, 1>([x], Gelu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast tanh against f64 over the range gelu meets.
    #[test]
    fn fast_tanh_is_accurate() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let u = -10.0 + 20.0 * i as f64 / 200_000.0;
            let got = tanh_fast(u as f32) as f64;
            worst = worst.max((got - (u as f32 as f64).tanh()).abs());
        }
        assert!(worst < 3e-7, "tanh absolute error {worst:e}");
    }

    /// Forward and backward against the formulas in f64, including the chunk edges and the
    /// vector loops' tails.
    #[test]
    fn slices_match_f64_formulas() {
        let n = 3 * CHUNK + 13;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 16.0)
            .collect();
        let dy: Vec<f32> = (0..n).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
        let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
        fwd_slices(&x, &mut y);
        bwd_slices(&x, &dy, &mut dx);
        let (c, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
        for i in 0..n {
            let (xv, g) = (x[i] as f64, dy[i] as f64);
            let t = (c * (xv + a * xv * xv * xv)).tanh();
            let want_y = 0.5 * xv * (1.0 + t);
            let want_dx =
                g * (0.5 * (1.0 + t) + 0.5 * xv * (1.0 - t * t) * c * (1.0 + 3.0 * a * xv * xv));
            assert!(
                (y[i] as f64 - want_y).abs() < 2e-6 * (1.0 + want_y.abs()),
                "y at {i}"
            );
            assert!(
                (dx[i] as f64 - want_dx).abs() < 2e-6 * (1.0 + want_dx.abs()),
                "dx at {i}: {} vs {want_dx}",
                dx[i]
            );
        }
    }

    /// Under autodiff the op's gradient equals burn differentiating the composed formula.
    #[test]
    fn autodiff_gradient_equals_the_composed_ops() {
        let ad = burn::tensor::Device::flex().autodiff();
        let n = 2 * 3 * 50;
        let vals: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
        let w: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let grad = |f: fn(Tensor<3>) -> Tensor<3>| {
            let x = Tensor::<3>::from_data(TensorData::new(vals.clone(), [2, 3, 50]), &ad)
                .require_grad();
            let weights = Tensor::<3>::from_data(TensorData::new(w.clone(), [2, 3, 50]), &ad);
            let y = f(x.clone());
            let grads = (y.clone() * weights).sum().backward();
            let gx = x.grad(&grads).expect("dx");
            let v = |t: Tensor<3>| t.into_data().try_into_vec::<f32>().unwrap();
            (v(y.without_autodiff()), v(gx))
        };
        let (y, gx) = grad(gelu_fast);
        let (y_ref, gx_ref) = grad(gelu_fast_composed);
        for i in 0..n {
            assert!(
                (y[i] - y_ref[i]).abs() < 2e-6 * (1.0 + y_ref[i].abs()),
                "y at {i}"
            );
            assert!(
                (gx[i] - gx_ref[i]).abs() < 2e-6 * (1.0 + gx_ref[i].abs()),
                "dx at {i}"
            );
        }
    }
}
