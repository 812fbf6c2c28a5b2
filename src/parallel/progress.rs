//! Non-blocking collectives (issue 42): a communication thread per group and rank that runs
//! started operations in the order they were started, while the rank's own thread computes.
//!
//! [`start`] hands a job (a closure over a communicator: one collective, or a bucketed series
//! of them) to the group's thread and returns a [`Pending`] at once; [`Pending::wait`] gives
//! the job's result. A group without a communication thread (overlap off, one rank, NCCL)
//! runs the job at once, inside `start`: the same calls in the same order, so results are
//! bit-identical either way.
//!
//! Why a thread rather than MPI's `MPI_I*` calls: one mechanism serves the thread ranks and
//! MPI alike, a job may be a whole bucketed series (ZeRO's gathers of a layer), and what the
//! thread does between calls (packing the next bucket) overlaps too. It needs MPI's
//! `MPI_THREAD_MULTIPLE` (several groups' threads call MPI at once); `parallel::mpi::init`
//! asks for it and the trainer turns overlap off, saying so, where the library offers less.
//!
//! Order: MPI and the thread groups match collectives by their order on each rank. A blocking
//! call on a group waits until the group's started jobs have run (it then runs on the calling
//! thread, with no copy), so every rank issues each group's collectives in program order,
//! whichever thread runs them. Two fields of `Ranks` that are one group share one
//! communication thread (`Ranks::wrapped` keeps them one).

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::parallel::comm::Communicator;
pub use crate::parallel::comm::{Job, WaitHook};
use crate::parallel::hooked::{Hook, Hooked};

/// Starts `job` on `comm`'s communication thread, or runs it now where `comm` has none.
pub fn start<T: Send + 'static>(
    comm: &dyn Communicator,
    job: impl FnOnce(&dyn Communicator) -> Result<T> + Send + 'static,
) -> Pending<T> {
    let (tx, rx) = channel();
    let boxed: Job = Box::new(move |c| {
        let _ = tx.send(job(c));
    });
    match comm.start_job(boxed) {
        Ok(hooks) => Pending { rx, hooks },
        Err(job) => {
            job(comm);
            Pending {
                rx,
                hooks: Vec::new(),
            }
        }
    }
}

/// The result of a started job, once it has run.
#[derive(Debug)]
#[must_use = "a started collective's result (or error) is only seen by waiting for it"]
pub struct Pending<T> {
    rx: Receiver<Result<T>>,
    /// Wrappers around the wait, innermost first.
    hooks: Vec<Arc<dyn WaitHook>>,
}

impl<T> Pending<T> {
    /// A result that is already there.
    pub fn ready(result: Result<T>) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(result);
        Pending {
            rx,
            hooks: Vec::new(),
        }
    }

    /// Waits for the job and returns what it returned.
    pub fn wait(self) -> Result<T> {
        type Got<T> = std::result::Result<Result<T>, std::sync::mpsc::RecvError>;
        fn run<T>(hooks: &[Arc<dyn WaitHook>], rx: &Receiver<Result<T>>, out: &mut Option<Got<T>>) {
            match hooks.split_last() {
                None => *out = Some(rx.recv()),
                Some((h, inner)) => h.around_wait(&mut || run(inner, rx, out)),
            }
        }
        let mut out = None;
        run(&self.hooks, &self.rx, &mut out);
        match out {
            Some(Ok(r)) => r,
            _ => Err(Error::Invalid(
                "a communication thread stopped before finishing a started collective (it \
                 panicked; see the message above)"
                    .into(),
            )),
        }
    }
}

/// Jobs started and not yet finished, and the signal of each finish.
#[derive(Debug, Default)]
struct InFlight {
    n: Mutex<usize>,
    cv: Condvar,
}

