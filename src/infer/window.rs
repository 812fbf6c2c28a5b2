//! The window `score` and `embed` cut records into: one rule for both.
//!
//! `--seq-len` when given; otherwise the window the model was trained with (`genslm.toml`
//! beside a genslm checkpoint), else its `max_position_embeddings`. Rotary and learned models
//! are capped at `max_position_embeddings` by default; learned ones refuse a longer window
//! (they have no positions past it). ALiBi models extrapolate, so a longer `--seq-len` is
//! taken as asked, but the default stays bounded: one window of a whole chromosome would need
//! memory quadratic in its length for the naive kernel and hours for any.

use std::path::Path;

use crate::config::Position;
use crate::error::{Error, Result};
use crate::model::GenSlm;

/// The window for `model` loaded from `model_dir` (see the module docs).
pub fn resolve_window(model: &GenSlm, seq_len: Option<usize>, model_dir: &Path) -> Result<usize> {
    let max = model.cfg.max_position_embeddings;
    match seq_len {
        Some(s) if s < 2 => Err(Error::Invalid(format!("--seq-len {s}: must be at least 2"))),
        Some(s) if s > max && model.cfg.position == Position::Learned => {
            Err(Error::Invalid(format!(
                "--seq-len {s}: this model uses learned positions and knows only {max} of them \
                 (ALiBi models can take longer windows)"
            )))
        }
        Some(s) => Ok(s),
        None => {
            let w = trained_window(model_dir)?
                .filter(|&t| t >= 2)
                .unwrap_or(max);
            Ok(if model.cfg.position == Position::Alibi {
                w
            } else {
                w.min(max)
            })
        }
    }
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
