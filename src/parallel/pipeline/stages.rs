//! Which layers each pipeline chunk holds (`--pp-layers`, or balanced by layer count).
//!
//! The model's layers are cut into `stages × virtual` contiguous chunks; chunk `c` lives on
//! stage `c % stages` (see [`super::schedule`]). The embeddings go with chunk 0 (stage 0), the
//! final LayerNorm and the head with the last chunk (stage `stages − 1`).

use std::ops::Range;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stages {
    pub stages: usize,
    pub virtual_stages: usize,
    /// Chunk `c` holds layers `bounds[c]..bounds[c + 1]`.
    bounds: Vec<usize>,
}

impl Stages {
    /// `layers` cut into `stages × virtual_stages` chunks as evenly as possible. When the count
    /// does not divide, the extra layers go to the last chunks: under 1F1B the first stage
    /// holds the most micro-batches' activations (P of them, the last stage one), and the
    /// head the last stage also holds is small (a 69-codon vocabulary), so the later stages
    /// have memory to spare.
    pub fn balanced(layers: usize, stages: usize, virtual_stages: usize) -> Result<Self> {
        let chunks = Self::chunk_count(stages, virtual_stages)?;
        if layers < chunks {
            return Err(Error::Invalid(format!(
                "--pp {stages} × --pp-virtual {virtual_stages} = {chunks} chunks of layers, but the \
                 model has {layers} layers: every chunk needs at least one"
            )));
        }
        let (base, extra) = (layers / chunks, layers % chunks);
        let counts: Vec<usize> = (0..chunks)
            .map(|c| base + usize::from(c >= chunks - extra))
            .collect();
        Self::from_counts(&counts, layers, stages, virtual_stages)
    }

    /// Chunks of `counts[c]` layers each (`--pp-layers a,b,…`, one count per chunk in chunk
    /// order), checked against the model's `layers`.
    pub fn from_counts(
        counts: &[usize],
        layers: usize,
        stages: usize,
        virtual_stages: usize,
    ) -> Result<Self> {
        let chunks = Self::chunk_count(stages, virtual_stages)?;
        let given = counts
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",");
        if counts.len() != chunks {
            return Err(Error::Invalid(format!(
                "--pp-layers {given}: {} counts for {chunks} chunks (--pp {stages} × --pp-virtual \
                 {virtual_stages}); give one count per chunk",
                counts.len()
            )));
        }
        if let Some(c) = counts.iter().position(|&n| n == 0) {
            return Err(Error::Invalid(format!(
                "--pp-layers {given}: chunk {c} has no layers; every chunk needs at least one"
            )));
        }
        let sum = counts.iter().try_fold(0usize, |a, &n| a.checked_add(n));
        if sum != Some(layers) {
            return Err(Error::Invalid(format!(
                "--pp-layers {given}: the counts must add up to the model's {layers} layers"
            )));
        }
        let mut bounds = vec![0];
        for &n in counts {
            bounds.push(bounds.last().copied().unwrap_or(0) + n);
        }
        Ok(Self {
            stages,
            virtual_stages,
            bounds,
        })
    }

    fn chunk_count(stages: usize, virtual_stages: usize) -> Result<usize> {
        if stages == 0 || virtual_stages == 0 {
            return Err(Error::Invalid(format!(
                "--pp {stages} --pp-virtual {virtual_stages}: both must be at least 1"
            )));
        }
        stages.checked_mul(virtual_stages).ok_or_else(|| {
            Error::Invalid(format!(
                "--pp {stages} × --pp-virtual {virtual_stages} overflows"
            ))
        })
    }

    pub fn chunks(&self) -> usize {
        self.bounds.len() - 1
    }

    pub fn layers(&self, chunk: usize) -> Range<usize> {
        self.bounds[chunk]..self.bounds[chunk + 1]
    }

    /// The stage running `chunk`.
    pub fn stage_of(&self, chunk: usize) -> usize {
        chunk % self.stages
    }

    /// The chunks `stage` holds, in model order.
    pub fn chunks_of(&self, stage: usize) -> Vec<usize> {
        (stage..self.chunks()).step_by(self.stages).collect()
    }

    /// Layers stage `stage` holds (over all its chunks).
    pub fn stage_layers(&self, stage: usize) -> usize {
        self.chunks_of(stage)
            .into_iter()
            .map(|c| self.layers(c).len())
            .sum()
    }

    pub fn is_last(&self, chunk: usize) -> bool {
        chunk + 1 == self.chunks()
    }

    /// Layers per chunk, in chunk order (as `--pp-layers` takes them).
    pub fn counts(&self) -> Vec<usize> {
        self.bounds.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_cuts_cover_every_layer_once() {
        for layers in 1..=12 {
            for (p, v) in [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)] {
                let Ok(s) = Stages::balanced(layers, p, v) else {
                    assert!(layers < p * v, "{layers} layers over {p}×{v} refused");
                    continue;
                };
                let counts = s.counts();
                assert_eq!(counts.iter().sum::<usize>(), layers);
                let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(hi - lo <= 1, "{counts:?}");
                // Extra layers sit at the end.
                assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
                let mut next = 0;
                for c in 0..s.chunks() {
                    assert_eq!(s.layers(c).start, next);
                    next = s.layers(c).end;
                }
                assert_eq!(next, layers);
            }
        }
        assert_eq!(Stages::balanced(5, 2, 1).unwrap().counts(), vec![2, 3]);
        assert_eq!(
            Stages::balanced(5, 4, 1).unwrap().counts(),
            vec![1, 1, 1, 2]
        );
    }

    #[test]
    fn interleaved_chunks_alternate_stages() {
        let s = Stages::balanced(8, 2, 2).unwrap();
        assert_eq!(s.chunks_of(0), vec![0, 2]);
        assert_eq!(s.chunks_of(1), vec![1, 3]);
        assert_eq!(s.stage_of(3), 1);
        assert!(s.is_last(3) && !s.is_last(2));
    }

    #[test]
    fn bad_counts_are_refused_by_name() {
        let err = |r: Result<Stages>| r.unwrap_err().to_string();
        assert!(err(Stages::from_counts(&[2, 2], 5, 2, 1)).contains("add up to the model's 5"));
        assert!(err(Stages::from_counts(&[5, 0], 5, 2, 1)).contains("chunk 1 has no layers"));
        assert!(err(Stages::from_counts(&[5], 5, 2, 1)).contains("1 counts for 2 chunks"));
        assert!(err(Stages::balanced(3, 2, 2)).contains("every chunk needs at least one"));
        assert!(err(Stages::balanced(3, 0, 1)).contains("at least 1"));
        assert_eq!(
            Stages::from_counts(&[1, 4], 5, 2, 1).unwrap().counts(),
            vec![1, 4]
        );
    }
}
