//! Ranks as threads of one process: collectives through shared memory.
//!
//! Every collective is one *exchange*: each rank deposits a list of buffers (one per
//! destination, or one for everybody), waits until all have deposited, and reads what it needs.
//! A round's deposits are released only after every rank has read them, so rounds never mix.
//! Waits poll an abort flag: when a rank fails (`abort`, or its thread ends without finishing)
//! the others return an error naming it instead of waiting forever; a silent rank makes them
//! give up after `timeout` (except in [`Communicator::barrier_unbounded`], which marks a phase
//! known to be long, such as rank 0 writing a checkpoint).
//!
//! Every collective checks the contract MPI and NCCL impose (equal counts on every rank), so a
//! layout that would truncate or misalign data under mpirun fails here too, with a message.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::parallel::comm::{check_blocks, check_peer, Communicator};

/// What a rank puts into one round: f32 buffers and, for f64 reductions, f64 ones.
#[derive(Debug, Default)]
struct Payload {
    f32s: Vec<Vec<f32>>,
    f64s: Vec<f64>,
}

type Deposit = Arc<Payload>;

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
    /// Point-to-point messages sent and not yet received, per (from, to), in order.
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
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

/// Time spent waiting while the process ran. Waits poll every 50 ms; a gap between two polls
/// much longer than that means the process was stopped (Ctrl-Z, a Slurm suspend, SIGSTOP), and
/// such a gap counts as one poll interval only, so a suspended job does not time out on resume.
struct RunningClock {
    last: Instant,
    counted: Duration,
    limit: Option<Duration>,
}

/// The longest gap between two polls that counts in full.
const MAX_COUNTED_GAP: Duration = Duration::from_secs(1);

impl RunningClock {
    fn new(limit: Option<Duration>) -> Self {
        Self {
            last: Instant::now(),
            counted: Duration::ZERO,
            limit,
        }
    }

    /// The limit, when the running time since the start has passed it.
    fn expired(&mut self) -> Option<Duration> {
        let now = Instant::now();
        self.counted += (now - self.last).min(MAX_COUNTED_GAP);
        self.last = now;
        self.limit.filter(|&l| self.counted > l)
    }
}

impl ThreadComm {
    fn lock(&self) -> std::sync::MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock poisons it; the state is still usable.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next message from rank `from` to this one, which must hold `len` elements.
    fn take_mail(&self, op: &str, from: usize, len: usize) -> Result<Vec<f32>> {
        let mut clock = RunningClock::new(Some(self.shared.timeout));
        let mut st = self.lock();
        loop {
            if let Some(msg) = st
                .mail
                .get_mut(&(from, self.rank))
                .and_then(VecDeque::pop_front)
            {
                if msg.len() != len {
                    return Err(Error::Invalid(format!(
                        "{op}: rank {} expected {len} elements from rank {from}, which sent {}",
                        self.rank,
                        msg.len()
                    )));
                }
                return Ok(msg);
            }
            st = self.wait(st, &mut clock)?;
        }
    }

    /// Deposits `data` and returns every rank's deposit of this round, in rank order.
    fn exchange(&self, data: Vec<Vec<f32>>) -> Result<Arc<Vec<Deposit>>> {
        self.exchange_payload(
            Payload {
                f32s: data,
                f64s: Vec::new(),
            },
            Some(self.shared.timeout),
        )
    }

    /// [`Self::exchange`] of any payload; `timeout: None` waits until every rank arrives or one
    /// aborts.
    fn exchange_payload(
        &self,
        data: Payload,
        timeout: Option<Duration>,
    ) -> Result<Arc<Vec<Deposit>>> {
        let sh = &self.shared;
        let mut start = RunningClock::new(timeout);
        let mut st = self.lock();
        // Wait until the previous round has been read by everybody.
        while st.ready.is_some() {
            st = self.wait(st, &mut start)?;
        }
        let my_round = st.round;
        st.deposits[self.rank] = Some(Arc::new(data));
        st.arrived += 1;
        if st.arrived == sh.n {
            let all: Option<Vec<Deposit>> = st.deposits.iter_mut().map(Option::take).collect();
            let Some(all) = all else {
                // Every rank withdraws what a failed wait left, so this means a rank counted
                // twice: stop the group rather than mix rounds.
                return Err(Error::Invalid(format!(
                    "rank {}: a collective round lost count of its ranks",
                    self.rank
                )));
            };
            st.ready = Some(Arc::new(all));
            st.ready_round = my_round;
            st.readers_left = sh.n;
            st.arrived = 0;
            st.round += 1;
            sh.cv.notify_all();
        }
        while !(st.ready.is_some() && st.ready_round == my_round) {
            st = match self.wait(st, &mut start) {
                Ok(st) => st,
                Err(e) => {
                    self.withdraw(my_round);
                    return Err(e);
                }
            };
        }
        let out = st.ready.clone().expect("checked above");
        st.readers_left -= 1;
        if st.readers_left == 0 {
            st.ready = None;
            sh.cv.notify_all();
        }
        Ok(out)
    }

