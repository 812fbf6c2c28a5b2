//! `score --per-token` files: parquet with one row per predicted token.
//!
//! Columns: `id` (the record), `token_index` (the token's index in the record's token
//! sequence, `[BOS]` included where the vocabulary has one), `codon_index` (0-based codon of
//! the record; `[EOS]` gets the index after the last codon), `base_offset` (0-based offset of
//! the codon's first base in the cleaned record, 3·codon_index), `codon` (the token's text:
//! a codon, `[UNK]` for a codon with a base outside ACGT, `[EOS]`), `log_prob` (natural log of
//! the model's probability of the token, float64), `entropy` (of the predicted distribution,
//! nats, float64), `rank` (1 = the model's most likely token, int32), `context` (tokens of left
//! context the prediction saw, int32), `top_codons` / `top_probs` (the k most likely tokens
//! and their probabilities, fixed-size lists of k; absent with `--top-k 0`), and with `--full-distribution`
//! `log_probs` (all vocabulary ids' log-probabilities, a fixed-size list indexed by token id).
//! Key-value metadata records the model, window, stride and vocabulary (`genslm.*`).
//!
//! Rows are written in batches, so memory does not grow with the number of records, and the
//! file appears under its name only when complete.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{
    FixedSizeListBuilder, Float32Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
};
use arrow_array::ArrayRef;
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::error::{Error, Result};
use crate::infer::parquet_sink::ParquetSink;
use crate::infer::token_scores::TokenScore;
use crate::tokenizer::CodonTokenizer;

/// Rows per batch handed to the parquet writer.
const BATCH_ROWS: usize = 8192;
/// Row-group size in bytes after encoding.
const ROW_GROUP_BYTES: usize = 64 << 20;

fn list(item: DataType, n: usize) -> DataType {
    DataType::FixedSizeList(Arc::new(Field::new("item", item, false)), n as i32)
}

/// The columns that say where a token is, shared by the per-token tables (`score --per-token`,
/// `embed --pool none`): `id`, `token_index`, `codon_index`, `base_offset`, `codon`. A
/// genslm71 `[BOS]` is no codon: its codon index and base offset are −1.
pub struct TokenColumns {
    tok: CodonTokenizer,
    id: StringBuilder,
    ints: [Int64Builder; 3],
    codon: StringBuilder,
}

impl TokenColumns {
    pub fn new(tok: CodonTokenizer) -> Self {
        Self {
            tok,
            id: StringBuilder::new(),
            ints: Default::default(),
            codon: StringBuilder::new(),
        }
    }

    /// The fields, in the order [`TokenColumns::finish`] returns the columns.
    pub fn fields() -> Vec<Field> {
        vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("token_index", DataType::Int64, false),
            Field::new("codon_index", DataType::Int64, false),
            Field::new("base_offset", DataType::Int64, false),
            Field::new("codon", DataType::Utf8, false),
        ]
    }

    /// The text of a token id; ids past the tokenizer's vocabulary (a model whose
    /// `vocab_size` pads it) are written as `<id N>`.
    pub fn text(&self, id: u32) -> String {
        self.tok
            .token(id)
            .map_or_else(|| format!("<id {id}>"), str::to_string)
    }

    /// One row: record `id`'s token at index `t`, whose id is `token`.
    pub fn append(&mut self, id: &str, t: usize, token: u32) {
        let c = t as i64 - i64::from(self.tok.bos_id().is_some());
        self.id.append_value(id);
        for (b, v) in self
            .ints
            .iter_mut()
            .zip([t as i64, c, if c < 0 { -1 } else { 3 * c }])
        {
            b.append_value(v);
        }
        let text = self.text(token);
        self.codon.append_value(text);
    }

    /// The rows appended since the last call, as columns.
    pub fn finish(&mut self) -> Vec<ArrayRef> {
        let mut columns: Vec<ArrayRef> = vec![Arc::new(self.id.finish())];
        for b in &mut self.ints {
            columns.push(Arc::new(b.finish()));
        }
        columns.push(Arc::new(self.codon.finish()));
        columns
    }
}

