//! Checkpoints (docs/ARCHITECTURE.md §7): `RUN/checkpoints/step-N/` is a Hugging Face model directory
//! (`config.json`, `model.safetensors`) with the optimizer state (one
//! `optimizer-rankRRRRR-of-WWWWW.safetensors` per rank that holds moments, see
//! `train::optim_shards`; any layout can resume from them) and the trainer state (`trainer_state.json`: step, data
//! position, seed, settings) beside it, plus the resolved `genslm.toml`, and last
//! `checksums.sha256` (every file's sha256, checked when genslm loads the checkpoint).
//!
//! A checkpoint is written into a temporary directory and renamed into place when complete;
//! only then is `RUN/checkpoints/latest` (a one-line file naming the directory) replaced,
//! atomically. A crash at any point leaves the previous checkpoint as `latest`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Config, TrainConfig};
use crate::error::{Error, Result};
use crate::model::io::{load_config, model_files, save_model_dir};
use crate::model::tensors::HostTensor;
use crate::model::GenSlm;
use crate::train::optim::AdamWConfig;
use crate::train::optim_shards::shard_files;
use crate::train::param_source::ParamSource;

pub const STATE_FILE: &str = crate::checksum::GENSLM_STATE_FILE;
pub const GENSLM_CONFIG_FILE: &str = crate::checksum::GENSLM_SETTINGS_FILE;

/// Everything besides weights and moments needed to continue a run exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Completed optimizer steps (including skipped non-finite steps).
    pub step: u64,
    /// AdamW's bias-correction step count.
    pub optimizer_step: u64,
    /// Training windows served so far (the data loader's whole state).
    pub loader_cursor: u64,
    pub train: TrainConfig,
    pub adamw: AdamWConfig,
    /// Fingerprint of the tokenized training records (`train::resume::fingerprint`); absent
    /// in checkpoints written before it existed.
    #[serde(default)]
    pub data_fingerprint: Option<String>,
}

pub fn checkpoints_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

/// Where the checkpoint of step `step` is written before it is complete (every rank writes its
/// optimizer shard there; the name is the same on every rank, whatever process it runs in).
pub fn staging_dir(run: &Path, step: u64) -> PathBuf {
    checkpoints_dir(run).join(format!(".step-{step}.tmp"))
}

/// Creates an empty staging directory for step `step` (world rank 0, before any rank writes).
pub fn prepare_staging(run: &Path, step: u64) -> Result<PathBuf> {
    let tmp = staging_dir(run, step);
    if tmp.exists() {
        // Left by a run that stopped while writing this step.
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    Ok(tmp)
}

/// Completes the checkpoint in `staging`, where the ranks have written `shards` optimizer
/// shards: the weights (the whole `model`), trainer state, config and manifest, then the rename
/// and the move of `latest`. On failure the staging directory is removed.
pub fn commit_checkpoint(
    run: &Path,
    cfg: &Config,
    model: &GenSlm,
    state: &TrainerState,
    staging: &Path,
    shards: usize,
    on_commit: &dyn Fn(),
) -> Result<PathBuf> {
    let root = checkpoints_dir(run);
    let name = format!("step-{}", state.step);
    let final_dir = root.join(&name);
    let result = (|| {
        save_model_dir(model, staging)?;
        let json =
            serde_json::to_string_pretty(state).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&staging.join(STATE_FILE), json.as_bytes())?;
        let toml = toml::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&staging.join(GENSLM_CONFIG_FILE), toml.as_bytes())?;
        // Last, so it covers every file above; loads check it (`crate::checksum`).
        let found = shard_files(staging)?;
        if found.len() != shards {
            return Err(Error::Invalid(format!(
                "{}: {shards} ranks wrote optimizer shards but {} are here; the run directory \
                 must be on a file system every rank sees (with MPI across machines, a shared \
                 one)",
                staging.display(),
                found.len()
            )));
        }
        let mut files = model_files(&model.cfg);
        files.extend(found.iter().map(String::as_str));
        files.extend([STATE_FILE, GENSLM_CONFIG_FILE]);
        crate::checksum::write_manifest(staging, &files)?;
        if final_dir.exists() {
            // A resume refuses to start while a later step-N exists (the user's when `latest`
            // was moved back, or left by a kill between a save's rename and `latest`'s update,
            // moments apart: run_dir::check_later_checkpoints names both), so this is one
            // made since by this run's own ranks, and is replaced. Anything else of that name
            // is not ours to delete.
            match crate::checksum::unlisted_entries(&final_dir) {
                Some(other) if other.is_empty() => {
                    std::fs::remove_dir_all(&final_dir).map_err(|e| Error::io(&final_dir, e))?
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "{}: exists and is not a checkpoint genslm wrote (files its manifest \
                         does not list, or no manifest), so step {} cannot be saved there. \
                         Move it out of the run directory and resume",
                        final_dir.display(),
                        state.step
                    )))
                }
            }
        }
        // `latest`'s new text is on disk before the checkpoint takes its name, and the two
        // renames run as one critical section, which a signal's cleanup waits for: a finished
        // step-N that `latest` did not name (1 signal in 8 at --checkpoint-every 1), or a
        // staging directory the cleanup had emptied renamed to step-N, made the resume
        // refuse it as a later checkpoint.
        let latest = root.join("latest");
        let (next, mut file) = crate::atomic::AtomicFile::create(&latest)?;
        std::io::Write::write_all(&mut file, format!("{name}\n").as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|e| Error::io(next.tmp_path(), e))?;
        crate::interrupt::critical(|| {
            std::fs::rename(staging, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
            next.commit(file)?;
            // In the same section: what the run holds on to until it has a checkpoint (the
            // old run `--overwrite` replaces) lets go as it becomes one.
            on_commit();
            Ok(())
        })
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(staging);
    }
    result.map(|_| final_dir)
}

