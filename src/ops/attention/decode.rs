//! Attention of a decoding step: a few new queries over the key/value cache.
//!
//! The cache holds each layer's keys and values in buffers `[b, h, capacity, d]` of which the
//! first `len` rows are filled. Handing the reference (`naive.rs`) a view of those rows made
//! burn copy both views into contiguous tensors before its matmuls, build the ALiBi bias and
//! the causal mask on the host, and run a dozen tensor ops: at 1,024 cached codons that was
//! about 0.5 ms per layer of genslm-25m, as much as the layer's weights take to read (dev VM,
//! 2026-11-27). On f32 CPU tensors this reads the filled rows in place instead: one task per
//! (sequence, head), scores by dot products, the softmax with the vectorised exp, and the
//! weighted sum of value rows. Other backends and dtypes take the reference on the view.

use burn::tensor::{DType, Tensor, TensorData};

use super::naive::naive_attention;
use super::options::AttnOptions;
use crate::ops::simd::{dispatched, exp_neg, host_f32, values};
use crate::ops::team;

/// softmax(q kᵀ / √d + bias, masked) v for `q: [b, h, s, d]` over rows `0..len` of `k, v:
/// [b, h, capacity, d]` (keys at positions `k_offset + j`, queries at `q_offset + i`), as
/// [`naive_attention`] computes it on the views.
pub fn cached_attention(
    q: Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    len: usize,
    opts: &AttnOptions,
) -> Tensor<4> {
    let [b, h, s, d] = q.dims();
    let cap = k.dims()[2];
    assert!(len <= cap && v.dims() == k.dims() && k.dims()[3] == d);
    let cpu = |t: &Tensor<4>| {
        t.dtype() == DType::F32
            && t.clone()
                .try_into_primitive::<burn::backend::Flex>()
                .is_ok()
    };
    if !(cpu(&q) && cpu(k) && cpu(v)) {
        return naive_attention(
            q,
            k.clone().narrow(2, 0, len),
            v.clone().narrow(2, 0, len),
            opts,
        );
    }
    let device = q.device();
    let (qs, ks, vs) = (host_f32(q), host_f32(k.clone()), host_f32(v.clone()));
    let (qs, ks, vs) = (values(&qs), values(&ks), values(&vs));
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; b * h * s * d];
    team::for_each_chunk_mut(&mut out, s * d, |bh, o| {
        let neg_slope = opts.alibi.as_ref().map(|sl| -(sl[bh % h] as f32));
        let kh = &ks[bh * cap * d..(bh * cap + len) * d];
        let vh = &vs[bh * cap * d..(bh * cap + len) * d];
        let mut p = vec![0f32; len];
        for (i, oi) in o.chunks_exact_mut(d).enumerate() {
            let qi = &qs[(bh * s + i) * d..(bh * s + i + 1) * d];
            let qp = opts.q_offset + i;
            // Keys a causal query sees: those at positions up to its own.
            let seen = if opts.causal {
                (qp + 1).saturating_sub(opts.k_offset).min(len)
            } else {
                len
            };
            if seen == 0 {
                continue; // nothing to attend to: the reference gives NaN, never asked here
            }
            let p = &mut p[..seen];
            scores(p, qi, &kh[..seen * d], scale);
            if let Some(ns) = neg_slope {
                for (j, x) in p.iter_mut().enumerate() {
                    let dist = qp as f32 - (opts.k_offset + j) as f32;
                    *x += ns * if opts.causal { dist } else { dist.abs() };
                }
            }
            let max = p.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let sum = exp_shifted(p, max);
            weighted_rows(oi, p, &vh[..seen * d], 1.0 / sum);
        }
    });
    Tensor::from_data(TensorData::new(out, [b, h, s, d]), &device)
}

/// Lanes of the dot products' partial sums: a sum in order is one chain of dependent adds,
/// which the compiler may not reorder into vectors; sixteen independent sums are one AVX-512
/// register (two AVX2 ones).
const LANES: usize = 16;

dispatched!(scores, (p: &mut [f32], q: &[f32], k: &[f32], scale: f32), {
    let d = q.len();
    let split = d - d % LANES;
    for (x, kj) in p.iter_mut().zip(k.chunks_exact(d)) {
        let mut lanes = [0f32; LANES];
        for (qc, kc) in q[..split].chunks_exact(LANES).zip(kj[..split].chunks_exact(LANES)) {
            for l in 0..LANES {
                lanes[l] += qc[l] * kc[l];
            }
        }
        let mut dot: f32 = lanes.iter().sum();
        for (a, b) in q[split..].iter().zip(&kj[split..]) {
            dot += a * b;
        }
        *x = dot * scale;
    }
});

dispatched!(exp_shifted, (p: &mut [f32], max: f32) -> f32, {
    let mut sum = 0f32;
    for x in p.iter_mut() {
        *x = exp_neg(*x - max);
        sum += *x;
    }
    sum
});

dispatched!(weighted_rows, (o: &mut [f32], p: &[f32], v: &[f32], norm: f32), {
    let d = o.len();
    for (&pj, vj) in p.iter().zip(v.chunks_exact(d)) {
        for (a, &b) in o.iter_mut().zip(vj) {
            *a += pj * b;
        }
    }
    for a in o.iter_mut() {
        *a *= norm;
    }
});

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;
    use crate::ops::primitive::tensor_to_vec;

    fn tensor(dims: [usize; 4], seed: f32) -> Tensor<4> {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.754_877_7 + seed).fract() - 0.5) * 3.0)
            .collect();
        Tensor::from_data(TensorData::new(v, dims), &Device::flex())
    }

    /// Every query count, cache fill, capacity, causal or not, with and without ALiBi, equals
    /// the reference on the filled rows.
    #[test]
    fn equals_the_reference_on_the_filled_rows() {
        let (b, h) = (2, 3);
        // Head dims with and without a remainder past the dot products' 16 lanes.
        for (d, s, len, cap) in [
            (16, 1, 1, 1),
            (8, 1, 37, 64),
            (24, 3, 40, 40),
            (64, 5, 129, 200),
            (40, 16, 16, 30),
        ] {
            for causal in [true, false] {
                for alibi in [None, Some(vec![0.5, 0.125, 0.03125])] {
                    let opts = AttnOptions {
                        causal,
                        alibi,
                        q_offset: len - s,
                        k_offset: 0,
                    };
                    let q = tensor([b, h, s, d], 0.1);
                    let (k, v) = (tensor([b, h, cap, d], 0.3), tensor([b, h, cap, d], 0.7));
                    let got = tensor_to_vec(&cached_attention(q.clone(), &k, &v, len, &opts));
                    let want = naive_attention(q, k.narrow(2, 0, len), v.narrow(2, 0, len), &opts);
                    let worst = got
                        .iter()
                        .zip(tensor_to_vec(&want))
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    let what = format!(
                        "d {d} s {s} len {len} cap {cap} causal {causal} {:?}",
                        opts.alibi
                    );
                    assert!(worst < 1e-5, "{what}: {worst}");
                }
            }
        }
    }
}
