//! `genslm convert`: other people's GPT-NeoX weights → a genslm model directory.
//!
//! Accepted inputs: GenSLM's released PyTorch Lightning checkpoints (`torch.save` of a dict
//! whose `state_dict` holds the Hugging Face names prefixed with `model.`, sometimes with the
//! attention buffers), a Hugging Face `pytorch_model.bin`, a `.safetensors` file, or a model
//! directory holding either (sharded safetensors included). Pickles are read by
//! [`pickle`], which executes nothing. The shape comes from `--config` (a genslm TOML such as
//! configs/genslm-25m.toml, or a config.json), else from the config.json beside the input, and
//! every tensor is checked against it.

pub mod pickle;
pub mod torch;
pub mod value;
pub mod zip;

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::config::{Config, ModelConfig};
use crate::error::{Error, Result};
use crate::model::hf::config_from_hf;
use crate::model::io::{
    from_hf_tensors, is_buffer, load_config, model_files, write_model_dir, CONFIG_FILE,
    WEIGHTS_FILE,
};
use crate::model::params::Layout;
use crate::model::tensors::{read_safetensors_except, HostTensor};

/// What `convert` did, for the command's summary.
#[derive(Debug)]
pub struct Converted {
    pub format: &'static str,
    pub config: ModelConfig,
    pub tensors: usize,
    /// Buffers of transformers' GPT-NeoX that are not parameters (causal mask, rotary
    /// frequencies), dropped.
    pub dropped: usize,
    pub parameters: u64,
}

/// The Hugging Face name of a checkpoint key: Lightning's `model.` (or DDP/DeepSpeed's
/// `module.`) wrapper prefix removed, and transformers 5's in-memory `lm_head` called by the
/// `embed_out` name its files use.
fn hf_name(key: &str) -> &str {
    let mut name = key;
    for prefix in ["model.", "module."] {
        if let Some(rest) = key.strip_prefix(prefix) {
            if ["gpt_neox.", "embed_out.", "lm_head."]
                .iter()
                .any(|p| rest.starts_with(p))
            {
                name = rest;
            }
        }
    }
    if name == "lm_head.weight" {
        "embed_out.weight"
    } else {
        name
    }
}

fn model_config(input: &Path, config: Option<&Path>) -> Result<ModelConfig> {
    if let Some(c) = config {
        // A model or run directory gives its config, as `info --config` takes it.
        if c.is_dir() {
            return load_config(&crate::model::io::resolve_model_dir(c)?);
        }
        if c.extension().is_some_and(|e| e == "json") {
            let text = crate::config::read_config_text(c)?;
            return config_from_hf(&text).map_err(|msg| Error::Config {
                file: c.to_path_buf(),
                msg,
            });
        }
        return Ok(Config::load(c)?.model);
    }
    let dir = if input.is_dir() {
        input
    } else {
        input.parent().unwrap_or(Path::new("."))
    };
    crate::error::file_or_missing(&dir.join(CONFIG_FILE), "the model's config")?;
    if dir.join(CONFIG_FILE).is_file() {
        return load_config(dir);
    }
    // A genslm run or checkpoint needs no converting: every command loads it as it is.
    if let Some(run) = crate::run_lock::run_holding(input) {
        let what = if run == input {
            "a genslm run directory".to_string()
        } else {
            format!("part of the genslm run in {}", run.display())
        };
        return Err(Error::Invalid(format!(
            "{}: {what}; its checkpoints (checkpoints/step-N) are model directories every \
             genslm command loads as they are (--model {} takes the latest). convert reads \
             foreign weights: a Lightning .pt, a pytorch_model.bin or a safetensors file",
            input.display(),
            run.display()
        )));
    }
    Err(Error::Invalid(format!(
        "{}: no config.json beside it; pass --config with the model's shape (GenSLM's \
         presets: configs/genslm-25m.toml, genslm-250m, genslm-2.5b, genslm-25b)",
        input.display()
    )))
}

/// A sharded checkpoint's index (transformers' name).
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensor key → shard file name, as a sharded index's `weight_map` gives it.
type WeightMap = HashMap<String, String>;

