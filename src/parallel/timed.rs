//! Time a rank spends inside its communicators (issue 42's `comm_wait_s`), and the bytes it
//! sends through them (`comm_bytes`): every call of every group the rank belongs to is timed
//! into one clock, so a step's metrics can say how much of it the rank spent moving data or
//! waiting for the other ranks. With blocking collectives that is time the rank computed
//! nothing; overlapped communication shrinks it.
//!
//! A [`Hooked`](crate::parallel::hooked::Hooked) communicator with a shared [`CommClock`] as
//! its hook adds each call's wall time to the clock. Two clock reads per call: nothing beside
//! a collective.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::parallel::comm::WaitHook;
use crate::parallel::hooked::Hook;

/// Nanoseconds spent in communicator calls, summed over every group of one rank.
#[derive(Debug, Default)]
pub struct CommClock {
    nanos: AtomicU64,
}

impl CommClock {
    /// Seconds counted so far.
    pub fn seconds(&self) -> f64 {
        self.nanos.load(Ordering::Relaxed) as f64 * 1e-9
    }
}

/// Wrapped in a [`Hooked`](crate::parallel::hooked::Hooked) communicator, a clock times each
/// call into itself.
impl Hook for Arc<CommClock> {
    fn around<T>(&self, _size: usize, _bytes: usize, call: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = call();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
    /// A started collective counts only while the rank waits for it.
    fn wait_hook(&self) -> Option<Arc<dyn WaitHook>> {
        Some(self.clone())
    }
}

impl WaitHook for CommClock {
    fn around_wait(&self, wait: &mut dyn FnMut()) {
        let t = Instant::now();
        wait();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Bytes that leave a rank in its communicators' calls (`comm_bytes`: what quantized
/// collectives shrink; ring algorithms assumed, `hooked::Wire`), summed over every group. It sits beneath the communication threads, so collectives started
/// to overlap count as well as blocking ones. One atomic add per call.
#[derive(Debug, Default)]
pub struct ByteCount {
    bytes: AtomicU64,
}

impl ByteCount {
    /// Bytes counted so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

impl Hook for Arc<ByteCount> {
    fn around<T>(&self, _size: usize, _bytes: usize, call: impl FnOnce() -> T) -> T {
        call()
    }
    fn moved(&self, wire_bytes: usize) {
        self.bytes.fetch_add(wire_bytes as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::parallel::hooked::Hooked;
    use crate::parallel::threads::thread_group;

    /// A rank that waits for a late peer counts the wait; results pass through unchanged; the
    /// one clock sums every group it is shared by.
    #[test]
    fn a_wait_for_a_late_rank_is_counted() {
        let clocks: Vec<Arc<CommClock>> = (0..2).map(|_| Arc::default()).collect();
        let handles: Vec<_> = thread_group(2, Duration::from_secs(10))
            .into_iter()
            .zip(thread_group(2, Duration::from_secs(10)))
            .zip(clocks.clone())
            .map(|((a, b), clock)| {
                std::thread::spawn(move || {
                    let (a, b) = (
                        Hooked::wrap(Arc::new(a), clock.clone()),
                        Hooked::wrap(Arc::new(b), clock.clone()),
                    );
                    if a.rank() == 1 {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    let mut x = [a.rank() as f32 + 1.0];
                    a.all_reduce_sum(&mut x).unwrap();
                    let mut y = [2.0f64];
                    b.all_reduce_sum_f64(&mut y).unwrap();
                    (x[0], y[0])
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), (3.0, 4.0));
        }
        let (early, late) = (clocks[0].seconds(), clocks[1].seconds());
        assert!(early >= 0.25, "rank 0 waited ~0.3 s for rank 1: {early}");
        assert!(late < 0.2, "rank 1 found rank 0 waiting: {late}");
    }

    /// Bytes sent, by the ring algorithms' textbook counts on 4 ranks: an all-reduce of 1,000
    /// floats sends 2·3/4 of its 4,000 bytes, an all-gather of 100 floats 3 × 400, an
    /// all-to-all of four 10-float pieces the 3 × 40 for the others, a reduce-scatter of 400
    /// floats 3/4 of 1,600; a broadcast of 50 floats costs the root 200 and the others
    /// nothing. A group of one sends nothing.
    #[test]
    fn bytes_sent_follow_the_ring_counts() {
        let counts: Vec<Arc<ByteCount>> = (0..4).map(|_| Arc::default()).collect();
        let handles: Vec<_> = thread_group(4, Duration::from_secs(10))
            .into_iter()
            .zip(counts.clone())
            .map(|(c, count)| {
                std::thread::spawn(move || {
                    let c = Hooked::wrap(Arc::new(c), count);
                    c.all_reduce_sum(&mut [1.0; 1000]).unwrap();
                    c.all_gather_into(&[1.0; 100], &mut [0.0; 400]).unwrap();
                    c.all_to_all(vec![vec![1.0; 10]; 4]).unwrap();
                    c.reduce_scatter_sum(&[1.0; 400], &mut [0.0; 100]).unwrap();
                    c.broadcast(&mut vec![1.0; 50], 0).unwrap();
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let got: Vec<u64> = counts.iter().map(|c| c.bytes()).collect();
        let common = 6000 + 1200 + 120 + 1200;
        assert_eq!(got, vec![common + 200, common, common, common]);
        let one = Arc::new(ByteCount::default());
        let solo = Hooked::wrap(Arc::new(crate::parallel::Solo), one.clone());
        solo.all_reduce_sum(&mut [1.0; 8]).unwrap();
        solo.broadcast(&mut vec![1.0; 8], 0).unwrap();
        assert_eq!(one.bytes(), 0);
    }
}
