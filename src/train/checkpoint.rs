//! Checkpoints (docs/ARCHITECTURE.md §7): `RUN/checkpoints/step-N/` is a Hugging Face model directory
//! (`config.json`, `model.safetensors`) with the optimizer (`optimizer.safetensors`, moments by
//! HF parameter name and shape) and the trainer state (`trainer_state.json`: step, data
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
use crate::model::io::{from_hf_tensors, hf_streamed, load_model_dir, model_files, save_model_dir};
use crate::model::neox::tensor_to_vec;
use crate::model::tensors::{read_safetensors, write_safetensors_streamed, HostTensor};
use crate::model::GenSlm;
use crate::train::optim::{AdamW, AdamWConfig};

pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
pub const GENSLM_CONFIG_FILE: &str = "genslm.toml";

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

/// Saves a complete checkpoint for `state.step` and moves `latest` to it.
pub fn save_checkpoint(
    run: &Path,
    cfg: &Config,
    model: &GenSlm,
    opt: &AdamW,
    state: &TrainerState,
) -> Result<PathBuf> {
    let root = checkpoints_dir(run);
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let name = format!("step-{}", state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = (|| {
        save_model_dir(model, &tmp)?;
        // Moments stream one tensor at a time, like the weights.
        let m = |i: usize| tensor_to_vec(&opt.m[i]);
        let v = |i: usize| tensor_to_vec(&opt.v[i]);
        let mut tensors = hf_streamed(&model.layout, ".exp_avg", &m);
        tensors.extend(hf_streamed(&model.layout, ".exp_avg_sq", &v));
        write_safetensors_streamed(&tmp.join(OPTIMIZER_FILE), &tensors, HashMap::new())?;
        let json =
            serde_json::to_string_pretty(state).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&tmp.join(STATE_FILE), json.as_bytes())?;
        let toml = toml::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&tmp.join(GENSLM_CONFIG_FILE), toml.as_bytes())?;
        // Last, so it covers every file above; loads check it (`crate::checksum`).
        let mut files = model_files(&model.cfg);
        files.extend([OPTIMIZER_FILE, STATE_FILE, GENSLM_CONFIG_FILE]);
        crate::checksum::write_manifest(&tmp, &files)?;
        if final_dir.exists() {
            // Left by an interrupted run that got further than the checkpoint we resumed from.
            std::fs::remove_dir_all(&final_dir).map_err(|e| Error::io(&final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
        crate::atomic::write_bytes(&root.join("latest"), format!("{name}\n").as_bytes())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result.map(|_| final_dir)
}

/// A checkpoint read back.
pub struct Loaded {
    pub saved: Saved,
    pub model: GenSlm,
    pub opt: AdamW,
}

/// Loads `RUN/checkpoints/latest` onto `device` (the model; moments go to its plain device).
pub fn load_latest(run: &Path, device: &burn::tensor::Device) -> Result<Loaded> {
    let saved = read_saved(run)?;
    let dir = saved.dir.clone();
    let model = load_model_dir(&dir, device)?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let (mut tensors, _) = read_safetensors(&opt_path)?;
    let mut moments = Vec::new();
    for suffix in ["exp_avg", "exp_avg_sq"] {
        let tail = format!(".{suffix}");
        let mut these: HashMap<String, HostTensor> = tensors
            .iter()
            .filter_map(|(k, t)| {
                k.strip_suffix(&tail).map(|base| {
                    (
                        base.to_string(),
                        HostTensor {
                            name: base.to_string(),
                            ..t.clone()
                        },
                    )
                })
            })
            .collect();
        moments.push(from_hf_tensors(&model.layout, &mut these, &opt_path)?);
    }
    tensors.clear();
    let v = moments.pop().expect("two moments");
    let m = moments.pop().expect("two moments");
    let state = &saved.state;
    let opt = AdamW::from_host(state.adamw, state.optimizer_step, m, v, device);
    Ok(Loaded { saved, model, opt })
}

/// The checkpoint a resume starts from: its trainer state and the config it ran with.
pub struct Saved {
    pub dir: PathBuf,
    pub state: TrainerState,
    /// `genslm.toml` beside the weights (absent only in foreign or hand-made checkpoints).
    pub config: Option<Config>,
}

/// Reads `RUN/checkpoints/latest`'s trainer state and config, without the weights.
pub fn read_saved(run: &Path) -> Result<Saved> {
    let root = checkpoints_dir(run);
    let latest = root.join("latest");
    let name = std::fs::read_to_string(&latest).map_err(|e| {
        Error::Invalid(format!(
            "cannot resume: {} ({e}); no completed checkpoint in {}",
            latest.display(),
            run.display()
        ))
    })?;
    let dir = root.join(name.trim());
    crate::checksum::verify(&dir, &[STATE_FILE, GENSLM_CONFIG_FILE])?;
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        Error::Invalid(format!(
            "{}: corrupt trainer state: {e}",
            state_path.display()
        ))
    })?;
    let cfg_path = dir.join(GENSLM_CONFIG_FILE);
    let config = if cfg_path.exists() {
        Some(Config::load(&cfg_path)?)
    } else {
        None
    };
    Ok(Saved { dir, state, config })
}
