//! Incremental decoding with a key/value cache.
//!
//! [`forward_cached`] runs the same GPT-NeoX layers as [`GenSlm::hidden_states`] on the new
//! tokens only. Each layer keeps the keys and values of every earlier token (`[b, heads, s, d]`,
//! keys after rotary at their global positions) and appends the new ones; the new queries attend
//! to all of them with `q_offset` = the number of cached tokens. So one more token costs O(s)
//! (its attention row over the cache) instead of a full O(s²) pass over the prefix.
//!
//! Positions are global: rotary tables and the learned table are read at `offset..offset + n`,
//! ALiBi biases use `q_offset`/`k_offset`. The test `generate_top_k_1_equals_greedy_without_cache`
//! checks that decoding with the cache gives the same tokens as full passes over the prefix.

use burn::tensor::module::{embedding, layer_norm, linear};
use burn::tensor::{Int, Tensor};

use crate::config::Position;
use crate::error::{Error, Result};
use crate::model::attention::{attention, AttnOptions};
use crate::model::neox::gelu_fast;
use crate::model::position::{alibi_slopes, apply_rotary, rotary_tables};
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

fn vec1(model: &GenSlm, i: usize) -> Tensor<1> {
    model.params[i].clone()
}

fn mat(model: &GenSlm, i: usize) -> Tensor<2> {
    let s = &model.layout.specs[i].shape;
    model.params[i].clone().reshape([s[0], s[1]])
}

/// Final hidden states `[b, n, h]` (after the final LayerNorm) of `tokens: [b, n]`, which sit
/// at positions `cache.len..cache.len + n` after the cached ones; their keys and values are
/// appended to `cache`. With an empty cache this is `hidden_states(tokens, offset 0)`.
pub fn forward_cached(
    model: &GenSlm,
    tokens: Tensor<2, Int>,
    cache: &mut KvCache,
) -> Result<Tensor<3>> {
    let c = &model.cfg;
    let [b, n] = tokens.dims();
    let (heads, d, h) = (c.num_heads, c.head_dim(), c.hidden_size);
    let eps = c.layer_norm_eps;
    let offset = cache.len;
    if model.sp.is_some() {
        return Err(Error::Invalid(
            "decoding with a KV cache runs on one rank; this model is sharded for sequence \
             parallelism"
                .into(),
        ));
    }
    if let Some((k, _)) = cache.layers.first() {
        if k.dims()[0] != b {
            return Err(Error::Invalid(format!(
                "KV cache holds {} sequences, the new tokens {b}",
                k.dims()[0]
            )));
        }
    }
    let mut x = embedding(mat(model, model.layout.embed_in), tokens);
    if let Some(pos) = model.layout.embed_pos {
        if offset + n > c.max_position_embeddings {
            return Err(Error::Invalid(format!(
                "position {} is past the learned position table ({} positions): \
                 learned-position models cannot go beyond their training length",
                offset + n - 1,
                c.max_position_embeddings
            )));
        }
        let table = mat(model, pos).narrow(0, offset, n);
        x = x + table.unsqueeze::<3>().expand([b, n, h]);
    }
    let rot = c.rotary_dims();
    let rope = (c.position == Position::Rotary)
        .then(|| rotary_tables(rot, c.rotary_base, offset, n, &model.device));
    let attn_opts = AttnOptions {
        causal: true,
        alibi: (c.position == Position::Alibi).then(|| alibi_slopes(heads)),
        q_offset: offset,
        k_offset: 0,
    };
    let mut new_layers = Vec::with_capacity(model.layout.layers.len());
    for (li, l) in model.layout.layers.iter().enumerate() {
        let a_in = layer_norm(
            x.clone(),
            vec1(model, l.ln1_w),
            Some(vec1(model, l.ln1_b)),
            eps,
        );
        let qkv = linear(a_in, mat(model, l.qkv_w), Some(vec1(model, l.qkv_b)));
        let qkv = qkv.reshape([b, n, heads, 3 * d]).swap_dims(1, 2);
        let mut q = qkv.clone().narrow(3, 0, d);
        let mut k = qkv.clone().narrow(3, d, d);
        let v = qkv.narrow(3, 2 * d, d);
        if let Some((cos, sin)) = &rope {
            q = apply_rotary(q, cos, sin, rot);
            k = apply_rotary(k, cos, sin, rot);
        }
        let (k_all, v_all) = match cache.layers.get(li) {
            Some((kc, vc)) => (
                Tensor::cat(vec![kc.clone(), k], 2),
                Tensor::cat(vec![vc.clone(), v], 2),
            ),
            None => (k, v),
        };
        let o = attention(q, k_all.clone(), v_all.clone(), &attn_opts, c.attention);
        new_layers.push((k_all, v_all));
        let o = o.swap_dims(1, 2).reshape([b, n, h]);
        let attn_out = linear(o, mat(model, l.dense_w), Some(vec1(model, l.dense_b)));
        let m_in = layer_norm(
            x.clone(),
            vec1(model, l.ln2_w),
            Some(vec1(model, l.ln2_b)),
            eps,
        );
        let m = gelu_fast(linear(
            m_in,
            mat(model, l.fc1_w),
            Some(vec1(model, l.fc1_b)),
        ));
        let mlp_out = linear(m, mat(model, l.fc2_w), Some(vec1(model, l.fc2_b)));
        x = x + attn_out + mlp_out;
    }
    cache.layers = new_layers;
    cache.len = offset + n;
    Ok(layer_norm(
        x,
        vec1(model, model.layout.final_ln_w),
        Some(vec1(model, model.layout.final_ln_b)),
        eps,
    ))
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
