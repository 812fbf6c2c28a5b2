//! Memory checked before work: the planner's CPU model (within ±15% of genslm's measured
//! peaks, tests/plan_calibration.rs) predicts a training run's peak, and a run that cannot fit
//! in the memory this machine has available is refused before ingest or the first step,
//! instead of aborting with "memory allocation failed" after work has started.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::plan::cpu::CpuRun;
use crate::plan::{
    estimate, Checkpointing, Degrees, Hardware, Mask, Parallelism, Precision, Recipe, Strategy,
    Target, GIB,
};
use crate::train::metrics::proc_kib;

/// The strategy genslm trains `cfg` with on CPU under `dp × sp` (`batch_size` is the global
/// batch, split over DP).
pub fn trainer_strategy(cfg: &Config, dp: usize, sp: usize) -> Strategy {
    pipelined_strategy(cfg, dp, sp, 1)
}

/// [`trainer_strategy`] with `pp` pipeline stages (the planner estimates every stage; the
/// layers balanced as `Stages::balanced` cuts them).
pub fn pipelined_strategy(cfg: &Config, dp: usize, sp: usize, pp: usize) -> Strategy {
    let t = &cfg.train;
    Strategy {
        layout: Parallelism {
            degrees: Degrees {
                dp,
                cp: 1,
                sp,
                tp: 1,
                pp,
            },
            zero: t.zero,
            megatron_sp: false,
            zero_over_sp: Parallelism::trainer_zero_over_sp(t.zero),
            pipeline: crate::plan::PipePlan {
                schedule: t.pp_schedule,
                virtual_stages: t.pp_virtual,
                micro_batches: t.grad_accum,
            },
        },
        recipe: Recipe::Genslm,
        attention: cfg.model.attention,
        positions: cfg.model.position,
        shard_positions: true,
        mask: Mask::None,
        checkpointing: if t.checkpoint_activations {
            Checkpointing::Full { partitioned: false }
        } else {
            Checkpointing::None
        },
        precision: Precision::Fp32,
        batch_size: (t.batch_size / dp).max(1),
        tied_embeddings: false,
        vocab_size: cfg.model.vocab_size,
        stage: None,
    }
}

/// Predicted peak bytes of a process running `in_process` of the `dp × sp × pp` ranks at
/// `seq_len` (under PP, the largest stage's peak for each).
pub fn predicted_peak(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    in_process: usize,
    seq_len: usize,
) -> f64 {
    let st = pipelined_strategy(cfg, dp, sp, pp);
    let run = if dp * sp * pp == 1 {
        CpuRun::Train
    } else {
        CpuRun::TrainMpi
    };
    let hw = Hardware {
        mem_bytes: f64::INFINITY,
        target: Target::Cpu { run },
    };
    estimate(&cfg.model, &st, &hw, seq_len).total() * in_process as f64
}

/// Bytes this process can still use: `MemAvailable`, bounded by a cgroup v2 limit and by an
/// address-space limit (`ulimit -v`, which some batch systems set) when there is one. `None`
/// where none can be read (the check is then skipped).
pub fn available_bytes() -> Option<f64> {
    let mut avail = proc_kib("/proc/meminfo", "MemAvailable:")? as f64 * 1024.0;
    let address_space = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            let line = t
                .lines()
                .find_map(|l| l.strip_prefix("Max address space"))?;
            line.split_whitespace().next()?.parse::<f64>().ok()
        });
    if let (Some(limit), Some(used)) = (address_space, proc_kib("/proc/self/status", "VmSize:")) {
        avail = avail.min((limit - used as f64 * 1024.0).max(0.0));
    }
    let read = |f: &str| -> Option<f64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    if let (Some(max), Some(used)) = (read("memory.max"), read("memory.current")) {
        avail = avail.min((max - used).max(0.0));
    }
    Some(avail)
}

/// Refuses a run whose predicted peak exceeds `available` bytes, naming both and the longest
/// `--seq-len` that fits.
pub fn check_fits(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    in_process: usize,
    available: f64,
) -> Result<()> {
    let s = cfg.train.seq_len;
    let peak = |len: usize| predicted_peak(cfg, (dp, sp, pp), in_process, len);
    let need = peak(s);
    if need <= available {
        return Ok(());
    }
    // The longest multiple of `sp` that fits, by bisection (the peak grows with the length).
    let (mut lo, mut hi) = (0usize, s / sp);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if peak(mid * sp) <= available {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let fits = if lo >= 1 && peak(lo * sp) <= available {
        format!("the longest --seq-len that fits is about {}", lo * sp)
    } else {
        "no --seq-len fits with this model and layout".into()
    };
    Err(Error::Invalid(format!(
        "--seq-len {s}: the predicted peak memory is {:.1} GiB, but this machine has {:.1} GiB \
         available; {fits} (or use more ranks, --checkpoint-activations, or pass \
         --skip-memory-check if you know better)",
        need / GIB,
        available / GIB
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_with_both_figures_and_a_length_that_fits() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/genslm-25m.toml");
        let mut cfg = Config::load(&path).unwrap();
        cfg.train.seq_len = 1_000_000;
        cfg.train.batch_size = 1;
        let avail = 20.0 * GIB;
        let e = check_fits(&cfg, (1, 1, 1), 1, avail)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("GiB available") && e.contains("longest --seq-len that fits"),
            "{e}"
        );
        let fit: usize = e
            .split("fits is about ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap()
            .parse()
            .unwrap();
        assert!(predicted_peak(&cfg, (1, 1, 1), 1, fit) <= avail);
        assert!(predicted_peak(&cfg, (1, 1, 1), 1, fit + 1) > avail);
        cfg.train.seq_len = fit;
        assert!(check_fits(&cfg, (1, 1, 1), 1, avail).is_ok());
    }
}
