//! Checkpoints (DESIGN.md §8): `RUN/checkpoints/step-N/` is a Hugging Face model directory
//! (`config.json`, `model.safetensors`) with the optimizer (`optimizer.safetensors`, moments by
//! HF parameter name and shape) and the trainer state (`trainer_state.json`: step, data
//! position, seed, settings) beside it, plus the resolved `genslm.toml`.
//!
//! A checkpoint is written into a temporary directory and renamed into place when complete;
//! only then is `RUN/checkpoints/latest` (a one-line file naming the directory) replaced,
//! atomically. A crash at any point leaves the previous checkpoint as `latest`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Config, TrainConfig};
use crate::error::{Error, Result};
use crate::model::io::{from_hf_tensors, load_model_dir, save_model_dir, to_hf_tensors};
use crate::model::tensors::{read_safetensors, write_safetensors, HostTensor};
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
        let (m, v) = opt.moments_to_host();
        let mut tensors = Vec::new();
        for (suffix, values) in [("exp_avg", m), ("exp_avg_sq", v)] {
            for t in to_hf_tensors(&model.layout, &values) {
                tensors.push(HostTensor {
                    name: format!("{}.{suffix}", t.name),
                    ..t
                });
            }
        }
        write_safetensors(&tmp.join(OPTIMIZER_FILE), &tensors, HashMap::new())?;
        let json =
            serde_json::to_string_pretty(state).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&tmp.join(STATE_FILE), json.as_bytes())?;
        let toml = toml::to_string(cfg).map_err(|e| Error::Invalid(e.to_string()))?;
        crate::atomic::write_bytes(&tmp.join(GENSLM_CONFIG_FILE), toml.as_bytes())?;
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
    pub dir: PathBuf,
    pub model: GenSlm,
    pub opt: AdamW,
    pub state: TrainerState,
}

/// Loads `RUN/checkpoints/latest` onto `device` (the model; moments go to its plain device).
pub fn load_latest(run: &Path, device: &burn::tensor::Device) -> Result<Loaded> {
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
    let model = load_model_dir(&dir, device)?;
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        Error::Invalid(format!(
            "{}: corrupt trainer state: {e}",
            state_path.display()
        ))
    })?;
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
    let opt = AdamW::from_host(state.adamw, state.optimizer_step, m, v, device);
    Ok(Loaded {
        dir,
        model,
        opt,
        state,
    })
}
