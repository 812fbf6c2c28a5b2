//! One ZeRO shard: a group of parameters whose flat concatenation is split into N contiguous,
//! equal (padded) blocks over a sharding group of N ranks; rank r keeps block r of the Adam
//! moments (and, for ZeRO-3, of the values themselves).
//!
//! ZeRO-1 uses one shard of all replicated parameters over the DP group: gradients are summed
//! over the SP group, reduce-scattered over DP (each rank receives the sum of its chunk), the
//! chunk is updated with AdamW, and the updated chunks are all-gathered so every rank holds
//! the full parameters again. ZeRO-2/3 (`train::zero_units`) use one shard per layer over the
//! DP×SP group. The collectives run in buckets (`parallel::bucket`), so no single call exceeds
//! MPI's count limit whatever the model size.

use burn::tensor::{Device, Tensor};

use crate::config::Quantize;
use crate::error::Result;
use crate::model::params::ParamSpec;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::bucket::{
    gather_bucketed, pack, reduce_scatter_bucketed, unpack, unpack_host,
};
use crate::parallel::comm::Communicator;
use crate::parallel::quant::{all_gather_quantized, reduce_scatter_quantized};
use crate::train::optim::{AdamW, AdamWConfig};

/// A piece of parameter `param` covering elements `[start, start + len)` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub param: usize,
    pub start: usize,
    pub len: usize,
}

/// One parameter's full values: `(index, values)`.
pub type FullParam = (usize, Vec<f32>);

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

