//! The order a grouped NCCL call on borrowed device buffers keeps, whatever fails: every call
//! is tried until one fails, the group is closed (NCCL refuses all later work while a group is
//! open), the communicator's stream is waited for (calls enqueued before the failure may still
//! be reading or writing the buffers), and only then is the first error returned, so the
//! caller releases the buffers after NCCL is done with them. `parallel::nccl_device` runs its
//! collectives through this; it lives apart (no CUDA needed) so tests can drive it with fakes.

/// Runs `call(0..calls)` inside a group that `end` closes, then `sync`; the first error wins,
/// and `end` and `sync` run in every case.
pub fn grouped<E>(
    calls: usize,
    mut call: impl FnMut(usize) -> Result<(), E>,
    end: impl FnOnce() -> Result<(), E>,
    sync: impl FnOnce() -> Result<(), E>,
) -> Result<(), E> {
    let mut failed = None;
    for j in 0..calls {
        if let Err(e) = call(j) {
            failed = Some(e);
            break;
        }
    }
    let ended = end();
    settled(failed.map_or(ended, Err), sync)
}

/// `sync` runs whatever `result` is; `result`'s error wins over the wait's.
pub fn settled<E>(result: Result<(), E>, sync: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
    let synced = sync();
    result.and(synced)
}

#[cfg(test)]
mod tests {
    use super::grouped;
    use std::cell::RefCell;

    /// Runs `grouped` over 4 calls of which `fail` (if any) fails, with `end`/`sync` results
    /// as given; returns the result and the event log.
    fn run(fail: Option<usize>, end_ok: bool, sync_ok: bool) -> (Result<(), String>, Vec<String>) {
        let log = RefCell::new(Vec::new());
        let r = grouped(
            4,
            |j| {
                log.borrow_mut().push(format!("call {j}"));
                if Some(j) == fail {
                    Err(format!("call {j} failed"))
                } else {
                    Ok(())
                }
            },
            || {
                log.borrow_mut().push("end".into());
                if end_ok {
                    Ok(())
                } else {
                    Err("end failed".into())
                }
            },
            || {
                log.borrow_mut().push("sync".into());
                if sync_ok {
                    Ok(())
                } else {
                    Err("sync failed".into())
                }
            },
        );
        (r, log.into_inner())
    }

    #[test]
    fn a_failed_call_still_closes_the_group_and_waits_for_the_stream() {
        let (r, log) = run(Some(2), true, true);
        assert_eq!(r.unwrap_err(), "call 2 failed");
        // Nothing after the failure is enqueued; the wait comes after the group is closed.
        assert_eq!(log, ["call 0", "call 1", "call 2", "end", "sync"]);
        // The call's error is the one reported, even when closing and waiting fail too.
        assert_eq!(run(Some(0), false, false).0.unwrap_err(), "call 0 failed");
    }

    #[test]
    fn success_runs_every_call_and_reports_end_then_sync_errors() {
        let (r, log) = run(None, true, true);
        assert!(r.is_ok());
        assert_eq!(log, ["call 0", "call 1", "call 2", "call 3", "end", "sync"]);
        let (r, log) = run(None, false, true);
        assert_eq!(r.unwrap_err(), "end failed");
        assert_eq!(
            log.last().unwrap(),
            "sync",
            "the stream is waited for after a failed end"
        );
        assert_eq!(run(None, true, false).0.unwrap_err(), "sync failed");
    }
}
