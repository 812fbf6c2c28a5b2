//! `genslm plan`: the memory terms against their closed forms (the command line:
//! tests/plan_cli.rs; the CPU calibration: tests/plan_calibration.rs; the published comparison
//! and the logged GPU peaks: tests/plan_published.rs).

mod common;

use common::{repo, run};
use genslm::config::{AttentionKind, ModelConfig, Position};
use genslm::plan::{
    estimate, granule, max_seq_len, model_params, Checkpointing, Degrees, Hardware, Mask,
    Parallelism, Phase, Precision, Recipe, Strategy, Target, GIB,
};

fn shape(layers: usize, h: usize, heads: usize, i: usize) -> ModelConfig {
    common::neox_shape(layers, h, heads, i)
}

fn layout(tp: usize, sp: usize, dp: usize, zero: u8, megatron_sp: bool) -> Parallelism {
    Parallelism {
        degrees: Degrees {
            dp,
            cp: 1,
            sp,
            tp,
            pp: 1,
        },
        zero,
        megatron_sp,
        zero_over_sp: true,
        pipeline: genslm::plan::PipePlan::default(),
    }
}

/// Megatron's layer in bf16 with dropout (16-bit softmax, no score buffer: Korthikanti et
/// al.'s accounting), no position table, no mask.
fn megatron(l: Parallelism, attention: AttentionKind, ckpt: Checkpointing) -> Strategy {
    Strategy {
        layout: l,
        recipe: Recipe::Megatron {
            dropout: true,
            softmax_fp32: false,
            score_buffer: false,
        },
        attention,
        positions: Position::Rotary,
        shard_positions: false,
        mask: Mask::None,
        checkpointing: ckpt,
        precision: Precision::Bf16,
        batch_size: 1,
        tied_embeddings: true,
        offload: genslm::config::Offload::None,
        vocab_size: 1024,
        stage: None,
        pp_layers: None,
    }
}

fn gpu(gib: f64) -> Hardware {
    Hardware {
        mem_bytes: gib * GIB,
        target: Target::Gpu,
    }
}

fn close(got: f64, want: f64, what: &str) {
    let tol = 1e-9 * want.abs().max(1.0);
    assert!((got - want).abs() <= tol, "{what}: got {got}, want {want}");
}

/// Bytes of one layer (activations + attention) at `s` tokens: the difference between the
/// 2-layer and the 1-layer model.
fn one_layer(st: &Strategy, h: usize, heads: usize, i: usize, s: usize) -> (f64, f64) {
    let hw = gpu(1e6);
    let at = |layers| estimate(&shape(layers, h, heads, i), st, &hw, s).memory;
    let (a2, a1) = (at(2), at(1));
    (a2.activations - a1.activations, a2.attention - a1.attention)
}

#[test]
fn megatron_layer_is_korthikanti_34_plus_5as_over_h() {
    let (h, a, s) = (1024usize, 16usize, 4096usize);
    let (hf, af, sf) = (h as f64, a as f64, s as f64);
    for t in [1usize, 2, 8] {
        let tf = t as f64;
        // TP + Megatron SP, naive attention: s·b·h·(34 + 5·a·s/h)/t.
        let st = megatron(
            layout(t, 1, 1, 0, true),
            AttentionKind::Naive,
            Checkpointing::None,
        );
        let (act, att) = one_layer(&st, h, a, 4 * h, s);
        close(
            act + att,
            sf * hf * (34.0 + 5.0 * af * sf / hf) / tf,
            "TP+SP naive",
        );
        // TP without SP: s·b·h·(10 + 24/t + 5·a·s/(h·t)).
        let st = megatron(
            layout(t, 1, 1, 0, false),
            AttentionKind::Naive,
            Checkpointing::None,
        );
        let (act, att) = one_layer(&st, h, a, 4 * h, s);
        close(
            act + att,
            sf * hf * (10.0 + 24.0 / tf + 5.0 * af * sf / (hf * tf)),
            "TP naive",
        );
        // Flash: the scores term vanishes; the fp32 log-sum-exp (4·a·s/t) remains.
        let st = megatron(
            layout(t, 1, 1, 0, true),
            AttentionKind::Flash,
            Checkpointing::None,
        );
        let (act, att) = one_layer(&st, h, a, 4 * h, s);
        close(act, 34.0 * sf * hf / tf, "flash activations");
        close(att, 4.0 * af * sf / tf, "flash log-sum-exp");
        // Full checkpointing: each extra layer adds only its kept input (2·s·h/t with SP).
        let full = Checkpointing::Full { partitioned: false };
        let st = megatron(layout(t, 1, 1, 0, true), AttentionKind::Naive, full);
        let (act, att) = one_layer(&st, h, a, 4 * h, s);
        close(act, 2.0 * sf * hf / tf, "checkpointed layer");
        close(att, 0.0, "checkpointed scores (one layer, recomputed)");
        // Without SP the kept inputs are whole on every TP rank, unless DeepSpeed partitions
        // them over the TP ranks.
        let st = megatron(layout(t, 1, 1, 0, false), AttentionKind::Naive, full);
        close(
            one_layer(&st, h, a, 4 * h, s).0,
            2.0 * sf * hf,
            "unpartitioned",
        );
        let partitioned = Checkpointing::Full { partitioned: true };
        let st = megatron(layout(t, 1, 1, 0, false), AttentionKind::Naive, partitioned);
        close(
            one_layer(&st, h, a, 4 * h, s).0,
            2.0 * sf * hf / tf,
            "partitioned",
        );
    }
}

