//! The `genslm plan` command: arguments, layout search, sweeps and the text / JSON reports.

use std::path::PathBuf;

use clap::ValueEnum;
use serde::Serialize;

use super::cpu::CpuRun;
use super::report::{gib, single_report, sweep_report, tokens};
use super::{
    check, estimate, granule, max_seq_len, published, Checkpointing, Estimate, Hardware, Layout,
    Mask, Precision, Recipe, Strategy, Target, GIB,
};
use crate::config::{AttentionKind, Config, ModelConfig, Position};
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Flash,
    Naive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PositionArg {
    Rotary,
    Learned,
    Alibi,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    Bf16,
    Fp32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// GPUs (CUDA context and allocator reserve).
    Gpu,
    /// CPU processes running genslm (one per rank; process baseline, fp32).
    Cpu,
}

/// `genslm plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Model config (TOML), e.g. configs/genslm-33b.toml.
    #[arg(long, required_unless_present = "compare_published")]
    pub config: Option<PathBuf>,
    /// Number of GPUs (CPU processes with --device cpu).
    #[arg(long, required_unless_present = "compare_published")]
    pub gpus: Option<usize>,
    /// Memory of each GPU in GiB (of each process with --device cpu).
    #[arg(long, required_unless_present = "compare_published")]
    pub gpu_mem_gib: Option<f64>,
    /// Ulysses sequence-parallel degree (default: searched).
    #[arg(long)]
    pub sp: Option<usize>,
    /// Tensor-parallel degree, as genslm's --tp runs it: heads, MLP columns and vocabulary
    /// split, LayerNorm and residual activations whole on every TP rank (no Megatron sequence
    /// parallelism) (default: searched, ≤ a node).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Context-parallel degree (ring attention; default: searched).
    #[arg(long)]
    pub cp: Option<usize>,
    /// Data-parallel degree (default: what the GPUs leave).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage 0-3 (default: searched).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Attention (default: the config's).
    #[arg(long, value_enum)]
    pub attention: Option<AttentionArg>,
    /// Position encoding (default: the config's).
    #[arg(long, value_enum)]
    pub positions: Option<PositionArg>,
    /// Split a learned position table over the sequence-parallel ranks (genslm's trainer does
    /// this under --sp).
    #[arg(long)]
    pub shard_positions: bool,
    /// Full activation checkpointing: each layer keeps its input and is recomputed (genslm train
    /// --checkpoint-activations).
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Number formats (default: bf16 mixed precision on GPUs, fp32 on CPU).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Also break the memory down at this sequence length.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// What runs the ranks.
    #[arg(long, value_enum, default_value = "gpu")]
    pub device: DeviceArg,
    /// GPUs per node: searched tensor parallelism stays within a node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: usize,
    /// Table over GPU counts (powers of two up to --gpus) and layouts, with the best of each.
    #[arg(long, conflicts_with_all = ["sp", "tp", "cp", "dp", "seq_len"])]
    pub sweep: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Compare with the published Megatron-DeepSpeed maxima (25B/33B on A100-40GB), and with
    /// the peak memory Megatron-DeepSpeed logged for its long-sequence runs.
    #[arg(long, conflicts_with_all = ["config", "gpus", "gpu_mem_gib", "sweep", "seq_len"])]
    pub compare_published: bool,
}

/// The largest cluster planned for (layouts are searched over the divisors of the count).
pub const MAX_GPUS: usize = 1 << 20;

