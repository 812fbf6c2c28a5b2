//! Hugging Face GPT-NeoX compatibility: `config.json` both ways.
//!
//! transformers ≥ 5 writes rotary settings as `rope_parameters.{partial_rotary_factor,
//! rope_theta}`; older files (GenSLM's) use `rotary_pct` / `rotary_emb_base`. Both are read;
//! both are written so either generation of transformers loads our checkpoints. Position
//! encodings other than rotary are a genslm extension recorded as `genslm_position`
//! (transformers ignores the key; such checkpoints only run in genslm).

use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{ModelConfig, Position};
use crate::tokenizer::VocabKind;

#[derive(Debug, Clone, Deserialize)]
struct RopeParameters {
    partial_rotary_factor: Option<f64>,
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// transformers < 5's `rope_scaling` (`{"type"|"rope_type": "linear"|"dynamic"|..., ...}`).
#[derive(Debug, Clone, Deserialize)]
struct RopeScaling {
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_type: Option<String>,
}

/// The fields of `GPTNeoXConfig` genslm reads.
#[derive(Debug, Clone, Deserialize)]
struct HfConfigIn {
    model_type: Option<String>,
    hidden_size: usize,
    num_attention_heads: usize,
    num_hidden_layers: usize,
    intermediate_size: usize,
    vocab_size: usize,
    max_position_embeddings: usize,
    rotary_pct: Option<f64>,
    rotary_emb_base: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeScaling>,
    layer_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    use_parallel_residual: Option<bool>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    genslm_position: Option<Position>,
    genslm_vocab: Option<VocabKind>,
    genslm_name: Option<String>,
}

/// Parses a GPT-NeoX `config.json`; the error says which field is missing or unsupported.
pub fn config_from_hf(text: &str) -> Result<ModelConfig, String> {
    // A byte-order mark (Windows editors write one) is no JSON: serde refused it at column 1.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // serde reads an array into the struct by position ("invalid type: integer `1`, expected
    // a string"): a config.json is one object.
    let first = text
        .trim_start_matches(['\u{feff}', ' ', '\t', '\r', '\n'])
        .chars()
        .next();
    if first.is_some_and(|c| c != '{') {
        return Err("not a JSON object: a config.json is one {…} of settings".into());
    }
    let c: HfConfigIn = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if let Some(t) = &c.model_type {
        if t != "gpt_neox" && t != REMOTE_MODEL_TYPE {
            return Err(format!(
                "model_type is '{t}'; genslm reads GPT-NeoX (gpt_neox, or {REMOTE_MODEL_TYPE} \
                 for learned/ALiBi positions) models"
            ));
        }
    }
    if let Some(act) = &c.hidden_act {
        if act != "gelu_fast" && act != "gelu_new" && act != "gelu_pytorch_tanh" {
            return Err(format!(
                "hidden_act '{act}' is not supported (genslm implements the tanh GELU, 'gelu_fast')"
            ));
        }
    }
    if c.use_parallel_residual == Some(false) {
        return Err("use_parallel_residual = false is not supported".into());
    }
    if c.tie_word_embeddings == Some(true) {
        return Err("tie_word_embeddings = true is not supported (GenSLM unties them)".into());
    }
    if c.attention_bias == Some(false) {
        return Err("attention_bias = false is not supported".into());
    }
    let rope = c.rope_parameters.as_ref();
    // genslm implements plain rotary only: a scaled rotary (linear, dynamic NTK, YaRN, ...)
    // loaded as plain would give different logits without a word.
    let scaling = [
        rope.and_then(|r| r.rope_type.clone()),
        c.rope_scaling.as_ref().and_then(|r| r.rope_type.clone()),
        c.rope_scaling.as_ref().and_then(|r| r.kind.clone()),
    ];
    if let Some(kind) = scaling.into_iter().flatten().find(|k| k != "default") {
        return Err(format!(
            "rotary scaling '{kind}' (rope_scaling / rope_parameters.rope_type) is not \
             supported: genslm implements the default (unscaled) rotary embedding only"
        ));
    }
    // Both spellings present and different: which one transformers uses depends on its
    // version, so no choice here would be safe.
    for (old, old_name, new, new_name) in [
        (
            c.rotary_pct,
            "rotary_pct",
            rope.and_then(|r| r.partial_rotary_factor),
            "rope_parameters.partial_rotary_factor",
        ),
        (
            c.rotary_emb_base,
            "rotary_emb_base",
            rope.and_then(|r| r.rope_theta),
            "rope_parameters.rope_theta",
        ),
    ] {
        if let (Some(a), Some(b)) = (old, new) {
            if a != b {
                return Err(format!(
                    "{old_name} {a} and {new_name} {b} disagree: which one a reader uses \
                     depends on its transformers version; keep one"
                ));
            }
        }
    }
    if c.model_type.as_deref() == Some("gpt_neox")
        && c.genslm_position.is_some_and(|p| p != Position::Rotary)
    {
        return Err(format!(
            "model_type 'gpt_neox' with genslm_position '{}': transformers runs every gpt_neox \
             model with rotary positions, so this file would mean two models; genslm writes \
             learned and ALiBi models as model_type '{REMOTE_MODEL_TYPE}'",
            c.genslm_position.map(|p| p.to_string()).unwrap_or_default()
        ));
    }
    let rotary_pct = c
        .rotary_pct
        .or_else(|| rope.and_then(|r| r.partial_rotary_factor))
        .unwrap_or(0.25);
    let rotary_base = c
        .rotary_emb_base
        .or_else(|| rope.and_then(|r| r.rope_theta))
        .unwrap_or(10000.0);
    // Without genslm's own key the vocabulary is read from the table's size only where that
    // size says it: 69 or 70 rows can only be genslm69, 71 is genslm71. A larger table (padded
    // to 128, as training frameworks do) could be either, and the two number the codons
    // differently, so guessing would score and sample with the wrong tokens.
    let vocab = match (c.genslm_vocab, c.vocab_size) {
        (Some(v), _) => v,
        (None, 69 | 70) => VocabKind::Genslm69,
        (None, 71) => VocabKind::Genslm71,
        (None, n) if n > 71 => {
            return Err(format!(
                "vocab_size {n} does not say which codon vocabulary the ids mean (genslm69 has \
                 69 tokens, genslm71 71; a padded table can be either): add \
                 \"genslm_vocab\": \"genslm69\" or \"genslm71\" to config.json"
            ))
        }
        (None, _) => VocabKind::Genslm69,
    };
    let cfg = ModelConfig {
        name: c.genslm_name.unwrap_or_else(|| "hf-gpt-neox".into()),
        num_layers: c.num_hidden_layers,
        hidden_size: c.hidden_size,
        num_heads: c.num_attention_heads,
        intermediate_size: c.intermediate_size,
        vocab,
        vocab_size: c.vocab_size,
        max_position_embeddings: c.max_position_embeddings,
        position: c.genslm_position.unwrap_or(Position::Rotary),
        rotary_pct,
        rotary_base,
        layer_norm_eps: c.layer_norm_eps.unwrap_or(1e-5),
        attention: Default::default(),
    };
    // The checks speak genslm's TOML names; this file's reader knows the JSON keys.
    cfg.validate().map_err(|e| {
        [
            ("`num_heads`", "`num_attention_heads`"),
            ("`num_layers`", "`num_hidden_layers`"),
            ("`rotary_base`", "`rotary_emb_base`"),
            ("num_heads ", "num_attention_heads "),
        ]
        .iter()
        .fold(e, |e, (ours, json)| e.replace(ours, json))
    })?;
    Ok(cfg)
}

/// `model_type` of checkpoints with learned or ALiBi positions: transformers' GPT-NeoX knows
/// only rotary and would run them as rotary models (wrong logits, no warning), so they name
/// their own type, which transformers loads only through the modeling file they carry
/// ([`MODELING_PY`]) and only with `trust_remote_code=True`.
pub const REMOTE_MODEL_TYPE: &str = "genslm_neox";
/// The modeling file such checkpoints carry (`modeling_genslm.py`): genslm's forward for all
/// three positions under GPT-NeoX's parameter names.
pub const MODELING_PY: &str = include_str!("modeling_genslm.py");
pub const MODELING_FILE: &str = "modeling_genslm.py";

/// Whether a model of this config needs the modeling file (anything but rotary).
pub fn needs_remote_code(m: &ModelConfig) -> bool {
    m.position != Position::Rotary
}

/// A `config.json` that `GPTNeoXConfig.from_pretrained` accepts, old and new transformers
/// (rotary models), or that points transformers at [`MODELING_PY`] (learned/ALiBi).
///
/// The special-token ids are the vocabulary's own, so transformers' `generate()` starts and
/// stops where genslm does: genslm71's `[BOS]`/`[EOS]`; genslm69 has neither (null: generation
/// runs to its length limit, as genslm's does).
pub fn config_to_hf(m: &ModelConfig) -> Value {
    let tok = crate::tokenizer::CodonTokenizer::new(m.vocab).ok();
    let bos = tok.as_ref().and_then(|t| t.bos_id());
    let eos = tok.as_ref().and_then(|t| t.eos_id());
    let pad = tok.as_ref().map(|t| t.pad_id());
    let mut v = json!({
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_heads,
        "num_hidden_layers": m.num_layers,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rotary_pct": m.rotary_pct,
        "rotary_emb_base": m.rotary_base,
        "rope_parameters": {
            "rope_type": "default",
            "partial_rotary_factor": m.rotary_pct,
            "rope_theta": m.rotary_base,
        },
        "layer_norm_eps": m.layer_norm_eps,
        "hidden_act": "gelu_fast",
        "use_parallel_residual": true,
        "tie_word_embeddings": false,
        "attention_bias": true,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": true,
        "genslm_position": m.position,
        "genslm_vocab": m.vocab,
        "genslm_name": m.name,
    });
    if needs_remote_code(m) {
        let module = MODELING_FILE.trim_end_matches(".py");
        v["model_type"] = json!(REMOTE_MODEL_TYPE);
        v["architectures"] = json!(["GenSlmNeoXForCausalLM"]);
        v["auto_map"] = json!({
            "AutoConfig": format!("{module}.GenSlmNeoXConfig"),
            "AutoModelForCausalLM": format!("{module}.GenSlmNeoXForCausalLM"),
        });
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_genslm_and_new_transformers_styles() {
        let old = r#"{"architectures":["GPTNeoXForCausalLM"],"hidden_size":512,"num_attention_heads":8,
          "num_hidden_layers":8,"intermediate_size":2048,"hidden_act":"gelu_fast","layer_norm_eps":1e-05,
          "max_position_embeddings":2048,"model_type":"gpt_neox","rotary_emb_base":10000,"rotary_pct":0.25,
          "tie_word_embeddings":false,"vocab_size":69}"#;
        let c = config_from_hf(old).unwrap();
        assert_eq!((c.num_layers, c.hidden_size, c.rotary_dims()), (8, 512, 16));
        let new = include_str!("../../tests/fixtures/hf_neox_tiny/config.json");
        let c = config_from_hf(new).unwrap();
        assert_eq!(
            (c.num_heads, c.rotary_pct, c.rotary_base),
            (4, 0.25, 10000.0)
        );
        let back = config_from_hf(&config_to_hf(&c).to_string()).unwrap();
        assert_eq!(back.hidden_size, c.hidden_size);
        // Saved with a byte-order mark: read as without it.
        let bom = config_from_hf(&format!("\u{feff}{new}")).unwrap();
        assert_eq!(
            (bom.num_heads, bom.hidden_size),
            (c.num_heads, c.hidden_size)
        );
    }

    fn tiny(extra: &str) -> String {
        format!(
            r#"{{"model_type":"gpt_neox","hidden_size":16,"num_attention_heads":2,
            "num_hidden_layers":1,"intermediate_size":32,"max_position_embeddings":64{extra}}}"#
        )
    }

    /// Only a table of 69, 70 or 71 rows names its vocabulary; a padded one must say it.
    #[test]
    fn the_vocabulary_is_read_from_the_table_size_only_where_it_is_unambiguous() {
        for (n, want) in [(69, VocabKind::Genslm69), (70, VocabKind::Genslm69)] {
            let c = config_from_hf(&tiny(&format!(r#","vocab_size":{n}"#))).unwrap();
            assert_eq!(c.vocab, want, "{n}");
        }
        let c = config_from_hf(&tiny(r#","vocab_size":71"#)).unwrap();
        assert_eq!(c.vocab, VocabKind::Genslm71);
        let e = config_from_hf(&tiny(r#","vocab_size":128"#)).unwrap_err();
        assert!(
            e.contains("vocab_size 128") && e.contains("genslm_vocab"),
            "{e}"
        );
        let c = config_from_hf(&tiny(r#","vocab_size":128,"genslm_vocab":"genslm69""#)).unwrap();
        assert_eq!((c.vocab, c.vocab_size), (VocabKind::Genslm69, 128));
    }

    /// Refusals name config.json's keys, not genslm's TOML fields.
    #[test]
    fn refusals_name_the_json_keys() {
        let deep = tiny(r#","vocab_size":69"#)
            .replace(r#""num_hidden_layers":1"#, r#""num_hidden_layers":100000"#);
        let e = config_from_hf(&deep).unwrap_err();
        assert!(e.contains("`num_hidden_layers` (100000)"), "{e}");
        let one = tiny(r#","vocab_size":69"#)
            .replace(r#""num_attention_heads":2"#, r#""num_attention_heads":16"#);
        let e = config_from_hf(&one).unwrap_err();
        assert!(
            e.contains("num_attention_heads 16") && !e.contains("at least"),
            "{e}"
        );
    }

    #[test]
    fn rejects_other_architectures() {
        let e = config_from_hf(r#"{"model_type":"llama","hidden_size":8,"num_attention_heads":2,
            "num_hidden_layers":1,"intermediate_size":8,"vocab_size":69,"max_position_embeddings":8}"#)
        .unwrap_err();
        assert!(e.contains("llama"), "{e}");
    }

    /// The ids come from the vocabulary files (tokenizers/*.json), not from this module.
    #[test]
    fn learned_and_alibi_models_name_their_own_type() {
        let tiny = include_str!("../../tests/fixtures/hf_neox_tiny/config.json");
        let mut c = config_from_hf(tiny).unwrap();
        for pos in [Position::Rotary, Position::Learned, Position::Alibi] {
            c.position = pos;
            let hf = config_to_hf(&c);
            let remote = pos != Position::Rotary;
            let want = if remote {
                REMOTE_MODEL_TYPE
            } else {
                "gpt_neox"
            };
            assert_eq!(hf["model_type"], json!(want), "{pos}");
            assert_eq!(hf.get("auto_map").is_some(), remote, "{pos}");
            if remote {
                // The auto_map names classes that the carried file defines.
                for class in ["GenSlmNeoXConfig", "GenSlmNeoXForCausalLM"] {
                    assert!(hf["auto_map"].to_string().contains(class));
                    assert!(MODELING_PY.contains(&format!("class {class}(")), "{class}");
                }
                assert!(MODELING_PY.contains(&format!("model_type = \"{REMOTE_MODEL_TYPE}\"")));
            }
            // genslm reads back what it wrote.
            assert_eq!(config_from_hf(&hf.to_string()).unwrap(), c, "{pos}");
        }
    }

    #[test]
    fn special_token_ids_are_the_vocabularys() {
        let tiny = include_str!("../../tests/fixtures/hf_neox_tiny/config.json");
        let mut c = config_from_hf(tiny).unwrap();
        for (vocab, bos, eos) in [
            (VocabKind::Genslm71, Some("[BOS]"), Some("[EOS]")),
            (VocabKind::Genslm69, None, None),
        ] {
            c.vocab = vocab;
            let hf = config_to_hf(&c);
            let file: Value = serde_json::from_str(vocab_json(vocab)).unwrap();
            let id = |t: Option<&str>| t.map_or(Value::Null, |t| file["model"]["vocab"][t].clone());
            assert_eq!(hf["bos_token_id"], id(bos), "{vocab:?}");
            assert_eq!(hf["eos_token_id"], id(eos), "{vocab:?}");
            assert_eq!(hf["pad_token_id"], id(Some("[PAD]")), "{vocab:?}");
        }
        // genslm71's [BOS]/[EOS] are 2 and 3 (GenSLM's tokenizer file), never [UNK]'s 0.
        c.vocab = VocabKind::Genslm71;
        assert_eq!(
            (
                config_to_hf(&c)["bos_token_id"].clone(),
                config_to_hf(&c)["eos_token_id"].clone()
            ),
            (json!(2), json!(3))
        );
    }

    fn vocab_json(v: VocabKind) -> &'static str {
        match v {
            VocabKind::Genslm69 => include_str!("../../tokenizers/genslm69.json"),
            VocabKind::Genslm71 => include_str!("../../tokenizers/genslm71.json"),
        }
    }

    #[test]
    fn scaled_rotary_is_refused() {
        let tiny = include_str!("../../tests/fixtures/hf_neox_tiny/config.json");
        let mut v: Value = serde_json::from_str(tiny).unwrap();
        for (key, scaling) in [
            ("rope_scaling", json!({"type": "linear", "factor": 2.0})),
            (
                "rope_scaling",
                json!({"rope_type": "dynamic", "factor": 2.0}),
            ),
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 10000.0}),
            ),
        ] {
            v[key] = scaling;
            let e = config_from_hf(&v.to_string()).unwrap_err();
            assert!(
                e.contains("rotary scaling") && e.contains("not supported"),
                "{e}"
            );
            v.as_object_mut().unwrap().remove(key);
        }
        // The default type (what genslm writes) and a null rope_scaling still load.
        v["rope_scaling"] = Value::Null;
        v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 10000.0});
        config_from_hf(&v.to_string()).unwrap();
    }

    /// A file that says two things: both rotary spellings with different values, or the
    /// rotary model type with genslm's learned/ALiBi positions. Each reading gave different
    /// logits, and one was picked without a word.
    #[test]
    fn contradicting_fields_are_refused() {
        let tiny = include_str!("../../tests/fixtures/hf_neox_tiny/config.json");
        let base: Value = serde_json::from_str(tiny).unwrap();
        let check = |edit: &dyn Fn(&mut Value), want: &str| {
            let mut v = base.clone();
            edit(&mut v);
            let e = config_from_hf(&v.to_string()).unwrap_err();
            assert!(e.contains(want), "{e}");
        };
        check(
            &|v| {
                v["rotary_pct"] = json!(0.5);
                v["rope_parameters"] =
                    json!({"rope_type": "default", "partial_rotary_factor": 0.25});
            },
            "rotary_pct 0.5 and rope_parameters.partial_rotary_factor 0.25 disagree",
        );
        check(
            &|v| {
                v["rotary_emb_base"] = json!(10000.0);
                v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 500.0});
            },
            "rotary_emb_base 10000 and rope_parameters.rope_theta 500 disagree",
        );
        check(
            &|v| {
                v["model_type"] = json!("gpt_neox");
                v["genslm_position"] = json!("alibi");
            },
            "model_type 'gpt_neox' with genslm_position 'alibi'",
        );
        // Agreeing spellings load.
        let mut v = base.clone();
        v["rotary_pct"] = json!(0.25);
        v["rope_parameters"] = json!({"rope_type": "default", "partial_rotary_factor": 0.25});
        config_from_hf(&v.to_string()).unwrap();
    }
}
