//! Training samples: records cut into windows of `seq_len` codons, split into train and
//! validation, served in a seeded order that a checkpoint can resume exactly.
//!
//! A record longer than `seq_len` is cut into consecutive, non-overlapping windows; the last,
//! shorter window is padded with `[PAD]` and the padding is masked out of the loss. Windows of
//! one token carry no next-token target and are dropped.

use crate::error::{Error, Result};
use crate::rng::{Domain, SplitMix64};

/// A slice `[start, start + len)` of record `record`'s tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub record: usize,
    pub start: usize,
    pub len: usize,
}

/// A padded batch: `tokens` is `[batch, seq_len]` row-major; `mask[i]` is 1 for real tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq_len: usize,
    pub tokens: Vec<u32>,
    pub mask: Vec<u8>,
}

impl Batch {
    /// Number of next-token targets: real tokens that have a real token before them.
    pub fn n_targets(&self) -> usize {
        (0..self.batch)
            .map(|b| {
                let row = &self.mask[b * self.seq_len..(b + 1) * self.seq_len];
                row.iter().filter(|&&m| m == 1).count().saturating_sub(1)
            })
            .sum()
    }
}

/// Cuts every record into windows of at most `seq_len` tokens.
pub fn windows(records: &[Vec<u32>], seq_len: usize) -> Vec<Window> {
    let mut out = Vec::new();
    for (r, toks) in records.iter().enumerate() {
        let mut start = 0;
        while start < toks.len() {
            let len = (toks.len() - start).min(seq_len);
            if len >= 2 {
                out.push(Window {
                    record: r,
                    start,
                    len,
                });
            }
            start += seq_len;
        }
    }
    out
}

/// Token records with their train/validation windows.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub records: Vec<Vec<u32>>,
    pub seq_len: usize,
    pub pad_id: u32,
    pub train: Vec<Window>,
    pub val: Vec<Window>,
    /// Fingerprint of `records` when the trainer loaded them (empty otherwise).
    pub fingerprint: String,
}

impl Corpus {
    /// Splits windows into train and validation: a seeded shuffle, then the first
    /// `round(val_fraction · n)` windows (at least one when the fraction is positive and there
    /// are two or more windows) are validation.
    pub fn new(
        records: Vec<Vec<u32>>,
        seq_len: usize,
        pad_id: u32,
        val_fraction: f64,
        seed: u64,
    ) -> Result<Self> {
        if seq_len < 2 {
            return Err(Error::Invalid(format!(
                "--seq-len {seq_len}: must be at least 2 (one token and its successor)"
            )));
        }
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(Error::Invalid(format!(
                "--val-fraction {}: must be in [0, 1)",
                crate::error::short_num(val_fraction)
            )));
        }
        let mut all = windows(&records, seq_len);
        if all.is_empty() {
            return Err(Error::Invalid(if records.is_empty() {
                "no training samples: the data holds no records".into()
            } else {
                "no training samples: every record is shorter than 2 codons".into()
            }));
        }
        SplitMix64::stream(seed, Domain::Split, 0).shuffle(&mut all);
        let mut n_val = (val_fraction * all.len() as f64).round() as usize;
        if val_fraction > 0.0 && all.len() >= 2 {
            n_val = n_val.max(1);
        }
        n_val = n_val.min(all.len() - 1);
        let train = all.split_off(n_val);
        let mut val = all;
        // Validation order does not matter; keep it in file order for readable logs.
        val.sort_by_key(|w| (w.record, w.start));
        Ok(Self {
            records,
            seq_len,
            pad_id,
            train,
            val,
            fingerprint: String::new(),
        })
    }

    /// What a user should hear about the split `val_fraction` asked for, when it is far from
    /// what they got: no validation at all (one window, which training keeps), or at least
    /// one window held out where that is well over the fraction (2 windows at 0.1: half the
    /// data). Both were silent.
    pub fn split_note(&self, val_fraction: f64) -> Option<String> {
        let n = self.train.len() + self.val.len();
        let share = self.val.len() as f64 / n as f64;
        if val_fraction > 0.0 && self.val.is_empty() {
            Some(format!(
                "--val-fraction {}: the data makes one window of {} codons, which \
                 training keeps, so there is no validation (a shorter --seq-len makes more \
                 windows)",
                crate::error::short_num(val_fraction),
                self.seq_len
            ))
        } else if val_fraction > 0.0 && share > 2.0 * val_fraction {
            Some(format!(
                "--val-fraction {}: {} of the data's {n} windows of {} codons \
                 ({:.0}%) are held out for validation (at least one is); --val-fraction 0 \
                 trains on all of them, a shorter --seq-len makes more windows",
                crate::error::short_num(val_fraction),
                self.val.len(),
                self.seq_len,
                100.0 * share
            ))
        } else {
            None
        }
    }

    /// Pads `ws` into a batch.
    pub fn batch_of(&self, ws: &[Window]) -> Batch {
        let mut tokens = vec![self.pad_id; ws.len() * self.seq_len];
        let mut mask = vec![0u8; ws.len() * self.seq_len];
        for (b, w) in ws.iter().enumerate() {
            let src = &self.records[w.record][w.start..w.start + w.len];
            tokens[b * self.seq_len..b * self.seq_len + w.len].copy_from_slice(src);
            mask[b * self.seq_len..b * self.seq_len + w.len].fill(1);
        }
        Batch {
            batch: ws.len(),
            seq_len: self.seq_len,
            tokens,
            mask,
        }
    }
}

