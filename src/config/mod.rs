//! Model configuration: TOML presets in `configs/`, parsed with serde and validated.
//!
//! Shapes follow Hugging Face `GPTNeoXConfig` (docs/ARCHITECTURE.md §3). Unknown fields are rejected so a
//! typo in a config file is reported instead of silently ignored.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::tokenizer::VocabKind;

/// Default `reduce_bucket_size`: 2²⁴ elements (64 MiB of f32) per collective call, far below
/// MPI's count limit, large enough that per-call latency does not matter
/// (`parallel::bucket` cuts every transfer into such buckets).
pub const DEFAULT_BUCKET: usize = 1 << 24;

mod choices;
mod load;
pub use choices::{Offload, Precision, Quantize, ScheduleKind};
pub use load::{preset, read_config_text, short_lines, MAX_CONFIG_BYTES, PRESETS};

/// How token positions enter the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    /// GPT-NeoX rotary embedding on the first `rotary_pct` of each head (GenSLM default).
    #[default]
    Rotary,
    /// Absolute learned table of `max_position_embeddings` rows.
    Learned,
    /// Attention bias `-slope_h · (i − j)`; no parameters, extrapolates past the training length.
    Alibi,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Position::Rotary => "rotary",
            Position::Learned => "learned",
            Position::Alibi => "alibi",
        })
    }
}

/// Which attention implementation the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// genslm's FlashAttention-2 op: O(s) memory, hand-written backward.
    #[default]
    Flash,
    /// Materialised scores: the reference, O(s²) memory.
    Naive,
}

fn default_rotary_pct() -> f64 {
    0.25
}
fn default_rotary_base() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-5
}

/// The shape of a GPT-NeoX model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    /// Tokenizer vocabulary; `vocab_size` must hold all of its ids.
    #[serde(default)]
    pub vocab: VocabKind,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub position: Position,
    #[serde(default = "default_rotary_pct")]
    pub rotary_pct: f64,
    #[serde(default = "default_rotary_base")]
    pub rotary_base: f64,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default)]
    pub attention: AttentionKind,
}

/// Largest model dimension (layers, hidden, heads, intermediate, vocabulary) accepted.
pub const MAX_DIM: usize = 1 << 24;
/// Largest layer count accepted: DeepNet's 1,000-layer models fit eight times over. The layout
/// holds a dozen named parameters per layer before any weight is read, so a config.json beside
/// a 19 KB file asking for 2²⁴ layers took 23 GB (3.5 KB a layer) instead of being refused.
pub const MAX_LAYERS: usize = 8192;
/// Largest token count (sequence length, positions, tokens per step) accepted: 2³¹.
pub const MAX_TOKENS: usize = 1 << 31;
/// Largest parameter count accepted (2⁴⁰, 30 times genslm-33b).
pub const MAX_PARAMS: u64 = 1 << 40;
/// Largest step count accepted (2⁵³: exact in the f64 schedule).
pub const MAX_STEPS: u64 = 1 << 53;
/// Most layers ZeRO-3 may gather ahead (`prefetch_layers`).
pub const MAX_PREFETCH_LAYERS: usize = 64;
/// Layers ZeRO-3 gathers ahead unless told (`prefetch_layers`).
pub const DEFAULT_PREFETCH_LAYERS: usize = 1;

/// Largest rank timeout accepted, in seconds.
pub const MAX_TIMEOUT_S: u64 = 1_000_000_000;

