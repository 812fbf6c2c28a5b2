//! What `--resume` may change, and how it knows the data is the same.
//!
//! A resumed run continues the checkpoint's loss curve only if the model, the data and the
//! settings that shape the curve are the same. Each setting is one of three kinds:
//! - **refused** when changed (the run stops before writing anything, listing every change):
//!   the whole model shape (every `[model]` field but `attention`), `seq_len`, `batch_size`,
//!   `grad_accum`, `seed`, `lr`, `warmup`, `min_lr_ratio`, `val_fraction`, and AdamW's
//!   `beta1`, `beta2`, `eps` (the saved moments are averages under those);
//! - **applied, with a note** on stderr, from the first resumed step on: `steps` (a run is
//!   extended, or shortened to no fewer steps than it has done: steps after the resume point
//!   take the learning rate of the schedule for the new total, those before keep theirs),
//!   `weight_decay`,
//!   `max_grad_norm`, `attention` (flash and naive compute the same function), `zero`,
//!   `checkpoint_activations`, `skip_nonfinite`, `max_consecutive_skips`, `val_every`, `checkpoint_every`, `keep_checkpoints`,
//!   `reduce_bucket_size`, `rank_timeout_s`, `precision` (the master weights and moments are
//!   fp32 either way), `pp_schedule`, `pp_virtual`, `pp_layers`, `megatron_sp`, `overlap`,
//!   `prefetch_layers`, `quantize_weights`, `quantize_grads`, `offload` (checkpoints do not depend on the layout);
//! - the **data**: the checkpoint stores a fingerprint of the tokenized training records; a
//!   resume whose data differs is refused. `RUN/data.parquet` is reused when the FASTA inputs
//!   are unchanged (same files, sizes and modification times, recorded in
//!   `RUN/data.sources.json`).

use std::path::{Path, PathBuf};

use md5::{Digest, Md5};

use crate::config::{Config, ModelConfig, TrainConfig};
use crate::error::{Error, Result};
use crate::train::checkpoint::{Saved, TrainerState, GENSLM_CONFIG_FILE, STATE_FILE};

/// Compares the settings of a resume with the checkpoint's. Returns the notes for the changes
/// that are applied; refuses (naming every refused setting) otherwise.
pub fn check_resume(saved: &Saved, cfg: &Config) -> Result<Vec<String>> {
    check_saved_settings(&saved.state, &saved.dir)?;
    let (mut refused, mut applied) = (Vec::new(), Vec::new());
    let old = &saved.state.train;
    let new = &cfg.train;
    macro_rules! cmp {
        ($list:ident, $a:expr, $b:expr, $($f:ident),*) => {$(
            if $a.$f != $b.$f {
                $list.push(format!(
                    "{} (checkpoint {}, now {})",
                    stringify!($f),
                    shown(&$a.$f),
                    shown(&$b.$f)
                ));
            }
        )*};
    }
    cmp!(
        refused,
        old,
        new,
        seq_len,
        batch_size,
        grad_accum,
        seed,
        lr,
        warmup,
        min_lr_ratio,
        val_fraction,
        beta1,
        beta2,
        eps
    );
    cmp!(
        applied,
        old,
        new,
        weight_decay,
        max_grad_norm,
        zero,
        checkpoint_activations,
        skip_nonfinite,
        max_consecutive_skips,
        val_every,
        checkpoint_every,
        keep_checkpoints,
        reduce_bucket_size,
        rank_timeout_s,
        precision,
        pp_schedule,
        pp_virtual,
        pp_layers,
        megatron_sp,
        overlap,
        prefetch_layers,
        quantize_weights,
        quantize_grads,
        offload
    );
    // A different length extends (or shortens) the run: the schedule is recomputed for the
    // new total from the next step on. A total the run has reached is the flag's fault, said
    // before the note on the schedule (check_state's refusal named trainer_state.json, as if
    // the file were forged).
    let done = saved.state.step;
    if new.steps <= done && done <= old.steps {
        return Err(Error::Invalid(format!(
            "--steps {}: this run has done {done} steps (checkpoint {}); pass a larger --steps \
             with --resume to go on",
            new.steps,
            saved.dir.display()
        )));
    }
    if old.steps != new.steps {
        applied.push(format!(
            "steps (checkpoint {}, now {}): the learning-rate schedule is recomputed for a run \
             of {} steps",
            old.steps, new.steps, new.steps
        ));
    }
    match &saved.config {
        Some(c) => {
            let (a, b): (&ModelConfig, &ModelConfig) = (&c.model, &cfg.model);
            cmp!(
                refused,
                a,
                b,
                name,
                num_layers,
                hidden_size,
                num_heads,
                intermediate_size,
                vocab,
                vocab_size,
                max_position_embeddings,
                position,
                rotary_pct,
                rotary_base,
                layer_norm_eps
            );
            cmp!(applied, a, b, attention);
        }
        None => refused.push(format!(
            "the model (no {GENSLM_CONFIG_FILE} in {} to compare with)",
            saved.dir.display()
        )),
    }
    if !refused.is_empty() {
        return Err(Error::Invalid(format!(
            "cannot resume from {}: settings differ from the checkpoint: {}. Use the \
             checkpoint's settings, or start a new run directory",
            saved.dir.display(),
            refused.join(", ")
        )));
    }
    Ok(applied
        .into_iter()
        .map(|a| format!("resume: {a}: the new value applies from the next step"))
        .collect())
}

