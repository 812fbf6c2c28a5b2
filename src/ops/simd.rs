//! What the fused CPU ops share: an exp that compiles to SIMD (libm's `expf` is one scalar
//! call per element), a macro that compiles a loop for the widest vectors the CPU has, chosen
//! at run time, the copy of a tensor's values to the host slices the loops run on, and the gemm
//! call their products use.

use burn::backend::{tensor::FloatTensor, Flex};
use burn::tensor::{DType, Tensor};

/// A CPU tensor whose f32 values lie in one slice ([`values`]): the tensor itself when it is
/// contiguous (no copy: autodiff often holds the same buffer for the backward, so taking the
/// values out would copy them), else a contiguous copy of a strided view.
pub fn host_f32<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    assert_eq!(
        t.dtype(),
        DType::F32,
        "the fused CPU ops take f32 tensors only"
    );
    let t = t
        .try_into_primitive::<Flex>()
        .expect("the fused CPU ops run on the CPU backend");
    if t.as_slice::<f32>().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The values of a tensor from [`host_f32`], row-major.
pub fn values(t: &FloatTensor<Flex>) -> &[f32] {
    t.as_slice::<f32>()
        .expect("host_f32 gives contiguous f32 tensors")
}

/// Who runs a [`matmul`]: the calling thread (the op's own tasks are the parallel unit), or
/// gemm's split of the product over the rayon pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    Serial,
    Pool,
}

/// `dst (m×n, row stride dst_rs) = [dst +] lhs (m×k) · rhs (k×n)`, strides in elements
/// (row, column).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_rs: usize,
    accumulate: bool,
    lhs: &[f32],
    lhs_strides: (usize, usize),
    rhs: &[f32],
    rhs_strides: (usize, usize),
    threads: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst.len() >= (m - 1) * dst_rs + n);
    // SAFETY: `dst` covers every element the stride reaches (asserted); `gemm` checks the
    // inputs' extents; `dst` does not alias them (distinct borrows).
    unsafe {
        gemm_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            dst_rs,
            accumulate,
            (lhs, lhs_strides),
            (rhs, rhs_strides),
            threads,
        )
    };
}

/// `lhs (m×k) · rhs (k×n)` into a new row-major vector, written once by the product (no zeroing
/// pass before it).
pub fn matmul_new(
    (m, n, k): (usize, usize, usize),
    lhs: (&[f32], (usize, usize)),
    rhs: (&[f32], (usize, usize)),
    threads: Threads,
) -> Vec<f32> {
    let len = m * n;
    if k == 0 {
        return vec![0.0; len]; // an empty sum (gemm would have nothing to write)
    }
    let mut out = Vec::<f32>::with_capacity(len);
    if len > 0 {
        // SAFETY: the capacity holds m·n elements; gemm without accumulation writes every one
        // of them and reads none, so all `len` are initialised before `set_len`.
        unsafe {
            gemm_raw((m, n, k), out.as_mut_ptr(), n, false, lhs, rhs, threads);
            out.set_len(len);
        }
    }
    out
}

/// Products with at most this many rows run on the pool as one single-threaded gemm per
/// block of the destination's columns (see [`gemm_raw`]).
const COLUMN_SPLIT_MAX_ROWS: usize = 1024;

/// Width granularity of those column blocks: gemm's register tile along them with AVX-512 (64
/// columns; with AVX2 it is 24, and a block may end in one partial tile).
const COLUMN_BLOCK: usize = 64;