/// Training settings (`[train]` in a config file; each has a CLI flag of the same name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps in the whole run.
    pub steps: u64,
    /// Codons per sample; longer records are cut into windows, shorter ones padded.
    pub seq_len: usize,
    /// Samples per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// The cosine decay ends at `min_lr_ratio · lr`.
    pub min_lr_ratio: f64,
    /// Linear warm-up steps.
    pub warmup: u64,
    pub seed: u64,
    /// Share of windows held out for validation.
    pub val_fraction: f64,
    /// Validate every N steps (and at the end); 0 = only at the end.
    pub val_every: u64,
    /// Checkpoint every N steps (and at the end); 0 = only at the end.
    pub checkpoint_every: u64,
    /// Keep the newest K checkpoint directories (older ones are removed); 0 keeps all.
    pub keep_checkpoints: usize,
    /// Global gradient-norm clip; 0 disables clipping.
    pub max_grad_norm: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Skip a step whose loss or gradient is NaN/Inf instead of stopping.
    pub skip_nonfinite: bool,
    /// With `skip_nonfinite`: stop (exit ≠ 0) after more than this many skipped steps in a row.
    pub max_consecutive_skips: u64,
    /// ZeRO stage: 0 keeps the optimizer state replicated; 1 shards the Adam moments over the
    /// DP group; 2 shards moments and gradients, 3 also the weights, over all DP × CP × SP ranks.
    pub zero: u8,
    /// Full activation checkpointing: keep only each layer's input through the forward and
    /// recompute one layer at a time in the backward (same gradients, much less memory for
    /// long sequences, about one more forward of compute).
    pub checkpoint_activations: bool,
    /// Elements per call when gradients and ZeRO shards travel between ranks (buckets keep
    /// every MPI call below its 2³¹ count limit and bound the staging memory).
    pub reduce_bucket_size: usize,
    /// Seconds a thread rank waits for the others in a collective before declaring them stuck
    /// (phases known to be long, such as rank 0 writing a checkpoint, wait without limit).
    pub rank_timeout_s: u64,
    /// Compute precision; unset = the backend's default (bf16 on CUDA, fp32 on CPU).
    pub precision: Option<Precision>,
    /// Pipeline schedule when `--pp` > 1: gpipe, 1f1b, interleaved or zb.
    pub pp_schedule: ScheduleKind,
    /// Chunks of layers per pipeline stage (more than 1 with `interleaved` only).
    pub pp_virtual: usize,
    /// Layers per pipeline chunk, in chunk order (unset: as even as the layer count allows).
    pub pp_layers: Option<Vec<usize>>,
    /// Under TP, Megatron sequence parallelism: LayerNorms, the residual and the embedding's
    /// output hold `1/T` of the sequence on each TP rank (all-gather before, reduce-scatter
    /// after the tensor-parallel blocks instead of all-reduces). Same results; off for
    /// comparison (`--no-megatron-sp`).
    pub megatron_sp: bool,
    /// Communication overlapped with compute (issue 42): started collectives run on a
    /// communication thread per group (ZeRO-2/3's gradient reduce-scatters and gathers, the
    /// ring's K/V passes). Same results; off for comparison and debugging (`--no-overlap`).
    pub overlap: bool,
    /// ZeRO-3 with overlap: layers whose weights are gathered ahead of their use (at most
    /// this many plus the running one gathered at a time); 0 gathers each layer when it runs.
    pub prefetch_layers: usize,
    /// ZeRO-3's weight all-gathers quantized (ZeRO++'s qwZ): each rank's fp32 shard is
    /// encoded before it travels and every rank computes with the decoded weights; the fp32
    /// master shards, the update and checkpoints are unchanged. Unset (or `fp32`): fp32.
    #[serde(deserialize_with = "choices::quantize_or_fp32")]
    pub quantize_weights: Option<Quantize>,
    /// Gradient reductions quantized (ZeRO++'s qgZ): each rank encodes its contribution to
    /// every other rank's block once and sends it by all-to-all; the receiver decodes and sums
    /// in fp32, so errors do not compound over the ranks. Unset (or `fp32`): fp32.
    #[serde(deserialize_with = "choices::quantize_or_fp32")]
    pub quantize_grads: Option<Quantize>,
    /// State kept in host memory instead of the device's (see [`Offload`]); the same results.
    /// On the CPU backend the device is the host, so nothing moves.
    pub offload: Offload,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 100,
            seq_len: 256,
            batch_size: 4,
            grad_accum: 1,
            lr: 1e-3,
            min_lr_ratio: 0.1,
            warmup: 10,
            seed: 0,
            val_fraction: 0.1,
            val_every: 50,
            checkpoint_every: 0,
            keep_checkpoints: 5,
            max_grad_norm: 1.0,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            skip_nonfinite: false,
            max_consecutive_skips: 10,
            zero: 1,
            checkpoint_activations: false,
            reduce_bucket_size: DEFAULT_BUCKET,
            rank_timeout_s: 600,
            precision: None,
            pp_schedule: ScheduleKind::OneFOneB,
            pp_virtual: 1,
            pp_layers: None,
            megatron_sp: true,
            overlap: true,
            prefetch_layers: DEFAULT_PREFETCH_LAYERS,
            quantize_weights: None,
            quantize_grads: None,
            offload: Offload::None,
        }
    }
}