/// Refuses saved settings no run can have: the file was edited. (They are compared with the
/// run's by `check_resume` and then replaced by them, so without this the comparison's notes
/// would report impossible values as if they had trained.)
fn check_saved_settings(s: &TrainerState, dir: &Path) -> Result<()> {
    let file = dir.join(STATE_FILE);
    let bad = |why: String| Err(Error::Invalid(format!("{}: {why}", file.display())));
    if let Err(why) = s.train.validate() {
        return bad(format!("saved `train` settings: {why} (edited?)"));
    }
    let own = crate::train::optim::AdamWConfig::of(&s.train);
    if s.adamw != own {
        let show = |c: &crate::train::optim::AdamWConfig| {
            format!(
                "beta1 {}, beta2 {}, eps {}, weight_decay {}",
                c.beta1, c.beta2, c.eps, c.weight_decay
            )
        };
        return bad(format!(
            "saved `adamw` ({}) differs from its own `train` settings ({}) (edited?)",
            show(&s.adamw),
            show(&own)
        ));
    }
    Ok(())
}

/// A setting as the config file writes it: `fp32`, `1f1b`, `none` (the notes printed Rust's
/// `Some(Fp32)` and `OneFOneB`).
fn shown<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Null) => "not set".into(),
        Ok(other) => other.to_string(),
        Err(_) => "?".into(),
    }
}

/// Refuses a trainer state that cannot belong to this run (hand-edited or foreign): its step
/// must lie within the run, and the data position and optimizer count must agree with it.
pub fn check_state(s: &TrainerState, t: &TrainConfig, dir: &Path) -> Result<()> {
    let file = dir.join(STATE_FILE);
    let bad = |why: String| Err(Error::Invalid(format!("{}: {why}", file.display())));
    if s.step == 0 || s.step > t.steps {
        return bad(format!(
            "step {} is outside this run of {} steps (1..={})",
            s.step, t.steps, t.steps
        ));
    }
    if s.step == t.steps {
        return bad(format!(
            "the run already finished all {} steps; pass a larger --steps with --resume to \
             extend it",
            t.steps
        ));
    }
    let windows = (t.batch_size as u64)
        .checked_mul(t.grad_accum as u64)
        .and_then(|w| w.checked_mul(s.step));
    if windows != Some(s.loader_cursor) {
        return bad(format!(
            "data position {} does not match step {} ({} windows per step)",
            s.loader_cursor,
            s.step,
            t.batch_size * t.grad_accum
        ));
    }
    if s.optimizer_step > s.step {
        return bad(format!(
            "optimizer step {} is past the training step {}",
            s.optimizer_step, s.step
        ));
    }
    Ok(())
}

/// Refuses a resume whose training data is not the checkpoint's.
/// `source` says where the data came from, for the message. A checkpoint that records no
/// fingerprint (written before genslm kept one, or edited) cannot be checked: the resume goes
/// on, with the warning returned here.
pub fn check_data(saved: &Saved, fingerprint: &str, source: &str) -> Result<Option<String>> {
    match &saved.state.data_fingerprint {
        Some(f) if f != fingerprint => Err(Error::Invalid(format!(
            "cannot resume from {}: the training data differs from the checkpoint's ({source} \
             gives fingerprint {fingerprint}, the checkpoint was trained on {f}); resume with \
             the same FASTA/parquet input, or start a new run directory",
            saved.dir.display(),
        ))),
        Some(_) => Ok(None),
        None => Ok(Some(format!(
            "{}: the checkpoint records no fingerprint of its training data, so {source} cannot \
             be checked against it; the resume is exact only if the data is the same",
            saved.dir.display()
        ))),
    }
}

