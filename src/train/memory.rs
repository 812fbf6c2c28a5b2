//! Memory checked before work: the planner's CPU model (within ±15% of genslm's measured
//! peaks, tests/plan_calibration.rs) predicts a training run's peak, and a run that cannot fit
//! in the memory this machine has available is refused before ingest or the first step,
//! instead of aborting with "memory allocation failed" after work has started.

use crate::config::{Config, ScheduleKind};
use crate::error::{Error, Result};
use crate::host_memory::available_bytes;
use crate::plan::cpu::CpuRun;
use crate::plan::{
    estimate, Checkpointing, Degrees, Hardware, Mask, Parallelism, Precision, Recipe, Strategy,
    Target, GIB,
};

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
        offload: t.offload,
        vocab_size: cfg.model.vocab_size,
        stage: None,
        pp_layers: if pp > 1 { t.pp_layers.clone() } else { None },
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

/// Refuses to build `bytes` of host data (`what` says which, naming the flags that size it)
/// that the memory available here cannot hold: an allocation that fails aborts the process,
/// and one the kernel grants lazily ends in the OOM killer. No bound where none can be read.
pub fn check_held(bytes: f64, what: &str) -> Result<()> {
    match available_bytes() {
        Some(avail) if bytes > avail => Err(Error::Invalid(format!(
            "{what} need about {:.1} GiB, more than the {:.1} GiB available here",
            bytes / GIB,
            avail / GIB
        ))),
        _ => Ok(()),
    }
}

/// Host bytes of one step's micro-batches, which the trainer reads before the step runs: per
/// micro-batch, each sequence's tokens (u32) and mask (u8), the two vectors' headers and the
/// allocator's share (measured: 10⁷ micro-batches of 2 × 64 codons took ~7 GB).
pub fn step_batch_bytes(cfg: &Config) -> f64 {
    let t = &cfg.train;
    t.grad_accum as f64 * (t.batch_size as f64 * (t.seq_len as f64 + 1.0) * 5.0 + 96.0)
}

/// The bytes of the micro-batches `in_process` ranks read per step, or a refusal where they
/// alone would take more than half of `available` bytes (`--grad-accum 10000000` grew to 7 GB
/// reading them, before any step and unchecked).
pub fn check_step_batches(cfg: &Config, in_process: usize, available: f64) -> Result<f64> {
    let need = step_batch_bytes(cfg) * in_process.max(1) as f64;
    if need <= available / 2.0 {
        return Ok(need);
    }
    let t = &cfg.train;
    Err(Error::Invalid(format!(
        "--grad-accum {} × --batch-size {}: a step reads its {} micro-batches before it runs, \
         {:.1} GiB of tokens, more than half of the {:.1} GiB available; use fewer \
         micro-batches per step",
        t.grad_accum,
        t.batch_size,
        t.grad_accum,
        need / GIB,
        available / GIB
    )))
}

/// Refuses a run whose predicted peak exceeds `available` bytes, naming both and the longest
/// `--seq-len` that fits.
pub fn check_fits(
    cfg: &Config,
    degrees: (usize, usize, usize),
    in_process: usize,
    available: f64,
) -> Result<()> {
    let skip = ", or pass --skip-memory-check if you know better";
    check_fits_or(cfg, degrees, in_process, available, skip)
}

/// [`check_fits`] whose advice ends with `more` (train's `--skip-memory-check`; benchmarks,
/// which have no such flag, give none).
pub fn check_fits_or(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    in_process: usize,
    available: f64,
    more: &str,
) -> Result<()> {
    let peak = |len: usize| predicted_peak(cfg, (dp, sp, pp), in_process, len);
    let (need, fits) = match over_budget(cfg.train.seq_len, sp, peak, available) {
        None => return Ok(()),
        Some((need, fits)) => (need, with_table_note(cfg, fits)),
    };
    // GPipe holds every micro-batch's activations until the backward: there the count, not the
    // length, is what to change (`--grad-accum 200000` was blamed on `--seq-len 64`).
    let t = &cfg.train;
    let fits = if pp > 1 && t.pp_schedule == ScheduleKind::GPipe && t.grad_accum > pp {
        format!(
            "{fits}; --pp-schedule gpipe keeps all --grad-accum {} micro-batches' activations \
             in flight, where 1f1b and zb keep at most {pp}",
            t.grad_accum
        )
    } else {
        fits
    };
    Err(Error::Invalid(format!(
        "--seq-len {}: the predicted peak memory is {:.1} GiB, but this machine has {:.1} GiB \
         available; {fits} (or use more ranks, --checkpoint-activations{more})",
        cfg.train.seq_len,
        need / GIB,
        available / GIB
    )))
}

