//! The small products of FlashAttention's CPU tiles, `C (m×n) [+]= A (m×k) · B (k×n)`, as a
//! register-blocked kernel that reads both operands where they lie: A with any strides (a score
//! tile, or its transpose), B row-major (a block of V, dO, K or Q, or a panel of a transposed K).
//!
//! gemm (burn's matmul kernels, and what these tiles ran on before) packs both operands of every
//! call into its own layout. That pays for itself on large products, but a tile's operands are
//! small, fresh and read once or twice: profiled on the dev VM (genslm-25m's heads, seq 1024),
//! packing, its buffers and the per-call set-up were a fifth of the attention forward, and the
//! forward reached 50–64% of the two cores' peak. Here A's elements are broadcast straight from
//! the tile (each row or column read in order) and B's rows are loaded as vectors, so nothing is
//! copied; the callers lay B out so its rows are short and contiguous (`attention::cpu` keeps K
//! and V transposed in 64-column panels for the products that need them).
//!
//! The kernel: `MR` rows of C by up to four vectors of columns live in registers (6 × 64 with
//! AVX-512: 24 accumulators of the 32 registers; 6 × 16 with AVX2: 12 of 16), over `KC` steps of
//! the inner dimension at a time, so a B strip (`KC × 64` floats, 32 KiB) stays in L1 while
//! every row block of A streams past it. Widths that are not a multiple of the vector (16
//! lanes, 8 with AVX2) and the scalar tier go to gemm, which takes any shape.

use crate::isa;
use crate::ops::simd::{matmul, Threads};

/// Which code a product of `n` columns runs on at the tier in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Avx512,
    Avx2,
    /// gemm, serial (any shape, any CPU).
    Gemm,
}

/// The kernel [`tile_matmul`] uses for `n` columns.
pub fn kernel_for(n: usize) -> Kernel {
    if cfg!(target_arch = "x86_64") {
        if isa::avx512() && n.is_multiple_of(16) {
            return Kernel::Avx512;
        }
        if isa::avx2() && n.is_multiple_of(8) {
            return Kernel::Avx2;
        }
    }
    Kernel::Gemm
}

