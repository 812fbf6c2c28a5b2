//! What the fused CPU ops share: an exp that compiles to SIMD (libm's `expf` is one scalar
//! call per element), a macro that compiles a loop for the widest vectors the CPU has, chosen
//! at run time, and the copy of a tensor's values to the host slices the loops run on.

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

/// e^x for x ≤ 0 (softmax with its max subtracted, tanh through e^(−2|u|)), to a few ulp:
/// 2^k · p(r) with r = x − k·ln 2 in [−ln2/2, ln2/2] and a degree-6 polynomial; exactly 0 below
/// −87 (so −∞ gives 0). Branch-free, so loops over it vectorise.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    let xc = x.max(-87.0);
    // Round to nearest by adding 1.5·2^23: the integer lands in the low mantissa bits, so both
    // k as a float and k as an integer come out of plain adds and bit ops (`round` and `as i32`
    // would not vectorise: the saturating cast compiled to a scalar compare per lane).
    let t = xc * std::f32::consts::LOG2_E + 12_582_912.0;
    let kf = t - 12_582_912.0;
    let k = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    let r = xc - kf * 0.693_145_75 - kf * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (0.166_666_67 + r * (0.041_666_68 + r * (0.008_333_1 + r * 0.001_388_9)))));
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
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features the function was compiled for.
                    return unsafe { v4($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
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
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 87.0 * i as f64 / 200_000.0;
            let want = (x as f32 as f64).exp();
            worst = worst.max((exp_neg(x as f32) as f64 - want).abs() / want);
        }
        assert!(worst < 1e-6, "relative error {worst:e}");
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-100.0), 0.0);
        assert_eq!(exp_neg(0.0), 1.0);
    }
}