impl TrainConfig {
    /// Checks the settings; the message names the field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("steps", self.steps as usize),
            ("batch_size", self.batch_size),
            ("grad_accum", self.grad_accum),
            ("pp_virtual", self.pp_virtual),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("field `{field}` must be positive"));
            }
        }
        if self.offload.activations() && !self.checkpoint_activations {
            return Err(format!(
                "field `offload` = {} moves the layer inputs that activation checkpointing \
                 keeps: set `checkpoint_activations` (--checkpoint-activations) too",
                self.offload
            ));
        }
        if self.seq_len < 2 {
            return Err(format!(
                "field `seq_len` ({}) must be at least 2",
                self.seq_len
            ));
        }
        for (field, v) in [
            ("seq_len", self.seq_len),
            ("batch_size", self.batch_size),
            ("grad_accum", self.grad_accum),
        ] {
            if v > MAX_TOKENS {
                return Err(format!("field `{field}` ({v}) is larger than {MAX_TOKENS}"));
            }
        }
        let tokens = (self.seq_len as u128) * (self.batch_size as u128) * (self.grad_accum as u128);
        if tokens > MAX_TOKENS as u128 {
            return Err(format!(
                "`seq_len` × `batch_size` × `grad_accum` = {tokens} tokens per step, more than \
                 {MAX_TOKENS}"
            ));
        }
        if self.steps > MAX_STEPS {
            return Err(format!(
                "field `steps` ({}) is larger than {MAX_STEPS}",
                self.steps
            ));
        }
        // The run's config.toml records every setting, and a TOML integer is an i64: a seed of
        // 2⁶⁴ − 1 trained, then its config.toml and checkpoint could not be read back.
        for (field, v) in [
            ("seed", self.seed),
            ("warmup", self.warmup),
            ("val_every", self.val_every),
            ("checkpoint_every", self.checkpoint_every),
            ("max_consecutive_skips", self.max_consecutive_skips),
            ("keep_checkpoints", self.keep_checkpoints as u64),
            ("reduce_bucket_size", self.reduce_bucket_size as u64),
        ] {
            if v > i64::MAX as u64 {
                return Err(format!(
                    "field `{field}` ({v}) is larger than {} (the largest integer a TOML file \
                     holds, and the run's config.toml records it)",
                    i64::MAX
                ));
            }
        }
        if self.rank_timeout_s > MAX_TIMEOUT_S {
            return Err(format!(
                "field `rank_timeout_s` ({}) is larger than {MAX_TIMEOUT_S} (about 30 years)",
                self.rank_timeout_s
            ));
        }
        // The optimizer's arithmetic is f32: 1e-45 was a learning rate of 0, 1e39 infinite.
        positive_in_f32("lr", self.lr)?;
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err("field `min_lr_ratio` must be in [0, 1]".into());
        }
        if !(0.0..1.0).contains(&self.val_fraction) {
            return Err("field `val_fraction` must be in [0, 1)".into());
        }
        for (field, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(format!("field `{field}` must be in [0, 1)"));
            }
        }
        positive_in_f32("eps", self.eps)?;
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(format!(
                "field `weight_decay` ({}) must be finite and ≥ 0",
                self.weight_decay
            ));
        }
        if self.prefetch_layers > MAX_PREFETCH_LAYERS {
            return Err(format!(
                "field `prefetch_layers` ({}) is larger than {MAX_PREFETCH_LAYERS}: each \
                 prefetched layer holds its gathered weights",
                self.prefetch_layers
            ));
        }
        if self.zero > 3 {
            return Err(format!(
                "field `zero` ({}): ZeRO stages are 0, 1, 2 and 3",
                self.zero
            ));
        }
        if self.reduce_bucket_size == 0 || self.reduce_bucket_size > i32::MAX as usize {
            return Err(format!(
                "field `reduce_bucket_size` ({}) must be between 1 and {} elements",
                self.reduce_bucket_size,
                i32::MAX
            ));
        }
        if self.rank_timeout_s == 0 {
            return Err("field `rank_timeout_s` must be positive".into());
        }
        // Infinite was accepted and saved as JSON null, which the resume refused.
        if !self.max_grad_norm.is_finite() || self.max_grad_norm < 0.0 {
            return Err(
                "field `max_grad_norm` must be a finite number ≥ 0 (0 turns clipping off)".into(),
            );
        }
        Ok(())
    }
}

/// A config file: `[model]` and optional `[train]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    #[serde(default)]
    pub train: TrainConfig,
}

