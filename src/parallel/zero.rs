//! ZeRO stage 1 over the data-parallel group: the Adam moments (and the fp32 master copy being
//! updated) of the replicated parameters are split into D contiguous chunks of their flat
//! concatenation; DP rank d keeps chunk d only.
//!
//! One step: gradients are summed over the SP group, reduce-scattered over the DP group (each
//! rank receives the sum of its chunk), the chunk is updated with AdamW, and the updated chunks
//! are all-gathered so every rank holds the full parameters again. Per rank, optimizer memory
//! drops D-fold.

use burn::tensor::Tensor;

use crate::error::Result;
use crate::model::neox::{host_to_param, tensor_to_vec};
use crate::model::params::ParamSpec;
use crate::parallel::ranks::Ranks;
use crate::train::optim::{AdamW, AdamWConfig};

/// A piece of parameter `param` covering elements `[start, start + len)` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub param: usize,
    pub start: usize,
    pub len: usize,
}

/// One parameter's full Adam moments: `(index, m, v)`.
pub type GatheredMoments = (usize, Vec<f32>, Vec<f32>);

/// This DP rank's chunk of the replicated parameters and its AdamW state.
#[derive(Debug, Clone)]
pub struct ZeroShard {
    /// Replicated parameter indices, in flat order.
    pub params: Vec<usize>,
    pub lens: Vec<usize>,
    /// Elements per DP rank's chunk.
    pub chunk_lens: Vec<usize>,
    pub segments: Vec<Segment>,
    /// Moments of the segments (one tensor per segment).
    pub opt: AdamW,
}

/// Splits `total` elements into `d` contiguous chunks, the first `total % d` one longer.
pub fn chunk_lens(total: usize, d: usize) -> Vec<usize> {
    (0..d)
        .map(|i| total / d + usize::from(i < total % d))
        .collect()
}

/// The segments of the flat range `[from, from + len)` over parameters of lengths `lens`.
pub fn segments_of(params: &[usize], lens: &[usize], from: usize, len: usize) -> Vec<Segment> {
    let mut out = Vec::new();
    let (mut at, end) = (0usize, from + len);
    for (&p, &n) in params.iter().zip(lens) {
        let (a, b) = (at.max(from), (at + n).min(end));
        if a < b {
            out.push(Segment {
                param: p,
                start: a - at,
                len: b - a,
            });
        }
        at += n;
    }
    out
}

impl ZeroShard {
    /// The shard of DP rank `ranks.topo.dp_rank()`; moments start from `full_moments` (our
    /// layout, one vector per parameter) when resuming, else zero.
    pub fn new(
        cfg: AdamWConfig,
        params: Vec<usize>,
        all: &[Tensor<1>],
        ranks: &Ranks,
        full_moments: Option<(&[Tensor<1>], &[Tensor<1>], u64)>,
    ) -> Self {
        let lens: Vec<usize> = params.iter().map(|&i| all[i].dims()[0]).collect();
        let chunk_lens = chunk_lens(lens.iter().sum(), ranks.topo.dp);
        let d = ranks.topo.dp_rank();
        let from: usize = chunk_lens[..d].iter().sum();
        let segments = segments_of(&params, &lens, from, chunk_lens[d]);
        let cut =
            |t: &Tensor<1>, s: &Segment| t.clone().without_autodiff().narrow(0, s.start, s.len);
        let pieces: Vec<Tensor<1>> = segments.iter().map(|s| cut(&all[s.param], s)).collect();
        let mut opt = AdamW::new(cfg, &pieces);
        if let Some((m, v, step)) = full_moments {
            opt.m = segments.iter().map(|s| cut(&m[s.param], s)).collect();
            opt.v = segments.iter().map(|s| cut(&v[s.param], s)).collect();
            opt.step = step;
        }
        Self {
            params,
            lens,
            chunk_lens,
            segments,
            opt,
        }
    }

    /// This rank's chunk of the DP-summed gradients (replicated parameters only; `grads` must
    /// already be summed over the SP group).
    pub fn reduce_scatter(&self, grads: &[Tensor<1>], ranks: &Ranks) -> Result<Vec<Tensor<1>>> {
        let device = grads[self.params[0]].device();
        let flat: Vec<f32> = self
            .params
            .iter()
            .flat_map(|&i| tensor_to_vec(&grads[i]))
            .collect();
        let mine = ranks.dp.reduce_scatter_sum(&flat, &self.chunk_lens)?;
        let mut at = 0;
        Ok(self
            .segments
            .iter()
            .map(|s| {
                let t = host_to_param(mine[at..at + s.len].to_vec(), &device);
                at += s.len;
                t
            })
            .collect())
    }

    /// AdamW on this rank's chunk, then the all-gather that gives everyone the new values.
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grad_chunk: Vec<Tensor<1>>,
        specs: &[ParamSpec],
        lr: f64,
        ranks: &Ranks,
    ) -> Result<()> {
        let pieces: Vec<Tensor<1>> = self
            .segments
            .iter()
            .map(|s| params[s.param].clone().narrow(0, s.start, s.len))
            .collect();
        let seg_specs: Vec<ParamSpec> = self
            .segments
            .iter()
            .map(|s| specs[s.param].clone())
            .collect();
        let new = self.opt.update(pieces, grad_chunk, &seg_specs, lr);
        let mine: Vec<f32> = new.iter().flat_map(tensor_to_vec).collect();
        let flat = ranks.dp.all_gather(&mine)?.concat();
        let device = params[self.params[0]].device();
        let mut at = 0;
        for (&i, &n) in self.params.iter().zip(&self.lens) {
            params[i] = host_to_param(flat[at..at + n].to_vec(), &device);
            at += n;
        }
        Ok(())
    }

    /// Full moments `(param, m, v)` of the replicated parameters (every DP rank takes part;
    /// for checkpoints).
    pub fn gather_moments(&self, ranks: &Ranks) -> Result<Vec<GatheredMoments>> {
        let m: Vec<f32> = self.opt.m.iter().flat_map(tensor_to_vec).collect();
        let v: Vec<f32> = self.opt.v.iter().flat_map(tensor_to_vec).collect();
        let (m, v) = (
            ranks.dp.all_gather(&m)?.concat(),
            ranks.dp.all_gather(&v)?.concat(),
        );
        let mut at = 0;
        let mut out = Vec::new();
        for (&i, &n) in self.params.iter().zip(&self.lens) {
            out.push((i, m[at..at + n].to_vec(), v[at..at + n].to_vec()));
            at += n;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_and_segments_cover_everything_once() {
        assert_eq!(chunk_lens(10, 3), vec![4, 3, 3]);
        let (params, lens) = (vec![0, 2, 5], vec![3, 4, 3]);
        let mut covered = vec![0; 10];
        let mut from = 0;
        for c in chunk_lens(10, 3) {
            for s in segments_of(&params, &lens, from, c) {
                let base: usize = params
                    .iter()
                    .zip(&lens)
                    .take_while(|(p, _)| **p != s.param)
                    .map(|(_, n)| n)
                    .sum();
                for c in &mut covered[base + s.start..base + s.start + s.len] {
                    *c += 1;
                }
            }
            from += c;
        }
        assert_eq!(covered, vec![1; 10]);
        assert_eq!(
            segments_of(&params, &lens, 2, 3),
            vec![
                Segment {
                    param: 0,
                    start: 2,
                    len: 1
                },
                Segment {
                    param: 2,
                    start: 0,
                    len: 2
                }
            ]
        );
    }
}
