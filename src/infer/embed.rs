//! `genslm embed`: one vector per record from a layer's hidden states.
//!
//! - **Layer**: Hugging Face's `hidden_states` numbering: 0 = the token embeddings, `i` = the
//!   output of layer `i`, `num_layers` (or −1, the default, as GenSLM does) = after the final
//!   LayerNorm. Negative values count from the end (−2 = the output of the last layer but one).
//! - **Pooling**: `mean` averages the hidden states of the record's real tokens (padding is
//!   excluded); `last` takes the state of its last token; `none` writes every token's state
//!   (one row per token and layer, see [`crate::infer::token_states`]).
//! - **Several layers** (`--layers`): one pass, one row per record and layer.
//! - **`--stride`**: overlapping windows, each token's state from the first window whose end
//!   passes it (at least W − S tokens of context), as `score --stride` predicts.
//! - **Long records**: a record longer than the window (`--seq-len`; default as for `score`,
//!   see [`crate::infer::window`]) is cut into consecutive windows, each run on its own from
//!   position 0 like in training; the record's mean is the token-count-weighted average of the
//!   windows' means, i.e. the mean over all of its tokens. `last` uses the last window.
//! - Only the layers up to the one asked for run.
//!
//! Records stream through in small groups (their windows sorted by length into padded batches),
//! and rows stream into the parquet file, so memory does not grow with the number of records.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::tensor::{Tensor, TensorData};
use md5::{Digest, Md5};

use crate::backend::Compute;
use crate::checksum::hex;
use crate::data::dataset::{DatasetReader, TokenizedRecord};
use crate::data::digest::DigestKind;
use crate::data::fasta::{self, OnInvalid};
use crate::error::{Error, Result};
use crate::infer::embed_io::{EmbeddingRow, EmbeddingWriter};
use crate::infer::token_states::{record_states_each, TokenStateWriter};
use crate::infer::window::resolve_window;
use crate::model::io::load_model_dir;
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::tokenizer::CodonTokenizer;

/// How a record's token states become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pool {
    /// Mean over the record's tokens.
    #[default]
    Mean,
    /// The last token's state.
    Last,
    /// No pooling: every token's state.
    None,
}

impl Pool {
    pub fn name(self) -> &'static str {
        match self {
            Pool::Mean => "mean",
            Pool::Last => "last",
            Pool::None => "none",
        }
    }
}

/// Settings of one `embed` run.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedOptions {
    /// Hidden-state indices; negative counts from the end (−1 = after the final LayerNorm).
    pub layers: Vec<i64>,
    pub pool: Pool,
    /// Window in tokens (None: the default of [`crate::infer::window::resolve_window`]).
    pub seq_len: Option<usize>,
    /// Tokens between window starts (None: the window).
    pub stride: Option<usize>,
    /// Windows per forward pass.
    pub batch_size: usize,
    pub progress: bool,
    pub compute: Compute,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        Self {
            layers: vec![-1],
            pool: Pool::Mean,
            seq_len: None,
            stride: None,
            batch_size: 8,
            progress: false,
            compute: Compute::default(),
        }
    }
}

/// Where the records come from.
#[derive(Debug, Clone, PartialEq)]
pub enum EmbedInput {
    Fasta(Vec<PathBuf>),
    /// A dataset written by `genslm tokenize`.
    Parquet(PathBuf),
}

/// What an embed run did.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedSummary {
    /// Records read.
    pub records: u64,
    /// Rows written: one per record pooled, one per token and layer with `--pool none`.
    pub rows: u64,
    pub tokens: u64,
    pub dim: usize,
    pub layers: Vec<usize>,
    pub window: Option<usize>,
    pub elapsed: Duration,
}

/// Resolves `--layer` to a hidden-state index in `0..=num_layers`.
pub fn resolve_layer(layer: i64, num_layers: usize) -> Result<usize> {
    let n = num_layers as i64;
    let idx = if layer < 0 { n + 1 + layer } else { layer };
    if !(0..=n).contains(&idx) {
        return Err(Error::Invalid(format!(
            "layer {layer} (--layer/--layers): this model has {num_layers} layers, so a layer is \
             0 (embeddings) to {num_layers} (after the final LayerNorm), or -1 to -{}",
            n + 1
        )));
    }
    Ok(idx as usize)
}