/// `values` concatenated on the host and zero-padded to `len` elements.
fn padded(values: impl Iterator<Item = Vec<f32>>, len: usize) -> Vec<f32> {
    let mut flat = Vec::with_capacity(len);
    values.for_each(|v| flat.extend_from_slice(&v));
    assert!(flat.len() <= len, "{} values do not fit {len}", flat.len());
    flat.resize(len, 0.0);
    flat
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
    /// The shard of rank `comm.rank()` of the sharding group `comm`; moments start from
    /// `full_moments` (our layout, one vector per parameter) when resuming, else zero; in host
    /// memory with `offload` (`AdamW::offload`).
    pub fn new(
        cfg: AdamWConfig,
        params: Vec<usize>,
        all: &[Tensor<1>],
        comm: &dyn Communicator,
        full_moments: Option<(&[Tensor<1>], &[Tensor<1>], u64)>,
        offload: bool,
    ) -> Self {
        let lens: Vec<usize> = params.iter().map(|&i| all[i].dims()[0]).collect();
        let total: usize = lens.iter().sum();
        let block = block_len(total, comm.size());
        let from = (comm.rank() * block).min(total);
        let segments = segments_of(&params, &lens, from, block.min(total - from));
        let pieces = Self::cut(&segments, all);
        let mut opt = AdamW::placed(cfg, &pieces, offload);
        if let Some((m, v, step)) = full_moments {
            let place = |t: Vec<Tensor<1>>| t.into_iter().map(|x| opt.to_state_device(x));
            let (m, v) = (Self::cut(&segments, m), Self::cut(&segments, v));
            (opt.m, opt.v) = (place(m).collect(), place(v).collect());
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

    /// This shard's pieces of `all` (one full tensor per parameter, indexed like the model's).
    fn cut(segments: &[Segment], all: &[Tensor<1>]) -> Vec<Tensor<1>> {
        segments
            .iter()
            .map(|s| {
                all[s.param]
                    .clone()
                    .without_autodiff()
                    .narrow(0, s.start, s.len)
            })
            .collect()
    }

    /// This shard's pieces of the parameter values `all`.
    pub fn pieces_of(&self, all: &[Tensor<1>]) -> Vec<Tensor<1>> {
        Self::cut(&self.segments, all)
    }

    /// This rank's chunk of the group-summed gradients, reduce-scattered in buckets over
    /// `comm`. `grads` holds one full gradient per parameter of the shard, in `params` order.
    pub fn reduce_scatter(
        &self,
        grads: &[Tensor<1>],
        comm: &dyn Communicator,
        bucket: usize,
        codec: Option<Quantize>,
    ) -> Result<Vec<Tensor<1>>> {
        let device = grads[0].device();
        if codec.is_none() && comm.on_device(&device) {
            // NCCL on device buffers: one flat, padded tensor; no host copy, no i32 limit.
            let flat = pack(grads.iter().cloned(), self.block * comm.size(), &device);
            let mine = comm.reduce_scatter_tensor(flat)?;
            return Ok(unpack(&mine, self.segments.iter().map(|s| s.len)));
        }
        let flat = self.grads_flat(grads, comm.size());
        let mine = self.scatter_host(flat, bucket, codec)(comm)?;
        Ok(self.chunk_of(&mine, &device))
    }

    /// `grads` (one per parameter) as one host vector padded to `n` blocks.
    pub fn grads_flat(&self, grads: &[Tensor<1>], n: usize) -> Vec<f32> {
        padded(grads.iter().map(tensor_to_vec), self.block * n)
    }

    /// The reduce-scatter of a [`ZeroShard::grads_flat`] vector: a job for any thread, giving
    /// this rank's block of the sum ([`crate::parallel::progress::start`] runs it overlapped),
    /// quantized by `codec` (all-to-all based, `parallel::quant`) or fp32.
    pub fn scatter_host(
        &self,
        flat: Vec<f32>,
        bucket: usize,
        codec: Option<Quantize>,
    ) -> impl FnOnce(&dyn Communicator) -> Result<Vec<f32>> + Send + 'static {
        let block = self.block;
        move |comm| {
            let mut mine = vec![0.0f32; block];
            match codec {
                Some(q) => reduce_scatter_quantized(comm, &flat, &mut mine, q, bucket)?,
                None => reduce_scatter_bucketed(comm, &flat, &mut mine, bucket)?,
            }
            Ok(mine)
        }
    }

    /// This rank's block of a sum (host) as one gradient piece per segment on `device`.
    pub fn chunk_of(&self, mine: &[f32], device: &Device) -> Vec<Tensor<1>> {
        let lens = self.segments.iter().map(|s| s.len);
        unpack_host(mine, lens)
            .into_iter()
            .map(|v| host_to_param(v, device))
            .collect()
    }

    /// The full parameters (one tensor per entry of `params`) from every rank's `pieces`,
    /// all-gathered over `comm` on `device`.
    pub fn all_gather(
        &self,
        pieces: Vec<Tensor<1>>,
        comm: &dyn Communicator,
        bucket: usize,
        device: &Device,
        codec: Option<Quantize>,
    ) -> Result<Vec<Tensor<1>>> {
        if codec.is_none() && comm.on_device(device) {
            // Offloaded pieces (ZeRO-3 `--offload optimizer`) live on the host.
            let here = pieces.into_iter().map(|p| p.to_device(device));
            let mine = pack(here, self.block, device);
            let all = comm.all_gather_tensor(mine)?;
            return Ok(unpack(&all, self.lens.iter().copied()));
        }
        let flat = self.gather_host(&pieces, bucket, codec)(comm)?;
        Ok(self.params_of(&flat, device))
    }

    /// The all-gather of this rank's `pieces` as a job for any thread, giving every rank's
    /// blocks in rank order (host); quantized by `codec` (every rank then holds the decoded
    /// values, its own block's too) or fp32.
    pub fn gather_host(
        &self,
        pieces: &[Tensor<1>],
        bucket: usize,
        codec: Option<Quantize>,
    ) -> impl FnOnce(&dyn Communicator) -> Result<Vec<f32>> + Send + 'static {
        let mine = padded(pieces.iter().map(tensor_to_vec), self.block);
        move |comm| {
            if let Some(q) = codec {
                return all_gather_quantized(comm, &mine, q, bucket);
            }
            let mut flat = vec![0.0f32; mine.len() * comm.size()];
            gather_bucketed(comm, &mine, Some(&mut flat[..]), None, bucket)?;
            Ok(flat)
        }
    }

    /// Every rank's blocks (host, from [`ZeroShard::gather_host`]) as the full parameters.
    pub fn params_of(&self, flat: &[f32], device: &Device) -> Vec<Tensor<1>> {
        unpack_host(flat, self.lens.iter().copied())
            .into_iter()
            .map(|v| host_to_param(v, device))
            .collect()
    }

    /// AdamW on this rank's `pieces` of the parameters with its `grad_chunk` scaled by
    /// `grad_scale`; returns the new pieces.
    pub fn update_pieces(
        &mut self,
        pieces: Vec<Tensor<1>>,
        grad_chunk: Vec<Tensor<1>>,
        grad_scale: f64,
        specs: &[ParamSpec],
        lr: f64,
    ) -> Vec<Tensor<1>> {
        let seg_specs: Vec<ParamSpec> = self
            .segments
            .iter()
            .map(|s| specs[s.param].clone())
            .collect();
        self.opt
            .update(pieces, grad_chunk, grad_scale, &seg_specs, lr)
    }

    /// AdamW on this rank's chunk, then the all-gather that gives everyone the new values.
    // The update's inputs and the all-gather's, passed through: a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grad_chunk: Vec<Tensor<1>>,
        grad_scale: f64,
        specs: &[ParamSpec],
        lr: f64,
        comm: &dyn Communicator,
        bucket: usize,
    ) -> Result<()> {
        let pieces = self.pieces_of(params);
        let new = self.update_pieces(pieces, grad_chunk, grad_scale, specs, lr);
        let device = params[self.params[0]].device();
        let full = self.all_gather(new, comm, bucket, &device, None)?;
        for (&i, t) in self.params.iter().zip(full) {
            params[i] = t;
        }
        Ok(())
    }

    /// Every rank's `pieces` joined into full parameters `(param, values)` on group rank 0
    /// (`None` on the others); every rank of `comm` takes part.
    pub fn gather_to_root(
        &self,
        pieces: &[Tensor<1>],
        comm: &dyn Communicator,
        bucket: usize,
    ) -> Result<Option<Vec<FullParam>>> {
        let mine = padded(pieces.iter().map(tensor_to_vec), self.block);
        let mut full = (comm.rank() == 0).then(|| vec![0.0f32; self.block * comm.size()]);
        gather_bucketed(comm, &mine, full.as_deref_mut(), Some(0), bucket)?;
        Ok(full.map(|f| {
            let lens = self.lens.iter().copied();
            self.params
                .iter()
                .copied()
                .zip(unpack_host(&f, lens))
                .collect()
        }))
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
