//! The kernels against an f64 naive reference, run on whichever wgpu device the machine has:
//! Mesa's lavapipe (software Vulkan) on machines without a GPU (`scripts/test-kernels.sh`).
#![cfg(feature = "wgpu")]

mod common;
mod reference;

use common::{client, download, rel_err, round, tolerance, upload, values};
use cubecl::prelude::*;
use genslm_kernels::{backward, forward, AttnConfig, AttnShape, Dtype, KernelError, NO_KEY_LSE};
use reference::Case;

/// GPT-NeoX/ALiBi-style slopes for `h` heads (geometric, as genslm's model uses).
fn slopes(h: usize) -> Vec<f64> {
    (0..h)
        .map(|i| 2f64.powf(-8.0 * (i + 1) as f64 / h as f64))
        .collect()
}

struct Outputs {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

struct Inputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
}

fn inputs(case: &Case, dtype: Dtype) -> Inputs {
    let nq = case.b * case.h * case.sq * case.d;
    let nk = case.b * case.h * case.sk * case.d;
    // Queries and keys scaled up so softmax rows are peaked rather than flat.
    let big = |xs: Vec<f64>| xs.into_iter().map(|x| 3.0 * x).collect::<Vec<_>>();
    Inputs {
        q: round(&big(values(nq, 1)), dtype),
        k: round(&big(values(nk, 2)), dtype),
        v: round(&values(nk, 3), dtype),
        d_o: round(&values(nq, 4), dtype),
    }
}

fn run_kernels(case: &Case, dtype: Dtype, x: &Inputs) -> Outputs {
    let c = client();
    let shape = AttnShape {
        batch: case.b,
        heads: case.h,
        seq_q: case.sq,
        seq_k: case.sk,
        head_dim: case.d,
    };
    let cfg = AttnConfig {
        causal: case.causal,
        alibi: case
            .alibi
            .as_ref()
            .map(|s| s.iter().map(|&x| x as f32).collect()),
        q_offset: case.q_off,
        k_offset: case.k_off,
    };
    let (q, k, v, d_o) = (
        upload(&c, &x.q, dtype),
        upload(&c, &x.k, dtype),
        upload(&c, &x.v, dtype),
        upload(&c, &x.d_o, dtype),
    );
    let (o, lse) = forward(&c, dtype, shape, &cfg, &q, &k, &v).expect("forward launches");
    let (dq, dk, dv) =
        backward(&c, dtype, shape, &cfg, &q, &k, &v, &o, &lse, &d_o).expect("backward launches");
    Outputs {
        o: download(&c, o, dtype),
        lse: download(&c, lse, Dtype::F32),
        dq: download(&c, dq, dtype),
        dk: download(&c, dk, dtype),
        dv: download(&c, dv, dtype),
    }
}

/// Every output of the kernels against the f64 reference; returns the largest relative error.
fn check(case: &Case, dtype: Dtype) -> f64 {
    let x = inputs(case, dtype);
    let got = run_kernels(case, dtype, &x);
    let (o, lse) = case.forward(&x.q, &x.k, &x.v);
    let g = case.backward(&x.q, &x.k, &x.v, &x.d_o);
    // Rows that see no key: the reference says −∞, the kernel writes its finite stand-in.
    for (a, b) in got.lse.iter().zip(&lse) {
        if b.is_infinite() {
            assert!(*a <= NO_KEY_LSE as f64 * 0.5, "no-key row lse {a}");
        }
    }
    let finite = |xs: &[f64], like: &[f64]| -> Vec<f64> {
        xs.iter()
            .zip(like)
            .filter(|(_, b)| b.is_finite())
            .map(|(a, _)| *a)
            .collect()
    };
    let errs = [
        ("o", rel_err(&got.o, &o)),
        ("lse", rel_err(&finite(&got.lse, &lse), &finite(&lse, &lse))),
        ("dq", rel_err(&got.dq, &g.dq)),
        ("dk", rel_err(&got.dk, &g.dk)),
        ("dv", rel_err(&got.dv, &g.dv)),
    ];
    let tol = tolerance(dtype);
    for (name, e) in errs {
        assert!(
            e <= tol,
            "{name}: relative error {e:.2e} > {tol:.0e} (dtype {dtype:?}, b {} h {} sq {} sk {} \
             d {} causal {} alibi {} offsets {}/{})",
            case.b,
            case.h,
            case.sq,
            case.sk,
            case.d,
            case.causal,
            case.alibi.is_some(),
            case.q_off,
            case.k_off
        );
    }
    errs.iter().map(|e| e.1).fold(0.0, f64::max)
}

