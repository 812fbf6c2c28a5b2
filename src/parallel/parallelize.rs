//! The one step that applies parallelism to a plain model (torchtitan's "parallelize"): the
//! model (`src/model`) knows nothing of ranks; this file cuts a replicated [`GenSlm`] into what
//! one rank of a layout holds and attaches the strategies through the model's two traits
//! (`TensorParallel`, `SequenceParallel`), in a fixed order — TP, then SP/CP. Data parallelism
//! and ZeRO need no change to the model: they act on batches and gradients (`train::shard`) and
//! on the optimizer state (`train::zero_shard`, `train::zero_units`).
//!
//! Also here: what a rank keeps of a learned-position table under SP ([`position_rows`]) and
//! the way back to the whole table for checkpoints ([`gather_shard`]).

use std::sync::Arc;

use burn::tensor::Tensor;

use crate::config::{ModelConfig, Position};
use crate::error::Result;
use crate::model::GenSlm;
use crate::ops::primitive::{host_to_param, tensor_to_vec};
use crate::parallel::bucket::gather_unequal;
use crate::parallel::ranks::Ranks;
use crate::parallel::ring::{RingGroup, UlyssesRing};
use crate::parallel::tensor::TpGroup;
use crate::parallel::tensor_slices::{
    check_degree, cut, gather_slices, slice_of, split_of, split_params,
};
use crate::parallel::ulysses::SpGroup;

/// Adam's first and second moments, cut together with the weights they belong to.
pub type Moments<'a> = Option<(&'a mut Vec<Tensor<1>>, &'a mut Vec<Tensor<1>>)>;

/// Turns a full (replicated) model into this rank's, applying the layout's parallelism from
/// outside the model in a fixed order: tensor parallelism first (each TP rank keeps its slices
/// of the weights), then sequence/context parallelism (the sequence group's attention, and
/// under SP alone this rank's rows of a learned-position table). `moments`, when given, are cut
/// exactly as the weights are. A skeleton's parameters (`GenSlm::empty`, filled later from a
/// `ParamSource`) hold no values: only the layout is cut.
pub fn parallelize(
    model: GenSlm,
    mut moments: Moments,
    ranks: &Ranks,
    seq_len: usize,
) -> Result<GenSlm> {
    let model = apply_tensor_parallel(model, moments.as_mut(), ranks)?;
    apply_sequence_parallel(model, moments, ranks, seq_len)
}

/// Under TP: keeps this rank's slices of the weights (and of their Adam moments,
/// `parallel::tensor_slices`) and joins the TP group.
fn apply_tensor_parallel(
    mut model: GenSlm,
    mut moments: Option<&mut (&mut Vec<Tensor<1>>, &mut Vec<Tensor<1>>)>,
    ranks: &Ranks,
) -> Result<GenSlm> {
    let t = &ranks.topo;
    if t.tp == 1 {
        return Ok(model);
    }
    check_degree(&model.cfg, t.tp)?;
    for i in split_params(&model.layout) {
        let split = split_of(&model.layout, i).expect("a split parameter");
        let shape = model.layout.specs[i].shape.clone();
        let mine = |x: &Tensor<1>| match x.dims()[0] {
            0 => x.clone(),
            _ => cut(x, &shape, split, t.tp, t.tp_rank()),
        };
        model.params[i] = mine(&model.params[i]);
        if let Some((m, v)) = moments.as_mut() {
            m[i] = mine(&m[i]);
            v[i] = mine(&v[i]);
        }
        model.layout.specs[i].shape = slice_of(&shape, split, t.tp, t.tp_rank()).2;
    }
    model.tp = Some(Arc::new(TpGroup {
        comm: ranks.tp.clone(),
        seq_split: ranks.megatron_sp,
    }));
    Ok(model)
}

