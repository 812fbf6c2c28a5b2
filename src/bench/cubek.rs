//! The baseline of `genslm bench attention --impl cubek`: cubek-attention 0.3.1, the CubeCL
//! attention that burn 0.22.1 ships, launched on the same device and tensors as genslm's
//! fused kernels.
//!
//! Its forward has a unit routine (each unit owns query rows, as ours does) and, on devices
//! with matrix units, plane routines on tensor cores ("blackbox accelerated"); the bench times
//! each one that takes the shape once and keeps the fastest, as burn's autotune would. Its
//! forward writes no log-sum-exp and its backward (one unit per query or key row, no tiling)
//! needs one and runs in f32 only, so the backward is handed genslm's log-sum-exp and is
//! refused for other element types.

use burn::backend::Cube;
use burn::tensor::{DType, Tensor};
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubek_attention::backward::definition::BackwardConfig;
use cubek_attention::backward::flash_attention_backward;
use cubek_attention::forward::definition::{
    AccumulatorPrecision, AttentionGlobalTypes, AttentionOptions,
};
use cubek_attention::forward::launch::{launch_ref, BlueprintStrategy, Strategy};
use cubek_attention::forward::routines::blackbox_accelerated::BlackboxAcceleratedStrategy;

use crate::error::{Error, Result};

/// One of cubek's forward routines, by the name the bench prints.
#[derive(Clone, Debug)]
pub struct Routine {
    pub name: String,
    strategy: Strategy,
}

/// Every forward routine burn's autotune considers for flash attention.
pub fn routines() -> Vec<Routine> {
    let mut all: Vec<Routine> = [2, 4, 8]
        .into_iter()
        .map(|num_planes| Routine {
            name: format!("blackbox_accelerated_{num_planes}_planes"),
            strategy: Strategy::BlackboxAccelerated(BlueprintStrategy::Inferred(
                BlackboxAcceleratedStrategy {
                    num_planes,
                    seq_q: 1,
                    seq_kv: 1,
                },
            )),
        })
        .collect();
    all.push(Routine {
        name: "unit".into(),
        strategy: Strategy::Unit(BlueprintStrategy::Inferred(())),
    });
    all
}

fn primitive<const D: usize>(t: &Tensor<D>) -> Result<CubeTensor> {
    t.clone()
        .try_into_primitive::<Cube>()
        .map(into_contiguous)
        .map_err(|_| {
            Error::Invalid(
                "--impl cubek runs on the CubeCL backends only (--backend cuda or wgpu)".into(),
            )
        })
}

fn elem(dtype: DType) -> Result<ElemType> {
    Ok(ElemType::Float(match dtype {
        DType::F32 => FloatKind::F32,
        DType::BF16 => FloatKind::BF16,
        DType::F16 => FloatKind::F16,
        other => {
            return Err(Error::Invalid(format!(
                "--impl cubek: element type {other:?}"
            )))
        }
    }))
}

/// An uninitialised contiguous tensor shaped and typed like `like`.
fn empty_like(like: &CubeTensor) -> CubeTensor {
    let bytes = like.meta.shape().num_elements() * like.dtype.size();
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        like.meta.shape().clone(),
        like.client.empty(bytes),
        like.dtype,
    )
}

fn failed(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Invalid(format!("cubek-attention {what}: {e:?}"))
}

/// `softmax(q kᵀ / √d) v` (causal: bottom-right aligned, as genslm's) with `routine`.
pub fn forward(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    causal: bool,
    routine: &Routine,
) -> Result<Tensor<4>> {
    let (q, k, v) = (primitive(q)?, primitive(k)?, primitive(v)?);
    let ty = elem(q.dtype)?;
    let client = q.client.clone();
    let types = AttentionGlobalTypes::from_single_float_dtype(
        ty,
        AttentionGlobalTypes::mask_dtype(&client),
    );
    let out = empty_like(&q);
    launch_ref(
        routine.strategy.clone(),
        &client,
        q.binding(),
        k.binding(),
        v.binding(),
        None,
        out.clone().binding(),
        &types,
        AttentionOptions {
            causal,
            accumulator_precision: AccumulatorPrecision::Strict(ElemType::Float(FloatKind::F32)),
        },
    )
    .map_err(|e| failed(&format!("forward ({})", routine.name), e))?;
    Ok(Tensor::from_primitive::<Cube>(out))
}

/// dQ, dK, dV from cubek's backward kernels, given the forward's f32 log-sum-exp `lse`.
pub fn backward(
    [q, k, v, o, d_o]: [&Tensor<4>; 5],
    lse: &Tensor<3>,
    causal: bool,
) -> Result<[Tensor<4>; 3]> {
    let (q, k, v, o, d_o) = (
        primitive(q)?,
        primitive(k)?,
        primitive(v)?,
        primitive(o)?,
        primitive(d_o)?,
    );
    let lse = primitive(&lse.clone().cast(DType::F32))?;
    if q.dtype != DType::F32 {
        return Err(Error::Invalid(format!(
            "cubek-attention's backward runs in f32 only (asked for {:?})",
            q.dtype
        )));
    }
    let client = q.client.clone();
    let types = AttentionGlobalTypes::from_single_float_dtype(
        elem(q.dtype)?,
        AttentionGlobalTypes::mask_dtype(&client),
    );
    let (dq, dk, dv) = (empty_like(&q), empty_like(&k), empty_like(&v));
    let config = BackwardConfig {
        causal,
        ..BackwardConfig::from_head_dim(q.meta.shape()[3])
    };
    flash_attention_backward(
        &client,
        q.binding(),
        k.binding(),
        v.binding(),
        o.binding(),
        lse.binding(),
        d_o.binding(),
        dq.clone().binding(),
        dk.clone().binding(),
        dv.clone().binding(),
        &types,
        config,
    )
    .map_err(|e| failed("backward", e))?;
    let w = Tensor::from_primitive::<Cube>;
    Ok([w(dq), w(dk), w(dv)])
}