    /// Takes back this rank's part in round `round` after its wait failed (a timeout, or
    /// another rank's abort): its deposit, if the round is still filling, or its read, if the
    /// round completed meanwhile. A later collective of this rank (the error path may still
    /// call one) then starts a round of its own instead of being counted twice in this one.
    fn withdraw(&self, round: u64) {
        let mut st = self.lock();
        if st.round == round {
            if st.deposits[self.rank].take().is_some() {
                st.arrived -= 1;
            }
        } else if st.ready.is_some() && st.ready_round == round {
            st.readers_left -= 1;
            if st.readers_left == 0 {
                st.ready = None;
            }
        }
        self.shared.cv.notify_all();
    }

    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, Round>,
        clock: &mut RunningClock,
    ) -> Result<std::sync::MutexGuard<'a, Round>> {
        if let Some(why) = &st.aborted {
            return Err(Error::Invalid(format!(
                "rank {}: stopping: {why}",
                self.rank
            )));
        }
        if let Some(limit) = clock.expired() {
            return Err(Error::Invalid(format!(
                "rank {}: no answer from the other ranks after {limit:?}; one of them is stuck or \
                 dead (raise `rank_timeout_s` if a phase legitimately takes longer)",
                self.rank
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

/// The first rank whose length differs from rank 0's, as a contract error for `op`.
fn equal_lengths(op: &str, lens: impl Iterator<Item = usize>) -> Result<usize> {
    let lens: Vec<usize> = lens.collect();
    match lens.iter().position(|&n| n != lens[0]) {
        None => Ok(lens[0]),
        Some(j) => Err(Error::Invalid(format!(
            "{op}: rank {j} passed {} elements, rank 0 passed {}; MPI and NCCL need equal \
             counts on every rank",
            lens[j], lens[0]
        ))),
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
        equal_lengths("all_reduce", all.iter().map(|d| d.f32s[0].len()))?;
        // Sum in rank order on every rank, so all ranks get bit-identical results.
        buf.fill(0.0);
        for d in all.iter() {
            for (b, v) in buf.iter_mut().zip(&d.f32s[0]) {
                *b += v;
            }
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        let all = self.exchange_payload(
            Payload {
                f32s: Vec::new(),
                f64s: buf.to_vec(),
            },
            Some(self.shared.timeout),
        )?;
        equal_lengths("all_reduce (f64)", all.iter().map(|d| d.f64s.len()))?;
        buf.fill(0.0);
        for d in all.iter() {
            for (b, v) in buf.iter_mut().zip(&d.f64s) {
                *b += v;
            }
        }
        Ok(())
    }

    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let all = self.exchange(vec![send.to_vec()])?;
        let n = equal_lengths("all_gather", all.iter().map(|d| d.f32s[0].len()))?;
        check_blocks("all_gather", recv.len(), n, self.shared.n)?;
        for (j, d) in all.iter().enumerate() {
            recv[j * n..(j + 1) * n].copy_from_slice(&d.f32s[0]);
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        let all = self.exchange(vec![buf.to_vec()])?;
        let total = equal_lengths("reduce_scatter", all.iter().map(|d| d.f32s[0].len()))?;
        check_blocks("reduce_scatter", total, out.len(), self.shared.n)?;
        let start = self.rank * out.len();
        out.fill(0.0);
        for d in all.iter() {
            for (o, v) in out.iter_mut().zip(&d.f32s[0][start..]) {
                *o += v;
            }
        }
        Ok(())
    }

    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        let all = self.exchange(vec![send.to_vec()])?;
        let n = equal_lengths("gather", all.iter().map(|d| d.f32s[0].len()))?;
        if self.rank == root {
            let recv =
                recv.ok_or_else(|| Error::Invalid("gather: the root has no buffer".into()))?;
            check_blocks("gather", recv.len(), n, self.shared.n)?;
            for (j, d) in all.iter().enumerate() {
                recv[j * n..(j + 1) * n].copy_from_slice(&d.f32s[0]);
            }
        }
        Ok(())
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        if send.len() != self.shared.n {
            return Err(Error::Invalid(format!(
                "all_to_all: {} buffers for {} ranks",
                send.len(),
                self.shared.n
            )));
        }
        let all = self.exchange(send)?;
        equal_lengths(
            "all_to_all",
            all.iter().flat_map(|d| d.f32s.iter().map(Vec::len)),
        )?;
        Ok(all.iter().map(|d| d.f32s[self.rank].clone()).collect())
    }

    /// A neighbour exchange, as MPI's `sendrecv`: the block goes to the next rank's mailbox
    /// and the previous rank's is taken from this one's, so a pass waits for the previous
    /// rank only, not for the whole group (a group-wide round would make every ring step a
    /// barrier, which no real ring pays).
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        let n = self.shared.n;
        self.send((self.rank + 1) % n, send)?;
        self.take_mail("ring_pass", (self.rank + n - 1) % n, send.len())
    }

    fn ring_pass_both(&self, fwd: &[f32], back: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = self.shared.n;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        self.send(next, fwd)?;
        self.send(prev, back)?;
        let from_prev = self.take_mail("ring_pass_both", prev, fwd.len())?;
        Ok((
            from_prev,
            self.take_mail("ring_pass_both", next, back.len())?,
        ))
    }

    fn send(&self, to: usize, buf: &[f32]) -> Result<()> {
        check_peer("send", to, self.shared.n)?;
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(Error::Invalid(format!(
                "rank {}: stopping: {why}",
                self.rank
            )));
        }
        st.mail
            .entry((self.rank, to))
            .or_default()
            .push_back(buf.to_vec());
        self.shared.cv.notify_all();
        Ok(())
    }

    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()> {
        check_peer("recv", from, self.shared.n)?;
        buf.copy_from_slice(&self.take_mail("recv", from, buf.len())?);
        Ok(())
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let mine = if self.rank == root {
            buf.clone()
        } else {
            Vec::new()
        };
        let all = self.exchange(vec![mine])?;
        *buf = all[root].f32s[0].clone();
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(Vec::new()).map(|_| ())
    }

    fn barrier_unbounded(&self) -> Result<()> {
        self.exchange_payload(Payload::default(), None).map(|_| ())
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
mod tests;
