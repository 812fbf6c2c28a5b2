use super::cpu::{transpose_heads, Shape};
use super::*;
use crate::model::position::rotary_tables;
use crate::ops::attention::naive::naive_attention;
use burn::tensor::TensorData;

/// Output and QKV gradient against burn differentiating the composed steps (head split,
/// rotary as tensor ops, attention with every score materialised, merge), with partial rotary, a batch of
/// two, a length that is not a multiple of the tiles, and an offset; with and without
/// the causal mask.
#[test]
fn matches_autodiff_of_the_composed_steps() {
    let ad = burn::tensor::Device::flex().autodiff();
    let (b, s, h, d, rot) = (2, 37, 3, 8, 4);
    let n = b * s * h * 3 * d;
    let vals: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let wts: Vec<f32> = (0..b * s * h * d)
        .map(|i| (i as f32 * 0.11).cos())
        .collect();
    let (cos, sin) = rotary_tables(rot, 10_000.0, 5, s, &ad);
    for causal in [true, false] {
        let o = AttnOptions {
            causal,
            alibi: None,
            q_offset: 5,
            k_offset: 5,
        };
        let run = |fused: bool| {
            let qkv = Tensor::<3>::from_data(TensorData::new(vals.clone(), [b, s, h * 3 * d]), &ad)
                .require_grad();
            let p = QkvParams {
                heads: h,
                rot,
                flash: FlashParams::new(&o, 16, 16),
            };
            let out = if fused {
                qkv_attention(qkv.clone(), (&cos, &sin), h, rot, &o)
            } else {
                let (q, k, v) = split_composed(qkv.clone(), &cos, &sin, &p);
                merge_composed(naive_attention(q, k, v, &o))
            };
            let weights = Tensor::<3>::from_data(TensorData::new(wts.clone(), [b, s, h * d]), &ad);
            let grads = (out.clone() * weights).sum().backward();
            let v = |t: Tensor<3>| t.into_data().try_into_vec::<f32>().unwrap();
            (
                v(out.without_autodiff()),
                v(qkv.grad(&grads).expect("dqkv")),
            )
        };
        let ((y, g), (y_ref, g_ref)) = (run(true), run(false));
        for (what, a, r) in [("o", &y, &y_ref), ("dqkv", &g, &g_ref)] {
            assert_eq!(a.len(), r.len());
            for (i, (x, want)) in a.iter().zip(r.iter()).enumerate() {
                assert!(
                    (x - want).abs() < 2e-5 * (1.0 + want.abs()),
                    "{what} at {i} (causal {causal}): {x} vs {want}"
                );
            }
        }
    }
}

/// The loops' head transposes are inverses, and the split's v is the input's v columns.
#[test]
fn transposes_round_trip() {
    let n = Shape {
        b: 2,
        h: 3,
        s: 5,
        d: 4,
        rot: 0,
    };
    let x: Vec<f32> = (0..2 * 3 * 5 * 4).map(|i| i as f32).collect();
    let heads = transpose_heads(&x, n, false);
    assert_eq!(transpose_heads(&heads, n, true), x);
    // Token 1 of batch 1, head 2, element 3 of a [b, s, h·d] input.
    assert_eq!(
        heads[((3 + 2) * 5 + 1) * 4 + 3],
        x[((5 + 1) * 3 + 2) * 4 + 3]
    );
}
