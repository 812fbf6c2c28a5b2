//! Sampling the next token from logits: temperature, top-k and top-p (nucleus) filtering,
//! applied in that order as Hugging Face's `generate` does, then one draw from the filtered
//! distribution.
//!
//! - **temperature** divides the logits (0 means greedy: the most likely token).
//! - **top-k** keeps the tokens whose logit is at least the k-th largest (ties with the k-th are
//!   kept, as in transformers' `TopKLogitsWarper`); 0 disables it.
//! - **top-p** keeps the most probable tokens, in decreasing order, until their probability
//!   reaches p (the token that crosses p is kept; at least one token always is), as in
//!   transformers' `TopPLogitsWarper`; 1 disables it.

use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub top_k: usize,
    pub top_p: f64,
    pub temperature: f64,
}

impl Default for SamplingParams {
    /// GenSLM's settings: top-k 50, top-p 0.95, temperature 1.
    fn default() -> Self {
        Self {
            top_k: 50,
            top_p: 0.95,
            temperature: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Invalid(format!(
                "--top-p {}: must be in (0, 1] (1 disables nucleus filtering)",
                self.top_p
            )));
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::Invalid(format!(
                "--temperature {}: must be a finite number ≥ 0 (0 = greedy)",
                self.temperature
            )));
        }
        Ok(())
    }
}

/// Index of the largest finite value (the first one on ties); `None` when none is finite.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_finite() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Sets every logit below the k-th largest to −∞ (k = 0 or k ≥ len: no change).
pub fn top_k_filter(logits: &mut [f64], k: usize) {
    if k == 0 || k >= logits.len() {
        return;
    }
    let mut sorted: Vec<f64> = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[k - 1];
    for v in logits.iter_mut() {
        if *v < kth {
            *v = f64::NEG_INFINITY;
        }
    }
}

/// Softmax of `logits` (−∞ entries get probability 0).
pub fn softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    let e: Vec<f64> = logits.iter().map(|&v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// Keeps the smallest set of most probable tokens whose probability reaches `p`: in decreasing
/// order of probability, a token is kept when the tokens before it sum to less than `p`.
/// The others are set to −∞. `p ≥ 1`: no change.
pub fn top_p_filter(logits: &mut [f64], p: f64) {
    if p >= 1.0 {
        return;
    }
    let probs = softmax(logits);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut before = 0.0;
    for (rank, &i) in order.iter().enumerate() {
        if rank > 0 && before >= p {
            logits[i] = f64::NEG_INFINITY;
        }
        before += probs[i];
    }
}

/// The distribution the next token is drawn from: temperature, then top-k, then top-p, then
/// softmax. With temperature 0 it is all mass on the argmax.
pub fn filtered_probs(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    if params.temperature == 0.0 {
        let mut p = vec![0.0; logits.len()];
        if let Some(i) = argmax(logits) {
            p[i] = 1.0;
        }
        return p;
    }
    let mut l: Vec<f64> = logits
        .iter()
        .map(|&v| v as f64 / params.temperature)
        .collect();
    top_k_filter(&mut l, params.top_k);
    top_p_filter(&mut l, params.top_p);
    softmax(&l)
}

/// Inverse-CDF draw: the first index whose cumulative probability exceeds `u ∈ [0, 1)`
/// (never an index of probability 0).
pub fn draw(probs: &[f64], u: f64) -> usize {
    let total: f64 = probs.iter().sum();
    let target = u * total;
    let mut acc = 0.0;
    let mut last = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            acc += p;
            last = i;
            if target < acc {
                return i;
            }
        }
    }
    last
}

