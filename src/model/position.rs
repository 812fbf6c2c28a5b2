//! Position encodings: GPT-NeoX rotary (rotate-half on the first `rotary_dims` of each head) and
//! ALiBi slopes. The learned table is a plain parameter (see `params.rs`).
//!
//! Positions are global: a caller that holds a slice of a sequence (sequence parallelism,
//! generation with a cache) passes the offset of its first token.

use burn::tensor::{Device, Tensor, TensorData};

/// A contiguous run of global token positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub len: usize,
}

/// Where a forward's tokens sit in their sequence: runs of global positions in the order the
/// tokens are held (one run on a single rank; two under context parallelism's zigzag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Positions {
    pub spans: Vec<Span>,
    /// Positions at or past this are padding (a sequence rounded up to the ranks' pieces): they
    /// carry no loss and no real token attends to them, so their learned-position rows are
    /// zeros whatever the table holds.
    pub real_end: usize,
}

impl Positions {
    /// `len` tokens from `offset` on, none of them padding.
    pub fn contiguous(offset: usize, len: usize) -> Self {
        Self {
            spans: vec![Span { start: offset, len }],
            real_end: offset + len,
        }
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first token's position.
    pub fn start(&self) -> usize {
        self.spans.first().map_or(0, |s| s.start)
    }
}

/// Rotary tables for every span of `pos`, concatenated in the order the tokens are held.
pub fn rotary_tables_at(
    rot: usize,
    base: f64,
    pos: &Positions,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let (cos, sin): (Vec<_>, Vec<_>) = pos
        .spans
        .iter()
        .map(|s| rotary_tables(rot, base, s.start, s.len, device))
        .unzip();
    (cat_runs(cos, 2), cat_runs(sin, 2))
}

/// One tensor per run of positions joined along `dim` (a single run is returned as it is,
/// without the copy a one-element concatenation would make).
pub fn cat_runs<const D: usize>(mut parts: Vec<Tensor<D>>, dim: usize) -> Tensor<D> {
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(parts, dim)
    }
}

/// cos and sin tables of shape `[1, 1, len, rot]` for positions `offset..offset + len`,
/// laid out as Hugging Face does: `emb = cat(freqs, freqs)`.
pub fn rotary_tables(
    rot: usize,
    base: f64,
    offset: usize,
    len: usize,
    device: &Device,
) -> (Tensor<4>, Tensor<4>) {
    let half = rot / 2;
    // inv_freq[i] = base^(-2i / rot), computed in f32 as transformers does.
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / (base as f32).powf((2 * i) as f32 / rot as f32))
        .collect();
    let mut cos = Vec::with_capacity(len * rot);
    let mut sin = Vec::with_capacity(len * rot);
    for p in offset..offset + len {
        for k in 0..rot {
            let angle = p as f32 * inv_freq[k % half];
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let shape = [1, 1, len, rot];
    (
        Tensor::from_data(TensorData::new(cos, shape), device),
        Tensor::from_data(TensorData::new(sin, shape), device),
    )
}

/// ALiBi slopes (Press et al., 2022) for `n` heads. A power of two n gets the geometric
/// sequence `2^(-8/n · (i+1))`; otherwise the closest lower power of two p gets its slopes, and
/// the remaining `n − p` heads take every other slope of `2p` (the odd-numbered ones).
pub fn alibi_slopes(n: usize) -> Vec<f64> {
    fn pow2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-8.0 / n as f64);
        (0..n).map(|i| start.powi(i as i32 + 1)).collect()
    }
    if n == 0 {
        return Vec::new();
    }
    if n.is_power_of_two() {
        return pow2(n);
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let mut slopes = pow2(p);
    slopes.extend(pow2(2 * p).into_iter().step_by(2).take(n - p));
    slopes
}

#[cfg(test)]
mod tests {
    use super::alibi_slopes;

    #[test]
    fn alibi_slopes_match_the_paper() {
        // n = 8: 1/2, 1/4, ..., 1/256.
        let s = alibi_slopes(8);
        for (i, v) in s.iter().enumerate() {
            assert!((v - 0.5f64.powi(i as i32 + 1)).abs() < 1e-15);
        }
        // n = 12: the 8 slopes of n = 8, then slopes 1, 3, 5, 7 (0-based 0, 2, 4, 6) of n = 16,
        // which are 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
        let s = alibi_slopes(12);
        assert_eq!(s.len(), 12);
        for (k, e) in [0.5f64, 1.5, 2.5, 3.5].iter().enumerate() {
            assert!((s[8 + k] - 2f64.powf(-e)).abs() < 1e-15, "{k}");
        }
        assert_eq!(alibi_slopes(1), vec![2f64.powf(-8.0)]);
    }
}
