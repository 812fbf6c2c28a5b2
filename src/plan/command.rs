//! The `genslm plan` command: runs a request (one plan, a sweep, or the published comparison)
//! and writes the text or JSON report.

use super::report::{gib, single_report, sweep_report, tokens};
use super::request::{PlanDevice, PlanRequest};
use super::search::{best_of, evaluate, layouts, sweep, Candidate};
use super::{estimate, granule, published, Estimate, Target, GIB};
use crate::config::{Config, ModelConfig, Position};
use crate::error::{Error, Result};

/// The least memory `--gpu-mem-gib` and `--host-mem-gib` take: a MiB.
const MIN_MEM_GIB: f64 = 1.0 / 1024.0;
/// The largest cluster planned for (layouts are searched over the divisors of the count).
pub const MAX_GPUS: usize = 1 << 20;

/// Runs the command; returns what to print.
pub fn run(a: &PlanRequest) -> Result<String> {
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
    // At least a MiB: 1e-300 passed as "positive" and was planned as 0 bytes, printed as a
    // 300-digit decimal.
    if !(MIN_MEM_GIB..=1e9).contains(&mem) {
        return Err(Error::Invalid(format!(
            "--gpu-mem-gib {}: must be a number of GiB from 1/1024 (a MiB) to 1e9",
            crate::error::short_num(mem)
        )));
    }
    if a.batch_size == 0 {
        return Err(Error::Invalid("--batch-size must be at least 1".into()));
    }
    if let Some(n) = a.seq_len.filter(|&n| n < 2) {
        // As train refuses it: a sequence of one token predicts nothing.
        return Err(Error::Invalid(format!(
            "--seq-len {n}: a training sequence holds at least 2 tokens (each predicts the next)"
        )));
    }
    for (flag, v) in [
        ("--tp", a.tp),
        ("--sp", a.sp),
        ("--cp", a.cp),
        ("--dp", a.dp),
        ("--pp", a.pp),
        ("--grad-accum", a.grad_accum),
    ] {
        if v == Some(0) {
            return Err(Error::Invalid(format!("{flag} 0: must be at least 1")));
        }
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
    if a.offload.activations() && !a.checkpoint_activations {
        return Err(Error::Invalid(format!(
            "--offload {} moves the layer inputs activation checkpointing keeps: add \
             --checkpoint-activations",
            a.offload
        )));
    }
    // A flag whose only effect is on something the request turned off was ignored without a
    // word: the user believed it was checked.
    if a.host_mem_gib.is_some() && a.offload == crate::config::Offload::None {
        return Err(Error::Invalid(
            "--host-mem-gib limits what --offload puts in host memory, and nothing is offloaded: \
             give --offload optimizer|activations|all with it, or leave it out"
                .into(),
        ));
    }
    crate::parallel::pipeline::schedule::Schedule::check_flags(
        a.pp_schedule,
        a.pp.unwrap_or(2).max(1),
        a.pp_virtual,
    )?;
    if a.pp.is_some_and(|p| p < 2) && a.pp_virtual > 1 {
        return Err(Error::Invalid(format!(
            "--pp-virtual {} splits pipeline stages into chunks: give --pp P (2 or more) with it",
            a.pp_virtual
        )));
    }
    if a.gpus_per_node == 0 {
        return Err(Error::Invalid("--gpus-per-node must be at least 1".into()));
    }
    if let Some(h) = a.host_mem_gib.filter(|h| !(MIN_MEM_GIB..=1e9).contains(h)) {
        return Err(Error::Invalid(format!(
            "--host-mem-gib {}: give the host memory of a node in GiB (from 1/1024, a MiB, to \
             1e9)",
            crate::error::short_num(h)
        )));
    }
    if a.device == PlanDevice::Cpu && (a.tp.is_some_and(|t| t > 1) || a.cp.is_some_and(|c| c > 1)) {
        return Err(Error::Invalid(
            "--device cpu: the CPU process model is calibrated for --sp/--dp/--zero only; plan \
             --tp and --cp for GPUs (their CPU runs are measured by scripts/cp_memory_table.py)"
                .into(),
        ));
    }
    // A Hugging Face config.json or a model/run directory as `info` reads them (plan refused
    // them with a TOML parse error at `{`, while its own message offered config.json); a
    // preset's bare name stays the preset.
    let hf = (path.is_dir() && crate::config::preset(path).is_none())
        || path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let model = match hf {
        true => crate::info::load_model_config(path)?,
        false => Config::load_model(path, "plan")?,
    };
    let mem_bytes = mem * GIB;
    if a.sweep {
        let rows = sweep(&model, a, gpus, mem_bytes)?;
        return if a.json {
            to_json(&serde_json::json!({
                "model": model.name,
                "gpus": gpus,
                "gpu_mem_bytes": super::WholeBytes(mem_bytes),
                "rows": rows,
            }))
        } else {
            Ok(sweep_report(&model, a, mem, &rows))
        };
    }
    let candidates = layouts(&model, a, gpus)?;
    let searched = candidates.len() > 1;
    // Why the first layout cannot run, when none can (e.g. --pp with too few micro-batches).
    let first = candidates
        .first()
        .map(|&l| super::check(&model, &super::search::strategy_for(&model, a, l)));
    let mut evaluated = evaluate(&model, a, mem_bytes, candidates);
    // At a --seq-len some layouts cut a window into twice its tokens or more: the trainer
    // refuses those, so they are not chosen while another is left (the notes say so where
    // none is).
    if let Some(len) = a.seq_len {
        let runs = |c: &Candidate| c.strategy.layout.pieces() < len.saturating_mul(2);
        if evaluated.iter().any(runs) {
            evaluated.retain(runs);
        }
    }
    let best = best_of(evaluated).ok_or_else(|| match first {
        Some(Err(e)) => e,
        _ => Error::Invalid("no layout to evaluate".into()),
    })?;
    // Where nothing fits, the breakdown at the shortest length searched says why.
    let shown = best.max_seq_len.max(granule(&best.strategy));
    let at_max = estimate(&model, &best.strategy, &best.hardware, shown);
    let at_len = a
        .seq_len
        .map(|n| estimate(&model, &best.strategy, &best.hardware, n));
    let notes = notes(&model, a, &best, &at_max);
    if a.json {
        return to_json(&serde_json::json!({
            "model": model.name,
            "gpus": gpus,
            "gpu_mem_bytes": super::WholeBytes(mem_bytes),
            "device": match a.device { PlanDevice::Gpu => "gpu", PlanDevice::Cpu => "cpu" },
            "layout": best.strategy.layout,
            "layout_searched": searched,
            "strategy": best.strategy,
            "max_seq_len": best.max_seq_len,
            "pipeline_bubble": super::stages::bubble(&model, &best.strategy.layout),
            "stages_at_seq_len": a.seq_len.map(|n| stage_estimates(&model, &best, n)),
            "suggested_pp_layers": super::balance::suggest_layers(
                &model,
                &best.strategy,
                &best.hardware,
                a.seq_len.unwrap_or(best.max_seq_len).max(1),
            )
            .map(|(counts, _)| counts),
            "granule": granule(&best.strategy),
            "at_max_seq_len": at_max,
            "total_bytes_at_max": super::WholeBytes(at_max.total()),
            "at_seq_len": at_len,
            "rank_states_at_seq_len": a.seq_len.map(|n| {
                let [p, g, o] = super::state_terms::rank_states(&model, &best.strategy, &best.hardware, n);
                serde_json::json!({"parameters": super::WholeBytes(p), "gradients": super::WholeBytes(g), "optimizer_states": super::WholeBytes(o)})
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

fn notes(model: &ModelConfig, a: &PlanRequest, best: &Candidate, at_max: &Estimate) -> Vec<String> {
    let st = &best.strategy;
    let l = &st.layout;
    let mut n = Vec::new();
    let share = super::search::host_share(a, l);
    let host_bound =
        best.max_seq_len == 0 && super::search::host_bound(a, l, at_max, best.hardware.mem_bytes);
    if host_bound {
        n.push(format!(
            "even {} tokens do not fit in host memory: {} is offloaded per rank, and each \
             rank's share of --host-mem-gib is {}",
            granule(st),
            gib(at_max.host_bytes),
            gib(share)
        ));
    } else if best.max_seq_len == 0 {
        n.push(format!(
            "even {} tokens do not fit: {} is needed per rank before activations",
            granule(st),
            gib(at_max.memory.parameters
                + at_max.memory.gradients
                + at_max.memory.optimizer_states
                + at_max.memory.workspace)
        ));
    }
    let pieces = l.pieces();
    if let Some(len) = a.seq_len.filter(|&len| pieces >= len.saturating_mul(2)) {
        n.push(format!(
            "genslm train refuses this layout at --seq-len {len}: it cuts every window into \
             {pieces} pieces, at least twice its tokens (most of every step would be padding)"
        ));
    }
    if a.device == PlanDevice::Gpu {
        n.push(
            "what-if plan: genslm's GPU path has been measured on one H200 only (README's GPU \
             section: this planner gave 1.0–4.1× its peaks, never less); the plan assumes its \
             layer recipe (burn autodiff) with bf16 activations"
                .into(),
        );
    }
    if share.is_finite() && at_max.host_bytes > 0.0 && !host_bound {
        n.push(format!(
            "host memory: each rank's share of --host-mem-gib is {}; {} of it is offloaded at \
             the longest sequence",
            gib(share),
            gib(at_max.host_bytes)
        ));
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

/// Under PP, every stage's estimate at `seq_len` (empty without stages).
fn stage_estimates(model: &ModelConfig, best: &Candidate, seq_len: usize) -> Vec<Estimate> {
    let st = &best.strategy;
    if st.layout.pp <= 1 {
        return Vec::new();
    }
    super::stages::stage_views(model, &st.layout, st.pp_layers.as_deref())
        .unwrap_or_default()
        .into_iter()
        .map(|v| super::estimate_on(model, st, &best.hardware, seq_len, v))
        .collect()
}
