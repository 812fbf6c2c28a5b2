//! The backward kernels: `D = rowsum(dO ∘ O)`, then dQ (query rows own their gradient) and
//! dK/dV (key rows own theirs). Both recompute `P = exp(S − lse)` tile by tile.

use cubecl::prelude::*;

use crate::forward::{alibi_bias, head_slope, load_tile, visible_key_end, MASKED};

/// `D[row] = Σ_c dO[row, c] · O[row, c]` in f32; one unit per row.
#[cube(launch_unchecked)]
pub(crate) fn flash_backward_prepass<E: Float>(
    o: &[E],
    d_o: &[E],
    delta: &mut [f32],
    rows: u32,
    #[comptime] d: usize,
    #[define(E)] _dtype: ElemType,
) {
    let row = ABSOLUTE_POS;
    if row < rows as usize {
        let base = row * d;
        let mut acc = 0.0f32;
        #[unroll]
        for c in 0..d {
            acc += f32::cast_from(o[base + c]) * f32::cast_from(d_o[base + c]);
        }
        delta[row] = acc;
    }
}

/// dQ. Grid: x = query blocks of `block_q` rows (one unit each), y = batch·heads.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dq<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    d_o: &[E],
    lse: &[f32],
    delta: &[f32],
    slopes: &[f32],
    dq: &mut [E],
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    q_offset: u32,
    k_offset: u32,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
    #[comptime] alibi: bool,
    #[define(E)] _dtype: ElemType,
) {
    let sq = seq_q as usize;
    let sk = seq_k as usize;
    let bh = CUBE_POS_Y as usize;
    let q_first = CUBE_POS_X as usize * block_q;
    let row = q_first + UNIT_POS_X as usize;
    let valid = row < sq;
    let qpos = q_offset as usize + row;
    let slope = head_slope(slopes, bh, heads, alibi);

    let base = (bh * sq + row) * d;
    let mut qr = Array::<f32>::new(d);
    let mut dor = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    #[unroll]
    for c in 0..d {
        let mut x = 0.0f32;
        let mut g = 0.0f32;
        if valid {
            x = f32::cast_from(q[base + c]) * scale;
            g = f32::cast_from(d_o[base + c]);
        }
        qr[c] = x;
        dor[c] = g;
        acc[c] = 0.0f32;
    }
    if valid {
        row_lse = lse[bh * sq + row];
        row_delta = delta[bh * sq + row];
    }

    let k_end = visible_key_end(q_first, sq, sk, q_offset, k_offset, block_q, causal);

    let mut ks = Shared::<[f32]>::new_slice(block_k * d);
    let mut vs = Shared::<[f32]>::new_slice(block_k * d);
    let kv_base = bh * sk * d;
    let tiles = k_end.div_ceil(block_k);
    for t in 0..tiles {
        let k0 = t * block_k;
        load_tile::<E>(k, &mut ks, kv_base, k0, sk, block_k, d, block_q);
        load_tile::<E>(v, &mut vs, kv_base, k0, sk, block_k, d, block_q);
        sync_cube();
        if valid && row_lse > MASKED {
            let nk = min(block_k, k_end - k0);
            for j in 0..nk {
                let kpos = k_offset as usize + k0 + j;
                if !causal || kpos <= qpos {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    #[unroll]
                    for c in 0..d {
                        s += qr[c] * ks[j * d + c];
                        dp += dor[c] * vs[j * d + c];
                    }
                    if alibi {
                        s += alibi_bias(slope, qpos, kpos, causal);
                    }
                    let ds = f32::exp(s - row_lse) * (dp - row_delta);
                    #[unroll]
                    for c in 0..d {
                        acc[c] += ds * ks[j * d + c];
                    }
                }
            }
        }
        sync_cube();
    }

    if valid {
        #[unroll]
        for c in 0..d {
            dq[base + c] = E::cast_from(acc[c] * scale);
        }
    }
}

