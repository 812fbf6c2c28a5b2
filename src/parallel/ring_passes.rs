//! The K/V blocks of the CP ring's forward, both ways round the ring (issue 42).
//!
//! A rank of a ring of n needs every other rank's block. Passed one way, the block of the rank
//! d behind arrives after d hops, each a message's latency: three in a row at n = 4, longer
//! behind a 20 ms link than the attention and MLP a rank of 512 tokens computes meanwhile.
//! Here each exchange sends one block forward and one back
//! ([`Communicator::ring_pass_both_tensors`]), so the blocks of the ranks d behind and d ahead
//! both arrive after d exchanges, and all of them after ⌈(n − 1)/2⌉ (two at n = 4).
//!
//! The exchanges run on the group's communication thread one after the other, each handing
//! on what the one before it brought as soon as it arrives, whatever the rank's compute is
//! doing. At most [`IN_FLIGHT`] exchanges are under way ahead of the blocks handed out (up to
//! n = 5 that is all of them; beyond, the next starts when a block is taken), which bounds the
//! blocks alive.
//!
//! The order the blocks come in is [`block_order`]: this rank's, then the rank behind, the
//! rank ahead, two behind, two ahead, … Without a communication thread the exchanges run
//! where they are started, in the same order: the same blocks, the same numbers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;

use burn::tensor::Tensor;

use crate::error::Error;
use crate::parallel::comm::Communicator;
use crate::parallel::progress::{start, Pending};

/// Exchanges under way ahead of the blocks handed out: at most six K/V blocks alive at once
/// (four travelling, one arrived and waiting, one being scored), where a one-way ring holds
/// two.
const IN_FLIGHT: usize = 2;

/// A block and the one going the other way (none once only one way is left).
type Both = (Vec<Tensor<4>>, Option<Vec<Tensor<4>>>);

/// The ranks whose blocks rank `c` of `n` scores, in the order they arrive.
pub fn block_order(c: usize, n: usize) -> Vec<usize> {
    let mut order = vec![c];
    for d in 1..=n / 2 {
        order.push((c + n - d) % n);
        if n - d != d {
            order.push((c + d) % n);
        }
    }
    order
}

/// What an exchange sends: this rank's own block both ways, or what the exchange before it
/// brought.
enum Input {
    Own(Vec<Tensor<4>>),
    After(Receiver<Both>),
}

/// The forward's blocks as they arrive.
pub struct BlockPasses {
    comm: Arc<dyn Communicator>,
    sent: Arc<AtomicU64>,
    /// Exchanges in all: ⌈(n − 1)/2⌉.
    total: usize,
    /// Exchanges started.
    started: usize,
    /// Elements of one block.
    elements: u64,
    /// What the next exchange sends: this rank's block, then where the last started exchange
    /// hands on what it receives.
    input: Option<Input>,
    in_flight: VecDeque<Pending<Both>>,
    /// The ranks whose blocks are still to be handed out, in [`block_order`].
    sources: VecDeque<usize>,
    /// Arrived blocks not yet handed out, in [`block_order`].
    arrived: VecDeque<Vec<Tensor<4>>>,
}

impl BlockPasses {
    /// Starts passing this rank's block `own` (its k and v) both ways; `sent` counts the
    /// elements this rank sends.
    pub fn start(comm: Arc<dyn Communicator>, sent: Arc<AtomicU64>, own: Vec<Tensor<4>>) -> Self {
        let (c, n) = (comm.rank(), comm.size());
        let elements = own.iter().map(|t| t.shape().num_elements() as u64).sum();
        let mut p = Self {
            comm,
            sent,
            total: n / 2,
            started: 0,
            elements,
            input: Some(Input::Own(own)),
            in_flight: VecDeque::new(),
            sources: block_order(c, n).into_iter().skip(1).collect(),
            arrived: VecDeque::new(),
        };
        p.fill();
        p
    }

    /// Whether blocks are still to come.
    pub fn pending(&self) -> bool {
        !self.arrived.is_empty() || !self.in_flight.is_empty()
    }

    /// The next block in [`block_order`] after this rank's own, with the rank it is from,
    /// waiting for it where it has not arrived; `None` once all have been handed out. A failed
    /// exchange ends the rank (the op cannot return an error), whose peers then stop with its
    /// message.
    pub fn next_block(&mut self) -> Option<(usize, Vec<Tensor<4>>)> {
        if self.arrived.is_empty() {
            let (fwd, back) = self
                .in_flight
                .pop_front()?
                .wait()
                .unwrap_or_else(|e| panic!("context-parallel ring pass failed: {e}"));
            self.arrived.push_back(fwd);
            self.arrived.extend(back);
            self.fill();
        }
        let block = self.arrived.pop_front()?;
        let src = self.sources.pop_front().expect("one source per block");
        Some((src, block))
    }

    /// Starts exchanges until [`IN_FLIGHT`] are under way or none is left. Exchange j (from 1)
    /// brings the blocks of the ranks j behind and j ahead; the last one of an even ring
    /// brings the rank opposite once, one way.
    fn fill(&mut self) {
        let n = self.comm.size();
        while self.in_flight.len() < IN_FLIGHT && self.started < self.total {
            let j = self.started + 1;
            let both = 2 * j < n;
            let input = self
                .input
                .take()
                .expect("each exchange leaves a chain for the next");
            let count = self.elements * if both { 2 } else { 1 };
            self.sent.fetch_add(count, Ordering::Relaxed);
            let (tx, rx) = channel();
            let pending = start(self.comm.as_ref(), move |c| {
                let (fwd, back) = match input {
                    Input::Own(own) => (own.clone(), Some(own)),
                    Input::After(before) => before.recv().map_err(|_| {
                        Error::Invalid(
                            "context-parallel ring: the exchange before this one failed, so \
                             it has no block to pass on"
                                .into(),
                        )
                    })?,
                };
                let got = c.ring_pass_both_tensors(fwd, back.filter(|_| both))?;
                // Tensors are shared handles: the chain and the result hold the same blocks.
                let _ = tx.send(got.clone());
                Ok(got)
            });
            self.in_flight.push_back(pending);
            self.input = Some(Input::After(rx));
            self.started += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's block exactly once, this rank's first, then by distance, behind first.
    #[test]
    fn the_order_holds_every_block_once_by_distance() {
        assert_eq!(block_order(0, 1), vec![0]);
        assert_eq!(block_order(1, 2), vec![1, 0]);
        assert_eq!(block_order(0, 3), vec![0, 2, 1]);
        assert_eq!(block_order(1, 4), vec![1, 0, 2, 3]);
        assert_eq!(block_order(4, 5), vec![4, 3, 0, 2, 1]);
        for n in 1..9 {
            for c in 0..n {
                let mut o = block_order(c, n);
                let dist: Vec<usize> = o
                    .iter()
                    .map(|&r| ((r + n - c) % n).min((c + n - r) % n))
                    .collect();
                assert!(dist.windows(2).all(|w| w[0] <= w[1]), "{c}/{n}: {dist:?}");
                o.sort();
                assert_eq!(o, (0..n).collect::<Vec<_>>(), "{c} of {n}");
            }
        }
    }
}
