//! Training's entry points and the rank launcher: one rank ([`train`]), ranks as threads of this
//! process ([`train_grid`]), or one rank per process under a launcher such as MPI
//! ([`train_with_ranks`]). Each rank runs `rank_loop::train_rank`; a failing rank stops the
//! others with its message, and the run's error is the root cause among the ranks' results.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::parallel::ranks::{abort_all, thread_grid, Ranks};
use crate::parallel::{Degrees, Topology};
use crate::train::fault::injected_fault;
use crate::train::old_run::OldRun;
use crate::train::setup::{check_memory, load_corpus, prepare_run, validate_layout};

pub use crate::train::rank_loop::{train_rank, TrainSummary};
pub use crate::train::setup::{DataSource, RunOptions};

/// Trains `cfg.model` with `cfg.train` on `data`, writing everything under `run` (one rank).
pub fn train(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
) -> Result<TrainSummary> {
    let (corpus, _lock, pending) = prepare_run(cfg, data, run, opts)?;
    let opts = RunOptions {
        old_run: OldRun::hold(pending),
        ..opts.clone()
    };
    let r = train_rank(cfg, &corpus, run, &opts, &Ranks::single());
    opts.old_run.settle(r.is_ok());
    r
}

/// The same run with `dp × sp` ranks as threads of this process (docs/ARCHITECTURE.md §5). Only rank 0
/// writes metrics and checkpoints; a failing rank stops the others with its message.
pub fn train_threads(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    dp: usize,
    sp: usize,
) -> Result<TrainSummary> {
    train_grid(cfg, data, run, opts, Degrees::new(dp, 1, sp))
}

/// [`train_threads`] on a DP × CP × SP × TP grid.
pub fn train_grid(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    d: Degrees,
) -> Result<TrainSummary> {
    let topo = Topology::of(0, d)?;
    validate_layout(cfg, &topo)?;
    let n = d.world();
    check_memory(cfg, (d.dp, topo.seq_degree(), d.pp), n, opts)?;
    if n == 1 {
        if cfg.train.zero >= 2 {
            eprintln!(
                "note: ZeRO-{} with one rank has nothing to shard: the whole model stays on \
                 this rank (ZeRO-0 in effect)",
                cfg.train.zero
            );
        }
        return train(cfg, data, run, opts);
    }
    let (corpus, _lock, pending) = prepare_run(cfg, data, run, opts)?;
    let opts = &RunOptions {
        old_run: OldRun::hold(pending),
        ..opts.clone()
    };
    let corpus = Arc::new(corpus);
    let timeout = Duration::from_secs(cfg.train.rank_timeout_s);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut started = 0;
    let old_run = opts.old_run.clone();
    for ranks in thread_grid(d, timeout) {
        let ranks = match opts.network {
            Some(net) => ranks.delayed(net),
            None => ranks,
        };
        let (cfg, corpus, run) = (cfg.clone(), corpus.clone(), run.to_path_buf());
        let opts = RunOptions {
            thread_rank: ranks.topo.rank,
            ranks_in_process: n,
            ..opts.clone()
        };
        let tx = tx.clone();
        let rank = ranks.topo.rank;
        let abort_ranks = ranks.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{RANK_THREAD_PREFIX}{rank}"))
            .spawn(move || {
                let r = run_rank_guarded(&ranks, || train_rank(&cfg, &corpus, &run, &opts, &ranks));
                let _ = tx.send((rank, r));
            });
        if let Err(e) = spawned {
            // The ranks already running stop at their next collective.
            let why = format!("could not start rank {rank} as a thread: {e}");
            abort_all(&abort_ranks, &why);
            old_run.settle(false);
            return Err(Error::Invalid(format!(
                "{why} (a process or thread limit? lower --dp/--sp)"
            )));
        }
        started += 1;
    }
    drop(tx);
    let r = collect_rank_results(&rx, started, timeout);
    old_run.settle(r.is_ok());
    r
}

/// How a rank's thread is named (the panic hook recognises them).
pub const RANK_THREAD_PREFIX: &str = "genslm-rank-";

/// The ranks' results as they finish. Once one has failed, the others get a grace period to
/// report (they stop at their next collective); a rank that does not, frozen in a computation,
/// is left behind: the run's error is returned and the process can exit, instead of waiting
/// forever to join it.
fn collect_rank_results(
    rx: &std::sync::mpsc::Receiver<(usize, Result<TrainSummary>)>,
    n: usize,
    timeout: Duration,
) -> Result<TrainSummary> {
    use std::sync::mpsc::RecvTimeoutError;
    const GRACE: Duration = Duration::from_secs(5);
    let mut results: Vec<(usize, Result<TrainSummary>)> = Vec::with_capacity(n);
    while results.len() < n {
        let failed = results.iter().any(|(_, r)| r.is_err());
        // A healthy run reports when it is done; a frozen rank makes its peers fail within
        // the rank timeout, which ends this wait through their results.
        let wait = if failed { GRACE } else { timeout + GRACE };
        match rx.recv_timeout(wait) {
            Ok(r) => results.push(r),
            Err(RecvTimeoutError::Timeout) if !failed => continue,
            Err(_) => break,
        }
    }
    if results.len() < n && results.iter().all(|(_, r)| r.is_ok()) {
        results.push((
            n,
            Err(Error::Invalid("a rank thread never finished".into())),
        ));
    }
    first_error_or_root(results)
}

