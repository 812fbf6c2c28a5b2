//! A small deterministic generator (splitmix64). Everything random in genslm that must be
//! reproducible and resumable (initial weights, data order, sampling) draws from it, so a run's
//! randomness is a pure function of its seed and position.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

/// What a stream is for. Streams of different domains start from different states for every
/// index (the domain fills the top byte of the stream number), so parameter initialisation,
/// the validation split, epoch shuffles and samples never draw the same numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// Initial weights, one stream per parameter.
    Init = 1,
    /// The train/validation split of the windows.
    Split = 2,
    /// The order of an epoch's windows, one stream per epoch.
    Shuffle = 3,
    /// Generation, one stream per sample.
    Sample = 4,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Stream `k` (below 2⁵⁶) of `domain` for `seed`.
    pub fn stream(seed: u64, domain: Domain, k: u64) -> Self {
        debug_assert!(
            k < 1 << 56,
            "stream index {k} overflows into the domain byte"
        );
        Self::derive(seed, (domain as u64) << 56 | (k & ((1 << 56) - 1)))
    }

    /// A generator for stream `stream` of `seed`. Distinct streams start from distinct states
    /// (the multiplier is odd, so the map is a bijection); prefer [`SplitMix64::stream`], which
    /// also keeps the purposes apart.
    pub fn derive(seed: u64, stream: u64) -> Self {
        let mut g = Self(seed ^ stream.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        g.next_u64();
        g
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u64) -> u64 {
        // Multiply-shift: bias is below 2^-64 · n, irrelevant here.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Domain, SplitMix64};

    #[test]
    fn reference_values() {
        // splitmix64 seeded with 0: first outputs published with the algorithm (Vigna).
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    /// dc757c5 drew parameter k's initial weights and epoch k's shuffle from the same stream
    /// (`derive(seed, k + 1)`); domains keep every pair apart.
    #[test]
    fn domains_never_share_a_stream() {
        let domains = [Domain::Init, Domain::Split, Domain::Shuffle, Domain::Sample];
        for seed in [0u64, 1, 42, u64::MAX] {
            let mut seen = std::collections::HashMap::new();
            for d in domains {
                for k in 0..200u64 {
                    let first = SplitMix64::stream(seed, d, k).next_u64();
                    if let Some(prev) = seen.insert(first, (d, k)) {
                        panic!("seed {seed}: {prev:?} and {:?} share a stream", (d, k));
                    }
                }
            }
        }
    }

    #[test]
    fn normal_moments() {
        let mut g = SplitMix64::new(3);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| g.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }
}
