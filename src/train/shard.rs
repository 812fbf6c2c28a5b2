//! What one rank computes of a global batch, and how gradients are combined across ranks.
//!
//! `--batch-size` is the global batch: DP rank d takes rows `[d·B/D, (d+1)·B/D)`; the sequence
//! group (CP × SP) takes the token columns of each row that `Topology::spans` gives it (SP rank
//! r of P alone: `[r·s/P, (r+1)·s/P)`), the row padded at its end to the group's pieces. A
//! position's target is the next token of the whole row (for the last token of a shard, the
//! first token of the next shard), so the sum of every rank's loss terms is exactly the
//! single-rank loss. Under TP the ranks of a TP group hold slices of the weights and see the
//! same tokens (their loss terms are equal, counted once). Gradients of replicated parameters
//! and of TP slices are summed over the data group (all ranks of one TP rank); the
//! learned-position shard's over the DP group only.

use burn::tensor::Tensor;

use crate::config::Quantize;
use crate::data::loader::Batch;
use crate::error::Result;
use crate::model::position::Positions;
use crate::model::GenSlm;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::bucket::unpack;
use crate::parallel::comm::Communicator;
use crate::parallel::quant::all_reduce_host;
use crate::parallel::ranks::Ranks;
use crate::parallel::tensor_slices::split_of;
use crate::train::optim::sums_of_squares;

/// This rank's slice of a batch: tokens `[rows, cols]`, next-token targets and weights.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalBatch {
    pub rows: usize,
    pub cols: usize,
    /// Global positions of the columns (padding past the batch's length included).
    pub positions: Positions,
    pub tokens: Vec<u32>,
    pub targets: Vec<i64>,
    pub weights: Vec<f32>,
}

/// Cuts this rank's slice out of a global batch. The sequence is padded at the end to the
/// sequence group's pieces ([`crate::parallel::Topology::padded_len`]); padding tokens carry
/// token id 0 and no loss.
pub fn local_batch(b: &Batch, ranks: &Ranks) -> LocalBatch {
    let t = &ranks.topo;
    let rows = b.batch / t.dp;
    let spans = t.spans(t.padded_len(b.seq_len));
    let cols: usize = spans.iter().map(|s| s.len).sum();
    let r0 = t.dp_rank() * rows;
    let mut out = LocalBatch {
        rows,
        cols,
        positions: Positions {
            spans: spans.clone(),
            real_end: b.seq_len,
        },
        tokens: Vec::with_capacity(rows * cols),
        targets: Vec::with_capacity(rows * cols),
        weights: Vec::with_capacity(rows * cols),
    };
    for r in r0..r0 + rows {
        for c in spans.iter().flat_map(|s| s.start..s.start + s.len) {
            let i = r * b.seq_len + c;
            let real = c < b.seq_len;
            out.tokens.push(if real { b.tokens[i] } else { 0 });
            let has_next = real && c + 1 < b.seq_len && b.mask[i + 1] == 1;
            out.targets
                .push(if has_next { b.tokens[i + 1] as i64 } else { 0 });
            out.weights.push(if has_next { 1.0 } else { 0.0 });
        }
    }
    out
}

/// Σ −log p(target) · weight over this rank's positions (`logits` from `model`).
pub fn local_nll(model: &GenSlm, logits: Tensor<3>, lb: &LocalBatch) -> Tensor<1> {
    model.nll(logits, lb.targets.clone(), lb.weights.clone())
}

/// Sums `grads[i]` for `idx` over `comm`, in buckets of `bucket` elements (one host copy of
/// each gradient, reduced in place, written back to its tensor); quantized by `codec`
/// (`parallel::quant`, through host buffers) or fp32.
pub fn reduce_params(
    grads: &mut [Tensor<1>],
    idx: &[usize],
    comm: &dyn Communicator,
    bucket: usize,
    codec: Option<Quantize>,
) -> Result<()> {
    if comm.size() == 1 || idx.is_empty() {
        return Ok(());
    }
    let device = grads[idx[0]].device();
    if codec.is_none() && comm.on_device(&device) {
        return reduce_params_on_device(grads, idx, comm, bucket);
    }
    let mut host: Vec<Vec<f32>> = idx.iter().map(|&i| tensor_to_vec(&grads[i])).collect();
    all_reduce_host(comm, &mut host, codec, bucket)?;
    for (&i, v) in idx.iter().zip(host) {
        grads[i] = host_to_param(v, &device);
    }
    Ok(())
}

