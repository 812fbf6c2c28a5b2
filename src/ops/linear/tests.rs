use super::cpu::{bwd_slices, fwd_slices};
use super::*;
use burn::tensor::TensorData;

fn data(n: usize, seed: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.618_034 + seed).fract() - 0.5) * 2.0)
        .collect()
}

/// The naive triple loops in f64: `(y, dx, dw, db)`.
#[allow(clippy::type_complexity)]
fn reference(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    dy: &[f32],
    (rows, n, m): (usize, usize, usize),
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0f64; rows * m], vec![0f64; rows * n]);
    let (mut dw, mut db) = (vec![0f64; n * m], vec![0f64; m]);
    for r in 0..rows {
        for j in 0..m {
            let mut acc = b[j] as f64;
            for i in 0..n {
                acc += x[r * n + i] as f64 * w[i * m + j] as f64;
                dx[r * n + i] += dy[r * m + j] as f64 * w[i * m + j] as f64;
                dw[i * m + j] += x[r * n + i] as f64 * dy[r * m + j] as f64;
            }
            y[r * m + j] = acc;
            db[j] += dy[r * m + j] as f64;
        }
    }
    (y, dx, dw, db)
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what} length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() < 1e-4 * (1.0 + w.abs()),
            "{what} at {i}: {g} vs {w}"
        );
    }
}

/// The loops against f64, on a product small enough for the calling thread, on one split over
/// the pool, and on few-row products (a decoding step's; rows of `w` split over the team, with
/// remainders of the eight-row unrolling and of the split) (odd sizes throughout).
#[test]
fn slices_match_f64_loops() {
    let few = [
        (1, 7, 5),
        (1, 517, 33),
        (3, 1029, 70),
        (4, 64, 16),
        (17, 131, 89),
        (32, 67, 130),
        (2, 0, 9),
        (0, 5, 3),
    ];
    for dims @ (rows, n, m) in [(37, 19, 23), (211, 131, 89)].into_iter().chain(few) {
        let (x, w, bias, dy) = (
            data(rows * n, 0.1),
            data(n * m, 0.4),
            data(m, 0.7),
            data(rows * m, 0.9),
        );
        let (y_ref, dx_ref, dw_ref, db_ref) = reference(&x, &w, &bias, &dy, dims);
        assert_close(&fwd_slices(&x, &w, &bias, dims), &y_ref, "y");
        let (dx, dw, db) = bwd_slices(&x, &w, &dy, dims);
        assert_close(&dx, &dx_ref, "dx");
        assert_close(&dw, &dw_ref, "dw");
        assert_close(&db, &db_ref, "db");
    }
}

/// Under autodiff, the output and every gradient equal burn differentiating its own
/// `linear` (a matmul and a broadcast add); without a bias, `linear` is burn's.
#[test]
fn autodiff_gradients_equal_burn_linear() {
    let ad = burn::tensor::Device::flex().autodiff();
    let ([bs, s, n], m) = ([2, 5, 7], 3);
    type Out = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);
    let run = |fused: bool, with_bias: bool| -> Out {
        let t = |v: Vec<f32>| {
            let n = v.len();
            TensorData::new(v, [n])
        };
        let x = Tensor::<1>::from_data(t(data(bs * s * n, 0.2)), &ad)
            .reshape([bs, s, n])
            .require_grad();
        let w = Tensor::<1>::from_data(t(data(n * m, 0.5)), &ad)
            .reshape([n, m])
            .require_grad();
        let b = Tensor::<1>::from_data(t(data(m, 0.8)), &ad).require_grad();
        let weights = Tensor::<1>::from_data(t(data(bs * s * m, 0.3)), &ad).reshape([bs, s, m]);
        let bias = with_bias.then(|| b.clone());
        let y = if fused {
            linear(x.clone(), w.clone(), bias)
        } else {
            burn::tensor::module::linear(x.clone(), w.clone(), bias)
        };
        let grads = (y.clone() * weights).sum().backward();
        let v = |t: Tensor<1>| t.into_data().try_into_vec::<f32>().unwrap();
        let flat3 = |t: Tensor<3>| {
            let n: usize = t.dims().iter().product();
            v(t.reshape([n]))
        };
        (
            flat3(y.without_autodiff()),
            flat3(x.grad(&grads).expect("dx")),
            v(w.grad(&grads).expect("dw").reshape([n * m])),
            b.grad(&grads).map(v),
        )
    };
    for with_bias in [true, false] {
        let (got, want) = (run(true, with_bias), run(false, with_bias));
        let close = |a: &[f32], b: &[f32], what: &str| {
            assert_eq!(a.len(), b.len());
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() < 1e-5 * (1.0 + y.abs()),
                    "{what} at {i}: {x} vs {y}"
                );
            }
        };
        close(&got.0, &want.0, "y");
        close(&got.1, &want.1, "dx");
        close(&got.2, &want.2, "dw");
        assert_eq!(got.3.is_some(), with_bias, "db exists iff there is a bias");
        if let (Some(a), Some(b)) = (&got.3, &want.3) {
            close(a, b, "db");
        }
    }
}