/// Bytes per attention score (per element of `[a/t, s, s]`) at the backward peak of one
/// recomputed layer: the forward/backward total less flash attention's (whose only attention
/// term is the fp32 log-sum-exp, `4·a·s/t`).
#[test]
fn naive_softmax_backward_peaks_at_4_probabilities_plus_the_buffer() {
    let (h, a, s) = (1024usize, 16usize, 8192usize);
    let m = shape(2, h, a, 4 * h);
    let hw = gpu(1e6);
    let full = Checkpointing::Full { partitioned: false };
    let fb = |st: &Strategy| {
        estimate(&m, st, &hw, s)
            .phases
            .iter()
            .find(|(p, _)| *p == Phase::ForwardBackward)
            .expect("a forward/backward phase")
            .1
    };
    for t in [1usize, 4] {
        let flash = megatron(layout(t, 1, 1, 0, true), AttentionKind::Flash, full);
        let scores = (a / t * s * s) as f64;
        let lse = 4.0 * (a / t * s) as f64;
        // 16-bit softmax: kept probabilities e, then the gradient, `grad · output` and the input
        // gradient (4·e = 8). fp32 softmax: 4·4 = 16 (PyTorch's softmax backward). Megatron-LM's
        // global score buffer adds e = 2.
        for (softmax_fp32, score_buffer, bytes) in
            [(false, false, 8.0), (true, false, 16.0), (true, true, 18.0)]
        {
            let mut st = megatron(layout(t, 1, 1, 0, true), AttentionKind::Naive, full);
            st.recipe = Recipe::Megatron {
                dropout: true,
                softmax_fp32,
                score_buffer,
            };
            close(
                fb(&st) - fb(&flash),
                bytes * scores - lse,
                &format!("t {t}, fp32 {softmax_fp32}, buffer {score_buffer}"),
            );
        }
    }
}

#[test]
fn genslm_layer_keeps_15h_per_token_then_16h_under_ulysses() {
    let (h, a, i, s) = (512usize, 8usize, 2048usize, 4096usize);
    let mut st = megatron(
        layout(1, 1, 1, 0, false),
        AttentionKind::Flash,
        Checkpointing::None,
    );
    st.recipe = Recipe::Genslm;
    st.precision = Precision::Fp32;
    // Rotary, one rank: 7·h + 2·i fp32 elements per token (= 15·h for i = 4h): the layer's
    // input (kept by the fused LayerNorm), LN1's output, the attention output, LN2's output,
    // the QKV projection the fused QKV attention op keeps (3·h), fc1's output and gelu's (2·i).
    // The fused gelu_fast keeps only its input, where the composed one kept four more i-wide
    // tensors; burn's composed LayerNorm kept two more h-wide tensors each; the composed
    // split, rotary and attention kept the rotated Q and K and the attention output besides.
    let (act, att) = one_layer(&st, h, a, i, s);
    close(act, 4.0 * s as f64 * (7 * h + 2 * i) as f64, "p = 1");
    close(act, 4.0 * s as f64 * 15.0 * h as f64, "15h");
    close(att, 4.0 * (a * s) as f64, "log-sum-exp");
    // Ulysses p = 2: q, k, v no longer pin the fused QKV buffer: 8·h + 2·i per local token.
    st.layout = layout(1, 2, 1, 0, false);
    let (act, _) = one_layer(&st, h, a, i, s);
    close(act, 4.0 * (s / 2) as f64 * (8 * h + 2 * i) as f64, "p = 2");
    // Naive attention (burn): 2 fp32 per score kept plus each layer's bool causal mask.
    st.layout = layout(1, 1, 1, 0, false);
    st.attention = AttentionKind::Naive;
    let (_, att) = one_layer(&st, h, a, i, s);
    close(att, (8 * a * s * s + s * s) as f64, "naive scores and mask");
}