/// Embeds token sequences: one vector of the hidden size per record (see the module docs).
/// Every record needs at least one token.
pub fn embed_tokens(
    model: &GenSlm,
    records: &[&[u32]],
    layer: usize,
    pool: Pool,
    window: Option<usize>,
    batch_size: usize,
) -> Result<Vec<Vec<f32>>> {
    let h = model.cfg.hidden_size;
    let pad = CodonTokenizer::new(model.cfg.vocab)?.pad_id();
    // (record, start, len, is the record's last window)
    let mut windows = Vec::new();
    for (r, toks) in records.iter().enumerate() {
        let w = window.unwrap_or(toks.len()).max(1);
        let mut start = 0;
        while start < toks.len() {
            let len = (toks.len() - start).min(w);
            windows.push((r, start, len, start + len == toks.len()));
            start += len;
        }
    }
    // Similar lengths share a batch: less padding.
    windows.sort_by_key(|&(r, start, len, _)| (std::cmp::Reverse(len), r, start));
    let mut sums = vec![vec![0f64; h]; records.len()];
    let mut counts = vec![0usize; records.len()];
    for batch in windows.chunks(batch_size.max(1)) {
        let b = batch.len();
        let s = batch.iter().map(|w| w.2).max().unwrap_or(1);
        crate::infer::window::check_forward_memory(model, b, s, "--seq-len")?;
        let mut tokens = vec![pad; b * s];
        let mut weights = vec![0f32; b * s];
        for (i, &(r, start, len, last)) in batch.iter().enumerate() {
            tokens[i * s..i * s + len].copy_from_slice(&records[r][start..start + len]);
            match pool {
                Pool::Mean => weights[i * s..i * s + len].fill(1.0),
                Pool::Last if last => weights[i * s + len - 1] = 1.0,
                Pool::Last | Pool::None => {}
            }
        }
        let states = model.hidden_state(tokens_tensor(&tokens, b, s, &model.device), layer)?;
        let w = Tensor::<3>::from_data(TensorData::new(weights, [b, s, 1]), &model.device);
        let pooled = tensor_to_vec(&(states * w).sum_dim(1));
        for (i, &(r, _, len, last)) in batch.iter().enumerate() {
            if pool == Pool::Last && !last {
                continue;
            }
            for (acc, v) in sums[r].iter_mut().zip(&pooled[i * h..(i + 1) * h]) {
                *acc += *v as f64;
            }
            counts[r] += if pool == Pool::Mean { len } else { 1 };
        }
    }
    Ok(sums
        .into_iter()
        .zip(counts)
        .map(|(s, n)| {
            s.into_iter()
                .map(|v| (v / n.max(1) as f64) as f32)
                .collect()
        })
        .collect())
}

/// The output row of record `p`'s vector `e` at hidden state `layer`; an error where the vector
/// is not finite (weights that overflow in fp32 give NaN states, no embedding).
fn embedding_row<'r>(
    p: &'r TokenizedRecord,
    layer: usize,
    e: &'r [f32],
) -> Result<EmbeddingRow<'r>> {
    if let Some(i) = e.iter().position(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "record '{}': its embedding (layer {layer}) holds {} at dimension {i}: the model's \
             hidden states are not finite (do its weights overflow in fp32?); nothing was written",
            crate::error::short_id(&p.id),
            e[i]
        )));
    }
    Ok(EmbeddingRow {
        id: &p.id,
        description: &p.description,
        source: &p.source,
        digest: &p.digest,
        length: p.length,
        gc_content: p.gc_content,
        n_tokens: p.tokens.len() as u64,
        layer: layer as i32,
        embedding: e,
    })
}

/// Records are embedded in groups of about this many windows per batch slot.
const GROUP_BATCHES: usize = 4;
/// ... or when this many tokens are waiting.
const GROUP_TOKENS: usize = 1 << 20;

/// Where rows go: pooled vectors, or every token's state.
enum Sink {
    Pooled(Box<EmbeddingWriter>),
    Tokens(Box<TokenStateWriter>),
}

