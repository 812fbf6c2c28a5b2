//! One GPT-NeoX layer as the model runs it: `x + attn(ln1(x)) + mlp(ln2(x))` (the parallel
//! residual), what the layers of one forward share ([`LayerContext`]: rotary tables, attention
//! options), and the one function that chooses how attention runs ([`GenSlm::attend`]). The
//! parameters, embedding, head and the model's forwards are in `neox.rs`.

use burn::tensor::Tensor;

use crate::config::{AttentionKind, Position};
use crate::model::attention::{attention, SequenceParallel};
use crate::model::cache::{LayerKv, Past};
use crate::model::neox::GenSlm;
use crate::model::params::LayerParams;
use crate::model::position::{alibi_slopes, rotary_tables_at, Positions};
use crate::ops::attention::decode::cached_attention;
use crate::ops::attention::options::AttnOptions;
use crate::ops::attention::qkv::qkv_attention;
use crate::ops::gelu::gelu_fast;
use crate::ops::linear::{linear_part, WeightParts};
use crate::ops::rotary::apply_rotary;

/// New tokens per cached decoding call up to which attention over the cache is the decoding
/// kernel (one pass over the cached rows per query); longer calls (a prompt) take the
/// configured attention.
const DECODE_DIRECT_ROWS: usize = 16;

/// What the layers of one forward share (see [`GenSlm::layer_context`]).
#[derive(Debug, Clone)]
pub struct LayerContext {
    /// Rotary cos/sin tables for the forward's positions.
    pub rope: Option<(Tensor<4>, Tensor<4>)>,
    pub attn: AttnOptions,
}

impl GenSlm {
    /// What every layer of one forward shares: rotary tables and attention options for `s`
    /// tokens starting at `offset`.
    pub fn layer_context(&self, offset: usize, s: usize) -> LayerContext {
        self.layer_context_at(&Positions::contiguous(offset, s))
    }

    /// [`GenSlm::layer_context`] for tokens at `pos`. Several runs of positions need a
    /// sequence-parallel strategy that knows its layout (the ring): plain attention reads one
    /// offset.
    pub fn layer_context_at(&self, pos: &Positions) -> LayerContext {
        let c = &self.cfg;
        let rot = c.rotary_dims();
        assert!(
            pos.spans.len() == 1 || self.sp.is_some(),
            "tokens at {} runs of positions need a sequence-parallel strategy",
            pos.spans.len()
        );
        LayerContext {
            rope: (c.position == Position::Rotary)
                .then(|| rotary_tables_at(rot, c.rotary_base, pos, &self.device)),
            attn: AttnOptions {
                causal: true,
                alibi: (c.position == Position::Alibi).then(|| {
                    // This rank's heads under TP (whole heads, in order).
                    let all = alibi_slopes(c.num_heads);
                    let (first, n) = self.rank_slice(c.num_heads);
                    all[first..first + n].to_vec()
                }),
                q_offset: pos.start(),
                k_offset: pos.start(),
            },
        }
    }

    /// Layer `li` on `x: [b, s, h]`: GPT-NeoX's parallel residual. With `Past::Cache`
    /// (incremental decoding, one rank only: `hidden_states_cached` refuses sharded models) the
    /// layer's cached keys and values come before the new ones, and the layer's updated
    /// `(k, v)` is returned beside its output.
    pub fn layer(
        &self,
        li: usize,
        x: Tensor<3>,
        ctx: &LayerContext,
        past: Past,
    ) -> (Tensor<3>, Option<LayerKv>) {
        let l = &self.layout.layers[li];
        if let (Some(sp), Past::None, None, None) = (&self.sp, &past, &self.tp, &self.defer) {
            if sp.hides_work() {
                return (self.layer_beside(l, x, ctx, sp.as_ref()), None);
            }
        }
        let (attn, kv) = self.attention_block(l, self.norm(x.clone(), l.ln1_w, l.ln1_b), ctx, past);
        let mlp = self.mlp_block(l, self.norm(x.clone(), l.ln2_w, l.ln2_b));
        (x + attn + mlp, kv)
    }