#[test]
fn model_states_follow_the_zero_stages() {
    let m = shape(4, 1024, 16, 4096);
    let (t, d) = (2usize, 4usize);
    let n = model_params(&m, 1024, true) / t as f64;
    let z = d as f64;
    let hw = gpu(1e6);
    let states = |zero, recipe| {
        let mut st = megatron(
            layout(t, 1, d, zero, true),
            AttentionKind::Flash,
            Checkpointing::None,
        );
        st.recipe = recipe;
        let b = estimate(&m, &st, &hw, 1024).memory;
        (b.parameters, b.gradients, b.optimizer_states)
    };
    // bf16 mixed precision as DeepSpeed holds it: 2 + 2 + 12 bytes per parameter; ZeRO-k
    // partitions over D.
    let want = [
        (2.0 * n, 2.0 * n, 12.0 * n),
        (2.0 * n, 2.0 * n, 12.0 * n / z),
        (2.0 * n, 2.0 * n / z, 12.0 * n / z),
        (2.0 * n / z, 2.0 * n / z, 12.0 * n / z),
    ];
    let deepspeed = megatron(
        layout(t, 1, d, 0, true),
        AttentionKind::Flash,
        Checkpointing::None,
    );
    for (zero, w) in want.iter().enumerate() {
        let (p, g, o) = states(zero as u8, deepspeed.recipe);
        close(p, w.0, "weights");
        close(g, w.1, "gradients");
        close(o, w.2, "optimizer states");
    }
    // genslm's trainer (README's bytes-per-parameter table, which tests/bf16_layout.rs checks
    // against the trainer's own accounting): under ZeRO-3 the weight shard is the fp32 master
    // beside 8 bytes of moments. (Its fp32 gradients are allocated as the backward frees
    // activations: not in the forward/backward peak's breakdown.)
    let want = [
        (2.0 * n, 12.0 * n),
        (2.0 * n, 12.0 * n / z),
        (2.0 * n, 12.0 * n / z),
        (4.0 * n / z, 8.0 * n / z),
    ];
    for (zero, w) in want.iter().enumerate() {
        let (p, _, o) = states(zero as u8, Recipe::Genslm);
        close(p, w.0, "genslm weights");
        close(o, w.1, "genslm optimizer states");
    }
    // Untied GPT-NeoX parameters = Hugging Face's count.
    let m = shape(8, 512, 8, 2048);
    close(model_params(&m, 69, false), 25_290_752.0, "genslm-25m");
}

