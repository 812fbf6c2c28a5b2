//! Per-token hidden states of a record (`embed --pool none`, `--layers`, `--stride`).
//!
//! Windows of W tokens start every S tokens (S = W: consecutive windows, as `embed` has always
//! cut records); token t's state comes from the first window whose end passes t, so with S < W
//! every token past the first window sees at least W − S tokens of left context — the rule
//! `score --stride` uses for predictions (a token's state here includes the token itself).
//!
//! Files (parquet, atomic, streamed one batch of windows at a time): one row per token and layer — `id`, `token_index`, `codon_index`,
//! `base_offset` (−1 for a genslm71 `[BOS]`), `codon` (as in `score --per-token`), `layer` (Hugging Face's
//! `hidden_states` index), `context` (tokens of left context the state saw) and `embedding`
//! (fixed-size list of float32, the hidden size). Long format, so that pandas users select a
//! layer with `df[df.layer == 4]` and stack it with `np.stack(df.embedding)`.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, Int32Builder};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::error::Result;
use crate::infer::parquet_sink::ParquetSink;
use crate::infer::score_io::TokenColumns;
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::tokenizer::CodonTokenizer;

/// The windows of `n` tokens: `(start, end, first assigned token)`; tokens
/// `first..end` take their state from the window.
pub fn state_windows(n: usize, w: usize, stride: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut start, mut prev_end) = (0usize, 0usize);
    while start < n {
        let end = (start + w).min(n);
        out.push((start, end, start.max(prev_end)));
        if end == n {
            break;
        }
        prev_end = end;
        start += stride;
    }
    out
}

/// The states of a run of tokens at one layer, as a forward pass produced them.
pub struct StateRun<'a> {
    /// Index into the `layers` asked.
    pub layer: usize,
    /// The tokens `first..end` of the record.
    pub first: usize,
    pub end: usize,
    /// The window's first token: token t saw `t − start` tokens of left context.
    pub start: usize,
    /// `[(end − first) · hidden]`, row-major.
    pub states: &'a [f32],
}

