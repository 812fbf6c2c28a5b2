//! Test hooks that make a rank fail or hang on purpose, so the tests and `scripts/check_mpi.sh`
//! can check that a failing or frozen rank stops the whole run with its message.

use std::time::Duration;

use crate::error::{Error, Result};

/// Test hooks: `GENSLM_FAULT_RANK=R:S` makes rank R fail when it starts step S;
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

/// `R:S` of a test hook.
fn rank_step(spec: &str) -> Option<(u64, u64)> {
    let (r, s) = spec.split_once(':')?;
    Some((r.parse().ok()?, s.parse().ok()?))
}
