//! `genslm plan`'s CPU-process terms against the peaks genslm itself measured on this machine
//! (the calibration: within ±15%).

mod common;

use common::repo;
use genslm::config::{AttentionKind, Config, ModelConfig};
use genslm::plan::cpu::CpuRun;
use genslm::plan::{
    estimate, Checkpointing, Hardware, Layout, Mask, Precision, Recipe, Strategy, Target, MIB,
};

/// Peaks genslm measured on the 2-core development machine (Xeon 2.5 GHz, 23 GiB, glibc,
/// release build; `--features mpi` with Open MPI 4.1.4 for the MPI rows):
/// - `bench`: `genslm bench attention --config configs/tiny.toml --seq-lens …` (one training
///   step without optimizer per length, each in its own process; peak = VmHWM).
/// - `train`: `genslm train --fasta data/lambda_virus.fa --config C --out D --steps 1
///   --seq-len N --batch-size 1 --val-fraction 0 --warmup 0 --quiet`, `peak_rss_mib` of
///   `D/metrics.jsonl` (fp32 weights, AdamW with two fp32 moments, flash attention).
/// - `mpi`: the same under `mpirun --oversubscribe -np P … --sp P` (rank 0's metrics; rank 0's
///   peak can differ by ~8% between identical runs, as glibc returns or keeps freed memory).
///
/// Re-measured 2026-11-24 with `scripts/measure_plan_calibration.sh` (fused gelu and CPU flash
/// kernel).
const MEASURED: &[(&str, &str, usize, AttentionKind, usize, f64)] = &[
    // (config, run, sp, attention, seq_len, peak MiB)
    ("tiny", "bench", 1, AttentionKind::Flash, 2048, 41.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 4096, 69.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 8192, 124.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 16384, 237.0),
    ("tiny", "bench", 1, AttentionKind::Naive, 2048, 493.0),
    ("tiny", "bench", 1, AttentionKind::Naive, 4096, 1885.0),
    ("tiny", "bench", 1, AttentionKind::Naive, 8192, 7405.0),
    ("tiny", "train", 1, AttentionKind::Flash, 2048, 44.1),
    ("tiny", "train", 1, AttentionKind::Flash, 4096, 72.1),
    ("tiny", "train", 1, AttentionKind::Flash, 8192, 128.8),
    ("tiny", "train", 1, AttentionKind::Flash, 16384, 241.1),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 1024, 685.0),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 2048, 1058.5),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 4096, 1772.8),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 9968, 3754.6),
    ("genslm-25m", "mpi", 2, AttentionKind::Flash, 1024, 685.5),
    ("genslm-25m", "mpi", 2, AttentionKind::Flash, 2048, 785.4),
    ("genslm-25m", "mpi", 2, AttentionKind::Flash, 4096, 1018.3),
    ("genslm-25m", "mpi", 2, AttentionKind::Flash, 8192, 1720.6),
    ("genslm-25m", "mpi", 4, AttentionKind::Flash, 1024, 694.9),
    ("genslm-25m", "mpi", 4, AttentionKind::Flash, 2048, 687.3),
    ("genslm-25m", "mpi", 4, AttentionKind::Flash, 4096, 819.7), // median of 3: 756–820
    ("genslm-25m", "mpi", 4, AttentionKind::Flash, 8192, 1074.0),
];

/// The same measurements with full activation checkpointing (`--checkpoint-activations` on
/// `bench step` and `train`; 2-core Xeon, release build).
const MEASURED_CKPT: &[(&str, &str, usize, AttentionKind, usize, f64)] = &[
    ("tiny", "bench", 1, AttentionKind::Flash, 2048, 30.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 4096, 47.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 8192, 81.0),
    ("tiny", "bench", 1, AttentionKind::Flash, 16384, 150.0),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 1024, 488.2),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 4096, 700.9),
    ("genslm-25m", "train", 1, AttentionKind::Flash, 9968, 1097.8),
];

/// The strategy genslm's CPU trainer runs: its own layer recipe in fp32, rotary positions,
/// Ulysses SP over `sp` processes, optimizer replicated (ZeRO-1 only partitions over DP).
fn cpu_strategy(model: &ModelConfig, sp: usize, attention: AttentionKind) -> Strategy {
    Strategy {
        layout: Layout {
            tp: 1,
            sp,
            cp: 1,
            dp: 1,
            zero: 1,
            megatron_sp: false,
            zero_over_sp: false,
        },
        recipe: Recipe::Genslm,
        attention,
        positions: model.position,
        shard_positions: true,
        mask: Mask::None,
        checkpointing: Checkpointing::None,
        precision: Precision::Fp32,
        batch_size: 1,
        tied_embeddings: false,
        vocab_size: model.vocab_size,
    }
}

#[test]
fn cpu_calibration_within_15_percent() {
    let mut worst: f64 = 0.0;
    let mut table = String::from(
        "config       run    sp  attention  ckpt  seq_len  measured  predicted  error\n",
    );
    let cases = MEASURED
        .iter()
        .map(|m| (m, false))
        .chain(MEASURED_CKPT.iter().map(|m| (m, true)));
    for (&(name, run, sp, attention, s, measured), ckpt) in cases {
        let cfg = Config::load(&repo().join(format!("configs/{name}.toml"))).unwrap();
        let mut st = cpu_strategy(&cfg.model, sp, attention);
        if ckpt {
            st.checkpointing = Checkpointing::Full { partitioned: false };
        }
        let hw = Hardware {
            mem_bytes: 1e15,
            target: Target::Cpu {
                run: match run {
                    "bench" => CpuRun::BenchStep,
                    "train" => CpuRun::Train,
                    _ => CpuRun::TrainMpi,
                },
            },
        };
        let predicted = estimate(&cfg.model, &st, &hw, s).total() / MIB;
        let err = predicted / measured - 1.0;
        worst = worst.max(err.abs());
        table.push_str(&format!(
            "{name:<12} {run:<5} {sp:>3}  {:<9}  {:<4}  {s:>7}  {measured:>8.1}  {predicted:>9.1}  {:+.1}%\n",
            format!("{attention:?}").to_lowercase(),
            if ckpt { "yes" } else { "no" },
            100.0 * err
        ));
    }
    println!("{table}");
    assert!(worst <= 0.15, "worst error {:.1}%:\n{table}", 100.0 * worst);
}
