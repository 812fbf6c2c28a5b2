//! Parity with Hugging Face transformers: a random GPT-NeoX saved by `save_pretrained`
//! (scripts/make_neox_fixture.py) loads through genslm's checkpoint loader and gives the logits
//! and loss transformers computed.

use burn::tensor::Device;
use genslm::model::io::load_model_dir;
use genslm::model::neox::next_token_nll;
use genslm::ops::primitive::{tensor_to_vec, tokens_tensor};

#[derive(serde::Deserialize)]
struct Expected {
    input_ids: Vec<Vec<u32>>,
    logits: Vec<f32>,
    logits_shape: Vec<usize>,
    loss: f64,
}

#[test]
fn logits_and_loss_match_transformers() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_neox_tiny");
    let exp: Expected =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let device = Device::flex();
    let model = load_model_dir(&dir, &device).unwrap();
    let (b, s) = (exp.input_ids.len(), exp.input_ids[0].len());
    let flat: Vec<u32> = exp.input_ids.concat();
    let logits = model
        .forward(tokens_tensor(&flat, b, s, &device), 0)
        .unwrap();
    assert_eq!(logits.dims().to_vec(), exp.logits_shape);
    let got = tensor_to_vec(&logits);
    let scale = exp.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&exp.logits)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff / scale <= 1e-4,
        "max |Δlogit| {max_diff} vs scale {scale}"
    );
    let mask = vec![1u8; b * s];
    let (sum, n) = next_token_nll(logits, &flat, &mask, b, s);
    let loss = tensor_to_vec(&sum)[0] as f64 / n as f64;
    assert!(
        (loss - exp.loss).abs() / exp.loss <= 1e-5,
        "loss {loss} vs {}",
        exp.loss
    );
}
