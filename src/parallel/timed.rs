//! Time a rank spends inside its communicators (issue 42's `comm_wait_s`): every call of every
//! group the rank belongs to is timed into one clock, so a step's metrics can say how much of
//! it the rank spent moving data or waiting for the other ranks. With blocking collectives
//! that is time the rank computed nothing; overlapped communication will shrink it.
//!
//! [`Timed`] forwards every call (defaults included, so a communicator's own device paths and
//! point-to-point calls stay its own) and adds its wall time to a shared [`CommClock`]. Two
//! clock reads per call: nothing beside a collective.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Device, Tensor};

use crate::error::Result;
use crate::parallel::comm::Communicator;

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

    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

/// A communicator whose calls are timed into a [`CommClock`].
#[derive(Debug)]
pub struct Timed {
    inner: Arc<dyn Communicator>,
    clock: Arc<CommClock>,
}

impl Timed {
    pub fn wrap(inner: Arc<dyn Communicator>, clock: &Arc<CommClock>) -> Arc<dyn Communicator> {
        Arc::new(Timed {
            inner,
            clock: clock.clone(),
        })
    }
}

impl Communicator for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.clock.time(|| self.inner.all_reduce_sum(buf))
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.clock.time(|| self.inner.all_reduce_sum_f64(buf))
    }
    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.clock.time(|| self.inner.all_gather_into(send, recv))
    }
    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        self.clock.time(|| self.inner.reduce_scatter_sum(buf, out))
    }
    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        self.clock.time(|| self.inner.gather_into(send, recv, root))
    }
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        self.clock.time(|| self.inner.all_to_all(send))
    }
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        self.clock.time(|| self.inner.ring_pass(send))
    }
    fn send(&self, to: usize, buf: &[f32]) -> Result<()> {
        self.clock.time(|| self.inner.send(to, buf))
    }
    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()> {
        self.clock.time(|| self.inner.recv(from, buf))
    }
    fn send_recv(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) -> Result<()> {
        self.clock
            .time(|| self.inner.send_recv(to, send, from, recv))
    }
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        self.clock.time(|| self.inner.broadcast(buf, root))
    }
    fn barrier(&self) -> Result<()> {
        self.clock.time(|| self.inner.barrier())
    }
    fn barrier_unbounded(&self) -> Result<()> {
        self.clock.time(|| self.inner.barrier_unbounded())
    }
    fn abort(&self, why: &str) {
        self.inner.abort(why)
    }
    fn on_device(&self, device: &Device) -> bool {
        self.inner.on_device(device)
    }
    fn all_to_all_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        self.clock.time(|| self.inner.all_to_all_tensors(send))
    }
    fn ring_pass_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        self.clock.time(|| self.inner.ring_pass_tensors(send))
    }
    fn all_reduce_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        self.clock.time(|| self.inner.all_reduce_tensor(t))
    }
    fn reduce_scatter_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        self.clock.time(|| self.inner.reduce_scatter_tensor(t))
    }
    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        self.clock.time(|| self.inner.all_gather_tensor(t))
    }
    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.clock.time(|| self.inner.all_gather(send))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
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
                        Timed::wrap(Arc::new(a), &clock),
                        Timed::wrap(Arc::new(b), &clock),
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
}
