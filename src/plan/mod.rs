//! `genslm plan`: the memory one training step needs on each GPU (or CPU process), term by
//! term, and the longest sequence that fits.
//!
//! The model is written from first principles: every tensor a step keeps is counted as its shape
//! times its bytes per element, divided by the ranks that share it. Nothing in it is fitted to
//! the published maxima it is compared with ([`published`]). Its CPU-process terms ([`cpu`])
//! are checked against the peaks genslm itself measures (`tests/plan.rs`).
//!
//! Notation, per rank: `s` sequence length, `b` micro-batch, `h` hidden size, `a` heads, `i`
//! intermediate (MLP) size, `L` layers, `V` vocabulary, `e` bytes per activation element,
//! `t` tensor-parallel degree, `p` Ulysses sequence-parallel degree, `D` data-parallel degree,
//! `Z` the ZeRO partition group: `D·p` as in DeepSpeed-Ulysses (Ulysses SP ranks hold replicas,
//! so ZeRO can span DP × SP), or `D` as genslm's trainer partitions today.
//!
//! Two regions of a layer are split differently:
//! - the **sequence region** (LayerNorms, residual-stream inputs, dropout masks): split over
//!   `seq_shard = p·t` with Megatron sequence parallelism, over `p` without it (plain TP
//!   replicates these on every TP rank);
//! - the **head region** (Q, K, V, attention output, MLP columns, scores): split over
//!   `head_shard = p·t` (TP splits heads and MLP columns; Ulysses gives each rank `a/p` heads
//!   over the whole sequence, the same number of elements as `s/p` tokens of all heads).
//!
//! The peak is the largest of the phases of a step ([`Phase`]): forward/backward, building a
//! materialised attention mask, and (with genslm's own recipe) the optimizer step.

pub mod balance;
mod check;
pub mod command;
mod counts;
pub mod cpu;
pub mod measured;
mod offload;
pub mod published;
mod report;
pub mod request;
pub mod search;
pub mod stages;
mod state_terms;
mod terms;

use serde::Serialize;

use crate::config::{AttentionKind, ModelConfig, Position};
pub use crate::parallel::Degrees;

pub use check::check;
pub use counts::{layer_params, model_params, stage_params};
pub use stages::{PipePlan, StageView};
pub use state_terms::rank_states;

/// A byte count serialised as a whole number: an integer up to 2^53 (exact in every JSON
/// reader, JavaScript's included), a float above it (a cast to u64 capped 1.1e21 bytes of
/// naive attention at 18446744073709551615, so the parts outgrew their total).
#[derive(Debug, Clone, Copy)]
pub struct WholeBytes(pub f64);

impl Serialize for WholeBytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let v = self.0.max(0.0).round();
        if v <= 9_007_199_254_740_992.0 {
            s.serialize_u64(v as u64)
        } else {
            s.serialize_f64(v)
        }
    }
}

fn whole_bytes<S: serde::Serializer>(v: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    WholeBytes(*v).serialize(s)
}

fn whole_phase_bytes<S: serde::Serializer>(
    v: &[(Phase, f64)],
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(Some(v.len()))?;
    for (p, b) in v {
        seq.serialize_element(&(p, WholeBytes(*b)))?;
    }
    seq.end()
}

/// Bytes in one GiB.
pub const GIB: f64 = (1u64 << 30) as f64;
/// Bytes in one MiB.
pub const MIB: f64 = (1u64 << 20) as f64;

/// Number formats of a step: the trainer's own [`crate::config::Precision`]. `Bf16` plans
/// mixed precision (bf16 or fp16 weights, gradients and activations; fp32 master weights and
/// Adam moments in the optimizer), `Fp32` everything in fp32 (genslm on CPU).
pub use crate::config::Precision;

/// What `--offload` moves to host memory (see [`Strategy::offload`]).
pub use crate::config::Offload;

/// What each number format costs, in the planner's terms.
impl Precision {
    /// `e`: bytes per activation element.
    pub fn activation_bytes(self) -> f64 {
        match self {
            Precision::Bf16 => 2.0,
            Precision::Fp32 => 4.0,
        }
    }

