//! Parameter counts of a GPT-NeoX model from its config: what every memory term that scales
//! with the weights (`terms.rs`, `cpu.rs`) starts from.

use super::StageView;
use crate::config::ModelConfig;

/// Parameters of one transformer layer (GPT-NeoX and Megatron's GPT have the same ones): two
/// LayerNorms `4h`, fused QKV `3h² + 3h`, attention output `h² + h`, MLP `h·i + i` and
/// `i·h + h`. For `i = 4h`: `12h² + 13h`.
pub fn layer_params(m: &ModelConfig) -> f64 {
    let (h, i) = (m.hidden_size as f64, m.intermediate_size as f64);
    4.0 * h + (3.0 * h * h + 3.0 * h) + (h * h + h) + (h * i + i) + (i * h + h)
}

/// Parameters outside a learned position table: `L·layer + 2h` (final LayerNorm) `+ V·h` per
/// embedding matrix (one when tied, two for GPT-NeoX's untied `embed_in` / `embed_out`).
/// With `vocab = vocab_size` and untied, this is `ModelConfig::param_count` without the table.
pub fn model_params(m: &ModelConfig, vocab: usize, tied: bool) -> f64 {
    let (h, v, l) = (m.hidden_size as f64, vocab as f64, m.num_layers as f64);
    let embeddings = if tied { 1.0 } else { 2.0 };
    l * layer_params(m) + 2.0 * h + embeddings * v * h
}

/// Parameters a pipeline stage holds: its layers, the input embedding with the first, the
/// final LayerNorm and the output head with the last (a tied matrix sits on both ends, as
/// Megatron keeps it). The whole model's view gives [`model_params`].
pub fn stage_params(m: &ModelConfig, vocab: usize, tied: bool, view: &StageView) -> f64 {
    let (h, v) = (m.hidden_size as f64, vocab as f64);
    let mut n = view.layers as f64 * layer_params(m);
    if view.embeddings {
        n += v * h;
    }
    if view.head {
        n += 2.0 * h + if tied && view.embeddings { 0.0 } else { v * h };
    }
    n
}
