//! The forward kernel: FlashAttention-2's online softmax, one query row per unit.

use cubecl::prelude::*;

/// A score that stands for "masked": finite, because shader compilers may assume there are no
/// infinities, and so far below any real score that `exp(MASKED − m)` is exactly 0.
pub(crate) const MASKED: f32 = -1.0e30;

/// The ALiBi bias `−slope · distance` of query position `qpos` against key position `kpos`
/// (`|distance|` when not causal). Positions are below 2²⁴, so their f32 difference is exact.
#[cube]
pub(crate) fn alibi_bias(slope: f32, qpos: usize, kpos: usize, #[comptime] causal: bool) -> f32 {
    let dist = f32::cast_from(qpos as u32) - f32::cast_from(kpos as u32);
    if causal {
        -slope * dist
    } else {
        -slope * f32::abs(dist)
    }
}

/// This head's ALiBi slope (0 without ALiBi, never read then).
#[cube]
pub(crate) fn head_slope(slopes: &[f32], bh: usize, heads: u32, #[comptime] alibi: bool) -> f32 {
    let mut slope = 0.0f32;
    if alibi {
        slope = slopes[bh % heads as usize];
    }
    slope
}

/// The end (exclusive) of the keys any query of the block `[q_first, q_first + block_q)` can
/// see: keys after the block's last query are masked for every row, so their tiles are skipped.
#[cube]
pub(crate) fn visible_key_end(
    q_first: usize,
    sq: usize,
    sk: usize,
    q_offset: u32,
    k_offset: u32,
    #[comptime] block_q: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut k_end = sk;
    if causal {
        let visible = q_offset as usize + min(q_first + block_q, sq);
        if visible <= k_offset as usize {
            k_end = 0;
        } else {
            k_end = min(sk, visible - k_offset as usize);
        }
    }
    k_end
}

/// Copies rows `[first, first + rows)` of one `[seq, d]` head of `src` into `dst` (`rows × d`,
/// f32), zero past `seq`; all `units` units of the cube take part.
#[cube]
pub(crate) fn load_tile<E: Float>(
    src: &[E],
    dst: &mut [f32],
    head_base: usize,
    first: usize,
    seq: usize,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] units: usize,
) {
    let mut idx = UNIT_POS_X as usize;
    while idx < rows * d {
        let r = first + idx / d;
        let mut x = 0.0f32;
        if r < seq {
            x = f32::cast_from(src[head_base + r * d + idx % d]);
        }
        dst[idx] = x;
        idx += units;
    }
}

/// Grid: x = query blocks of `block_q` rows (one unit each), y = batch·heads.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_forward<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    slopes: &[f32],
    o: &mut [E],
    lse: &mut [f32],
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

    // This unit's query row, pre-scaled, and its output accumulator.
    let q_base = (bh * sq + row) * d;
    let mut qr = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    #[unroll]
    for c in 0..d {
        let mut x = 0.0f32;
        if valid {
            x = f32::cast_from(q[q_base + c]) * scale;
        }
        qr[c] = x;
        acc[c] = 0.0f32;
    }

    let k_end = visible_key_end(q_first, sq, sk, q_offset, k_offset, block_q, causal);

    let mut ks = Shared::<[f32]>::new_slice(block_k * d);
    let mut vs = Shared::<[f32]>::new_slice(block_k * d);
    let mut scores = Array::<f32>::new(block_k);
    let mut m = f32::new(MASKED);
    let mut l = 0.0f32;
    let kv_base = bh * sk * d;
    let tiles = k_end.div_ceil(block_k);
    for t in 0..tiles {
        let k0 = t * block_k;
        load_tile::<E>(k, &mut ks, kv_base, k0, sk, block_k, d, block_q);
        load_tile::<E>(v, &mut vs, kv_base, k0, sk, block_k, d, block_q);
        sync_cube();
        if valid {
            let nk = min(block_k, k_end - k0);
            let mut tile_max = f32::new(MASKED);
            for j in 0..nk {
                let kpos = k_offset as usize + k0 + j;
                let mut s = f32::new(MASKED);
                if !causal || kpos <= qpos {
                    let mut dot = 0.0f32;
                    #[unroll]
                    for c in 0..d {
                        dot += qr[c] * ks[j * d + c];
                    }
                    if alibi {
                        dot += alibi_bias(slope, qpos, kpos, causal);
                    }
                    s = dot;
                }
                scores[j] = s;
                tile_max = max(tile_max, s);
            }
            if tile_max > MASKED {
                // Rescale what came before to the new running max, then add this tile.
                let m_new = max(m, tile_max);
                let alpha = f32::exp(m - m_new);
                l *= alpha;
                #[unroll]
                for c in 0..d {
                    acc[c] *= alpha;
                }
                for j in 0..nk {
                    let s = scores[j];
                    if s > MASKED {
                        let p = f32::exp(s - m_new);
                        l += p;
                        #[unroll]
                        for c in 0..d {
                            acc[c] += p * vs[j * d + c];
                        }
                    }
                }
                m = m_new;
            }
        }
        sync_cube();
    }

    if valid {
        let out = bh * sq + row;
        if l > 0.0f32 {
            let inv = 1.0f32 / l;
            #[unroll]
            for c in 0..d {
                o[q_base + c] = E::cast_from(acc[c] * inv);
            }
            lse[out] = m + f32::ln(l);
        } else {
            #[unroll]
            for c in 0..d {
                o[q_base + c] = E::cast_from(0.0f32);
            }
            lse[out] = MASKED;
        }
    }
}