    /// Bytes per parameter of (weights, gradients, optimizer states). bf16: 2 + 2 + (4 master
    /// + 4 m + 4 v); fp32: 4 + 4 + (4 m + 4 v) — AdamW with two moments either way.
    pub fn state_bytes(self) -> (f64, f64, f64) {
        match self {
            Precision::Bf16 => (2.0, 2.0, 12.0),
            Precision::Fp32 => (4.0, 4.0, 8.0),
        }
    }
}

/// Which tensors a transformer layer keeps for its backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Recipe {
    /// Megatron-LM's GPT layer as Korthikanti et al. ("Reducing Activation Recomputation in
    /// Large Transformer Models", 2022) count it: `s·b·h·(34 + 5·a·s/h)` bytes per layer in
    /// 16-bit with dropout and a 4h MLP. Gradients live in a contiguous buffer for the whole
    /// step.
    ///
    /// Without flash attention, long sequences take PyTorch's softmax (Megatron's fused kernel
    /// needs `s ≤ 16384` (2048 in the 2022 Megatron-DeepSpeed) and `b·a/t` a multiple of 4).
    /// `softmax_fp32`: query-key layer scaling (on by default in 2022–2023) runs it in fp32,
    /// which keeps 4-byte probabilities instead of `e`-byte ones. `score_buffer`: Megatron-LM's
    /// core attention writes the scores into a global `[b·a/t, s, s]` buffer of `e` bytes per
    /// element that lives for the whole run (Megatron-DeepSpeed 2022 has none).
    Megatron {
        dropout: bool,
        softmax_fp32: bool,
        score_buffer: bool,
    },
    /// genslm's GPT-NeoX layer under burn autodiff (`src/model/neox.rs`): the tensors each op
    /// saves, `18·h` fp32 elements per token per layer for a 4h MLP (see [`terms`]). Gradients are
    /// allocated as the backward frees activations.
    Genslm,
}

/// Activation checkpointing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Checkpointing {
    /// Every layer keeps its activations until its backward.
    None,
    /// Each layer keeps only its input and is recomputed in the backward. `partitioned`: the
    /// kept inputs are split over the TP ranks even without Megatron SP (DeepSpeed's
    /// `partition_activations`).
    Full { partitioned: bool },
}

/// The causal attention mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mask {
    /// No `[s, s]` mask on the device (flash attention's causal tiles, or a mask kept on the
    /// host).
    None,
    /// Megatron's `get_ltor_masks_and_position_ids`: `tril(ones(s, s))` in fp32, then
    /// `< 0.5` into a bool mask kept on every GPU for the step.
    Materialised,
}

/// Where the step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Target {
    /// A GPU: CUDA context and library workspaces plus allocator slack are reserved.
    Gpu,
    /// A CPU process running genslm (one per rank), with the process terms of [`cpu`].
    Cpu { run: cpu::CpuRun },
}

/// How the ranks split the work: the degrees (`tp · sp · cp · dp` ranks in all, the same
/// [`Degrees`] the trainer's topology takes) and what the planner adds to them — the ZeRO stage
/// and its partition group, and Megatron sequence parallelism. Reads of the degrees go through
/// `Deref` (`layout.tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Parallelism {
    /// Tensor-parallel degree `t` (Megatron column/row-parallel layers), Ulysses
    /// sequence-parallel degree `p` (all-to-all of Q, K, V, O around attention),
    /// context-parallel degree `c` (ring attention: each rank holds `s/c` tokens of every
    /// region, K/V blocks travel around the ring; weights replicated over it) and the
    /// data-parallel degree `D`.
    #[serde(flatten)]
    pub degrees: Degrees,
    /// ZeRO stage: 1 partitions optimizer states, 2 also gradients, 3 also weights, over `Z`.
    pub zero: u8,
    /// Megatron sequence parallelism on the TP group (the sequence region split over `t`).
    pub megatron_sp: bool,
    /// ZeRO partitions over DP × SP (DeepSpeed-Ulysses) rather than over DP only (genslm's
    /// trainer today).
    pub zero_over_sp: bool,
    /// The pipeline's schedule when `pp` > 1.
    pub pipeline: PipePlan,
}

