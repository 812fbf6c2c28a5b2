//! `genslm plan`: the published comparison (the article's maxima, the cells and their
//! invariants) and the GPU terms against the peaks Megatron-DeepSpeed logged.

use genslm::plan::measured;
use genslm::plan::published::{self, System};

#[test]
fn published_comparison_has_every_cell() {
    let cells = published::cells();
    assert_eq!(cells.len(), 2 * 3 * System::ALL.len());
    let published: Vec<_> = cells.iter().filter(|c| c.published_k.is_some()).collect();
    assert_eq!(published.len(), 18);
    // (The published values themselves live in src/plan/published.rs, read off the article's
    // Figures 7-8; restating them here would compare the constants with a copy of themselves.)
    for c in &published {
        assert!(
            c.predicted_tokens > 0,
            "{} {:?} {}",
            c.model,
            c.system,
            c.gpus
        );
        assert!(c.memory.total() <= published::A100_40GB);
    }
    // More GPUs never shorten a system's longest sequence.
    for c in &cells {
        if let Some(more) = cells
            .iter()
            .find(|x| x.model == c.model && x.system == c.system && x.gpus == 2 * c.gpus)
        {
            assert!(more.predicted_tokens >= c.predicted_tokens);
        }
    }
}

/// The GPU terms against memory measured elsewhere: the peaks Megatron-DeepSpeed logged for
/// its long-sequence runs (Megatron SP + flash + full checkpointing on A100-40GB; the values
/// are copied from the public logs, `src/plan/measured.rs`).
#[test]
fn megatron_deepspeed_logged_peaks_within_10_percent() {
    let rows = measured::rows();
    assert_eq!(rows.len(), measured::RUNS.len());
    for r in &rows {
        let x = &r.run;
        assert!(
            r.rel_error.abs() <= 0.10,
            "job {} ({}L/{}h, TP {}, DP {}, ZeRO {}, b {}, s {}): logged {:.0} MiB, predicted \
             {:.0} MiB ({:+.1}%)",
            x.job,
            x.layers,
            x.hidden,
            x.tp,
            x.dp,
            x.zero,
            x.micro_batch,
            x.seq_len,
            x.max_allocated_mib,
            r.predicted_mib,
            100.0 * r.rel_error
        );
    }
    // Longer sequences of one layout need more memory, as logged.
    let tp32: Vec<_> = rows
        .iter()
        .filter(|r| r.run.tp == 32 && r.run.micro_batch == 1)
        .collect();
    for w in tp32.windows(2) {
        if w[1].run.seq_len > w[0].run.seq_len {
            assert!(w[1].predicted_mib > w[0].predicted_mib);
        }
    }
}
