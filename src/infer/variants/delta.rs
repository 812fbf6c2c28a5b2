//! Δ log-likelihood of ALT against REF over one window, two ways.
//!
//! **Windows.** A variant whose first changed codon is c gets the window of W codons starting
//! at `a = min(max(c − W/2, 0), max(n − W, 0))` (centred, clipped at the CDS ends), extended
//! past W codons when the change itself runs further (a long deletion or MNV). REF is the
//! reference's codons of the window; ALT is the same reference bases with the change made (an
//! indel makes it longer or shorter; a trailing partial codon is dropped). Both are scored from
//! their first codon, which is never predicted, so the variant's own codon is scored whenever
//! it is not the window's first (only the start codon of a CDS shorter than W/2 is not). On a
//! record that is the CDS, windows at its ends hold what training saw there (`[BOS]`; a
//! partial last codon's `[UNK]` and `[EOS]`): see `place`.
//!
//! **Δ.** Σ log p(ALT tokens) − Σ log p(REF tokens), each over every predicted token of its
//! window, not normalised: a causal model's predictions before the variant are the same in
//! both, so the difference is the variant's effect on its own codon and on everything after
//! it, and dividing by a length would dilute a single codon's effect by the window. For indels
//! the two sums have different numbers of terms (`ref_tokens`, `alt_tokens` in the output).
//!
//! **Full recomputation** scores each REF and ALT window with its own forward pass (the
//! reference). **Prefix reuse**: REF and ALT are identical before the variant's codon j, so the
//! REF window is run once with a KV cache, and each ALT runs only tokens `j..` against the
//! cached prefix; variants with the same window and codon are decoded as one batch.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::infer::token_scores::token_score;
use crate::model::cache::KvCache;
use crate::model::decode::forward_cached;
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};

/// One variant's windows, as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// First codon of the window in the CDS (0-based).
    pub start: usize,
    /// REF and ALT tokens of the window.
    pub reference: Vec<u32>,
    pub alt: Vec<u32>,
    /// Index in both windows of the first token that differs.
    pub first: usize,
    /// Window indices of the codons whose per-codon Δ is reported.
    pub codons: Vec<usize>,
}

/// The result for one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// Σ log p(ALT) − Σ log p(REF) over the windows.
    pub total: f64,
    /// Mean log p per predicted codon, ALT's minus REF's: comparable across indels, whose
    /// windows predict different numbers of codons.
    pub mean: f64,
    /// Per reported codon: log p(ALT codon) − log p(REF codon); NaN for a window's first token.
    pub codons: Vec<f64>,
}

/// First codon of the window for a change at codon `c` of a CDS of `n` codons.
pub fn window_start(c: usize, n: usize, w: usize) -> usize {
    c.saturating_sub(w / 2).min(n.saturating_sub(w))
}

/// log p of every token of `tokens` from 1 on, given `logits[t]` (row t predicts token t+1).
fn log_probs(tokens: &[u32], logits: &[f32], vocab: usize) -> Vec<f64> {
    let mut out = vec![f64::NAN; tokens.len()];
    for t in 1..tokens.len() {
        let row = &logits[(t - 1) * vocab..t * vocab];
        out[t] = token_score(row, tokens[t], 0, false).log_prob;
    }
    out
}

/// Δ of `job` from REF's and ALT's per-token log-probabilities; an error where they are not
/// finite (weights that overflow in fp32 give NaN logits, and a NaN Δ is no answer).
fn delta(job: &Job, ref_lp: &[f64], alt_lp: &[f64]) -> Result<Delta> {
    let sum = |v: &[f64]| v.iter().skip(1).sum::<f64>();
    if !(sum(ref_lp).is_finite() && sum(alt_lp).is_finite()) {
        return Err(Error::Invalid(format!(
            "the model's log-probabilities in the window starting at codon {} are not finite \
             (NaN or infinite: do its weights overflow in fp32?); no Δ was written",
            job.start + 1
        )));
    }
    // A window with nothing predicted has no mean (callers do not score such windows).
    let mean = |v: &[f64]| sum(v) / v.len().saturating_sub(1) as f64;
    Ok(Delta {
        total: sum(alt_lp) - sum(ref_lp),
        mean: mean(alt_lp) - mean(ref_lp),
        codons: job
            .codons
            .iter()
            .map(|&i| match (ref_lp.get(i), alt_lp.get(i)) {
                (Some(r), Some(a)) if i > 0 => a - r,
                _ => f64::NAN,
            })
            .collect(),
    })
}

fn forward_log_probs(model: &GenSlm, tokens: &[u32]) -> Result<Vec<f64>> {
    let logits = model.forward(tokens_tensor(tokens, 1, tokens.len(), &model.device), 0)?;
    Ok(log_probs(
        tokens,
        &tensor_to_vec(&logits),
        model.cfg.vocab_size,
    ))
}

/// Δ of each job by two independent forward passes (REF, ALT) per job.
pub fn full_recomputation(model: &GenSlm, jobs: &[Job]) -> Result<Vec<Delta>> {
    jobs.iter()
        .map(|j| {
            let r = forward_log_probs(model, &j.reference)?;
            let a = forward_log_probs(model, &j.alt)?;
            delta(j, &r, &a)
        })
        .collect()
}