/// [`reduce_params`] without leaving the device: gradients packed into flat buckets of up to
/// `bucket` elements (a larger gradient alone), each summed by one collective, then split back.
fn reduce_params_on_device(
    grads: &mut [Tensor<1>],
    idx: &[usize],
    comm: &dyn Communicator,
    bucket: usize,
) -> Result<()> {
    let mut start = 0;
    while start < idx.len() {
        let mut end = start + 1;
        let mut n = grads[idx[start]].dims()[0];
        while end < idx.len() && n + grads[idx[end]].dims()[0] <= bucket {
            n += grads[idx[end]].dims()[0];
            end += 1;
        }
        let members = &idx[start..end];
        let flat = Tensor::cat(members.iter().map(|&i| grads[i].clone()).collect(), 0);
        let sum = comm.all_reduce_tensor(flat)?;
        let pieces = unpack(&sum, members.iter().map(|&i| grads[i].dims()[0]));
        for (&i, t) in members.iter().zip(pieces) {
            grads[i] = t;
        }
        start = end;
    }
    Ok(())
}

/// Indices of the parameters whose gradients sum over the data group (replicated ones and TP
/// slices) and of the SP-sharded one (the learned position table when sequence parallelism
/// shards it). Empty parameters (another pipeline stage's) are in neither.
pub fn param_groups(model: &GenSlm) -> (Vec<usize>, Vec<usize>) {
    let held = |i: &usize| model.params[*i].dims()[0] > 0;
    let sharded = model
        .layout
        .embed_pos
        .filter(|_| model.position_shard().is_some())
        .filter(held);
    let all = (0..model.params.len()).filter(held);
    (
        all.filter(|&i| Some(i) != sharded).collect(),
        sharded.into_iter().collect(),
    )
}

/// Whether parameter `i` of `model` is a TP slice (its squares sum over the TP group in norms).
pub fn is_tp_slice(model: &GenSlm, i: usize) -> bool {
    model.tp.is_some() && split_of(&model.layout, i).is_some()
}

/// Combines every rank's gradients: replicated parameters and TP slices over the data group,
/// the position shard over the DP group.
pub fn reduce_gradients(grads: &mut [Tensor<1>], model: &GenSlm, ranks: &Ranks) -> Result<()> {
    let (replicated, sharded) = param_groups(model);
    let q = ranks.quantize.grads;
    reduce_params(grads, &replicated, ranks.data.as_ref(), ranks.bucket, q)?;
    reduce_params(grads, &sharded, ranks.dp.as_ref(), ranks.bucket, q)
}

/// The global norm from sums of squares: `whole` (replicated parameters, equal on every rank),
/// `tp_slices` (disjoint over the TP group) and `pos` (the position shard's, disjoint over SP;
/// `None` when SP does not shard the table, the same on every rank), each this stage's (the
/// stages hold disjoint parameters, summed over the pipeline).
pub fn combine_norm(whole: f64, tp_slices: f64, pos: Option<f64>, ranks: &Ranks) -> Result<f64> {
    let mut tp = [tp_slices];
    if ranks.topo.tp > 1 {
        ranks.tp.all_reduce_sum_f64(&mut tp)?;
    }
    let mut pos_sq = [0.0];
    if let Some(sq) = pos {
        pos_sq[0] = sq;
        ranks.sp.all_reduce_sum_f64(&mut pos_sq)?;
    }
    let mut total = [whole + tp[0] + pos_sq[0]];
    if ranks.topo.pp > 1 {
        ranks.pp.all_reduce_sum_f64(&mut total)?;
    }
    Ok(total[0].sqrt())
}

/// Global gradient norm with every element counted once: replicated gradients are identical
/// on all ranks after the reduction; TP slices are disjoint across the TP group, position
/// shards across the SP group.
pub fn global_grad_norm(grads: &[Tensor<1>], model: &GenSlm, ranks: &Ranks) -> Result<f64> {
    // Every gradient's Σ g² in one pass (one device read on a GPU).
    let all = sums_of_squares(&grads.iter().collect::<Vec<_>>());
    let sq = |i: &usize| all[*i];
    let (replicated, sharded) = param_groups(model);
    let (sliced, whole): (Vec<usize>, Vec<usize>) =
        replicated.iter().partition(|&&i| is_tp_slice(model, i));
    let pos = (!sharded.is_empty()).then(|| sharded.iter().map(sq).sum::<f64>());
    combine_norm(
        whole.iter().map(sq).sum(),
        sliced.iter().map(sq).sum(),
        pos,
        ranks,
    )
}
