//! The fused AdamW kernel against AdamW written out in f64 (PyTorch's formula), on lavapipe.
#![cfg(feature = "wgpu")]

mod common;

use common::{client, download, upload, values};
use genslm_kernels::{adamw, AdamWStep, Dtype, KernelError};

/// One step of AdamW in f64: new (p, m, v), and the step's size had the first moment's two
/// terms not cancelled (what f32 rounding errors scale with).
fn reference(p: f64, g: f64, m: f64, v: f64, s: &AdamWStep) -> (f64, f64, f64, f64) {
    let g = g * s.grad_scale;
    let m_abs = s.beta1 * m.abs() + (1.0 - s.beta1) * g.abs();
    let m = s.beta1 * m + (1.0 - s.beta1) * g;
    let v = s.beta2 * v + (1.0 - s.beta2) * g * g;
    let denom = (v / s.bc2).sqrt() + s.eps;
    let u = s.lr * (m / s.bc1) / denom;
    (p * s.decay - u, m, v, s.lr * (m_abs / s.bc1) / denom)
}

/// The third step of a run with weight decay 0.1, clipped by one half.
fn step() -> AdamWStep {
    AdamWStep {
        grad_scale: 0.5,
        beta1: 0.9,
        beta2: 0.95,
        decay: 1.0 - 1e-3 * 0.1,
        bc1: 1.0 - 0.9f64.powi(3),
        bc2: 1.0 - 0.95f64.powi(3),
        eps: 1e-8,
        lr: 1e-3,
    }
}

fn check(n: usize, working: Dtype, seed: u64) {
    let c = client();
    let round = |xs: Vec<f64>| -> Vec<f64> { xs.iter().map(|&x| x as f32 as f64).collect() };
    let p = round(values(n, seed));
    let g = round(values(n, seed + 1).iter().map(|x| 3.0 * x).collect());
    let m = round(values(n, seed + 2).iter().map(|x| 0.1 * x).collect());
    // Second moments are non-negative.
    let v = round(values(n, seed + 3).iter().map(|x| 0.01 * x * x).collect());
    let step = step();
    let up = |xs: &[f64]| upload(&c, xs, Dtype::F32);
    let (hp, hm, hv, hw) =
        adamw(&c, n, &up(&p), &up(&g), &up(&m), &up(&v), &step, working).expect("launch");
    let (gp, gm, gv) = (
        download(&c, hp, Dtype::F32),
        download(&c, hm, Dtype::F32),
        download(&c, hv, Dtype::F32),
    );
    assert_eq!((gp.len(), gm.len(), gv.len()), (n, n, n));
    for i in 0..n {
        let (wp, wm, wv, u_abs) = reference(p[i], g[i], m[i], v[i], &step);
        // f32 arithmetic over a handful of operations: a few ulps of the largest term.
        let close = |got: f64, want: f64, scale: f64| (got - want).abs() <= 1e-6 * scale;
        assert!(
            close(gm[i], wm, wm.abs().max(g[i].abs())),
            "m[{i}] {} vs {wm}",
            gm[i]
        );
        assert!(
            close(gv[i], wv, wv.abs().max(1e-12)),
            "v[{i}] {} vs {wv}",
            gv[i]
        );
        assert!(
            close(gp[i], wp, p[i].abs() + u_abs),
            "p[{i}] {} vs {wp}",
            gp[i]
        );
    }
    match (working, hw) {
        (Dtype::F32, None) => {}
        (Dtype::F32, Some(_)) => panic!("an f32 run has no separate working copy"),
        (_, None) => panic!("no working copy for {working:?}"),
        (_, Some(hw)) => {
            let w = download(&c, hw, working);
            let want = common::round(&gp, working);
            assert_eq!(
                w, want,
                "the working copy is the new value rounded to {working:?}"
            );
        }
    }
}

#[test]
fn matches_f64_adamw_around_the_block_size() {
    for (k, n) in [1usize, 63, 64, 65, 4099].into_iter().enumerate() {
        check(n, Dtype::F32, 10 + k as u64);
    }
}

/// The working copy in bf16 and f16 where the device stores them; elsewhere (lavapipe has no
/// bf16) a clear error instead of a panic inside the shader compiler.
#[test]
fn writes_the_working_copy_in_half_precision() {
    let mut ran = 0;
    for (k, dtype) in [Dtype::Bf16, Dtype::F16].into_iter().enumerate() {
        let c = client();
        if !dtype.supported(&c) {
            let h = upload(&c, &[0.0], Dtype::F32);
            let err = adamw(&c, 1, &h, &h, &h, &h, &step(), dtype).unwrap_err();
            assert!(matches!(err, KernelError::Dtype { .. }), "{err}");
            eprintln!("{dtype:?}: NOT RUN on {}: {err}", c.name());
            continue;
        }
        check(1000, dtype, 20 + k as u64);
        ran += 1;
    }
    assert!(ran >= 1, "neither half-precision type ran");
}

/// More elements than the grid covers (65535 cubes of 64 units): the grid-stride loop runs
/// a unit over several elements.
#[test]
fn covers_tensors_past_the_grid() {
    check(65_535 * 256 + 1_000, Dtype::F32, 30);
}

#[test]
fn refuses_tensors_past_32_bit_offsets() {
    let c = client();
    let h = upload(&c, &[0.0], Dtype::F32);
    let err = adamw(&c, 1 << 32, &h, &h, &h, &h, &step(), Dtype::F32).unwrap_err();
    assert!(err.to_string().contains("2^32"), "{err}");
}