/// `c (m×n, row stride ldc) = [c +] a (m×k) · b (k×n)`: `a[i][p]` at `a[i·ars + p·acs]`, `b[p][j]`
/// at `b[p·ldb + j]`. On the calling thread (the attention tasks are the parallel unit).
#[allow(clippy::too_many_arguments)]
pub fn tile_matmul(
    (m, n, k): (usize, usize, usize),
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: &[f32],
    (ars, acs): (usize, usize),
    b: &[f32],
    ldb: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(c.len() >= (m - 1) * ldc + n, "c is too short for its rows");
    if k == 0 {
        if !accumulate {
            c.chunks_mut(ldc).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    // Every element the strides reach lies in the slices: the unsafe kernels rely on it.
    assert!(a.len() > (m - 1) * ars + (k - 1) * acs, "a is too short");
    assert!(b.len() >= (k - 1) * ldb + n, "b is too short");
    #[cfg(target_arch = "x86_64")]
    {
        let kernel: x86::KernelFn = match kernel_for(n) {
            Kernel::Avx512 => x86::avx512,
            Kernel::Avx2 => x86::avx2,
            Kernel::Gemm => return gemm_tile((m, n, k), c, ldc, accumulate, a, (ars, acs), b, ldb),
        };
        let (c, a, b) = (c.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        // SAFETY: `kernel_for` picked the kernel for the CPU's (forced) tier; the asserts bound
        // every offset it forms; `c` does not alias `a` or `b` (distinct borrows).
        unsafe { kernel((m, n, k), c, ldc, accumulate, a, (ars, acs), b, ldb) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    gemm_tile((m, n, k), c, ldc, accumulate, a, (ars, acs), b, ldb)
}

/// The tile product on gemm, serial (any shape, any CPU).
#[allow(clippy::too_many_arguments)]
fn gemm_tile(
    dims: (usize, usize, usize),
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: &[f32],
    a_strides: (usize, usize),
    b: &[f32],
    ldb: usize,
) {
    matmul(
        dims,
        c,
        ldc,
        accumulate,
        a,
        a_strides,
        b,
        (ldb, 1),
        Threads::Serial,
    )
}

/// Columns per panel of a transposed operand ([`transposed_panels`]).
pub const PANEL: usize = 64;

/// Floats in the [`transposed_panels`] of `rows` rows `e` wide (the last panel padded).
pub fn panels_len(rows: usize, e: usize) -> usize {
    rows.div_ceil(PANEL) * PANEL * e
}

/// `x (rows×e, row-major)` transposed into panels of [`PANEL`] rows of `x`: panel `p` holds
/// `xᵀ[..][p·PANEL..(p+1)·PANEL]` as `e` contiguous rows of `PANEL` (zeros past `rows`), so a
/// product with `xᵀ` reads B rows of 256 bytes laid end to end. A plain row-major `xᵀ` would put
/// B's rows a whole sequence apart: at the power-of-two strides of attention's shapes they fall
/// into a few L1 sets and evict each other.
pub fn transposed_panels(x: &[f32], rows: usize, e: usize, out: &mut [f32]) {
    assert!(x.len() >= rows * e && out.len() >= panels_len(rows, e));
    for (p, panel) in out
        .chunks_exact_mut(PANEL * e)
        .take(rows.div_ceil(PANEL))
        .enumerate()
    {
        let first = p * PANEL;
        let n = PANEL.min(rows - first);
        for (c, row) in x[first * e..(first + n) * e].chunks_exact(e).enumerate() {
            for (f, &v) in row.iter().enumerate() {
                panel[f * PANEL + c] = v;
            }
        }
        for f in 0..e {
            panel[f * PANEL + n..(f + 1) * PANEL].fill(0.0);
        }
    }
}

/// `c[r][j] = Σ_f a[r][f] · x[first + j][f]` for `rows` rows of `a` (row-major, `e` wide) and
/// `j < cols`, with `x` given as its [`transposed_panels`]: a score tile `Q·Kᵀ` (or `dO·Vᵀ`)
/// for keys `first..first + cols`. Columns may also be written up to the next multiple of 16
/// (within `ldc`) where that keeps the product on the vector kernels; they hold the products
/// with the keys there (or the panels' zero padding) and callers ignore them.
pub fn times_transposed(
    c: &mut [f32],
    ldc: usize,
    (rows, e): (usize, usize),
    a: &[f32],
    panels: &[f32],
    (first, cols): (usize, usize),
) {
    let mut j = 0;
    while j < cols {
        let (p, off) = ((first + j) / PANEL, (first + j) % PANEL);
        let mut w = (PANEL - off).min(cols - j);
        if off.is_multiple_of(16) {
            // Within the panel (its padding is zero) and within the row.
            w = w.next_multiple_of(16).min(PANEL - off).min(ldc - j);
        }
        let b = &panels[p * PANEL * e + off..];
        tile_matmul((rows, w, e), &mut c[j..], ldc, false, a, (e, 1), b, PANEL);
        j += w;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// A kernel's signature: `tile_matmul`'s, on raw pointers.
    pub(super) type KernelFn = unsafe fn(
        (usize, usize, usize),
        *mut f32,
        usize,
        bool,
        *const f32,
        (usize, usize),
        *const f32,
        usize,
    );

    /// Rows of C per register block.
    const MR: usize = 6;
    /// Steps of the inner dimension per pass over a B strip.
    const KC: usize = 128;

    /// The kernel for one instruction set: its vector type and the three operations the block
    /// needs. Both sets share the blocking code below, instantiated per set with its
    /// `target_feature` so every intrinsic inlines.
    macro_rules! kernel {
        ($name:ident, $feat:literal, $vec:ty, $lanes:expr, $nv:expr,
         $zero:path, $splat:path, $load:path, $store:path, $fma:path, $add:path) => {
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub(super) unsafe fn $name(
                (m, n, k): (usize, usize, usize),
                c: *mut f32,
                ldc: usize,
                accumulate: bool,
                a: *const f32,
                (ars, acs): (usize, usize),
                b: *const f32,
                ldb: usize,
            ) {
                const LANES: usize = $lanes;
                const WIDE: usize = $nv * LANES;
                let mut p0 = 0;
                while p0 < k {
                    let kc = KC.min(k - p0);
                    // Later passes add to what the earlier ones wrote.
                    let add = accumulate || p0 > 0;
                    let (a, b) = (a.add(p0 * acs), b.add(p0 * ldb));
                    let mut j = 0;
                    while j < n {
                        let (bj, cj) = (b.add(j), c.add(j));
                        if n - j >= WIDE {
                            rows::<$nv>(m, kc, cj, ldc, add, a, (ars, acs), bj, ldb);
                            j += WIDE;
                        } else {
                            rows::<1>(m, kc, cj, ldc, add, a, (ars, acs), bj, ldb);
                            j += LANES;
                        }
                    }
                    p0 += kc;
                }

                /// Every row block of one strip of `NV` vectors of columns.
                #[allow(clippy::too_many_arguments)]
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn rows<const NV: usize>(
                    m: usize,
                    kc: usize,
                    c: *mut f32,
                    ldc: usize,
                    add: bool,
                    a: *const f32,
                    (ars, acs): (usize, usize),
                    b: *const f32,
                    ldb: usize,
                ) {
                    let mut i = 0;
                    while i + MR <= m {
                        block::<MR, NV>(
                            kc,
                            c.add(i * ldc),
                            ldc,
                            add,
                            a.add(i * ars),
                            (ars, acs),
                            b,
                            ldb,
                        );
                        i += MR;
                    }
                    let (c, a) = (c.add(i * ldc), a.add(i * ars));
                    match m - i {
                        0 => {}
                        1 => block::<1, NV>(kc, c, ldc, add, a, (ars, acs), b, ldb),
                        2 => block::<2, NV>(kc, c, ldc, add, a, (ars, acs), b, ldb),
                        3 => block::<3, NV>(kc, c, ldc, add, a, (ars, acs), b, ldb),
                        4 => block::<4, NV>(kc, c, ldc, add, a, (ars, acs), b, ldb),
                        _ => block::<5, NV>(kc, c, ldc, add, a, (ars, acs), b, ldb),
                    }
                }

                /// `R` rows × `NV` vectors of C in registers over `kc` steps: per step, B's row
                /// loaded once as `NV` vectors and each of A's `R` elements broadcast against it.
                #[allow(clippy::too_many_arguments)]
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn block<const R: usize, const NV: usize>(
                    kc: usize,
                    c: *mut f32,
                    ldc: usize,
                    add: bool,
                    a: *const f32,
                    (ars, acs): (usize, usize),
                    b: *const f32,
                    ldb: usize,
                ) {
                    let mut acc: [[$vec; NV]; R] = [[$zero(); NV]; R];
                    for p in 0..kc {
                        let bp = b.add(p * ldb);
                        let mut bv: [$vec; NV] = [$zero(); NV];
                        for (v, x) in bv.iter_mut().enumerate() {
                            *x = $load(bp.add(v * LANES));
                        }
                        let ap = a.add(p * acs);
                        for (r, row) in acc.iter_mut().enumerate() {
                            let x = $splat(*ap.add(r * ars));
                            for (v, y) in row.iter_mut().enumerate() {
                                *y = $fma(x, bv[v], *y);
                            }
                        }
                    }
                    for (r, row) in acc.iter().enumerate() {
                        for (v, &y) in row.iter().enumerate() {
                            let cp = c.add(r * ldc + v * LANES);
                            $store(cp, if add { $add($load(cp), y) } else { y });
                        }
                    }
                }
            }
        };
    }

    kernel!(
        avx512,
        "avx512f",
        __m512,
        16,
        4,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps
    );
    kernel!(
        avx2,
        "avx2,fma",
        __m256,
        8,
        2,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random(n: usize, rng: &mut SplitMix64) -> Vec<f32> {
        (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
    }

    /// One product against the naive f64 sum, with row strides wider than the rows and the
    /// columns of C beyond `n` left untouched.
    fn check((m, n, k): (usize, usize, usize), a_cols: bool, accumulate: bool, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        let (ldc, ldb) = (n + 3, n + 5);
        // A row-major with a padded row, or column-major (a transposed tile).
        let (ars, acs) = if a_cols { (1, m + 2) } else { (k + 1, 1) };
        let a = random((m.max(1) - 1) * ars + (k.max(1) - 1) * acs + 1, &mut rng);
        let b = random(k.max(1) * ldb, &mut rng);
        let c0 = random(m * ldc, &mut rng);
        let mut c = c0.clone();
        tile_matmul((m, n, k), &mut c, ldc, accumulate, &a, (ars, acs), &b, ldb);
        for i in 0..m {
            for j in 0..ldc {
                let got = c[i * ldc + j] as f64;
                if j >= n {
                    assert_eq!(
                        got,
                        c0[i * ldc + j] as f64,
                        "column {j} beyond n was written"
                    );
                    continue;
                }
                let mut want = if accumulate {
                    c0[i * ldc + j] as f64
                } else {
                    0.0
                };
                for p in 0..k {
                    want += a[i * ars + p * acs] as f64 * b[p * ldb + j] as f64;
                }
                let tol = 1e-5 * (1.0 + (k as f64).sqrt());
                assert!(
                    (got - want).abs() <= tol,
                    "({m}, {n}, {k}) a_cols {a_cols} acc {accumulate} at ({i}, {j}): {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn products_equal_the_f64_sum_for_every_shape_the_blocking_splits() {
        let mut seed = 1;
        // Rows: below, at and past the register block, with every tail; columns: one vector,
        // the full strip, strips plus a vector tail, and widths gemm takes; inner: empty, short,
        // and across the KC passes.
        for m in [1, 2, 5, 6, 7, 11, 13, 64] {
            for n in [8, 16, 24, 48, 64, 80, 128, 200] {
                for k in [0, 1, 3, 64, 129, 300] {
                    for (a_cols, accumulate) in [(false, false), (true, true), (false, true)] {
                        check((m, n, k), a_cols, accumulate, seed);
                        seed += 1;
                    }
                }
            }
        }
    }

    #[test]
    fn the_tier_in_effect_picks_the_kernel() {
        let want = |n: usize| match isa::tier() {
            isa::Tier::Avx512 if n.is_multiple_of(16) => Kernel::Avx512,
            isa::Tier::Avx512 | isa::Tier::Avx2 if n.is_multiple_of(8) => Kernel::Avx2,
            _ => Kernel::Gemm,
        };
        for n in [8, 16, 24, 64, 100] {
            assert_eq!(kernel_for(n), want(n), "n = {n} at tier {}", isa::tier());
        }
    }

    #[test]
    fn products_with_transposed_panels_equal_the_f64_sum() {
        let mut rng = SplitMix64::new(7);
        // Key counts below, at and past a panel; windows that start on and off the 16-column
        // grid and end inside the padding.
        for (rows, keys, e) in [(5, 30, 8), (9, 64, 16), (13, 200, 64), (3, 129, 24)] {
            let a = random(rows * e, &mut rng);
            let x = random(keys * e, &mut rng);
            let mut panels = vec![f32::NAN; panels_len(keys, e)];
            transposed_panels(&x, keys, e, &mut panels);
            for (first, cols) in [
                (0, keys),
                (3, keys - 3),
                (16, keys.min(40) - 16),
                (keys - 1, 1),
            ] {
                let ldc = cols.next_multiple_of(16) + 16;
                let mut c = vec![0f32; rows * ldc];
                times_transposed(&mut c, ldc, (rows, e), &a, &panels, (first, cols));
                for r in 0..rows {
                    for j in 0..cols {
                        let want: f64 = (0..e)
                            .map(|f| a[r * e + f] as f64 * x[(first + j) * e + f] as f64)
                            .sum();
                        let got = c[r * ldc + j] as f64;
                        assert!((got - want).abs() < 1e-4, "({rows}, {keys}, {e}) window ({first}, {cols}) at ({r}, {j}): {got} vs {want}");
                    }
                }
            }
        }
    }
}
