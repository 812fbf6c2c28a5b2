//! Pipeline parallelism (issue 40): the model's layers split into stages over ranks, the
//! micro-batches of a step flowing through them. The schedules are data ([`schedule`]), with a
//! unit-cost simulation that the tests hold to the closed forms of each schedule's bubble;
//! [`stages`] cuts the layers into chunks; stages talk through the communicators'
//! point-to-point calls, matched by name in a [`mailroom`]. `train::pipeline` executes a
//! schedule on a stage's rank.

pub mod mailroom;
pub mod schedule;
pub mod stages;

use crate::error::Result;
use schedule::{Schedule, ScheduleKind};
use stages::Stages;

/// The cut of `layers` into `pp × virtual_stages` chunks (`counts` from `--pp-layers`, else
/// balanced) and the schedule of `micros` micro-batches over them, or why they cannot run: the
/// flags among themselves first, then the cut (more chunks than layers is wrong whatever the
/// micro-batches), then the micro-batches (naming them first sent users from one refusal to
/// the next). Training and the planner both build their pipelines here.
pub fn cut_and_schedule(
    layers: usize,
    counts: Option<&[usize]>,
    kind: ScheduleKind,
    pp: usize,
    micros: usize,
    virtual_stages: usize,
) -> Result<(Schedule, Stages)> {
    Schedule::check_flags(kind, pp, virtual_stages)?;
    let stages = match counts {
        Some(counts) => Stages::from_counts(counts, layers, pp, virtual_stages)?,
        None => Stages::balanced(layers, pp, virtual_stages)?,
    };
    Schedule::check(kind, pp, micros, virtual_stages)?;
    let schedule = Schedule::build(kind, pp, micros, virtual_stages)?;
    Ok((schedule, stages))
}