#[test]
fn position_table_mask_logits_and_buffers() {
    let m = shape(2, 1024, 16, 4096);
    let (h, s, t) = (1024.0, 8192usize, 4usize);
    let sf = s as f64;
    let hw = gpu(1e6);
    let mut st = megatron(
        layout(t, 1, 1, 0, true),
        AttentionKind::Flash,
        Checkpointing::None,
    );
    st.positions = Position::Learned;
    // Replicated learned table of s rows: 16 bytes per element on every GPU; sharded: / t.
    close(
        estimate(&m, &st, &hw, s).memory.position_table,
        16.0 * sf * h,
        "replicated table",
    );
    st.shard_positions = true;
    close(
        estimate(&m, &st, &hw, s).memory.position_table,
        16.0 * sf * h / t as f64,
        "sharded table",
    );
    // A config's table longer than the sequence is allocated whole (its rows were counted as
    // the sequence's: 2²⁴ rows passed train's memory check and aborted on a 4 GiB allocation).
    let mut long_table = m.clone();
    long_table.max_position_embeddings = 4 * s;
    close(
        estimate(&long_table, &st, &hw, s).memory.position_table,
        16.0 * 4.0 * sf * h / t as f64,
        "a table of 4·s rows",
    );
    // Logits: V/t columns of (2 bf16 + 4 fp32 softmax + 4 fp32 gradient) bytes per token.
    let b = estimate(&m, &st, &hw, s).memory;
    close(b.logits, sf * 1024.0 * 10.0 / t as f64, "logits");
    // Megatron SP: the all-gathered input and the reduce-scatter input, 2·2·s·h (not / t).
    close(b.communication, 4.0 * sf * h, "Megatron-SP buffers");
    // A materialised mask adds s² bytes to the forward/backward; building it needs 8·s²
    // (fp32 ones and tril) on top of the model states, which binds here.
    st.mask = Mask::Materialised;
    let e = estimate(&m, &st, &hw, s);
    let fb = e
        .phases
        .iter()
        .find(|(p, _)| *p == Phase::ForwardBackward)
        .unwrap()
        .1;
    close(fb - b.total(), sf * sf, "materialised mask");
    assert_eq!(e.phase, Phase::MaskCreation);
    close(e.memory.attention, 8.0 * sf * sf, "mask creation");
    close(
        e.total(),
        b.parameters
            + b.gradients
            + b.optimizer_states
            + b.position_table
            + 8.0 * sf * sf
            + GIB
            + 0.05 * hw.mem_bytes,
        "mask creation total",
    );
    // Ulysses p: send + receive of q, k, v for s/p tokens; ZeRO-3 gathers two layers.
    let st = megatron(
        layout(1, 4, 2, 3, false),
        AttentionKind::Flash,
        Checkpointing::None,
    );
    let layer = genslm::plan::layer_params(&m);
    close(
        estimate(&m, &st, &hw, s).memory.communication,
        6.0 * 2.0 * h * sf / 4.0 + 2.0 * 2.0 * layer,
        "Ulysses + ZeRO-3 buffers",
    );
    // The GPU reserve: 1 GiB + 5% of the device.
    let b = estimate(&m, &st, &gpu(80.0), 1024).memory;
    assert!(b.workspace >= GIB + 0.05 * 80.0 * GIB);
}

#[test]
fn search_brackets_the_capacity() {
    let m = shape(8, 2048, 16, 8192);
    let st = megatron(
        layout(2, 1, 1, 0, true),
        AttentionKind::Flash,
        Checkpointing::None,
    );
    let hw = gpu(40.0);
    let n = max_seq_len(&m, &st, &hw);
    let g = granule(&st);
    assert!(n > 0 && n.is_multiple_of(g), "{n}");
    assert!(estimate(&m, &st, &hw, n).total() <= hw.mem_bytes);
    assert!(estimate(&m, &st, &hw, n + g).total() > hw.mem_bytes);
    // More memory never shortens the sequence; a model that cannot fit gets 0.
    assert!(max_seq_len(&m, &st, &gpu(80.0)) >= n);
    assert_eq!(max_seq_len(&shape(96, 12288, 96, 49152), &st, &gpu(8.0)), 0);
}

/// Under full checkpointing the logits peak in their own phase (end of the forward), on top of
/// every layer's kept input, and are gone when the first layer is recomputed.
#[test]
fn checkpointed_logits_peak_at_the_loss() {
    let (h, a, s, t, v) = (256usize, 4usize, 4096usize, 2usize, 65536usize);
    let (hf, sf, tf, vf) = (h as f64, s as f64, t as f64, v as f64);
    let m = shape(2, h, a, 4 * h);
    let mut st = megatron(
        layout(t, 1, 1, 0, true),
        AttentionKind::Flash,
        Checkpointing::Full { partitioned: false },
    );
    st.vocab_size = v;
    let hw = gpu(80.0);
    let e = estimate(&m, &st, &hw, s);
    assert_eq!(e.phase, Phase::Loss);
    // Kept inputs 2·s·e·h/t, the final LN and LM-head inputs 2·e·h and the token ids (20 bytes)
    // per token over t; logits e + 8 bytes per (token, vocabulary entry) over t; the LM head's
    // all-gathered input e·h per token.
    close(
        e.memory.activations,
        2.0 * sf * 2.0 * hf / tf + sf * (2.0 * 2.0 * hf + 20.0) / tf,
        "loss activations",
    );
    close(e.memory.logits, sf * vf * 10.0 / tf, "logits");
    close(e.memory.communication, 2.0 * hf * sf, "LM-head gather");
    // The recomputed layers' phase holds no logits: it does not grow with the vocabulary.
    let fb = |vocab| {
        let mut st = st.clone();
        st.vocab_size = vocab;
        let e = estimate(&m, &st, &hw, s);
        let b = e
            .phases
            .iter()
            .find(|(p, _)| *p == Phase::ForwardBackward)
            .unwrap()
            .1;
        // The model states grow with the embedding: take them out.
        b - (e.memory.parameters + e.memory.gradients + e.memory.optimizer_states)
    };
    close(fb(v), fb(4 * v), "forward/backward without logits");
}

