//! Megatron tensor parallelism (heads and MLP columns split, vocabulary-parallel embedding,
//! head and cross-entropy; Megatron sequence parallelism on, and off), alone and with SP, CP,
//! DP and ZeRO-1, gives the one-rank run on
//! threads: losses, validation losses and gradient norms over 8 optimizer steps (≤ 1e-5
//! relative) and the final checkpoint, with rotary, ALiBi and learned positions; its
//! checkpoints resume on other layouts; and the vocabulary-parallel loss matches the closed
//! form in f64.

mod curves;

use std::time::Duration;

use burn::tensor::{Device, Tensor, TensorData};
use curves::{data, grid, layouts_match_one_rank, resumes_match_one_rank, tiny};
use genslm::config::{Config, Position};
use genslm::model::tensor_parallel::{split_range, vocab_parallel_nll};
use genslm::ops::primitive::tensor_to_vec;
use genslm::parallel::tensor::TpGroup;
use genslm::parallel::threads::thread_group;
use genslm::parallel::Degrees;
use genslm::train::trainer::{train_grid, RunOptions};

/// `(dp, cp, sp, tp, zero, checkpoint_activations)`.
type Layout = (usize, usize, usize, usize, u8, bool);

fn run_config(cfg: Config, layouts: &[Layout]) {
    let grid: Vec<_> = layouts
        .iter()
        .map(|&(dp, cp, sp, tp, zero, ckpt)| (grid(dp, cp, sp, tp), zero, ckpt))
        .collect();
    layouts_match_one_rank(&cfg, &grid)
}

#[test]
fn tensor_parallel_matches_one_rank_with_rotary() {
    run_config(
        tiny(Position::Rotary, 32),
        &[
            (1, 1, 1, 2, 0, false),
            (1, 1, 1, 4, 0, false),
            (1, 1, 2, 2, 0, false),
            (2, 1, 1, 2, 1, false),
            (1, 1, 1, 2, 0, true),
            (1, 2, 1, 2, 0, false),
        ],
    );
}

#[test]
fn tensor_parallel_matches_one_rank_with_alibi_and_learned_positions() {
    for pos in [Position::Alibi, Position::Learned] {
        run_config(
            tiny(pos, 32),
            &[
                (1, 1, 1, 2, 0, false),
                (1, 1, 2, 2, 0, false),
                (2, 1, 1, 2, 1, true),
            ],
        );
    }
}

/// 37 and 1001 tokens divide by no degree (padded and masked), and 69 vocabulary ids split
/// 34/35 over TP 2, 23 each over TP 3 (with 6 heads so that TP 3 gives whole heads).
#[test]
fn tensor_parallel_with_lengths_and_vocabularies_no_degree_divides() {
    for pos in [Position::Rotary, Position::Alibi, Position::Learned] {
        run_config(
            tiny(pos, 37),
            &[(1, 1, 2, 2, 0, false), (1, 2, 1, 2, 1, false)],
        );
    }
    for pos in [Position::Rotary, Position::Alibi] {
        run_config(tiny(pos, 1001), &[(1, 2, 2, 2, 0, false)]);
    }
    let mut cfg = tiny(Position::Alibi, 32);
    cfg.model.hidden_size = 48;
    cfg.model.num_heads = 6;
    cfg.model.intermediate_size = 192;
    run_config(cfg, &[(1, 1, 1, 3, 0, false), (1, 1, 2, 3, 0, false)]);
}

/// Megatron sequence parallelism is on in every test above (the default); with it off
/// (`--no-megatron-sp`: LayerNorms and the residual whole on every TP rank, all-reduces around
/// the blocks) the layouts give the one-rank run too, so on and off agree within twice the
/// tolerance. 37 tokens pad to 38 under TP 2 (each rank's part of the sequence must divide by T).
#[test]
fn tensor_parallel_without_megatron_sequence_parallelism_matches_one_rank() {
    for pos in [Position::Learned, Position::Rotary] {
        let mut cfg = tiny(pos, 37);
        cfg.train.megatron_sp = false;
        run_config(
            cfg,
            &[
                (1, 1, 1, 2, 0, false),
                (1, 1, 2, 2, 1, false),
                (2, 1, 1, 2, 3, true),
            ],
        );
    }
}