/// A checkpoint's Adam moments as named tensors (`NAME.exp_avg`, `NAME.exp_avg_sq`, our
/// layout's shapes), whatever layout wrote them: for comparing two runs' optimizer states.
pub fn moment_tensors(dir: &Path) -> Result<HashMap<String, HostTensor>> {
    let source = ParamSource::checkpoint(dir, &load_config(dir)?, true)?;
    let mut out = HashMap::new();
    for (i, spec) in source.layout().specs.iter().enumerate() {
        let Some((m, v)) = source.moments(i)? else {
            continue;
        };
        for (suffix, data) in [("exp_avg", m), ("exp_avg_sq", v)] {
            let name = format!("{}.{suffix}", spec.name);
            let t = HostTensor {
                name: name.clone(),
                shape: spec.shape.clone(),
                data,
            };
            out.insert(name, t);
        }
    }
    Ok(out)
}

/// The checkpoint a resume starts from: its trainer state and the config it ran with.
pub struct Saved {
    pub dir: PathBuf,
    pub state: TrainerState,
    /// `genslm.toml` beside the weights (absent only in foreign or hand-made checkpoints).
    pub config: Option<Config>,
}

/// The step of a checkpoint's name (`step-N`, N as genslm writes it), if it is one.
pub(crate) fn step_of(name: &str) -> Option<u64> {
    let n: u64 = name.strip_prefix("step-")?.parse().ok()?;
    (name == format!("step-{n}")).then_some(n)
}

/// The steps of the checkpoint directories in `RUN/checkpoints`, in order.
fn saved_steps(run: &Path) -> Vec<u64> {
    let mut steps: Vec<u64> = std::fs::read_dir(checkpoints_dir(run))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join(STATE_FILE).is_file())
        .filter_map(|e| step_of(&e.file_name().to_string_lossy()))
        .collect();
    steps.sort_unstable();
    steps
}

/// Why `latest` cannot be read, when it is missing or no file, with the way out: checkpoints
/// without a `latest` were sent to `--overwrite`, which deletes them, and a link to a step's
/// directory was "a directory, not a file".
fn latest_unreadable(run: &Path, latest: &Path, what: &str) -> Error {
    let steps = saved_steps(run);
    let link = std::fs::read_link(latest).ok();
    // Through a link, `echo … > latest` writes to its target (a directory: refused; a file
    // elsewhere: overwritten), so the link goes first.
    let fix = |step: u64| {
        let rm = match link {
            Some(_) => format!("rm {} && ", latest.display()),
            None => String::new(),
        };
        format!(
            "point it at the one to resume from (e.g. `{rm}echo step-{step} > {}`), then resume",
            latest.display()
        )
    };
    match (what, steps.last()) {
        ("missing", None) => Error::Invalid(format!(
            "cannot resume: {} has no completed checkpoint yet (no checkpoints/latest). Start \
             the run over with --overwrite instead of --resume (its files are replaced), or \
             train into a new --out",
            run.display()
        )),
        ("missing", Some(&last)) => Error::Invalid(format!(
            "cannot resume: {} is missing, though {} holds checkpoints ({}); genslm writes it \
             after each save, so it was removed or the run was copied without it: {} \
             (--overwrite would delete them)",
            latest.display(),
            checkpoints_dir(run).display(),
            steps
                .iter()
                .map(|s| format!("step-{s}"))
                .collect::<Vec<_>>()
                .join(", "),
            fix(last)
        )),
        _ => {
            let linked = link
                .as_ref()
                .map_or(String::new(), |t| format!(" (a link to {})", t.display()));
            let way = steps
                .last()
                .map_or(String::new(), |&s| format!(": {}", fix(s)));
            Error::Invalid(format!(
                "cannot resume: {}: {what}{linked}; genslm writes it as a file naming the \
                 latest step-N{way}",
                latest.display()
            ))
        }
    }
}

/// Reads `RUN/checkpoints/latest`'s trainer state and config, without the weights.
pub fn read_saved(run: &Path) -> Result<Saved> {
    let root = checkpoints_dir(run);
    let latest = root.join("latest");
    // Checked before reading: a named pipe there would block the read for ever.
    match crate::error::not_a_file(&latest) {
        "a file" => {}
        what => return Err(latest_unreadable(run, &latest, what)),
    }
    let (name, dir) = crate::model::io::read_latest(&latest)?;
    // config.json too: a missing one was a bare "No such file" from the model's loader.
    crate::checksum::verify(
        &dir,
        &[
            STATE_FILE,
            GENSLM_CONFIG_FILE,
            crate::model::io::CONFIG_FILE,
        ],
    )?;
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        Error::Invalid(format!(
            "{}: corrupt trainer state: {e}",
            state_path.display()
        ))
    })?;
    // The directory's name is the step it was saved at (latest_step_dir checked its form);
    // a state that says otherwise was edited or copied from another checkpoint.
    let named = name.trim().trim_start_matches("step-").parse::<u64>().ok();
    if named != Some(state.step) {
        return Err(Error::Invalid(format!(
            "{}: says step {} but is the checkpoint of {} (edited, or copied from another \
             checkpoint?)",
            state_path.display(),
            state.step,
            name.trim()
        )));
    }
    let cfg_path = dir.join(GENSLM_CONFIG_FILE);
    let config = if cfg_path.exists() {
        Some(Config::load(&cfg_path)?)
    } else {
        None
    };
    Ok(Saved { dir, state, config })
}
