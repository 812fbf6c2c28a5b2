//! Text reports of `genslm plan`: one plan, a sweep.

use std::fmt::Write;

use super::request::{PlanDevice, PlanRequest};
use super::search::{strategy_for, Candidate, SweepRow};
use super::{
    granule, Checkpointing, Degrees, Estimate, Offload, Parallelism, Precision, Strategy, GIB,
};
use crate::config::{AttentionKind, ModelConfig, Position};

pub(super) fn layout_text(l: &Parallelism) -> String {
    let mut parts = Vec::new();
    if l.tp > 1 {
        parts.push(format!(
            "tp {}{}",
            l.tp,
            if l.megatron_sp { " (+Megatron SP)" } else { "" }
        ));
    }
    if l.sp > 1 {
        parts.push(format!("sp {} (Ulysses)", l.sp));
    }
    if l.cp > 1 {
        parts.push(format!("cp {} (ring)", l.cp));
    }
    if l.pp > 1 {
        let p = &l.pipeline;
        parts.push(format!(
            "pp {} ({}{}, {} micro-batches)",
            l.pp,
            p.schedule,
            if p.virtual_stages > 1 {
                format!(" V {}", p.virtual_stages)
            } else {
                String::new()
            },
            p.micro_batches
        ));
    }
    parts.push(format!("dp {}", l.dp));
    format!("{}, ZeRO-{}", parts.join(" × "), l.zero)
}

pub(super) fn tokens(n: usize) -> String {
    crate::info::group_digits(n as u64)
}

pub(super) fn gib(b: f64) -> String {
    format!("{:.2} GiB", b / GIB)
}

pub(super) fn describe(st: &Strategy) -> String {
    format!(
        "{} attention, {} positions{}, {}, {}, batch {}",
        match st.attention {
            AttentionKind::Flash => "flash",
            AttentionKind::Naive => "naive",
        },
        st.positions,
        if st.positions == Position::Learned {
            if st.shard_positions {
                " (table sharded)"
            } else {
                " (table replicated)"
            }
        } else {
            ""
        },
        match st.precision {
            Precision::Bf16 => "bf16 mixed precision",
            Precision::Fp32 => "fp32",
        },
        match st.checkpointing {
            Checkpointing::None => "no activation checkpointing",
            Checkpointing::Full { .. } => "full activation checkpointing",
        },
        st.batch_size
    ) + &match st.offload {
        Offload::None => String::new(),
        o => format!(", offload {o}"),
    }
}