/// Predicted peak device bytes of one rank of `dp × sp × pp` on a GPU of `capacity` bytes
/// (the planner's GPU terms: runtime reserve, weights, gradients, moments and activations at
/// `precision`), and the bytes `--offload` keeps in host memory instead.
pub fn predicted_device_peak(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    seq_len: usize,
    capacity: f64,
    precision: Precision,
) -> (f64, f64) {
    let st = Strategy {
        precision,
        ..pipelined_strategy(cfg, dp, sp, pp)
    };
    let hw = Hardware {
        mem_bytes: capacity,
        target: Target::Gpu,
    };
    // The planner's genslm recipe holds what the trainer holds in either precision (bf16:
    // `train::master`'s layout).
    let e = estimate(&cfg.model, &st, &hw, seq_len);
    (e.total(), e.host_bytes)
}

/// Refuses, before any work, a GPU run whose predicted device peak (times the `sharing` ranks
/// of this process on the same device) exceeds the device's `capacity`, naming both figures
/// and the longest `--seq-len` that fits.
pub fn check_fits_device(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    sharing: usize,
    capacity: f64,
    precision: Precision,
    (device, host_backed): (&str, bool),
) -> Result<()> {
    // A device whose buffers are host memory gains nothing from offloading to the host.
    let peak = |len: usize| {
        let (device, host) = predicted_device_peak(cfg, (dp, sp, pp), len, capacity, precision);
        sharing as f64 * (device + if host_backed { host } else { 0.0 })
    };
    let (need, fits) = match over_budget(cfg.train.seq_len, sp, peak, capacity) {
        None => return Ok(()),
        Some((need, fits)) => (need, with_table_note(cfg, fits)),
    };
    let shared = if sharing > 1 {
        format!(" for the {sharing} ranks sharing it")
    } else {
        String::new()
    };
    let offers = if host_backed {
        "keeps its buffers in host memory, which has available"
    } else {
        "offers"
    };
    Err(Error::Invalid(format!(
        "--seq-len {}: the predicted peak device memory{shared} is {:.1} GiB ({precision}), but \
         the device ({device}) {offers} {:.1} GiB; {fits} (or use more ranks, \
         --checkpoint-activations, or pass --skip-memory-check if you know better)",
        cfg.train.seq_len,
        need / GIB,
        capacity / GIB
    )))
}

/// Refuses, before any work, a run on a device with memory of its own whose offloaded state
/// (`--offload`: moments and master pieces, checkpointed layer inputs) for the `in_process`
/// ranks of this process exceeds the host memory available, naming both figures.
pub fn check_fits_host(
    cfg: &Config,
    (dp, sp, pp): (usize, usize, usize),
    in_process: usize,
    capacity: f64,
    precision: Precision,
    available: f64,
) -> Result<()> {
    if cfg.train.offload == crate::config::Offload::None {
        return Ok(());
    }
    let (_, host) =
        predicted_device_peak(cfg, (dp, sp, pp), cfg.train.seq_len, capacity, precision);
    let need = host * in_process.max(1) as f64;
    if need <= available {
        return Ok(());
    }
    let ranks = if in_process > 1 {
        format!(" for the {in_process} ranks of this process")
    } else {
        String::new()
    };
    Err(Error::Invalid(format!(
        "--offload {}: the predicted host memory the offload keeps{ranks} is {:.1} GiB, but the \
         host has {:.1} GiB available; offload less (--offload optimizer keeps the layer inputs \
         on the device), use a shorter --seq-len or fewer ranks per process, or pass \
         --skip-memory-check if you know better",
        cfg.train.offload,
        need / GIB,
        available / GIB
    )))
}