/// # Safety
/// `dst` must be valid for writes (and reads, when accumulating) of the `m×n` elements at row
/// stride `dst_rs`, and must not alias the inputs.
unsafe fn gemm_raw(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    (lhs, (lhs_rs, lhs_cs)): (&[f32], (usize, usize)),
    (rhs, (rhs_rs, rhs_cs)): (&[f32], (usize, usize)),
    threads: Threads,
) {
    if k > 0 && m > 0 && n > 0 {
        // The input slices must cover every element the strides reach.
        assert!(lhs.len() > (m - 1) * lhs_rs + (k - 1) * lhs_cs);
        assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs);
    }
    let call = |n: usize, dst: *mut f32, rhs: *const f32, parallelism| {
        // SAFETY: the caller vouches for `dst`; the asserts bound every input offset, and a
        // column block's `dst`/`rhs` start inside them with `n` columns left.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                dst_rs as isize,
                accumulate,
                lhs.as_ptr(),
                lhs_cs as isize,
                lhs_rs as isize,
                rhs,
                rhs_cs as isize,
                rhs_rs as isize,
                if accumulate { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    // gemm splits a row-major product over its threads by rows (it transposes the problem so
    // that the destination is column-major, then gives each thread whole columns of that), and
    // each thread packs all of the other operand, a linear layer's weight, for itself: on two
    // threads the weight is packed twice. With few rows the packing is a large share of the
    // product (with 102 rows, a 512×2048 weight's input gradient took 2.0 ms on the pool and
    // 1.0 ms in two column blocks, 2026-11-28 dev VM), so there the blocks of the
    // destination's columns go to the pool's threads instead, each packing its own block of
    // the weight once. With many rows the packing is amortised and gemm's split is as fast.
    let blocks = rayon::current_num_threads().min(n / COLUMN_BLOCK);
    if threads == Threads::Pool && m <= COLUMN_SPLIT_MAX_ROWS && blocks > 1 {
        let width = n.div_ceil(blocks).next_multiple_of(COLUMN_BLOCK);
        let (dst, rhs) = (dst as usize, rhs.as_ptr() as usize);
        rayon::scope(|s| {
            for c0 in (0..n).step_by(width) {
                s.spawn(move |_| {
                    let dst = (dst as *mut f32).wrapping_add(c0);
                    let rhs = (rhs as *const f32).wrapping_add(c0 * rhs_cs);
                    call(width.min(n - c0), dst, rhs, gemm::Parallelism::None)
                });
            }
        });
        return;
    }
    let parallelism = match threads {
        Threads::Serial => gemm::Parallelism::None,
        Threads::Pool => gemm::Parallelism::Rayon(0),
    };
    call(n, dst, rhs.as_ptr(), parallelism);
}

/// e^x for x ≤ 0 (softmax with its max subtracted, tanh through e^(−2|u|)), to a few ulp:
/// 2^k · p(r) with r = x − k·ln 2 in [−ln2/2, ln2/2] and a degree-6 polynomial; exactly 0 below
/// −87 (so −∞ gives 0). Branch-free, so loops over it vectorise.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    exp_neg_with(x, |a, b, c| a * b + c)
}

/// [`exp_neg`] with its multiply-adds fused (`f32::mul_add`): the same polynomial in 9 fused
/// operations instead of 9 multiplies and 9 adds, for loops compiled with FMA enabled (a
/// `target_feature` function with `fma` or `avx512f`), where the exp of every attention score
/// sits beside the tile products. Elsewhere `mul_add` is a libm call: use [`exp_neg`] there.
#[inline(always)]
pub fn exp_neg_fused(x: f32) -> f32 {
    exp_neg_with(x, f32::mul_add)
}

