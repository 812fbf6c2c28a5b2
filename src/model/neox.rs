//! GPT-NeoX exactly as Hugging Face's `GPTNeoXForCausalLM` computes it (docs/ARCHITECTURE.md §3):
//! `x + attn(ln1(x)) + mlp(ln2(x))` per layer (parallel residual), rotary on the first
//! `rotary_dims` of each head (rotate-half), `gelu_fast`, final LayerNorm, untied `embed_out`.
//! Learned and ALiBi positions are genslm's options beside rotary.
//!
//! Parameters are a flat list of 1-D tensors (see `params.rs`), reshaped where used.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};

use crate::config::{ModelConfig, Precision};
use crate::error::{Error, Result};
use crate::model::attention::SequenceParallel;
use crate::model::cache::{KvCache, Past};
use crate::model::params::{Layout, ParamSpec};
use crate::model::position::{cat_runs, Positions};
use crate::model::tensor_parallel::TensorParallel;
use crate::ops::layer_norm::layer_norm;
use crate::ops::linear::{linear, linear_deferred, WeightGrads};
use crate::ops::primitive::{host_to_param, tensor_to_vec};

/// A GPT-NeoX model on one device.
#[derive(Debug, Clone)]
pub struct GenSlm {
    pub cfg: ModelConfig,
    pub layout: Layout,
    /// One flat tensor per `layout.specs` entry.
    pub params: Vec<Tensor<1>>,
    pub device: Device,
    /// How attention spans ranks when this rank holds one shard of each sequence (set from
    /// outside, by `train::shard`); with learned positions the table parameter is then this
    /// rank's rows only.
    pub sp: Option<std::sync::Arc<dyn SequenceParallel>>,
    /// The tensor-parallel group when this rank holds slices of the weights (set from outside,
    /// by `train::shard`, which also cuts the parameters: see `model::tensor_parallel`).
    pub tp: Option<std::sync::Arc<dyn TensorParallel>>,
    /// Compute dtype of the forward (the parameters stay fp32 whatever it is).
    pub precision: Precision,
    /// Where the linear layers leave their weight gradients for later (a zero-bubble
    /// pipeline's W pass; see [`GenSlm::deferring_weight_grads`]); `None`: in the backward.
    pub defer: Option<WeightGrads>,
}

/// What a forward pass returns besides the final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ForwardOptions {
    /// Position of the first token (a window further into a sequence, or a sequence shard).
    pub offset: usize,
    /// Keep the hidden states entering each layer (index 0 = embeddings).
    pub collect_hidden: bool,
}

impl GenSlm {
    /// Builds a model from host values in our layout (one `Vec<f32>` per parameter).
    pub fn from_host(cfg: ModelConfig, values: Vec<Vec<f32>>, device: &Device) -> Result<Self> {
        cfg.validate().map_err(Error::Invalid)?;
        let layout = Layout::new(&cfg);
        if values.len() != layout.specs.len() {
            return Err(Error::Invalid(format!(
                "model has {} parameters, got {} tensors",
                layout.specs.len(),
                values.len()
            )));
        }
        let mut params = Vec::with_capacity(values.len());
        for (spec, v) in layout.specs.iter().zip(values) {
            if v.len() != spec.numel() {
                return Err(Error::Invalid(format!(
                    "parameter {}: expected {} values ({:?}), got {}",
                    spec.name,
                    spec.numel(),
                    spec.shape,
                    v.len()
                )));
            }
            params.push(host_to_param(v, device));
        }
        Ok(Self::assemble(cfg, layout, params, device))
    }

    fn assemble(cfg: ModelConfig, layout: Layout, params: Vec<Tensor<1>>, device: &Device) -> Self {
        Self {
            cfg,
            layout,
            params,
            device: device.clone(),
            sp: None,
            tp: None,
            precision: Precision::Fp32,
            defer: None,
        }
    }

    /// A model with this configuration whose parameters are all empty (no values): the
    /// skeleton a rank fills with only its share of the weights (ZeRO-3 builds from it).
    pub fn empty(cfg: ModelConfig, device: &Device) -> Result<Self> {
        cfg.validate().map_err(Error::Invalid)?;
        let layout = Layout::new(&cfg);
        let params = (0..layout.specs.len())
            .map(|_| host_to_param(Vec::new(), device))
            .collect();
        Ok(Self::assemble(cfg, layout, params, device))
    }

