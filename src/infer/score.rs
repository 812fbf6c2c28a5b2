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
use crate::model::GenSlm;
use crate::ops::primitive::{tensor_to_vec, tokens_tensor};
use crate::tokenizer::CodonTokenizer;

/// Records are scored in groups of about this many per batch slot...
const GROUP_BATCHES: usize = 4;
/// ... or when this many tokens are waiting.
const GROUP_TOKENS: usize = 1 << 18;

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
    let mut out = score_records(model, &[tokens], seq_len, stride, batch, top_k, full)?;
    Ok(out.pop().unwrap_or_default())
}

/// [`score_tokens_detailed`] of several records at once: their windows are sorted by length
/// and batched together, so many short records (genes, reads) share forward passes with little
/// padding instead of running one window at a time.
pub fn score_records(
    model: &GenSlm,
    records: &[&[u32]],
    seq_len: usize,
    stride: usize,
    batch: usize,
    top_k: usize,
    full: bool,
) -> Result<Vec<Vec<TokenScore>>> {
    let mut out: Vec<Vec<TokenScore>> = vec![Vec::new(); records.len()];
    let mut keep = |r: usize, scores: Vec<TokenScore>| {
        out[r].extend(scores);
        Ok(())
    };
    score_records_each(
        model, records, seq_len, stride, batch, top_k, full, &mut keep,
    )?;
    Ok(out)
}