/// Serves training batches in a per-epoch seeded order. The whole state is `cursor` (windows
/// served so far), so a checkpoint resumes the same sequence of batches.
#[derive(Debug, Clone)]
pub struct Loader {
    seed: u64,
    pub cursor: u64,
    epoch_order: Option<(u64, Vec<usize>)>,
}

impl Loader {
    pub fn new(seed: u64, cursor: u64) -> Self {
        Self {
            seed,
            cursor,
            epoch_order: None,
        }
    }

    /// The next `batch_size` training windows (wrapping into the next epoch as needed).
    pub fn next_batch(&mut self, corpus: &Corpus, batch_size: usize) -> Batch {
        let n = corpus.train.len() as u64;
        let mut ws = Vec::with_capacity(batch_size);
        for _ in 0..batch_size {
            let epoch = self.cursor / n;
            let idx = (self.cursor % n) as usize;
            if self.epoch_order.as_ref().map(|(e, _)| *e) != Some(epoch) {
                let mut order: Vec<usize> = (0..n as usize).collect();
                SplitMix64::stream(self.seed, Domain::Shuffle, epoch).shuffle(&mut order);
                self.epoch_order = Some((epoch, order));
            }
            let order = &self.epoch_order.as_ref().expect("set above").1;
            ws.push(corpus.train[order[idx]]);
            self.cursor += 1;
        }
        corpus.batch_of(&ws)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No records at all is said so (it read "every record is shorter than 2 codons").
    #[test]
    fn no_samples_say_why() {
        let e = Corpus::new(vec![], 8, 0, 0.0, 1).unwrap_err().to_string();
        assert!(e.contains("holds no records"), "{e}");
        let e = Corpus::new(vec![vec![5]], 8, 0, 0.0, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("shorter than 2 codons"), "{e}");
    }

    #[test]
    fn windows_cover_records() {
        let recs = vec![(0..10).collect::<Vec<u32>>(), vec![7], (0..4).collect()];
        let w = windows(&recs, 4);
        let expect = [(0, 0, 4), (0, 4, 4), (0, 8, 2), (2, 0, 4)];
        let got: Vec<_> = w.iter().map(|w| (w.record, w.start, w.len)).collect();
        assert_eq!(got, expect);
    }

    #[test]
    fn padding_and_targets() {
        // 6 tokens, windows of 4: [10..14) and the padded tail [14, 15].
        let c = Corpus::new(vec![(10..16).collect()], 4, 3, 0.0, 1).unwrap();
        let mut ws = c.train.clone();
        ws.sort_by_key(|w| w.start);
        let b = c.batch_of(&ws);
        assert_eq!(b.tokens, vec![10, 11, 12, 13, 14, 15, 3, 3]);
        assert_eq!(b.mask, vec![1, 1, 1, 1, 1, 1, 0, 0]);
        assert_eq!(b.n_targets(), 3 + 1);
    }

    /// A split far from the fraction asked for is said: half the data for validation (2
    /// windows at 0.1), or none (1 window); 10 windows at 0.1 is what was asked.
    #[test]
    fn a_split_far_from_the_fraction_is_noted() {
        let c = |records: usize, f: f64| {
            let recs = (0..records).map(|i| vec![5 + i as u32; 8]).collect();
            Corpus::new(recs, 8, 3, f, 1).unwrap()
        };
        let half = c(2, 0.1).split_note(0.1).unwrap();
        assert!(
            half.contains("1 of the data's 2 windows of 8 codons (50%)"),
            "{half}"
        );
        let none = c(1, 0.5).split_note(0.5).unwrap();
        assert!(none.contains("there is no validation"), "{none}");
        assert_eq!(c(10, 0.1).split_note(0.1), None);
        assert_eq!(c(2, 0.0).split_note(0.0), None);
    }

    #[test]
    fn loader_resumes_from_cursor() {
        let recs: Vec<Vec<u32>> = (0..7).map(|i| vec![i; 8]).collect();
        let c = Corpus::new(recs, 4, 3, 0.2, 9).unwrap();
        let mut a = Loader::new(5, 0);
        let full: Vec<Batch> = (0..10).map(|_| a.next_batch(&c, 3)).collect();
        let mut b = Loader::new(5, 0);
        for _ in 0..4 {
            b.next_batch(&c, 3);
        }
        let mut resumed = Loader::new(5, b.cursor);
        for batch in &full[4..] {
            assert_eq!(&resumed.next_batch(&c, 3), batch);
        }
        // Each epoch visits every training window exactly once.
        let mut l = Loader::new(5, 0);
        let epoch = l.next_batch(&c, c.train.len());
        let mut firsts: Vec<u32> = epoch.tokens.chunks(4).map(|r| r[0]).collect();
        firsts.sort();
        let mut expect: Vec<u32> = c.train.iter().map(|w| w.record as u32).collect();
        expect.sort();
        assert_eq!(firsts, expect);
    }
}
