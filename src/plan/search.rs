//! The layout search of `genslm plan`: every layout of the cluster consistent with the request,
//! each evaluated (strategy, hardware, longest sequence), the best, and the sweep over GPU
//! counts.

use serde::Serialize;

use super::cpu::CpuRun;
use super::request::{PlanDevice, PlanRequest};
use super::{
    check, max_seq_len_with_host, Checkpointing, Degrees, Estimate, Hardware, Mask, Parallelism,
    PipePlan, Precision, Recipe, Strategy, Target,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};

/// A layout with its strategy, hardware and longest sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub strategy: Strategy,
    #[serde(skip)]
    pub hardware: Hardware,
    pub max_seq_len: usize,
    /// Where nothing fits (`max_seq_len` 0): how many times over its shortest sequence
    /// outgrows the device or the host share (× 1e9), so the layout closest to fitting is the
    /// one shown (0 where something fits).
    #[serde(skip)]
    pub short_need: u64,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The strategy genslm would train with for these flags and this layout.
pub fn strategy_for(model: &ModelConfig, a: &PlanRequest, layout: Parallelism) -> Strategy {
    let cpu = a.device == PlanDevice::Cpu;
    Strategy {
        layout,
        recipe: Recipe::Genslm,
        attention: a.attention.unwrap_or(model.attention),
        positions: a.positions.unwrap_or(model.position),
        shard_positions: a.shard_positions,
        mask: Mask::None,
        checkpointing: if a.checkpoint_activations {
            Checkpointing::Full { partitioned: false }
        } else {
            Checkpointing::None
        },
        precision: match (a.precision, cpu) {
            (Some(p), _) => p,
            (None, true) => Precision::Fp32,
            (None, false) => Precision::Bf16,
        },
        batch_size: a.batch_size,
        tied_embeddings: false,
        offload: a.offload,
        vocab_size: model.vocab_size,
        stage: None,
        // The cut applies to the layout with the stages it was given for.
        pp_layers: a.pp_layers.clone().filter(|_| a.pp == Some(layout.pp)),
    }
}

/// A rank's share of its node's host memory (`--host-mem-gib` over the ranks of a node), or
/// unlimited when not given.
pub fn host_share(a: &PlanRequest, layout: &Parallelism) -> f64 {
    match a.host_mem_gib {
        Some(h) => h * crate::plan::GIB / a.gpus_per_node.min(layout.ranks()).max(1) as f64,
        None => f64::INFINITY,
    }
}

/// Whether what stops `est` is the host, not the device: it fits the device's `mem_bytes`, and
/// what it offloads does not fit the rank's share of `--host-mem-gib`.
pub fn host_bound(a: &PlanRequest, layout: &Parallelism, est: &Estimate, mem_bytes: f64) -> bool {
    est.total() <= mem_bytes && est.host_bytes > host_share(a, layout)
}

pub fn hardware_for(a: &PlanRequest, layout: &Parallelism, mem_bytes: f64) -> Hardware {
    Hardware {
        mem_bytes,
        target: match a.device {
            PlanDevice::Gpu => Target::Gpu,
            PlanDevice::Cpu if layout.ranks() == 1 => Target::Cpu { run: CpuRun::Train },
            PlanDevice::Cpu => Target::Cpu {
                run: CpuRun::TrainMpi,
            },
        },
    }
}

/// The pipeline a request plans for `pp` stages: its schedule and virtual stages, and
/// `--grad-accum` micro-batches (default 4·P, which keeps 1F1B's bubble at (P − 1)/(4P) < 25%).
pub fn pipe_plan(a: &PlanRequest, pp: usize) -> PipePlan {
    PipePlan {
        schedule: a.pp_schedule,
        virtual_stages: a.pp_virtual,
        micro_batches: a.grad_accum.unwrap_or(4 * pp),
    }
}

