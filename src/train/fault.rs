//! Test hooks that make a rank fail or hang on purpose, so the tests and `scripts/check_mpi.sh`
//! can check that a failing or frozen rank stops the whole run with its message.

use std::time::Duration;

use crate::error::{Error, Result};

/// Test hooks: `GENSLM_FAULT_RANK=R:S` makes rank R fail when it starts step S (S = 0: once
/// it has read its data, before the first step, where ranks are processes of a launcher);
/// `GENSLM_FREEZE_RANK=R:S` makes it hang there forever (a rank stuck in a computation).
pub(crate) fn injected_fault(rank: usize, step: u64) -> Result<()> {
    if let Ok(spec) = std::env::var("GENSLM_FREEZE_RANK") {
        if rank_step(&spec) == Some((rank as u64, step)) {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    let fault = std::env::var("GENSLM_FAULT_RANK").ok();
    if fault.and_then(|s| rank_step(&s)) == Some((rank as u64, step)) {
        return Err(Error::Invalid(format!(
            "rank {rank}: injected fault at step {step} (GENSLM_FAULT_RANK)"
        )));
    }
    Ok(())
}

/// Checks the hooks' variables before a run starts: a value that is not `R:S` is refused
/// naming it (it was ignored, so a mistyped test ran without its fault), and a set hook is
/// announced, since it stops or hangs the run on purpose.
pub(crate) fn check_hooks() -> Result<()> {
    for (var, what) in [
        ("GENSLM_FAULT_RANK", "fail"),
        ("GENSLM_FREEZE_RANK", "hang without end"),
    ] {
        let Some(value) = std::env::var_os(var) else {
            continue;
        };
        let text = value.to_string_lossy();
        let Some((r, s)) = value.to_str().and_then(rank_step) else {
            return Err(Error::Invalid(format!(
                "{var}={text}: a test hook takes RANK:STEP (two whole numbers, e.g. 1:3); unset \
                 it for a normal run"
            )));
        };
        eprintln!("warning: {var}={text} is set: rank {r} will {what} at step {s} (a test hook)");
    }
    // The MPI communicator's piece size, lowered by scripts/check_mpi.sh.
    crate::parallel::comm::mpi_max_count()?;
    Ok(())
}

/// `R:S` of a test hook.
fn rank_step(spec: &str) -> Option<(u64, u64)> {
    let (r, s) = spec.split_once(':')?;
    Some((r.parse().ok()?, s.parse().ok()?))
}