impl Sink {
    fn rows(&self) -> u64 {
        match self {
            Sink::Pooled(w) => w.rows(),
            Sink::Tokens(w) => w.rows(),
        }
    }
    fn finish(self) -> Result<()> {
        match self {
            Sink::Pooled(w) => w.finish(),
            Sink::Tokens(w) => w.finish(),
        }
    }
}

struct Pipeline<'a> {
    model: &'a GenSlm,
    writer: Sink,
    opts: &'a EmbedOptions,
    layers: Vec<usize>,
    window: Option<usize>,
    /// One layer, consecutive windows, pooled: records batched together by window length.
    batched: bool,
    pending: Vec<TokenizedRecord>,
    pending_windows: usize,
    pending_tokens: usize,
    tokens: u64,
    bar: indicatif::ProgressBar,
    /// The tokenizer's [UNK] and its [BOS]/[EOS] (not codons), and how many records held
    /// codons but no A/C/G/T one (all N): their vectors are of [UNK] states, said at the end.
    unk: (u32, [Option<u32>; 2]),
    unknown: usize,
    /// Records with no token at all, left out (id and source).
    empty: Vec<String>,
}

impl Pipeline<'_> {
    fn push(&mut self, p: TokenizedRecord) -> Result<()> {
        if p.tokens.is_empty() {
            // A dataset row of no codon (tokenize --drop-partial-codon of a record under 3
            // bases) has no vector: left out and named at the end, as score gives such a
            // record NA, instead of stopping the whole run.
            self.empty.push(format!("'{}' ({})", p.id, p.source));
            return Ok(());
        }
        let (unk, specials) = self.unk;
        let mut codons = p.tokens.iter().filter(|&&t| !specials.contains(&Some(t)));
        if codons.clone().next().is_some() && codons.all(|&t| t == unk) {
            self.unknown += 1;
        }
        let w = self.window.unwrap_or(p.tokens.len());
        self.pending_windows += p.tokens.len().div_ceil(w);
        self.pending_tokens += p.tokens.len();
        self.pending.push(p);
        if self.pending_windows >= GROUP_BATCHES.saturating_mul(self.opts.batch_size.max(1))
            || self.pending_tokens >= GROUP_TOKENS
        {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.batched {
            self.flush_batched()?;
        } else {
            for p in std::mem::take(&mut self.pending) {
                self.record(&p)?;
                self.tokens += p.tokens.len() as u64;
                self.bar.inc(1);
            }
        }
        self.pending.clear();
        self.pending_windows = 0;
        self.pending_tokens = 0;
        Ok(())
    }

    /// The pending records' windows batched together (one layer, consecutive windows).
    fn flush_batched(&mut self) -> Result<()> {
        let toks: Vec<&[u32]> = self.pending.iter().map(|p| p.tokens.as_slice()).collect();
        let layer = self.layers[0];
        let embs = embed_tokens(
            self.model,
            &toks,
            layer,
            self.opts.pool,
            self.window,
            self.opts.batch_size,
        )?;
        let Sink::Pooled(w) = &mut self.writer else {
            unreachable!("batched pooling writes pooled rows")
        };
        for (p, e) in self.pending.iter().zip(&embs) {
            w.push(&embedding_row(p, layer, e)?)?;
            self.tokens += p.tokens.len() as u64;
        }
        self.bar.inc(self.pending.len() as u64);
        Ok(())
    }

    /// One record through per-token states, one batch of windows at a time: written as they
    /// are, or pooled per layer (sums, or the last token's state).
    fn record(&mut self, p: &TokenizedRecord) -> Result<()> {
        let n = p.tokens.len();
        let w = self.window.unwrap_or(n);
        let stride = self.opts.stride.unwrap_or(w);
        let h = self.model.cfg.hidden_size;
        let (layers, pool, model) = (&self.layers, self.opts.pool, self.model);
        let mut sums = vec![vec![0f64; h]; layers.len()];
        let mut last = vec![Vec::new(); layers.len()];
        let writer = &mut self.writer;
        record_states_each(
            model,
            &p.tokens,
            layers,
            w,
            stride,
            self.opts.batch_size,
            &mut |run| match writer {
                Sink::Tokens(tw) => tw.push_run(&p.id, &p.tokens, layers[run.layer], &run),
                Sink::Pooled(_) => {
                    for row in run.states.chunks_exact(h) {
                        for (a, v) in sums[run.layer].iter_mut().zip(row) {
                            *a += *v as f64;
                        }
                    }
                    if run.end == n {
                        last[run.layer] = run.states[run.states.len() - h..].to_vec();
                    }
                    Ok(())
                }
            },
        )?;
        if let Sink::Pooled(pw) = &mut self.writer {
            for (li, &layer) in layers.iter().enumerate() {
                let e: Vec<f32> = match pool {
                    Pool::Last => std::mem::take(&mut last[li]),
                    _ => sums[li].iter().map(|v| (v / n as f64) as f32).collect(),
                };
                pw.push(&embedding_row(p, layer, &e)?)?;
            }
        }
        Ok(())
    }
}