/// Runs the command; returns what to print.
pub fn run(a: &PlanArgs) -> Result<String> {
    if a.compare_published {
        let cells = published::cells();
        let logged = super::measured::rows();
        return Ok(if a.json {
            let mut v = published::json(&cells);
            v["logged_runs"] = serde_json::to_value(&logged)
                .map_err(|e| Error::Invalid(format!("serialising the logged runs: {e}")))?;
            to_json(&v)?
        } else {
            format!(
                "{}\n{}",
                published::report(&cells),
                super::measured::report(&logged)
            )
        });
    }
    let (path, gpus, mem) = match (&a.config, a.gpus, a.gpu_mem_gib) {
        (Some(p), Some(g), Some(m)) => (p, g, m),
        _ => {
            return Err(Error::Invalid(
                "plan needs --config, --gpus and --gpu-mem-gib (or --compare-published)".into(),
            ))
        }
    };
    if gpus == 0 || gpus > MAX_GPUS {
        return Err(Error::Invalid(format!(
            "--gpus {gpus}: must be between 1 and {MAX_GPUS}"
        )));
    }
    if !(mem.is_finite() && mem > 0.0 && mem <= 1e9) {
        return Err(Error::Invalid(format!(
            "--gpu-mem-gib {mem}: must be a positive number of GiB (at most 1e9)"
        )));
    }
    if a.batch_size == 0 {
        return Err(Error::Invalid("--batch-size must be at least 1".into()));
    }
    let max = crate::config::MAX_TOKENS;
    for (flag, v) in [
        ("--batch-size", Some(a.batch_size)),
        ("--seq-len", a.seq_len),
    ] {
        if let Some(v) = v.filter(|&v| v > max) {
            return Err(Error::Invalid(format!("{flag} {v}: must be at most {max}")));
        }
    }
    if a.gpus_per_node == 0 {
        return Err(Error::Invalid("--gpus-per-node must be at least 1".into()));
    }
    if a.device == DeviceArg::Cpu && (a.tp.is_some_and(|t| t > 1) || a.cp.is_some_and(|c| c > 1)) {
        return Err(Error::Invalid(
            "--device cpu: the CPU process model is calibrated for --sp/--dp/--zero only; plan \
             --tp and --cp for GPUs (their CPU runs are measured by scripts/cp_memory_table.py)"
                .into(),
        ));
    }
    let model = Config::load(path)?.model;
    let mem_bytes = mem * GIB;
    if a.sweep {
        let rows = sweep(&model, a, gpus, mem_bytes)?;
        return if a.json {
            to_json(&serde_json::json!({
                "model": model.name,
                "gpus": gpus,
                "gpu_mem_bytes": mem_bytes as u64,
                "rows": rows,
            }))
        } else {
            Ok(sweep_report(&model, a, mem, &rows))
        };
    }
    let candidates = layouts(&model, a, gpus)?;
    let searched = candidates.len() > 1;
    let best = best_of(&model, a, mem_bytes, candidates)
        .ok_or_else(|| Error::Invalid("no layout to evaluate".into()))?;
    let at_max = estimate(&model, &best.strategy, &best.hardware, best.max_seq_len);
    let at_len = a
        .seq_len
        .map(|n| estimate(&model, &best.strategy, &best.hardware, n));
    let notes = notes(&model, a, &best, &at_max);
    if a.json {
        return to_json(&serde_json::json!({
            "model": model.name,
            "gpus": gpus,
            "gpu_mem_bytes": mem_bytes as u64,
            "device": match a.device { DeviceArg::Gpu => "gpu", DeviceArg::Cpu => "cpu" },
            "layout": best.strategy.layout,
            "layout_searched": searched,
            "strategy": best.strategy,
            "max_seq_len": best.max_seq_len,
            "granule": granule(&best.strategy),
            "at_max_seq_len": at_max,
            "total_bytes_at_max": at_max.total().round() as u64,
            "at_seq_len": at_len,
            "rank_states_at_seq_len": a.seq_len.map(|n| {
                let [p, g, o] = super::terms::rank_states(&model, &best.strategy, &best.hardware, n);
                serde_json::json!({"parameters": p as u64, "gradients": g as u64, "optimizer_states": o as u64})
            }),
            "notes": notes,
        }));
    }
    Ok(single_report(
        &model, a, gpus, mem, &best, searched, &at_max, at_len, &notes,
    ))
}

fn to_json(v: &serde_json::Value) -> Result<String> {
    serde_json::to_string_pretty(v)
        .map(|s| s + "\n")
        .map_err(|e| Error::Invalid(format!("writing JSON: {e}")))
}

/// A layout with its strategy, hardware and longest sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub strategy: Strategy,
    #[serde(skip)]
    pub hardware: Hardware,
    pub max_seq_len: usize,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The strategy genslm would train with for these flags and this layout.
pub(super) fn strategy_for(model: &ModelConfig, a: &PlanArgs, layout: Layout) -> Strategy {
    let cpu = a.device == DeviceArg::Cpu;
    Strategy {
        layout,
        recipe: Recipe::Genslm,
        attention: match a.attention {
            Some(AttentionArg::Flash) => AttentionKind::Flash,
            Some(AttentionArg::Naive) => AttentionKind::Naive,
            None => model.attention,
        },
        positions: match a.positions {
            Some(PositionArg::Rotary) => Position::Rotary,
            Some(PositionArg::Learned) => Position::Learned,
            Some(PositionArg::Alibi) => Position::Alibi,
            None => model.position,
        },
        shard_positions: a.shard_positions,
        mask: Mask::None,
        checkpointing: if a.checkpoint_activations {
            Checkpointing::Full { partitioned: false }
        } else {
            Checkpointing::None
        },
        precision: match (a.precision, cpu) {
            (Some(PrecisionArg::Bf16), _) => Precision::Bf16,
            (Some(PrecisionArg::Fp32), _) | (None, true) => Precision::Fp32,
            (None, false) => Precision::Bf16,
        },
        batch_size: a.batch_size,
        tied_embeddings: false,
        vocab_size: model.vocab_size,
    }
}

