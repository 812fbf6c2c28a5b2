//! Fused AdamW: one launch updates a whole parameter tensor (the fp32 value, both moments and,
//! under mixed precision, the working copy in the compute dtype). Composed of burn's tensor
//! ops the same update is about fifteen launches, each reading and writing the whole tensor:
//! at genslm-25m that was ~1,500 of a step's ~3,900 launches on an H200 (2026-11-28 profile).

use cubecl::prelude::*;

/// Grid-stride loop over the `n` elements: unit `u` takes `u`, `u + stride`, ... (the grid is
/// capped at 65535 cubes, a tensor can be larger). Each element is PyTorch's AdamW in f32, in
/// the order genslm's composed update takes:
/// `g ← g·scale; m ← m·β₁ + g·(1−β₁); v ← v·β₂ + g·g·(1−β₂); p ← p·decay;
/// p ← p − (m / bc₁) / (√(v / bc₂) + ε) · lr`, every scalar rounded to f32 from f64 (1 − β
/// included) as burn's scalar ops round them.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_step<W: Float>(
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    p_out: &mut [f32],
    m_out: &mut [f32],
    v_out: &mut [f32],
    w_out: &mut [W],
    scalars: &[f32],
    n: u32,
    stride: u32,
    #[comptime] working: bool,
    #[define(W)] _working_dtype: ElemType,
) {
    let (grad_scale, beta1, rest1, beta2) = (scalars[0], scalars[1], scalars[2], scalars[3]);
    let (rest2, decay, bc1, bc2) = (scalars[4], scalars[5], scalars[6], scalars[7]);
    let (eps, lr) = (scalars[8], scalars[9]);
    let mut i = ABSOLUTE_POS;
    while i < n as usize {
        let gi = g[i] * grad_scale;
        let mi = m[i] * beta1 + gi * rest1;
        let vi = v[i] * beta2 + gi * gi * rest2;
        let denom = f32::sqrt(vi / bc2) + eps;
        let pi = p[i] * decay - mi / bc1 / denom * lr;
        m_out[i] = mi;
        v_out[i] = vi;
        p_out[i] = pi;
        if working {
            w_out[i] = W::cast_from(pi);
        }
        i += stride as usize;
    }
}
