//! Per-token scoring: which windows a record is cut into, and what one predicted token's
//! logits say about it.
//!
//! **Windows with a stride** (Hugging Face's perplexity recipe, in codons): window k covers
//! tokens `[k·S, min(k·S + W, n))`; it predicts the tokens from the end of the previous window
//! (or from its own second token) to its end. Every token is predicted exactly once, and a
//! token t of window k sees the tokens `[k·S, t)`: at least `W − S` of left context once past
//! the first window. `S = W` (the default) gives consecutive windows, where each window's
//! first token has no context and is not predicted, as in training.
//!
//! Token statistics are computed on the host in f64 from the model's fp32 logits: one
//! log-softmax over the whole vocabulary per predicted token (69 values), so the cost is
//! negligible next to the forward pass.

/// One window of a record's tokens: the forward runs over `start..end` from position 0, and
/// predicts the tokens `first..end` (each from the tokens of the window before it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoreWindow {
    pub start: usize,
    pub end: usize,
    pub first: usize,
}

impl ScoreWindow {
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// The windows of `n` tokens for window `w` and stride `stride` (see the module docs);
/// windows that predict nothing are left out. `w ≥ 2` and `1 ≤ stride ≤ w` are the caller's.
pub fn score_windows(n: usize, w: usize, stride: usize) -> Vec<ScoreWindow> {
    debug_assert!(w >= 2 && (1..=w).contains(&stride));
    let mut out = Vec::new();
    let (mut start, mut prev_end) = (0usize, 0usize);
    while start < n {
        let end = (start + w).min(n);
        let first = (start + 1).max(prev_end);
        if end > first {
            out.push(ScoreWindow { start, end, first });
        }
        if end == n {
            break;
        }
        prev_end = end;
        start += stride;
    }
    out
}

/// What the model said about one predicted token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenScore {
    /// Index of the predicted token in the record's token sequence.
    pub index: usize,
    /// Tokens of left context the prediction saw.
    pub context: usize,
    /// The token that is there.
    pub target: u32,
    /// log p(target), natural log.
    pub log_prob: f64,
    /// Entropy of the predicted distribution, nats.
    pub entropy: f64,
    /// 1 + the number of tokens with a strictly higher logit than the target.
    pub rank: u32,
    /// The `k` most likely tokens and their probabilities, most likely first (ties by id).
    pub top: Vec<(u32, f32)>,
    /// log p of every vocabulary id, when asked for.
    pub log_probs: Option<Vec<f32>>,
}

/// The statistics of one position's `logits` (the whole vocabulary) for `target`; `index` and
/// `context` are left 0 for the caller.
pub fn token_score(logits: &[f32], target: u32, top_k: usize, full: bool) -> TokenScore {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let t = logits[target as usize];
    let log_prob = t as f64 - lse;
    let entropy = -logits
        .iter()
        .map(|&x| {
            let lp = x as f64 - lse;
            lp.exp() * lp
        })
        .sum::<f64>();
    let rank = 1 + logits.iter().filter(|&&x| x > t).count() as u32;
    let top = if top_k == 0 {
        Vec::new()
    } else {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        // Descending logit, ascending id on ties: a total order, so the list is reproducible.
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        ids.truncate(top_k);
        ids.into_iter()
            .map(|i| (i, (logits[i as usize] as f64 - lse).exp() as f32))
            .collect()
    };
    let log_probs = full.then(|| logits.iter().map(|&x| (x as f64 - lse) as f32).collect());
    TokenScore {
        index: 0,
        context: 0,
        target,
        log_prob,
        entropy,
        rank,
        top,
        log_probs,
    }
}

/// The scores of the tokens window `w` predicts, from its logits `[w.len(), vocab]` (row-major;
/// row p predicts token `w.start + p + 1`).
pub fn window_scores(
    w: &ScoreWindow,
    tokens: &[u32],
    logits: &[f32],
    vocab: usize,
    top_k: usize,
    full: bool,
) -> Vec<TokenScore> {
    (w.first..w.end)
        .map(|i| {
            let p = i - 1 - w.start;
            let row = &logits[p * vocab..(p + 1) * vocab];
            TokenScore {
                index: i,
                context: i - w.start,
                ..token_score(row, tokens[i], top_k, full)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every token from index 1 on is predicted exactly once, with at least `w − s` tokens of
    /// context once it could have them, and no window is longer than `w`.
    #[test]
    fn every_token_is_predicted_once_with_the_stated_context() {
        for n in 0..40 {
            for w in 2..12 {
                for s in 1..=w {
                    let ws = score_windows(n, w, s);
                    let mut seen = vec![0u32; n];
                    for x in &ws {
                        assert!(x.len() <= w && x.first > x.start && x.end <= n);
                        for (t, c) in seen.iter_mut().enumerate().take(x.end).skip(x.first) {
                            *c += 1;
                            assert!(t - x.start >= (w - s).min(t), "{n} {w} {s} {x:?} {t}");
                        }
                    }
                    // With S = W a window's first token has no context and is not predicted.
                    for (t, &c) in seen.iter().enumerate() {
                        let unpredicted = t == 0 || (s == w && t % w == 0);
                        assert_eq!(c, u32::from(!unpredicted), "{n} {w} {s} token {t}");
                    }
                }
            }
        }
    }

    /// The default stride is today's consecutive windows (crate::data::loader::windows).
    #[test]
    fn stride_equal_to_the_window_is_the_training_windows() {
        for n in 0..50 {
            for w in 2..9 {
                let ours: Vec<(usize, usize)> = score_windows(n, w, w)
                    .iter()
                    .map(|x| (x.start, x.len()))
                    .collect();
                let theirs: Vec<(usize, usize)> = crate::data::loader::windows(&[vec![0; n]], w)
                    .iter()
                    .map(|x| (x.start, x.len))
                    .collect();
                assert_eq!(ours, theirs, "n {n} w {w}");
            }
        }
    }

    /// Against the definitions, computed naively: softmax by division, entropy, rank by
    /// counting, top-k by repeated arg-max.
    #[test]
    fn token_statistics_match_their_definitions() {
        let logits: Vec<f32> = (0..69)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
            .collect();
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let p: Vec<f64> = logits.iter().map(|&x| (x as f64).exp() / z).collect();
        for target in [0u32, 5, 22, 68] {
            let TokenScore {
                log_prob: lp,
                entropy: h,
                rank,
                top,
                log_probs: full,
                ..
            } = token_score(&logits, target, 5, true);
            assert!((lp - p[target as usize].ln()).abs() < 1e-12);
            let h_ref: f64 = -p.iter().map(|&q| q * q.ln()).sum::<f64>();
            assert!((h - h_ref).abs() < 1e-12);
            let better = p.iter().filter(|&&q| q > p[target as usize]).count();
            assert_eq!(rank as usize, better + 1);
            let mut left: Vec<usize> = (0..69).collect();
            for &(id, prob) in &top {
                let best = *left
                    .iter()
                    .max_by(|&&a, &&b| p[a].partial_cmp(&p[b]).unwrap().then(b.cmp(&a)))
                    .unwrap();
                assert_eq!(id as usize, best);
                assert!((prob as f64 - p[best]).abs() < 1e-7);
                left.retain(|&i| i != best);
            }
            let full = full.unwrap();
            for (a, b) in full.iter().zip(&p) {
                assert!((*a as f64 - b.ln()).abs() < 1e-6);
            }
        }
        // A large logit does not overflow.
        let s = token_score(&[1e4, 0.0, -1e4], 0, 0, false);
        assert!(s.log_prob.abs() < 1e-12 && s.rank == 1);
    }
}