pub(super) fn breakdown_lines(s: &mut String, e: &Estimate, mem_bytes: f64) {
    let _ = writeln!(
        s,
        "per-rank memory at {} tokens (peak in the {} phase{}):",
        tokens(e.seq_len),
        e.phase.name(),
        e.stage
            .map(|st| format!(", on pipeline stage {st}"))
            .unwrap_or_default()
    );
    for (name, v) in e.memory.rows() {
        let _ = writeln!(s, "  {name:<24}{:>12}", gib(v));
    }
    let _ = writeln!(
        s,
        "  {:<24}{:>12}  of {}",
        "total",
        gib(e.total()),
        gib(mem_bytes)
    );
    if e.host_bytes > 0.0 {
        let _ = writeln!(
            s,
            "  {:<24}{:>12}  in host memory (--offload)",
            "offloaded",
            gib(e.host_bytes)
        );
    }
    let others: Vec<String> = e
        .phases
        .iter()
        .filter(|(p, _)| *p != e.phase)
        .map(|(p, t)| format!("{} {}", p.name(), gib(*t)))
        .collect();
    if !others.is_empty() {
        let _ = writeln!(s, "  (other phases: {})", others.join(", "));
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn single_report(
    model: &ModelConfig,
    a: &PlanRequest,
    gpus: usize,
    mem: f64,
    best: &Candidate,
    searched: bool,
    at_max: &Estimate,
    at_len: Option<Estimate>,
    notes: &[String],
) -> String {
    let mut s = String::new();
    let what = match a.device {
        PlanDevice::Gpu => "GPUs",
        PlanDevice::Cpu => "CPU processes",
    };
    let _ = writeln!(s, "{} on {gpus} {what} × {mem} GiB", model.name);
    let _ = writeln!(
        s,
        "layout              {}{}",
        layout_text(&best.strategy.layout),
        match (searched, best.max_seq_len) {
            (true, 0) => "  (none of the layouts the flags allow fits; this one comes closest)",
            (true, _) => "  (best of the layouts the flags allow)",
            _ => "",
        }
    );
    let _ = writeln!(s, "settings            {}", describe(&best.strategy));
    if best.max_seq_len == 0
        && super::search::host_bound(a, &best.strategy.layout, at_max, best.hardware.mem_bytes)
    {
        let _ = writeln!(
            s,
            "longest sequence    none: not even {} tokens fit in host memory (--host-mem-gib; \
             the device's {mem} GiB would hold them, note below)",
            tokens(granule(&best.strategy))
        );
    } else if best.max_seq_len == 0 {
        // "0 tokens" read as a sequence length; say that nothing fits, and why below.
        let _ = writeln!(
            s,
            "longest sequence    none: not even {} tokens fit in {mem} GiB (the memory at \
             that length below)",
            tokens(granule(&best.strategy))
        );
    } else {
        let g = granule(&best.strategy);
        let limit = if best.max_seq_len + g > super::MAX_SEARCH {
            "; the most genslm trains (--seq-len), the memory holds more"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "longest sequence    {} tokens ({} codons ≈ {} bases; searched in steps of {}{limit})",
            tokens(best.max_seq_len),
            tokens(best.max_seq_len),
            tokens(3 * best.max_seq_len),
            tokens(g)
        );
    }
    if let Some(b) = super::stages::bubble(model, &best.strategy.layout) {
        let _ = writeln!(
            s,
            "pipeline bubble     {b:.3} (idle over busy, the backward twice the forward)"
        );
    }
    let n = best.max_seq_len;
    if let Some((counts, peaks)) =
        super::balance::suggest_layers(model, &best.strategy, &best.hardware, n.max(1))
    {
        let counts: Vec<String> = counts.iter().map(|c| c.to_string()).collect();
        let peaks: Vec<String> = peaks.iter().map(|p| gib(*p)).collect();
        let _ = writeln!(
            s,
            "balanced stages     --pp-layers {} (stage peaks {} at {} tokens)",
            counts.join(","),
            peaks.join(", "),
            tokens(n.max(1))
        );
    }
    breakdown_lines(&mut s, at_max, best.hardware.mem_bytes);
    if let Some(e) = at_len {
        breakdown_lines(&mut s, &e, best.hardware.mem_bytes);
    }
    for n in notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

pub(super) fn sweep_report(
    model: &ModelConfig,
    a: &PlanRequest,
    mem: f64,
    rows: &[SweepRow],
) -> String {
    let mut s = String::new();
    // The first column's header: "processes" would not fit its six characters.
    let (what, column) = match a.device {
        PlanDevice::Gpu => ("GPU", "GPUs"),
        PlanDevice::Cpu => ("process", "procs"),
    };
    let _ = writeln!(
        s,
        "{}: longest sequence (tokens) by {what} count, {mem} GiB per {what}; {}",
        model.name,
        describe(&strategy_for(
            model,
            a,
            Parallelism {
                degrees: Degrees {
                    dp: 1,
                    cp: 1,
                    sp: 1,
                    tp: 1,
                    pp: 1,
                },
                zero: 0,
                megatron_sp: false,
                zero_over_sp: false,
                pipeline: crate::plan::PipePlan::default(),
            }
        ))
    );
    let _ = writeln!(
        s,
        "{:>6}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  best layout",
        column, "DP only", "TP", "Ulysses SP", "TP+Ulysses", "CP (+any)", "PP (+any)", "best"
    );
    for r in rows {
        let cell = |n: usize| if n == 0 { "-".to_string() } else { tokens(n) };
        let _ = writeln!(
            s,
            "{:>6}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}  {}",
            r.gpus,
            cell(r.dp_only),
            cell(r.tp),
            cell(r.ulysses),
            cell(r.tp_ulysses),
            cell(r.context),
            cell(r.pipeline),
            cell(r.best.max_seq_len),
            match r.best.max_seq_len {
                0 => format!(
                    "none fits; closest: {}",
                    layout_text(&r.best.strategy.layout)
                ),
                _ => layout_text(&r.best.strategy.layout),
            }
        );
    }
    let _ = writeln!(
        s,
        "(- : no layout of that family fits or exists; TP within {} GPUs per node; the \
         families left of PP have no pipeline stages)",
        a.gpus_per_node
    );
    s
}
