//! Pipeline schedules as data (issue 40, step 1): for each stage, the ordered list of passes it
//! runs over the micro-batches of one optimizer step. One function builds every schedule
//! ([`Schedule::build`]); an engine executes the lists, and the tests below check each schedule
//! as data: every pass once and on its stage, a micro-batch's forward before its backward,
//! the dependencies between stages satisfiable in the given orders, the in-flight activations
//! within the schedule's bound, and the idle time of a unit-cost run equal to the closed form.
//!
//! The model's layers are cut into `stages × virtual` chunks; chunk `c` lives on stage
//! `c % stages` (Megatron's interleaved layout: stage `s` holds chunks `s, s + P, s + 2P, …`),
//! so with one virtual stage chunk `c` is stage `c`. A micro-batch's forward runs the chunks in
//! order, its backward in reverse.
//!
//! Schedules (`--pp-schedule`):
//! - `gpipe`: all forwards, then all backwards. The simplest; holds every micro-batch's
//!   activations at once.
//! - `1f1b`: `P − s − 1` warm-up forwards on stage `s`, then one forward and one backward in
//!   turn, then the remaining backwards; stage `s` holds at most `P − s` micro-batches.
//! - `interleaved` (`--pp-virtual V`): 1F1B over `V` chunks per stage, the bubble divided by
//!   `V` (Narayanan et al. 2021); needs the micro-batches in whole groups of `P`.
//! - `zb`: ZB-H1 of Qi et al. 2024 (arXiv 2401.10241): the backward split into the input
//!   gradient (B), which the previous stage waits for, and the weight gradient (W), which
//!   nobody waits for. Stage `s` postpones `s` of its W passes to the end, where the later
//!   stages would otherwise wait for the earlier ones' last backwards; the in-flight bound
//!   stays 1F1B's `P` on stage 0.

use crate::error::{Error, Result};

/// Most passes one step's schedule may hold (each is a few bytes; 2²⁴ is far past any
/// pipeline that runs).
pub const MAX_PASSES: usize = 1 << 24;

/// The schedule kinds are a setting (`[train] pp_schedule`), so they live with the settings.
pub use crate::config::ScheduleKind;

/// What a pass computes: the forward, the backward (for schedules that do not split it: the
/// input and the weight gradients together), or the weight gradient alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    F,
    B,
    W,
}

/// One pass of one micro-batch through one chunk of layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Op {
    pub pass: Pass,
    pub micro: usize,
    /// The model chunk (`0..stages × virtual`), on stage `chunk % stages`.
    pub chunk: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub stages: usize,
    pub micros: usize,
    pub virtual_stages: usize,
    /// Per stage, its passes in the order it runs them.
    pub ops: Vec<Vec<Op>>,
}

impl Schedule {
    /// Whether the flags agree among themselves, whatever the model and the micro-batches:
    /// every count at least 1, and virtual stages only with the schedule that has them.
    pub fn check_flags(kind: ScheduleKind, stages: usize, virtual_stages: usize) -> Result<()> {
        let (p, v) = (stages, virtual_stages);
        if p == 0 || v == 0 {
            return Err(Error::Invalid(format!(
                "pipeline of {p} stages, {v} virtual stages: each must be at least 1"
            )));
        }
        if v > 1 && kind != ScheduleKind::Interleaved {
            return Err(Error::Invalid(format!(
                "--pp-virtual {v} needs --pp-schedule interleaved ({kind} runs one chunk per stage)"
            )));
        }
        Ok(())
    }

