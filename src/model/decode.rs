//! Incremental decoding with a key/value cache ([`KvCache`]): [`forward_cached`] runs the
//! model's own layers ([`GenSlm::hidden_states_cached`]) on the new tokens only, so one more
//! token costs O(s) (its attention row over the cache) instead of a full O(s²) pass over the
//! prefix. The test below, and `generate_top_k_1_equals_greedy_without_cache`, check that
//! decoding with the cache gives what full passes over the prefix give.

use burn::tensor::{Int, Tensor};

use crate::error::{Error, Result};
use crate::model::cache::KvCache;
use crate::model::neox::GenSlm;

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
    use crate::ops::primitive::{tensor_to_vec, tokens_tensor};

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