/// The largest single activation a rank allocates, in bytes, and what it is: the MLP's
/// `[b, s, 4h]`, the fused QKV projection's `[b, s, 3h]` (at the compute precision) or the
/// logits `[b, s, vocab]` (fp32 for the loss), for the rank's local batch and sequence shard.
pub fn largest_activation(
    cfg: &Config,
    (dp, sp): (usize, usize),
    precision: Precision,
) -> (f64, &'static str) {
    let m = &cfg.model;
    let rows = (cfg.train.batch_size / dp).max(1) as f64 * cfg.train.seq_len.div_ceil(sp) as f64;
    let e = precision.activation_bytes();
    [
        (m.intermediate_size as f64 * e, "the MLP's [b, s, 4h]"),
        (
            3.0 * m.hidden_size as f64 * e,
            "the QKV projection's [b, s, 3h]",
        ),
        (m.vocab_size as f64 * 4.0, "the logits [b, s, vocab]"),
    ]
    .into_iter()
    .map(|(width, what)| (rows * width, what))
    .fold((0.0, ""), |a, b| if b.0 > a.0 { b } else { a })
}

/// Refuses a GPU run one of whose activations is larger than the largest buffer the device
/// allocates (WebGPU binds at most `max_allocation` bytes; lavapipe 128 MiB), which would
/// otherwise fail at the first step after the run directory has been written.
pub fn check_largest_buffer(
    cfg: &Config,
    (dp, sp): (usize, usize),
    precision: Precision,
    mem: &crate::backend::DeviceMemory,
) -> Result<()> {
    let (bytes, what) = largest_activation(cfg, (dp, sp), precision);
    let limit = mem.max_allocation as f64;
    if bytes <= limit {
        return Ok(());
    }
    let per_token = bytes / cfg.train.seq_len.div_ceil(sp) as f64;
    let fits = (limit / per_token).floor() as usize * sp;
    Err(Error::Invalid(format!(
        "--seq-len {}: one activation, {what}, takes {:.0} MiB on each rank, more than the \
         largest buffer the device ({}) allocates, {:.0} MiB; the longest --seq-len whose \
         buffers fit is about {fits} (or split the sequence with --sp, or use fewer sequences \
         per rank; pass --skip-memory-check if you know better)",
        cfg.train.seq_len,
        bytes / (1u64 << 20) as f64,
        mem.name,
        limit / (1u64 << 20) as f64,
    )))
}

/// `fits` with, for a learned-position model whose table is longer than the sequence, what no
/// length changes: the table keeps the config's rows (2²⁴ of them were refused with "no
/// --seq-len fits" alone).
fn with_table_note(cfg: &Config, fits: String) -> String {
    let m = &cfg.model;
    if m.position == crate::config::Position::Learned
        && m.max_position_embeddings > cfg.train.seq_len
    {
        format!(
            "{fits}; the learned position table keeps its max_position_embeddings = {} rows at \
             any --seq-len (a smaller table in the config shrinks it)",
            m.max_position_embeddings
        )
    } else {
        fits
    }
}

