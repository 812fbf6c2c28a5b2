use super::cpu::{bwd_slices, fwd_slices, Stats, ROWS};
use super::*;
use burn::tensor::{Device, TensorData};

fn data(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.618_034 + seed).fract() - 0.5) * 6.0 + seed)
        .collect()
}

/// The loops against the formulas in f64, over more rows than one task and a width that
/// is not a multiple of the vector lanes.
#[test]
fn slices_match_f64_formulas() {
    let (rows, h) = (2 * ROWS + 5, 37);
    let (x, dy) = (data(rows * h, 0.3), data(rows * h, -0.1));
    let (g, b) = (data(h, 1.0), data(h, 0.2));
    let eps = 1e-5;
    let (y, st) = fwd_slices(&x, &g, &b, eps as f32);
    let stats = Stats {
        mean: &st.mean[..],
        rstd: &st.rstd[..],
    };
    let (dx, cols) = bwd_slices(&x, &g, stats, &dy);
    let (mut dg, mut db) = (vec![0f64; h], vec![0f64; h]);
    for r in 0..rows {
        let xr: Vec<f64> = x[r * h..(r + 1) * h].iter().map(|&v| v.into()).collect();
        let dyr: Vec<f64> = dy[r * h..(r + 1) * h].iter().map(|&v| v.into()).collect();
        let mean = xr.iter().sum::<f64>() / h as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / h as f64;
        let rs = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = xr.iter().map(|v| (v - mean) * rs).collect();
        let gg: Vec<f64> = (0..h).map(|i| dyr[i] * g[i] as f64).collect();
        let a = gg.iter().sum::<f64>() / h as f64;
        let bb = (0..h).map(|i| gg[i] * xhat[i]).sum::<f64>() / h as f64;
        for i in 0..h {
            let want_y = xhat[i] * g[i] as f64 + b[i] as f64;
            let want_dx = rs * (gg[i] - a - xhat[i] * bb);
            let (got_y, got_dx) = (y[r * h + i] as f64, dx[r * h + i] as f64);
            assert!(
                (got_y - want_y).abs() < 1e-5 * (1.0 + want_y.abs()),
                "y {r},{i}"
            );
            assert!(
                (got_dx - want_dx).abs() < 1e-5 * (1.0 + want_dx.abs()),
                "dx {r},{i}"
            );
            dg[i] += dyr[i] * xhat[i];
            db[i] += dyr[i];
        }
    }
    for i in 0..h {
        assert!(
            (cols[i] as f64 - dg[i]).abs() < 1e-4 * (1.0 + dg[i].abs()),
            "dγ {i}"
        );
        assert!(
            (cols[h + i] as f64 - db[i]).abs() < 1e-4 * (1.0 + db[i].abs()),
            "dβ {i}"
        );
    }
}

/// Under autodiff, the output and all three gradients equal burn differentiating its own
/// (composed) LayerNorm.
#[test]
fn autodiff_gradients_equal_burns_layer_norm() {
    let ad = Device::flex().autodiff();
    let (b, s, h) = (2, 3, 50);
    let (xv, wv) = (data(b * s * h, 0.7), data(b * s * h, -0.4));
    let (gv, bv) = (data(h, 1.1), data(h, 0.05));
    type Norm = fn(Tensor<3>, Tensor<1>, Tensor<1>, f64) -> Tensor<3>;
    let run = |f: Norm| {
        let x = Tensor::<3>::from_data(TensorData::new(xv.clone(), [b, s, h]), &ad).require_grad();
        let g = Tensor::<1>::from_data(TensorData::new(gv.clone(), [h]), &ad).require_grad();
        let be = Tensor::<1>::from_data(TensorData::new(bv.clone(), [h]), &ad).require_grad();
        let w = Tensor::<3>::from_data(TensorData::new(wv.clone(), [b, s, h]), &ad);
        let y = f(x.clone(), g.clone(), be.clone(), 1e-5);
        let grads = (y.clone() * w).sum().backward();
        let v = |t: burn::tensor::TensorData| t.try_into_vec::<f32>().unwrap();
        [
            v(y.without_autodiff().into_data()),
            v(x.grad(&grads).expect("dx").into_data()),
            v(g.grad(&grads).expect("dγ").into_data()),
            v(be.grad(&grads).expect("dβ").into_data()),
        ]
    };
    let ours = run(layer_norm);
    let burns = run(|x, g, b, eps| burn::tensor::module::layer_norm(x, g, Some(b), eps));
    for (k, (o, r)) in ours.iter().zip(&burns).enumerate() {
        for (i, (o, r)) in o.iter().zip(r).enumerate() {
            assert!(
                (o - r).abs() < 2e-5 * (1.0 + r.abs()),
                "output {k} at {i}: {o} vs {r}"
            );
        }
    }
}
