//! What `--offload` moves off a GPU (ZeRO-Offload's optimizer state, ALST's checkpointed
//! layer inputs) and the host bytes it costs: what the device terms of [`super::terms`] hold
//! without the offload and no longer hold with it.

use super::state_terms::state_parts;
use super::terms::kept_layer_inputs;
use super::{Hardware, Offload, Strategy};
use crate::config::ModelConfig;

/// Bytes per rank that `--offload` keeps in host memory: the optimizer's state (with the
/// position table's) and, under ZeRO-3 with fp32 weights, the weight shard; every layer's
/// kept input.
pub(super) fn offloaded(m: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> f64 {
    // Weights and optimizer state (gradients never move), and the kept inputs, on the device.
    let resident = |s: &Strategy| {
        let ([w, _, o], [pw, _, po]) = state_parts(m, s, hw, seq_len as f64, false);
        w + o + pw + po + kept_layer_inputs(m, s, hw, seq_len)
    };
    let stay = Strategy {
        offload: Offload::None,
        ..st.clone()
    };
    resident(&stay) - resident(st)
}