    /// A freshly initialised model (Hugging Face's init: N(0, 0.02) weights, LayerNorm 1/0,
    /// zero biases), drawn deterministically from `seed`.
    pub fn init(cfg: ModelConfig, seed: u64, device: &Device) -> Result<Self> {
        let values = Layout::new(&cfg).init_host(seed);
        Self::from_host(cfg, values, device)
    }

    /// The same model outside autodiff (parameters shared, not copied): for forwards that
    /// record no graph, such as validation and checkpointing's first pass.
    pub fn without_autodiff(&self) -> Self {
        Self {
            cfg: self.cfg.clone(),
            layout: self.layout.clone(),
            params: self
                .params
                .iter()
                .map(|p| p.clone().without_autodiff())
                .collect(),
            device: self.device.clone().without_autodiff(),
            sp: self.sp.clone(),
            tp: self.tp.clone(),
            precision: self.precision,
            defer: None,
        }
    }

    /// The same model (parameters shared) whose linear layers leave their weight gradients in
    /// `sink` instead of the backward: the backward then computes what the previous pipeline
    /// stage waits for, and [`WeightGrads::take`] the weights' products later.
    pub fn deferring_weight_grads(&self, sink: WeightGrads) -> Self {
        Self {
            defer: Some(sink),
            ..self.clone()
        }
    }