/// The run with ranks given by a launcher (one rank per process, e.g. MPI): rank 0 prepares
/// the run directory and the dataset, the others read them after a barrier.
pub fn train_with_ranks(
    cfg: &Config,
    data: &DataSource,
    run: &Path,
    opts: &RunOptions,
    ranks: &Ranks,
) -> Result<TrainSummary> {
    run_rank_guarded(ranks, || {
        validate_layout(cfg, &ranks.topo)?;
        let t = &ranks.topo;
        check_memory(cfg, (t.dp, t.seq_degree(), t.pp), 1, opts)?;
        // Rank 0 may tokenize for a long time: the others wait without a deadline. It holds
        // the run directory's lock until the run ends.
        let (corpus, _lock, old_run, _owner) = if ranks.is_root() {
            let prepared = prepare_run(cfg, data, run, opts);
            let (corpus, lock, pending) = match (ranks.world.barrier_unbounded(), prepared) {
                (Ok(()), Ok(p)) => p,
                (_, Err(e)) => return Err(e),
                (Err(e), Ok((_, lock, pending))) => {
                    drop(pending);
                    drop(lock);
                    return Err(e);
                }
            };
            // Every rank reads the data before the first step (a rank that cannot, on a node
            // that does not see the run directory, fails here). The old run `--overwrite`
            // replaces stays until rank 0's first checkpoint; a failure or signal before
            // then puts it back.
            let agreed = injected_fault(0, 0).and_then(|()| ranks.world.barrier_unbounded());
            if let Err(e) = agreed {
                drop(pending);
                drop(lock);
                return Err(e);
            }
            (corpus, Some(lock), Some(OldRun::hold(pending)), None)
        } else {
            ranks.world.barrier_unbounded()?;
            // The other ranks write their own files of the run (optimizer shards) without the
            // lock; the directory exists from here on.
            let owner = crate::run_lock::RunOwner::register(run);
            let data = match data {
                DataSource::Fasta(_) => DataSource::Parquet(run.join("data.parquet")),
                other => other.clone(),
            };
            let corpus = load_corpus(cfg, &data, run, None)?;
            injected_fault(t.rank, 0)?;
            ranks.world.barrier_unbounded()?;
            (corpus, None, None, Some(owner))
        };
        let opts = RunOptions {
            old_run: old_run.unwrap_or_default(),
            ..opts.clone()
        };
        let r = train_rank(cfg, &corpus, run, &opts, ranks);
        opts.old_run.settle(r.is_ok());
        r
    })
}

/// Runs one rank's work; an error or panic aborts every group so the other ranks stop waiting.
pub fn run_rank_guarded<T>(ranks: &Ranks, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let rank = ranks.topo.rank;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = crate::error::panic_message(p.as_ref()).unwrap_or("panicked");
        Err(Error::Invalid(format!("rank {rank}: {msg}")))
    });
    if let Err(e) = &out {
        abort_all(ranks, &e.to_string());
    }
    out
}

/// The root cause among the ranks' results: the first error that is not another rank's
/// "stopping" echo, else rank 0's result.
fn first_error_or_root(mut results: Vec<(usize, Result<TrainSummary>)>) -> Result<TrainSummary> {
    let cause = results
        .iter()
        .position(|(_, r)| matches!(r, Err(e) if !e.to_string().contains("stopping:")));
    let any = results.iter().position(|(_, r)| r.is_err());
    // Without an error, rank 0's summary: it alone writes the checkpoints, so only its names
    // the last one (the first rank to finish, whichever it was, was reported before).
    let root = results.iter().position(|(rank, _)| *rank == 0);
    match cause.or(any).or(root) {
        Some(i) => results.swap_remove(i).1,
        None => results.swap_remove(0).1,
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// Without an error the summary is rank 0's, whatever order the ranks finished in: only
    /// it names the last checkpoint (the first to finish was reported, so `train --tp 2`
    /// sometimes printed no "checkpoint" line). With errors, the cause before the echoes.
    #[test]
    fn the_summary_is_rank_zeros_and_the_error_is_the_cause() {
        let done = |ckpt: Option<&str>| {
            Ok(TrainSummary {
                last_checkpoint: ckpt.map(PathBuf::from),
                ..Default::default()
            })
        };
        let s = first_error_or_root(vec![(1, done(None)), (0, done(Some("step-4")))]).unwrap();
        assert_eq!(s.last_checkpoint, Some(PathBuf::from("step-4")));
        let err = |m: &str| Err(Error::Invalid(m.into()));
        let e = first_error_or_root(vec![
            (0, err("stopping: rank 1 failed")),
            (1, err("rank 1: out of memory")),
            (2, done(None)),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("out of memory"), "{e}");
    }
}