/// Under SP and/or CP: joins the sequence group (Ulysses over SP, the ring over CP, or both)
/// and, with learned positions under SP alone, keeps only this rank's rows of the table (and of
/// its moments), see [`position_rows`]. Under CP every rank keeps the whole table: its zigzag
/// chunks read rows from both ends of it.
fn apply_sequence_parallel(
    mut model: GenSlm,
    moments: Moments,
    ranks: &Ranks,
    seq_len: usize,
) -> Result<GenSlm> {
    let t = &ranks.topo;
    if t.seq_degree() == 1 {
        return Ok(model);
    }
    check_positions(&model.cfg, seq_len)?;
    let mut ulysses = SpGroup::new(ranks.sp.clone());
    if let (Some(pos), 1) = (model.layout.embed_pos, t.cp) {
        let [rows, h] = [
            model.layout.specs[pos].shape[0],
            model.layout.specs[pos].shape[1],
        ];
        let (first, count) = position_rows(t.padded_len(seq_len), rows, t.sp, t.sp_rank());
        let cut = |t: &Tensor<1>| match t.dims()[0] {
            0 => t.clone(),
            _ => t.clone().narrow(0, first * h, count * h),
        };
        model.params[pos] = cut(&model.params[pos]);
        if let Some((m, v)) = moments {
            m[pos] = cut(&m[pos]);
            v[pos] = cut(&v[pos]);
        }
        model.layout.specs[pos].shape = vec![count, h];
        ulysses.pos_shard = Some(first);
    }
    let ring = || RingGroup::new(ranks.cp.clone());
    model.sp = Some(match (t.sp > 1, t.cp > 1) {
        (true, false) => Arc::new(ulysses),
        (false, true) => Arc::new(ring()),
        _ => Arc::new(UlyssesRing {
            ulysses,
            ring: ring(),
        }),
    });
    Ok(model)
}

/// The rows `(first, count)` of a learned-position table of `table_rows` rows that SP rank `r`
/// of `p` owns when training on sequences padded to `padded` tokens: rank r's tokens use
/// positions `[r·s/P, (r+1)·s/P)`, so it owns those rows (clipped to the table: padding needs
/// none); the last rank also keeps the rows past the sequence `[s, M)`, which no step reads but
/// a checkpoint must return unchanged (AdamW's weight decay still applies to them, exactly as
/// on one rank).
pub fn position_rows(padded: usize, table_rows: usize, p: usize, r: usize) -> (usize, usize) {
    let stride = padded / p;
    let first = (r * stride).min(table_rows);
    let count = if r + 1 == p {
        table_rows - first
    } else {
        stride.min(table_rows - first)
    };
    (first, count)
}

/// Checks that a learned-position table can serve `seq_len` under SP degree `p`, before any
/// work starts.
pub fn check_positions(cfg: &ModelConfig, seq_len: usize) -> Result<()> {
    if cfg.position == Position::Learned && seq_len > cfg.max_position_embeddings {
        return Err(crate::error::Error::Invalid(format!(
            "--seq-len {seq_len}: learned positions cover only max_position_embeddings = {} \
             tokens; use --seq-len {} or less",
            cfg.max_position_embeddings, cfg.max_position_embeddings
        )));
    }
    Ok(())
}

/// The full learned-position table (or a moment of it) from the SP group's shards, on every
/// SP rank.
pub fn gather_shard(t: &Tensor<1>, ranks: &Ranks) -> Result<Tensor<1>> {
    let all = gather_unequal(ranks.sp.as_ref(), &tensor_to_vec(t), None, ranks.bucket)?;
    Ok(host_to_param(all.unwrap_or_default(), &t.device()))
}

/// Under TP, the whole model from the TP group's slices of `model`, on TP rank 0 (`None` on
/// the others; every rank of the group must call it); `model` itself without TP. For
/// checkpoints: world rank 0's TP group joins its slices there.
pub fn join_tp_slices(mut model: GenSlm, ranks: &Ranks) -> Result<Option<GenSlm>> {
    if ranks.topo.tp == 1 {
        return Ok(Some(model));
    }
    let layout = crate::model::params::Layout::new(&model.cfg);
    let joined = gather_slices(&model.params, &layout, ranks.tp.as_ref(), ranks.bucket)?;
    let Some(p) = joined else {
        return Ok(None);
    };
    (model.params, model.layout, model.tp) = (p, layout, None);
    Ok(Some(model))
}

/// [`gather_shard`] to SP rank 0 only (`None` on the others): for checkpoints.
pub fn gather_shard_to_root(t: &Tensor<1>, ranks: &Ranks) -> Result<Option<Tensor<1>>> {
    let all = gather_unequal(ranks.sp.as_ref(), &tensor_to_vec(t), Some(0), ranks.bucket)?;
    Ok(all.map(|v| host_to_param(v, &t.device())))
}