impl std::ops::Deref for Parallelism {
    type Target = Degrees;
    fn deref(&self) -> &Degrees {
        &self.degrees
    }
}

impl Parallelism {
    /// Whether genslm's trainer partitions ZeRO stage `zero` over SP as well: ZeRO-1 spans
    /// DP × CP only, ZeRO-2/3 every data rank (DP × CP × SP).
    pub fn trainer_zero_over_sp(zero: u8) -> bool {
        zero >= 2
    }
    pub fn ranks(&self) -> usize {
        self.degrees.world()
    }
    /// The ZeRO partition group: `Z = D·c·p`, or `D·c` without `zero_over_sp` (CP ranks
    /// hold replicas, so ZeRO always spans them, as Megatron's distributed optimizer does).
    pub fn zero_group(&self) -> usize {
        self.dp * self.cp * if self.zero_over_sp { self.sp } else { 1 }
    }
    /// Ranks over which the sequence region is split.
    pub fn seq_shard(&self) -> usize {
        self.sp * self.cp * if self.megatron_sp { self.tp } else { 1 }
    }
    /// Ranks over which the head region is split (CP: `s/c` tokens of `a/(p·t)` heads).
    pub fn head_shard(&self) -> usize {
        self.sp * self.tp * self.cp
    }
}

/// Everything about a training step that the memory depends on, besides the model's shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Strategy {
    pub layout: Parallelism,
    pub recipe: Recipe,
    pub attention: AttentionKind,
    pub positions: Position,
    /// A learned position table split over the sequence shards instead of replicated.
    pub shard_positions: bool,
    pub mask: Mask,
    pub checkpointing: Checkpointing,
    pub precision: Precision,
    /// Sequences per micro-batch `b`.
    pub batch_size: usize,
    /// The pipeline stage estimated (`None`: the whole model, or under PP every stage, the
    /// peak the largest).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<StageView>,
    /// Input and output embeddings share one matrix (Megatron's GPT; GPT-NeoX unties them).
    pub tied_embeddings: bool,
    /// `V` as the framework allocates it (Megatron pads the tokenizer's vocabulary).
    pub vocab_size: usize,
    /// State kept in host memory instead of the GPU's (`--offload`; nothing moves on a CPU
    /// target): the optimizer's (moments, and master weights as the layout keeps them), and
    /// checkpointed layer inputs.
    pub offload: Offload,
    /// Layers per pipeline chunk as `--pp-layers` cuts them (`None`: the trainer's balanced
    /// cut, extra layers on the last chunks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp_layers: Option<Vec<usize>>,
}

/// Memory of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Hardware {
    /// Bytes of device memory (GPU) or of memory allowed per process (CPU).
    #[serde(serialize_with = "whole_bytes")]
    pub mem_bytes: f64,
    pub target: Target,
}

/// A phase of a training step whose live memory can be the step's peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The backward's peak: without checkpointing, all saved activations and the loss'
    /// tensors at its start; with full checkpointing, one recomputed layer's activations and
    /// working gradients on top of every layer's kept input.
    ForwardBackward,
    /// Full checkpointing only: the logits and the loss at the end of the forward, on top of
    /// every layer's kept input.
    Loss,
    /// Building a materialised `[s, s]` mask before the forward (fp32 ones and tril, then bool).
    MaskCreation,
    /// Gradient reduction and the AdamW update, after the backward.
    OptimizerStep,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::ForwardBackward => "forward/backward",
            Phase::Loss => "logits and loss",
            Phase::MaskCreation => "mask creation",
            Phase::OptimizerStep => "optimizer step",
        }
    }
}