/// Chooses the next token from `logits` with `params`, drawing from `rng`.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SplitMix64) -> usize {
    let probs = filtered_probs(logits, params);
    draw(&probs, rng.next_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(l: &[f64]) -> Vec<usize> {
        (0..l.len()).filter(|&i| l[i].is_finite()).collect()
    }

    #[test]
    fn top_k_keeps_the_k_largest_and_ties() {
        let mut l = vec![1.0, 5.0, 3.0, 4.0, 2.0];
        top_k_filter(&mut l, 2);
        assert_eq!(kept(&l), vec![1, 3]);
        let mut l = vec![1.0, 3.0, 3.0, 0.0];
        top_k_filter(&mut l, 1);
        assert_eq!(kept(&l), vec![1, 2], "ties with the k-th are kept");
        let mut l = vec![1.0, 2.0];
        top_k_filter(&mut l, 0);
        assert_eq!(kept(&l), vec![0, 1]);
        top_k_filter(&mut l, 9);
        assert_eq!(kept(&l), vec![0, 1]);
    }

    #[test]
    fn top_p_on_a_hand_made_distribution() {
        // probabilities 0.5, 0.3, 0.15, 0.05 (as log-probabilities, in shuffled order)
        let probs = [0.15, 0.5, 0.05, 0.3];
        let logits: Vec<f64> = probs.iter().map(|p: &f64| p.ln()).collect();
        let case = |p: f64| {
            let mut l = logits.clone();
            top_p_filter(&mut l, p);
            kept(&l)
        };
        assert_eq!(case(0.4), vec![1], "0.5 alone reaches 0.4");
        assert_eq!(case(0.6), vec![1, 3], "0.5 < 0.6: add 0.3");
        assert_eq!(case(0.79), vec![1, 3]);
        assert_eq!(case(0.81), vec![0, 1, 3]);
        assert_eq!(case(0.96), vec![0, 1, 2, 3]);
        assert_eq!(case(1.0), vec![0, 1, 2, 3]);
        assert_eq!(case(1e-9), vec![1], "at least one token");
    }

    #[test]
    fn filters_compose_and_renormalise() {
        // logits for probabilities 0.4, 0.3, 0.2, 0.1; top-k 3 leaves 0.4/0.3/0.2 = 4/9, 3/9, 2/9;
        // top-p 0.7 then keeps 4/9 + 3/9 = 7/9 ≥ 0.7 → 4/7, 3/7.
        let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
        let p = filtered_probs(
            &logits,
            &SamplingParams {
                top_k: 3,
                top_p: 0.7,
                temperature: 1.0,
            },
        );
        let want = [4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
        // Temperature 2 on logits ln(0.8), ln(0.2): probabilities ∝ √0.8, √0.2 = 2:1.
        let logits: Vec<f32> = [0.8f32, 0.2].iter().map(|p| p.ln()).collect();
        let p = filtered_probs(
            &logits,
            &SamplingParams {
                top_k: 0,
                top_p: 1.0,
                temperature: 2.0,
            },
        );
        assert!((p[0] - 2.0 / 3.0).abs() < 1e-6, "{p:?}");
        // Temperature 0: greedy.
        let p = filtered_probs(
            &[0.1, 3.0, f32::NEG_INFINITY],
            &SamplingParams {
                top_k: 0,
                top_p: 1.0,
                temperature: 0.0,
            },
        );
        assert_eq!(p, vec![0.0, 1.0, 0.0]);
    }

    #[test]
    fn draws_follow_the_distribution() {
        let probs = [0.0, 0.25, 0.0, 0.75];
        assert_eq!(draw(&probs, 0.0), 1);
        assert_eq!(draw(&probs, 0.2499), 1);
        assert_eq!(draw(&probs, 0.25), 3);
        assert_eq!(draw(&probs, 0.999_999), 3);
        let mut rng = SplitMix64::new(7);
        let n = 20_000;
        let hits = (0..n).filter(|_| draw(&probs, rng.next_f64()) == 1).count();
        let share = hits as f64 / n as f64;
        assert!((share - 0.25).abs() < 0.015, "{share}");
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_rng() {
        let logits = [0.3f32, 2.0, 1.9, -1.0];
        let params = SamplingParams {
            top_k: 1,
            top_p: 0.95,
            temperature: 1.0,
        };
        let mut rng = SplitMix64::new(1);
        for _ in 0..100 {
            assert_eq!(sample(&logits, &params, &mut rng), 1);
        }
        assert_eq!(argmax(&logits), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), None);
    }
}