/// A fingerprint of tokenized records: MD5 over each record's length and token ids, in order.
pub fn fingerprint(records: &[Vec<u32>]) -> String {
    let mut h = Md5::new();
    for r in records {
        h.update((r.len() as u64).to_le_bytes());
        for t in r {
            h.update(t.to_le_bytes());
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What identifies a set of FASTA inputs without reading them: each discovered file's path,
/// size and modification time, and the vocabulary they were tokenized with.
pub fn fasta_stamp(files: &[PathBuf], vocab: &str) -> Result<String> {
    let mut out = format!("vocab {vocab}\n");
    for f in files {
        let m = std::fs::metadata(f).map_err(|e| Error::io(f, e))?;
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let path = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        out.push_str(&format!("{}\t{}\t{mtime}\n", path.display(), m.len()));
    }
    Ok(out)
}

/// Refuses a checkpoint whose `config.json` (the shape its weights are loaded with) describes
/// another model than the run's settings, which `check_resume` compared with `genslm.toml`:
/// an edit to one file that the manifest was recomputed for went on training with, say,
/// `layer_norm_eps` 1.0 under a genslm.toml saying 1e-5.
pub fn check_weights_config(saved: &ModelConfig, run: &ModelConfig, dir: &Path) -> Result<()> {
    let (Ok(a), Ok(b)) = (serde_json::to_value(saved), serde_json::to_value(run)) else {
        return Ok(());
    };
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return Ok(());
    };
    let differ: Vec<String> = a
        .iter()
        .filter(|(k, v)| k.as_str() != "name" && b.get(k.as_str()) != Some(v))
        .map(|(k, v)| {
            format!(
                "{k} {v} against {}",
                b.get(k.as_str()).unwrap_or(&serde_json::Value::Null)
            )
        })
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "cannot resume from {}: its config.json describes another model than the run's \
         config ({}); the checkpoint's files disagree (edited?)",
        dir.display(),
        differ.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_sees_order_and_boundaries() {
        let a = fingerprint(&[vec![5, 6], vec![7]]);
        assert_eq!(a, fingerprint(&[vec![5, 6], vec![7]]));
        assert_ne!(a, fingerprint(&[vec![5], vec![6, 7]]));
        assert_ne!(a, fingerprint(&[vec![7], vec![5, 6]]));
    }

    #[test]
    fn a_weights_config_that_disagrees_with_the_run_is_refused() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let run = Config::load(&path).unwrap().model;
        let mut saved = run.clone();
        saved.name = "hf-gpt-neox".into(); // config.json need not carry genslm's name
        let dir = Path::new("run/checkpoints/step-4");
        check_weights_config(&saved, &run, dir).unwrap();
        saved.layer_norm_eps = 1.0;
        let e = check_weights_config(&saved, &run, dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer_norm_eps 1.0 against 0.00001") && e.contains("step-4"),
            "{e}"
        );
    }

    #[test]
    fn impossible_saved_settings_are_refused_before_any_comparison() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let cfg = Config::load(&path).unwrap();
        let t = cfg.train.clone();
        let adamw = crate::train::optim::AdamWConfig::of(&t);
        let windows = (t.batch_size * t.grad_accum) as u64;
        let mut saved = Saved {
            dir: "run/checkpoints/step-1".into(),
            state: TrainerState {
                step: 1,
                optimizer_step: 1,
                loader_cursor: windows,
                train: t.clone(),
                adamw,
                data_fingerprint: None,
            },
            config: Some(cfg.clone()),
        };
        // The run's own state resumes with no notes.
        assert!(check_resume(&saved, &cfg).unwrap().is_empty());
        saved.state.train.zero = 7;
        let e = check_resume(&saved, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("trainer_state.json") && e.contains("`zero` (7)"),
            "{e}"
        );
        saved.state.train.zero = t.zero;
        saved.state.adamw.eps = 0.0;
        let e = check_resume(&saved, &cfg).unwrap_err().to_string();
        assert!(e.contains("saved `adamw`") && e.contains("eps 0"), "{e}");
    }

    #[test]
    fn data_is_checked_against_the_checkpoints_fingerprint() {
        let mut saved = Saved {
            dir: "run/checkpoints/step-2".into(),
            state: TrainerState {
                step: 2,
                optimizer_step: 2,
                loader_cursor: 2,
                train: Default::default(),
                adamw: Default::default(),
                data_fingerprint: Some("aa".into()),
            },
            config: None,
        };
        assert_eq!(check_data(&saved, "aa", "x.fa").unwrap(), None);
        let e = check_data(&saved, "bb", "x.fa").unwrap_err().to_string();
        assert!(e.contains("training data differs"), "{e}");
        saved.state.data_fingerprint = None;
        let w = check_data(&saved, "bb", "x.fa").unwrap().unwrap();
        assert!(
            w.contains("records no fingerprint") && w.contains("x.fa"),
            "{w}"
        );
    }
}