/// The exp of [`exp_neg`] with `madd(a, b, c) = a·b + c` as the caller compiles it (two roundings,
/// or one fused).
#[inline(always)]
fn exp_neg_with(x: f32, madd: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let xc = x.max(-87.0);
    // Round to nearest by adding 1.5·2^23: the integer lands in the low mantissa bits, so both
    // k as a float and k as an integer come out of plain adds and bit ops (`round` and `as i32`
    // would not vectorise: the saturating cast compiled to a scalar compare per lane).
    let t = madd(xc, std::f32::consts::LOG2_E, 12_582_912.0);
    let kf = t - 12_582_912.0;
    let k = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    // r = x − k·ln 2, with ln 2 in two parts.
    let r = madd(kf, -1.428_606_8e-6, madd(kf, -0.693_145_75, xc));
    let mut p = madd(r, 0.001_388_9, 0.008_333_1);
    for c in [0.041_666_68, 0.166_666_67, 0.5, 1.0, 1.0] {
        p = madd(r, p, c);
    }
    let scale = f32::from_bits(((k + 127) << 23) as u32);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// `dispatched!(name, (arg: Type, ...), body)` defines `fn name(args)` running `body` compiled
/// for AVX-512, else AVX2+FMA, else the portable baseline, by run-time detection.
macro_rules! dispatched {
    ($name:ident, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?, $body:expr) => {
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                    $body
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                    $body
                }
                if $crate::isa::avx512() {
                    // SAFETY: the CPU has the features the function was compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if $crate::isa::avx2() {
                    // SAFETY: as above.
                    return unsafe { v3($($arg),*) };
                }
            }
            $body
        }
    };
}
pub(crate) use dispatched;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_and_zero_below_the_range() {
        for (name, exp) in [
            ("exp_neg", exp_neg as fn(f32) -> f32),
            ("exp_neg_fused", exp_neg_fused),
        ] {
            let mut worst = 0f64;
            for i in 0..=200_000 {
                let x = -87.0 + 87.0 * i as f64 / 200_000.0;
                let want = (x as f32 as f64).exp();
                worst = worst.max((exp(x as f32) as f64 - want).abs() / want);
            }
            assert!(worst < 1e-6, "{name}: relative error {worst:e}");
            assert_eq!(exp(f32::NEG_INFINITY), 0.0, "{name}");
            assert_eq!(exp(-100.0), 0.0, "{name}");
            assert_eq!(exp(0.0), 1.0, "{name}");
        }
    }

    /// `lhs · rhs` in f64 from the strided operands, the reference for [`matmul`].
    fn naive(
        (m, n, k): (usize, usize, usize),
        (lhs, (lrs, lcs)): (&[f32], (usize, usize)),
        (rhs, (rrs, rcs)): (&[f32], (usize, usize)),
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|p| lhs[i * lrs + p * lcs] as f64 * rhs[p * rrs + j * rcs] as f64)
                    .sum();
            }
        }
        out
    }

    /// Products on the pool, both ways they are split (by column blocks of the destination
    /// with few rows, by gemm with many), with transposed operands and with accumulation,
    /// against the naive product. Column counts that are not multiples of the block leave a
    /// ragged last block; the destination's row stride is wider than its rows. On a pool of
    /// three threads, whatever the machine's cores, so that the column split has three blocks.
    #[test]
    fn pool_products_match_the_naive_product() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build();
        pool.expect("a pool of three threads")
            .install(pool_products_check);
    }

    fn pool_products_check() {
        let fill = |len: usize, seed: u32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
                .map(|v| v as f32 / 500.0 - 1.0)
                .collect()
        };
        for (m, n, k) in [
            (3, 389, 70),
            (100, 1000, 64),
            (1024, 130, 33),
            (1100, 200, 40),
        ] {
            for transposed in [false, true] {
                let lhs = fill(m * k, 1);
                let rhs = fill(k * n, 2);
                // Row-major, or the transpose stored row-major (strides swapped).
                let (ls, rs) = match transposed {
                    false => ((k, 1), (n, 1)),
                    true => ((1, m), (1, k)),
                };
                let want = naive((m, n, k), (&lhs, ls), (&rhs, rs));
                let fresh = matmul_new((m, n, k), (&lhs, ls), (&rhs, rs), Threads::Pool);
                let ld = n + 5;
                let mut acc = vec![0.5f32; m * ld];
                matmul(
                    (m, n, k),
                    &mut acc,
                    ld,
                    true,
                    &lhs,
                    ls,
                    &rhs,
                    rs,
                    Threads::Pool,
                );
                for i in 0..m {
                    for j in 0..n {
                        let w = want[i * n + j];
                        let case = format!("{m}x{n}x{k} transposed {transposed} at ({i}, {j})");
                        assert!((fresh[i * n + j] as f64 - w).abs() < 1e-4, "{case}");
                        assert!((acc[i * ld + j] as f64 - w - 0.5).abs() < 1e-4, "{case}");
                    }
                    for j in n..ld {
                        assert_eq!(acc[i * ld + j], 0.5, "{m}x{n}x{k}: padding ({i}, {j})");
                    }
                }
            }
        }
    }
}
