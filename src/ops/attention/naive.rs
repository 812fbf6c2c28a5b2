//! The reference attention: softmax(q kᵀ / √d + bias, masked) v with every `[b, h, sq, sk]`
//! score materialised. O(s²) memory; every faster path is tested against it.
//!
//! Positions are global: query i sits at `q_offset + i`, key j at `k_offset + j`. Causal masking
//! hides keys after the query. ALiBi adds `-slope_h · (pos_q − pos_k)` (and
//! `-slope_h · |pos_q − pos_k|` when not causal).

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};

use super::options::AttnOptions;

/// The reference: softmax(q kᵀ / √d + bias, masked) v with every score materialised.
pub fn naive_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, opts: &AttnOptions) -> Tensor<4> {
    let [b, h, sq, d] = q.dims();
    let sk = k.dims()[2];
    let device = q.device();
    let mut scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (d as f64).sqrt());
    if let Some(slopes) = &opts.alibi {
        assert_eq!(slopes.len(), h, "one ALiBi slope per head");
        let mut bias = Vec::with_capacity(h * sq * sk);
        for s in slopes {
            for i in 0..sq {
                for j in 0..sk {
                    let dist = (opts.q_offset + i) as f64 - (opts.k_offset + j) as f64;
                    let dist = if opts.causal { dist } else { dist.abs() };
                    bias.push((-s * dist) as f32);
                }
            }
        }
        let bias = Tensor::<4>::from_data(TensorData::new(bias, [1, h, sq, sk]), &device);
        scores = scores + bias.expand([b, h, sq, sk]);
    }
    if opts.causal {
        let mut mask = Vec::with_capacity(sq * sk);
        for i in 0..sq {
            for j in 0..sk {
                mask.push(opts.k_offset + j > opts.q_offset + i);
            }
        }
        let mask = Tensor::<4, Bool>::from_data(TensorData::new(mask, [1, 1, sq, sk]), &device);
        scores = scores.mask_fill(mask.expand([b, h, sq, sk]), f32::NEG_INFINITY);
    }
    softmax(scores, 3).matmul(v)
}
