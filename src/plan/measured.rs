//! Peak GPU memory that Megatron-DeepSpeed itself logged, next to this model's prediction for
//! the same shape and layout: a check of the GPU terms against measurements made elsewhere.
//!
//! The runs are the July 2023 long-sequence benchmark jobs of the DeepSpeed4Science work
//! (ThetaGPU, DGX A100-40GB nodes), whose logs are public in the GitHub repository
//! `zhangsmallshark/Megatron-DS-Benchmarking` under `ALCF/su_logs/<job>.output`. Every job ran
//! `pretrain_gpt.py` with `--sequence-parallel --use-flash-attn --checkpoint-activations
//! --checkpoint-num-layers 1 --fp16`, learned absolute positions with
//! `--max-position-embeddings` = the sequence length, GPT-2's vocabulary padded to a multiple of
//! 128·TP, and logged `[Rank 0] (after 1 iterations) memory (MB) | ... | max allocated: M`
//! (`torch.cuda.max_memory_allocated`, MiB). That counter excludes the CUDA context and the
//! caching allocator's slack, so the prediction it is compared with is this model's total
//! minus its fixed GPU reserve ([`super::terms::gpu_reserve`]).

use std::fmt::Write;

use serde::Serialize;

use super::{
    estimate, terms::gpu_reserve, Degrees, Hardware, Parallelism, Phase, Strategy, Target, MIB,
};
use crate::config::{AttentionKind, ModelConfig, Position};
use crate::tokenizer::VocabKind;

/// One logged run: its shape, layout and the peak it logged.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Run {
    /// Job id: the log is `ALCF/su_logs/<job>.output`.
    pub job: &'static str,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub tp: usize,
    pub dp: usize,
    pub zero: u8,
    /// `SeqParallelPositionEmbedding` (the table split over the TP ranks) rather than a plain
    /// `Embedding` (which ZeRO-3 partitions over DP).
    pub shard_positions: bool,
    /// The padded vocabulary the log reports.
    pub vocab: usize,
    pub micro_batch: usize,
    pub seq_len: usize,
    /// Rank 0's `max allocated` after the first iteration, MiB.
    pub max_allocated_mib: f64,
}

const fn run(
    job: &'static str,
    (layers, hidden, heads): (usize, usize, usize),
    (tp, dp, zero, shard_positions): (usize, usize, u8, bool),
    vocab: usize,
    (micro_batch, seq_len): (usize, usize),
    max_allocated_mib: f64,
) -> Run {
    Run {
        job,
        layers,
        hidden,
        heads,
        tp,
        dp,
        zero,
        shard_positions,
        vocab,
        micro_batch,
        seq_len,
        max_allocated_mib,
    }
}

/// Every run of the logs that completed an iteration and printed its memory.
pub const RUNS: [Run; 14] = [
    run(
        "10142816",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (1, 65536),
        19070.7,
    ),
    run(
        "10142816",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (1, 131072),
        20384.5,
    ),
    run(
        "10142816",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (1, 262144),
        28329.8,
    ),
    run(
        "10142843",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (16, 8192),
        20110.1,
    ),
    run(
        "10142843",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (8, 16384),
        20162.1,
    ),
    run(
        "10142843",
        (64, 6144, 64),
        (32, 1, 0, true),
        53248,
        (4, 32768),
        20172.6,
    ),
    run(
        "10143818",
        (64, 6144, 128),
        (32, 1, 0, true),
        53248,
        (1, 262144),
        28336.5,
    ),
    run(
        "10143818",
        (64, 6144, 128),
        (32, 1, 0, true),
        53248,
        (1, 278528),
        29299.3,
    ),
    run(
        "10143687",
        (64, 5760, 80),
        (40, 1, 0, true),
        51200,
        (1, 131040),
        15257.1,
    ),
    run(
        "10143738",
        (80, 5760, 80),
        (40, 1, 0, true),
        51200,
        (1, 65520),
        16653.2,
    ),
    run(
        "10143163",
        (64, 6144, 64),
        (8, 4, 3, false),
        51200,
        (4, 8192),
        20669.3,
    ),
    run(
        "10143163",
        (64, 6144, 64),
        (8, 4, 3, false),
        51200,
        (2, 16384),
        20862.2,
    ),
    run(
        "10143163",
        (64, 6144, 64),
        (16, 2, 3, false),
        51200,
        (1, 32768),
        19066.0,
    ),
    run(
        "10143163",
        (64, 6144, 64),
        (16, 2, 3, false),
        51200,
        (1, 65536),
        23819.4,
    ),
];

