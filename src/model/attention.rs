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

use burn::tensor::Tensor;

use crate::config::AttentionKind;
use crate::ops::attention::flash::{flash_attention, DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q};
use crate::ops::attention::naive::naive_attention;
use crate::ops::attention::options::AttnOptions;

/// The single-device attention a [`SequenceParallel`] strategy runs on what it gathered.
pub type LocalAttention<'a> =
    &'a dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>, &AttnOptions) -> Tensor<4>;

/// Work that a strategy's exchanges can hide ([`SequenceParallel::attention_beside`]): called
/// for part `k` of `n` (`k`, `n`, `tie`); the part applies `tie` to its input, which makes
/// autodiff run the part's backward while the exchange's gradient travels.
pub type SideWork<'a> = dyn FnMut(usize, usize, &dyn Fn(Tensor<3>) -> Tensor<3>) -> Tensor<3> + 'a;

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

    /// Whether [`SequenceParallel::attention_beside`] hides work behind the exchanges (they
    /// run on a communication thread); by default it does not.
    fn hides_work(&self) -> bool {
        false
    }

    /// [`SequenceParallel::attention`], with the parts of `side` (work independent of
    /// attention) computed while the exchanges travel, forward and backward; returns the output
    /// and the parts' results in order. By default: attention, then `side` in one part.
    fn attention_beside(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        opts: &AttnOptions,
        local: LocalAttention<'_>,
        side: &mut SideWork<'_>,
    ) -> (Tensor<4>, Vec<Tensor<3>>) {
        let o = self.attention(q, k, v, opts, local);
        (o, vec![side(0, 1, &|x| x)])
    }
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