/// Every layout of `gpus` ranks consistent with the flags (fixed where given, searched where
/// not: TP within a node, whole heads per rank, ZeRO 0–3).
pub fn layouts(model: &ModelConfig, a: &PlanRequest, gpus: usize) -> Result<Vec<Parallelism>> {
    let cpu = a.device == PlanDevice::Cpu;
    if a.pp_layers.is_some() && a.pp.unwrap_or(1) < 2 {
        return Err(Error::Invalid(
            "--pp-layers cuts the layers into pipeline stages: give --pp P (2 or more) too".into(),
        ));
    }
    if let (Some(pp @ 2..), Some(zero @ 2..)) = (a.pp, a.zero) {
        return Err(Error::Invalid(format!(
            "--pp {pp} with --zero {zero}: genslm's trainer runs pipeline stages with ZeRO 0 or 1"
        )));
    }
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
                if !model.num_heads.is_multiple_of(tp * sp) {
                    continue;
                }
                let rest = gpus / (tp * cp * sp);
                // Pipeline stages: searched over the divisors left, at most one layer each.
                // Chunks of stages (--pp-virtual) need stages: the search had them on pp 1.
                let pps = match a.pp {
                    Some(p) => vec![p],
                    None => divisors(rest)
                        .into_iter()
                        .filter(|&p| p <= model.num_layers && (a.pp_virtual == 1 || p >= 2))
                        .collect(),
                };
                for pp in pps {
                    if pp == 0 || !rest.is_multiple_of(pp) {
                        continue;
                    }
                    let dp = rest / pp;
                    if a.dp.is_some_and(|d| d != dp) {
                        continue;
                    }
                    // The trainer runs pipeline stages with ZeRO 0 or 1 only.
                    for &zero in zeros.iter().filter(|&&z| pp == 1 || z <= 1) {
                        out.push(Parallelism {
                            degrees: Degrees { dp, cp, sp, tp, pp },
                            zero,
                            megatron_sp: a.megatron_sp && tp > 1,
                            // genslm's trainer partitions ZeRO-1 over DP × CP and ZeRO-2/3 over
                            // all ranks; on GPUs plan every stage as DeepSpeed-Ulysses does.
                            zero_over_sp: !cpu || Parallelism::trainer_zero_over_sp(zero),
                            pipeline: pipe_plan(a, pp),
                        });
                    }
                }
            }
        }
    }
    if out.is_empty() {
        let fixed = [
            ("tp", a.tp),
            ("sp", a.sp),
            ("cp", a.cp),
            ("pp", a.pp),
            ("dp", a.dp),
        ]
        .iter()
        .filter_map(|(n, v)| v.map(|v| format!("--{n} {v}")))
        .collect::<Vec<_>>()
        .join(" ");
        return Err(Error::Invalid(format!(
            "no layout of {gpus} GPUs fits {}{}: tp × sp × cp × pp × dp must equal --gpus, and \
             tp × sp must divide the {} heads (genslm train also runs an sp that does not, \
             padding empty heads in, which the planner does not model)",
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

/// The layout with the longest sequence (where none fits, the one needing the least memory per
/// rank at its shortest: ZeRO-0 was shown, at 4.4× ZeRO-3's need); ties go to fewer pipeline
/// stages (no bubble), then the lower ZeRO stage, then more DP, then less TP.
pub fn best_of(candidates: Vec<Candidate>) -> Option<Candidate> {
    candidates.into_iter().min_by_key(|c| {
        let l = &c.strategy.layout;
        (
            std::cmp::Reverse(c.max_seq_len),
            c.short_need,
            l.pp,
            l.zero,
            std::cmp::Reverse(l.dp),
            l.tp,
        )
    })
}

pub fn evaluate(
    model: &ModelConfig,
    a: &PlanRequest,
    mem_bytes: f64,
    layouts: Vec<Parallelism>,
) -> Vec<Candidate> {
    use rayon::prelude::*;
    // Each layout's search is independent; a sweep to 2^20 GPUs evaluates thousands.
    layouts
        .into_par_iter()
        .filter_map(|layout| {
            let strategy = strategy_for(model, a, layout);
            check(model, &strategy).ok()?;
            let hardware = hardware_for(a, &layout, mem_bytes);
            let max_seq_len =
                max_seq_len_with_host(model, &strategy, &hardware, host_share(a, &layout));
            // How far the shortest sequence is from fitting: the larger of its device need
            // over the device's memory and its offloaded bytes over the rank's host share.
            let short_need = if max_seq_len == 0 {
                let e = super::estimate(model, &strategy, &hardware, super::granule(&strategy));
                let share = host_share(a, &layout);
                let host = if share.is_finite() {
                    e.host_bytes / share
                } else {
                    0.0
                };
                let ratio = (e.total() / hardware.mem_bytes).max(host);
                (ratio * 1e9).min(u64::MAX as f64) as u64
            } else {
                0
            };
            Some(Candidate {
                strategy,
                hardware,
                max_seq_len,
                short_need,
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
    /// With pipeline stages (any other degrees), and without them.
    pub pipeline: usize,
    pub no_pipeline: usize,
    pub layouts_evaluated: usize,
}

pub fn sweep(
    model: &ModelConfig,
    a: &PlanRequest,
    gpus: usize,
    mem_bytes: f64,
) -> Result<Vec<SweepRow>> {
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
        let best_in = |f: &dyn Fn(&Parallelism) -> bool| {
            all.iter()
                .filter(|c| f(&c.strategy.layout))
                .map(|c| c.max_seq_len)
                .max()
                .unwrap_or(0)
        };
        let row = SweepRow {
            gpus: count,
            dp_only: best_in(&|l| l.tp == 1 && l.sp == 1 && l.cp == 1 && l.pp == 1),
            tp: best_in(&|l| l.tp > 1 && l.sp == 1 && l.cp == 1 && l.pp == 1),
            ulysses: best_in(&|l| l.tp == 1 && l.sp > 1 && l.cp == 1 && l.pp == 1),
            tp_ulysses: best_in(&|l| l.tp > 1 && l.sp > 1 && l.cp == 1 && l.pp == 1),
            context: best_in(&|l| l.cp > 1 && l.pp == 1),
            pipeline: best_in(&|l| l.pp > 1),
            no_pipeline: best_in(&|l| l.pp == 1),
            layouts_evaluated: all.len(),
            best: match best_of(all) {
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