/// `None` when `peak(s)` fits `budget`; else the peak and what to say about the longest
/// multiple of `sp` that fits (found by bisection: the peak grows with the length).
fn over_budget(
    s: usize,
    sp: usize,
    peak: impl Fn(usize) -> f64,
    budget: f64,
) -> Option<(f64, String)> {
    let need = peak(s);
    if need <= budget {
        return None;
    }
    let (mut lo, mut hi) = (0usize, s / sp);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if peak(mid * sp) <= budget {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let fits = if lo >= 1 && peak(lo * sp) <= budget {
        format!("the longest --seq-len that fits is about {}", lo * sp)
    } else {
        "no --seq-len fits with this model and layout".into()
    };
    Some((need, fits))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn genslm_25m() -> Config {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/genslm-25m.toml");
        Config::load(&path).unwrap()
    }

    /// The `--seq-len` a refusal offers ("… fits is about N …").
    fn offered_length(e: &str) -> usize {
        e.split("fits is about ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap()
            .parse()
            .unwrap()
    }

    /// A learned table longer than the sequence counts whole, and the refusal says no length
    /// changes it (2²⁴ rows passed the check and aborted on the allocation).
    #[test]
    fn a_long_learned_table_is_counted_and_named() {
        let mut cfg = genslm_25m();
        cfg.model.position = crate::config::Position::Learned;
        cfg.train.seq_len = 64;
        cfg.train.batch_size = 1;
        check_fits(&cfg, (1, 1, 1), 1, 2.0 * GIB).unwrap();
        // 2²⁴ rows of 512: 2³³ parameters, 16 bytes each for weights, gradients and moments.
        cfg.model.max_position_embeddings = 1 << 24;
        let e = check_fits(&cfg, (1, 1, 1), 1, 100.0 * GIB)
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_position_embeddings = 16777216 rows"), "{e}");
    }

    #[test]
    fn refuses_with_both_figures_and_a_length_that_fits() {
        let mut cfg = genslm_25m();
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
        let fit = offered_length(&e);
        assert!(predicted_peak(&cfg, (1, 1, 1), 1, fit) <= avail);
        assert!(predicted_peak(&cfg, (1, 1, 1), 1, fit + 1) > avail);
        cfg.train.seq_len = fit;
        assert!(check_fits(&cfg, (1, 1, 1), 1, avail).is_ok());
    }

    /// A step's micro-batches are counted before they are read: 10⁷ micro-batches of 2 × 64
    /// codons (~7 GB measured as they were read) are refused on a machine with 8 GiB free.
    #[test]
    fn a_step_of_too_many_micro_batches_is_refused() {
        let mut cfg = genslm_25m();
        (cfg.train.batch_size, cfg.train.seq_len) = (2, 64);
        cfg.train.grad_accum = 10_000_000;
        let bytes = step_batch_bytes(&cfg);
        assert!((7.0e9..8.0e9).contains(&bytes), "{bytes}");
        let e = check_step_batches(&cfg, 1, 8.0 * GIB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--grad-accum 10000000") && e.contains("GiB available"),
            "{e}"
        );
        cfg.train.grad_accum = 8;
        assert!(check_step_batches(&cfg, 1, 8.0 * GIB).is_ok());
    }

    /// Under the bf16 layout the trainer keeps the fp32 masters beside the moments: offloading
    /// the optimizer takes exactly those 12 bytes per parameter off the device's prediction and
    /// puts them in host memory (fp32: the two moments, 8 bytes).
    #[test]
    fn bf16_offload_takes_the_trainers_masters_and_moments_off_the_device() {
        let mut cfg = genslm_25m();
        cfg.train.batch_size = 1;
        cfg.train.checkpoint_activations = true;
        let n = crate::plan::model_params(&cfg.model, cfg.model.vocab_size, false);
        for (precision, bytes) in [(Precision::Bf16, 12.0), (Precision::Fp32, 8.0)] {
            let peak =
                |cfg: &Config| predicted_device_peak(cfg, (1, 1, 1), 8192, 40.0 * GIB, precision);
            cfg.train.offload = crate::config::Offload::None;
            let (none, _) = peak(&cfg);
            cfg.train.offload = crate::config::Offload::Optimizer;
            let (off, host) = peak(&cfg);
            let moved = none - off;
            let want = bytes * n;
            assert!(
                (moved - want).abs() <= 1e-6 * moved,
                "{precision}: {moved} vs {want}"
            );
            assert!(
                (host - want).abs() <= 1e-6 * host,
                "{precision}: {host} vs {want}"
            );
        }
    }

    /// The device check: the planner's GPU peak against the capacity, both figures named, and
    /// a length that fits; a device shared by two ranks needs twice the memory.
    /// The pre-flight predicts the stages `--pp-layers` cuts, not balanced ones: genslm-25m's
    /// 8 layers as 1 + 7 peak where the 7-layer stage does, above the balanced 4 + 4, and
    /// 7 + 1 (the first stage keeps 2 micro-batches under 1F1B) above both.
    #[test]
    fn the_pipeline_prediction_follows_the_layer_cut() {
        let mut cfg = genslm_25m();
        cfg.train.batch_size = 1;
        cfg.train.grad_accum = 4;
        let peak = |cfg: &Config| predicted_peak(cfg, (1, 1, 2), 1, 4096);
        let balanced = peak(&cfg);
        cfg.train.pp_layers = Some(vec![1, 7]);
        let last_heavy = peak(&cfg);
        cfg.train.pp_layers = Some(vec![7, 1]);
        let first_heavy = peak(&cfg);
        assert!(
            balanced < last_heavy && last_heavy < first_heavy,
            "{balanced} {last_heavy} {first_heavy}"
        );
    }

    /// A card's run that offloads more than the host has is refused with both figures: the
    /// optimizer offload of genslm-25m in bf16 keeps the fp32 masters and the two moments, 12
    /// bytes per parameter, on the host (per rank of the process); without offload nothing is
    /// checked.
    #[test]
    fn offload_beyond_the_host_memory_is_refused() {
        let mut cfg = genslm_25m();
        cfg.train.batch_size = 1;
        cfg.train.seq_len = 2048;
        let n = crate::plan::model_params(&cfg.model, cfg.model.vocab_size, false);
        let check = |cfg: &Config, ranks: usize, avail: f64| {
            check_fits_host(cfg, (1, 1, 1), ranks, 40.0 * GIB, Precision::Bf16, avail)
        };
        assert!(check(&cfg, 1, 0.0).is_ok(), "no offload, no host check");
        cfg.train.offload = crate::config::Offload::Optimizer;
        assert!(check(&cfg, 1, 12.0 * n + 1.0).is_ok());
        assert!(
            check(&cfg, 2, 12.0 * n + 1.0).is_err(),
            "two ranks offload twice"
        );
        let e = check(&cfg, 1, 11.0 * n).unwrap_err().to_string();
        let gib = |b: f64| format!("{:.1} GiB", b / GIB);
        assert!(
            e.contains("--offload optimizer")
                && e.contains(&gib(12.0 * n))
                && e.contains(&gib(11.0 * n)),
            "{e}"
        );
    }

    #[test]
    fn a_gpu_run_is_refused_with_the_device_figures() {
        let mut cfg = genslm_25m();
        cfg.train.seq_len = 1_000_000;
        cfg.train.batch_size = 1;
        let cap = 40.0 * GIB;
        let p = Precision::Bf16;
        let e = check_fits_device(&cfg, (1, 1, 1), 1, cap, p, ("A100-SXM4-40GB", false))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("(A100-SXM4-40GB) offers 40.0 GiB") && e.contains("(bf16)"),
            "{e}"
        );
        let fit = offered_length(&e);
        let peak = |s| predicted_device_peak(&cfg, (1, 1, 1), s, cap, p).0;
        assert!(peak(fit) <= cap && peak(fit + 1) > cap);
        cfg.train.seq_len = fit;
        assert!(check_fits_device(&cfg, (1, 1, 1), 1, cap, p, ("x", false)).is_ok());
        let shared = check_fits_device(&cfg, (1, 1, 1), 2, cap, p, ("x", true));
        let e = shared.unwrap_err().to_string();
        assert!(
            e.contains("for the 2 ranks sharing it") && e.contains("host memory"),
            "{e}"
        );
    }

    /// One activation larger than the device's largest buffer is refused, naming it; the
    /// length offered is the longest whose `[b, s, 4h]` fits (genslm-25m: 4h = 2048 fp32
    /// values, 8 KiB a token, so 16,384 tokens in 128 MiB; with --sp 2, twice that).
    #[test]
    fn an_activation_larger_than_the_largest_buffer_is_refused() {
        let mut cfg = genslm_25m();
        cfg.train.batch_size = 1;
        let mem = crate::backend::DeviceMemory {
            capacity: None,
            max_allocation: 128 << 20,
            host_backed: true,
            name: "llvmpipe".into(),
        };
        for (sp, fit) in [(1, 16_384), (2, 32_768)] {
            cfg.train.seq_len = fit + sp;
            let e = check_largest_buffer(&cfg, (1, sp), Precision::Fp32, &mem)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("the MLP's [b, s, 4h]") && e.contains("(llvmpipe)"),
                "{e}"
            );
            assert!(e.contains(&format!("fit is about {fit} ")), "{e}");
            cfg.train.seq_len = fit;
            assert!(check_largest_buffer(&cfg, (1, sp), Precision::Fp32, &mem).is_ok());
        }
    }
}
