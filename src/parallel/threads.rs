//! Ranks as threads of one process: collectives through shared memory.
//!
//! Every collective is one *exchange*: each rank deposits a list of buffers (one per
//! destination, or one for everybody), waits until all have deposited, and reads what it needs.
//! A round's deposits are released only after every rank has read them, so rounds never mix.
//! Waits poll an abort flag: when a rank fails (`abort`, or its thread ends without finishing)
//! the others return an error naming it instead of waiting forever; a silent rank makes them
//! give up after `timeout`.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::parallel::comm::Communicator;

type Deposit = Arc<Vec<Vec<f32>>>;

#[derive(Debug, Default)]
struct Round {
    /// Deposits of the round being filled, per rank.
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
    /// The completed round's deposits, until every rank has read them.
    ready: Option<Arc<Vec<Deposit>>>,
    readers_left: usize,
    /// Round number of `ready`.
    ready_round: u64,
    /// Rounds started so far.
    round: u64,
    aborted: Option<String>,
}

#[derive(Debug)]
struct Shared {
    n: usize,
    state: Mutex<Round>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank's handle on a thread group.
#[derive(Debug, Clone)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

/// Handles for `n` ranks sharing one group; give one to each thread.
pub fn thread_group(n: usize, timeout: Duration) -> Vec<ThreadComm> {
    let shared = Arc::new(Shared {
        n,
        state: Mutex::new(Round {
            deposits: vec![None; n],
            ..Default::default()
        }),
        cv: Condvar::new(),
        timeout,
    });
    (0..n)
        .map(|rank| ThreadComm {
            rank,
            shared: shared.clone(),
        })
        .collect()
}

impl ThreadComm {
    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock poisons it; the state is still usable.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Deposits `data` and returns every rank's deposit of this round, in rank order.
    fn exchange(&self, data: Vec<Vec<f32>>) -> Result<Arc<Vec<Deposit>>> {
        let sh = &self.shared;
        let start = Instant::now();
        let mut st = self.lock();
        // Wait until the previous round has been read by everybody.
        while st.ready.is_some() {
            st = self.wait(st, start)?;
        }
        let my_round = st.round;
        st.deposits[self.rank] = Some(Arc::new(data));
        st.arrived += 1;
        if st.arrived == sh.n {
            let all: Vec<Deposit> = st
                .deposits
                .iter_mut()
                .map(|d| d.take().expect("deposited"))
                .collect();
            st.ready = Some(Arc::new(all));
            st.ready_round = my_round;
            st.readers_left = sh.n;
            st.arrived = 0;
            st.round += 1;
            sh.cv.notify_all();
        }
        while !(st.ready.is_some() && st.ready_round == my_round) {
            st = self.wait(st, start)?;
        }
        let out = st.ready.clone().expect("checked above");
        st.readers_left -= 1;
        if st.readers_left == 0 {
            st.ready = None;
            sh.cv.notify_all();
        }
        Ok(out)
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, Round>,
        start: Instant,
    ) -> Result<std::sync::MutexGuard<'a, Round>> {
        if let Some(why) = &st.aborted {
            return Err(Error::Invalid(format!(
                "rank {}: stopping: {why}",
                self.rank
            )));
        }
        if start.elapsed() > self.shared.timeout {
            return Err(Error::Invalid(format!(
                "rank {}: no answer from the other ranks after {:?}; one of them is stuck or dead",
                self.rank, self.shared.timeout
            )));
        }
        let (st, _) = self
            .shared
            .cv
            .wait_timeout(st, Duration::from_millis(50))
            .unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.aborted {
            return Err(Error::Invalid(format!(
                "rank {}: stopping: {why}",
                self.rank
            )));
        }
        Ok(st)
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.n
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let all = self.exchange(vec![buf.to_vec()])?;
        // Sum in rank order on every rank, so all ranks get bit-identical results.
        buf.fill(0.0);
        for d in all.iter() {
            for (b, v) in buf.iter_mut().zip(&d[0]) {
                *b += v;
            }
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>> {
        let all = self.exchange(vec![send.to_vec()])?;
        Ok(all.iter().map(|d| d[0].clone()).collect())
    }

    fn reduce_scatter_sum(&self, buf: &[f32], chunk_lens: &[usize]) -> Result<Vec<f32>> {
        let start: usize = chunk_lens[..self.rank].iter().sum();
        let len = chunk_lens[self.rank];
        let all = self.exchange(vec![buf.to_vec()])?;
        let mut out = vec![0.0; len];
        for d in all.iter() {
            for (o, v) in out.iter_mut().zip(&d[0][start..start + len]) {
                *o += v;
            }
        }
        Ok(out)
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        assert_eq!(send.len(), self.shared.n, "all_to_all: one buffer per rank");
        let all = self.exchange(send)?;
        Ok(all.iter().map(|d| d[self.rank].clone()).collect())
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let mine = if self.rank == root {
            buf.clone()
        } else {
            Vec::new()
        };
        let all = self.exchange(vec![mine])?;
        *buf = all[root][0].clone();
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Vec::new()).map(|_| ())
    }

    fn abort(&self, why: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!("rank {} failed: {why}", self.rank));
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send + 'static>(
        n: usize,
        f: impl Fn(ThreadComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let hs: Vec<_> = thread_group(n, Duration::from_secs(10))
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_match_their_definitions() {
        let out = run(3, |c| {
            let r = c.rank() as f32;
            let mut s = vec![r, 10.0 * r];
            c.all_reduce_sum(&mut s).unwrap();
            let g = c.all_gather(&[r]).unwrap();
            let rs = c
                .reduce_scatter_sum(&[1.0, 2.0, 3.0, 4.0], &[1, 1, 2])
                .unwrap();
            let a2a = c
                .all_to_all((0..3).map(|j| vec![r * 10.0 + j as f32]).collect())
                .unwrap();
            let mut b = if c.rank() == 2 {
                vec![7.0, 8.0]
            } else {
                vec![]
            };
            c.broadcast(&mut b, 2).unwrap();
            c.barrier().unwrap();
            (s, g, rs, a2a, b)
        });
        for (rank, (s, g, rs, a2a, b)) in out.into_iter().enumerate() {
            assert_eq!(s, vec![3.0, 30.0]);
            assert_eq!(g, vec![vec![0.0], vec![1.0], vec![2.0]]);
            let expect_rs = [vec![3.0], vec![6.0], vec![9.0, 12.0]];
            assert_eq!(rs, expect_rs[rank]);
            let expect_a2a: Vec<Vec<f32>> = (0..3)
                .map(|src| vec![src as f32 * 10.0 + rank as f32])
                .collect();
            assert_eq!(a2a, expect_a2a);
            assert_eq!(b, vec![7.0, 8.0]);
        }
    }

    #[test]
    fn a_failed_rank_stops_the_others() {
        let out = run(3, |c| {
            if c.rank() == 1 {
                c.abort("disk full");
                return Err(Error::Invalid("disk full".into()));
            }
            c.barrier()?;
            c.barrier()
        });
        for (rank, r) in out.iter().enumerate() {
            let e = r.as_ref().unwrap_err().to_string();
            if rank != 1 {
                assert!(e.contains("rank 1 failed: disk full"), "{e}");
            }
        }
    }
}
