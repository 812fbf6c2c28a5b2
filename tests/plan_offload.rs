//! `genslm plan` with `--offload`: what moves to host memory, against the closed forms
//! (DeepSpeed's ZeRO-Offload keeps the fp32 master weights and both Adam moments on the host;
//! ALST's activation offload keeps each checkpointed layer input there).

mod common;

use common::{repo, run};
use genslm::config::{AttentionKind, ModelConfig, Offload, Position};
use genslm::plan::{
    estimate, granule, max_seq_len, max_seq_len_with_host, model_params, Checkpointing, Degrees,
    Hardware, Mask, Parallelism, Phase, Precision, Recipe, Strategy, Target, GIB,
};

fn shape(layers: usize) -> ModelConfig {
    common::neox_shape(layers, 512, 8, 2048)
}

fn strategy(dp: usize, sp: usize, zero: u8, precision: Precision, offload: Offload) -> Strategy {
    Strategy {
        layout: Parallelism {
            degrees: Degrees {
                dp,
                cp: 1,
                sp,
                tp: 1,
                pp: 1,
            },
            zero,
            megatron_sp: false,
            zero_over_sp: true,
            pipeline: genslm::plan::PipePlan::default(),
        },
        recipe: Recipe::Genslm,
        attention: AttentionKind::Flash,
        positions: Position::Rotary,
        shard_positions: false,
        mask: Mask::None,
        checkpointing: Checkpointing::Full { partitioned: false },
        precision,
        batch_size: 1,
        tied_embeddings: false,
        offload,
        vocab_size: 69,
        stage: None,
        pp_layers: None,
    }
}

fn close(got: f64, want: f64, what: &str) {
    let tol = 1e-9 * want.abs().max(1.0);
    assert!((got - want).abs() <= tol, "{what}: got {got}, want {want}");
}

const GPU: Hardware = Hardware {
    mem_bytes: 80.0 * GIB,
    target: Target::Gpu,
};

#[test]
fn optimizer_offload_moves_master_weights_and_moments_to_the_host() {
    let m = shape(4);
    let n = model_params(&m, 69, false);
    let s = 4096;
    for (dp, zero, precision) in [
        (1, 0, Precision::Fp32),
        (4, 1, Precision::Bf16),
        (4, 2, Precision::Fp32),
        (4, 3, Precision::Fp32),
        (4, 3, Precision::Bf16),
    ] {
        let what = format!("dp {dp} zero {zero} {precision}");
        let base = estimate(
            &m,
            &strategy(dp, 1, zero, precision, Offload::None),
            &GPU,
            s,
        );
        let off = estimate(
            &m,
            &strategy(dp, 1, zero, precision, Offload::Optimizer),
            &GPU,
            s,
        );
        let z = |stage: u8| if zero >= stage { dp as f64 } else { 1.0 };
        // Adam's state: bf16 keeps 4 (master) + 8 (moments) bytes per parameter in it, fp32
        // the moments only (its weights are the master copy); under ZeRO-3 the rank's weight
        // shard is the fp32 master whatever the precision (`train::master`), and goes too.
        let state = match precision {
            Precision::Bf16 if zero < 3 => 12.0,
            _ => 8.0,
        };
        close(base.memory.optimizer_states, n * state / z(1), &what);
        close(off.memory.optimizer_states, 0.0, &what);
        let shard = if zero >= 3 { 4.0 * n / z(3) } else { 0.0 };
        close(off.host_bytes, n * state / z(1) + shard, &what);
        close(off.memory.parameters, base.memory.parameters - shard, &what);
        close(off.memory.gradients, base.memory.gradients, &what);
        close(base.host_bytes, 0.0, &what);
    }
}

#[test]
fn activation_offload_keeps_one_layer_input_on_the_device() {
    let s = 1 << 16;
    for (layers, sp, precision) in [(4, 1, Precision::Fp32), (8, 2, Precision::Bf16)] {
        let m = shape(layers);
        let what = format!("{layers} layers sp {sp} {precision}");
        let base = estimate(&m, &strategy(1, sp, 0, precision, Offload::None), &GPU, s);
        let off = estimate(
            &m,
            &strategy(1, sp, 0, precision, Offload::Activations),
            &GPU,
            s,
        );
        assert_eq!(base.phase, Phase::ForwardBackward, "{what}");
        assert_eq!(off.phase, Phase::ForwardBackward, "{what}");
        // Every layer's kept input, L·b·s·e·h over the Ulysses ranks, goes to the host; the
        // device keeps the recomputed layer's own (which it counted already).
        let e = precision.activation_bytes();
        let kept = layers as f64 * s as f64 * e * 512.0 / sp as f64;
        close(off.host_bytes, kept, &what);
        let per_layer = kept / layers as f64;
        close(
            base.memory.activations - off.memory.activations,
            kept - per_layer,
            &what,
        );
        close(base.total() - off.total(), kept - per_layer, &what);
    }
}

