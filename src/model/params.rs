//! The model's parameters: one flat list, named and shaped as Hugging Face GPT-NeoX names them.
//!
//! Every parameter is stored as a 1-D tensor and reshaped where it is used. That keeps the
//! optimizer, gradient clipping, checkpoints and (later) ZeRO sharding simple: they all work on a
//! list of flat vectors with names. Matrices are kept as `[in, out]` (x @ W); Hugging Face stores
//! Linear weights as `[out, in]`, so [`ParamSpec::hf_transposed`] marks the ones to transpose on
//! the way to and from safetensors. The name mapping lives here, in one place.

use crate::config::{ModelConfig, Position};
use crate::rng::{Domain, SplitMix64};

/// How a parameter is initialised (Hugging Face GPT-NeoX's `_init_weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal(f64),
    Ones,
    Zeros,
}

/// One parameter: HF name, our shape, and whether HF stores it transposed.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub hf_transposed: bool,
    pub init: Init,
    /// Receives weight decay (matrices and embeddings; not LayerNorm or biases).
    pub decay: bool,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Shape as stored in a Hugging Face checkpoint.
    pub fn hf_shape(&self) -> Vec<usize> {
        if self.hf_transposed {
            vec![self.shape[1], self.shape[0]]
        } else {
            self.shape.clone()
        }
    }
}

/// Indices of one transformer layer's parameters in the flat list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerParams {
    pub ln1_w: usize,
    pub ln1_b: usize,
    pub ln2_w: usize,
    pub ln2_b: usize,
    pub qkv_w: usize,
    pub qkv_b: usize,
    pub dense_w: usize,
    pub dense_b: usize,
    pub fc1_w: usize,
    pub fc1_b: usize,
    pub fc2_w: usize,
    pub fc2_b: usize,
}

impl LayerParams {
    /// Every index of the layer, in declaration order.
    pub fn all(&self) -> [usize; 12] {
        [
            self.ln1_w,
            self.ln1_b,
            self.ln2_w,
            self.ln2_b,
            self.qkv_w,
            self.qkv_b,
            self.dense_w,
            self.dense_b,
            self.fc1_w,
            self.fc1_b,
            self.fc2_w,
            self.fc2_b,
        ]
    }
}

/// Where every parameter of a model lives in the flat list.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub specs: Vec<ParamSpec>,
    pub embed_in: usize,
    /// Learned absolute positions (genslm extension; not in HF GPT-NeoX).
    pub embed_pos: Option<usize>,
    pub layers: Vec<LayerParams>,
    pub final_ln_w: usize,
    pub final_ln_b: usize,
    pub embed_out: usize,
}

/// Name of the learned position table in checkpoints.
pub const EMBED_POS: &str = "gpt_neox.embed_pos.weight";
/// HF's initializer_range default, used by GenSLM.
pub const INIT_STD: f64 = 0.02;

impl Layout {
    pub fn new(m: &ModelConfig) -> Self {
        let (h, i, v) = (m.hidden_size, m.intermediate_size, m.vocab_size);
        let mut specs = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, hf_transposed: bool, init: Init| {
            let decay = shape.len() == 2;
            specs.push(ParamSpec {
                name,
                shape,
                hf_transposed,
                init,
                decay,
            });
            specs.len() - 1
        };
        let normal = Init::Normal(INIT_STD);
        let embed_in = add("gpt_neox.embed_in.weight".into(), vec![v, h], false, normal);
        let embed_pos = (m.position == Position::Learned).then(|| {
            add(
                EMBED_POS.into(),
                vec![m.max_position_embeddings, h],
                false,
                normal,
            )
        });
        let mut layers = Vec::new();
        for l in 0..m.num_layers {
            let p = |s: &str| format!("gpt_neox.layers.{l}.{s}");
            layers.push(LayerParams {
                ln1_w: add(p("input_layernorm.weight"), vec![h], false, Init::Ones),
                ln1_b: add(p("input_layernorm.bias"), vec![h], false, Init::Zeros),
                ln2_w: add(
                    p("post_attention_layernorm.weight"),
                    vec![h],
                    false,
                    Init::Ones,
                ),
                ln2_b: add(
                    p("post_attention_layernorm.bias"),
                    vec![h],
                    false,
                    Init::Zeros,
                ),
                qkv_w: add(
                    p("attention.query_key_value.weight"),
                    vec![h, 3 * h],
                    true,
                    normal,
                ),
                qkv_b: add(
                    p("attention.query_key_value.bias"),
                    vec![3 * h],
                    false,
                    Init::Zeros,
                ),
                dense_w: add(p("attention.dense.weight"), vec![h, h], true, normal),
                dense_b: add(p("attention.dense.bias"), vec![h], false, Init::Zeros),
                fc1_w: add(p("mlp.dense_h_to_4h.weight"), vec![h, i], true, normal),
                fc1_b: add(p("mlp.dense_h_to_4h.bias"), vec![i], false, Init::Zeros),
                fc2_w: add(p("mlp.dense_4h_to_h.weight"), vec![i, h], true, normal),
                fc2_b: add(p("mlp.dense_4h_to_h.bias"), vec![h], false, Init::Zeros),
            });
        }
        let final_ln_w = add(
            "gpt_neox.final_layer_norm.weight".into(),
            vec![h],
            false,
            Init::Ones,
        );
        let final_ln_b = add(
            "gpt_neox.final_layer_norm.bias".into(),
            vec![h],
            false,
            Init::Zeros,
        );
        let embed_out = add("embed_out.weight".into(), vec![h, v], true, normal);
        Self {
            specs,
            embed_in,
            embed_pos,
            layers,
            final_ln_w,
            final_ln_b,
            embed_out,
        }
    }

    pub fn num_params(&self) -> usize {
        self.specs.iter().map(ParamSpec::numel).sum()
    }

    /// Initial values, drawn from `seed` parameter by parameter (each from its own stream, so
    /// a value does not depend on the order of the others).
    pub fn init_host(&self, seed: u64) -> Vec<Vec<f32>> {
        (0..self.specs.len())
            .map(|k| self.init_param(seed, k))
            .collect()
    }

    /// Parameter `k`'s initial values (one of [`Layout::init_host`]'s, drawn alone).
    pub fn init_param(&self, seed: u64, k: usize) -> Vec<f32> {
        let s = &self.specs[k];
        match s.init {
            Init::Ones => vec![1.0; s.numel()],
            Init::Zeros => vec![0.0; s.numel()],
            Init::Normal(std) => {
                let mut g = SplitMix64::stream(seed, Domain::Init, k as u64);
                (0..s.numel()).map(|_| (g.normal() * std) as f32).collect()
            }
        }
    }
}

/// Row-major transpose of a `[rows, cols]` matrix.
pub fn transpose(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = data[r * cols + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn layout_counts_match_config() {
        for name in ["tiny", "genslm-25m"] {
            let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join(format!("configs/{name}.toml"));
            let cfg = Config::load(&path).unwrap().model;
            assert_eq!(Layout::new(&cfg).num_params() as u64, cfg.param_count());
        }
    }

    #[test]
    fn transpose_small() {
        assert_eq!(
            transpose(&[1., 2., 3., 4., 5., 6.], 2, 3),
            vec![1., 4., 2., 5., 3., 6.]
        );
    }
}
