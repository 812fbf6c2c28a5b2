//! `genslm plan`'s arguments: parsed here, handed to the library as a
//! [`genslm::plan::request::PlanRequest`].

use std::path::PathBuf;

use genslm::config::Position;
use genslm::plan::request::{PlanDevice, PlanRequest};
use genslm::plan::Precision;

use super::{mirror, AttentionArg};

mirror!(PositionArg => Position { Rotary, Learned, Alibi });
mirror!(PrecisionArg => Precision { Bf16, Fp32 });
mirror!(DeviceArg => PlanDevice {
    /// GPUs (CUDA context and allocator reserve).
    Gpu,
    /// CPU processes running genslm (one per rank; process baseline, fp32).
    Cpu,
});

/// `genslm plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Model config: a TOML file (e.g. configs/genslm-33b.toml), or a built-in preset by name
    /// (tiny, genslm-25m, genslm-250m, genslm-2.5b, genslm-25b, genslm-33b).
    #[arg(long, required_unless_present = "compare_published")]
    pub config: Option<PathBuf>,
    /// Number of GPUs (CPU processes with --device cpu).
    #[arg(long, required_unless_present = "compare_published")]
    pub gpus: Option<usize>,
    /// Memory of each GPU in GiB (of each process with --device cpu).
    #[arg(long, required_unless_present = "compare_published")]
    pub gpu_mem_gib: Option<f64>,
    /// Ulysses sequence-parallel degree (default: searched).
    #[arg(long)]
    pub sp: Option<usize>,
    /// Tensor-parallel degree, as genslm's --tp runs it: heads, MLP columns and vocabulary
    /// split; LayerNorm and residual activations 1/T of the sequence each (Megatron sequence
    /// parallelism; whole on every TP rank with --no-megatron-sp) (default: searched, ≤ a node).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Context-parallel degree (ring attention; default: searched).
    #[arg(long)]
    pub cp: Option<usize>,
    /// Data-parallel degree (default: what the GPUs leave).
    #[arg(long)]
    pub dp: Option<usize>,
    /// Pipeline stages, as genslm's --pp runs them (default: searched, with ZeRO 0 or 1).
    #[arg(long)]
    pub pp: Option<usize>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved, zb.
    #[arg(long, default_value = "1f1b")]
    pub pp_schedule: genslm::parallel::pipeline::schedule::ScheduleKind,
    /// Chunks of layers per pipeline stage (interleaved).
    #[arg(long, default_value_t = 1)]
    pub pp_virtual: usize,
    /// Layers per pipeline chunk, comma-separated, as genslm train's --pp-layers (default:
    /// balanced, extra layers on the last chunks); needs --pp.
    #[arg(long, value_delimiter = ',')]
    pub pp_layers: Option<Vec<usize>>,
    /// Micro-batches per step under PP (default: 4 × the stages).
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// ZeRO stage 0-3 (default: searched).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Attention (default: the config's).
    #[arg(long, value_enum)]
    pub attention: Option<AttentionArg>,
    /// Position encoding (default: the config's).
    #[arg(long, value_enum)]
    pub positions: Option<PositionArg>,
    /// Split a learned position table over the sequence-parallel ranks (genslm's trainer does
    /// this under --sp).
    #[arg(long)]
    pub shard_positions: bool,
    /// Full activation checkpointing: each layer keeps its input and is recomputed (genslm train
    /// --checkpoint-activations).
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Plan `genslm train --offload`: the optimizer's state (`optimizer`), the checkpointed
    /// layer inputs (`activations`, with --checkpoint-activations) or both (`all`) in host
    /// memory; the report adds the host bytes per rank.
    #[arg(
        long,
        default_value = "none",
        value_name = "none|optimizer|activations|all"
    )]
    pub offload: genslm::config::Offload,
    /// Plan TP as `genslm train --no-megatron-sp` runs it: LayerNorms, the residual and the
    /// embedding's output whole on every TP rank (default: Megatron sequence parallelism,
    /// 1/T of the sequence each, as the trainer runs TP by default).
    #[arg(long)]
    pub no_megatron_sp: bool,
    /// Number formats (default: bf16 mixed precision on GPUs, fp32 on CPU).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Also break the memory down at this sequence length.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// What runs the ranks.
    #[arg(long, value_enum, default_value = "gpu")]
    pub device: DeviceArg,
    /// GPUs per node: searched tensor parallelism stays within a node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Host memory per node in GiB: with --offload, a layout fits only if every rank's
    /// offloaded bytes fit in its share of it (default: not checked).
    #[arg(long)]
    pub host_mem_gib: Option<f64>,
    /// Table over GPU counts (powers of two up to --gpus) and layouts, with the best of each.
    #[arg(long, conflicts_with_all = ["sp", "tp", "cp", "dp", "pp", "seq_len"])]
    pub sweep: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Compare with the published Megatron-DeepSpeed maxima (25B/33B on A100-40GB), and with
    /// the peak memory Megatron-DeepSpeed logged for its long-sequence runs. Its layouts are
    /// the published ones: a layout flag beside it is refused (it was ignored, silently).
    #[arg(long, conflicts_with_all = [
        "config", "gpus", "gpu_mem_gib", "sweep", "seq_len", "host_mem_gib", "device",
        "sp", "tp", "cp", "dp", "pp", "pp_schedule", "pp_virtual", "pp_layers", "grad_accum",
        "zero", "attention", "positions", "shard_positions", "checkpoint_activations",
        "offload", "no_megatron_sp", "precision", "batch_size", "gpus_per_node",
    ])]
    pub compare_published: bool,
}

impl From<PlanArgs> for PlanRequest {
    fn from(a: PlanArgs) -> Self {
        Self {
            config: a.config,
            gpus: a.gpus,
            gpu_mem_gib: a.gpu_mem_gib,
            sp: a.sp,
            tp: a.tp,
            cp: a.cp,
            dp: a.dp,
            pp: a.pp,
            pp_schedule: a.pp_schedule,
            pp_virtual: a.pp_virtual,
            pp_layers: a.pp_layers,
            grad_accum: a.grad_accum,
            zero: a.zero,
            attention: a.attention.map(Into::into),
            positions: a.positions.map(Into::into),
            shard_positions: a.shard_positions,
            checkpoint_activations: a.checkpoint_activations,
            offload: a.offload,
            megatron_sp: !a.no_megatron_sp,
            precision: a.precision.map(Into::into),
            batch_size: a.batch_size,
            seq_len: a.seq_len,
            device: a.device.into(),
            gpus_per_node: a.gpus_per_node,
            host_mem_gib: a.host_mem_gib,
            sweep: a.sweep,
            json: a.json,
            compare_published: a.compare_published,
        }
    }
}