/// A run saved under TP 2 × SP 2 resumes on one rank, and a one-rank run resumes under
/// TP 2 × DP 2 with ZeRO-1, both with the uninterrupted one-rank losses and checkpoint: the
/// checkpoint is one full HF directory whatever the layout.
#[test]
fn tensor_parallel_checkpoints_resume_on_other_layouts() {
    let cfg = tiny(Position::Learned, 32);
    let (tp_sp, tp_dp) = (grid(1, 1, 2, 2), grid(2, 1, 1, 2));
    let single = Degrees::new(1, 1, 1);
    resumes_match_one_rank(
        &cfg,
        &[
            ("tp2sp2-to-1", tp_sp, single),
            ("1-to-tp2dp2", single, tp_dp),
        ],
    );
}

/// Layouts TP cannot cut are refused before any work, naming the flag and the reason.
#[test]
fn impossible_tensor_parallel_layouts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let refuse = |cfg: &Config, d: Degrees, words: &[&str]| {
        let out = dir.path().join(format!("r{}", d.tp));
        let e = train_grid(cfg, &data(), &out, &RunOptions::default(), d)
            .unwrap_err()
            .to_string();
        for w in words {
            assert!(e.contains(w), "{e}");
        }
        assert!(!out.exists(), "nothing written for a refused layout");
    };
    let tp = |tp| Degrees {
        tp,
        ..Degrees::new(1, 1, 1)
    };
    let cfg = tiny(Position::Rotary, 32);
    refuse(&cfg, tp(3), &["--tp 3", "4 attention heads"]);
    let mut odd = cfg.clone();
    odd.model.intermediate_size = 255;
    refuse(&odd, tp(2), &["--tp 2", "intermediate_size 255"]);
}

/// Each rank holding a slice of the vocabulary columns: the loss on every rank and each rank's
/// gradient of its columns equal the closed form in f64 (Σ w·(logsumexp − l_target);
/// gradient w·(softmax − onehot)), for uneven slices and targets on either rank.
#[test]
fn vocabulary_parallel_loss_matches_the_closed_form() {
    let (rows, cols, vocab) = (2usize, 3usize, 69usize);
    let logits: Vec<f32> = (0..rows * cols * vocab)
        .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 6.0)
        .collect();
    let targets: Vec<i64> = vec![0, 68, 33, 34, 35, 12];
    let weights: Vec<f32> = vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0];
    // The closed form.
    let (mut loss, mut grad) = (0.0f64, vec![0.0f64; logits.len()]);
    for p in 0..rows * cols {
        let row = &logits[p * vocab..(p + 1) * vocab];
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
        let w = weights[p] as f64;
        loss += w * (z.ln() + max - row[targets[p] as usize] as f64);
        for (j, &l) in row.iter().enumerate() {
            let onehot = if j as i64 == targets[p] { 1.0 } else { 0.0 };
            grad[p * vocab + j] = w * ((l as f64 - max).exp() / z - onehot);
        }
    }
    for tp in [2usize, 3] {
        let comms = thread_group(tp, Duration::from_secs(60));
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let (logits, targets, weights) = (logits.clone(), targets.clone(), weights.clone());
                std::thread::spawn(move || {
                    let (first, n) = split_range(vocab, tp, r);
                    let mine: Vec<f32> = (0..rows * cols)
                        .flat_map(|p| logits[p * vocab + first..p * vocab + first + n].to_vec())
                        .collect();
                    let dev = Device::flex().autodiff();
                    let x = Tensor::<3>::from_data(TensorData::new(mine, [rows, cols, n]), &dev)
                        .require_grad();
                    let group = TpGroup {
                        comm: std::sync::Arc::new(comm),
                        seq_split: false,
                    };
                    let l = vocab_parallel_nll(x.clone(), &targets, weights, first, &group);
                    let g = x.grad(&l.backward()).unwrap();
                    (first, n, tensor_to_vec(&l)[0], tensor_to_vec(&g))
                })
            })
            .collect();
        for h in handles {
            let (first, n, l, g) = h.join().unwrap();
            assert!(
                (l as f64 - loss).abs() <= 1e-5 * loss.abs(),
                "tp {tp}: {l} vs {loss}"
            );
            for p in 0..rows * cols {
                for j in 0..n {
                    let want = grad[p * vocab + first + j];
                    let got = g[p * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6,
                        "tp {tp} pos {p} id {}: {got} vs {want}",
                        first + j
                    );
                }
            }
        }
    }
}