/// Bytes per rank by component, in one phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Weights (the working copy; ZeRO-3 keeps `1/Z` of them).
    #[serde(serialize_with = "whole_bytes")]
    pub parameters: f64,
    /// Weight gradients.
    #[serde(serialize_with = "whole_bytes")]
    pub gradients: f64,
    /// fp32 master weights (mixed precision) and the two Adam moments.
    #[serde(serialize_with = "whole_bytes")]
    pub optimizer_states: f64,
    /// Activations saved for the backward (layer inputs, LayerNorm, MLP, Q/K/V/O), plus the
    /// token ids and rotary tables.
    #[serde(serialize_with = "whole_bytes")]
    pub activations: f64,
    /// Attention scores kept by naive attention, flash's row log-sum-exp, and a materialised
    /// `[s, s]` mask.
    #[serde(serialize_with = "whole_bytes")]
    pub attention: f64,
    /// A learned position table with its gradient and optimizer states.
    #[serde(serialize_with = "whole_bytes")]
    pub position_table: f64,
    /// Logits over the vocabulary and the loss' softmax.
    #[serde(serialize_with = "whole_bytes")]
    pub logits: f64,
    /// Buffers of collectives: Megatron-SP all-gathers, Ulysses all-to-alls, ZeRO-3 gathered
    /// weights, gradient reductions.
    #[serde(serialize_with = "whole_bytes")]
    pub communication: f64,
    /// Backward working gradients of one layer, plus the fixed reserve: CUDA context, library
    /// workspaces and allocator slack on a GPU; the process baseline on a CPU.
    #[serde(serialize_with = "whole_bytes")]
    pub workspace: f64,
}

impl Breakdown {
    /// `(1 − f)·self + f·other`, component by component.
    pub fn mix(&self, other: &Breakdown, f: f64) -> Breakdown {
        let m = |a: f64, b: f64| (1.0 - f) * a + f * b;
        Breakdown {
            parameters: m(self.parameters, other.parameters),
            gradients: m(self.gradients, other.gradients),
            optimizer_states: m(self.optimizer_states, other.optimizer_states),
            activations: m(self.activations, other.activations),
            attention: m(self.attention, other.attention),
            position_table: m(self.position_table, other.position_table),
            logits: m(self.logits, other.logits),
            communication: m(self.communication, other.communication),
            workspace: m(self.workspace, other.workspace),
        }
    }

    pub fn total(&self) -> f64 {
        self.rows().iter().map(|(_, v)| v).sum()
    }

    /// `(name, bytes)` in display order.
    pub fn rows(&self) -> [(&'static str, f64); 9] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            ("activations", self.activations),
            ("attention scores/mask", self.attention),
            ("position table", self.position_table),
            ("logits", self.logits),
            ("communication buffers", self.communication),
            ("workspace", self.workspace),
        ]
    }
}

/// The memory of one step at one sequence length.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub seq_len: usize,
    /// Under PP, the stage with the peak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// The phase with the largest total: the step's peak.
    pub phase: Phase,
    /// Its components.
    pub memory: Breakdown,
    /// Every phase considered, with its total bytes.
    #[serde(serialize_with = "whole_phase_bytes")]
    pub phases: Vec<(Phase, f64)>,
    /// Bytes per rank that `--offload` keeps in host memory instead (0 without it).
    #[serde(serialize_with = "whole_bytes")]
    pub host_bytes: f64,
}

impl Estimate {
    pub fn total(&self) -> f64 {
        self.memory.total()
    }
}

/// Sequence lengths are searched in multiples of this: 1024 tokens, rounded up to a multiple of
/// the pieces the sequence is cut into (each rank gets a whole number of tokens; CP cuts 2·c
/// zigzag chunks).
pub fn granule(st: &Strategy) -> usize {
    lcm(1024, st.layout.pieces())
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    a / gcd(a, b) * b
}