/// The weight files of a model directory, in the order to read them, with the index's
/// `weight_map` when the shards are read. A directory holding more than one set is read as
/// transformers' `from_pretrained` reads it — `model.safetensors`, else the sharded index,
/// else `pytorch_model.bin` — and the others are named in a note (the shards were read before
/// a `model.safetensors` beside them, whose weights transformers would load, without a word).
fn weight_sources(dir: &Path) -> Result<(Vec<PathBuf>, Option<WeightMap>)> {
    let index = dir.join(INDEX_FILE);
    for name in [WEIGHTS_FILE, INDEX_FILE, "pytorch_model.bin"] {
        crate::error::file_or_missing(&dir.join(name), "weights")?;
    }
    let present: Vec<&str> = [WEIGHTS_FILE, INDEX_FILE, "pytorch_model.bin"]
        .into_iter()
        .filter(|n| dir.join(n).is_file())
        .collect();
    if present.len() > 1 {
        eprintln!(
            "note: {} holds {}; reading {} as transformers does, the others are not read",
            dir.display(),
            present.join(" and "),
            present[0]
        );
    }
    if dir.join(WEIGHTS_FILE).is_file() {
        return Ok((vec![dir.join(WEIGHTS_FILE)], None));
    }
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            file: index.clone(),
            msg: e.to_string(),
        })?;
        let map = v["weight_map"].as_object().ok_or_else(|| Error::Config {
            file: index.clone(),
            msg: "no weight_map".into(),
        })?;
        let names: HashSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
        let mut files = Vec::with_capacity(names.len());
        for name in names {
            // A shard is a file beside the index: an absolute path or one with `..` would
            // have genslm read outside the model directory on the index's say-so.
            let plain = Path::new(name)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain || name.is_empty() {
                return Err(Error::Config {
                    file: index.clone(),
                    msg: format!(
                        "weight_map names '{}', not a file beside the index (absolute paths \
                         and '..' are refused)",
                        name.escape_debug()
                    ),
                });
            }
            let shard = dir.join(name);
            if !shard.is_file() {
                return Err(Error::Config {
                    file: index.clone(),
                    msg: format!(
                        "weight_map names the shard '{name}', and {} is {} (an incomplete \
                         download?)",
                        shard.display(),
                        crate::error::not_a_file(&shard)
                    ),
                });
            }
            files.push(shard);
        }
        if files.is_empty() {
            return Err(Error::Config {
                file: index.clone(),
                msg: "weight_map lists no weight files".into(),
            });
        }
        files.sort();
        let weight_map = map
            .iter()
            .filter_map(|(k, f)| Some((k.clone(), f.as_str()?.to_string())))
            .collect();
        return Ok((files, Some(weight_map)));
    }
    if dir.join("pytorch_model.bin").is_file() {
        return Ok((vec![dir.join("pytorch_model.bin")], None));
    }
    Err(Error::Invalid(format!(
        "{}: holds no {WEIGHTS_FILE}, model.safetensors.index.json or pytorch_model.bin",
        dir.display()
    )))
}

/// Refuses a sharded index whose `weight_map` does not describe the shards: a tensor it puts
/// in another shard than the one holding it, or one it lists that no shard holds (the weights
/// read were right, but an index that disagrees with its shards is a broken download or an
/// edited file, and transformers would fail on it).
fn check_weight_map(
    dir: &Path,
    map: &WeightMap,
    read_from: &HashMap<String, String>,
) -> Result<()> {
    let index = dir.join(INDEX_FILE);
    let bad = |msg: String| Error::Config {
        file: index.clone(),
        msg,
    };
    for (key, file) in map {
        let name = hf_name(key);
        if is_buffer(name) {
            continue;
        }
        match read_from.get(name) {
            None => {
                return Err(bad(format!(
                    "weight_map lists '{key}' in {file}, and no shard holds it"
                )))
            }
            Some(held) if held != file => {
                return Err(bad(format!(
                    "weight_map puts '{key}' in {file}, but {held} holds it"
                )))
            }
            Some(_) => {}
        }
    }
    let listed: HashSet<&str> = map.keys().map(|k| hf_name(k)).collect();
    if let Some((name, held)) = read_from.iter().find(|(n, _)| !listed.contains(n.as_str())) {
        return Err(bad(format!(
            "weight_map does not list '{name}', which {held} holds"
        )));
    }
    Ok(())
}