/// Per-token states of `tokens` at each of `layers`, handed to `each` one window's run at a
/// time (memory: one batch of windows), `batch` windows per forward pass. For every layer, the
/// runs arrive in token order and cover every token once.
pub fn record_states_each(
    model: &GenSlm,
    tokens: &[u32],
    layers: &[usize],
    w: usize,
    stride: usize,
    batch: usize,
    each: &mut dyn FnMut(StateRun<'_>) -> Result<()>,
) -> Result<()> {
    let h = model.cfg.hidden_size;
    let n = tokens.len();
    let pad = CodonTokenizer::new(model.cfg.vocab)?.pad_id();
    let w = w.min(n.max(1));
    let windows = state_windows(n, w, stride.clamp(1, w));
    crate::infer::window::check_forward_memory(
        model,
        batch.max(1).min(windows.len().max(1)),
        w,
        "--seq-len",
    )?;
    for group in windows.chunks(batch.max(1)) {
        let s = group.iter().map(|x| x.1 - x.0).max().unwrap_or(1);
        let mut ids = vec![pad; group.len() * s];
        for (r, &(a, e, _)) in group.iter().enumerate() {
            ids[r * s..r * s + e - a].copy_from_slice(&tokens[a..e]);
        }
        let states =
            model.hidden_states_at(tokens_tensor(&ids, group.len(), s, &model.device), layers)?;
        for (li, st) in states.iter().enumerate() {
            let v = tensor_to_vec(st);
            for (r, &(a, e, first)) in group.iter().enumerate() {
                let from = (r * s + first - a) * h;
                each(StateRun {
                    layer: li,
                    first,
                    end: e,
                    start: a,
                    states: &v[from..from + (e - first) * h],
                })?;
            }
        }
    }
    Ok(())
}

/// [`record_states_each`] gathered: per layer `[n · hidden]`, and each token's left context.
pub fn record_states(
    model: &GenSlm,
    tokens: &[u32],
    layers: &[usize],
    w: usize,
    stride: usize,
    batch: usize,
) -> Result<(Vec<Vec<f32>>, Vec<usize>)> {
    let (n, h) = (tokens.len(), model.cfg.hidden_size);
    let mut out = vec![vec![0f32; n * h]; layers.len()];
    let mut context = vec![0usize; n];
    record_states_each(model, tokens, layers, w, stride, batch, &mut |run| {
        out[run.layer][run.first * h..run.end * h].copy_from_slice(run.states);
        for (t, c) in context.iter_mut().enumerate().take(run.end).skip(run.first) {
            *c = t - run.start;
        }
        Ok(())
    })?;
    Ok((out, context))
}

/// Rows per batch handed to the parquet writer.
const BATCH_ROWS: usize = 2048;

/// Streams per-token states into a parquet file that appears only after [`finish`].
///
/// [`finish`]: TokenStateWriter::finish
pub struct TokenStateWriter {
    sink: ParquetSink,
    dim: usize,
    position: TokenColumns,
    layer: Int32Builder,
    context: Int32Builder,
    embedding: FixedSizeListBuilder<Float32Builder>,
    rows: usize,
    total: u64,
}

pub fn schema(dim: usize) -> SchemaRef {
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    let mut fields = TokenColumns::fields();
    fields.extend([
        Field::new("layer", DataType::Int32, false),
        Field::new("context", DataType::Int32, false),
        Field::new(
            "embedding",
            DataType::FixedSizeList(item, dim as i32),
            false,
        ),
    ]);
    Arc::new(Schema::new(fields))
}

impl TokenStateWriter {
    pub fn create(
        path: &Path,
        tok: CodonTokenizer,
        dim: usize,
        metadata: Vec<(String, String)>,
    ) -> Result<Self> {
        let sink = ParquetSink::create(path, schema(dim), metadata, 64 << 20)?;
        let item = Arc::new(Field::new("item", DataType::Float32, false));
        Ok(Self {
            sink,
            dim,
            position: TokenColumns::new(tok),
            layer: Int32Builder::new(),
            context: Int32Builder::new(),
            embedding: FixedSizeListBuilder::new(Float32Builder::new(), dim as i32)
                .with_field(item),
            rows: 0,
            total: 0,
        })
    }

    /// Appends the rows of one run of record `id`'s tokens at hidden state `layer`.
    pub fn push_run(
        &mut self,
        id: &str,
        tokens: &[u32],
        layer: usize,
        run: &StateRun<'_>,
    ) -> Result<()> {
        for (t, &tokid) in tokens.iter().enumerate().take(run.end).skip(run.first) {
            self.position.append(id, t, tokid);
            self.layer.append_value(layer as i32);
            self.context.append_value((t - run.start) as i32);
            let row = (t - run.first) * self.dim;
            self.embedding
                .values()
                .append_slice(&run.states[row..row + self.dim]);
            self.embedding.append(true);
            self.rows += 1;
            self.total += 1;
            if self.rows >= BATCH_ROWS {
                self.write_batch()?;
            }
        }
        Ok(())
    }

    fn write_batch(&mut self) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let mut columns = self.position.finish();
        columns.push(Arc::new(self.layer.finish()));
        columns.push(Arc::new(self.context.finish()));
        columns.push(Arc::new(self.embedding.finish()));
        self.sink.write(columns)?;
        self.rows = 0;
        Ok(())
    }

    pub fn rows(&self) -> u64 {
        self.total
    }

    /// Writes the footer, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        self.write_batch()?;
        self.sink.finish()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::{Config, Position};

    /// Brute force: token t's state recomputed alone from the tokens `[a, t]`, a = the start of
    /// the first window whose end passes t (a causal model's state at t sees nothing after t).
    #[test]
    fn strided_states_equal_a_per_token_recomputation() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        for pos in [Position::Rotary, Position::Alibi] {
            let mut cfg = Config::load(&path).unwrap().model;
            cfg.position = pos;
            let model = GenSlm::init(cfg, 3, &Device::flex()).unwrap();
            let h = model.cfg.hidden_size;
            let ids: Vec<u32> = (0..23u32).map(|i| 5 + (i * 31 + 2) % 64).collect();
            let layers = [0, 1, model.cfg.num_layers];
            for (w, s) in [(8, 3), (8, 8), (30, 4)] {
                let (got, ctx) = record_states(&model, &ids, &layers, w, s, 2).unwrap();
                let w = w.min(ids.len());
                for t in 0..ids.len() {
                    let a = (t + 1).saturating_sub(w).div_ceil(s) * s;
                    assert_eq!(ctx[t], t - a, "{pos:?} w {w} s {s} t {t}");
                    let x = &ids[a..=t];
                    for (li, &layer) in layers.iter().enumerate() {
                        let st = model
                            .hidden_state(tokens_tensor(x, 1, x.len(), &model.device), layer)
                            .unwrap();
                        let v = tensor_to_vec(&st);
                        let want = &v[(x.len() - 1) * h..x.len() * h];
                        let have = &got[li][t * h..(t + 1) * h];
                        let err = want
                            .iter()
                            .zip(have)
                            .map(|(p, q)| (p - q).abs())
                            .fold(0f32, f32::max);
                        assert!(err < 1e-4, "{pos:?} w {w} s {s} t {t} layer {layer}: {err}");
                    }
                }
            }
        }
    }

    /// Every token gets exactly one window, with at least W − S tokens of context past the
    /// first window; S = W is `embed`'s consecutive windows.
    #[test]
    fn every_token_takes_its_state_from_one_window() {
        for n in 0..30 {
            for w in 1..9 {
                for s in 1..=w {
                    let mut seen = vec![0; n];
                    for (a, e, first) in state_windows(n, w, s) {
                        assert!(e - a <= w && first >= a);
                        for (t, c) in seen.iter_mut().enumerate().take(e).skip(first) {
                            *c += 1;
                            assert!(t - a >= (w - s).min(t));
                        }
                    }
                    assert!(seen.iter().all(|&c| c == 1), "{n} {w} {s}");
                }
            }
        }
    }
}
