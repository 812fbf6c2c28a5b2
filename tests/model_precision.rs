//! bf16 mixed precision on CPU: the same casts a GPU run makes (fp32 master weights, bf16
//! matmuls and activations, fp32 statistics and loss), checked against the fp32 path — which
//! tests/model_hf_parity.rs checks against transformers.

use std::path::Path;

use burn::tensor::{DType, Device};
use genslm::config::{Config, Precision};
use genslm::model::neox::next_token_nll;
use genslm::model::GenSlm;
use genslm::ops::primitive::{tensor_to_vec, tokens_tensor};
use genslm::rng::SplitMix64;
use genslm::train::metrics::read_metrics;
use genslm::train::trainer::{train, DataSource, RunOptions};

fn tiny() -> Config {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
    Config::load(&path).unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn bf16_forward_and_gradients_are_fp32_within_bf16_rounding() {
    let cfg = tiny();
    let ad = Device::flex().autodiff();
    let (b, s) = (2, 48);
    let mut g = SplitMix64::new(3);
    let tokens: Vec<u32> = (0..b * s).map(|_| 5 + g.below(64) as u32).collect();
    let mask = vec![1u8; b * s];
    let host = GenSlm::init(cfg.model.clone(), 1, &ad).unwrap().to_host();
    let run = |p: Precision| {
        let m = GenSlm::from_host(cfg.model.clone(), host.clone(), &ad)
            .unwrap()
            .with_precision(p);
        let m = GenSlm {
            params: m.params.iter().map(|t| t.clone().require_grad()).collect(),
            ..m
        };
        let logits = m.forward(tokens_tensor(&tokens, b, s, &ad), 0).unwrap();
        assert_eq!(logits.dtype(), DType::F32, "logits (and the loss) are fp32");
        let (nll, _) = next_token_nll(logits.clone(), &tokens, &mask, b, s);
        let grads = nll.backward();
        let gs: Vec<_> = m.params.iter().map(|t| t.grad(&grads).unwrap()).collect();
        for (i, gr) in gs.iter().enumerate() {
            assert_eq!(gr.dtype(), DType::F32, "gradient of parameter {i}");
        }
        (
            tensor_to_vec(&logits),
            gs.iter().map(tensor_to_vec).collect::<Vec<_>>(),
        )
    };
    let (l32, g32) = run(Precision::Fp32);
    let (l16, g16) = run(Precision::Bf16);
    let e = rel_l2(&l16, &l32);
    // bf16 keeps 8 significant bits (relative rounding 2⁻⁹ ≈ 2e-3): the logits move by about
    // that much — not 0 (the casts happened) and not more (nothing else changed).
    assert!(e > 1e-4 && e < 2e-2, "logits: relative L2 difference {e:e}");
    for (i, (a, r)) in g16.iter().zip(&g32).enumerate() {
        let e = rel_l2(a, r);
        assert!(
            e < 3e-2,
            "gradient of parameter {i}: relative L2 difference {e:e}"
        );
    }
}

#[test]
fn bf16_training_follows_fp32_and_saves_fp32_weights() {
    let dir = tempfile::tempdir().unwrap();
    let data = DataSource::Fasta(vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("data")]);
    let mut runs = Vec::new();
    for p in [Precision::Fp32, Precision::Bf16] {
        let mut cfg = tiny();
        cfg.train.steps = 20;
        cfg.train.seq_len = 64;
        cfg.train.batch_size = 4;
        cfg.train.lr = 3e-3;
        cfg.train.precision = Some(p);
        let out = dir.path().join(p.to_string());
        train(&cfg, &data, &out, &RunOptions::default()).unwrap();
        runs.push(out);
    }
    let a = read_metrics(&runs[0].join("metrics.jsonl")).unwrap();
    let b = read_metrics(&runs[1].join("metrics.jsonl")).unwrap();
    let (a, b): (Vec<_>, Vec<_>) = (
        a.iter().filter(|m| m.loss.is_finite()).collect(),
        b.iter().filter(|m| m.loss.is_finite()).collect(),
    );
    assert_eq!(a.len(), 20);
    assert_eq!(b.len(), 20);
    let mut differ = false;
    for (x, y) in a.iter().zip(&b) {
        let rel = (x.loss - y.loss).abs() / x.loss;
        assert!(
            rel <= 0.02,
            "step {}: fp32 {} vs bf16 {}",
            x.step,
            x.loss,
            y.loss
        );
        differ |= x.loss != y.loss;
    }
    assert!(
        differ,
        "bf16 gave bit-identical losses: the casts did not happen"
    );
    // Master weights: the checkpoint holds fp32 tensors.
    let st = runs[1].join("checkpoints/step-20/model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in tensors.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    }
    // The resolved precision is recorded with the run.
    let toml = std::fs::read_to_string(runs[1].join("config.toml")).unwrap();
    assert!(toml.contains("precision = \"bf16\""), "{toml}");
}

/// Inference in bf16: embed, score and generate run (the pooled embeddings are fp32 and close
/// to the fp32 ones).
#[test]
fn bf16_inference_runs_and_embeds_close_to_fp32() {
    use genslm::backend::{Compute, DeviceChoice};
    use genslm::infer::embed::{embed_to_parquet, EmbedInput, EmbedOptions};
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_neox_tiny");
    let fasta = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/lambda_virus.fa");
    let mut rows = Vec::new();
    for p in [Precision::Fp32, Precision::Bf16] {
        let out = dir.path().join(format!("{p}.parquet"));
        let opts = EmbedOptions {
            compute: Compute::new(DeviceChoice::cpu(), Some(p)),
            seq_len: Some(64),
            ..Default::default()
        };
        embed_to_parquet(&model, &EmbedInput::Fasta(vec![fasta.clone()]), &out, &opts).unwrap();
        rows.push(genslm::infer::embed_io::read_embeddings(&out, "gc_content").unwrap());
    }
    let (a, b) = (&rows[0].values, &rows[1].values);
    let e = rel_l2(b, a);
    assert!(
        e > 0.0 && e < 2e-2,
        "embedding: relative L2 difference {e:e}"
    );
}