/// Context parallelism: a rank of CP c holds s/c tokens of every region, so genslm's layer
/// keeps 10·h + 2·i elements per local token (as on one rank: q, k, v stay views of the fused
/// QKV buffer), the log-sum-exp a·s/c; the ring's blocks are (2·(2e + 8) + 4)·h bytes per
/// local token; weights are replicated over CP, so ZeRO partitions over D·c; naive attention
/// and a materialised mask are refused with CP.
#[test]
fn context_parallel_splits_every_region_and_zero_spans_it() {
    let (h, a, i, s, c) = (512usize, 8usize, 2048usize, 8192usize, 4usize);
    let mut st = megatron(
        Parallelism {
            degrees: Degrees {
                cp: c,
                ..layout(1, 1, 1, 0, false).degrees
            },
            ..layout(1, 1, 1, 0, false)
        },
        AttentionKind::Flash,
        Checkpointing::None,
    );
    st.recipe = Recipe::Genslm;
    st.precision = Precision::Fp32;
    let (act, att) = one_layer(&st, h, a, i, s);
    close(
        act,
        4.0 * (s / c) as f64 * (10 * h + 2 * i) as f64,
        "cp 4 layer",
    );
    close(att, 4.0 * (a * s / c) as f64, "cp 4 log-sum-exp");
    let m = shape(2, h, a, i);
    let b = estimate(&m, &st, &gpu(1e6), s).memory;
    close(
        b.communication,
        (2.0 * (2.0 * 4.0 + 8.0) + 4.0) * h as f64 * (s / c) as f64,
        "ring blocks",
    );
    // ZeRO-3 over D × c (dp 2 × cp 4): genslm's weight shard is the fp32 master, 4 bytes / 8
    // ranks whatever the compute precision.
    let mut z = megatron(
        Parallelism {
            degrees: Degrees {
                cp: c,
                ..layout(1, 1, 2, 3, false).degrees
            },
            zero: 3,
            ..layout(1, 1, 2, 3, false)
        },
        AttentionKind::Flash,
        Checkpointing::None,
    );
    z.recipe = Recipe::Genslm;
    let b = estimate(&m, &z, &gpu(1e6), 1024).memory;
    close(
        b.parameters,
        4.0 * model_params(&m, 1024, true) / 8.0,
        "ZeRO-3 over dp × cp",
    );
    for (attention, mask) in [
        (AttentionKind::Naive, Mask::None),
        (AttentionKind::Flash, Mask::Materialised),
    ] {
        let mut bad = st.clone();
        (bad.attention, bad.mask) = (attention, mask);
        let e = genslm::plan::check(&m, &bad).unwrap_err().to_string();
        assert!(e.contains("cp 4") && e.contains("ring"), "{e}");
    }
    // The CLI searches CP and names it; with CP given, the sequence granule covers 2·c chunks.
    let config = repo().join("configs/genslm-25b.toml");
    let (ok, out, err) = run(&[
        "plan",
        "--config",
        config.to_str().unwrap(),
        "--gpus",
        "128",
        "--gpu-mem-gib",
        "40",
        "--sweep",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("CP (+any)") && out.contains("cp 2 (ring)"),
        "{out}"
    );
    assert_eq!(
        granule(&Strategy {
            layout: Parallelism {
                degrees: Degrees {
                    cp: 3,
                    ..st.layout.degrees
                },
                ..st.layout
            },
            ..st.clone()
        }),
        3072
    );
}
