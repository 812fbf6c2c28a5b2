//! CPU-process terms: what a genslm process on this kind of machine holds besides the tensors
//! of [`super::terms`], so that the same model predicts the peak memory genslm measures
//! (`peak_rss_mib` in `metrics.jsonl`, the process' VmHWM; one process per rank under MPI).
//!
//! - **Process baseline** (measured, not derived): the binary, its libraries and the runtime,
//!   read as the peak of a run whose tensors are negligible (release build, 2-core Xeon,
//!   glibc; re-measured 2026-11-24): `genslm bench attention` at 16 tokens (tiny): 13 MiB;
//!   `genslm train` on tiny at 64 tokens: 17.7 MiB one process (FASTA→parquet, data loader and
//!   metrics on top), 27.3 MiB and 30.6 MiB per rank under `mpirun -np 2` / `-np 4` (Open MPI
//!   4.1.4). Minus the model's own ~2 MiB at those sizes: 11, 15 and 25 MiB.
//! - **Allocator retention**: glibc serves allocations below its mmap threshold from the heap,
//!   and heap memory freed by the backward stays resident. genslm fixes that threshold at
//!   [`crate::alloc::MMAP_THRESHOLD`] (32 MiB; glibc's default moves it with what the process
//!   frees, which made the same layout peak 10% apart), so the activation memory stays resident
//!   when the largest activation tensor, the MLP's `[b, s/p, i]` fp32, is below it (a 25M run
//!   at seq 2048: 16 MiB), and is returned when it is not (seq 4096: 32 MiB). What stays
//!   ([`retained_share`]) is still resident at the optimizer step, whose buffers come on top.
//! - **Optimizer-step buffers** with more than one rank ([`step_buffers`];
//!   `src/train/dist_optim.rs`, `src/parallel/bucket.rs`): replicated gradients are reduced
//!   from one host copy in buckets (one bucket staged, one inside the communicator); ZeRO-1
//!   over DP peaks inside its reduce-scatter (the flat gradient, the rank's block, the staged
//!   bucket and Open MPI's scratch on rank 0, measured); ZeRO-2 gathers one unit at a time;
//!   ZeRO-3 has reduced everything during the backward. With ZeRO-3, the gathered layers
//!   ([`gathered_weights`]) count in the forward/backward.

use serde::Serialize;

use super::counts::{model_params, stage_params};
use super::{Strategy, MIB};
use crate::config::{ModelConfig, Position};
use crate::model::params::Layout;

/// What kind of genslm process is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuRun {
    /// `genslm bench step`: one forward and backward, no optimizer.
    BenchStep,
    /// `genslm train`, one process.
    Train,
    /// `genslm train` under mpirun, one process per rank.
    TrainMpi,
}

/// The process baseline (see the module documentation for how it was measured).
pub fn baseline(run: CpuRun) -> f64 {
    match run {
        CpuRun::BenchStep => 11.0 * MIB,
        CpuRun::Train => 15.0 * MIB,
        CpuRun::TrainMpi => 25.0 * MIB,
    }
}

/// Whether the run keeps optimizer states (AdamW's two fp32 moments).
pub fn has_optimizer(run: CpuRun) -> bool {
    run != CpuRun::BenchStep
}

/// Activation tensors smaller than this stay resident in glibc's heap after they are freed
/// (the mmap threshold genslm pins at start).
pub const RETAINED_TENSOR_MAX: f64 = crate::alloc::MMAP_THRESHOLD as f64;

/// Of the activation memory held in tensors below [`RETAINED_TENSOR_MAX`], the share that
/// counts as still resident at the optimizer step. genslm never trims the heap
/// (`crate::alloc`), so all of it stays resident, but the step's own heap-sized allocations
/// (new parameters, gradient pieces, blocks below the threshold) reuse part of it instead of
/// adding to it. Fitted, not derived: 0.7 puts every row of tests/plan_calibration.rs within
/// −13% … +15% (0.8: up to +17%, the ZeRO-1 rows over 4 processes).
const HEAP_KEPT: f64 = 0.7;

