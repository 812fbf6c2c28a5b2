//! `genslm plan` with pipeline stages: each stage's share of the model states and of the
//! activations against closed forms (1F1B keeps P − s micro-batches on stage s, GPipe all m),
//! the bubble against (P − 1)/m and (P − 1)/(m·V), and the search (PP only with ZeRO 0/1, as
//! the trainer runs it; the one ZeRO-1 layout of genslm-33b that fits 16 × 40 GB has stages).

mod common;

use common::{repo, run};
use genslm::config::{AttentionKind, ModelConfig, Position};
use genslm::parallel::pipeline::schedule::ScheduleKind;
use genslm::plan::balance::suggest_layers;
use genslm::plan::stages::{bubble, stage_views};
use genslm::plan::{
    estimate, layer_params, model_params, stage_params, Checkpointing, Degrees, Hardware, Mask,
    Parallelism, PipePlan, Precision, Recipe, Strategy, Target, GIB,
};

fn shape(layers: usize) -> ModelConfig {
    common::neox_shape(layers, 512, 8, 2048)
}

fn layout(pp: usize, tp: usize, zero: u8, kind: ScheduleKind, v: usize, m: usize) -> Parallelism {
    Parallelism {
        degrees: Degrees {
            dp: 1,
            cp: 1,
            sp: 1,
            tp,
            pp,
        },
        zero,
        megatron_sp: false,
        zero_over_sp: true,
        pipeline: PipePlan {
            schedule: kind,
            virtual_stages: v,
            micro_batches: m,
        },
    }
}

fn strategy(l: Parallelism) -> Strategy {
    Strategy {
        layout: l,
        recipe: Recipe::Genslm,
        attention: AttentionKind::Flash,
        positions: Position::Rotary,
        shard_positions: false,
        mask: Mask::None,
        checkpointing: Checkpointing::None,
        precision: Precision::Bf16,
        batch_size: 1,
        tied_embeddings: false,
        offload: genslm::config::Offload::None,
        vocab_size: 69,
        stage: None,
        pp_layers: None,
    }
}

fn gpu() -> Hardware {
    Hardware {
        mem_bytes: 1e6 * GIB,
        target: Target::Gpu,
    }
}

fn close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-9 * want.abs().max(1.0),
        "{what}: {got} vs {want}"
    );
}

#[test]
fn stages_hold_their_layers_and_the_schedule_s_micro_batches() {
    let m = shape(8);
    let views = stage_views(&m, &layout(4, 1, 1, ScheduleKind::OneFOneB, 1, 8), None).unwrap();
    let kept: Vec<usize> = views.iter().map(|v| v.kept_layers).collect();
    // 1F1B: stage s keeps P − s micro-batches of its 2 layers.
    assert_eq!(kept, vec![8, 6, 4, 2]);
    assert!(views.iter().all(|v| v.layers == 2));
    assert!(views[0].embeddings && !views[0].head && views[3].head && !views[3].embeddings);
    // GPipe keeps every micro-batch until the backwards start.
    let views = stage_views(&m, &layout(4, 1, 1, ScheduleKind::GPipe, 1, 8), None).unwrap();
    assert!(views.iter().all(|v| v.kept_layers == 16));
    // The stages' parameters add up to the model's (untied embeddings: one matrix each end).
    let sum: f64 = views.iter().map(|v| stage_params(&m, 69, false, v)).sum();
    close(sum, model_params(&m, 69, false), "Σ stages");
    // Impossible pipelines are refused by the check, as the trainer refuses them.
    assert!(stage_views(&m, &layout(4, 1, 1, ScheduleKind::OneFOneB, 1, 2), None).is_err());
    assert!(stage_views(&m, &layout(16, 1, 1, ScheduleKind::GPipe, 1, 16), None).is_err());
}