fn case(s: usize, d: usize, causal: bool, alibi: bool) -> Case {
    Case {
        b: 2,
        h: 3,
        sq: s,
        sk: s,
        d,
        causal,
        alibi: alibi.then(|| slopes(3)),
        q_off: 0,
        k_off: 0,
    }
}

/// A long case: one sequence of two heads. The long tests are about lengths and offsets
/// (many key blocks, positions past 4096), not batch or head indexing, which the short cases
/// cover with 2×3; the f64 reference and llvmpipe both cost b·h·s², so fewer heads keep the
/// suite in CI's time.
fn long(s: usize, d: usize, causal: bool, alibi: bool) -> Case {
    Case {
        b: 1,
        h: 2,
        alibi: alibi.then(|| slopes(2)),
        ..case(s, d, causal, false)
    }
}

#[test]
fn short_sequences_every_mask_and_head_dim() {
    for s in [1, 17, 256] {
        for d in [64, 128] {
            for causal in [false, true] {
                for alibi in [false, true] {
                    let e = check(&case(s, d, causal, alibi), Dtype::F32);
                    eprintln!("seq {s} d {d} causal {causal} alibi {alibi}: max rel err {e:.1e}");
                }
            }
        }
    }
}

#[test]
fn seq_1000_with_position_offsets() {
    for (d, causal, alibi, q_off, k_off) in [
        (64, true, true, 700, 200),
        (128, true, false, 500, 500),
        (128, false, true, 40, 900),
        (64, false, false, 3, 0),
    ] {
        let c = Case {
            q_off,
            k_off,
            ..long(1000, d, causal, alibi)
        };
        let e = check(&c, Dtype::F32);
        eprintln!("seq 1000 d {d} causal {causal} alibi {alibi} offsets {q_off}/{k_off}: {e:.1e}");
    }
}

/// Query and key blocks of different lengths, as a KV cache or a ring step gives: queries
/// after all keys, and keys after some queries (rows that see no key at all).
#[test]
fn unequal_lengths_and_rows_without_keys() {
    for (sq, sk, q_off, k_off) in [(17, 256, 300, 40), (256, 17, 0, 100), (100, 300, 0, 0)] {
        let c = Case {
            sq,
            sk,
            q_off,
            k_off,
            ..case(1, 64, true, true)
        };
        check(&c, Dtype::F32);
    }
}

#[test]
fn seq_4097_both_head_dims() {
    for (d, alibi) in [(64, true), (128, false)] {
        let e = check(&long(4097, d, true, alibi), Dtype::F32);
        eprintln!("seq 4097 d {d} causal alibi {alibi}: {e:.1e}");
    }
}