/// The run's model: its shape with a 4h MLP and a learned position table.
pub fn shape(r: &Run) -> ModelConfig {
    ModelConfig {
        name: format!("{}L/{}h/{}a", r.layers, r.hidden, r.heads),
        num_layers: r.layers,
        hidden_size: r.hidden,
        num_heads: r.heads,
        intermediate_size: 4 * r.hidden,
        vocab: VocabKind::Genslm69,
        vocab_size: r.vocab,
        max_position_embeddings: r.seq_len,
        position: Position::Learned,
        rotary_pct: 0.25,
        rotary_base: 10000.0,
        layer_norm_eps: 1e-5,
        attention: AttentionKind::Flash,
    }
}

/// The run's settings: Megatron's layer with dropout under TP with Megatron SP, flash
/// attention, full checkpointing, fp16 mixed precision, GPT-2's tied embeddings.
pub fn strategy(r: &Run) -> Strategy {
    // The runs used fp16: the same bytes as bf16 (`Precision::Bf16` is 16-bit mixed).
    let layout = Parallelism {
        degrees: Degrees {
            dp: r.dp,
            cp: 1,
            sp: 1,
            tp: r.tp,
            pp: 1,
        },
        zero: r.zero,
        megatron_sp: true,
        zero_over_sp: false,
        pipeline: crate::plan::PipePlan::default(),
    };
    Strategy {
        shard_positions: r.shard_positions,
        batch_size: r.micro_batch,
        ..super::published::megatron_sp_flash(layout, r.vocab)
    }
}

/// A run with the prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub run: Run,
    pub predicted_mib: f64,
    /// predicted / measured − 1.
    pub rel_error: f64,
    pub phase: Phase,
}

/// Every run with this model's prediction (A100-40GB).
pub fn rows() -> Vec<Row> {
    let hw = Hardware {
        mem_bytes: super::published::A100_40GB,
        target: Target::Gpu,
    };
    RUNS.iter()
        .map(|r| {
            let e = estimate(&shape(r), &strategy(r), &hw, r.seq_len);
            let predicted_mib = (e.total() - gpu_reserve(hw.mem_bytes)) / MIB;
            Row {
                run: *r,
                predicted_mib,
                rel_error: predicted_mib / r.max_allocated_mib - 1.0,
                phase: e.phase,
            }
        })
        .collect()
}

/// The comparison as a text table.
pub fn report(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Peak memory Megatron-DeepSpeed logged (torch max_memory_allocated, rank 0, A100-40GB) vs \
         predicted: Megatron SP + flash + full checkpointing, fp16, micro-batch b"
    );
    let _ = writeln!(
        s,
        "{:<9} {:<14} {:>3} {:>3} {:>4} {:>3} {:>7} {:>9} {:>9} {:>7}  {:<9}",
        "job", "shape", "TP", "DP", "ZeRO", "b", "seq", "logged", "predicted", "error", "positions"
    );
    for r in rows {
        let x = &r.run;
        let _ = writeln!(
            s,
            "{:<9} {:<14} {:>3} {:>3} {:>4} {:>3} {:>7} {:>9.0} {:>9.0} {:>+6.1}%  {:<9}",
            x.job,
            format!("{}L/{}h/{}a", x.layers, x.hidden, x.heads),
            x.tp,
            x.dp,
            x.zero,
            x.micro_batch,
            x.seq_len,
            x.max_allocated_mib,
            r.predicted_mib,
            100.0 * r.rel_error,
            if x.shard_positions { "split" } else { "ZeRO-3" }
        );
    }
    let worst = rows.iter().map(|r| r.rel_error.abs()).fold(0.0, f64::max);
    let _ = writeln!(
        s,
        "{} runs, worst error {:.1}% (MiB; logs: github.com/zhangsmallshark/Megatron-DS-Benchmarking \
         ALCF/su_logs/<job>.output)",
        rows.len(),
        100.0 * worst
    );
    s
}