/// The file's schema for `top_k` and, with the full distribution, `vocab` ids.
pub fn schema(top_k: usize, full: Option<usize>) -> SchemaRef {
    let mut fields = TokenColumns::fields();
    fields.extend([
        Field::new("log_prob", DataType::Float64, false),
        Field::new("entropy", DataType::Float64, false),
        Field::new("rank", DataType::Int32, false),
        Field::new("context", DataType::Int32, false),
    ]);
    // Lists of no entries would still need a length per row, which a fixed-size list of size 0
    // does not carry through arrow: with `--top-k 0` the columns are left out.
    if top_k > 0 {
        fields.extend([
            Field::new("top_codons", list(DataType::Utf8, top_k), false),
            Field::new("top_probs", list(DataType::Float32, top_k), false),
        ]);
    }
    if let Some(v) = full {
        fields.push(Field::new("log_probs", list(DataType::Float32, v), false));
    }
    Arc::new(Schema::new(fields))
}

/// Streams per-token rows into a parquet file that appears only after [`finish`].
///
/// [`finish`]: TokenScoreWriter::finish
pub struct TokenScoreWriter {
    sink: ParquetSink,
    top_k: usize,
    full: Option<usize>,
    position: TokenColumns,
    floats: [Float64Builder; 2],
    rank: Int32Builder,
    context: Int32Builder,
    top_codons: FixedSizeListBuilder<StringBuilder>,
    top_probs: FixedSizeListBuilder<Float32Builder>,
    log_probs: FixedSizeListBuilder<Float32Builder>,
    rows: usize,
    total: u64,
}

impl TokenScoreWriter {
    /// `full`: the vocabulary size when every id's log-probability is written.
    pub fn create(
        path: &Path,
        tok: CodonTokenizer,
        top_k: usize,
        full: Option<usize>,
        metadata: Vec<(String, String)>,
    ) -> Result<Self> {
        let sink = ParquetSink::create(path, schema(top_k, full), metadata, ROW_GROUP_BYTES)?;
        let item = |t| Arc::new(Field::new("item", t, false));
        Ok(Self {
            sink,
            top_k,
            full,
            position: TokenColumns::new(tok),
            floats: Default::default(),
            rank: Int32Builder::new(),
            context: Int32Builder::new(),
            top_codons: FixedSizeListBuilder::new(StringBuilder::new(), top_k as i32)
                .with_field(item(DataType::Utf8)),
            top_probs: FixedSizeListBuilder::new(Float32Builder::new(), top_k as i32)
                .with_field(item(DataType::Float32)),
            log_probs: FixedSizeListBuilder::new(Float32Builder::new(), full.unwrap_or(0) as i32)
                .with_field(item(DataType::Float32)),
            rows: 0,
            total: 0,
        })
    }

    /// Appends the scores of record `id`'s tokens.
    pub fn push(&mut self, id: &str, scores: &[TokenScore]) -> Result<()> {
        for s in scores {
            if s.top.len() != self.top_k || s.log_probs.as_ref().map(Vec::len) != self.full {
                return Err(self.err(format!(
                    "record '{id}': token {} has {} top entries and {:?} log-probabilities, \
                     the file holds {} and {:?}",
                    s.index,
                    s.top.len(),
                    s.log_probs.as_ref().map(Vec::len),
                    self.top_k,
                    self.full
                )));
            }
            self.position.append(id, s.index, s.target);
            self.floats[0].append_value(s.log_prob);
            self.floats[1].append_value(s.entropy);
            self.rank.append_value(s.rank as i32);
            self.context.append_value(s.context as i32);
            for &(t, p) in &s.top {
                let text = self.position.text(t);
                self.top_codons.values().append_value(text);
                self.top_probs.values().append_value(p);
            }
            if self.top_k > 0 {
                self.top_codons.append(true);
                self.top_probs.append(true);
            }
            if let Some(lp) = &s.log_probs {
                self.log_probs.values().append_slice(lp);
                self.log_probs.append(true);
            }
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
        // Schema order (see `schema`).
        let mut columns = self.position.finish();
        for b in &mut self.floats {
            columns.push(Arc::new(b.finish()));
        }
        columns.push(Arc::new(self.rank.finish()));
        columns.push(Arc::new(self.context.finish()));
        if self.top_k > 0 {
            columns.push(Arc::new(self.top_codons.finish()));
            columns.push(Arc::new(self.top_probs.finish()));
        }
        if self.full.is_some() {
            columns.push(Arc::new(self.log_probs.finish()));
        }
        self.sink.write(columns)?;
        self.rows = 0;
        Ok(())
    }

    fn err(&self, msg: String) -> Error {
        self.sink.err(msg)
    }

    /// Rows written so far.
    pub fn rows(&self) -> u64 {
        self.total
    }

    /// Writes the footer, syncs and renames the file into place.
    pub fn finish(mut self) -> Result<()> {
        self.write_batch()?;
        self.sink.finish()
    }
}