/// `genslm embed`: embeds every record of `input` with the model in `model_dir` and writes
/// the rows to `out` (parquet, atomically).
pub fn embed_to_parquet(
    model_dir: &Path,
    input: &EmbedInput,
    out: &Path,
    opts: &EmbedOptions,
) -> Result<EmbedSummary> {
    let start = Instant::now();
    if opts.batch_size == 0 {
        return Err(Error::Invalid("--batch-size 0: must be at least 1".into()));
    }
    let model =
        load_model_dir(model_dir, &opts.compute.open()?)?.with_precision(opts.compute.precision);
    let mut layers = Vec::new();
    let mut asked: Vec<i64> = Vec::new();
    for &l in &opts.layers {
        let r = resolve_layer(l, model.cfg.num_layers)?;
        match layers.iter().position(|&x| x == r) {
            // Written once, in the place it was first asked for; said, since the file then
            // holds fewer layers than the flag lists (-1 and the layer count are one layer).
            Some(i) => eprintln!(
                "warning: --layers {l} names layer {r} again (as {}): its rows are written once",
                asked[i]
            ),
            None => {
                layers.push(r);
                asked.push(l);
            }
        }
    }
    if layers.is_empty() {
        return Err(Error::Invalid("--layers: name at least one layer".into()));
    }
    let w = resolve_window(&model, opts.seq_len, model_dir, "--seq-len")?;
    if let Some(st) = opts.stride.filter(|&st| st == 0 || st > w) {
        return Err(Error::Invalid(format!(
            "--stride {st}: must be between 1 and the window ({w} tokens)"
        )));
    }
    let window = Some(w);
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    // FASTA files are found (and noted as inputs) before the output is created, so an output
    // that is one of them is refused before any work.
    let mut fasta_files = Vec::new();
    let dataset = match input {
        EmbedInput::Parquet(p) => {
            let reader = DatasetReader::open(p, 64)?;
            if reader.vocab != model.cfg.vocab {
                return Err(Error::Invalid(format!(
                    "{}: tokenized with {}, but the model uses {}",
                    p.display(),
                    reader.vocab,
                    model.cfg.vocab
                )));
            }
            Some(reader)
        }
        EmbedInput::Fasta(paths) => {
            fasta_files = fasta::discover(paths)?;
            None
        }
    };
    let metadata = vec![
        ("genslm.model".into(), model_dir.display().to_string()),
        (
            "genslm.layer".into(),
            layers
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("genslm.pool".into(), opts.pool.name().into()),
        ("genslm.stride".into(), opts.stride.unwrap_or(w).to_string()),
        (
            "genslm.window".into(),
            window.map_or("whole records".into(), |w| w.to_string()),
        ),
    ];
    let writer = match opts.pool {
        Pool::None => Sink::Tokens(Box::new(TokenStateWriter::create(
            out,
            tok.clone(),
            model.cfg.hidden_size,
            metadata,
        )?)),
        _ => Sink::Pooled(Box::new(EmbeddingWriter::create(
            out,
            model.cfg.hidden_size,
            // FASTA input: MD5 of each record, as before; a dataset: the digest it carries.
            dataset.as_ref().map_or(DigestKind::Md5, |d| d.digest),
            metadata,
        )?)),
    };
    let batched = opts.pool != Pool::None && layers.len() == 1 && opts.stride.is_none();
    let mut pipe = Pipeline {
        model: &model,
        writer,
        opts,
        layers: layers.clone(),
        window,
        batched,
        pending: Vec::new(),
        pending_windows: 0,
        pending_tokens: 0,
        tokens: 0,
        unk: (tok.unk_id(), [tok.bos_id(), tok.eos_id()]),
        unknown: 0,
        empty: Vec::new(),
        bar: match dataset.as_ref() {
            Some(d) => crate::progress::bar(
                opts.progress,
                Some(d.num_rows),
                "embed {bar:40} {pos}/{len} records {per_sec} eta {eta}",
            ),
            None => crate::progress::bar(
                opts.progress,
                None,
                "embed {spinner} {pos} records {per_sec} {elapsed}",
            ),
        },
    };
    let mut records = 0u64;
    let mut duplicates = fasta::DuplicateIds::default();
    if let (Some(reader), EmbedInput::Parquet(path)) = (dataset, input) {
        for rec in reader {
            let r = rec?;
            if r.id.is_empty() {
                // As a FASTA record without an id: the rows could not be told apart.
                return Err(Error::Invalid(format!(
                    "{}: row {records} has an empty id (genslm tokenize refuses such records); \
                     give every record an id",
                    path.display()
                )));
            }
            // As tokenize refuses it in a FASTA header: the id is written into the output and
            // printed, and a terminal's escape sequence would act there.
            if let Some(c) = r.id.chars().find(|c| c.is_control()) {
                return Err(Error::Invalid(format!(
                    "{}: row {records}'s id '{}' holds a control character ({}); genslm \
                     tokenize refuses such ids: rename the record",
                    path.display(),
                    r.id.escape_debug(),
                    c.escape_unicode()
                )));
            }
            duplicates.see(&r.id);
            if let Some(&t) = r
                .tokens
                .iter()
                .find(|&&t| t as usize >= model.cfg.vocab_size)
            {
                return Err(Error::Invalid(format!(
                    "{}: record '{}' holds token id {t}, outside the model's vocabulary of {} \
                     ids; was this file tokenized for another model?",
                    path.display(),
                    crate::error::short_id(&r.id),
                    model.cfg.vocab_size
                )));
            }
            pipe.push(r)?;
            records += 1;
        }
    } else {
        for f in fasta_files {
            let source = f.display().to_string();
            let mut warn = |w: String| eprintln!("warning: {w}");
            fasta::read_file(&f, OnInvalid::Error, &mut warn, &mut |rec, _| {
                duplicates.see(rec.id);
                records += 1;
                pipe.push(TokenizedRecord {
                    id: rec.id.to_string(),
                    description: rec.description.to_string(),
                    source: source.clone(),
                    digest: hex(&Md5::digest(rec.seq)),
                    digest_kind: DigestKind::Md5,
                    length: rec.seq.len() as u64,
                    gc_content: rec.gc as f64 / rec.seq.len() as f64,
                    tokens: tok.encode(rec.seq),
                })
            })?;
        }
    }
    // Either input: a dataset's rows carry their FASTA's name in `source` too.
    if let Some(w) = duplicates.warning("the rows (with their source file) are written") {
        eprintln!("warning: {w}");
    }
    pipe.flush()?;
    if pipe.unknown > 0 {
        // As score says for the same records (which it leaves unscored): a vector of [UNK]
        // states is the model's answer to "nothing known", not to the sequence.
        eprintln!(
            "warning: {} record(s) hold no A/C/G/T codon (only N or other symbols): their \
             vectors are the model's states for [UNK] tokens, not for a sequence",
            pipe.unknown
        );
    }
    if !pipe.empty.is_empty() {
        eprintln!(
            "warning: {} record(s) hold no codon (shorter than 3 bases, tokenized with \
             --drop-partial-codon): no row written for {}",
            pipe.empty.len(),
            crate::error::first_five(&pipe.empty)
        );
    }
    let rows = pipe.writer.rows();
    if rows == 0 {
        return Err(Error::Invalid(format!(
            "no records to embed; nothing written to {}",
            out.display()
        )));
    }
    let tokens = pipe.tokens;
    pipe.bar.finish_and_clear();
    pipe.writer.finish()?;
    Ok(EmbedSummary {
        records,
        rows,
        tokens,
        dim: model.cfg.hidden_size,
        layers,
        window,
        elapsed: start.elapsed(),
    })
}