/// With its weight gradient deferred, the op's backward gives the input's and the bias's
/// gradients as burn's own `linear` does, sends the (detached) weight none, and the queued
/// product, run afterwards, equals burn's weight gradient; a second deferred op queues its own.
#[test]
fn deferred_weight_gradient_equals_burn_linear() {
    let ad = burn::tensor::Device::flex().autodiff();
    let ([bs, s, n], m) = ([2, 5, 7], 3);
    let t = |v: Vec<f32>, shape: [usize; 3]| {
        Tensor::<1>::from_data(TensorData::new(v, [shape.iter().product::<usize>()]), &ad)
            .reshape(shape)
    };
    let x = t(data(bs * s * n, 0.2), [bs, s, n]).require_grad();
    let w = t(data(n * m, 0.5), [1, n, m])
        .reshape([n, m])
        .require_grad();
    let b = t(data(m, 0.8), [1, 1, m]).reshape([m]).require_grad();
    let weights = t(data(bs * s * m, 0.3), [bs, s, m]);
    let v = |t: Tensor<2>| {
        t.reshape([n * m])
            .into_data()
            .try_into_vec::<f32>()
            .unwrap()
    };
    let flat = |t: Tensor<3>| {
        t.reshape([bs * s * n])
            .into_data()
            .try_into_vec::<f32>()
            .unwrap()
    };

    let y = burn::tensor::module::linear(x.clone(), w.clone(), Some(b.clone()));
    let grads = (y * weights.clone()).sum().backward();
    let (dx_ref, dw_ref) = (flat(x.grad(&grads).unwrap()), v(w.grad(&grads).unwrap()));
    let db_ref = b
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();

    let sink = WeightGrads::default();
    let y = linear_deferred(x.clone(), w.clone(), Some(b.clone()), sink.to(4));
    let y2 = linear_deferred(x.clone(), w.clone(), None, sink.to(9));
    let grads = (y * weights.clone() + y2 * weights).sum().backward();
    assert!(
        w.grad(&grads).is_none(),
        "the weight's gradient is left to the queue"
    );
    assert_eq!(sink.len(), 2);
    let close = |a: &[f32], b: &[f32], k: f32, what: &str| {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - k * y).abs() < 1e-5 * (1.0 + y.abs()),
                "{what} at {i}: {x} vs {y}"
            );
        }
    };
    // Two uses of x: its gradient is twice burn's; the bias is in the first op only.
    close(&flat(x.grad(&grads).unwrap()), &dx_ref, 2.0, "dx");
    let db = b
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    close(&db, &db_ref, 1.0, "db");
    let taken = sink.take();
    assert!(sink.is_empty());
    let mut params: Vec<usize> = taken.iter().map(|(i, _)| *i).collect();
    params.sort();
    assert_eq!(params, [4, 9]);
    for (_, dw) in taken {
        close(&v(dw), &dw_ref, 1.0, "dw");
    }
}

/// A layer's rows in three parts sharing one weight (a reshaped parameter, as the model's are):
/// the weight's gradient, gathered from the parts and computed once, is the whole layer's bit
/// for bit (the same product over the same rows), and the input's and the bias's gradients are
/// burn's `linear`'s on the whole; the gradient reaches the parameter through the reshape,
/// which gets one gradient, from the part that completed the set.
#[test]
fn parts_gather_the_whole_weight_gradient() {
    let ad = burn::tensor::Device::flex().autodiff();
    let ([bs, s, n], m) = ([2, 7, 5], 3);
    let leaf = |v: Vec<f32>| {
        let len = v.len();
        Tensor::<1>::from_data(TensorData::new(v, [len]), &ad).require_grad()
    };
    let (xp, wp, bp) = (
        leaf(data(bs * s * n, 0.2)),
        leaf(data(n * m, 0.5)),
        leaf(data(m, 0.8)),
    );
    let weights = Tensor::<1>::from_data(TensorData::new(data(bs * s * m, 0.3), [bs * s * m]), &ad)
        .reshape([bs, s, m]);
    let grads_of = |parted: bool| {
        let x = xp.clone().reshape([bs, s, n]);
        let w = wp.clone().reshape([n, m]);
        let y = if parted {
            let set = WeightParts::new(3);
            let cuts = [(0, 2), (2, 2), (4, 3)];
            let ys = cuts
                .iter()
                .enumerate()
                .map(|(i, &(at, len))| {
                    let xi = x.clone().narrow(1, at, len);
                    linear_part(xi, w.clone(), Some(bp.clone()), set.part(i))
                })
                .collect();
            Tensor::cat(ys, 1)
        } else {
            linear(x, w, Some(bp.clone()))
        };
        let grads = (y * weights.clone()).sum().backward();
        let v = |t: Option<Tensor<1>>| t.unwrap().into_data().try_into_vec::<f32>().unwrap();
        (v(xp.grad(&grads)), v(wp.grad(&grads)), v(bp.grad(&grads)))
    };
    let (dx, dw, db) = grads_of(true);
    let (dx_whole, dw_whole, db_whole) = grads_of(false);
    assert_eq!(
        dw, dw_whole,
        "the gathered weight gradient is the whole product's"
    );
    let close = |a: &[f32], b: &[f32], what: &str| {
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() < 1e-5 * (1.0 + y.abs()),
                "{what} at {i}: {x} vs {y}"
            );
        }
    };
    close(&dx, &dx_whole, "dx");
    close(&db, &db_whole, "db");
    // And both against burn's own linear, an independent implementation.
    let x = xp.clone().reshape([bs, s, n]);
    let y = burn::tensor::module::linear(x, wp.clone().reshape([n, m]), Some(bp.clone()));
    let grads = (y * weights).sum().backward();
    let dw_burn = wp
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    close(&dw, &dw_burn, "dw against burn");
}
