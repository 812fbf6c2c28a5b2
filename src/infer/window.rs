//! The window `score` and `embed` cut records into: one rule for both.
//!
//! `--seq-len` when given; otherwise the window the model was trained with (`genslm.toml`
//! beside a genslm checkpoint), else its `max_position_embeddings`. Learned models are capped
//! at `max_position_embeddings` and refuse a longer window (they have no positions past it);
//! a rotary model trained at a longer window than its `max_position_embeddings` scores at the
//! window it trained at, and is warned about only past both. ALiBi models extrapolate, so a
//! longer `--seq-len` is taken as asked, but the default stays bounded: one window of a whole
//! chromosome would need memory quadratic in its length for the naive kernel and hours for
//! any.

use std::path::Path;

use crate::config::Position;
use crate::error::{Error, Result};
use crate::model::GenSlm;

/// The window for `model` loaded from `model_dir` (see the module docs), asked for by `flag`
/// (`--seq-len`, or variants' `--window`) when `seq_len` is given.
pub fn resolve_window(
    model: &GenSlm,
    seq_len: Option<usize>,
    model_dir: &Path,
    flag: &str,
) -> Result<usize> {
    let max = model.cfg.max_position_embeddings;
    match seq_len {
        Some(s) if s < 2 => Err(Error::Invalid(format!("{flag} {s}: must be at least 2"))),
        Some(s) if s > max && model.cfg.position == Position::Learned => {
            Err(Error::Invalid(format!(
                "{flag} {s}: this model uses learned positions and knows only {max} of them \
                 (ALiBi models can take longer windows)"
            )))
        }
        Some(s) => {
            let known = training_length(model, model_dir);
            if s > known && model.cfg.position == Position::Rotary {
                // As `generate` says for --max-codons: the window is taken, not hidden.
                eprintln!(
                    "warning: {flag} {s} goes past the model's training length ({known}: its \
                     max_position_embeddings or the window it trained at); rotary models are \
                     untested beyond it"
                );
            }
            Ok(s)
        }
        None => {
            let w = trained_window(model_dir)?
                .filter(|&t| t >= 2)
                .unwrap_or(max);
            // A rotary model trained past its max_position_embeddings scores at the window it
            // trained at (it was cut to the smaller, and warned at the trained one).
            let w = if model.cfg.position == Position::Learned {
                w.min(max)
            } else {
                w
            };
            if w < 2 {
                // One codon a window predicts nothing: every record would score NA.
                return Err(Error::Invalid(format!(
                    "the model's default window is {w} codon(s) (max_position_embeddings {max}): \
                     nothing to predict; pass {flag} of at least 2{}",
                    if model.cfg.position == Position::Learned {
                        " (a learned-position model knows no more positions than its table)"
                    } else {
                        ""
                    }
                )));
            }
            Ok(w)
        }
    }
}

/// The longest window `model` is known to take: its max_position_embeddings, or the window it
/// trained at when longer (known good, whatever the table says; a window the file cannot give
/// is only not known, and no warning hangs on it). Past it, rotary scores extrapolate.
pub fn training_length(model: &GenSlm, model_dir: &Path) -> usize {
    let trained = trained_window(model_dir).ok().flatten().unwrap_or(0);
    trained.max(model.cfg.max_position_embeddings)
}

/// The training window recorded beside a genslm checkpoint (`genslm.toml`), if there is one.
/// A `genslm.toml` that exists but does not parse is an error, not a silent fallback to
/// another window.
pub fn trained_window(model_dir: &Path) -> Result<Option<usize>> {
    let Ok(dir) = crate::model::io::resolve_model_dir(model_dir) else {
        return Ok(None);
    };
    let file = dir.join(crate::train::checkpoint::GENSLM_CONFIG_FILE);
    if !file.exists() {
        return Ok(None);
    }
    // The window changes every score: the file must be the one the checkpoint was saved with.
    crate::checksum::verify(&dir, &[crate::train::checkpoint::GENSLM_CONFIG_FILE])?;
    let cfg = crate::config::Config::load(&file).map_err(|e| {
        Error::Invalid(format!(
            "{e} (the training settings beside the model, which give the default window; \
             fix or remove the file, or pass --seq-len)"
        ))
    })?;
    Ok(Some(cfg.train.seq_len))
}