#[test]
fn nothing_moves_on_a_cpu_target() {
    let m = shape(4);
    let cpu = Hardware {
        mem_bytes: 64.0 * GIB,
        target: Target::Cpu {
            run: genslm::plan::cpu::CpuRun::Train,
        },
    };
    let base = estimate(
        &m,
        &strategy(1, 1, 0, Precision::Fp32, Offload::None),
        &cpu,
        4096,
    );
    let off = estimate(
        &m,
        &strategy(1, 1, 0, Precision::Fp32, Offload::All),
        &cpu,
        4096,
    );
    assert_eq!(base.memory, off.memory);
    assert_eq!(off.host_bytes, 0.0);
}

#[test]
fn plan_reports_the_host_bytes_and_refuses_activations_without_checkpointing() {
    let config = repo().join("configs/genslm-25b.toml");
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "plan",
            "--config",
            config.to_str().unwrap(),
            "--gpus",
            "64",
            "--gpu-mem-gib",
            "40",
        ];
        a.extend_from_slice(extra);
        run(&a)
    };
    let (ok, plain, err) = args(&["--checkpoint-activations"]);
    assert!(ok, "{err}");
    let (ok, out, err) = args(&["--checkpoint-activations", "--offload", "all"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("offload all") && out.contains("in host memory (--offload)"),
        "{out}"
    );
    assert!(!plain.contains("in host memory"), "{plain}");
    let longest = |o: &str| -> usize {
        let line = o
            .lines()
            .find(|l| l.starts_with("longest sequence"))
            .unwrap();
        line.split_whitespace()
            .nth(2)
            .unwrap()
            .replace(',', "")
            .parse()
            .unwrap()
    };
    assert!(longest(&out) > longest(&plain), "{plain}\n{out}");
    let (ok, _, err) = args(&["--offload", "activations"]);
    assert!(!ok && err.contains("--checkpoint-activations"), "{err}");
}

/// A host-memory limit shortens the longest sequence under activation offload (the kept
/// inputs on the host grow with it) to where the offloaded bytes fit: at the answer they do,
/// one granule further they do not; without a limit the device alone decides.
#[test]
fn host_memory_bounds_the_longest_sequence_under_offload() {
    let m = shape(32);
    let st = strategy(1, 1, 1, Precision::Bf16, Offload::All);
    let free = max_seq_len(&m, &st, &GPU);
    assert_eq!(max_seq_len_with_host(&m, &st, &GPU, f64::INFINITY), free);
    let limit = estimate(&m, &st, &GPU, free / 4).host_bytes;
    let n = max_seq_len_with_host(&m, &st, &GPU, limit);
    let g = granule(&st);
    assert!(n > 0 && n < free, "{n} vs {free}");
    assert!(estimate(&m, &st, &GPU, n).host_bytes <= limit);
    assert!(estimate(&m, &st, &GPU, n + g).host_bytes > limit);
}

/// When the offloaded bytes are what does not fit, the answer says host memory, not the
/// device's (it said "not even 1,024 tokens fit in 80 GiB" beside a 5 GiB total).
#[test]
fn a_plan_stopped_by_host_memory_says_so() {
    let plan = |host: &str, pinned: &[&str]| {
        let mut a = vec![
            "plan",
            "--config",
            "genslm-25m",
            "--gpus",
            "8",
            "--gpu-mem-gib",
            "80",
            "--offload",
            "optimizer",
            "--host-mem-gib",
            host,
        ];
        a.extend_from_slice(pinned);
        run(&a)
    };
    // ZeRO-0 over 8 DP ranks, named: the figures below are its own.
    let zero0 = [
        "--zero", "0", "--tp", "1", "--sp", "1", "--cp", "1", "--pp", "1",
    ];
    let (ok, out, err) = plan("0.1", &zero0);
    assert!(ok, "{err}");
    assert!(
        out.contains("not even 1,024 tokens fit in host memory (--host-mem-gib")
            && out.contains("do not fit in host memory: 0.28 GiB is offloaded per rank")
            && !out.contains("needed per rank before activations"),
        "{out}"
    );
    // genslm-25m's optimizer state on the host: 12 bytes (fp32 master and moments) of each of
    // its 25,290,752 parameters (bf16 mixed, ZeRO-0) = 0.28 GiB, the note's figure.
    let bytes = 12.0 * 25_290_752.0 / GIB;
    assert!((bytes - 0.28).abs() < 0.005, "{bytes}");
    let (ok, out, err) = plan("1", &[]);
    assert!(
        ok && !out.contains("longest sequence    none"),
        "{err}{out}"
    );
}
