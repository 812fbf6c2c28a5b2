//! The messages between pipeline stages, matched by what they are rather than by arrival.
//!
//! Stage `s` sends its neighbours two kinds of message: a chunk's output activation (to the
//! stage of the next chunk) and the gradient of a chunk's input (to the stage of the previous
//! one). Under interleaving two stages exchange both kinds in both directions, and both have
//! the same length, so a receiver that took "the next message from stage s" could take a
//! gradient for an activation and compute a silently wrong step. Communicators have no tags
//! (NCCL has none either), but a schedule is data: every stage knows in which order every
//! other stage sends. A [`Mailroom`] therefore knows which message comes next from each peer;
//! to take one it receives the peer's messages in that order, keeping the ones it will need
//! later, until the wanted one arrives.

use std::collections::{HashMap, VecDeque};

use crate::error::{Error, Result};
use crate::parallel::comm::Communicator;
use crate::parallel::pipeline::schedule::{Op, Pass, Schedule};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Msg {
    /// `chunk`'s input activation for `micro` (sent by the forward of chunk − 1).
    Activation { micro: usize, chunk: usize },
    /// The gradient of `chunk`'s output for `micro` (sent by the backward of chunk + 1).
    Gradient { micro: usize, chunk: usize },
}

impl Msg {
    pub fn micro(self) -> usize {
        match self {
            Msg::Activation { micro, .. } | Msg::Gradient { micro, .. } => micro,
        }
    }

    /// The message `op` sends and the stage it goes to, if any. The input gradient leaves with
    /// B (in schedules that do not split the backward, B is the whole backward); W sends
    /// nothing.
    pub fn sent_by(op: Op, schedule: &Schedule) -> Option<(usize, Msg)> {
        let (p, last) = (schedule.stages, schedule.chunks() - 1);
        let (micro, c) = (op.micro, op.chunk);
        match op.pass {
            Pass::F if c < last => Some((
                (c + 1) % p,
                Msg::Activation {
                    micro,
                    chunk: c + 1,
                },
            )),
            Pass::B if c > 0 => Some((
                (c - 1) % p,
                Msg::Gradient {
                    micro,
                    chunk: c - 1,
                },
            )),
            _ => None,
        }
    }

    /// The stage that sends this message.
    pub fn sender(self, schedule: &Schedule) -> usize {
        match self {
            Msg::Activation { chunk, .. } => (chunk - 1) % schedule.stages,
            Msg::Gradient { chunk, .. } => (chunk + 1) % schedule.stages,
        }
    }
}

#[derive(Debug)]
pub struct Mailroom<'a> {
    comm: &'a dyn Communicator,
    me: usize,
    /// Per peer stage, the messages it sends here that have not arrived yet, in its order.
    expected: Vec<VecDeque<Msg>>,
    /// Messages that arrived (or that this stage sent itself) and wait to be taken.
    stash: HashMap<Msg, Vec<f32>>,
}

impl<'a> Mailroom<'a> {
    /// The mailroom of stage `comm.rank()` for one run of `schedule` (`comm` is the pipeline
    /// group: member `s` runs stage `s`).
    pub fn new(comm: &'a dyn Communicator, schedule: &Schedule) -> Result<Self> {
        if comm.size() != schedule.stages {
            return Err(Error::Invalid(format!(
                "a pipeline of {} stages on a group of {} ranks",
                schedule.stages,
                comm.size()
            )));
        }
        let me = comm.rank();
        let mut expected = vec![VecDeque::new(); schedule.stages];
        for (s, ops) in schedule.ops.iter().enumerate() {
            if s == me {
                continue;
            }
            for &op in ops {
                if let Some((to, msg)) = Msg::sent_by(op, schedule) {
                    if to == me {
                        expected[s].push_back(msg);
                    }
                }
            }
        }
        Ok(Self {
            comm,
            me,
            expected,
            stash: HashMap::new(),
        })
    }

    /// Sends `msg` to stage `to` (kept here when `to` is this stage: with one stage and
    /// several virtual chunks, a chunk's neighbour can live on the same rank).
    pub fn post(&mut self, to: usize, msg: Msg, data: Vec<f32>) -> Result<()> {
        if to == self.me {
            self.stash.insert(msg, data);
            return Ok(());
        }
        self.comm.send(to, &data)
    }

