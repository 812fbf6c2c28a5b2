//! ZeRO stage 1 over the data-parallel group: the Adam moments (and the fp32 master copy being
//! updated) of the replicated parameters are split into D contiguous chunks of their flat
//! concatenation; DP rank d keeps chunk d only.
//!
//! One step: gradients are summed over the SP group, reduce-scattered over the DP group (each
//! rank receives the sum of its chunk), the chunk is updated with AdamW, and the updated chunks
//! are all-gathered so every rank holds the full parameters again. Per rank, optimizer memory
//! drops D-fold. Both collectives run in buckets (`parallel::bucket`), so no single call
//! exceeds MPI's count limit whatever the model size.

use burn::tensor::Tensor;

use crate::error::Result;
use crate::model::neox::{host_to_param, tensor_to_vec};
use crate::model::params::ParamSpec;
use crate::parallel::bucket::{
    all_gather_bucketed, gather_to_root_bucketed, pack, reduce_scatter_bucketed, unpack,
};
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
///
/// The flat concatenation of the replicated parameters (`total` elements) is padded with zeros
/// to `D · block` elements, `block = ⌈total / D⌉`, so that every rank's block has the same
/// length: MPI_Reduce_scatter_block, MPI_Allgather and their NCCL twins need equal counts.
/// DP rank d owns the real elements of `[d·block, (d+1)·block)`; the padding is never updated.
#[derive(Debug, Clone)]
pub struct ZeroShard {
    /// Replicated parameter indices, in flat order.
    pub params: Vec<usize>,
    pub lens: Vec<usize>,
    /// Real (unpadded) elements of the flat vector.
    pub total: usize,
    /// Elements per DP rank's block (padding included).
    pub block: usize,
    pub segments: Vec<Segment>,
    /// Moments of the segments (one tensor per segment).
    pub opt: AdamW,
}

/// Elements per rank when `total` elements are padded to a multiple of `d`.
pub fn block_len(total: usize, d: usize) -> usize {
    total.div_ceil(d)
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
        let total: usize = lens.iter().sum();
        let block = block_len(total, ranks.topo.dp);
        let from = (ranks.topo.dp_rank() * block).min(total);
        let segments = segments_of(&params, &lens, from, block.min(total - from));
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
            total,
            block,
            segments,
            opt,
        }
    }

    /// This rank's block of `values` (one host vector per segment), zero-padded to `block`.
    fn padded_block(&self, values: impl Iterator<Item = Vec<f32>>) -> Vec<f32> {
        let mut mine = Vec::with_capacity(self.block);
        values.for_each(|v| mine.extend_from_slice(&v));
        mine.resize(self.block, 0.0);
        mine
    }

    /// This rank's chunk of the DP-summed gradients (replicated parameters only; `grads` must
    /// already be summed over the SP group), reduce-scattered in buckets.
    pub fn reduce_scatter(&self, grads: &[Tensor<1>], ranks: &Ranks) -> Result<Vec<Tensor<1>>> {
        let device = grads[self.params[0]].device();
        if ranks.dp.on_device(&device) {
            // NCCL on device buffers: one flat, padded tensor; no host copy, no i32 limit.
            let parts = self.params.iter().map(|&i| grads[i].clone());
            let flat = pack(parts, self.block * ranks.topo.dp, &device);
            let mine = ranks.dp.reduce_scatter_tensor(flat)?;
            return Ok(unpack(&mine, self.segments.iter().map(|s| s.len)));
        }
        let mut flat = vec![0.0f32; self.block * ranks.topo.dp];
        let mut at = 0;
        for &i in &self.params {
            let g = tensor_to_vec(&grads[i]);
            flat[at..at + g.len()].copy_from_slice(&g);
            at += g.len();
        }
        let mut mine = vec![0.0f32; self.block];
        reduce_scatter_bucketed(ranks.dp.as_ref(), &flat, &mut mine, ranks.bucket)?;
        drop(flat);
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
        let device = params[self.params[0]].device();
        if ranks.dp.on_device(&device) {
            let mine = pack(new.into_iter(), self.block, &device);
            let all = ranks.dp.all_gather_tensor(mine)?;
            let pieces = unpack(&all, self.lens.iter().copied());
            for (&i, t) in self.params.iter().zip(pieces) {
                params[i] = t;
            }
            return Ok(());
        }
        let mine = self.padded_block(new.iter().map(tensor_to_vec));
        let mut flat = vec![0.0f32; self.block * ranks.topo.dp];
        all_gather_bucketed(ranks.dp.as_ref(), &mine, &mut flat, ranks.bucket)?;
        let mut at = 0;
        for (&i, &n) in self.params.iter().zip(&self.lens) {
            params[i] = host_to_param(flat[at..at + n].to_vec(), &device);
            at += n;
        }
        Ok(())
    }

    /// Full moments `(param, m, v)` of the replicated parameters on DP rank 0 (`None` on the
    /// others); every DP rank takes part. Only the root receives: a checkpoint is written by
    /// one rank, so the other ranks never hold the whole optimizer state.
    pub fn gather_moments(&self, ranks: &Ranks) -> Result<Option<Vec<GatheredMoments>>> {
        let root = ranks.topo.dp_rank() == 0;
        let gather = |moments: &[Tensor<1>]| -> Result<Option<Vec<f32>>> {
            let mine = self.padded_block(moments.iter().map(tensor_to_vec));
            let mut full = root.then(|| vec![0.0f32; self.block * ranks.topo.dp]);
            gather_to_root_bucketed(
                ranks.dp.as_ref(),
                &mine,
                full.as_deref_mut(),
                0,
                ranks.bucket,
            )?;
            Ok(full)
        };
        let (m, v) = (gather(&self.opt.m)?, gather(&self.opt.v)?);
        let (Some(m), Some(v)) = (m, v) else {
            return Ok(None);
        };
        let mut at = 0;
        let mut out = Vec::new();
        for (&i, &n) in self.params.iter().zip(&self.lens) {
            out.push((i, m[at..at + n].to_vec(), v[at..at + n].to_vec()));
            at += n;
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Padded blocks cover every real element exactly once, whatever `total % d` is, and
    /// every rank's block has the same length.
    #[test]
    fn padded_blocks_and_segments_cover_everything_once() {
        let (params, lens) = (vec![0, 2, 5], vec![3, 4, 3]);
        for d in 1..=12 {
            let block = block_len(10, d);
            assert!(block * d >= 10 && block * d < 10 + d);
            let mut covered = vec![0; 10];
            for r in 0..d {
                let from = (r * block).min(10);
                for s in segments_of(&params, &lens, from, block.min(10 - from)) {
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
            }
            assert_eq!(covered, vec![1; 10], "d = {d}");
        }
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
