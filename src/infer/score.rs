//! `genslm score`: per-record mean negative log-likelihood and perplexity, and with
//! `--per-token` every predicted codon's log-probability, entropy, rank and top-k.
//!
//! Each record is cut into windows of `seq_len` tokens, `stride` apart (default: `seq_len`,
//! consecutive windows as in training; see [`crate::infer::token_scores`] for the rule and
//! the context every token keeps). The record's score is the mean over its predicted tokens
//! (nats/token); perplexity is its exponential.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::backend::Compute;
use crate::data::fasta::{self, OnInvalid};
use crate::error::{Error, Result};
use crate::infer::score_io::TokenScoreWriter;
use crate::infer::token_scores::{score_windows, window_scores, TokenScore};
use crate::infer::window::resolve_window;
use crate::model::io::load_model_dir;
use crate::model::neox::{tensor_to_vec, tokens_tensor};
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

/// How `score` cuts and reports.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreOptions {
    /// Window in tokens (None: [`resolve_window`]'s default).
    pub seq_len: Option<usize>,
    /// Tokens between window starts (None: the window, i.e. consecutive windows).
    pub stride: Option<usize>,
    /// Windows per forward pass.
    pub batch_size: usize,
    /// Write one row per predicted token to this parquet file.
    pub per_token: Option<PathBuf>,
    /// Most likely tokens listed per position in the per-token file.
    pub top_k: usize,
    /// Add every vocabulary id's log-probability to the per-token file.
    pub full_distribution: bool,
    pub compute: Compute,
}

impl Default for ScoreOptions {
    fn default() -> Self {
        Self {
            seq_len: None,
            stride: None,
            batch_size: 4,
            per_token: None,
            top_k: 5,
            full_distribution: false,
            compute: Compute::default(),
        }
    }
}

/// The per-token scores of one token sequence under `model`: windows of `seq_len`, `stride`
/// apart, `batch` windows per forward pass. `top_k` and `full` say what each row lists.
pub fn score_tokens_detailed(
    model: &GenSlm,
    tokens: &[u32],
    seq_len: usize,
    stride: usize,
    batch: usize,
    top_k: usize,
    full: bool,
) -> Result<Vec<TokenScore>> {
    let pad = CodonTokenizer::new(model.cfg.vocab)?.pad_id();
    let vocab = model.cfg.vocab_size;
    // A record shorter than the window is one window of its own length: padding it to
    // `seq_len` would only cost memory (a huge --seq-len must not allocate for nothing).
    let w = seq_len.min(tokens.len().max(2));
    let windows = score_windows(tokens.len(), w, stride.min(w));
    let batch = batch.max(1).min(windows.len().max(1));
    crate::infer::window::check_forward_memory(model, batch, w)?;
    let mut out = Vec::new();
    for group in windows.chunks(batch) {
        // Windows of a group share a length except a record's last; the padding sits after
        // each window's tokens, where a causal model cannot see it.
        let s = group.iter().map(|x| x.len()).max().unwrap_or(0);
        let mut ids = vec![pad; group.len() * s];
        for (r, x) in group.iter().enumerate() {
            ids[r * s..r * s + x.len()].copy_from_slice(&tokens[x.start..x.end]);
        }
        let logits = model.forward(tokens_tensor(&ids, group.len(), s, &model.device), 0)?;
        let logits = tensor_to_vec(&logits);
        for (r, x) in group.iter().enumerate() {
            let rows = &logits[r * s * vocab..(r + 1) * s * vocab];
            out.extend(window_scores(x, tokens, rows, vocab, top_k, full));
        }
    }
    Ok(out)
}

/// Mean NLL of one token sequence under `model`, in consecutive windows of `seq_len`, and
/// the number of predicted tokens.
pub fn score_tokens(
    model: &GenSlm,
    tokens: &[u32],
    seq_len: usize,
    batch: usize,
) -> Result<(f64, usize)> {
    let scores = score_tokens_detailed(model, tokens, seq_len, seq_len, batch, 0, false)?;
    Ok(mean_nll(&scores))
}

fn mean_nll(scores: &[TokenScore]) -> (f64, usize) {
    let n = scores.len();
    let sum: f64 = scores.iter().map(|s| -s.log_prob).sum();
    (if n == 0 { f64::NAN } else { sum / n as f64 }, n)
}