impl ModelConfig {
    /// Checks the shape; the message names the offending field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("num_layers", self.num_layers),
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("field `{field}` must be positive"));
            }
        }
        // The name is printed (info, plan, bench) and written into exports: a newline or a
        // terminal's escape sequence went to the terminal raw.
        // So are the invisible format characters that reorder or hide text (a right-to-left
        // override shows "evil\u{202e}txt.exe" as "evilexe.txt").
        let invisible = |c: &char| {
            c.is_control()
                || matches!(c, '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
                    | '\u{2060}'..='\u{206f}' | '\u{feff}' | '\u{00ad}')
        };
        if let Some(c) = self.name.chars().find(invisible) {
            return Err(format!(
                "field `name` ({}) holds a control or invisible character ({}); use a printable \
                 name",
                self.name.escape_debug(),
                c.escape_unicode()
            ));
        }
        // Sizes far beyond any model (33B has hidden 6144) are refused before any arithmetic
        // on them can overflow; the parameter count is checked in 128 bits.
        let limits = [
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("num_heads", self.num_heads, MAX_DIM),
            ("intermediate_size", self.intermediate_size, MAX_DIM),
            ("vocab_size", self.vocab_size, MAX_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_TOKENS,
            ),
        ];
        for (field, v, max) in limits {
            if v > max {
                return Err(format!("field `{field}` ({v}) is larger than {max}"));
            }
        }
        let (h, i, v, l, p) = (
            self.hidden_size as u128,
            self.intermediate_size as u128,
            self.vocab_size as u128,
            self.num_layers as u128,
            self.max_position_embeddings as u128,
        );
        let rough = l * (4 * h * h + 2 * h * i + 9 * h + i) + 2 * v * h + p * h + 2 * h;
        if rough > MAX_PARAMS as u128 {
            return Err(format!(
                "the model would have about {rough} parameters (from `num_layers`, \
                 `hidden_size`, `intermediate_size`, `vocab_size`, `max_position_embeddings`), \
                 more than the {MAX_PARAMS} genslm supports"
            ));
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return Err(format!(
                "field `hidden_size` ({}) must be divisible by `num_heads` ({})",
                self.hidden_size, self.num_heads
            ));
        }
        let needed = match self.vocab {
            VocabKind::Genslm69 => 69,
            VocabKind::Genslm71 => 71,
        };
        if self.vocab_size < needed {
            return Err(format!(
                "field `vocab_size` ({}) is smaller than the {} vocabulary ({needed} tokens)",
                self.vocab_size, self.vocab
            ));
        }
        if !(self.rotary_pct > 0.0 && self.rotary_pct <= 1.0) {
            return Err(format!(
                "field `rotary_pct` ({}) must be in (0, 1]",
                self.rotary_pct
            ));
        }
        if self.position == Position::Rotary && !self.rotary_dims().is_multiple_of(2) {
            return Err(format!(
                "field `rotary_pct` ({}) gives {} rotary dims per head (head dim {}); rotary needs an even number",
                self.rotary_pct,
                self.rotary_dims(),
                self.head_dim()
            ));
        }
        if self.position == Position::Rotary && self.head_dim() < 2 {
            return Err(format!(
                "head dim {} (hidden_size {} / num_heads {}) has no pair of dims to rotate: use \
                 fewer heads, or learned or ALiBi positions",
                self.head_dim(),
                self.hidden_size,
                self.num_heads
            ));
        }
        if self.position == Position::Rotary && self.rotary_dims() == 0 {
            // int(head_dim · rotary_pct) = 0 rotates nothing: the model would train with no
            // position information at all, silently.
            return Err(format!(
                "field `rotary_pct` ({}) gives 0 rotary dims per head (head dim {}): the model \
                 would have no position information; use at least {:.4}",
                self.rotary_pct,
                self.head_dim(),
                2.0 / self.head_dim() as f64
            ));
        }
        positive_in_f32("rotary_base", self.rotary_base)?;
        positive_in_f32("layer_norm_eps", self.layer_norm_eps)?;
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Rotary dims per head as Hugging Face computes them: `int(head_dim * rotary_pct)`.
    pub fn rotary_dims(&self) -> usize {
        (self.head_dim() as f64 * self.rotary_pct) as usize
    }

    /// Parameter count, term by term as Hugging Face `GPTNeoXForCausalLM` builds the model
    /// (plus the learned position table when `position = "learned"`, which HF lacks).
    pub fn param_count(&self) -> u64 {
        let (v, h, i, l) = (
            self.vocab_size as u64,
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.num_layers as u64,
        );
        let layer_norms = 2 * (2 * h); // input + post-attention LayerNorm, weight and bias
        let qkv = h * 3 * h + 3 * h;
        let dense = h * h + h;
        let mlp = (h * i + i) + (i * h + h);
        let per_layer = layer_norms + qkv + dense + mlp;
        let embed_in = v * h;
        let final_ln = 2 * h;
        let embed_out = h * v; // untied, no bias
        let positions = match self.position {
            Position::Learned => self.max_position_embeddings as u64 * h,
            _ => 0,
        };
        embed_in + l * per_layer + final_ln + embed_out + positions
    }
}

/// A positive constant the f32 kernels use: finite, and neither 0 nor inf once rounded to f32
/// (an `eps` of 1e-50 is 0 in f32 and divides by zero; `inf` passed a bare "> 0" check).
fn positive_in_f32(field: &str, v: f64) -> std::result::Result<(), String> {
    // Not subnormal either: the range the message states (1e-40 passed it).
    let f = v as f32;
    if v > 0.0 && f >= f32::MIN_POSITIVE && f.is_finite() {
        Ok(())
    } else {
        Err(format!(
            "field `{field}` ({}) must be positive and finite in f32 (between {:e} and {:e})",
            crate::error::short_num(v),
            f32::MIN_POSITIVE,
            f32::MAX
        ))
    }
}

#[cfg(test)]
mod tests;