fn hardware_for(a: &PlanArgs, layout: &Layout, mem_bytes: f64) -> Hardware {
    Hardware {
        mem_bytes,
        target: match a.device {
            DeviceArg::Gpu => Target::Gpu,
            DeviceArg::Cpu if layout.ranks() == 1 => Target::Cpu { run: CpuRun::Train },
            DeviceArg::Cpu => Target::Cpu {
                run: CpuRun::TrainMpi,
            },
        },
    }
}

/// Every layout of `gpus` ranks consistent with the flags (fixed where given, searched where
/// not: TP within a node, whole heads per rank, ZeRO 0–3).
fn layouts(model: &ModelConfig, a: &PlanArgs, gpus: usize) -> Result<Vec<Layout>> {
    let cpu = a.device == DeviceArg::Cpu;
    let tps: Vec<usize> = match a.tp {
        Some(t) => vec![t],
        None if cpu => vec![1],
        None => divisors(gpus)
            .into_iter()
            .filter(|t| *t <= a.gpus_per_node)
            .collect(),
    };
    let zeros: Vec<u8> = match a.zero {
        Some(z) => vec![z],
        None => vec![0, 1, 2, 3],
    };
    let mut out = Vec::new();
    for &tp in &tps {
        if tp == 0 || !gpus.is_multiple_of(tp) {
            continue;
        }
        let cps = match a.cp {
            Some(c) => vec![c],
            None if cpu => vec![1],
            None => divisors(gpus / tp),
        };
        for cp in cps {
            if cp == 0 || !(gpus / tp).is_multiple_of(cp) {
                continue;
            }
            let sps = match a.sp {
                Some(p) => vec![p],
                None => divisors(gpus / (tp * cp)),
            };
            for sp in sps {
                if sp == 0 || !(gpus / (tp * cp)).is_multiple_of(sp) {
                    continue;
                }
                let dp = gpus / (tp * cp * sp);
                if a.dp.is_some_and(|d| d != dp) || !model.num_heads.is_multiple_of(tp * sp) {
                    continue;
                }
                for &zero in &zeros {
                    out.push(Layout {
                        tp,
                        sp,
                        cp,
                        dp,
                        zero,
                        megatron_sp: false,
                        // genslm's trainer partitions ZeRO-1 over DP × CP and ZeRO-2/3 over
                        // all ranks; on GPUs plan every stage as DeepSpeed-Ulysses does.
                        zero_over_sp: !cpu || zero >= 2,
                    });
                }
            }
        }
    }
    if out.is_empty() {
        let fixed = [("tp", a.tp), ("sp", a.sp), ("cp", a.cp), ("dp", a.dp)]
            .iter()
            .filter_map(|(n, v)| v.map(|v| format!("--{n} {v}")))
            .collect::<Vec<_>>()
            .join(" ");
        return Err(Error::Invalid(format!(
            "no layout of {gpus} GPUs fits {}{}: tp × sp × cp × dp must equal --gpus, and tp × \
             sp must divide the {} heads",
            if fixed.is_empty() {
                "the model"
            } else {
                &fixed
            },
            if fixed.is_empty() {
                ""
            } else {
                " and the model"
            },
            model.num_heads
        )));
    }
    Ok(out)
}

/// The layout with the longest sequence; ties go to the lower ZeRO stage, then more DP, then
/// less TP.
fn best_of(
    model: &ModelConfig,
    a: &PlanArgs,
    mem_bytes: f64,
    layouts: Vec<Layout>,
) -> Option<Candidate> {
    evaluate(model, a, mem_bytes, layouts)
        .into_iter()
        .min_by_key(|c| {
            let l = &c.strategy.layout;
            (
                std::cmp::Reverse(c.max_seq_len),
                l.zero,
                std::cmp::Reverse(l.dp),
                l.tp,
            )
        })
}

fn evaluate(
    model: &ModelConfig,
    a: &PlanArgs,
    mem_bytes: f64,
    layouts: Vec<Layout>,
) -> Vec<Candidate> {
    layouts
        .into_iter()
        .filter_map(|layout| {
            let strategy = strategy_for(model, a, layout);
            check(model, &strategy).ok()?;
            let hardware = hardware_for(a, &layout, mem_bytes);
            let max_seq_len = max_seq_len(model, &strategy, &hardware);
            Some(Candidate {
                strategy,
                hardware,
                max_seq_len,
            })
        })
        .collect()
}

