//! The layer cut the planner suggests for pipeline stages (`--pp-layers`): as even as the
//! layer count allows is not memory-balanced, because under 1F1B stage `s` keeps `P − s`
//! micro-batches in flight while the last stage also holds the head. Starting from one layer
//! per stage, each further layer goes to the stage whose peak grows least by taking it, which
//! evens out the stages' peaks (one chunk per stage; interleaving keeps the even cut).

use super::stages::{stage_views, StageView};
use super::{estimate_on, Hardware, Strategy};
use crate::config::ModelConfig;

/// Layers per stage that even out the stages' peaks at `seq_len`, with each stage's peak in
/// bytes; `None` without a pipeline, with interleaving, or for a layout that cannot run.
pub fn suggest_layers(
    m: &ModelConfig,
    st: &Strategy,
    hw: &Hardware,
    seq_len: usize,
) -> Option<(Vec<usize>, Vec<f64>)> {
    let l = &st.layout;
    if l.pp <= 1 || l.pipeline.virtual_stages != 1 || m.num_layers < l.pp {
        return None;
    }
    // Micro-batches in flight per stage: the even cut's kept layers over its layers.
    let even = stage_views(m, l, None).ok()?;
    let in_flight: Vec<usize> = even.iter().map(|v| v.kept_layers / v.layers).collect();
    let peak = |s: usize, layers: usize| {
        let view = StageView {
            layers,
            kept_layers: in_flight[s] * layers,
            ..even[s]
        };
        estimate_on(m, st, hw, seq_len, view).total()
    };
    let mut counts = vec![1usize; l.pp];
    let mut peaks: Vec<f64> = (0..l.pp).map(|s| peak(s, 1)).collect();
    for _ in l.pp..m.num_layers {
        let (s, grown) = (0..l.pp)
            .map(|s| (s, peak(s, counts[s] + 1)))
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        counts[s] += 1;
        peaks[s] = grown;
    }
    Some((counts, peaks))
}