    /// The same model computing in `precision`.
    pub fn with_precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }

    /// `t` in the compute dtype. Under autodiff the cast's backward hands the gradient back in
    /// fp32, so the fp32 parameters receive fp32 gradients (mixed precision with master
    /// weights).
    pub(crate) fn compute<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        match self.precision {
            Precision::Fp32 => t,
            Precision::Bf16 => t.cast(FloatDType::BF16),
        }
    }

    /// `t` back in fp32 (a no-op when the compute is fp32).
    pub(crate) fn full<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        match self.precision {
            Precision::Fp32 => t,
            Precision::Bf16 => t.cast(FloatDType::F32),
        }
    }

    /// A linear layer in the compute dtype.
    pub(super) fn dense(&self, x: Tensor<3>, w: usize, b: Option<usize>) -> Tensor<3> {
        let bias = b.map(|b| self.compute(self.vec(b)));
        let (x, weight) = (self.compute(x), self.compute(self.mat(w)));
        match &self.defer {
            None => linear(x, weight, bias),
            Some(sink) => linear_deferred(x, weight, bias, sink.to(w)),
        }
    }

    /// LayerNorm with its statistics in fp32; the result in the compute dtype.
    pub(super) fn norm(&self, x: Tensor<3>, w: usize, b: usize) -> Tensor<3> {
        // Parameters in fp32 too: bf16 working copies under DeepSpeed's layout.
        let y = layer_norm(
            self.full(x),
            self.full(self.region_vec(w)),
            self.full(self.region_vec(b)),
            self.cfg.layer_norm_eps,
        );
        self.compute(y)
    }

    /// Parameter values on the host, in our layout.
    pub fn to_host(&self) -> Vec<Vec<f32>> {
        self.params.iter().map(tensor_to_vec).collect()
    }

    pub(super) fn vec(&self, i: usize) -> Tensor<1> {
        self.params[i].clone()
    }

    pub(super) fn mat(&self, i: usize) -> Tensor<2> {
        let s = &self.layout.specs[i].shape;
        self.params[i].clone().reshape([s[0], s[1]])
    }

    pub fn spec(&self, i: usize) -> &ParamSpec {
        &self.layout.specs[i]
    }

    /// Final hidden states `[b, s, h]` (after the final LayerNorm) for `tokens: [b, s]`, and
    /// the states entering each layer when asked.
    pub fn hidden_states(
        &self,
        tokens: Tensor<2, Int>,
        opts: ForwardOptions,
    ) -> Result<(Tensor<3>, Vec<Tensor<3>>)> {
        self.layers_forward(tokens, opts, None)
    }

    /// Hidden state `layer` in Hugging Face's numbering (0 = the embeddings, `i` = the output of
    /// layer `i`, `num_layers` = after the final LayerNorm) of `tokens` at position 0, running
    /// only the layers it needs. In fp32 whatever the compute precision (callers pool it).
    pub fn hidden_state(&self, tokens: Tensor<2, Int>, layer: usize) -> Result<Tensor<3>> {
        let s = tokens.dims()[1];
        let mut x = self.embed(tokens, 0)?;
        let ctx = self.layer_context(0, s);
        let n = self.layout.layers.len();
        for li in 0..layer.min(n) {
            x = self.layer(li, x, &ctx, Past::None).0;
        }
        Ok(self.full(if layer >= n { self.final_norm(x) } else { x }))
    }

    /// Final hidden states of `tokens: [b, n]` placed after the `cache.len` cached tokens; their
    /// keys and values are appended to `cache` (incremental decoding: O(s) per new token).
    pub fn hidden_states_cached(
        &self,
        tokens: Tensor<2, Int>,
        cache: &mut KvCache,
    ) -> Result<Tensor<3>> {
        if self.sp.is_some() || self.tp.is_some() {
            return Err(Error::Invalid(
                "decoding with a KV cache runs on one rank; this model is sharded over ranks"
                    .into(),
            ));
        }
        let opts = ForwardOptions {
            offset: cache.len,
            collect_hidden: false,
        };
        self.layers_forward(tokens, opts, Some(cache))
            .map(|(h, _)| h)
    }

    /// The model body. With a cache, each layer's new keys/values are appended to the cached
    /// ones and the new queries (at `opts.offset`) attend to all of them.
    fn layers_forward(
        &self,
        tokens: Tensor<2, Int>,
        opts: ForwardOptions,
        cache: Option<&mut KvCache>,
    ) -> Result<(Tensor<3>, Vec<Tensor<3>>)> {
        let pos = Positions::contiguous(opts.offset, tokens.dims()[1]);
        self.layers_forward_at(tokens, &pos, opts.collect_hidden, cache)
    }

    /// [`GenSlm::layers_forward`] for tokens at `pos`.
    fn layers_forward_at(
        &self,
        tokens: Tensor<2, Int>,
        pos: &Positions,
        collect_hidden: bool,
        mut cache: Option<&mut KvCache>,
    ) -> Result<(Tensor<3>, Vec<Tensor<3>>)> {
        let mut x = self.embed_at(tokens, pos)?;
        let ctx = self.layer_context_at(pos);
        let mut collected = Vec::new();
        let mut new_cache = Vec::new();
        let reserve = cache.as_ref().map(|kv| kv.reserve);
        let mut pasts = cache
            .as_deref_mut()
            .map(|kv| std::mem::take(&mut kv.layers))
            .unwrap_or_default()
            .into_iter();
        for li in 0..self.layout.layers.len() {
            if collect_hidden {
                collected.push(x.clone());
            }
            let past = match reserve {
                Some(r) => Past::Cache(pasts.next(), r),
                None => Past::None,
            };
            let (out, kv) = self.layer(li, x, &ctx, past);
            if let Some(kv) = kv {
                new_cache.push(kv);
            }
            x = out;
        }
        if let Some(kv) = cache {
            kv.layers = new_cache;
            kv.len = pos.start() + pos.len();
        }
        Ok((self.final_norm(x), collected))
    }

    /// Token embeddings plus, with learned positions, the rows of positions
    /// `offset..offset + s` (this rank's shard of the table under SP): `[b, s, h]`.
    pub fn embed(&self, tokens: Tensor<2, Int>, offset: usize) -> Result<Tensor<3>> {
        let s = tokens.dims()[1];
        self.embed_at(tokens, &Positions::contiguous(offset, s))
    }

    /// First row of the learned-position table this rank holds, when the table is split over
    /// sequence-parallel ranks (`None`: the whole table is here).
    pub fn position_shard(&self) -> Option<usize> {
        self.sp.as_ref().and_then(|g| g.position_shard())
    }

    /// [`GenSlm::embed`] for tokens at `pos` (any runs of positions; padding gets zero rows).
    pub fn embed_at(&self, tokens: Tensor<2, Int>, pos: &Positions) -> Result<Tensor<3>> {
        let c = &self.cfg;
        let [b, s] = tokens.dims();
        let h = c.hidden_size;
        // The embeddings sum in fp32 whatever dtype the tables are kept in.
        let table = self.full(self.mat(self.layout.embed_in));
        let mut x = self.token_embedding(table, tokens);
        if let Some(p) = self.layout.embed_pos {
            let rows = self.layout.specs[p].shape[0];
            let first = self.position_shard().unwrap_or(0);
            let table_rows = self.full(self.region_vec(p)).reshape([rows, h]);
            let mut parts = Vec::with_capacity(pos.spans.len() + 1);
            // Whether any row of the table is read (not on a rank of padding only, below).
            let mut touched = false;
            for span in &pos.spans {
                let real = span.len.min(pos.real_end.saturating_sub(span.start));
                touched |= real > 0;
                let (start, end) = (span.start, span.start + real);
                if real > 0 && end > c.max_position_embeddings {
                    return Err(Error::Invalid(format!(
                        "{} tokens at position {} go past the {} learned positions of this \
                         model; learned-position models cannot go beyond their training length \
                         (score and embed: use --seq-len {} or less)",
                        real, start, c.max_position_embeddings, c.max_position_embeddings
                    )));
                }
                if real > 0 && (start < first || end > first + rows) {
                    return Err(Error::Invalid(format!(
                        "positions {start}..{end} are not in this rank's learned-position shard \
                         {first}..{}",
                        first + rows
                    )));
                }
                if real > 0 {
                    parts.push(table_rows.clone().narrow(0, start - first, real));
                }
                if real < span.len {
                    parts.push(Tensor::zeros([span.len - real, h], &self.device));
                }
            }
            let table = cat_runs(parts, 0);
            debug_assert_eq!(table.dims()[0], s);
            // Under Megatron SP the token embedding holds this rank's part of the sequence.
            let (at, n) = self.region_cols(s);
            x = x + table.narrow(0, at, n).unsqueeze::<3>().expand([b, n, h]);
            if !touched && rows > 0 {
                // A rank whose tokens are all padding (an SP or CP shard past a short
                // sequence's end) reads no row. One row weighted 0 keeps the table in its
                // graph, so its gradient is zero rather than missing: the reductions and the
                // optimizer take one from every rank ("no gradient for …embed_pos" stopped
                // such layouts at step 1).
                let none = table_rows.narrow(0, 0, 1).mul_scalar(0.0);
                x = x + none.unsqueeze::<3>().expand([b, n, h]);
            }
        }
        Ok(self.compute(x))
    }

    /// The final LayerNorm.
    pub fn final_norm(&self, x: Tensor<3>) -> Tensor<3> {
        self.norm(x, self.layout.final_ln_w, self.layout.final_ln_b)
    }

    /// Logits `[b, s, vocab]` from final hidden states, in fp32 (the loss is computed in fp32).
    /// Under TP, this rank's vocabulary columns only (see [`GenSlm::nll`]).
    pub fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        self.full(self.dense(self.copy_in(hidden), self.layout.embed_out, None))
    }

    /// Logits of `tokens` held at `pos` (a rank's shard of a sequence, possibly padded).
    pub fn forward_at(&self, tokens: Tensor<2, Int>, pos: &Positions) -> Result<Tensor<3>> {
        let (h, _) = self.layers_forward_at(tokens, pos, false, None)?;
        Ok(self.logits(h))
    }

    pub fn forward(&self, tokens: Tensor<2, Int>, offset: usize) -> Result<Tensor<3>> {
        let opts = ForwardOptions {
            offset,
            collect_hidden: false,
        };
        let (h, _) = self.hidden_states(tokens, opts)?;
        Ok(self.logits(h))
    }
}