/// Refuses, on the CPU, a forward pass over `rows` windows of `tokens` that cannot fit in the
/// memory available, with the figures, instead of an allocation that aborts the process.
/// Without autograd a forward keeps about one layer's activations (the residual, Q/K/V, the
/// attention output and the MLP's 4h twice: ~16 floats per token and hidden unit), the logits,
/// and with naive attention the scores and probabilities of every head (s² each). GPU memory
/// is the device's, not read here.
/// `window_flag` is the flag that sets `tokens` (`--seq-len`; variants' `--window`).
pub fn check_forward_memory(
    model: &GenSlm,
    rows: usize,
    tokens: usize,
    window_flag: &str,
) -> Result<()> {
    let Some(available) = cpu_memory_available(model) else {
        return Ok(());
    };
    let need = forward_bytes(&model.cfg, rows, tokens);
    if need <= available {
        return Ok(());
    }
    let gib = |x: f64| x / f64::from(1u32 << 30);
    Err(Error::Invalid(format!(
        "a batch of {rows} window(s) of {tokens} tokens needs about {:.1} GiB, more than the \
         {:.1} GiB available here; lower {window_flag}{} or --batch-size",
        gib(need),
        gib(available),
        if window_flag == "--seq-len" {
            " (a record longer than it is read in several windows)"
        } else {
            ""
        }
    )))
}

/// Bytes a forward pass over `rows` windows of `tokens` holds at its peak (see
/// [`check_forward_memory`]).
pub fn forward_bytes(c: &crate::config::ModelConfig, rows: usize, tokens: usize) -> f64 {
    let (b, s) = (rows as f64, tokens as f64);
    let mut need = 4.0 * b * s * (16.0 * c.hidden_size as f64 + c.vocab_size as f64);
    // Flash attention's keys, laid out in panels of 64 rows per head: a window of 3 tokens
    // takes a whole panel (16 KB at tiny's 4 heads; a million short records in one batch
    // asked 16 GB in one allocation, and the process aborted).
    let head_dim = c.hidden_size / c.num_heads.max(1);
    let panel = crate::ops::tile::PANEL as f64;
    need += 4.0 * b * c.num_heads as f64 * (s / panel).ceil() * panel * head_dim as f64;
    if c.attention == crate::config::AttentionKind::Naive {
        need += 4.0 * 2.0 * b * c.num_heads as f64 * s * s;
    }
    need
}

/// The memory available to a model on the CPU; `None` on a GPU (its memory is the device's,
/// not read here) or where it cannot be read, when inference's memory checks are skipped.
pub fn cpu_memory_available(model: &GenSlm) -> Option<f64> {
    let on_cpu = matches!(
        model.device.as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    );
    crate::host_memory::available_bytes().filter(|_| on_cpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of short windows costs at least its keys' padded panels (64 rows per head,
    /// whatever the window's length): a million 3-token windows of tiny's 4 heads of 16 dims
    /// are 16 GB, which the check missed before the allocation aborted.
    #[test]
    fn short_windows_cost_their_padded_key_panels() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let c = crate::config::Config::load(&path).unwrap().model;
        let head_dim = c.hidden_size / c.num_heads;
        let panels = 4.0 * 1e6 * c.num_heads as f64 * 64.0 * head_dim as f64;
        assert!(
            (panels - 16.384e9).abs() < 1.0,
            "tiny's shape changed: {panels}"
        );
        let acts = 4.0 * 1e6 * 3.0 * (16.0 * c.hidden_size as f64 + c.vocab_size as f64);
        let need = forward_bytes(&c, 1_000_000, 3);
        assert!(
            (need - (acts + panels)).abs() < 1.0,
            "{need} vs {acts} + {panels}"
        );
        // A long window's own activations still dominate, panels padded by under one panel.
        let long = forward_bytes(&c, 1, 4096);
        let own = 4.0 * 4096.0 * (16.0 * c.hidden_size as f64 + c.vocab_size as f64);
        assert!(long >= own && long < 1.2 * own, "{long} vs {own}");
    }
}
