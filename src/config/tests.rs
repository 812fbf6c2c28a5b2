//! The config checks against hand-computed shapes and the values each field refuses.
use super::*;

fn shape(l: usize, h: usize, heads: usize, i: usize) -> ModelConfig {
    ModelConfig {
        name: "t".into(),
        num_layers: l,
        hidden_size: h,
        num_heads: heads,
        intermediate_size: i,
        vocab: VocabKind::Genslm69,
        vocab_size: 69,
        max_position_embeddings: 2048,
        position: Position::Rotary,
        rotary_pct: 0.25,
        rotary_base: 10000.0,
        layer_norm_eps: 1e-5,
        attention: AttentionKind::Flash,
    }
}

#[test]
fn hf_param_counts() {
    // Counts printed by `sum(p.numel() for p in GPTNeoXForCausalLM(cfg).parameters())`.
    assert_eq!(shape(8, 512, 8, 2048).param_count(), 25_290_752);
    assert_eq!(shape(28, 3840, 32, 4096).param_count(), 2_533_931_008);
}

#[test]
fn rejects_constants_that_are_not_usable_in_f32() {
    for (field, set) in [
        (
            "rotary_base",
            (|c: &mut ModelConfig, v| c.rotary_base = v) as fn(&mut _, f64),
        ),
        ("layer_norm_eps", |c, v| c.layer_norm_eps = v),
    ] {
        // 1e-40 is subnormal in f32: outside the range the message states.
        for v in [f64::INFINITY, f64::NAN, 0.0, -1.0, 1e-50, 1e-40, 1e39] {
            let mut c = shape(2, 64, 4, 128);
            set(&mut c, v);
            let err = c.validate().unwrap_err();
            assert!(err.contains(field), "{field} = {v}: {err}");
        }
    }
    for eps in [f64::INFINITY, 1e-50] {
        let t = TrainConfig {
            eps,
            ..Default::default()
        };
        assert!(t.validate().unwrap_err().contains("`eps`"), "{eps}");
    }
    let t = TrainConfig {
        weight_decay: f64::INFINITY,
        ..Default::default()
    };
    assert!(t.validate().unwrap_err().contains("weight_decay"));
    // An infinite clip was saved as JSON null in the trainer state, which the resume refused.
    for max_grad_norm in [f64::INFINITY, f64::NAN, -1.0] {
        let t = TrainConfig {
            max_grad_norm,
            ..Default::default()
        };
        let err = t.validate().unwrap_err();
        assert!(err.contains("`max_grad_norm`"), "{max_grad_norm}: {err}");
    }
    assert!(TrainConfig::default().validate().is_ok());
}

#[test]
fn rejects_a_rotary_pct_that_rotates_nothing() {
    // head dim 16: int(16 · 0.05) = 0 rotary dims; 0.125 gives 2.
    let mut c = shape(2, 64, 4, 128);
    c.rotary_pct = 0.05;
    let err = c.validate().unwrap_err();
    assert!(
        err.contains("0 rotary dims") && err.contains("0.125"),
        "{err}"
    );
    c.rotary_pct = 0.125;
    assert!(c.validate().is_ok());
    c.rotary_pct = 0.05;
    c.position = Position::Alibi;
    assert!(c.validate().is_ok(), "rotary_pct is unused without rotary");
}

#[test]
fn rejects_indivisible_heads() {
    let err = shape(2, 100, 3, 64).validate().unwrap_err();
    assert!(
        err.contains("hidden_size") && err.contains("num_heads"),
        "{err}"
    );
}

#[test]
fn hostile_config_files_give_short_errors() {
    let dir = tempfile::tempdir().unwrap();
    // One line of 200,000 nested brackets: the parser's message quotes it, cut short.
    let deep = dir.path().join("deep.toml");
    std::fs::write(
        &deep,
        format!("a={}{}", "[".repeat(100_000), "]".repeat(100_000)),
    )
    .unwrap();
    let e = Config::load(&deep).unwrap_err().to_string();
    assert!(
        e.contains("deep.toml") && e.len() < 2000,
        "{} bytes",
        e.len()
    );
    // A file past the size bound is refused unread.
    let big = dir.path().join("big.toml");
    std::fs::write(&big, "#".repeat((MAX_CONFIG_BYTES + 1) as usize)).unwrap();
    let e = Config::load(&big).unwrap_err().to_string();
    assert!(e.contains("more than 1048576 bytes"), "{e}");
    assert_eq!(short_lines("ab\ncd"), "ab\ncd");
    assert_eq!(
        short_lines(&"x".repeat(300)),
        format!("{}…", "x".repeat(200))
    );
}

/// `fp32` in a file means unquantized, as the flags take it; an unset value survives the
/// trainer state's JSON (null); anything else is refused naming the choices.
#[test]
fn quantize_settings_read_fp32_and_null_as_unset() {
    let read = |v: &str| {
        let text = format!("quantize_grads = {v}\nquantize_weights = \"bf16\"\n");
        toml::from_str::<TrainConfig>(&text).map_err(|e| e.to_string())
    };
    let t = read("\"fp32\"").unwrap();
    assert_eq!(
        (t.quantize_grads, t.quantize_weights),
        (None, Some(Quantize::Bf16))
    );
    assert_eq!(
        read("\"int8\"").unwrap().quantize_grads,
        Some(Quantize::Int8)
    );
    let e = read("\"fp16\"").unwrap_err();
    assert!(e.contains("int8, bf16, or fp32"), "{e}");
    let json = serde_json::to_string(&TrainConfig::default()).unwrap();
    assert!(json.contains("\"quantize_grads\":null"), "{json}");
    let back: TrainConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, TrainConfig::default());
}

/// A model name is printed and exported: control characters in it are refused by field.
#[test]
fn a_model_name_with_control_characters_is_refused() {
    let mut m = shape(2, 64, 4, 256);
    assert!(m.validate().is_ok());
    m.name = "a\nb\u{1b}[31m".into();
    let e = m.validate().unwrap_err();
    assert!(e.contains("field `name`") && e.contains("\\u{a}"), "{e}");
    // Invisible characters that reorder or hide text, too; other scripts pass.
    for bad in ["evil\u{202e}txt.exe", "a\u{200b}b", "a\u{2028}b"] {
        m.name = bad.into();
        assert!(m.validate().unwrap_err().contains("invisible"), "{bad:?}");
    }
    m.name = "génome-α 基因".into();
    assert!(m.validate().is_ok());
}

/// Every integer a run records in its config.toml reads back: past i64::MAX (TOML's largest
/// integer) it is refused by field, and at it the TOML round trip holds (a seed of 2⁶⁴ − 1
/// trained, then its config.toml and checkpoint could not be read).
#[test]
fn integers_a_toml_file_cannot_hold_are_refused() {
    let too_big = i64::MAX as u64 + 1;
    for (field, t) in [
        (
            "seed",
            TrainConfig {
                seed: u64::MAX,
                ..Default::default()
            },
        ),
        (
            "warmup",
            TrainConfig {
                warmup: too_big,
                ..Default::default()
            },
        ),
        (
            "val_every",
            TrainConfig {
                val_every: too_big,
                ..Default::default()
            },
        ),
    ] {
        let err = t.validate().unwrap_err();
        assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
    }
    let t = TrainConfig {
        seed: i64::MAX as u64,
        warmup: i64::MAX as u64,
        ..Default::default()
    };
    t.validate().unwrap();
    let text = toml::to_string(&t).unwrap();
    let back: TrainConfig = toml::from_str(&text).unwrap();
    assert_eq!(back, t);
}
