//! What `genslm plan` is asked: the model, the cluster, the layout flags (fixed where given,
//! searched where not) and the options of the step. The command line fills it
//! (`src/cli/plan.rs`); the library never sees the argument parser.

use std::path::PathBuf;

use crate::config::{AttentionKind, Position};
use crate::parallel::pipeline::schedule::ScheduleKind;
use crate::plan::Precision;

/// What runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanDevice {
    /// GPUs (CUDA context and allocator reserve).
    Gpu,
    /// CPU processes running genslm (one per rank; process baseline, fp32).
    Cpu,
}

/// One `genslm plan` request.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Model config (TOML), e.g. configs/genslm-33b.toml.
    pub config: Option<PathBuf>,
    /// Number of GPUs (CPU processes with --device cpu).
    pub gpus: Option<usize>,
    /// Memory of each GPU in GiB (of each process with --device cpu).
    pub gpu_mem_gib: Option<f64>,
    /// Ulysses sequence-parallel degree (default: searched).
    pub sp: Option<usize>,
    /// Tensor-parallel degree, as genslm's --tp runs it: heads, MLP columns and vocabulary
    /// split, LayerNorm and residual activations split over the sequence (Megatron sequence
    /// parallelism) unless `megatron_sp` is off (default: searched, ≤ a node).
    pub tp: Option<usize>,
    /// Context-parallel degree (ring attention; default: searched).
    pub cp: Option<usize>,
    /// Data-parallel degree (default: what the GPUs leave).
    pub dp: Option<usize>,
    /// Pipeline stages (default: searched, ZeRO 0 or 1 with them as the trainer runs them).
    pub pp: Option<usize>,
    /// Pipeline schedule.
    pub pp_schedule: ScheduleKind,
    /// Chunks of layers per pipeline stage (interleaved).
    pub pp_virtual: usize,
    /// Layers per pipeline chunk, as `--pp-layers` cuts them (default: balanced).
    pub pp_layers: Option<Vec<usize>>,
    /// Micro-batches per step under PP (default 4·P).
    pub grad_accum: Option<usize>,
    /// ZeRO stage 0-3 (default: searched).
    pub zero: Option<u8>,
    /// Attention (default: the config's).
    pub attention: Option<AttentionKind>,
    /// Position encoding (default: the config's).
    pub positions: Option<Position>,
    /// Split a learned position table over the sequence-parallel ranks (genslm's trainer does
    /// this under --sp).
    pub shard_positions: bool,
    /// Full activation checkpointing: each layer keeps its input and is recomputed (genslm train
    /// --checkpoint-activations).
    pub checkpoint_activations: bool,
    /// State kept in host memory instead of the GPU's (genslm train --offload).
    pub offload: crate::config::Offload,
    /// Under TP, Megatron sequence parallelism (the trainer's default; `--no-megatron-sp`).
    pub megatron_sp: bool,
    /// Number formats (default: bf16 mixed precision on GPUs, fp32 on CPU).
    pub precision: Option<Precision>,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Also break the memory down at this sequence length.
    pub seq_len: Option<usize>,
    /// What runs the ranks.
    pub device: PlanDevice,
    /// GPUs per node: searched tensor parallelism stays within a node.
    pub gpus_per_node: usize,
    /// Host memory per node in GiB: with `--offload`, a layout fits only if each rank's
    /// offloaded bytes fit in its share (the node's memory over its ranks). `None`: unchecked.
    pub host_mem_gib: Option<f64>,
    /// Table over GPU counts (powers of two up to --gpus) and layouts, with the best of each.
    pub sweep: bool,
    /// Print JSON instead of text.
    pub json: bool,
    /// Compare with the published Megatron-DeepSpeed maxima (25B/33B on A100-40GB), and with
    /// the peak memory Megatron-DeepSpeed logged for its long-sequence runs.
    pub compare_published: bool,
}