/// Sum over positions of −log p(next token), counting only targets whose `mask` is 1, and the
/// number of such targets. Position t predicts token t+1 of the same row.
pub fn next_token_nll(
    logits: Tensor<3>,
    tokens: &[u32],
    mask: &[u8],
    b: usize,
    s: usize,
) -> (Tensor<1>, usize) {
    let mut targets = Vec::with_capacity(b * (s - 1));
    let mut weights = Vec::with_capacity(b * (s - 1));
    for r in 0..b {
        for t in 0..s - 1 {
            targets.push(tokens[r * s + t + 1] as i64);
            weights.push(f32::from(mask[r * s + t + 1]));
        }
    }
    let n = weights.iter().filter(|&&w| w > 0.0).count();
    (masked_nll(logits.narrow(1, 0, s - 1), targets, weights), n)
}

/// The loss: Σ −log softmax(logits)[target] · weight over `logits: [rows, cols, vocab]`, with
/// one target id and one weight per position (row-major). Every loss in genslm (training on
/// any rank layout, validation, scoring) is this function.
pub fn masked_nll(logits: Tensor<3>, targets: Vec<i64>, weights: Vec<f32>) -> Tensor<1> {
    let [rows, cols, _] = logits.dims();
    let device = logits.device();
    let targets: Tensor<3, Int> =
        Tensor::from_data(TensorData::new(targets, [rows, cols, 1]), &device);
    let weights: Tensor<2> = Tensor::from_data(TensorData::new(weights, [rows, cols]), &device);
    let lp = log_softmax(logits, 2);
    let picked: Tensor<2> = lp.gather(2, targets).squeeze_dim::<2>(2);
    (picked * weights).sum().neg()
}