/// [`score_records`], handing each window's scores to `each(record, scores)` as soon as they
/// exist (memory: one batch of windows). Windows run longest first; a record's windows still
/// arrive in order (all but its last have the full window's length, and ties go by position).
#[allow(clippy::too_many_arguments)]
pub fn score_records_each(
    model: &GenSlm,
    records: &[&[u32]],
    seq_len: usize,
    stride: usize,
    batch: usize,
    top_k: usize,
    full: bool,
    each: &mut dyn FnMut(usize, Vec<TokenScore>) -> Result<()>,
) -> Result<()> {
    let pad = CodonTokenizer::new(model.cfg.vocab)?.pad_id();
    let vocab = model.cfg.vocab_size;
    // (record, window); a record shorter than the window is one window of its own length:
    // padding it to `seq_len` would only cost memory.
    let mut windows = Vec::new();
    let mut longest = 0;
    for (r, tokens) in records.iter().enumerate() {
        let w = seq_len.min(tokens.len().max(2));
        for x in score_windows(tokens.len(), w, stride.min(w)) {
            longest = longest.max(x.len());
            windows.push((r, x));
        }
    }
    let batch = batch.max(1).min(windows.len().max(1));
    crate::infer::window::check_forward_memory(model, batch, longest.max(1), "--seq-len")?;
    windows.sort_by_key(|&(r, x)| (std::cmp::Reverse(x.len()), r, x.start));
    for group in windows.chunks(batch) {
        // The padding sits after each window's tokens, where a causal model cannot see it.
        let s = group.iter().map(|(_, x)| x.len()).max().unwrap_or(0);
        let mut ids = vec![pad; group.len() * s];
        for (i, (r, x)) in group.iter().enumerate() {
            ids[i * s..i * s + x.len()].copy_from_slice(&records[*r][x.start..x.end]);
        }
        let logits = model.forward(tokens_tensor(&ids, group.len(), s, &model.device), 0)?;
        let logits = tensor_to_vec(&logits);
        for (i, (r, x)) in group.iter().enumerate() {
            let rows = &logits[i * s * vocab..(i + 1) * s * vocab];
            each(*r, window_scores(x, records[*r], rows, vocab, top_k, full))?;
        }
    }
    Ok(())
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
    let seq_len = resolve_window(&model, opts.seq_len, model_dir, "--seq-len")?;
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
    // With --per-token the parquet file is an output too: a reader gone from the TSV is an
    // error there (the file is not written), not the quiet end of a `| head`.
    let per_token = writer.is_some();
    let werr = |e: std::io::Error| match per_token {
        false => Error::stdout_only("scores", e),
        true => Error::Invalid(format!(
            "writing scores: {e}; the --per-token file was not written (a file already \
             there is left as it was)"
        )),
    };
    let mut rows = Vec::new();
    let mut pending: Vec<(String, Vec<u32>)> = Vec::new();
    let mut pending_tokens = 0usize;
    // Scores the pending records together and writes them in input order.
    let mut flush = |pending: &mut Vec<(String, Vec<u32>)>,
                     rows: &mut Vec<Score>,
                     out: &mut dyn Write|
     -> Result<()> {
        let toks: Vec<&[u32]> = pending.iter().map(|(_, t)| t.as_slice()).collect();
        let ids: Vec<&str> = pending.iter().map(|(id, _)| id.as_str()).collect();
        // Per record: the summed NLL and the predicted tokens. A group's rows are held until
        // it is done (its tokens are bounded); a record longer than a group is a group of its
        // own, whose windows stream straight to the file.
        let mut sums = vec![(0.0f64, 0usize); toks.len()];
        let mut held: Vec<Vec<TokenScore>> = vec![Vec::new(); toks.len()];
        let streaming = toks.len() == 1;
        let mut each = |r: usize, scores: Vec<TokenScore>| -> Result<()> {
            // Weights that overflow in fp32 give NaN logits: no score, not a NaN row.
            if let Some(s) = scores.iter().find(|s| !s.log_prob.is_finite()) {
                return Err(Error::Invalid(format!(
                    "record '{}': token {}'s log-probability is {} (the model's outputs are not \
                     finite: do its weights overflow in fp32?)",
                    crate::error::short_id(ids[r]),
                    s.index,
                    s.log_prob
                )));
            }
            sums[r].0 += scores.iter().map(|x| -x.log_prob).sum::<f64>();
            sums[r].1 += scores.len();
            match writer.as_mut() {
                Some(w) if streaming => w.push(ids[r], &scores),
                Some(_) => {
                    held[r].extend(scores);
                    Ok(())
                }
                None => Ok(()),
            }
        };
        score_records_each(
            &model,
            &toks,
            seq_len,
            stride,
            opts.batch_size,
            top_k,
            full,
            &mut each,
        )?;
        for (r, &(sum, n)) in sums.iter().enumerate() {
            if let Some(w) = writer.as_mut().filter(|_| !streaming) {
                w.push(ids[r], &held[r])?;
            }
            let nll = if n == 0 { f64::NAN } else { sum / n as f64 };
            let row = Score {
                id: ids[r].to_string(),
                n_tokens: n,
                mean_nll: nll,
                perplexity: nll.exp(),
            };
            // The header comes with the first row, so that an error in the first record
            // leaves nothing on stdout.
            if rows.is_empty() {
                writeln!(out, "id\tn_tokens\tmean_nll\tperplexity").map_err(werr)?;
            }
            // A record of fewer than 2 codons has no token to predict: no score (NA, as pandas
            // and R read a missing value), not a NaN computed from nothing.
            if n == 0 {
                writeln!(out, "{}\t0\tNA\tNA", row.id).map_err(werr)?;
            } else {
                writeln!(
                    out,
                    "{}\t{}\t{:.6}\t{:.4}",
                    row.id, row.n_tokens, row.mean_nll, row.perplexity
                )
                .map_err(werr)?;
            }
            rows.push(row);
        }
        pending.clear();
        Ok(())
    };
    let (unk, specials) = (tok.unk_id(), [tok.bos_id(), tok.eos_id()]);
    let (mut unknown, mut duplicates) = (0usize, fasta::DuplicateIds::default());
    for f in &files {
        let mut warn = |w: String| eprintln!("warning: {w}");
        fasta::read_file(f, OnInvalid::Error, &mut warn, &mut |rec, _| {
            duplicates.see(rec.id);
            let mut tokens = tok.encode(rec.seq);
            // A record with no A/C/G/T codon (all N, or only a partial codon) is [UNK]
            // predicting [UNK]: nothing of the record is scored, so it gets NA, counted as
            // embed counts it (a genslm71 model scored `AC` as [BOS] [UNK] [EOS]).
            let mut codons = tokens.iter().filter(|&&t| !specials.contains(&Some(t)));
            if codons.clone().next().is_some() && codons.all(|&t| t == unk) {
                unknown += 1;
                tokens.clear();
            }
            if tokens.len() >= GROUP_TOKENS && !pending.is_empty() {
                flush(&mut pending, &mut rows, out)?;
                pending_tokens = 0;
            }
            pending_tokens += tokens.len();
            pending.push((rec.id.to_string(), tokens));
            // Enough windows to fill several batches, or a bounded number of tokens held.
            if pending.len() >= GROUP_BATCHES.saturating_mul(opts.batch_size)
                || pending_tokens >= GROUP_TOKENS
            {
                flush(&mut pending, &mut rows, out)?;
                pending_tokens = 0;
            }
            Ok(())
        })?;
    }
    flush(&mut pending, &mut rows, out)?;
    if rows.is_empty() {
        return Err(Error::Invalid("no records to score".into()));
    }
    let unscored = rows.iter().filter(|r| r.n_tokens == 0).count() - unknown;
    if unscored > 0 {
        eprintln!(
            "note: {unscored} record(s) shorter than 2 codons have no token to predict: \
             mean_nll and perplexity NA"
        );
    }
    if unknown > 0 {
        eprintln!(
            "note: {unknown} record(s) hold no A/C/G/T codon (only N or other symbols): not \
             scored, mean_nll and perplexity NA"
        );
    }
    if let Some(w) = duplicates.warning("the scores are listed") {
        eprintln!("warning: {w}");
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

    /// Records of different lengths scored together (windows sorted by length, padded into
    /// shared batches) give each record's scores as scoring it alone, one window at a time.
    #[test]
    fn records_batched_together_score_as_alone() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let model = GenSlm::init(Config::load(&path).unwrap().model, 4, &Device::flex()).unwrap();
        let recs: Vec<Vec<u32>> = [3usize, 30, 11, 2, 17]
            .iter()
            .map(|&n| {
                (0..n as u32)
                    .map(|i| 5 + (i * 19 + n as u32) % 64)
                    .collect()
            })
            .collect();
        let refs: Vec<&[u32]> = recs.iter().map(Vec::as_slice).collect();
        for (w, s) in [(8, 8), (8, 3)] {
            let together = score_records(&model, &refs, w, s, 4, 2, false).unwrap();
            for (r, t) in refs.iter().zip(&together) {
                let alone = score_tokens_detailed(&model, r, w, s, 1, 2, false).unwrap();
                assert_eq!(t.len(), alone.len());
                for (a, b) in t.iter().zip(&alone) {
                    assert_eq!((a.index, a.context, a.rank), (b.index, b.context, b.rank));
                    assert!((a.log_prob - b.log_prob).abs() < 1e-5);
                }
            }
        }
    }
}
