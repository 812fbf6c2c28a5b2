//! Reading a config: a genslm TOML file or a built-in preset, bounded in size, validated,
//! and which `[train]` keys it sets.

use std::path::Path;

use super::{Config, ModelConfig};
use crate::error::{Error, Result};

/// The largest config file read (TOML or config.json): real ones take a few KB, so a larger
/// file is not one and is refused without being read whole.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A config file's text, refused past [`MAX_CONFIG_BYTES`].
pub fn read_config_text(path: &Path) -> Result<String> {
    // A named pipe would wait for a writer forever; a directory is no config file.
    crate::error::file_or_missing(path, "a config (genslm TOML or config.json)")?;
    let Some(bytes) = crate::error::read_capped(path, MAX_CONFIG_BYTES)? else {
        return Err(Error::Config {
            file: path.to_path_buf(),
            msg: format!("more than {MAX_CONFIG_BYTES} bytes: not a model or training config"),
        });
    };
    String::from_utf8(bytes).map_err(|e| Error::Config {
        file: path.to_path_buf(),
        msg: format!(
            "not text (invalid UTF-8 at byte {}): a config is a genslm TOML or a Hugging Face \
             config.json, not weights or an archive",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// A parser's message with each line cut to 200 characters: it quotes the offending line,
/// which in a hostile file can be megabytes long.
pub fn short_lines(msg: &str) -> String {
    msg.trim_end()
        .lines()
        .map(|l| match l.char_indices().nth(200) {
            Some((i, _)) => format!("{}…", &l[..i]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The presets of `configs/`, built into the binary: `--config genslm-25m` works from any
/// directory (bench's defaults were paths that only existed in the repository's root).
pub const PRESETS: [(&str, &str); 6] = [
    ("tiny", include_str!("../../configs/tiny.toml")),
    ("genslm-25m", include_str!("../../configs/genslm-25m.toml")),
    (
        "genslm-250m",
        include_str!("../../configs/genslm-250m.toml"),
    ),
    (
        "genslm-2.5b",
        include_str!("../../configs/genslm-2.5b.toml"),
    ),
    ("genslm-25b", include_str!("../../configs/genslm-25b.toml")),
    ("genslm-33b", include_str!("../../configs/genslm-33b.toml")),
];

/// The built-in preset `path` names: a bare name (no directory, no `.toml`) of [`PRESETS`]
/// that is not also a file here (a file of that name is read instead; a directory, a run
/// trained into `--out tiny` say, is no config and does not hide the preset).
pub fn preset(path: &Path) -> Option<&'static str> {
    let name = path.to_str()?;
    if name.contains('/') || (path.exists() && !path.is_dir()) {
        return None;
    }
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}

impl Config {
    /// Reads and validates a TOML config, or a built-in preset by name ([`preset`]); errors
    /// name the file and the field.
    pub fn load(path: &Path) -> Result<Self> {
        Self::parse(path, &Self::text(path)?)
    }

    /// [`Config::load`], with the keys the file's `[train]` table sets (none where it has
    /// none): which settings the file chose, not the defaults filled in around them. The file
    /// is read once. `[train]` is not validated here: `train` validates it after its flags
    /// (a flag that corrects a bad value was refused over the file's), and the other callers
    /// do not read it ([`Config::load_model`]).
    pub fn load_keyed(path: &Path) -> Result<(Self, Vec<String>)> {
        let text = Self::text(path)?;
        let cfg = Self::parse_model_checked(path, &text)?;
        let v: toml::Table = toml::from_str(&text).map_err(|e| Error::Config {
            file: path.to_path_buf(),
            msg: short_lines(&e.to_string()),
        })?;
        let keys = v
            .get("train")
            .and_then(|t| t.as_table())
            .map(|t| t.keys().cloned().collect())
            .unwrap_or_default();
        Ok((cfg, keys))
    }

    /// The `[model]` of a config, for a command that takes its other settings from its own
    /// flags (`command` names it): the file's `[train]` settings are said to be unread (plan
    /// gave a bf16 batch-1 plan for a config asking for fp32, ZeRO-3 and batch 8, silently).
    pub fn load_model(path: &Path, command: &str) -> Result<ModelConfig> {
        let (cfg, keys) = Self::load_keyed(path)?;
        if !keys.is_empty() {
            eprintln!(
                "note: {}'s [train] settings ({}) are not read by {command}, which takes its \
                 settings from its flags",
                path.display(),
                crate::error::first_five(&keys)
            );
        }
        Ok(cfg.model)
    }

    /// `text`, the config read from `path`, parsed and validated.
    fn parse(path: &Path, text: &str) -> Result<Self> {
        let cfg = Self::parse_model_checked(path, text)?;
        cfg.train.validate().map_err(|msg| Error::Config {
            file: path.to_path_buf(),
            msg,
        })?;
        Ok(cfg)
    }

    /// `text` parsed, its `[model]` validated.
    fn parse_model_checked(path: &Path, text: &str) -> Result<Self> {
        let cfg: Config = toml::from_str(text).map_err(|e| Error::Config {
            file: path.to_path_buf(),
            msg: short_lines(&e.to_string()),
        })?;
        cfg.model.validate().map_err(|msg| Error::Config {
            file: path.to_path_buf(),
            msg,
        })?;
        Ok(cfg)
    }

    /// The text of a config file, or of a built-in preset by name.
    fn text(path: &Path) -> Result<String> {
        Ok(match preset(path) {
            Some(text) => {
                if path.is_dir() {
                    eprintln!(
                        "note: --config {0} is the built-in preset {0}; the directory of that \
                         name here is not read (give ./{0} for it)",
                        path.display()
                    );
                }
                text.to_string()
            }
            None => read_config_text(path).map_err(|e| match e {
                // A bare name that is no file and no preset: say which names are built in.
                Error::Io { .. } if !path.exists() && !path.to_string_lossy().contains('/') => {
                    Error::Invalid(format!(
                        "{e}; built-in presets: {}",
                        PRESETS.map(|(n, _)| n).join(", ")
                    ))
                }
                e => e,
            })?,
        })
    }
}
