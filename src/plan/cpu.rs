//! CPU-process terms: what a genslm process on this kind of machine holds besides the tensors
//! of [`super::terms`], so that the same model predicts the peak memory genslm measures
//! (`peak_rss_mib` in `metrics.jsonl`, the process' VmHWM; one process per rank under MPI).
//!
//! - **Process baseline** (measured, not derived): the binary, its libraries and the runtime,
//!   read as the peak of a run whose tensors are negligible (release build, 2-core Xeon,
//!   glibc): `genslm bench step` at 16 tokens (tiny): 10.6 MiB; `genslm train` on tiny at 64
//!   tokens: 18.1 MiB one process (FASTA→parquet, data loader and metrics on top), 26.2 MiB and
//!   29.1 MiB per rank under `mpirun -np 2` / `-np 4` (Open MPI 4.1.4). Minus the model's own
//!   ~2 MiB at those sizes: 10, 15 and 25 MiB.
//! - **Allocator retention**: glibc serves allocations below its mmap threshold from the heap,
//!   and heap memory freed by the backward stays resident. The threshold is dynamic (it rises to
//!   the largest mmapped block freed so far, at most 32 MiB); in genslm's process it settles
//!   between 8 and 16 MiB (measured: a 25M run's activation memory stays resident when its
//!   largest activation tensor, the MLP's `[b, s/p, i]` fp32, is 8 MiB, and is returned when it
//!   is 16 MiB). When it stays, the optimizer step's buffers come on top of the
//!   forward/backward peak.
//! - **Optimizer-step buffers** with more than one rank (`src/train/shard.rs`,
//!   `src/parallel/mpi.rs`): all gradients are copied into one flat `Vec<f32>` grown by
//!   `extend` (Rust's amortised doubling, simulated exactly over genslm's parameter order),
//!   and the MPI all-reduce takes a second, exact-size copy as its send buffer; ZeRO-1 with
//!   DP adds one more copy (the reduce-scatter's). MPI's internal scratch is not modelled
//!   (about 50 MiB measured for 25M).

use serde::Serialize;

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
        CpuRun::BenchStep => 10.0 * MIB,
        CpuRun::Train => 15.0 * MIB,
        CpuRun::TrainMpi => 25.0 * MIB,
    }
}

/// Whether the run keeps optimizer states (AdamW's two fp32 moments).
pub fn has_optimizer(run: CpuRun) -> bool {
    run != CpuRun::BenchStep
}

/// Largest activation tensor that glibc's heap keeps resident after it is freed (measured
/// boundary: kept at 8 MiB, returned at 16 MiB).
pub const RETAINED_TENSOR_MAX: f64 = 8.0 * MIB;

/// Whether the activation memory freed by the backward stays resident: the largest activation
/// tensor, `b·(s/p)·i` elements of the MLP, is at most [`RETAINED_TENSOR_MAX`].
pub fn retains_activations(m: &ModelConfig, st: &Strategy, seq_len: usize) -> bool {
    let e = st.precision.activation_bytes();
    let local = seq_len as f64 / st.layout.seq_shard() as f64;
    let largest =
        st.batch_size as f64 * local * m.intermediate_size as f64 * e / st.layout.tp as f64;
    largest <= RETAINED_TENSOR_MAX
}

/// ZeRO-3's gathered weights at the forward/backward peak (`src/train/zero_units.rs`): with
/// checkpointing, the recomputed layer's full weights and the all-gather's flat host buffer;
/// without, every layer's gathered weights (kept by its autodiff graph until its backward)
/// plus that buffer for one layer.
pub fn gathered_weights(m: &ModelConfig, st: &Strategy, checkpointed: bool) -> f64 {
    let l = &st.layout;
    if l.zero < 3 || l.ranks() == 1 {
        return 0.0;
    }
    let layer = 4.0 * super::terms::layer_params(m);
    if checkpointed {
        2.0 * layer
    } else {
        (m.num_layers as f64 + 1.0) * layer
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
    let n: usize = sizes.iter().sum();
    if l.zero == 2 {
        // ZeRO-2 reduce-scatters each layer's gradients during the backward; at the step it
        // all-gathers one unit at a time (the flat buffer and the new weights).
        let largest = sizes.iter().copied().max().unwrap_or(0) as f64;
        return 8.0 * largest.max(super::terms::layer_params(&m));
    }
    // One host copy of every gradient, plus up to one bucket staged and one bucket's send
    // copy inside the communicator.
    let bucket = crate::parallel::bucket::DEFAULT_BUCKET.min(n);
    let mut elems = n + 2 * bucket;
    let zero1_group = l.dp * l.cp;
    if zero1_group > 1 && l.zero >= 1 {
        // ZeRO-1 over DP × CP: the padded flat gradient for the reduce-scatter and the rank's
        // block.
        elems += n + n.div_ceil(zero1_group);
    }
    4.0 * elems as f64
}
