//! What `--offload` moves off a GPU (ZeRO-Offload's optimizer state, ALST's checkpointed
//! layer inputs) and the host bytes it costs: the device terms in [`super::terms`] leave out
//! what these say is offloaded.

use super::terms::{
    all_kept_inputs, model_share, offloaded_inputs, offloaded_state, position_states, zdiv,
};
use super::{Hardware, Strategy};
use crate::config::ModelConfig;

/// Bytes per rank that `--offload` keeps in host memory: the optimizer's state (with the
/// position table's) and, under ZeRO-3 with fp32 weights, the weight shard; every layer's
/// kept input.
pub(super) fn offloaded(m: &ModelConfig, st: &Strategy, hw: &Hardware, seq_len: usize) -> f64 {
    let mut host = 0.0;
    let (optimizer, master_shard) = offloaded_state(st, hw);
    if optimizer {
        let (pb, _, ob) = st.precision.state_bytes();
        let pb = if master_shard { pb } else { 0.0 };
        let l = &st.layout;
        let z = l.zero_group() as f64;
        let n = model_share(m, st);
        let [pp, _, po] = position_states(m, st, seq_len as f64, (pb, 0.0, ob));
        host += n * pb / zdiv(l.zero, 3, z) + n * ob / zdiv(l.zero, 1, z) + pp + po;
    }
    if offloaded_inputs(st, hw) {
        host += all_kept_inputs(m, st, seq_len);
    }
    host
}