/// bf16 and f16 inputs (f32 statistics and accumulators) where the device stores them; a
/// device that cannot gets a clear error instead of a panic inside the shader compiler.
#[test]
fn half_precision_inputs_accumulate_in_f32() {
    let mut tested = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::F16] {
        if !dtype.supported(&client()) {
            let c = case(4, 64, true, false);
            let x = inputs(&c, dtype);
            let cl = client();
            let h = upload(&cl, &x.q, dtype);
            let shape = AttnShape {
                batch: 2,
                heads: 3,
                seq_q: 4,
                seq_k: 4,
                head_dim: 64,
            };
            let err = forward(&cl, dtype, shape, &AttnConfig::default(), &h, &h, &h).unwrap_err();
            assert!(matches!(err, KernelError::Dtype { .. }), "{err}");
            eprintln!("{dtype:?}: NOT RUN on {}: {err}", cl.name());
            continue;
        }
        for d in [64, 128] {
            let c = Case {
                q_off: 30,
                k_off: 10,
                ..case(256, d, true, true)
            };
            let e = check(&c, dtype);
            eprintln!("{dtype:?} d {d}: {e:.1e}");
        }
        tested.push(dtype);
    }
    // The software driver must run at least one half type; which ones is reported above.
    if std::env::var("GENSLM_KERNELS_DEVICE").is_err() {
        assert!(!tested.is_empty(), "lavapipe ran neither bf16 nor f16");
    }
}

/// The tolerance is tight enough to catch a broken kernel: a mask, slope or offset that is
/// slightly wrong in the reference puts it far outside the tolerance of the kernel's output.
#[test]
fn the_checks_reject_a_wrong_mask_slope_or_offset() {
    let base = Case {
        q_off: 5,
        k_off: 0,
        ..case(64, 64, true, true)
    };
    let x = inputs(&base, Dtype::F32);
    let got = run_kernels(&base, Dtype::F32, &x);
    let mut wrong = vec![
        Case {
            causal: false,
            alibi: base.alibi.clone(),
            ..case(64, 64, false, true)
        },
        Case {
            alibi: Some(slopes(3).iter().map(|s| s * 1.05).collect()),
            ..case(64, 64, true, true)
        },
        case(64, 64, true, true),
    ];
    wrong[0].q_off = 5;
    wrong[1].q_off = 5;
    for (what, w) in ["mask", "slope", "offset"].iter().zip(&wrong) {
        let (o, _) = w.forward(&x.q, &x.k, &x.v);
        let g = w.backward(&x.q, &x.k, &x.v, &x.d_o);
        let e = rel_err(&got.o, &o).max(rel_err(&got.dq, &g.dq));
        assert!(
            e > 10.0 * tolerance(Dtype::F32),
            "a wrong {what} passes: {e:.1e}"
        );
    }
}

#[test]
fn unsupported_head_dim_is_a_clear_error() {
    let c = client();
    let shape = AttnShape {
        batch: 1,
        heads: 1,
        seq_q: 4,
        seq_k: 4,
        head_dim: 512,
    };
    let h = c.create_from_slice(f32::as_bytes(&vec![0.0f32; 4 * 512]));
    let err = forward(&c, Dtype::F32, shape, &AttnConfig::default(), &h, &h, &h).unwrap_err();
    assert_eq!(err, KernelError::HeadDim(512));
    assert!(err.to_string().contains("1..=256"), "{err}");
}

#[test]
fn buffers_past_32_bit_offsets_are_refused_before_any_launch() {
    // b·h·s·d = 1·32·2^20·128 = 2^32: with 32-bit offsets the last heads' rows would wrap onto
    // the first heads' and overwrite them silently. The guard answers before anything is
    // allocated or launched, so tiny stand-in buffers are enough here.
    let c = client();
    let h = c.create_from_slice(f32::as_bytes(&[0.0f32; 4]));
    let big = AttnShape {
        batch: 1,
        heads: 32,
        seq_q: 1 << 20,
        seq_k: 1 << 20,
        head_dim: 128,
    };
    let cfg = AttnConfig {
        causal: true,
        ..AttnConfig::default()
    };
    let err = forward(&c, Dtype::F32, big, &cfg, &h, &h, &h).unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)), "{err:?}");
    assert!(err.to_string().contains("2^32"), "{err}");
    let err = backward(&c, Dtype::F32, big, &cfg, &h, &h, &h, &h, &h, &h).unwrap_err();
    assert!(err.to_string().contains("2^32"), "{err}");
}
