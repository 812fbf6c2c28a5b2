//! Which x86-64 instruction-set tier genslm's own vector loops use, chosen once per process:
//! the best the CPU has, or the one `GENSLM_SIMD` forces (`avx512`, `avx2` or `scalar`; `auto`
//! or unset = the best). Forcing a lower tier lets the kernels' tests check every tier against
//! the same naive reference, and the benchmarks measure an AVX2-only machine's code paths on an
//! AVX-512 one.
//!
//! The tiers and what each enables:
//! - `avx512`: the fused ops' loops compiled for AVX-512F (`ops::simd::dispatched!`), and
//!   everything of `avx2`;
//! - `avx2`: the loops compiled for AVX2 + FMA, the AVX2 FASTA cleaning blocks
//!   (`data::clean`), the SSSE3 codon shuffles (`tokenizer::codons_x86`);
//! - `scalar`: the portable loops only (what the compiler makes of them for the build's
//!   baseline target).
//!
//! gemm's matrix kernels (burn's matmul and ours) choose their own tier from the CPU: in a build
//! with the `x86-v4` feature (the default) they use AVX-512 wherever the CPU has it, whatever
//! `GENSLM_SIMD` says; `cargo build --release --no-default-features` builds them without
//! AVX-512, which with `GENSLM_SIMD=avx2` is the whole of an AVX2-only machine's code.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// An instruction-set tier, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    Scalar,
    Avx2,
    Avx512,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The environment variable that forces a tier.
pub const ENV: &str = "GENSLM_SIMD";

/// The best tier this CPU supports.
pub fn detected() -> Tier {
    #[cfg(target_arch = "x86_64")]
    {
        // Each tier includes the ones below it: a virtual CPU that reports AVX-512F but hides
        // AVX2, FMA or SSSE3 gets the scalar tier, never a path it cannot run.
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("ssse3");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            return Tier::Avx512;
        }
        if avx2 {
            return Tier::Avx2;
        }
    }
    Tier::Scalar
}

/// The tier `value` of `GENSLM_SIMD` asks for on a CPU whose best is `best`: `None` (or
/// `auto`/empty) is the best; a tier above the CPU's is an error naming both.
pub fn parse(value: Option<&str>, best: Tier) -> Result<Tier> {
    let want = match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("auto") => return Ok(best),
        Some("avx512") => Tier::Avx512,
        Some("avx2") => Tier::Avx2,
        Some("scalar") => Tier::Scalar,
        Some(other) => {
            return Err(Error::Invalid(format!(
                "{ENV}={other}: expected avx512, avx2, scalar or auto"
            )))
        }
    };
    if want > best {
        return Err(Error::Invalid(format!(
            "{ENV}={want}: this CPU's best tier is {best} ({})",
            cpu_model()
        )));
    }
    Ok(want)
}

static TIER: OnceLock<std::result::Result<Tier, String>> = OnceLock::new();

fn chosen() -> &'static std::result::Result<Tier, String> {
    TIER.get_or_init(|| {
        parse(std::env::var(ENV).ok().as_deref(), detected()).map_err(|e| e.to_string())
    })
}

/// Checks `GENSLM_SIMD` once at start-up, so a bad value is a clear error before any work.
pub fn check() -> Result<Tier> {
    chosen().clone().map_err(Error::Invalid)
}

/// The tier in effect (the best the CPU has if `GENSLM_SIMD` is invalid: `check` reports that).
pub fn tier() -> Tier {
    match chosen() {
        Ok(t) => *t,
        Err(_) => detected(),
    }
}

/// Whether the AVX-512F loops may run.
#[inline]
pub fn avx512() -> bool {
    tier() >= Tier::Avx512
}

/// Whether the AVX2 (+ FMA, SSSE3) loops may run.
#[inline]
pub fn avx2() -> bool {
    tier() >= Tier::Avx2
}

/// The CPU's model name (`/proc/cpuinfo`), or "unknown CPU".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// "CPU model, simd TIER" with what gemm uses when it differs, for benchmark lines.
pub fn describe() -> String {
    let gemm = if cfg!(feature = "x86-v4") && detected() == Tier::Avx512 {
        "avx512"
    } else if detected() >= Tier::Avx2 {
        "avx2"
    } else {
        "scalar"
    };
    format!("{}, simd {} (gemm {gemm})", cpu_model(), tier())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_parse_and_refuse_what_the_cpu_lacks() {
        assert_eq!(parse(None, Tier::Avx512).unwrap(), Tier::Avx512);
        assert_eq!(parse(Some("auto"), Tier::Avx2).unwrap(), Tier::Avx2);
        assert_eq!(parse(Some(" AVX2 "), Tier::Avx512).unwrap(), Tier::Avx2);
        assert_eq!(parse(Some("scalar"), Tier::Avx2).unwrap(), Tier::Scalar);
        let e = parse(Some("avx512"), Tier::Avx2).unwrap_err().to_string();
        assert!(
            e.contains("GENSLM_SIMD=avx512") && e.contains("best tier is avx2"),
            "{e}"
        );
        let e = parse(Some("sse9"), Tier::Avx512).unwrap_err().to_string();
        assert!(e.contains("expected avx512, avx2, scalar or auto"), "{e}");
    }

    /// Under `GENSLM_SIMD=T` (scripts/test.sh runs the kernels' tests so, once per tier) the
    /// tier in effect is T: the forced runs really take that tier's paths.
    #[test]
    fn a_forced_tier_is_the_one_in_effect() {
        match std::env::var(ENV).ok().as_deref() {
            Some("scalar") => assert_eq!(tier(), Tier::Scalar),
            Some("avx2") => assert_eq!(tier(), Tier::Avx2),
            Some("avx512") => assert_eq!(tier(), Tier::Avx512),
            _ => assert_eq!(tier(), detected()),
        }
        assert!(tier() <= detected());
        assert_eq!(avx2(), tier() >= Tier::Avx2);
        assert_eq!(avx512(), tier() == Tier::Avx512);
        // The unsafe paths each tier enables need exactly these features.
        #[cfg(target_arch = "x86_64")]
        {
            if avx2() {
                assert!(std::arch::is_x86_feature_detected!("avx2"));
                assert!(std::arch::is_x86_feature_detected!("fma"));
                assert!(std::arch::is_x86_feature_detected!("ssse3"));
            }
            if avx512() {
                assert!(std::arch::is_x86_feature_detected!("avx512f"));
            }
        }
    }
}
