//! The memory of the model's states per rank: weights, gradients and optimizer moments (and
//! the learned position table's), as ZeRO, tensor/pipeline parallelism and offloading divide
//! them (notation in [`super`]).

use super::counts::stage_params;
use super::{cpu, Checkpointing, Hardware, Precision, Recipe, StageView, Strategy, Target};
use crate::config::{ModelConfig, Position};

/// Whether gradients occupy their own memory during the forward/backward peak: always in
/// Megatron's contiguous buffer; in genslm only under checkpointing, where the gradients of the
/// layers above are complete while the lowest layer is recomputed (without it, gradients are
/// allocated as the backward frees the activations).
pub(super) fn grads_at_peak(st: &Strategy) -> bool {
    matches!(st.recipe, Recipe::Megatron { .. })
        || matches!(st.checkpointing, Checkpointing::Full { .. })
}

pub(super) fn has_optimizer(hw: &Hardware) -> bool {
    match hw.target {
        Target::Gpu => true,
        Target::Cpu { run } => cpu::has_optimizer(run),
    }
}

/// ZeRO divisor for a term that ZeRO partitions from `stage` on.
pub(super) fn zdiv(zero: u8, stage: u8, group: f64) -> f64 {
    if zero >= stage {
        group
    } else {
        1.0
    }
}

/// Weights, gradients (when `grads`) and optimizer states of the model and of the position
/// table: (parameters, gradients, optimizer states, position table).
pub(super) fn states(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    s: f64,
    grads: bool,
) -> (f64, f64, f64, f64) {
    let ([params, gradients, optimizer], [pp, pg, po]) = state_parts(m, st, hw, s, grads);
    (params, gradients, optimizer, pp + pg + po)
}

/// (weights, gradients, optimizer states) of the model without the position table, and of the
/// table.
pub(super) fn state_parts(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    s: f64,
    grads: bool,
) -> ([f64; 3], [f64; 3]) {
    let l = &st.layout;
    let (pb, gb, ob) = held_state_bytes(st);
    let ob = if has_optimizer(hw) { ob } else { 0.0 };
    let gb = if grads { gb } else { 0.0 };
    // Offloaded: the optimizer's state lives on the host; with fp32 weights under ZeRO-3 the
    // rank's weight shard is also the master copy and goes with it (the working weights are
    // the gathered ones).
    let (pb, ob) = match offloaded_state(st, hw) {
        (true, master_shard) => (if master_shard { 0.0 } else { pb }, 0.0),
        (false, _) => (pb, ob),
    };
    let n = model_share(m, st);
    let z = l.zero_group() as f64;
    let params = n * pb / zdiv(l.zero, 3, z);
    let gradients = n * gb / zdiv(l.zero, 2, z);
    let optimizer = n * ob / zdiv(l.zero, 1, z);
    (
        [params, gradients, optimizer],
        position_states(m, st, s, (pb, gb, ob)),
    )
}

/// Bytes per parameter of (weights, gradients, optimizer state) a rank holds. Megatron-DeepSpeed
/// (the published runs): DeepSpeed's layout, [`Precision::state_bytes`]. genslm's trainer
/// (`train::master`): gradients are accumulated and reduced in fp32 (4 bytes), and under
/// ZeRO-3 a rank's weight shard is the fp32 master (4) with the moments beside it (8); the
/// bf16 working weights exist only gathered.
pub(super) fn held_state_bytes(st: &Strategy) -> (f64, f64, f64) {
    let (pb, _, ob) = st.precision.state_bytes();
    match st.recipe {
        Recipe::Genslm if st.layout.zero >= 3 => (4.0, 4.0, 8.0),
        Recipe::Genslm => (pb, 4.0, ob),
        Recipe::Megatron { .. } => st.precision.state_bytes(),
    }
}

/// Parameters of the rank's stage and TP slice. TP splits every matrix and the vocabulary;
/// LayerNorms and row-parallel biases are in fact replicated (≪ 0.1% of the weights, ignored).
pub(super) fn model_share(m: &ModelConfig, st: &Strategy) -> f64 {
    stage_params(m, st.vocab_size, st.tied_embeddings, &view(m, st)) / st.layout.tp as f64
}

/// Whether the optimizer's state is offloaded (GPU targets only: on a CPU the device is the
/// host), and whether the rank's weight shard goes with it (under ZeRO-3 when it is the fp32
/// master: fp32 weights, or genslm's trainer whatever the precision).
pub(super) fn offloaded_state(st: &Strategy, hw: &Hardware) -> (bool, bool) {
    let on = st.offload.optimizer() && hw.target == Target::Gpu && has_optimizer(hw);
    let master_shard = st.precision == Precision::Fp32 || st.recipe == Recipe::Genslm;
    (on, on && st.layout.zero >= 3 && master_shard)
}

/// Whether checkpointed layer inputs are kept in host memory (GPU targets, full
/// checkpointing).
pub(super) fn offloaded_inputs(st: &Strategy, hw: &Hardware) -> bool {
    st.offload.activations()
        && hw.target == Target::Gpu
        && matches!(st.checkpointing, Checkpointing::Full { .. })
}

/// The learned position table's (weights, gradients, optimizer states). A learned table covers
/// at least the sequence: max(s, max_position_embeddings) rows of h (a config's table longer
/// than the sequence is allocated whole: 2²⁴ rows of a tiny model passed the memory check and
/// aborted on a 4 GiB allocation). Sharded, each sequence shard owns rows/seq_shard rows and its
/// gradient is reduced over DP only, so ZeRO partitions it over D; replicated, it is
/// partitioned like any weight.
pub(super) fn position_states(
    m: &ModelConfig,
    st: &Strategy,
    s: f64,
    (pb, gb, ob): (f64, f64, f64),
) -> [f64; 3] {
    let l = &st.layout;
    if st.positions != Position::Learned || !view(m, st).embeddings {
        return [0.0; 3];
    }
    // Under CP every rank keeps the whole table (its zigzag chunks read both ends of it).
    let (shard, group) = if st.shard_positions && l.cp == 1 {
        (l.seq_shard() as f64, l.dp as f64)
    } else {
        (1.0, l.zero_group() as f64)
    };
    let rows = s.max(m.max_position_embeddings as f64);
    let el = rows * m.hidden_size as f64 / shard;
    [
        el * pb / zdiv(l.zero, 3, group),
        el * gb / zdiv(l.zero, 2, group),
        el * ob / zdiv(l.zero, 1, group),
    ]
}

/// What one rank holds when the optimizer step runs, position table included: (weights,
/// gradients, optimizer states), as genslm's metrics.jsonl accounts them (`memory`).
pub fn rank_states(m: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> [f64; 3] {
    let (model, table) = state_parts(m, st, hw, seq_len as f64, true);
    [0, 1, 2].map(|k| model[k] + table[k])
}

/// The share of the model the estimated rank holds (its pipeline stage, or all of it).
pub(super) fn view(m: &ModelConfig, st: &Strategy) -> StageView {
    st.stage.unwrap_or_else(|| StageView::whole(m))
}