/// `--pp-layers` cuts the stages where it says: 1F1B on 2 stages of 1 and 7 layers keeps 2
/// micro-batches of 1 layer on stage 0 and 1 of 7 on stage 1 (balanced: 2 × 4 and 1 × 4), the
/// estimate is the heavier stage's, and a cut that does not fit the model is refused.
#[test]
fn a_given_layer_cut_is_the_one_estimated() {
    let m = shape(8);
    let l = layout(2, 1, 1, ScheduleKind::OneFOneB, 1, 4);
    let views = stage_views(&m, &l, Some(&[1, 7])).unwrap();
    let got: Vec<(usize, usize)> = views.iter().map(|v| (v.layers, v.kept_layers)).collect();
    assert_eq!(got, [(1, 2), (7, 7)]);
    let even: Vec<(usize, usize)> = stage_views(&m, &l, None)
        .unwrap()
        .iter()
        .map(|v| (v.layers, v.kept_layers))
        .collect();
    assert_eq!(even, [(4, 8), (4, 4)]);
    let (cut, balanced) = (
        Strategy {
            pp_layers: Some(vec![1, 7]),
            ..strategy(l)
        },
        strategy(l),
    );
    let s = 4096;
    let heavy = genslm::plan::estimate_on(&m, &cut, &gpu(), s, views[1]).total();
    close(
        estimate(&m, &cut, &gpu(), s).total(),
        heavy,
        "the 7-layer stage's peak",
    );
    assert!(estimate(&m, &cut, &gpu(), s).total() > estimate(&m, &balanced, &gpu(), s).total());
    assert!(stage_views(&m, &l, Some(&[2, 7])).is_err(), "9 layers of 8");
    assert!(
        stage_views(&m, &l, Some(&[8])).is_err(),
        "one count for two stages"
    );
}

#[test]
fn bubbles_follow_the_closed_forms() {
    let m = shape(16);
    for (p, mb) in [(2, 4), (4, 8), (4, 16), (8, 8)] {
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
            let b = bubble(&m, &layout(p, 1, 1, kind, 1, mb)).unwrap();
            close(
                b,
                (p - 1) as f64 / mb as f64,
                &format!("{kind} P {p} m {mb}"),
            );
        }
        let b = bubble(&m, &layout(p, 1, 1, ScheduleKind::Interleaved, 2, mb)).unwrap();
        close(
            b,
            (p - 1) as f64 / (2 * mb) as f64,
            &format!("interleaved P {p} m {mb}"),
        );
    }
    assert_eq!(
        bubble(&m, &layout(1, 1, 1, ScheduleKind::OneFOneB, 1, 1)),
        None
    );
}

/// Stage 0 of 1F1B holds its layers' states and the embedding, and P micro-batches of L/P
/// layers: as many layer activations as one rank without a pipeline, without the head's; the
/// last stage holds the head and the logits.
#[test]
fn stage_memory_terms() {
    let m = shape(8);
    let (h, s) = (512.0, 4096usize);
    let tokens = s as f64;
    let t = 2;
    let whole = estimate(
        &m,
        &strategy(layout(1, t, 1, ScheduleKind::OneFOneB, 1, 1)),
        &gpu(),
        s,
    );
    let l = layout(4, t, 1, ScheduleKind::OneFOneB, 1, 8);
    let st = strategy(l);
    let views = stage_views(&m, &l, None).unwrap();
    let per_stage: Vec<_> = views
        .iter()
        .map(|&v| {
            let one = Strategy {
                stage: Some(v),
                ..st.clone()
            };
            estimate(&m, &one, &gpu(), s).memory
        })
        .collect();
    // bf16 weights: 2 bytes per parameter of the stage, over TP.
    let first = (2.0 * layer_params(&m) + 69.0 * h) / t as f64;
    close(per_stage[0].parameters, 2.0 * first, "stage 0 weights");
    let last = (2.0 * layer_params(&m) + 69.0 * h + 2.0 * h) / t as f64;
    close(per_stage[3].parameters, 2.0 * last, "stage 3 weights");
    // Stage 0 keeps 8 layers' activations like one rank; one rank also keeps the final
    // LayerNorm's fp32 input and output (the head's, on the last stage).
    let head_acts = tokens * (4.0 + 2.0) * h;
    close(
        per_stage[0].activations,
        whole.memory.activations - head_acts,
        "stage 0 activations",
    );
    assert_eq!(per_stage[0].logits, 0.0);
    assert!(per_stage[3].logits > 0.0);
    close(
        per_stage[3].logits,
        whole.memory.logits,
        "the last stage's logits",
    );
    // Every stage receives an activation and a gradient: 2 fp32 h-wide buffers per token.
    close(
        per_stage[1].communication,
        2.0 * 4.0 * h * tokens,
        "pipeline buffers",
    );
    // The plan's peak is the largest stage's.
    let peak = estimate(&m, &st, &gpu(), s);
    let max = per_stage.iter().map(|b| b.total()).fold(0.0, f64::max);
    close(peak.total(), max, "peak");
    assert_eq!(peak.stage, Some(0));
}