    /// The attention half of a layer on its normalised input `h`: the fused QKV projection,
    /// attention, and the output projection (row-parallel under TP).
    fn attention_block(
        &self,
        l: &LayerParams,
        h: Tensor<3>,
        ctx: &LayerContext,
        past: Past,
    ) -> (Tensor<3>, Option<LayerKv>) {
        let heads = self.layer_heads(l);
        let qkv = self.col_dense(h, l.qkv_w, l.qkv_b);
        let (o, kv) = self.attend(qkv, heads, ctx, past);
        (self.dense_out(o, l.dense_w, l.dense_b), kv)
    }

    /// [`GenSlm::layer`] under a sequence-parallel strategy whose exchanges hide work: the MLP
    /// (independent of attention in the parallel residual) runs in two halves of the rows
    /// while the exchanges travel, forward and backward (`parallel::ulysses_overlap`).
    fn layer_beside(
        &self,
        l: &LayerParams,
        x: Tensor<3>,
        ctx: &LayerContext,
        sp: &dyn SequenceParallel,
    ) -> Tensor<3> {
        let [b, s, hidden] = x.dims();
        let heads = self.layer_heads(l);
        let qkv = self.col_dense(self.norm(x.clone(), l.ln1_w, l.ln1_b), l.qkv_w, l.qkv_b);
        let (q, k, v) = self.split_heads(qkv, heads, ctx);
        let h = self.norm(x.clone(), l.ln2_w, l.ln2_b);
        let kind = self.cfg.attention;
        let local = |q, k, v, o: &AttnOptions| attention(q, k, v, o, kind);
        // The MLP's weights once for all parts (one tensor each, so autodiff gives each weight
        // the gradient its parts gathered: `ops::linear::linear_part`).
        let [w1, w2] = [l.fc1_w, l.fc2_w].map(|w| self.compute(self.mat(w)));
        let [b1, b2] = [l.fc1_b, l.fc2_b].map(|b| self.compute(self.vec(b)));
        let mut gathered: Option<[WeightParts; 2]> = None;
        let mut rows = |part: usize, parts: usize, tie: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let (first, end) = (part * s / parts, (part + 1) * s / parts);
            if first == end {
                // A rank holding fewer rows than there are parts (a short sequence over many
                // ranks) leaves some parts empty: no rows, no work, no weight gradient (burn
                // narrows to no rows nowhere). Every rank still takes the same path, so the
                // ring's or the exchanges' ops pair up across ranks.
                return self.compute(Tensor::zeros([b, 0, hidden], &x.device()));
            }
            // Cut at ⌊p·s/parts⌋, the parts' lengths are 0 or more and sum to s: min(s, parts)
            // of them hold rows.
            let [g1, g2] =
                gathered.get_or_insert_with(|| [0; 2].map(|_| WeightParts::new(parts.min(s))));
            let h = self.compute(tie(h.clone().narrow(1, first, end - first)));
            let m = gelu_fast(linear_part(h, w1.clone(), Some(b1.clone()), g1.part(part)));
            linear_part(m, w2.clone(), Some(b2.clone()), g2.part(part))
        };
        let (o, mlp) = sp.attention_beside(q, k, v, &ctx.attn, &local, &mut rows);
        let o = o
            .swap_dims(1, 2)
            .reshape([b, s, heads * self.cfg.head_dim()]);
        let mlp = mlp.into_iter().filter(|m| m.dims()[1] > 0).collect();
        x + self.dense_out(o, l.dense_w, l.dense_b) + Tensor::cat(mlp, 1)
    }

    /// This rank's heads of layer `l`: all of them, or its TP slice (the QKV weight's columns).
    fn layer_heads(&self, l: &LayerParams) -> usize {
        self.spec(l.qkv_w).shape[1] / (3 * self.cfg.head_dim())
    }

    /// The MLP half of a layer on its normalised input `h` (column- then row-parallel under TP).
    fn mlp_block(&self, l: &LayerParams, h: Tensor<3>) -> Tensor<3> {
        let m = gelu_fast(self.col_dense(h, l.fc1_w, l.fc1_b));
        self.dense_out(m, l.fc2_w, l.fc2_b)
    }

    /// q, k, v `[b, heads, s, d]` from the fused projection `qkv: [b, s, heads·3d]`, rotary
    /// applied. HF's fused layout: per head [q | k | v], each head_dim wide. Rotary and
    /// attention run in fp32 (softmax statistics in fp32 whatever the compute dtype).
    fn split_heads(
        &self,
        qkv: Tensor<3>,
        heads: usize,
        ctx: &LayerContext,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [b, s, _] = qkv.dims();
        let d = self.cfg.head_dim();
        let qkv = self.full(qkv.reshape([b, s, heads, 3 * d]).swap_dims(1, 2));
        let mut q = qkv.clone().narrow(3, 0, d);
        let mut k = qkv.clone().narrow(3, d, d);
        let v = qkv.narrow(3, 2 * d, d);
        if let Some((cos, sin)) = &ctx.rope {
            let rot = self.cfg.rotary_dims();
            q = apply_rotary(q, cos, sin, rot);
            k = apply_rotary(k, cos, sin, rot);
        }
        (q, k, v)
    }

    /// Attention from the fused projection `qkv: [b, s, heads·3d]` to `[b, s, heads·d]`, and
    /// the updated cache: the one place that chooses how attention runs.
    /// - one rank, no cache, rotary, FlashAttention: split, rotary and attention as one op;
    /// - a sequence-parallel model: the strategy's attention (Ulysses, ring) around the local one;
    /// - decoding with a cache: the new queries over the cached and new keys;
    /// - otherwise the configured attention (flash or naive) over this call's tokens.
    fn attend(
        &self,
        qkv: Tensor<3>,
        heads: usize,
        ctx: &LayerContext,
        past: Past,
    ) -> (Tensor<3>, Option<LayerKv>) {
        let c = &self.cfg;
        let (rot, kind) = (c.rotary_dims(), c.attention);
        if let (None, Past::None, Some((cos, sin)), AttentionKind::Flash) =
            (&self.sp, &past, &ctx.rope, kind)
        {
            return (
                qkv_attention(self.full(qkv), (cos, sin), heads, rot, &ctx.attn),
                None,
            );
        }
        let [b, s, _] = qkv.dims();
        let d = c.head_dim();
        let (q, k, v) = self.split_heads(qkv, heads, ctx);
        let (o, kv) = match (&self.sp, past) {
            (Some(sp), _) => {
                let local = |q, k, v, o: &AttnOptions| attention(q, k, v, o, kind);
                (sp.attention(q, k, v, &ctx.attn, &local), None)
            }
            (None, Past::Cache(past, reserve)) => {
                // Keys start at position 0 of the cache; queries at the context's offset.
                let kv = LayerKv::append(past, k, v, ctx.attn.q_offset, reserve);
                let len = ctx.attn.q_offset + s;
                let o = AttnOptions {
                    k_offset: 0,
                    ..ctx.attn.clone()
                };
                let o = if s <= DECODE_DIRECT_ROWS {
                    cached_attention(q, kv.keys(), kv.values(), len, &o)
                } else {
                    let rows = |t: &Tensor<4>| t.clone().narrow(2, 0, len);
                    attention(q, rows(kv.keys()), rows(kv.values()), &o, kind)
                };
                (o, Some(kv))
            }
            (None, Past::None) => (attention(q, k, v, &ctx.attn, kind), None),
        };
        (o.swap_dims(1, 2).reshape([b, s, heads * d]), kv)
    }
}
