//! Model directories in Hugging Face layout: `config.json` + `model.safetensors`.
//!
//! The same loader reads checkpoints written by genslm and GPT-NeoX models written by
//! transformers (`save_pretrained`), e.g. GenSLM's published weights converted to safetensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::hf::{
    config_from_hf, config_to_hf, needs_remote_code, MODELING_FILE, MODELING_PY,
};
use crate::model::params::{transpose, Layout, ParamSpec};
use crate::model::tensors::{read_safetensors, write_safetensors_streamed, HostTensor, Streamed};
use crate::model::GenSlm;
use crate::ops::primitive::tensor_to_vec;

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// HF-named tensors (name + `suffix`) streamed from `value(i)`, parameter `i`'s host values in
/// our layout (transposed where HF's layout differs), produced one at a time when written.
pub fn hf_streamed<'a>(
    layout: &'a Layout,
    suffix: &'a str,
    value: &'a dyn Fn(usize) -> Vec<f32>,
) -> Vec<Streamed<'a>> {
    layout
        .specs
        .iter()
        .enumerate()
        .map(|(i, spec)| Streamed {
            name: format!("{}{suffix}", spec.name),
            shape: spec.hf_shape(),
            values: Box::new(move || {
                let v = value(i);
                if spec.hf_transposed {
                    transpose(&v, spec.shape[0], spec.shape[1])
                } else {
                    v
                }
            }),
        })
        .collect()
}

/// HF-named tensors → our-layout host values; every parameter must be present with its shape.
pub fn from_hf_tensors(
    layout: &Layout,
    tensors: &mut HashMap<String, HostTensor>,
    file: &Path,
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(layout.specs.len());
    for spec in &layout.specs {
        let t = tensors.remove(&spec.name).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: tensor {} is missing (does config.json match the weights?)",
                file.display(),
                spec.name
            ))
        })?;
        out.push(hf_to_ours(spec, t, file)?);
    }
    Ok(out)
}

/// Transformers' non-parameter buffers that old GPT-NeoX checkpoints carry: the causal mask
/// (`attention.bias`, `attention.masked_bias`) and rotary frequencies, recomputed by genslm.
pub fn is_buffer(name: &str) -> bool {
    (name.starts_with("gpt_neox.layers.")
        && (name.ends_with(".attention.bias") || name.ends_with(".attention.masked_bias")))
        || name.ends_with("rotary_emb.inv_freq")
}

/// One HF tensor (`t`, read from `file`) as parameter `spec`'s values in our layout: its shape
/// checked against the config, transposed where HF's layout differs.
pub fn hf_to_ours(spec: &ParamSpec, t: HostTensor, file: &Path) -> Result<Vec<f32>> {
    if t.shape != spec.hf_shape() {
        return Err(Error::Invalid(format!(
            "{}: tensor {} has shape {:?}, the config needs {:?}",
            file.display(),
            t.name,
            t.shape,
            spec.hf_shape()
        )));
    }
    Ok(if spec.hf_transposed {
        // HF [out, in] → ours [in, out].
        transpose(&t.data, spec.shape[1], spec.shape[0])
    } else {
        t.data
    })
}

/// Writes the model directory's files ([`model_files`]) into `dir` (which must exist).
pub fn save_model_dir(model: &GenSlm, dir: &Path) -> Result<()> {
    let value = |i: usize| tensor_to_vec(&model.params[i]);
    write_model_dir(&model.cfg, &model.layout, &value, dir)
}

/// [`save_model_dir`] from host values: parameter `i` of `layout` in our layout is `value(i)`.
pub fn write_model_dir(
    cfg: &ModelConfig,
    layout: &Layout,
    value: &dyn Fn(usize) -> Vec<f32>,
    dir: &Path,
) -> Result<()> {
    let text = serde_json::to_string_pretty(&config_to_hf(cfg))
        .map_err(|e| Error::Invalid(e.to_string()))?;
    crate::atomic::write_bytes(&dir.join(CONFIG_FILE), text.as_bytes())?;
    if needs_remote_code(cfg) {
        crate::atomic::write_bytes(&dir.join(MODELING_FILE), MODELING_PY.as_bytes())?;
    }
    let tensors = hf_streamed(layout, "", value);
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors_streamed(&dir.join(WEIGHTS_FILE), &tensors, meta)
}