    /// Why `kind` cannot run on `stages` stages, `micros` micro-batches and `virtual` chunks
    /// per stage, if it cannot (without building anything).
    pub fn check(
        kind: ScheduleKind,
        stages: usize,
        micros: usize,
        virtual_stages: usize,
    ) -> Result<()> {
        let (p, m, v) = (stages, micros, virtual_stages);
        if m == 0 {
            return Err(Error::Invalid(format!(
                "pipeline of {p} stages, {m} micro-batches, {v} virtual stages: each must be at least 1"
            )));
        }
        Self::check_flags(kind, p, v)?;
        if matches!(
            kind,
            ScheduleKind::OneFOneB | ScheduleKind::Interleaved | ScheduleKind::ZeroBubble
        ) && m < p
        {
            return Err(Error::Invalid(format!(
                "--pp-schedule {kind} with {p} stages needs at least {p} micro-batches (--grad-accum), \
                 got {m}: with fewer, the last stage's first backward cannot start before the first \
                 stage runs out of forwards, so the schedule is GPipe's. Use --grad-accum {} (4·P \
                 micro-batches, as `genslm plan` assumes: a bubble of (P − 1)/m = {:.2}), or \
                 --pp-schedule gpipe",
                4 * p,
                (p - 1) as f64 / (4 * p) as f64
            )));
        }
        if kind == ScheduleKind::Interleaved && m % p != 0 {
            return Err(Error::Invalid(format!(
                "--pp-schedule interleaved runs the micro-batches in groups of the {p} stages: \
                 --grad-accum {m} is not a multiple of {p}"
            )));
        }
        // Every pass of the step is held as data (three per micro-batch and chunk at most):
        // refuse sizes whose lists would not fit in memory before building them.
        let passes = p
            .checked_mul(v)
            .and_then(|c| c.checked_mul(m))
            .and_then(|n| n.checked_mul(3));
        if passes.is_none_or(|n| n > MAX_PASSES) {
            return Err(Error::Invalid(format!(
                "a pipeline of {p} stages × {v} chunks × {m} micro-batches has more than \
                 {MAX_PASSES} passes per step: use fewer stages, chunks or micro-batches"
            )));
        }
        Ok(())
    }

    /// The schedule `kind` for `stages` stages, `micros` micro-batches and `virtual` chunks per
    /// stage, or why it cannot run.
    pub fn build(
        kind: ScheduleKind,
        stages: usize,
        micros: usize,
        virtual_stages: usize,
    ) -> Result<Self> {
        Self::check(kind, stages, micros, virtual_stages)?;
        let (p, m, v) = (stages, micros, virtual_stages);
        let ops = (0..p)
            .map(|s| match kind {
                ScheduleKind::GPipe => gpipe(s, m),
                ScheduleKind::OneFOneB => one_f_one_b(s, p, m),
                ScheduleKind::Interleaved => interleaved(s, p, m, v),
                ScheduleKind::ZeroBubble => zb_h1(s, p, m),
            })
            .collect();
        Ok(Schedule {
            kind,
            stages: p,
            micros: m,
            virtual_stages: v,
            ops,
        })
    }

    /// Chunks of the model: `stages × virtual`.
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The pass after which a micro-batch's activations on a chunk are no longer needed: W when
    /// the backward is split (the weight gradient reads the layer inputs), else B.
    pub fn frees(&self) -> Pass {
        if self.kind.splits_backward() {
            Pass::W
        } else {
            Pass::B
        }
    }

    /// The passes `op` waits for on other stages (or earlier on its own): the previous chunk's
    /// forward, the next chunk's input gradient, its own forward, its own input gradient.
    pub fn deps(&self, op: Op) -> impl Iterator<Item = Op> {
        let last = self.chunks() - 1;
        let at = |pass, chunk| Op {
            pass,
            micro: op.micro,
            chunk,
        };
        // At most two, without an allocation: the simulation asks for every op's.
        let (first, second) = match op.pass {
            Pass::F if op.chunk > 0 => (Some(at(Pass::F, op.chunk - 1)), None),
            Pass::F => (None, None),
            Pass::B if op.chunk < last => {
                (Some(at(Pass::F, op.chunk)), Some(at(Pass::B, op.chunk + 1)))
            }
            Pass::B => (Some(at(Pass::F, op.chunk)), None),
            Pass::W => (Some(at(Pass::B, op.chunk)), None),
        };
        first.into_iter().chain(second)
    }
}

