//! Incremental decoding with a key/value cache.
//!
//! [`forward_cached`] runs the model's own layers ([`GenSlm::hidden_states_cached`]) on the new
//! tokens only. Each layer keeps the keys and values of every earlier token ([`LayerKv`]:
//! preallocated buffers written in place) and adds the new ones; the new queries attend to all
//! of them with `q_offset` = the number of cached tokens. So one more token costs O(s) (its
//! attention row over the cache) instead of a full O(s²) pass over the prefix.
//!
//! Positions are global: rotary tables and the learned table are read at `offset..offset + n`,
//! ALiBi biases use `q_offset`/`k_offset`. The test `generate_top_k_1_equals_greedy_without_cache`
//! checks that decoding with the cache gives the same tokens as full passes over the prefix.

use std::ops::Range;

use burn::tensor::{Int, Tensor};

use crate::error::{Error, Result};
use crate::model::GenSlm;

/// Keys and values of the tokens seen so far, one pair of buffers per layer.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer; empty before the first call.
    pub layers: Vec<LayerKv>,
    /// Tokens cached (the global position of the next token).
    pub len: usize,
    /// Rows to allocate at the first call (the caller's expected total, e.g. generate's
    /// `max_codons`), so that decoding to that length never reallocates.
    pub reserve: usize,
}

impl KvCache {
    /// A cache that holds `tokens` tokens without growing.
    pub fn with_capacity(tokens: usize) -> Self {
        KvCache {
            reserve: tokens,
            ..Self::default()
        }
    }

    /// A new cache holding the first `len` cached tokens of sequence 0, repeated for `batch`
    /// sequences, with room for `extra` more tokens each: several continuations of one shared
    /// prefix (variant scoring decodes every ALT suffix from the reference's prefix).
    pub fn prefix(&self, len: usize, batch: usize, extra: usize) -> Result<KvCache> {
        if len > self.len {
            return Err(Error::Invalid(format!(
                "KV cache holds {} tokens, asked for a prefix of {len}",
                self.len
            )));
        }
        if len == 0 {
            return Ok(KvCache::with_capacity(extra));
        }
        let cap = len + extra;
        let layers = self
            .layers
            .iter()
            .map(|kv| {
                let take = |t: &Tensor<4>| {
                    let [_, heads, _, d] = t.dims();
                    let kept = t.clone().narrow(0, 0, 1).narrow(2, 0, len);
                    let buf = Tensor::<4>::zeros([batch, heads, cap, d], (&t.device(), t.dtype()));
                    buf.slice_assign(rows(batch, heads, 0..len, d), kept.repeat_dim(0, batch))
                };
                LayerKv {
                    k: take(&kv.k),
                    v: take(&kv.v),
                }
            })
            .collect();
        Ok(KvCache {
            layers,
            len,
            reserve: cap,
        })
    }
}

/// One layer's keys and values in buffers `[b, heads, capacity, head_dim]` (keys after rotary at
/// their global positions); rows `0..KvCache::len` along dim 2 are the cached tokens.
///
/// Appending writes the new rows into the buffers in place (burn's `slice_assign` reuses a
/// buffer nothing else holds), so a decoding step copies only its own keys and values instead
/// of the whole cache — concatenation made each of s steps copy O(s), O(s²) in all. When the
/// rows run out the buffers double.
#[derive(Debug, Clone)]
pub struct LayerKv {
    k: Tensor<4>,
    v: Tensor<4>,
}

impl LayerKv {
    /// Sequences in the cache.
    pub fn batch(&self) -> usize {
        self.k.dims()[0]
    }

    /// Rows allocated.
    pub fn capacity(&self) -> usize {
        self.k.dims()[2]
    }