/// The files [`write_model_dir`] writes for a model of `cfg`.
pub fn model_files(cfg: &ModelConfig) -> Vec<&'static str> {
    let mut files = vec![CONFIG_FILE, WEIGHTS_FILE];
    if needs_remote_code(cfg) {
        files.push(MODELING_FILE);
    }
    files
}

/// Reads a model config from `dir/config.json`.
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = crate::config::read_config_text(&path)?;
    crate::atomic::note_input(&path);
    config_from_hf(&text).map_err(|msg| Error::Config { file: path, msg })
}

/// The most of a `checkpoints/latest` file that is read: genslm writes a `step-N` name of at
/// most 25 bytes, so a longer file is not one of its own and is refused without being read
/// whole (a multi-gigabyte file there would otherwise be loaded, then echoed in the error).
const LATEST_MAX_BYTES: u64 = 4096;

/// Reads a `checkpoints/latest` file and returns the step name it holds (trimmed) and the
/// checkpoint directory it names ([`latest_step_dir`]).
pub fn read_latest(latest: &Path) -> Result<(String, PathBuf)> {
    let Some(bytes) = crate::error::read_capped(latest, LATEST_MAX_BYTES)? else {
        return Err(Error::Invalid(format!(
            "{}: more than {LATEST_MAX_BYTES} bytes, not a step-N name genslm writes \
             (a file of another program?)",
            latest.display()
        )));
    };
    let text = String::from_utf8_lossy(&bytes);
    let dir = latest_step_dir(latest, &text)?;
    // A name with nothing behind it: said here ("trainer_state.json: No such file" was all).
    if !dir.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: names {}, which is {}: point it at a step-N checkpoint of this run",
            latest.display(),
            text.trim(),
            match crate::error::not_a_file(&dir) {
                "missing" => "missing".to_string(),
                _ => crate::error::not_a_directory(&dir),
            }
        )));
    }
    Ok((text.trim().to_string(), dir))
}

/// The checkpoint a `checkpoints/latest` file (at `latest`, holding `text`) names: one
/// `step-N` directory beside it. Anything else — a path, `..`, another run's directory — is
/// refused, so a run never resumes from (or prunes around) another run's state.
pub fn latest_step_dir(latest: &Path, text: &str) -> Result<PathBuf> {
    let name = text.trim();
    let ok = name
        .strip_prefix("step-")
        .is_some_and(|n| !n.is_empty() && n.len() <= 20 && n.bytes().all(|b| b.is_ascii_digit()));
    if !ok {
        // The echoed name is cut short: the file is arbitrary bytes of arbitrary length.
        let shown: String = name.chars().take(64).collect();
        let more = if shown.len() < name.len() { "…" } else { "" };
        return Err(Error::Invalid(format!(
            "{}: names '{}{more}', not a step-N checkpoint of this run (genslm writes only \
             such names; a path elsewhere is refused)",
            latest.display(),
            shown.escape_debug()
        )));
    }
    Ok(latest.with_file_name(name))
}