/// Job indices by REF window (its start and tokens), then by first differing token.
type Groups<'a> = BTreeMap<(usize, &'a [u32]), BTreeMap<usize, Vec<usize>>>;

/// Δ of each job, each REF window run once and the ALT suffixes decoded from its cached prefix
/// in batches of at most `batch` (jobs grouped by window and first differing token).
pub fn prefix_reuse(model: &GenSlm, jobs: &[Job], batch: usize) -> Result<Vec<Delta>> {
    let vocab = model.cfg.vocab_size;
    let mut by_window: Groups<'_> = BTreeMap::new();
    for (i, j) in jobs.iter().enumerate() {
        by_window
            .entry((j.start, j.reference.as_slice()))
            .or_default()
            .entry(j.first)
            .or_default()
            .push(i);
    }
    let mut out: Vec<Option<Delta>> = vec![None; jobs.len()];
    for ((_, reference), groups) in by_window {
        let mut cache = KvCache::with_capacity(reference.len());
        let hidden = forward_cached(
            model,
            tokens_tensor(reference, 1, reference.len(), &model.device),
            &mut cache,
        )?;
        let ref_logits = tensor_to_vec(&model.logits(hidden));
        let ref_lp = log_probs(reference, &ref_logits, vocab);
        for (first, members) in groups {
            for chunk in members.chunks(batch.max(1)) {
                let suffix = chunk
                    .iter()
                    .map(|&i| jobs[i].alt.len().saturating_sub(first))
                    .max()
                    .unwrap_or(0);
                // Only the prefix before `first` is shared; token `first` onwards is ALT's.
                let mut ids = vec![0u32; chunk.len() * suffix];
                for (r, &i) in chunk.iter().enumerate() {
                    let s = &jobs[i].alt[first.min(jobs[i].alt.len())..];
                    ids[r * suffix..r * suffix + s.len()].copy_from_slice(s);
                }
                let alt_logits = if suffix == 0 {
                    Vec::new()
                } else {
                    let mut c = cache.prefix(first, chunk.len(), suffix)?;
                    let h = forward_cached(
                        model,
                        tokens_tensor(&ids, chunk.len(), suffix, &model.device),
                        &mut c,
                    )?;
                    tensor_to_vec(&model.logits(h))
                };
                for (r, &i) in chunk.iter().enumerate() {
                    let alt = &jobs[i].alt;
                    if alt[..first.min(alt.len())] != reference[..first.min(alt.len())] {
                        return Err(Error::Invalid(format!(
                            "variant window at codon {}: ALT differs from REF before token {first}",
                            jobs[i].start + 1
                        )));
                    }
                    let mut lp = vec![f64::NAN; alt.len()];
                    for t in 1..alt.len() {
                        let row = if t <= first {
                            &ref_logits[(t - 1) * vocab..t * vocab]
                        } else {
                            let p = r * suffix + (t - 1 - first);
                            &alt_logits[p * vocab..(p + 1) * vocab]
                        };
                        lp[t] = token_score(row, alt[t], 0, false).log_prob;
                    }
                    out[i] = Some(delta(&jobs[i], &ref_lp, &lp)?);
                }
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|d| d.expect("every job is in a group"))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::{Config, Position};

    /// Prefix reuse gives full recomputation's Δ for substitutions, insertions and deletions,
    /// at the window's start, middle and end, batched or not.
    #[test]
    fn prefix_reuse_equals_full_recomputation() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
            let mut cfg = Config::load(&path).unwrap().model;
            cfg.position = pos;
            let model = GenSlm::init(cfg, 5, &Device::flex()).unwrap();
            let reference: Vec<u32> = (0..20u32).map(|i| 5 + (i * 41 + 7) % 64).collect();
            let mut jobs = Vec::new();
            for (first, change) in [(0, 0i32), (1, 0), (9, 0), (9, 1), (9, -1), (19, 0), (19, 2)] {
                let mut alt = reference.clone();
                alt[first] = 5 + (alt[first] + 13) % 64;
                match change {
                    1 => alt.insert(first + 1, 7),
                    2 => alt.extend([9, 10]),
                    -1 => {
                        alt.remove(first + 1);
                    }
                    _ => {}
                }
                jobs.push(Job {
                    start: 0,
                    reference: reference.clone(),
                    alt,
                    first,
                    codons: vec![first],
                });
            }
            let full = full_recomputation(&model, &jobs).unwrap();
            for batch in [1, 3, 16] {
                let fast = prefix_reuse(&model, &jobs, batch).unwrap();
                for (f, p) in full.iter().zip(&fast) {
                    assert!((f.total - p.total).abs() < 1e-4, "{pos:?} {f:?} {p:?}");
                    assert!((f.mean - p.mean).abs() < 1e-5, "{pos:?} {f:?} {p:?}");
                    for (a, b) in f.codons.iter().zip(&p.codons) {
                        assert!(a.is_nan() && b.is_nan() || (a - b).abs() < 1e-4);
                    }
                }
            }
            assert!(full[0].codons[0].is_nan() && full[2].total.abs() > 0.0);
        }
    }

    #[test]
    fn windows_are_centred_and_clipped() {
        assert_eq!(window_start(0, 100, 10), 0);
        assert_eq!(window_start(50, 100, 10), 45);
        assert_eq!(window_start(99, 100, 10), 90);
        assert_eq!(window_start(3, 4, 10), 0);
    }
}
