//! The optimizer step's passes over every parameter, fused for tensors on the CPU backend.
//!
//! Composed of tensor ops, one AdamW update is about twelve elementwise kernels per parameter,
//! each allocating a full-size temporary, and clipping, the global norm and the finiteness
//! check add five more: measured on genslm-25m (2-core Xeon), the update alone took 0.14 s of
//! a step, as long as the forward and backward of 64 tokens. Here each is one pass over host
//! slices of the flex tensors' own buffers (threads over chunks, loops compiled for the widest
//! vectors the CPU has): the moments are updated in place, the new parameters written once.
//! Tensors on other backends (CubeCL) take the composed path in `optim.rs`.

use burn::backend::{tensor::FloatTensor, DispatchDevice, Flex};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::model::fastmath::dispatched;

/// Elements per task: big enough to amortise the thread hand-off, small enough to split one
/// parameter over the threads.
const CHUNK: usize = 1 << 15;

/// The scalars of one AdamW update, in f32 as the composed tensor ops apply them.
#[derive(Debug, Clone, Copy)]
pub struct AdamScalars {
    /// Factor applied to the gradient first (the clip factor).
    pub grad_scale: f32,
    pub beta1: f32,
    pub beta2: f32,
    /// `1 − lr·wd`, or 1 without decay.
    pub decay: f32,
    /// Bias corrections `1 − βᵗ`.
    pub bc1: f32,
    pub bc2: f32,
    pub eps: f32,
    pub lr: f32,
}

/// Whether `t` is an f32 tensor on the CPU backend (outside autodiff).
pub fn on_flex(t: &Tensor<1>) -> bool {
    t.dtype() == DType::F32 && matches!(t.device().as_dispatch(), DispatchDevice::Flex(_))
}

fn primitive(t: Tensor<1>) -> FloatTensor<Flex> {
    t.try_into_primitive::<Flex>()
        .expect("checked by on_flex: the tensor is on the CPU backend")
}

/// The values of a contiguous flex tensor as one slice (`None` for a strided view).
fn slice(t: &FloatTensor<Flex>) -> Option<&[f32]> {
    t.as_slice::<f32>()
}

/// Whether `t`'s buffer holds exactly its elements, in order (so its storage can be updated in
/// place as the tensor's values).
fn whole_buffer(t: &FloatTensor<Flex>) -> bool {
    let n = t.layout().num_elements();
    t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == 4 * n
}

/// One AdamW update of flex tensors: `m` and `v` in place, the new parameter returned. `None`
/// (nothing changed) when a tensor is a strided view, for the composed path to handle.
pub fn adamw(
    p: &Tensor<1>,
    g: &Tensor<1>,
    m: &mut Tensor<1>,
    v: &mut Tensor<1>,
    s: AdamScalars,
) -> Option<Tensor<1>> {
    let (pp, gp) = (primitive(p.clone()), primitive(g.clone()));
    let (ps, gs) = (slice(&pp)?, slice(&gp)?);
    let dummy = || Tensor::<1>::empty([0], &p.device());
    let mut mp = primitive(std::mem::replace(m, dummy()));
    let mut vp = primitive(std::mem::replace(v, dummy()));
    let n = ps.len();
    let fits = gs.len() == n
        && whole_buffer(&mp)
        && whole_buffer(&vp)
        && mp.layout().num_elements() == n
        && vp.layout().num_elements() == n;
    let out = fits.then(|| {
        let mut out = vec![0.0f32; n];
        // Copy-on-write: a moment a checkpoint writer still shares is copied once, else the
        // buffer is updated where it lies.
        let (ms, vs) = (mp.storage_mut::<f32>(), vp.storage_mut::<f32>());
        out.par_chunks_mut(CHUNK)
            .zip(ms.par_chunks_mut(CHUNK))
            .zip(vs.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(c, ((o, m), v))| {
                let r = c * CHUNK..c * CHUNK + o.len();
                adamw_chunk(&ps[r.clone()], &gs[r], m, v, o, s);
            });
        Tensor::<1>::from_data(TensorData::new(out, [n]), &p.device())
    });
    *m = Tensor::from_primitive::<Flex>(mp);
    *v = Tensor::from_primitive::<Flex>(vp);
    out
}

// The same operations, in the same order and precision, as the composed update in optim.rs.
dispatched!(adamw_chunk, (p: &[f32], g: &[f32], m: &mut [f32], v: &mut [f32], out: &mut [f32], s: AdamScalars), {
    for i in 0..out.len() {
        let g = g[i] * s.grad_scale;
        let mi = m[i] * s.beta1 + g * (1.0 - s.beta1);
        let vi = v[i] * s.beta2 + g * g * (1.0 - s.beta2);
        let denom = (vi / s.bc2).sqrt() + s.eps;
        out[i] = p[i] * s.decay - mi / s.bc1 / denom * s.lr;
        m[i] = mi;
        v[i] = vi;
    }
});

/// Σ x² of a flex tensor, accumulated in f64 (`None` for a strided view).
pub fn sum_of_squares(t: &Tensor<1>) -> Option<f64> {
    let tp = primitive(t.clone());
    let xs = slice(&tp)?;
    Some(xs.par_chunks(CHUNK).map(sum_sq_chunk).sum())
}

dispatched!(sum_sq_chunk, (x: &[f32]) -> f64, {
    // Eight independent sums, so the loop vectorises (one f64 lane each) without reordering
    // any single sum.
    let mut acc = [0.0f64; 8];
    let mut blocks = x.chunks_exact(8);
    for b in &mut blocks {
        for (a, &y) in acc.iter_mut().zip(b) {
            *a += f64::from(y) * f64::from(y);
        }
    }
    let tail: f64 = blocks.remainder().iter().map(|&y| f64::from(y) * f64::from(y)).sum();
    acc.iter().sum::<f64>() + tail
});

/// Whether every element of a flex tensor is finite (`None` for a strided view).
pub fn all_finite(t: &Tensor<1>) -> Option<bool> {
    let tp = primitive(t.clone());
    let xs = slice(&tp)?;
    Some(
        xs.par_chunks(CHUNK)
            .map(max_magnitude_bits)
            .max()
            .unwrap_or(0)
            < INF_BITS,
    )
}

/// The bits of +∞: a float's bits without the sign are at least this exactly when it is ±∞ or
/// NaN, and those bits order like the magnitudes.
const INF_BITS: u32 = 0x7f80_0000;

dispatched!(max_magnitude_bits, (x: &[f32]) -> u32, {
    x.iter().map(|y| y.to_bits() & 0x7fff_ffff).max().unwrap_or(0)
});