/// One row of a sweep: a GPU count, the best layout, and the best of each family.
#[derive(Debug, Clone, Serialize)]
pub struct SweepRow {
    pub gpus: usize,
    pub best: Candidate,
    /// Longest sequence with data parallelism only (ZeRO allowed).
    pub dp_only: usize,
    /// With tensor parallelism, no Ulysses, no CP.
    pub tp: usize,
    /// With Ulysses sequence parallelism, no TP, no CP.
    pub ulysses: usize,
    /// With TP and Ulysses, no CP.
    pub tp_ulysses: usize,
    /// With context parallelism (ring), alone or with TP and Ulysses.
    pub context: usize,
    pub layouts_evaluated: usize,
}

fn sweep(model: &ModelConfig, a: &PlanArgs, gpus: usize, mem_bytes: f64) -> Result<Vec<SweepRow>> {
    let mut counts: Vec<usize> = (0..usize::BITS)
        .map(|k| 1usize << k)
        .take_while(|&c| c <= gpus)
        .collect();
    if counts.last() != Some(&gpus) {
        counts.push(gpus);
    }
    let mut rows = Vec::new();
    for count in counts {
        let Ok(ls) = layouts(model, a, count) else {
            continue;
        };
        let all = evaluate(model, a, mem_bytes, ls);
        let best_in = |f: &dyn Fn(&Layout) -> bool| {
            all.iter()
                .filter(|c| f(&c.strategy.layout))
                .map(|c| c.max_seq_len)
                .max()
                .unwrap_or(0)
        };
        let row = SweepRow {
            gpus: count,
            dp_only: best_in(&|l| l.tp == 1 && l.sp == 1 && l.cp == 1),
            tp: best_in(&|l| l.tp > 1 && l.sp == 1 && l.cp == 1),
            ulysses: best_in(&|l| l.tp == 1 && l.sp > 1 && l.cp == 1),
            tp_ulysses: best_in(&|l| l.tp > 1 && l.sp > 1 && l.cp == 1),
            context: best_in(&|l| l.cp > 1),
            layouts_evaluated: all.len(),
            best: match best_of(
                model,
                a,
                mem_bytes,
                all.iter().map(|c| c.strategy.layout).collect(),
            ) {
                Some(b) => b,
                None => continue,
            },
        };
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(Error::Invalid(format!(
            "no layout of up to {gpus} GPUs fits the {} heads",
            model.num_heads
        )));
    }
    Ok(rows)
}

fn notes(model: &ModelConfig, a: &PlanArgs, best: &Candidate, at_max: &Estimate) -> Vec<String> {
    let st = &best.strategy;
    let l = &st.layout;
    let mut n = Vec::new();
    if best.max_seq_len == 0 {
        n.push(format!(
            "even {} tokens do not fit: {} is needed per rank before activations",
            granule(st),
            gib(at_max.memory.parameters
                + at_max.memory.gradients
                + at_max.memory.optimizer_states
                + at_max.memory.workspace)
        ));
    }
    if a.device == DeviceArg::Gpu {
        n.push(
            "what-if plan: genslm's GPU path has not been measured yet; the plan assumes its \
             layer recipe (burn autodiff) with bf16 activations"
                .into(),
        );
    }
    if l.zero >= 3 && !a.checkpoint_activations && l.ranks() > 1 {
        n.push(
            "ZeRO-3 without --checkpoint-activations: each layer's gathered weights stay in its \
             autodiff graph until its backward, so the full weights exist during the step"
                .into(),
        );
    }
    if st.positions == Position::Learned && l.sp > 1 && !st.shard_positions {
        n.push(
            "genslm's trainer shards a learned position table under SP: add --shard-positions \
             to plan for that"
                .into(),
        );
    }
    if matches!(best.hardware.target, Target::Cpu { .. })
        && at_max.phase == super::Phase::OptimizerStep
        && at_max.memory.gradients == 0.0
    {
        n.push(
            "optimizer-step peak: glibc keeps the activation memory the backward freed \
             resident (gradients were allocated inside it) and the gradient-reduction buffers \
             come on top"
                .into(),
        );
    }
    if st.positions == Position::Learned && best.max_seq_len > model.max_position_embeddings {
        n.push(format!(
            "a learned table of {} rows is planned; the config has {}",
            tokens(best.max_seq_len),
            tokens(model.max_position_embeddings)
        ));
    }
    n
}
