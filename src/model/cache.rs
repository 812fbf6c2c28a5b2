//! The key/value cache of incremental decoding (its use: `decode.rs`).
//!
//! Decoding runs the model's own layers on the new tokens only. Each layer keeps the keys and values of every earlier token ([`LayerKv`]:
//! preallocated buffers written in place) and adds the new ones; the new queries attend to all
//! of them with `q_offset` = the number of cached tokens. So one more token costs O(s) (its
//! attention row over the cache) instead of a full O(s²) pass over the prefix.
//!
//! Positions are global: rotary tables and the learned table are read at `offset..offset + n`,
//! ALiBi biases use `q_offset`/`k_offset`.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::error::{Error, Result};

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

    /// The key buffer `[b, heads, capacity, d]`; rows `0..len` are filled.
    pub fn keys(&self) -> &Tensor<4> {
        &self.k
    }

    /// The value buffer, as [`LayerKv::keys`].
    pub fn values(&self) -> &Tensor<4> {
        &self.v
    }

    /// Writes `k, v: [b, heads, n, d]` at rows `len..len + n` of `past` (new buffers of at least
    /// `reserve` rows when there is none) and returns the buffers, whose rows `0..len + n` are
    /// then the keys and values to attend to.
    pub fn append(
        past: Option<LayerKv>,
        k: Tensor<4>,
        v: Tensor<4>,
        len: usize,
        reserve: usize,
    ) -> LayerKv {
        let [b, heads, n, d] = k.dims();
        // Cached rows without their buffers would be read as zeros: a caller's bug, never data.
        assert!(
            past.is_some() || len == 0,
            "{len} cached tokens but no buffers"
        );
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
        kv
    }
}

/// A layer's keys and values from earlier calls (incremental decoding).
// One value per layer call, moved straight into the layer: boxing the large variant would only
// add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Past {
    /// No cache: attention over this call's tokens only.
    None,
    /// Decoding with a cache: this layer's buffers (none before the first call), taken out of
    /// the cache so the layer can write into them in place, and the rows to reserve.
    Cache(Option<LayerKv>, usize),
}

fn rows(b: usize, heads: usize, r: Range<usize>, d: usize) -> [Range<usize>; 4] {
    [0..b, 0..heads, r, 0..d]
}