/// Resolves what a user passes as `--model`: a model directory (with config.json), a run
/// directory (its `checkpoints/latest`), or a run's `checkpoints/` directory.
pub fn resolve_model_dir(path: &Path) -> Result<PathBuf> {
    crate::error::file_or_missing(&path.join(CONFIG_FILE), "the model's config")?;
    if path.join(CONFIG_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    for ckpts in [path.join("checkpoints"), path.to_path_buf()] {
        let latest = ckpts.join("latest");
        let what = crate::error::not_a_file(&latest);
        if what != "missing" && !latest.is_file() {
            return Err(Error::Invalid(format!(
                "{}: {what}; genslm writes it as a file naming the latest step-N",
                latest.display()
            )));
        }
        if latest.is_file() {
            let (_, dir) = read_latest(&latest)?;
            if dir.join(CONFIG_FILE).is_file() {
                return Ok(dir);
            }
            return Err(Error::Invalid(format!(
                "{}: points to {}, which holds no {CONFIG_FILE}",
                latest.display(),
                dir.display()
            )));
        }
    }
    if !path.exists() {
        return Err(Error::Invalid(format!(
            "{}: no such model directory",
            path.display()
        )));
    }
    // A model's file given for its directory (`--model m/model.safetensors`).
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if path.is_file() && parent.join(CONFIG_FILE).is_file() {
        return Err(Error::Invalid(format!(
            "{}: a file of a model; give the model directory that holds it ({})",
            path.display(),
            parent.display()
        )));
    }
    // A run's own file (`--model RUN/metrics.jsonl`): the run is the model.
    let run = crate::run_lock::run_holding(path)
        .map(|r| {
            format!(
                "; it is part of the run in {0}: give --model {0}",
                r.display()
            )
        })
        .unwrap_or_default();
    Err(Error::Invalid(format!(
        "{}: not a model directory: no {CONFIG_FILE} here and no checkpoints/latest{run}",
        path.display()
    )))
}

/// Loads a model directory onto `device`.
pub fn load_model_dir(path: &Path, device: &Device) -> Result<GenSlm> {
    let dir = resolve_model_dir(path)?;
    crate::checksum::verify(&dir, &[CONFIG_FILE])?;
    let cfg = load_config(&dir)?;
    let weights = dir.join(WEIGHTS_FILE);
    if !weights.is_file() {
        let hint = if dir.join("pytorch_model.bin").is_file() {
            " (found pytorch_model.bin: convert it with `genslm convert DIR --out NEW_DIR`)"
        } else if dir.join("model.safetensors.index.json").is_file() {
            " (found a sharded checkpoint, model.safetensors.index.json: convert it with \
             `genslm convert DIR --out NEW_DIR`)"
        } else {
            ""
        };
        return Err(Error::Invalid(format!(
            "{}: {}{hint}",
            weights.display(),
            crate::error::not_a_file(&weights)
        )));
    }
    let (mut tensors, _) = read_safetensors(&weights)?;
    let layout = Layout::new(&cfg);
    let values = from_hf_tensors(&layout, &mut tensors, &weights)?;
    // A tensor the config has no place for means config.json describes another model (fewer
    // layers, say): loading the rest would give that model's outputs without a word.
    let mut extra: Vec<&String> = tensors.keys().filter(|n| !is_buffer(n)).collect();
    extra.sort();
    if let Some(first) = extra.first() {
        return Err(Error::Invalid(format!(
            "{}: tensor {first}{} is not a parameter of the model {} describes (does config.json \
             match the weights?)",
            weights.display(),
            match extra.len() {
                1 => String::new(),
                n => format!(" (and {} more)", n - 1),
            },
            dir.join(CONFIG_FILE).display()
        )));
    }
    GenSlm::from_host(cfg, values, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_latest_file_is_read_only_as_far_as_a_step_name_goes() {
        let dir = tempfile::tempdir().unwrap();
        let latest = dir.path().join("latest");
        std::fs::write(&latest, "step-12\n").unwrap();
        // A name with nothing behind it is said to be missing.
        let e = read_latest(&latest).unwrap_err().to_string();
        assert!(e.contains("names step-12, which is missing"), "{e}");
        std::fs::create_dir(dir.path().join("step-12")).unwrap();
        let (name, step) = read_latest(&latest).unwrap();
        assert_eq!(name, "step-12");
        assert_eq!(step, dir.path().join("step-12"));

        // 32 MiB of one line: refused by its size, and the error stays short.
        std::fs::write(&latest, "x".repeat(32 << 20)).unwrap();
        let e = read_latest(&latest).unwrap_err().to_string();
        assert!(e.contains("more than 4096 bytes") && e.len() < 400, "{e}");

        // A long name under the cap: echoed cut short.
        std::fs::write(&latest, format!("step-{}", "9".repeat(3000))).unwrap();
        let e = read_latest(&latest).unwrap_err().to_string();
        assert!(
            e.contains("not a step-N checkpoint") && e.len() < 400,
            "{e}"
        );
        // Bytes that are not UTF-8: refused, not a panic.
        std::fs::write(&latest, [0xff, 0xfe, b's']).unwrap();
        assert!(read_latest(&latest).is_err());
    }
}