/// Scores every record of `inputs`, writing TSV (`id n_tokens mean_nll perplexity`) to `out`
/// and, with `opts.per_token`, one parquet row per predicted token.
pub fn score_fasta(
    model_dir: &Path,
    inputs: &[PathBuf],
    opts: &ScoreOptions,
    out: &mut dyn Write,
) -> Result<Vec<Score>> {
    if opts.batch_size == 0 {
        return Err(Error::Invalid("--batch-size 0: must be at least 1".into()));
    }
    let model =
        load_model_dir(model_dir, &opts.compute.open()?)?.with_precision(opts.compute.precision);
    let seq_len = resolve_window(&model, opts.seq_len, model_dir)?;
    let stride = match opts.stride {
        None => seq_len,
        Some(s) if s == 0 || s > seq_len => {
            return Err(Error::Invalid(format!(
                "--stride {s}: must be between 1 and the window ({seq_len} tokens); a stride \
                 S keeps {seq_len} − S tokens of left context for every scored token"
            )))
        }
        Some(s) => s,
    };
    let vocab = model.cfg.vocab_size;
    if opts.top_k > vocab {
        return Err(Error::Invalid(format!(
            "--top-k {}: the model has only {vocab} tokens",
            opts.top_k
        )));
    }
    if opts.per_token.is_none() && opts.full_distribution {
        return Err(Error::Invalid(
            "--full-distribution adds a column to the --per-token file: give --per-token FILE"
                .into(),
        ));
    }
    let tok = CodonTokenizer::new(model.cfg.vocab)?;
    let files = fasta::discover(inputs)?;
    let mut writer = match &opts.per_token {
        Some(path) => Some(TokenScoreWriter::create(
            path,
            tok.clone(),
            opts.top_k,
            opts.full_distribution.then_some(vocab),
            vec![
                ("genslm.model".into(), model_dir.display().to_string()),
                ("genslm.window".into(), seq_len.to_string()),
                ("genslm.stride".into(), stride.to_string()),
                ("genslm.vocab".into(), model.cfg.vocab.to_string()),
            ],
        )?),
        None => None,
    };
    let (top_k, full) = match writer {
        Some(_) => (opts.top_k, opts.full_distribution),
        None => (0, false),
    };
    let werr = |e| Error::Invalid(format!("writing scores: {e}"));
    writeln!(out, "id\tn_tokens\tmean_nll\tperplexity").map_err(werr)?;
    let mut rows = Vec::new();
    for f in &files {
        let mut warn = |w: String| eprintln!("warning: {w}");
        fasta::read_file(f, OnInvalid::Error, &mut warn, &mut |rec, _| {
            let tokens = tok.encode(rec.seq);
            let scores = score_tokens_detailed(
                &model,
                &tokens,
                seq_len,
                stride,
                opts.batch_size,
                top_k,
                full,
            )?;
            if let Some(w) = writer.as_mut() {
                w.push(rec.id, &scores)?;
            }
            let (nll, n) = mean_nll(&scores);
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
    if let Some(w) = writer {
        w.finish()?;
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::tensor::Device;

    use super::*;
    use crate::config::{Config, Position};

    /// Brute force: every scored token recomputed on its own, from a forward pass over exactly
    /// the context the module docs state (`[k·S, t)` for the first window whose end passes
    /// t), with a naive f64 log-softmax of the last position's logits.
    #[test]
    fn strided_scores_equal_a_per_token_recomputation() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        for pos in [Position::Rotary, Position::Alibi] {
            let mut cfg = Config::load(&path).unwrap().model;
            cfg.position = pos;
            let model = GenSlm::init(cfg, 11, &Device::flex()).unwrap();
            let ids: Vec<u32> = (0..37u32).map(|i| 5 + (i * 29 + 3) % 64).collect();
            for (w, s, batch) in [(12, 5, 3), (12, 12, 2), (8, 1, 4), (64, 7, 1)] {
                let got = score_tokens_detailed(&model, &ids, w, s, batch, 3, false).unwrap();
                let w = w.min(ids.len());
                let mut expect = Vec::new();
                for t in 1..ids.len() {
                    // The first window (start k·S) whose end k·S + W passes t.
                    let k = (t + 1).saturating_sub(w).div_ceil(s);
                    let start = k * s;
                    if start == t {
                        continue; // no context (S = W): not predicted
                    }
                    let ctx = &ids[start..t];
                    let logits = model
                        .forward(tokens_tensor(ctx, 1, ctx.len(), &model.device), 0)
                        .unwrap();
                    let v = tensor_to_vec(&logits);
                    let vocab = model.cfg.vocab_size;
                    let last = &v[(ctx.len() - 1) * vocab..ctx.len() * vocab];
                    let lse = last.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
                    expect.push((t, t - start, last[ids[t] as usize] as f64 - lse));
                }
                assert_eq!(got.len(), expect.len(), "{pos:?} w {w} s {s}");
                for (g, (t, ctx, lp)) in got.iter().zip(expect) {
                    assert_eq!((g.index, g.context), (t, ctx), "{pos:?} w {w} s {s}");
                    assert!(
                        (g.log_prob - lp).abs() < 1e-4,
                        "{pos:?} w {w} s {s} token {t}: {} vs {lp}",
                        g.log_prob
                    );
                }
            }
        }
    }
}