    /// Writes `k, v: [b, heads, n, d]` at rows `len..len + n` of `past` (new buffers of at least
    /// `reserve` rows when there is none) and returns the buffers with views of rows
    /// `0..len + n`, the keys and values to attend to.
    pub fn append(
        past: Option<LayerKv>,
        k: Tensor<4>,
        v: Tensor<4>,
        len: usize,
        reserve: usize,
    ) -> (LayerKv, Tensor<4>, Tensor<4>) {
        let [b, heads, n, d] = k.dims();
        let need = len + n;
        let mut kv = match past {
            Some(kv) if kv.capacity() >= need => kv,
            past => {
                let cap = need
                    .max(reserve)
                    .max(past.as_ref().map_or(0, |p| 2 * p.capacity()));
                let zeros = || Tensor::<4>::zeros([b, heads, cap, d], (&k.device(), k.dtype()));
                let (mut nk, mut nv) = (zeros(), zeros());
                if let Some(p) = past {
                    nk = nk.slice_assign(rows(b, heads, 0..len, d), p.k.narrow(2, 0, len));
                    nv = nv.slice_assign(rows(b, heads, 0..len, d), p.v.narrow(2, 0, len));
                }
                LayerKv { k: nk, v: nv }
            }
        };
        kv.k = kv.k.slice_assign(rows(b, heads, len..need, d), k);
        kv.v = kv.v.slice_assign(rows(b, heads, len..need, d), v);
        let (kview, vview) = (
            kv.k.clone().narrow(2, 0, need),
            kv.v.clone().narrow(2, 0, need),
        );
        (kv, kview, vview)
    }
}

fn rows(b: usize, heads: usize, r: Range<usize>, d: usize) -> [Range<usize>; 4] {
    [0..b, 0..heads, r, 0..d]
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
    if let Some(kv) = cache.layers.first() {
        if kv.batch() != b {
            return Err(Error::Invalid(format!(
                "KV cache holds {} sequences, the new tokens {b}",
                kv.batch()
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::{Config, Position};
    use crate::model::neox::{tensor_to_vec, tokens_tensor};

    /// Decoding through the cache — preallocated, too small (grows by doubling, several times),
    /// and fed several tokens at once — gives at every step the logits of a full forward pass
    /// over the whole prefix, which uses no cache at all.
    #[test]
    fn cached_decoding_equals_full_passes_whatever_the_capacity() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
            let mut cfg = Config::load(&path).unwrap().model;
            cfg.position = pos;
            let model = GenSlm::init(cfg, 7, &Device::flex()).unwrap();
            let ids: Vec<u32> = (0..40u32).map(|i| 5 + (i * 37 + 11) % 64).collect();
            let (b, device) = (1, &model.device);
            for reserve in [0, 5, 40] {
                let mut cache = KvCache::with_capacity(reserve);
                // A prompt of 3, single tokens, one step of 18 (past the direct-scores limit,
                // so FlashAttention over the cache), single tokens again.
                let mut cuts = vec![0];
                cuts.extend(3..=8);
                cuts.extend(26..=40);
                for w in cuts.windows(2) {
                    let (from, to) = (w[0], w[1]);
                    let new = tokens_tensor(&ids[from..to], b, to - from, device);
                    let got = tensor_to_vec(&next_logits(&model, new, &mut cache).unwrap());
                    let all = tokens_tensor(&ids[..to], b, to, device);
                    let full = model.forward(all, 0).unwrap().narrow(1, to - 1, 1);
                    let want = tensor_to_vec(&full);
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(worst < 1e-4, "{pos} reserve {reserve} at {to}: {worst}");
                    assert_eq!(cache.len, to);
                }
                let cap = cache.layers[0].capacity();
                match reserve {
                    // 3 rows, doubled to 6 and 12, 26 for the long step, doubled to 52.
                    0 => assert_eq!(cap, 52, "{pos}"),
                    5 => assert_eq!(cap, 52, "{pos}: 5, 10, 26, 52"),
                    _ => assert_eq!(cap, 40, "{pos}: preallocated, never grown"),
                }
            }
        }
    }
}
