//! `genslm score`: per-record mean negative log-likelihood and perplexity.
//!
//! Each record is cut into consecutive windows of `seq_len` tokens; every token after the first
//! of its window is predicted from the tokens before it in the window. The record's score is the
//! mean over all predicted tokens (nats/token); perplexity is its exponential.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::backend::Compute;
use crate::data::fasta::{self, OnInvalid};
use crate::data::loader::Corpus;
use crate::error::{Error, Result};
use crate::infer::window::resolve_window;
use crate::model::io::load_model_dir;
use crate::model::neox::{next_token_nll, tensor_to_vec, tokens_tensor};
use crate::model::GenSlm;
use crate::tokenizer::CodonTokenizer;

/// One output row.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    pub id: String,
    /// Predicted tokens.
    pub n_tokens: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
}

/// Mean NLL of one token sequence under `model`, in windows of `seq_len`.
pub fn score_tokens(
    model: &GenSlm,
    tokens: &[u32],
    seq_len: usize,
    batch: usize,
) -> Result<(f64, usize)> {
    let pad = CodonTokenizer::new(model.cfg.vocab)?.pad_id();
    // A record shorter than the window is one window of its own length: padding it to
    // `seq_len` would only cost memory (a huge --seq-len must not allocate for nothing).
    let seq_len = seq_len.min(tokens.len().max(2));
    let corpus = Corpus {
        records: vec![tokens.to_vec()],
        seq_len,
        pad_id: pad,
        train: crate::data::loader::windows(&[tokens.to_vec()], seq_len),
        val: Vec::new(),
        fingerprint: String::new(),
    };
    crate::infer::window::check_forward_memory(
        model,
        batch.max(1).min(corpus.train.len()),
        seq_len,
    )?;
    let (mut sum, mut n) = (0.0, 0usize);
    for ws in corpus.train.chunks(batch.max(1)) {
        let b = corpus.batch_of(ws);
        let logits = model.forward(
            tokens_tensor(&b.tokens, b.batch, b.seq_len, &model.device),
            0,
        )?;
        let (s, k) = next_token_nll(logits, &b.tokens, &b.mask, b.batch, b.seq_len);
        sum += tensor_to_vec(&s)[0] as f64;
        n += k;
    }
    Ok((if n == 0 { f64::NAN } else { sum / n as f64 }, n))
}

/// Scores every record of `inputs`, writing TSV (`id n_tokens mean_nll perplexity`) to `out`.
pub fn score_fasta(
    model_dir: &Path,
    inputs: &[PathBuf],
    seq_len: Option<usize>,
    batch: usize,
    compute: &Compute,
    out: &mut dyn Write,
) -> Result<Vec<Score>> {
    let model = load_model_dir(model_dir, &compute.open()?)?.with_precision(compute.precision);
    let seq_len = resolve_window(&model, seq_len, model_dir)?;
    if batch == 0 {
        return Err(Error::Invalid("--batch-size 0: must be at least 1".into()));
    }
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    let files = fasta::discover(inputs)?;
    let werr = |e| Error::Invalid(format!("writing scores: {e}"));
    writeln!(out, "id\tn_tokens\tmean_nll\tperplexity").map_err(werr)?;
    let mut rows = Vec::new();
    for f in &files {
        let mut warn = |w: String| eprintln!("warning: {w}");
        fasta::read_file(f, OnInvalid::Error, &mut warn, &mut |rec, _| {
            let tokens = tok.encode(rec.seq);
            let (nll, n) = score_tokens(&model, &tokens, seq_len, batch)?;
            let row = Score {
                id: rec.id.to_string(),
                n_tokens: n,
                mean_nll: nll,
                perplexity: nll.exp(),
            };
            writeln!(
                out,
                "{}\t{}\t{:.6}\t{:.4}",
                row.id, row.n_tokens, row.mean_nll, row.perplexity
            )
            .map_err(werr)?;
            rows.push(row);
            Ok(())
        })?;
    }
    if rows.is_empty() {
        return Err(Error::Invalid("no records to score".into()));
    }
    Ok(rows)
}
