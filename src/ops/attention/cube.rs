//! The FlashAttention op on burn's CubeCL backends (`--backend cuda`, `--backend wgpu`): the
//! fused kernels of `genslm-kernels` (kernels/), launched on the tensors' own device buffers.
//!
//! One forward launch writes `O` and the f32 log-sum-exp; the backward is the kernels' D
//! pre-pass, dQ and dK/dV launches. Nothing of size `seq × seq` exists on the device. A shape
//! the kernels do not take (head dim above [`genslm_kernels::MAX_HEAD_DIM`], a value dim that
//! differs from the query dim, an element type other than f32/bf16/f16) runs the tiled
//! burn-op path of `flash.rs` instead — same semantics and O(s) memory, many more launches —
//! after one warning naming the limit.

use std::sync::Once;

use burn::backend::{tensor::FloatTensor, Cube};
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use genslm_kernels::{AttnConfig, AttnShape, Dtype};

use super::flash::{FlashAttentionOps, FlashParams};
use super::tiled::{tiled_backward, tiled_forward};
use crate::ops::primitive::Primitive;

/// What the kernels need to know about a call, or why they cannot take it.
fn plan(q: &CubeTensor, v: &CubeTensor, k_len: usize) -> Result<(Dtype, AttnShape), String> {
    let [b, h, sq, d] = dims(q);
    let dv = dims(v)[3];
    let dtype = match q.dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::Bf16,
        DType::F16 => Dtype::F16,
        other => {
            return Err(format!(
                "element type {other:?} (the kernels take f32, bf16, f16)"
            ))
        }
    };
    if dv != d {
        return Err(format!("value dim {dv} differs from the query dim {d}"));
    }
    if d == 0 || d > genslm_kernels::MAX_HEAD_DIM {
        return Err(format!(
            "head dim {d} (the kernels take 1..={})",
            genslm_kernels::MAX_HEAD_DIM
        ));
    }
    Ok((
        dtype,
        AttnShape {
            batch: b,
            heads: h,
            seq_q: sq,
            seq_k: k_len,
            head_dim: d,
        },
    ))
}

fn dims(t: &CubeTensor) -> [usize; 4] {
    let s = t.meta.shape();
    [s[0], s[1], s[2], s[3]]
}

fn config(p: &FlashParams) -> AttnConfig {
    AttnConfig {
        causal: p.opts.causal,
        alibi: p
            .opts
            .alibi
            .as_ref()
            .map(|s| s.iter().map(|&x| x as f32).collect()),
        q_offset: p.opts.q_offset,
        k_offset: p.opts.k_offset,
    }
}

fn fallback_warning(why: &str) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "warning: the fused attention kernels do not take {why}; attention runs on the \
             slower tiled path (same results, O(seq) memory)"
        )
    });
}

/// A contiguous result buffer wrapped as a tensor like `like`.
fn wrap(
    like: &CubeTensor,
    dims: Vec<usize>,
    handle: burn_cubecl::cubecl::server::Handle,
    dtype: DType,
) -> CubeTensor {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims),
        handle,
        dtype,
    )
}

const KERNEL: &str = "flash attention kernel launch";

impl FlashAttentionOps for Cube {
    fn flash_attention_fwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let (dtype, shape) = match plan(&q, &v, dims(&k)[2]) {
            Ok(p) => p,
            Err(why) => {
                fallback_warning(&why);
                let (o, lse) =
                    tiled_forward(Self::tensor(q), Self::tensor(k), Self::tensor(v), &params);
                return (Self::prim(o), Self::prim(lse));
            }
        };
        let (o, lse) = genslm_kernels::forward(
            &q.client,
            dtype,
            shape,
            &config(&params),
            &q.handle,
            &k.handle,
            &v.handle,
        )
        .unwrap_or_else(|e| panic!("{KERNEL}: {e}"));
        let [b, h, sq, d] = dims(&q);
        (
            wrap(&q, vec![b, h, sq, d], o, q.dtype),
            wrap(&q, vec![b, h, sq], lse, DType::F32),
        )
    }

    fn flash_attention_bwd(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        params: FlashParams,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let c = into_contiguous;
        let (q, k, v, o, lse, d_o) = (c(q), c(k), c(v), c(o), c(lse), c(d_o));
        let (dtype, shape) = match plan(&q, &v, dims(&k)[2]) {
            Ok(p) if lse.dtype == DType::F32 && d_o.dtype == q.dtype && o.dtype == q.dtype => p,
            Ok(_) | Err(_) => {
                let lse = Self::tensor::<3>(lse).cast(q.dtype);
                let (dq, dk, dv) = tiled_backward(
                    Self::tensor(q),
                    Self::tensor(k),
                    Self::tensor(v),
                    Self::tensor(o),
                    lse,
                    Self::tensor(d_o),
                    &params,
                );
                return (Self::prim(dq), Self::prim(dk), Self::prim(dv));
            }
        };
        let (dq, dk, dv) = genslm_kernels::backward(
            &q.client,
            dtype,
            shape,
            &config(&params),
            &q.handle,
            &k.handle,
            &v.handle,
            &o.handle,
            &lse.handle,
            &d_o.handle,
        )
        .unwrap_or_else(|e| panic!("{KERNEL}: {e}"));
        let (qd, kd) = (dims(&q).to_vec(), dims(&k).to_vec());
        (
            wrap(&q, qd, dq, q.dtype),
            wrap(&q, kd.clone(), dk, q.dtype),
            wrap(&q, kd, dv, q.dtype),
        )
    }
}