/// Reads every tensor of `file` that the model needs (HF names), checking each shape against
/// `layout` before its data is read. Returns the format's name and the number of buffers dropped.
fn read_weights(
    file: &Path,
    layout: &Layout,
    out: &mut HashMap<String, HostTensor>,
) -> Result<(&'static str, usize)> {
    let shapes: HashMap<&str, Vec<usize>> = layout
        .specs
        .iter()
        .map(|s| (s.name.as_str(), s.hf_shape()))
        .collect();
    let mut dropped = 0;
    let mut keep = |key: &str, shape: &[usize]| -> Result<Option<String>> {
        let name = hf_name(key);
        if is_buffer(name) {
            dropped += 1;
            return Ok(None);
        }
        match shapes.get(name) {
            None => Err(Error::Invalid(format!(
                "{}: tensor '{key}' is not a parameter of the config's GPT-NeoX model (does the \
                 config read, --config or the config.json beside the weights, match the \
                 checkpoint?)",
                file.display()
            ))),
            Some(want) if want.as_slice() != shape => Err(Error::Invalid(format!(
                "{}: tensor '{key}' has shape {shape:?}, the config needs {want:?}",
                file.display()
            ))),
            Some(_) => Ok(Some(name.to_string())),
        }
    };
    if let Some(mut pt) = torch::TorchFile::open(file)? {
        let format = if file.extension().is_some_and(|e| e == "bin") {
            "PyTorch state dict"
        } else {
            "PyTorch checkpoint"
        };
        for (key, t) in pt.state_dict()? {
            if let Some(name) = keep(&key, &t.shape)? {
                once(file, &key, &name, out)?;
                if !t.dtype.is_float() {
                    return Err(Error::Invalid(format!(
                        "{}: tensor '{key}' holds {:?} values; a GPT-NeoX weight is floating \
                         point (F32, F16, BF16 or F64)",
                        file.display(),
                        t.dtype
                    )));
                }
                let data = pt.load(&key, &t)?;
                out.insert(
                    name.clone(),
                    HostTensor {
                        name,
                        shape: t.shape,
                        data,
                    },
                );
            }
        }
        return Ok((format, dropped));
    }
    let mut head = Vec::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(9).read_to_end(&mut head))
        .map_err(|e| Error::io(file, e))?;
    if head.len() == 9 && head[8] == b'{' {
        let skip = |key: &str| is_buffer(hf_name(key));
        let (tensors, _, buffers) = read_safetensors_except(file, &skip)?;
        for (key, t) in tensors {
            if let Some(name) = keep(&key, &t.shape)? {
                once(file, &key, &name, out)?;
                out.insert(name.clone(), HostTensor { name, ..t });
            }
        }
        return Ok(("safetensors", dropped + buffers));
    }
    Err(Error::Invalid(format!(
        "{}: {}",
        file.display(),
        not_weights(&head)
    )))
}

/// Refuses a weight given twice (`model.embed_out.weight` beside `embed_out.weight`, or one
/// tensor in two shards): one copy would silently replace the other.
fn once(file: &Path, key: &str, name: &str, out: &HashMap<String, HostTensor>) -> Result<()> {
    if out.contains_key(name) {
        let named = if key == name {
            String::new()
        } else {
            format!(" (that is, {name})")
        };
        return Err(Error::Invalid(format!(
            "{}: tensor '{key}'{named} was already given by an earlier key or weight file: two \
             copies of one weight, and which one is meant is unknown",
            file.display()
        )));
    }
    Ok(())
}

/// Why a file whose first bytes are `head` (at most 9) is neither format read.
fn not_weights(head: &[u8]) -> &'static str {
    // A legacy pickle opens with PROTO (0x80) and a protocol number, 2 to 5 in PyTorch's files.
    if head.starts_with(b"PK\x03\x04") {
        "a ZIP archive whose central directory is missing (truncated or still being copied?)"
    } else if head.len() < 9 {
        "too short to be a torch.save archive or a safetensors file (truncated?)"
    } else if head[0] == 0x80 && (2..=5).contains(&head[1]) {
        "a pickle without the ZIP container: PyTorch < 1.6's legacy torch.save format is not \
         read; load and re-save it with torch.save in a current PyTorch"
    } else {
        "neither a torch.save archive nor a safetensors file"
    }
}