/// Stage `s` of GPipe: every forward, then every backward (in order).
fn gpipe(s: usize, m: usize) -> Vec<Op> {
    let f = (0..m).map(|i| Op {
        pass: Pass::F,
        micro: i,
        chunk: s,
    });
    let b = (0..m).map(|i| Op {
        pass: Pass::B,
        micro: i,
        chunk: s,
    });
    f.chain(b).collect()
}

/// Stage `s` of 1F1B: `P − s − 1` warm-up forwards, then forward/backward pairs, then the
/// remaining backwards.
fn one_f_one_b(s: usize, p: usize, m: usize) -> Vec<Op> {
    let warm = (p - s - 1).min(m);
    let op = |pass, micro| Op {
        pass,
        micro,
        chunk: s,
    };
    let mut ops: Vec<Op> = (0..warm).map(|i| op(Pass::F, i)).collect();
    for k in 0..m - warm {
        ops.push(op(Pass::F, warm + k));
        ops.push(op(Pass::B, k));
    }
    ops.extend((m - warm..m).map(|i| op(Pass::B, i)));
    ops
}

/// Stage `s` of interleaved 1F1B over `v` chunks: the stage's `m · v` (micro-batch, chunk)
/// pairs ordered in groups of `p` micro-batches, chunk by chunk (the backward takes the chunks
/// in reverse); warm-up forwards enough for the next stage's first chunk to reach this stage's
/// second (`2(p − s − 1) + (v − 1)p`), then pairs, then the remaining backwards.
fn interleaved(s: usize, p: usize, m: usize, v: usize) -> Vec<Op> {
    let total = m * v;
    let nth = |k: usize, forward: bool| {
        let in_group = k % (p * v);
        let local = in_group / p;
        let local = if forward { local } else { v - 1 - local };
        (k / (p * v) * p + k % p, local * p + s)
    };
    let op = |pass, k| {
        let (micro, chunk) = nth(k, pass == Pass::F);
        Op { pass, micro, chunk }
    };
    let warm = if m == p {
        total
    } else {
        (2 * (p - s - 1) + (v - 1) * p).min(total)
    };
    let mut ops: Vec<Op> = (0..warm).map(|k| op(Pass::F, k)).collect();
    for k in 0..total - warm {
        ops.push(op(Pass::F, warm + k));
        ops.push(op(Pass::B, k));
    }
    ops.extend((total - warm..total).map(|k| op(Pass::B, k)));
    ops
}

/// Stage `s` of ZB-H1: 1F1B's `P − s − 1` warm-up forwards; then `s` forward/input-gradient
/// pairs whose weight gradients wait; then forward, input gradient, weight gradient (the oldest
/// waiting one) while forwards remain; then input and weight gradients; then the `s` weight
/// gradients that waited.
fn zb_h1(s: usize, p: usize, m: usize) -> Vec<Op> {
    let op = |pass, micro| Op {
        pass,
        micro,
        chunk: s,
    };
    let (mut f, mut b, mut w) = (0, 0, 0);
    let mut ops = Vec::with_capacity(3 * m);
    while f < (p - s - 1).min(m) {
        ops.push(op(Pass::F, f));
        f += 1;
    }
    for _ in 0..s {
        if f == m {
            break;
        }
        ops.extend([op(Pass::F, f), op(Pass::B, b)]);
        (f, b) = (f + 1, b + 1);
    }
    while f < m {
        ops.extend([op(Pass::F, f), op(Pass::B, b), op(Pass::W, w)]);
        (f, b, w) = (f + 1, b + 1, w + 1);
    }
    while b < m {
        ops.extend([op(Pass::B, b), op(Pass::W, w)]);
        (b, w) = (b + 1, w + 1);
    }
    ops.extend((w..m).map(|i| op(Pass::W, i)));
    ops
}

/// A run of a schedule where each pass takes a fixed time: when each stage is busy and idle.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// When the last pass of any stage ends.
    pub makespan: u64,
    /// Per stage: time spent running passes.
    pub busy: Vec<u64>,
    /// Per stage: the most micro-batch chunks whose activations are alive at once (forward
    /// run, [`Schedule::frees`] not yet).
    pub peak_in_flight: Vec<usize>,
}

