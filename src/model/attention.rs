//! Scaled dot-product attention: the one function the model calls, and the one trait through
//! which parallelism reaches it.
//!
//! Its inside is replaceable (FlashAttention, sequence-parallel exchanges) without touching the
//! model: a model sharded over the sequence holds a [`SequenceParallel`] that `parallel/`
//! implements (Ulysses today), so the model names no strategy. This file holds the naive path: scores materialised as `[b, h, sq, sk]`, which is the
//! reference the faster paths are tested against.
//!
//! Positions are global: query i sits at `q_offset + i`, key j at `k_offset + j` (a KV cache or a
//! sequence shard shifts them). Causal masking hides keys after the query. ALiBi adds
//! `-slope_h · (pos_q − pos_k)` (and `-slope_h · |pos_q − pos_k|` when not causal).

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};

use crate::config::AttentionKind;
use crate::model::flash::{flash_attention, DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q};

pub use crate::model::attn_options::AttnOptions;

/// The single-device attention a [`SequenceParallel`] strategy runs on what it gathered.
pub type LocalAttention<'a> =
    &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>, &AttnOptions) -> Tensor<4>;

/// How attention runs when each rank holds a shard of every sequence. Applied to the model from
/// outside (`train::shard`); implemented in `parallel/`.
pub trait SequenceParallel: std::fmt::Debug + Send + Sync {
    /// Attention output `[b, h, s_local, d]` for this rank's queries, given this rank's `q, k, v`
    /// (`[b, h, s_local, d]`, positions global through `opts`), running `local` where the
    /// strategy computes attention itself.
    fn attention(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        local: LocalAttention<'_>,
    ) -> Tensor<4>;

    /// With learned positions split over the ranks: the first row of the table rows this rank
    /// holds (`None`: every rank holds the whole table).
    fn position_shard(&self) -> Option<usize> {
        None
    }

    /// Tensor elements this rank has sent in forward exchanges so far (all layers): the
    /// communication volume the run logs.
    fn elements_sent(&self) -> u64;
}

/// Attention over `q: [b, h, sq, d]`, `k, v: [b, h, sk, d]` → `[b, h, sq, d]`, with the
/// implementation the config chose.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    opts: &AttnOptions,
    kind: AttentionKind,
) -> Tensor<4> {
    match kind {
        AttentionKind::Flash => flash_attention(q, k, v, opts, DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K),
        AttentionKind::Naive => naive_attention(q, k, v, opts),
    }
}

/// The reference: softmax(q kᵀ / √d + bias, masked) v with every score materialised.
pub fn naive_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, opts: &AttnOptions) -> Tensor<4> {
    let [b, h, sq, d] = q.dims();
    let sk = k.dims()[2];
    let device = q.device();
    let mut scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (d as f64).sqrt());
    if let Some(slopes) = &opts.alibi {
        assert_eq!(slopes.len(), h, "one ALiBi slope per head");
        let mut bias = Vec::with_capacity(h * sq * sk);
        for s in slopes {
            for i in 0..sq {
                for j in 0..sk {
                    let dist = (opts.q_offset + i) as f64 - (opts.k_offset + j) as f64;
                    let dist = if opts.causal { dist } else { dist.abs() };
                    bias.push((-s * dist) as f32);
                }
            }
        }
        let bias = Tensor::<4>::from_data(TensorData::new(bias, [1, h, sq, sk]), &device);
        scores = scores + bias.expand([b, h, sq, sk]);
    }
    if opts.causal {
        let mut mask = Vec::with_capacity(sq * sk);
        for i in 0..sq {
            for j in 0..sk {
                mask.push(opts.k_offset + j > opts.q_offset + i);
            }
        }
        let mask = Tensor::<4, Bool>::from_data(TensorData::new(mask, [1, 1, sq, sk]), &device);
        scores = scores.mask_fill(mask.expand([b, h, sq, sk]), f32::NEG_INFINITY);
    }
    softmax(scores, 3).matmul(v)
}
