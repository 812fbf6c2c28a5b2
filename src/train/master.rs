//! DeepSpeed's mixed-precision layout (issue 41, `--precision bf16`): the model's parameters are
//! bf16 working copies on the device; the fp32 master values live with the Adam moments in the
//! optimizer state, sharded and offloaded with them (`AdamW::master`).
//!
//! - The forward and backward run on the bf16 working copies: the values a bf16 compute cast
//!   of fp32 weights would give, so the compute is unchanged; LayerNorm statistics, the
//!   embeddings' sums and the loss stay fp32 (`GenSlm::full`).
//! - Gradients leave the backward in bf16 and are accumulated (micro-batches), reduced
//!   (bucketed collectives) and clipped in fp32 (`recompute::add_into`, `layerwise`).
//! - AdamW updates the fp32 master and hands back its bf16 rounding as the new working copy.
//! - Checkpoints hold the fp32 masters (`Engine::master_model`), so a bf16 run resumes exactly:
//!   the working copy is rebuilt as the master's rounding.
//!
//! Bytes per parameter a rank holds at the update (ψ parameters, N ranks sharding the state):
//!
//! | ZeRO | weights | gradients | master + moments | DeepSpeed (ZeRO paper) |
//! |---|---|---|---|---|
//! | 0 | 2 | 4 | 12 | 2 + 2 + 12 |
//! | 1 | 2 | 4 | 12/N | 2 + 2 + 12/N |
//! | 2 | 2 | 4/N | 12/N | 2 + (2 + 12)/N |
//! | 3 | 4/N (the master is the shard) + gathered layers | 4/N | 8/N | (2 + 2 + 12)/N |
//!
//! Gradients are fp32 where the whole model's are held (ZeRO 0/1): two bytes per parameter
//! more than DeepSpeed, which keeps them bf16, in exchange for sums that lose no digits over
//! micro-batches. fp32 runs keep fp32 parameters and no masters (4 + 4 + 8).

use burn::tensor::{FloatDType, Tensor};

use crate::config::Precision;
use crate::model::GenSlm;

/// Whether `model` trains with bf16 working copies and fp32 masters.
pub fn layout_on(model: &GenSlm) -> bool {
    model.precision == Precision::Bf16
}

/// `t` as a working parameter of `model`: kept in the compute dtype (bf16 under the layout,
/// else unchanged).
pub fn working(model: &GenSlm, t: Tensor<1>) -> Tensor<1> {
    model.compute(t)
}

/// `t` in fp32 (gradients and values on their way to the optimizer or a checkpoint).
pub fn fp32<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.cast(FloatDType::F32)
}

/// Bytes `t`'s values take.
pub fn numel_bytes(t: &Tensor<1>) -> usize {
    t.dims()[0] * t.dtype().size()
}
