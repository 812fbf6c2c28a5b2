//! Where a rank's starting weights and Adam moments come from, one parameter at a time: a fresh
//! initialisation drawn from the seed, or a checkpoint read tensor by tensor (weights from
//! `model.safetensors`, moments assembled from the optimizer shards). ZeRO-2/3 build their
//! shards from it unit by unit, so no rank ever holds the whole model: genslm-25b's fp32
//! weights alone are 100 GB, its moments 200 GB more.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::io::{hf_to_ours, CONFIG_FILE, WEIGHTS_FILE};
use crate::model::params::{Layout, ParamSpec};
use crate::model::tensors::TensorFile;
use crate::train::optim_shards::MomentShards;

/// The single optimizer file of checkpoints written before the shards (still read).
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// A parameter's host values in our layout.
pub type Values = Vec<f32>;

// One per run, read for every parameter: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum ParamSource {
    /// A new model drawn from `seed` (the values `GenSlm::init` gives).
    Init { layout: Layout, seed: u64 },
    /// A genslm checkpoint directory.
    Checkpoint {
        layout: Layout,
        weights: TensorFile,
        moments: Moments,
    },
}

/// A checkpoint's optimizer state.
pub enum Moments {
    Shards(MomentShards),
    /// One `optimizer.safetensors` (checkpoints written before the shards), HF names and shapes.
    Legacy(TensorFile),
}

impl ParamSource {
    pub fn init(cfg: &ModelConfig, seed: u64) -> Self {
        ParamSource::Init {
            layout: Layout::new(cfg),
            seed,
        }
    }

    /// Checkpoint directory `dir` of a model configured `cfg` (its `config.json`). With
    /// `verify`, every file read is first checked against the sha256 manifest, streaming
    /// (one rank does it: the reads themselves cannot, as they take pieces of files).
    pub fn checkpoint(dir: &Path, cfg: &ModelConfig, verify: bool) -> Result<Self> {
        let layout = Layout::new(cfg);
        let legacy = dir.join(OPTIMIZER_FILE).exists();
        let moments = if legacy {
            Moments::Legacy(TensorFile::open(&dir.join(OPTIMIZER_FILE))?)
        } else {
            Moments::Shards(MomentShards::open(dir, &layout)?)
        };
        if verify {
            let mut files = vec![CONFIG_FILE.to_string(), WEIGHTS_FILE.to_string()];
            match &moments {
                Moments::Shards(s) => files.extend_from_slice(s.file_names()),
                Moments::Legacy(_) => files.push(OPTIMIZER_FILE.to_string()),
            }
            let names: Vec<&str> = files.iter().map(String::as_str).collect();
            crate::checksum::verify(dir, &names)?;
        }
        let weights = dir.join(WEIGHTS_FILE);
        if !weights.is_file() {
            return Err(Error::Invalid(format!("{}: missing", weights.display())));
        }
        Ok(ParamSource::Checkpoint {
            layout,
            weights: TensorFile::open(&weights)?,
            moments,
        })
    }

    pub fn layout(&self) -> &Layout {
        match self {
            ParamSource::Init { layout, .. } | ParamSource::Checkpoint { layout, .. } => layout,
        }
    }

    /// Parameter `i`'s full values (our layout).
    pub fn values(&self, i: usize) -> Result<Values> {
        match self {
            ParamSource::Init { layout, seed } => Ok(layout.init_param(*seed, i)),
            ParamSource::Checkpoint {
                layout, weights, ..
            } => read_hf(weights, &layout.specs[i], ""),
        }
    }

    /// Parameter `i`'s full Adam moments `(m, v)`; `None` for a new model (zeros).
    pub fn moments(&self, i: usize) -> Result<Option<(Values, Values)>> {
        let ParamSource::Checkpoint {
            layout, moments, ..
        } = self
        else {
            return Ok(None);
        };
        let spec = &layout.specs[i];
        Ok(Some(match moments {
            Moments::Shards(s) => s.moments(&spec.name, &spec.shape)?,
            Moments::Legacy(f) => (
                read_hf(f, spec, ".exp_avg")?,
                read_hf(f, spec, ".exp_avg_sq")?,
            ),
        }))
    }
}

/// Tensor `spec.name + suffix` of `file` (HF's name and shape) in our layout.
fn read_hf(file: &TensorFile, spec: &ParamSpec, suffix: &str) -> Result<Values> {
    let t = file.read(&format!("{}{suffix}", spec.name))?;
    hf_to_ours(spec, t, file.path())
}