/// The per-rank memory of one step at `seq_len` tokens per sequence: under PP the stage with
/// the largest peak (every stage estimated; the layout must have passed [`check`]).
pub fn estimate(model: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> Estimate {
    if st.stage.is_some() || st.layout.pp <= 1 {
        return estimate_stage(model, st, hw, seq_len);
    }
    let views = stages::stage_views(model, &st.layout, st.pp_layers.as_deref())
        .unwrap_or_else(|_| vec![StageView::whole(model)]);
    estimate_stages(model, st, hw, seq_len, &views)
}

/// The largest of the stages' estimates.
fn estimate_stages(
    model: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
    views: &[StageView],
) -> Estimate {
    views
        .iter()
        .map(|&v| estimate_on(model, st, hw, seq_len, v))
        .fold(None::<Estimate>, |best, e| match best {
            Some(b) if b.total() >= e.total() => Some(b),
            _ => Some(e),
        })
        .expect("at least one stage")
}

/// [`estimate`] of pipeline stage `view` alone.
pub fn estimate_on(
    model: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
    view: StageView,
) -> Estimate {
    let one = Strategy {
        stage: Some(view),
        ..st.clone()
    };
    estimate_stage(model, &one, hw, seq_len)
}

/// [`estimate`] of the stage `st.stage` (or the whole model).
fn estimate_stage(model: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> Estimate {
    let mut phases = vec![(
        Phase::ForwardBackward,
        terms::forward_backward(model, st, hw, seq_len),
    )];
    if matches!(st.checkpointing, Checkpointing::Full { .. }) {
        phases.push((Phase::Loss, terms::loss(model, st, hw, seq_len)));
    }
    if st.mask == Mask::Materialised {
        phases.push((
            Phase::MaskCreation,
            terms::mask_creation(model, st, hw, seq_len),
        ));
    }
    if matches!(hw.target, Target::Cpu { .. }) || st.recipe == Recipe::Genslm {
        // The step follows the backward; a CPU allocator keeps the larger of the backward's
        // and the loss' peaks resident.
        let fb = phases
            .iter()
            .filter(|(p, _)| matches!(p, Phase::ForwardBackward | Phase::Loss))
            .map(|(_, b)| *b)
            .fold(Breakdown::default(), |a, b| {
                if b.total() > a.total() {
                    b
                } else {
                    a
                }
            });
        phases.push((
            Phase::OptimizerStep,
            terms::optimizer_step(model, st, hw, seq_len, &fb),
        ));
    }
    let (phase, memory) = phases
        .iter()
        .copied()
        .fold(None::<(Phase, Breakdown)>, |best, (p, b)| match best {
            Some((_, m)) if m.total() >= b.total() => best,
            _ => Some((p, b)),
        })
        .expect("at least one phase");
    Estimate {
        seq_len,
        stage: st.stage.filter(|_| st.layout.pp > 1).map(|v| v.stage),
        phase,
        memory,
        phases: phases.iter().map(|(p, b)| (*p, b.total())).collect(),
        host_bytes: offload::offloaded(model, st, hw, seq_len),
    }
}

/// Upper end of the search: the longest sequence genslm trains (`--seq-len` refuses more).
/// A memory that holds more is reported as reaching this limit, not as a length no run takes.
pub const MAX_SEARCH: usize = crate::config::MAX_TOKENS;

/// The longest sequence (a multiple of [`granule`]) whose step fits in `hw.mem_bytes`, by
/// doubling then bisection on the predicted total (which never decreases with the length).
/// 0 when even one granule does not fit.
pub fn max_seq_len(model: &ModelConfig, st: &Strategy, hw: &Hardware) -> usize {
    max_seq_len_with_host(model, st, hw, f64::INFINITY)
}

/// [`max_seq_len`] whose step also keeps at most `host_bytes` in host memory (`--offload`:
/// the rank's share of its node's memory); the offloaded bytes never decrease with the length
/// either.
pub fn max_seq_len_with_host(
    model: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    host_bytes: f64,
) -> usize {
    let g = granule(st);
    // The stages' views once (each comes from a simulation of the schedule).
    let views = match (st.stage, st.layout.pp) {
        (None, p) if p > 1 => stages::stage_views(model, &st.layout, st.pp_layers.as_deref()).ok(),
        _ => None,
    };
    let at = |n: usize| match &views {
        Some(v) => estimate_stages(model, st, hw, n, v),
        None => estimate(model, st, hw, n),
    };
    let fits = |k: usize| {
        let e = at(k * g);
        e.total() <= hw.mem_bytes && e.host_bytes <= host_bytes
    };
    // The most granules a run may take.
    let cap = MAX_SEARCH / g;
    if cap == 0 || !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi <= cap && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    if hi > cap {
        if fits(cap) {
            return cap * g;
        }
        hi = cap;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * g
}