    /// Message `msg` from stage `from`, receiving that stage's earlier messages on the way
    /// (kept for later). `len` gives each message's length in elements.
    pub fn take(&mut self, msg: Msg, from: usize, len: impl Fn(Msg) -> usize) -> Result<Vec<f32>> {
        if let Some(data) = self.stash.remove(&msg) {
            return Ok(data);
        }
        loop {
            let next = self.expected[from].pop_front().ok_or_else(|| {
                Error::Invalid(format!(
                    "pipeline stage {}: waiting for {msg:?} from stage {from}, which the schedule \
                     never sends here",
                    self.me
                ))
            })?;
            let mut buf = vec![0.0; len(next)];
            self.comm.recv(from, &mut buf)?;
            if next == msg {
                return Ok(buf);
            }
            self.stash.insert(next, buf);
        }
    }

    /// Whether every message the schedule sends here was taken (checked after a step: a
    /// message left over means the engine and the schedule disagree).
    pub fn is_done(&self) -> bool {
        self.stash.is_empty() && self.expected.iter().all(VecDeque::is_empty)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::parallel::pipeline::schedule::ScheduleKind;
    use crate::parallel::threads::thread_group;

    /// Under interleaving, stages exchange activations and gradients of equal length in both
    /// directions; each pass takes the message it names.
    #[test]
    fn interleaved_exchanges_deliver_each_message_to_its_pass() {
        let sched = Schedule::build(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
        let group = thread_group(2, Duration::from_secs(20));
        let code = |m: Msg| -> f32 {
            match m {
                Msg::Activation { micro, chunk } => (micro * 10 + chunk) as f32,
                Msg::Gradient { micro, chunk } => -((micro * 10 + chunk) as f32) - 1.0,
            }
        };
        let hs: Vec<_> = group
            .into_iter()
            .map(|c| {
                let sched = sched.clone();
                std::thread::spawn(move || {
                    let mut room = Mailroom::new(&c, &sched).unwrap();
                    let me = c.rank();
                    for &op in &sched.ops[me] {
                        // Take what the op needs, then send what it produces.
                        let need = match op.pass {
                            Pass::F if op.chunk > 0 => Some(Msg::Activation {
                                micro: op.micro,
                                chunk: op.chunk,
                            }),
                            Pass::B if op.chunk + 1 < sched.chunks() => Some(Msg::Gradient {
                                micro: op.micro,
                                chunk: op.chunk,
                            }),
                            _ => None,
                        };
                        if let Some(m) = need {
                            let got = room.take(m, m.sender(&sched), |_| 3).unwrap();
                            assert_eq!(got, vec![code(m); 3], "stage {me} took {m:?}");
                        }
                        if let Some((to, m)) = Msg::sent_by(op, &sched) {
                            room.post(to, m, vec![code(m); 3]).unwrap();
                        }
                    }
                    assert!(room.is_done());
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }

    /// A receiver that takes in another order than its peer sends keeps the early arrivals.
    #[test]
    fn messages_taken_out_of_order_are_kept_until_taken() {
        let op = |pass, micro, chunk| Op { pass, micro, chunk };
        let mut sched = Schedule::build(ScheduleKind::GPipe, 2, 3, 1).unwrap();
        // Stage 1 runs its forwards in reverse micro-batch order.
        sched.ops[1] = [2, 1, 0]
            .map(|m| op(Pass::F, m, 1))
            .into_iter()
            .chain((0..3).map(|m| op(Pass::B, m, 1)))
            .collect();
        let group = thread_group(2, Duration::from_secs(20));
        let mut sender = Mailroom::new(&group[0], &sched).unwrap();
        for micro in 0..3 {
            sender
                .post(1, Msg::Activation { micro, chunk: 1 }, vec![micro as f32])
                .unwrap();
        }
        let mut room = Mailroom::new(&group[1], &sched).unwrap();
        for micro in [2, 1, 0] {
            let got = room
                .take(Msg::Activation { micro, chunk: 1 }, 0, |_| 1)
                .unwrap();
            assert_eq!(got, vec![micro as f32]);
        }
        assert!(room.is_done());
    }

    #[test]
    fn a_message_the_schedule_never_sends_is_an_error() {
        let sched = Schedule::build(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
        let group = thread_group(2, Duration::from_secs(5));
        // Stage 0 sends its two activations; stage 1 receives both looking for a third.
        let mut sender = Mailroom::new(&group[0], &sched).unwrap();
        for micro in 0..2 {
            let m = Msg::Activation { micro, chunk: 1 };
            sender.post(1, m, vec![0.0]).unwrap();
        }
        let mut room = Mailroom::new(&group[1], &sched).unwrap();
        let err = room
            .take(Msg::Activation { micro: 7, chunk: 1 }, 0, |_| 1)
            .unwrap_err();
        assert!(err.to_string().contains("never sends here"), "{err}");
        assert!(Mailroom::new(
            &group[0],
            &Schedule::build(ScheduleKind::GPipe, 3, 3, 1).unwrap()
        )
        .is_err());
    }
}
