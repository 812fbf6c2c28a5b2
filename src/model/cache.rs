//! Incremental decoding with a key/value cache.
//!
//! [`forward_cached`] runs the model's own layers ([`GenSlm::hidden_states_cached`]) on the new
//! tokens only. Each layer keeps the keys and values of every earlier token (`[b, heads, s, d]`,
//! keys after rotary at their global positions) and appends the new ones; the new queries attend
//! to all of them with `q_offset` = the number of cached tokens. So one more token costs O(s)
//! (its attention row over the cache) instead of a full O(s²) pass over the prefix.
//!
//! Positions are global: rotary tables and the learned table are read at `offset..offset + n`,
//! ALiBi biases use `q_offset`/`k_offset`. The test `generate_top_k_1_equals_greedy_without_cache`
//! checks that decoding with the cache gives the same tokens as full passes over the prefix.

use burn::tensor::{Int, Tensor};

use crate::error::{Error, Result};
use crate::model::GenSlm;

/// Keys and values of the tokens seen so far, one pair per layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// `(k, v)` per layer, each `[b, heads, len, head_dim]`; empty before the first call.
    pub layers: Vec<(Tensor<4>, Tensor<4>)>,
    /// Tokens cached (the global position of the next token).
    pub len: usize,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Final hidden states `[b, n]` (after the final LayerNorm) of `tokens: [b, n]`, which sit
/// at positions `cache.len..cache.len + n` after the cached ones; their keys and values are
/// appended to `cache`. With an empty cache this is `hidden_states(tokens, offset 0)`.
pub fn forward_cached(
    model: &GenSlm,
    tokens: Tensor<2, Int>,
    cache: &mut KvCache,
) -> Result<Tensor<3>> {
    let b = tokens.dims()[0];
    if let Some((k, _)) = cache.layers.first() {
        if k.dims()[0] != b {
            return Err(Error::Invalid(format!(
                "KV cache holds {} sequences, the new tokens {b}",
                k.dims()[0]
            )));
        }
    }
    model.hidden_states_cached(tokens, cache)
}

/// Logits `[b, vocab]` of the last of `tokens` (`[b, n]`), decoding with `cache`.
pub fn next_logits(
    model: &GenSlm,
    tokens: Tensor<2, Int>,
    cache: &mut KvCache,
) -> Result<Tensor<2>> {
    let n = tokens.dims()[1];
    let hidden = forward_cached(model, tokens, cache)?;
    let last = hidden.narrow(1, n - 1, 1);
    Ok(model.logits(last).squeeze_dim::<2>(1))
}