/// Converts `input` into a new model directory `out` (written whole or not at all).
pub fn convert(input: &Path, out: &Path, config: Option<&Path>) -> Result<Converted> {
    if !input.exists() {
        return Err(Error::Invalid(format!(
            "{}: no such file or directory",
            input.display()
        )));
    }
    if !input.is_dir() {
        crate::error::file_or_missing(input, "weights (.pt, .bin or .safetensors)")?;
    }
    // A link to an empty directory is the directory it names: the model is renamed into place
    // there (renaming onto the link itself would replace the link, not fill the directory).
    let linked;
    let out = match std::fs::symlink_metadata(out) {
        Ok(m) if m.file_type().is_symlink() => {
            linked = std::fs::canonicalize(out).map_err(|e| {
                Error::Invalid(format!(
                    "{}: a symbolic link to nothing that exists ({e}); choose a new output \
                     directory",
                    out.display()
                ))
            })?;
            linked.as_path()
        }
        _ => out,
    };
    // `.` or `..` (or `/`) name no directory that can be renamed into place.
    crate::atomic::check_dir_name("--out", out)?;
    if out.file_name().is_none() {
        return Err(Error::Invalid(format!(
            "--out {}: name the new model directory (e.g. {}/model); convert writes a \
             directory and renames it into place",
            out.display(),
            out.display()
        )));
    }
    if out.exists() && !out.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: {}; convert writes a model directory there: choose a new directory",
            out.display(),
            crate::error::not_a_directory(out)
        )));
    }
    if out.exists()
        && std::fs::read_dir(out)
            .map_err(|e| Error::io(out, e))?
            .next()
            .is_some()
    {
        return Err(Error::Invalid(format!(
            "{}: exists and is not empty; choose a new output directory",
            out.display()
        )));
    }
    let cfg = model_config(input, config)?;
    let layout = Layout::new(&cfg);
    let (files, weight_map) = if input.is_dir() {
        weight_sources(input)?
    } else {
        (vec![input.to_path_buf()], None)
    };
    let mut tensors = HashMap::new();
    let (mut format, mut dropped) = ("", 0);
    // Our name → the file it was read from, for the index's cross-check.
    let mut read_from: HashMap<String, String> = HashMap::new();
    for f in &files {
        let (fmt, d) = read_weights(f, &layout, &mut tensors)?;
        format = fmt;
        dropped += d;
        let name = f.file_name().unwrap_or_default().to_string_lossy();
        for k in tensors.keys() {
            read_from
                .entry(k.clone())
                .or_insert_with(|| name.to_string());
        }
    }
    if let Some(map) = &weight_map {
        check_weight_map(input, map, &read_from)?;
    }
    let count = tensors.len();
    let values = from_hf_tensors(&layout, &mut tensors, &files[0])?;
    // Written beside `out` and renamed into place, so a failure leaves no half directory (and
    // a killed convert's is removed by the next one).
    let tmp = crate::atomic_dir::AtomicDir::create(out)?;
    write_model_dir(&cfg, &layout, &|i| values[i].clone(), tmp.path())?;
    crate::checksum::write_manifest(tmp.path(), &model_files(&cfg))?;
    tmp.commit()?;
    Ok(Converted {
        format,
        parameters: values.iter().map(|v| v.len() as u64).sum(),
        config: cfg,
        tensors: count,
        dropped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lightning_names_and_buffers() {
        assert_eq!(
            hf_name("model.gpt_neox.embed_in.weight"),
            "gpt_neox.embed_in.weight"
        );
        assert_eq!(hf_name("model.embed_out.weight"), "embed_out.weight");
        assert_eq!(hf_name("lm_head.weight"), "embed_out.weight");
        assert_eq!(
            hf_name("module.gpt_neox.final_layer_norm.bias"),
            "gpt_neox.final_layer_norm.bias"
        );
        // Only the wrapper prefix goes; other keys are left to fail the parameter check.
        assert_eq!(hf_name("model.other.weight"), "model.other.weight");
        assert!(is_buffer("gpt_neox.layers.3.attention.bias"));
        assert!(is_buffer("gpt_neox.layers.3.attention.masked_bias"));
        assert!(is_buffer("gpt_neox.layers.0.attention.rotary_emb.inv_freq"));
        assert!(is_buffer("gpt_neox.rotary_emb.inv_freq"));
        assert!(!is_buffer(
            "gpt_neox.layers.3.attention.query_key_value.bias"
        ));
        assert!(!is_buffer("gpt_neox.layers.3.attention.dense.bias"));
    }

    #[test]
    fn files_of_neither_format_are_told_apart() {
        // A safetensors file cut after 4 bytes (its header length starts with 0x80).
        assert!(not_weights(&[0x80, 0x01, 0, 0]).contains("too short"));
        assert!(not_weights(b"").contains("too short"));
        // torch.save before 1.6: PROTO 2, then the magic number's LONG1.
        let legacy = [0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9];
        assert!(not_weights(&legacy).contains("a pickle without the ZIP container"));
        assert!(not_weights(b"PK\x03\x04abcde").contains("ZIP archive"));
        assert!(not_weights(&[0x80, 0x01, 0, 0, 0, 0, 0, 0, b'[']).contains("neither"));
    }

    /// The index must say where each tensor is: one in another shard than the index puts it,
    /// one the index lists that no shard holds, and one a shard holds that the index omits are
    /// refused by name; buffers (`rotary_emb.inv_freq`) it may list freely.
    #[test]
    fn the_weight_map_must_match_the_shards() {
        let dir = Path::new("hf");
        let map = |pairs: &[(&str, &str)]| -> WeightMap {
            pairs
                .iter()
                .map(|(k, f)| (k.to_string(), f.to_string()))
                .collect()
        };
        let read: HashMap<String, String> = [
            ("gpt_neox.embed_in.weight", "a.safetensors"),
            ("embed_out.weight", "b.safetensors"),
        ]
        .iter()
        .map(|(k, f)| (k.to_string(), f.to_string()))
        .collect();
        let good = [
            ("gpt_neox.embed_in.weight", "a.safetensors"),
            ("embed_out.weight", "b.safetensors"),
            (
                "gpt_neox.layers.0.attention.rotary_emb.inv_freq",
                "a.safetensors",
            ),
        ];
        check_weight_map(dir, &map(&good), &read).unwrap();
        let e = |m: WeightMap| check_weight_map(dir, &m, &read).unwrap_err().to_string();
        let moved = e(map(&[good[0], ("embed_out.weight", "a.safetensors")]));
        assert!(
            moved.contains("puts 'embed_out.weight' in a.safetensors, but b"),
            "{moved}"
        );
        let bogus = e(map(&[
            good[0],
            good[1],
            ("gpt_neox.bogus.weight", "a.safetensors"),
        ]));
        assert!(bogus.contains("'gpt_neox.bogus.weight' in a.safetensors, and no shard"));
        let omitted = e(map(&[good[0]]));
        assert!(
            omitted.contains("does not list 'embed_out.weight'"),
            "{omitted}"
        );
    }

    #[test]
    fn an_index_names_only_files_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let index = |map: &str| {
            let text = format!("{{\"weight_map\": {map}}}");
            std::fs::write(d.join("model.safetensors.index.json"), text).unwrap();
            weight_sources(d).map(|w| w.0).map_err(|e| e.to_string())
        };
        let e = index("{}").unwrap_err();
        assert!(e.contains("lists no weight files"), "{e}");
        for hostile in ["/etc/passwd", "../other/model.safetensors", "a/../../b", ""] {
            let e = index(&format!("{{\"w\": \"{hostile}\"}}")).unwrap_err();
            assert!(e.contains("not a file beside the index"), "{hostile}: {e}");
        }
        let e = index(r#"{"a": "m-1.safetensors"}"#).unwrap_err();
        assert!(e.contains("names the shard 'm-1.safetensors'") && e.contains("missing"));
        for f in ["m-1.safetensors", "m-2.safetensors"] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        let files =
            index(r#"{"a": "m-2.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}"#)
                .unwrap();
        assert_eq!(
            files,
            [d.join("m-1.safetensors"), d.join("m-2.safetensors")]
        );
        // With a single model.safetensors beside the index (and a pytorch_model.bin), that
        // file is read, as transformers' from_pretrained reads it; the shards came first.
        std::fs::write(d.join("pytorch_model.bin"), b"x").unwrap();
        std::fs::write(d.join(WEIGHTS_FILE), b"x").unwrap();
        assert_eq!(
            weight_sources(d).map(|w| w.0).unwrap(),
            [d.join(WEIGHTS_FILE)]
        );
        std::fs::remove_file(d.join(WEIGHTS_FILE)).unwrap();
        assert_eq!(weight_sources(d).map(|w| w.0).unwrap().len(), 2);
        std::fs::remove_file(d.join("model.safetensors.index.json")).unwrap();
        assert_eq!(
            weight_sources(d).map(|w| w.0).unwrap(),
            [d.join("pytorch_model.bin")]
        );
    }
}