/// `genslm plan` for genslm-33b on `gpus` A100-40GB with `flags`: (success, stdout, stderr).
fn plan_33b(gpus: &str, flags: &[&str]) -> (bool, String, String) {
    let cfg = repo().join("configs/genslm-33b.toml");
    let mut args = vec!["plan", "--config", cfg.to_str().unwrap()];
    args.extend(["--gpus", gpus, "--gpu-mem-gib", "40"]);
    args.extend(flags);
    run(&args)
}

#[test]
fn the_search_plans_stages_as_the_trainer_runs_them() {
    // With ZeRO ≤ 1 and checkpointing, 32 A100-40GB hold genslm-33b only with pipeline stages
    // (2 bytes of bf16 weights and 4 of fp32 gradients per parameter on every DP rank).
    let (ok, out, err) = plan_33b("32", &["--zero", "1", "--checkpoint-activations", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["layout"]["pp"].as_u64().unwrap() > 1, "{}", v["layout"]);
    assert!(v["max_seq_len"].as_u64().unwrap() > 0);
    assert!(v["pipeline_bubble"].as_f64().unwrap() > 0.0);
    // ZeRO-2/3 with stages are refused by name (the trainer refuses them too).
    let (ok, _, err) = plan_33b("16", &["--pp", "2", "--zero", "3"]);
    assert!(!ok && err.contains("--pp 2 with --zero 3"), "{err}");
    // A fixed pipeline that cannot run says why.
    let (ok, _, err) = plan_33b("16", &["--pp", "4", "--grad-accum", "2"]);
    assert!(
        !ok && err.contains("needs at least 4 micro-batches"),
        "{err}"
    );
    // A fixed --pp is the only pipeline degree searched, and the text names the stage.
    let (ok, out, err) = plan_33b("64", &["--pp", "4", "--checkpoint-activations"]);
    assert!(ok, "{err}");
    assert!(out.contains("pp 4 (1f1b, 16 micro-batches)"), "{out}");
    assert!(out.contains("pipeline bubble     0.188"), "{out}");
    assert!(out.contains("on pipeline stage"), "{out}");
}

/// The suggested cut gives the stages that keep fewer micro-batches more layers, covers every
/// layer, and lowers the largest stage peak below the even cut's.
#[test]
fn the_suggested_cut_evens_out_the_stage_peaks() {
    let m = shape(16);
    let l = layout(4, 1, 1, ScheduleKind::OneFOneB, 1, 8);
    let st = strategy(l);
    let s = 8192;
    let (counts, peaks) = suggest_layers(&m, &st, &gpu(), s).unwrap();
    assert_eq!(counts.iter().sum::<usize>(), 16);
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert!(counts[0] < counts[3], "{counts:?}");
    let even = estimate(&m, &st, &gpu(), s).total();
    let worst = peaks.iter().copied().fold(0.0, f64::max);
    assert!(worst < even, "suggested {worst} vs even {even}");
    // Each reported peak is that stage's estimate with the suggested layers.
    let views = stage_views(&m, &l, None).unwrap();
    for (k, (&c, &p)) in counts.iter().zip(&peaks).enumerate() {
        let in_flight = views[k].kept_layers / views[k].layers;
        let view = genslm::plan::StageView {
            layers: c,
            kept_layers: in_flight * c,
            ..views[k]
        };
        let one = Strategy {
            stage: Some(view),
            ..st.clone()
        };
        close(
            estimate(&m, &one, &gpu(), s).total(),
            p,
            &format!("stage {k}"),
        );
    }
    // No suggestion without stages or with interleaving.
    assert!(suggest_layers(
        &m,
        &strategy(layout(1, 1, 1, ScheduleKind::OneFOneB, 1, 1)),
        &gpu(),
        s
    )
    .is_none());
    assert!(suggest_layers(
        &m,
        &strategy(layout(2, 1, 1, ScheduleKind::Interleaved, 2, 4)),
        &gpu(),
        s
    )
    .is_none());
}

/// GPipe's refusal for memory names what to change: it keeps every micro-batch in flight, so
/// `--grad-accum` or the schedule, not the `--seq-len` it alone blamed.
#[test]
fn a_gpipe_run_past_the_memory_names_its_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, _, err) = common::run(&[
        "train",
        "--fasta",
        common::repo()
            .join("data/lambda_virus.fa")
            .to_str()
            .unwrap(),
        "--config",
        "tiny",
        "--out",
        out.to_str().unwrap(),
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--pp",
        "2",
        "--grad-accum",
        "2000000",
        "--pp-schedule",
        "gpipe",
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("--pp-schedule gpipe keeps all --grad-accum 2000000 micro-batches"),
        "{err}"
    );
    assert!(!out.exists());
}
