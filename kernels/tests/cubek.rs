//! The kernels against a second, independent implementation: `cubek-attention`, the CubeCL
//! attention that burn 0.22.1 ships, run on the same device (lavapipe here).
//!
//! cubek has no ALiBi and no position offsets, so this covers plain and causal attention;
//! the f64 reference in `lavapipe.rs` covers the rest. cubek's forward writes no log-sum-exp,
//! so its backward is fed ours (which `lavapipe.rs` checks against the f64 reference): the
//! gradients themselves come from cubek's own dQ and dK/dV kernels.
#![cfg(feature = "wgpu")]

mod common;

use common::{client, download, rel_err, upload, values};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::std::tensor::TensorHandle;
use cubek_attention::backward::definition::BackwardConfig;
use cubek_attention::backward::flash_attention_backward;
use cubek_attention::forward::definition::{
    AccumulatorPrecision, AttentionGlobalTypes, AttentionOptions,
};
use cubek_attention::forward::launch::{launch_ref, BlueprintStrategy, Strategy};
use genslm_kernels::{backward, forward, AttnConfig, AttnShape, Dtype};

/// Both implementations compute in f32; they differ only in summation order.
const TOL: f64 = 1e-4;

struct Run {
    o: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn binding(h: &Handle, shape: &[usize]) -> cubecl::prelude::TensorBinding {
    TensorHandle::new_contiguous(shape.to_vec(), h.clone(), f32::elem_type_native()).binding()
}

/// Ours and cubek's outputs on the same f32 inputs; cubek's backward only when `grads`.
fn both(s: usize, d: usize, causal: bool, grads: bool) -> (Run, Run) {
    let c = client();
    let (b, h) = (2, 3);
    let n = b * h * s * d;
    let scaled = |seed| {
        values(n, seed)
            .into_iter()
            .map(|x| 3.0 * x)
            .collect::<Vec<_>>()
    };
    let (q, k, v, d_o) = (
        upload(&c, &scaled(1), Dtype::F32),
        upload(&c, &scaled(2), Dtype::F32),
        upload(&c, &values(n, 3), Dtype::F32),
        upload(&c, &values(n, 4), Dtype::F32),
    );
    let shape = AttnShape {
        batch: b,
        heads: h,
        seq_q: s,
        seq_k: s,
        head_dim: d,
    };
    let cfg = AttnConfig {
        causal,
        ..AttnConfig::default()
    };
    let (o, lse) = forward(&c, Dtype::F32, shape, &cfg, &q, &k, &v).expect("our forward");
    let (dq, dk, dv) =
        backward(&c, Dtype::F32, shape, &cfg, &q, &k, &v, &o, &lse, &d_o).expect("our backward");

    let dims = [b, h, s, d];
    let f32_types = AttentionGlobalTypes::from_single_float_dtype(
        f32::elem_type_native(),
        AttentionGlobalTypes::mask_dtype(&c),
    );
    let theirs_o = c.empty(n * 4);
    launch_ref(
        Strategy::Unit(BlueprintStrategy::Inferred(())),
        &c,
        binding(&q, &dims),
        binding(&k, &dims),
        binding(&v, &dims),
        None,
        binding(&theirs_o, &dims),
        &f32_types,
        AttentionOptions {
            causal,
            accumulator_precision: AccumulatorPrecision::Strict(f32::elem_type_native()),
        },
    )
    .expect("cubek forward launches");
    let theirs = if grads {
        let (tq, tk, tv) = (c.empty(n * 4), c.empty(n * 4), c.empty(n * 4));
        let config = BackwardConfig {
            causal,
            ..BackwardConfig::from_head_dim(d)
        };
        flash_attention_backward(
            &c,
            binding(&q, &dims),
            binding(&k, &dims),
            binding(&v, &dims),
            binding(&theirs_o, &dims),
            binding(&lse, &dims[..3]),
            binding(&d_o, &dims),
            binding(&tq, &dims),
            binding(&tk, &dims),
            binding(&tv, &dims),
            &f32_types,
            config,
        )
        .expect("cubek backward launches");
        Run {
            o: download(&c, theirs_o, Dtype::F32),
            dq: download(&c, tq, Dtype::F32),
            dk: download(&c, tk, Dtype::F32),
            dv: download(&c, tv, Dtype::F32),
        }
    } else {
        Run {
            o: download(&c, theirs_o, Dtype::F32),
            dq: vec![],
            dk: vec![],
            dv: vec![],
        }
    };
    let ours = Run {
        o: download(&c, o, Dtype::F32),
        dq: download(&c, dq, Dtype::F32),
        dk: download(&c, dk, Dtype::F32),
        dv: download(&c, dv, Dtype::F32),
    };
    (ours, theirs)
}

/// Each (head dim, causal) pair is a new shader for both implementations and llvmpipe takes
/// up to half a minute to compile one at d = 128 (and a minute to run seq 1000 at d = 128), so
/// the cases cover every length, head dim and mask without taking the full cross product
/// (lavapipe.rs does, against f64).
#[test]
fn forward_matches_cubek() {
    for (s, d, causal) in [
        (17, 64, false),
        (17, 64, true),
        (256, 128, true),
        (1000, 64, true),
    ] {
        let t = std::time::Instant::now();
        let (ours, theirs) = both(s, d, causal, false);
        let e = rel_err(&ours.o, &theirs.o);
        eprintln!(
            "forward seq {s} d {d} causal {causal}: ours vs cubek {e:.1e} ({:.1} s)",
            t.elapsed().as_secs_f64()
        );
        assert!(
            e <= TOL,
            "seq {s} d {d} causal {causal}: O differs by {e:.2e}"
        );
    }
}

/// The comparison can fail: cubek's causal output is far from our bidirectional one.
#[test]
fn the_cubek_comparison_rejects_a_wrong_mask() {
    let (ours, _) = both(64, 64, false, false);
    let (_, theirs) = both(64, 64, true, false);
    let e = rel_err(&ours.o, &theirs.o);
    assert!(e > 100.0 * TOL, "a wrong mask passes: {e:.1e}");
}

#[test]
fn backward_matches_cubek() {
    // cubek's backward is one unit per row looping over every key and head dim without
    // tiling; llvmpipe stops a loop nest at 65535 iterations, so its lengths stay short here.
    for (s, d, causal) in [(17, 64, false), (200, 64, true), (17, 128, true)] {
        {
            let (ours, theirs) = both(s, d, causal, true);
            for (name, a, b) in [
                ("dq", &ours.dq, &theirs.dq),
                ("dk", &ours.dk, &theirs.dk),
                ("dv", &ours.dv, &theirs.dv),
            ] {
                let e = rel_err(a, b);
                eprintln!("backward seq {s} d {d} causal {causal}: {name} ours vs cubek {e:.1e}");
                assert!(
                    e <= TOL,
                    "seq {s} d {d} causal {causal}: {name} differs by {e:.2e}"
                );
            }
        }
    }
}