/// dK and dV. Grid: x = key blocks of `block_k` rows (one unit each), y = batch·heads;
/// queries stream through shared memory in tiles of `block_q` rows.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward_dkdv<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    d_o: &[E],
    lse: &[f32],
    delta: &[f32],
    slopes: &[f32],
    dk: &mut [E],
    dv: &mut [E],
    seq_q: u32,
    seq_k: u32,
    heads: u32,
    q_offset: u32,
    k_offset: u32,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] block_q: usize,
    #[comptime] block_k: usize,
    #[comptime] causal: bool,
    #[comptime] alibi: bool,
    #[define(E)] _dtype: ElemType,
) {
    let sq = seq_q as usize;
    let sk = seq_k as usize;
    let bh = CUBE_POS_Y as usize;
    let k_first = CUBE_POS_X as usize * block_k;
    let row = k_first + UNIT_POS_X as usize;
    let valid = row < sk;
    let kpos = k_offset as usize + row;
    let slope = head_slope(slopes, bh, heads, alibi);

    let base = (bh * sk + row) * d;
    let mut kr = Array::<f32>::new(d);
    let mut vr = Array::<f32>::new(d);
    let mut dk_acc = Array::<f32>::new(d);
    let mut dv_acc = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        let mut x = 0.0f32;
        let mut y = 0.0f32;
        if valid {
            x = f32::cast_from(k[base + c]) * scale;
            y = f32::cast_from(v[base + c]);
        }
        kr[c] = x;
        vr[c] = y;
        dk_acc[c] = 0.0f32;
        dv_acc[c] = 0.0f32;
    }

    // Queries before the block's first key see none of its keys: their tiles are skipped.
    let mut q_start = 0usize;
    if causal {
        let first_key = k_offset as usize + k_first;
        if first_key > q_offset as usize {
            q_start = min(sq, first_key - q_offset as usize);
        }
    }
    let first_tile = q_start / block_q;

    let mut qs = Shared::<[f32]>::new_slice(block_q * d);
    let mut dos = Shared::<[f32]>::new_slice(block_q * d);
    let mut lses = Shared::<[f32]>::new_slice(block_q);
    let mut deltas = Shared::<[f32]>::new_slice(block_q);
    let q_base = bh * sq * d;
    let tiles = sq.div_ceil(block_q);
    for t in first_tile..tiles {
        let q0 = t * block_q;
        load_tile::<E>(q, &mut qs, q_base, q0, sq, block_q, d, block_k);
        load_tile::<E>(d_o, &mut dos, q_base, q0, sq, block_q, d, block_k);
        let mut idx = UNIT_POS_X as usize;
        while idx < block_q {
            let r = q0 + idx;
            let mut a = f32::new(MASKED);
            let mut b = 0.0f32;
            if r < sq {
                a = lse[bh * sq + r];
                b = delta[bh * sq + r];
            }
            lses[idx] = a;
            deltas[idx] = b;
            idx += block_k;
        }
        sync_cube();
        if valid {
            let nq = min(block_q, sq - q0);
            for i in 0..nq {
                let qpos = q_offset as usize + q0 + i;
                if (!causal || kpos <= qpos) && lses[i] > MASKED {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    #[unroll]
                    for c in 0..d {
                        s += qs[i * d + c] * kr[c];
                        dp += dos[i * d + c] * vr[c];
                    }
                    if alibi {
                        s += alibi_bias(slope, qpos, kpos, causal);
                    }
                    let p = f32::exp(s - lses[i]);
                    let ds = p * (dp - deltas[i]);
                    #[unroll]
                    for c in 0..d {
                        dv_acc[c] += p * dos[i * d + c];
                        dk_acc[c] += ds * qs[i * d + c];
                    }
                }
            }
        }
        sync_cube();
    }

    if valid {
        #[unroll]
        for c in 0..d {
            dk[base + c] = E::cast_from(dk_acc[c] * scale);
            dv[base + c] = E::cast_from(dv_acc[c]);
        }
    }
}