impl InFlight {
    fn add(&self) {
        *self.n.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }
    fn done(&self) {
        *self.n.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        self.cv.notify_all();
    }
    /// Returns once no job is in flight.
    fn drain(&self) {
        let mut n = self.n.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = self.cv.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A group's communication thread, as the hook of a [`Hooked`] communicator: blocking calls
/// wait for the started jobs first; [`start`] queues jobs for the thread. The thread starts
/// with the first job and ends when the communicator is dropped, which waits for it (see
/// [`Progress::drop`]).
#[derive(Debug)]
pub struct Progress {
    /// The communicator the jobs run on (what the wrapper wraps).
    inner: Arc<dyn Communicator>,
    queue: OnceLock<Option<Thread>>,
    in_flight: Arc<InFlight>,
}

/// The running communication thread: its queue, and the signal it gives once it has let go of
/// its communicator.
#[derive(Debug)]
struct Thread {
    queue: Mutex<Sender<Job>>,
    released: Mutex<Receiver<()>>,
    handle: std::thread::JoinHandle<()>,
}

/// How long dropping a communicator waits for its thread to finish the jobs left (a job stuck
/// on a peer that died is not waited for longer).
const JOIN_WAIT: Duration = Duration::from_secs(30);

impl Progress {
    /// `inner` with a communication thread.
    pub fn wrap(inner: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        let hook = Progress {
            inner: inner.clone(),
            queue: OnceLock::new(),
            in_flight: Arc::default(),
        };
        Hooked::wrap(inner, hook)
    }

    /// The thread's queue, the thread started with the first job; `None` where it could not
    /// start (a thread limit): the jobs then run on the caller's thread, blocking.
    fn queue(&self) -> Option<&Mutex<Sender<Job>>> {
        self.queue
            .get_or_init(|| {
                let (tx, rx) = channel::<Job>();
                let (done, released) = channel();
                let (inner, in_flight) = (self.inner.clone(), self.in_flight.clone());
                let rank = inner.rank();
                std::thread::Builder::new()
                    .name(format!("genslm-comm-{rank}"))
                    .spawn(move || {
                        for job in rx {
                            // A panicking job drops its result's sender: its waiter gets an
                            // error.
                            let run = AssertUnwindSafe(|| job(inner.as_ref()));
                            let _ = std::panic::catch_unwind(run);
                            in_flight.done();
                        }
                        drop(inner);
                        let _ = done.send(());
                    })
                    .ok()
                    .map(|handle| Thread {
                        queue: Mutex::new(tx),
                        released: Mutex::new(released),
                        handle,
                    })
            })
            .as_ref()
            .map(|t| &t.queue)
    }
}

impl Drop for Progress {
    /// Ends the thread and waits (at most [`JOIN_WAIT`]) until it has dropped its handle on the
    /// communicator. Why: the last handle's drop frees the communicator (`MPI_Comm_free`, the
    /// sends in flight); done on a detached thread it could run while `main` finalises MPI,
    /// which corrupted the heap in a CI run (`MPI_Finalize`: "corrupted double-linked list").
    fn drop(&mut self) {
        let Some(Some(Thread {
            queue,
            released,
            handle,
        })) = self.queue.take()
        else {
            return;
        };
        drop(queue);
        if handle.thread().id() == std::thread::current().id() {
            return; // dropped by one of its own jobs: it ends after this one
        }
        let released = released.into_inner().unwrap_or_else(|p| p.into_inner());
        if released.recv_timeout(JOIN_WAIT).is_ok() {
            let _ = handle.join();
        }
    }
}

impl Hook for Progress {
    fn around<T>(&self, _size: usize, _bytes: usize, call: impl FnOnce() -> T) -> T {
        self.in_flight.drain();
        call()
    }

    fn has_thread(&self) -> bool {
        true
    }

    fn submit(&self, job: Job) -> std::result::Result<Vec<Arc<dyn WaitHook>>, Job> {
        let Some(queue) = self.queue() else {
            return Err(job);
        };
        self.in_flight.add();
        match queue.lock().unwrap_or_else(|p| p.into_inner()).send(job) {
            Ok(()) => Ok(Vec::new()),
            Err(std::sync::mpsc::SendError(job)) => {
                // The thread is gone: run it here, after whatever it left.
                self.in_flight.done();
                self.in_flight.drain();
                Err(job)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::parallel::netsim::NetSim;
    use crate::parallel::threads::thread_group;

    /// Started all-reduces interleaved with blocking ones on the same group give what the same
    /// calls give in program order (a plain sum), on every rank.
    #[test]
    fn started_and_blocking_calls_keep_program_order() {
        let hs: Vec<_> = thread_group(3, Duration::from_secs(20))
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let c = Progress::wrap(Arc::new(c));
                    let r = c.rank() as f32;
                    let mut pending = Vec::new();
                    let mut blocking = Vec::new();
                    for k in 0..20 {
                        let v = vec![r * 10.0 + k as f32; 1000 + k];
                        pending.push(start(c.as_ref(), move |c| {
                            let mut v = v;
                            c.all_reduce_sum(&mut v)?;
                            Ok(v)
                        }));
                        let mut b = [r + k as f32];
                        c.all_reduce_sum(&mut b).unwrap();
                        blocking.push(b[0]);
                    }
                    let got: Vec<Vec<f32>> =
                        pending.into_iter().map(|p| p.wait().unwrap()).collect();
                    (got, blocking)
                })
            })
            .collect();
        for h in hs {
            let (got, blocking) = h.join().unwrap();
            for k in 0..20 {
                // Σ_r (10 r + k) over r = 0, 1, 2.
                let want = 30.0 + 3.0 * k as f32;
                assert_eq!(got[k].len(), 1000 + k);
                assert!(got[k].iter().all(|&x| x == want), "job {k}");
                assert_eq!(blocking[k], 3.0 + 3.0 * k as f32);
            }
        }
    }

    /// Behind a 100 ms link, a started all-reduce runs while the rank sleeps 100 ms ("computes"):
    /// both together take about 100 ms, not 200; without a communication thread, 200.
    #[test]
    fn a_started_collective_overlaps_the_callers_work() {
        let net: NetSim = "100ms,1GB/s".parse().unwrap();
        for overlap in [true, false] {
            let hs: Vec<_> = thread_group(2, Duration::from_secs(20))
                .into_iter()
                .map(|c| {
                    std::thread::spawn(move || {
                        let c = Hooked::wrap(Arc::new(c), net);
                        let c = if overlap { Progress::wrap(c) } else { c };
                        let t = Instant::now();
                        let p = start(c.as_ref(), |c| {
                            let mut v = vec![1.0f32; 10];
                            c.all_reduce_sum(&mut v)?;
                            Ok(v[0])
                        });
                        std::thread::sleep(Duration::from_millis(100));
                        let sum = p.wait().unwrap();
                        (t.elapsed(), sum)
                    })
                })
                .collect();
            for h in hs {
                let (took, sum) = h.join().unwrap();
                assert_eq!(sum, 2.0);
                if overlap {
                    assert!(took < Duration::from_millis(180), "{took:?}");
                } else {
                    assert!(took >= Duration::from_millis(200), "{took:?}");
                }
            }
        }
    }

    /// A rank that fails while its peer's started collective waits for it stops the peer with
    /// its message; a job that panics gives its waiter an error instead of a hang.
    #[test]
    fn a_failed_peer_ends_a_started_collective_with_its_message() {
        let hs: Vec<_> = thread_group(2, Duration::from_secs(60))
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let c = Progress::wrap(Arc::new(c));
                    if c.rank() == 1 {
                        std::thread::sleep(Duration::from_millis(50));
                        c.abort("rank 1 ran out of memory");
                        return Ok(());
                    }
                    let p = start(c.as_ref(), |c| c.all_reduce_sum(&mut [1.0]));
                    p.wait()
                })
            })
            .collect();
        let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let e = results[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("ran out of memory"), "{e}");

        let c = Progress::wrap(Arc::new(crate::parallel::comm::Solo));
        let p = start::<()>(c.as_ref(), |_| panic!("a job that panics"));
        let e = p.wait().unwrap_err().to_string();
        assert!(e.contains("stopped before finishing"), "{e}");
        // The thread goes on with the next job.
        assert_eq!(start(c.as_ref(), |_| Ok(7)).wait().unwrap(), 7);
    }

    /// Dropping the communicator waits until its thread has run the jobs left and let go of the
    /// inner communicator, so the last handle (an MPI communicator's free) goes on the dropping
    /// thread, never on a detached one racing `MPI_Finalize`.
    #[test]
    fn dropping_the_communicator_ends_its_thread_first() {
        let inner: Arc<dyn Communicator> = Arc::new(crate::parallel::comm::Solo);
        let c = Progress::wrap(inner.clone());
        let slow = start(c.as_ref(), |_| {
            std::thread::sleep(Duration::from_millis(200));
            Ok(())
        });
        drop(c);
        assert_eq!(Arc::strong_count(&inner), 1);
        assert!(slow.wait().is_ok(), "the job left ran to its end");
    }
}