impl Timeline {
    /// Idle time of stage `s` over the step: the makespan less its busy time.
    pub fn idle(&self, s: usize) -> u64 {
        self.makespan - self.busy[s]
    }
}

/// Runs `schedule` with each pass taking `cost(pass)` time units and no communication time:
/// every stage runs its list in order, a pass starting when its stage is free and its
/// dependencies have ended. Errors when a stage's next pass waits for a pass that can never
/// run (a deadlock in the given orders), or when a pass is missing, repeated or on the wrong
/// stage.
pub fn simulate(schedule: &Schedule, cost: impl Fn(Pass) -> u64) -> Result<Timeline> {
    let (p, m, chunks) = (schedule.stages, schedule.micros, schedule.chunks());
    let passes: &[Pass] = if schedule.kind.splits_backward() {
        &[Pass::F, Pass::B, Pass::W]
    } else {
        &[Pass::F, Pass::B]
    };
    // Dense tables indexed by (pass, chunk, micro-batch): the planner simulates a schedule
    // for every pipelined layout it weighs, and hashing each op dominated `plan --sweep`.
    let slot = |op: &Op| {
        let pass = match op.pass {
            Pass::F => 0,
            Pass::B => 1,
            Pass::W => 2,
        };
        (pass * chunks + op.chunk) * m + op.micro
    };
    let size = 3 * chunks * m;
    let mut seen = vec![false; size];
    let mut count = 0usize;
    for (s, ops) in schedule.ops.iter().enumerate() {
        for op in ops {
            if op.chunk >= chunks
                || op.micro >= m
                || op.chunk % p != s
                || !passes.contains(&op.pass)
            {
                return Err(Error::Invalid(format!(
                    "stage {s} runs {op:?}, which is not one of its passes"
                )));
            }
            if std::mem::replace(&mut seen[slot(op)], true) {
                return Err(Error::Invalid(format!("{op:?} runs twice")));
            }
            count += 1;
        }
    }
    if count != passes.len() * m * chunks {
        return Err(Error::Invalid(format!(
            "{} passes scheduled, {} needed",
            count,
            passes.len() * m * chunks
        )));
    }
    // When each op ends; `None` until it has run.
    let mut end: Vec<Option<u64>> = vec![None; size];
    let mut next = vec![0usize; p];
    let mut free = vec![0u64; p];
    let mut busy = vec![0u64; p];
    let mut alive = vec![0usize; p];
    let mut peak = vec![0usize; p];
    let frees = schedule.frees();
    let mut left = count;
    while left > 0 {
        let mut progressed = false;
        for s in 0..p {
            while let Some(&op) = schedule.ops[s].get(next[s]) {
                let Some(ready) = schedule
                    .deps(op)
                    .try_fold(0u64, |r, d| end[slot(&d)].map(|e| r.max(e)))
                else {
                    break;
                };
                let start = ready.max(free[s]);
                let t = cost(op.pass);
                end[slot(&op)] = Some(start + t);
                (free[s], busy[s]) = (start + t, busy[s] + t);
                if op.pass == Pass::F {
                    alive[s] += 1;
                    peak[s] = peak[s].max(alive[s]);
                } else if op.pass == frees {
                    alive[s] -= 1;
                }
                next[s] += 1;
                left -= 1;
                progressed = true;
            }
        }
        if !progressed {
            let waiting: Vec<String> = (0..p)
                .filter_map(|s| {
                    schedule.ops[s]
                        .get(next[s])
                        .map(|op| format!("stage {s} at {op:?}"))
                })
                .collect();
            return Err(Error::Invalid(format!(
                "the schedule deadlocks: {}",
                waiting.join(", ")
            )));
        }
    }
    Ok(Timeline {
        makespan: free.iter().copied().max().unwrap_or(0),
        busy,
        peak_in_flight: peak,
    })
}

#[cfg(test)]
mod tests;