/// The share of the forward/backward's activation memory that stays resident after the
/// backward frees it: [`HEAP_KEPT`] of the bytes held in tensors below
/// [`RETAINED_TENSOR_MAX`]. A genslm layer keeps two `i`-wide tensors per token (the
/// MLP's fc1 output and gelu output, `b·(s/p)·i/t` elements each) and `narrow` elements per
/// token in `h`-wide ones (`[b, s/p, h]`, or Q/K/V/O after the Ulysses exchange, the same
/// size; `super::terms` counts them), so each kind is kept or returned as a whole.
pub fn retained_share(m: &ModelConfig, st: &Strategy, seq_len: usize, narrow: f64) -> f64 {
    let e = st.precision.activation_bytes();
    let local = st.batch_size as f64 * seq_len as f64 / st.layout.seq_shard() as f64;
    let (h, i) = (
        m.hidden_size as f64,
        m.intermediate_size as f64 / st.layout.tp as f64,
    );
    let kept = |width: f64| local * width * e < RETAINED_TENSOR_MAX;
    let wide = 2.0 * i;
    let held = if kept(h) { narrow } else { 0.0 } + if kept(i) { wide } else { 0.0 };
    HEAP_KEPT * held / (narrow + wide)
}

/// ZeRO-3's gathered weights at the forward/backward peak (`src/train/zero_units.rs`), with
/// the trainer's default `--prefetch-layers 1` (each more layer prefetched adds one layer):
/// with checkpointing, the running layer's full weights, the all-gather's flat host buffer of
/// the layer being installed and that of the layer gathered ahead; without, every layer's
/// gathered weights (kept by its autodiff graph until its backward) plus those two buffers.
pub fn gathered_weights(m: &ModelConfig, st: &Strategy, checkpointed: bool) -> f64 {
    let l = &st.layout;
    if l.zero < 3 || l.ranks() == 1 {
        return 0.0;
    }
    let layer = 4.0 * super::counts::layer_params(m);
    if checkpointed {
        3.0 * layer
    } else {
        (m.num_layers as f64 + 2.0) * layer
    }
}

/// Bytes of the optimizer step's gradient-reduction buffers (0 with one rank).
pub fn step_buffers(m: &ModelConfig, st: &Strategy, seq_len: usize) -> f64 {
    let l = &st.layout;
    if l.ranks() == 1 || l.zero >= 3 {
        // ZeRO-3 reduce-scatters during the backward and updates its blocks in place.
        return 0.0;
    }
    // genslm's parameter list for the planned position encoding.
    let mut m = m.clone();
    m.position = st.positions;
    let layout = Layout::new(&m);
    // Every parameter but an SP-sharded position table (which covers the sequence, s rows,
    // when replicated) is reduced from host copies in buckets (`parallel::bucket`).
    let sharded_table = st.shard_positions && l.sp > 1 && l.cp == 1;
    let sizes: Vec<usize> = layout
        .specs
        .iter()
        .enumerate()
        .filter_map(|(k, spec)| {
            if Some(k) == layout.embed_pos {
                (!sharded_table && m.position == Position::Learned)
                    .then_some(seq_len * m.hidden_size)
            } else {
                Some(spec.numel())
            }
        })
        .collect();
    // A pipeline stage reduces its own parameters only.
    let share = match st.stage {
        Some(v) => {
            let (vocab, tied) = (st.vocab_size, st.tied_embeddings);
            stage_params(&m, vocab, tied, &v) / model_params(&m, vocab, tied)
        }
        None => 1.0,
    };
    let n = (sizes.iter().sum::<usize>() as f64 * share).round() as usize;
    if l.zero == 2 {
        // ZeRO-2 reduce-scatters each layer's gradients during the backward; at the step it
        // all-gathers one unit at a time (the flat buffer and the new weights).
        let largest = sizes.iter().copied().max().unwrap_or(0) as f64;
        return 8.0 * largest.max(super::counts::layer_params(&m));
    }
    let bucket = crate::config::DEFAULT_BUCKET.min(n);
    let zero1_group = l.dp * l.cp;
    let elems = if zero1_group > 1 && l.zero >= 1 {
        // ZeRO-1 over DP × CP peaks inside the gradients' reduce-scatter: the padded flat
        // gradient, the rank's block, one bucket staged, and the scratch Open MPI's
        // reduce-scatter takes on rank 0 (measured: one bucket per other rank of the group;
        // rank 0's peak rose by 111 MiB with 2 ranks and by 192 MiB with 4, 64 MiB buckets).
        n + n.div_ceil(zero1_group) + bucket * zero1_group
    } else {
        // One host copy of every gradient, plus up to one bucket staged and one bucket's
        // send copy inside the communicator.
        n + 2 * bucket
    };
    4.0 * elems as f64
}
