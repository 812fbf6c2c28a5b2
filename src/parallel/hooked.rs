//! One forwarding communicator for the wrappers that do something around every call: timing
//! it (`timed.rs`) or holding it back as a slow link would (`netsim.rs`). [`Hooked`] forwards
//! each method of [`Communicator`] — its defaults included, so a communicator's own device
//! paths and point-to-point calls stay its own — through its [`Hook`], which sees how many
//! elements the rank hands over.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};

use crate::error::Result;
use crate::parallel::comm::{Communicator, Job, WaitHook};

/// What a wrapper does around each call.
pub trait Hook: Send + Sync + std::fmt::Debug {
    /// Runs `call` in a group of `size` ranks to which this rank hands `bytes` bytes (its send
    /// buffer; for a receive, the buffer it fills).
    fn around<T>(&self, size: usize, bytes: usize, call: impl FnOnce() -> T) -> T;
    /// Told, before each call, the bytes that leave this rank over the wire in it under the
    /// usual algorithms ([`Wire`]; what `comm_bytes` counts).
    fn moved(&self, _wire_bytes: usize) {}
    /// Takes a started job ([`crate::parallel::progress`]) for a thread of its own, or gives
    /// it back to go further in.
    fn submit(&self, job: Job) -> std::result::Result<Vec<Arc<dyn WaitHook>>, Job> {
        Err(job)
    }
    /// What goes around the wait for a job started beneath this wrapper.
    fn wait_hook(&self) -> Option<Arc<dyn WaitHook>> {
        None
    }
    /// Whether [`Hook::submit`] takes jobs for a thread of its own.
    fn has_thread(&self) -> bool {
        false
    }
}

/// `inner` with `hook` around each call.
#[derive(Debug)]
pub struct Hooked<H> {
    inner: Arc<dyn Communicator>,
    hook: H,
}

impl<H: Hook + 'static> Hooked<H> {
    pub fn wrap(inner: Arc<dyn Communicator>, hook: H) -> Arc<dyn Communicator> {
        Arc::new(Hooked { inner, hook })
    }

    /// `call` with the hook around it, for `elements` of `bytes_each` bytes handed over, of
    /// which `wire` says what leaves the rank.
    fn with<T>(
        &self,
        wire: Wire,
        elements: usize,
        bytes_each: usize,
        call: impl FnOnce() -> T,
    ) -> T {
        let (n, bytes) = (self.inner.size(), elements * bytes_each);
        self.hook.moved(wire.bytes(bytes, n, self.inner.rank()));
        self.hook.around(n, bytes, call)
    }
}

/// How many of the bytes a rank hands to a call leave it, with the ring algorithms MPI and
/// NCCL use for large messages (`n` ranks, `b` bytes handed over): all-reduce 2(n−1)/n·b,
/// reduce-scatter (n−1)/n·b, all-gather (n−1)·b; an all-to-all sends all but its own piece;
/// a rooted call moves the root's (broadcast) or the others' (gather) buffer once.
#[derive(Debug, Clone, Copy)]
enum Wire {
    AllReduce,
    ReduceScatter,
    AllGather,
    /// Bytes of the piece the rank keeps for itself.
    AllToAll(usize),
    /// Sent once (point to point, a ring pass).
    Once,
    /// Sent by the root only / by all but the root.
    FromRoot(usize),
    ToRoot(usize),
    Nothing,
}

impl Wire {
    fn bytes(self, b: usize, n: usize, rank: usize) -> usize {
        if n <= 1 {
            return 0; // a group of one sends nothing
        }
        let n1 = n - 1;
        match self {
            Wire::AllReduce => 2 * n1 * b / n,
            Wire::ReduceScatter => n1 * b / n,
            Wire::AllGather => n1 * b,
            Wire::AllToAll(own) => b - own,
            Wire::Once => b,
            Wire::FromRoot(root) => usize::from(rank == root) * b,
            Wire::ToRoot(root) => usize::from(rank != root) * b,
            Wire::Nothing => 0,
        }
    }
}

fn numel<const D: usize>(ts: &[Tensor<D>]) -> usize {
    ts.iter().map(|t| t.shape().num_elements()).sum()
}

impl<H: Hook + 'static> Communicator for Hooked<H> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.with(Wire::AllReduce, buf.len(), 4, || {
            self.inner.all_reduce_sum(buf)
        })
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.with(Wire::AllReduce, buf.len(), 8, || {
            self.inner.all_reduce_sum_f64(buf)
        })
    }
    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.with(Wire::AllGather, send.len(), 4, || {
            self.inner.all_gather_into(send, recv)
        })
    }
    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        self.with(Wire::ReduceScatter, buf.len(), 4, || {
            self.inner.reduce_scatter_sum(buf, out)
        })
    }
    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        self.with(Wire::ToRoot(root), send.len(), 4, || {
            self.inner.gather_into(send, recv, root)
        })
    }
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let n = send.iter().map(Vec::len).sum();
        let own = send.get(self.inner.rank()).map_or(0, Vec::len) * 4;
        self.with(Wire::AllToAll(own), n, 4, || self.inner.all_to_all(send))
    }
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        self.with(Wire::Once, send.len(), 4, || self.inner.ring_pass(send))
    }
    /// Both neighbours' messages in one call: one latency, both blocks' bytes.
    fn ring_pass_both(&self, fwd: &[f32], back: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = fwd.len() + back.len();
        self.with(Wire::Once, n, 4, || self.inner.ring_pass_both(fwd, back))
    }
    fn send(&self, to: usize, buf: &[f32]) -> Result<()> {
        self.with(Wire::Once, buf.len(), 4, || self.inner.send(to, buf))
    }
    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()> {
        self.with(Wire::Nothing, buf.len(), 4, || self.inner.recv(from, buf))
    }
    fn send_recv(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) -> Result<()> {
        let n = send.len().max(recv.len());
        let wire = Wire::AllToAll(4 * (n - send.len()));
        self.with(wire, n, 4, || self.inner.send_recv(to, send, from, recv))
    }
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        self.with(Wire::FromRoot(root), buf.len(), 4, || {
            self.inner.broadcast(buf, root)
        })
    }
    fn barrier(&self) -> Result<()> {
        self.with(Wire::Nothing, 0, 4, || self.inner.barrier())
    }
    fn barrier_unbounded(&self) -> Result<()> {
        self.with(Wire::Nothing, 0, 4, || self.inner.barrier_unbounded())
    }
    fn abort(&self, why: &str) {
        self.inner.abort(why)
    }
    fn start_job(&self, job: Job) -> std::result::Result<Vec<Arc<dyn WaitHook>>, Job> {
        let job = match self.hook.submit(job) {
            Ok(hooks) => return Ok(hooks),
            Err(job) => job,
        };
        let mut hooks = self.inner.start_job(job)?;
        hooks.extend(self.hook.wait_hook());
        Ok(hooks)
    }
    fn runs_jobs_apart(&self) -> bool {
        self.hook.has_thread() || self.inner.runs_jobs_apart()
    }
    fn on_device(&self, device: &Device) -> bool {
        self.inner.on_device(device)
    }
    fn all_to_all_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        let own = send
            .get(self.inner.rank())
            .map_or(0, |t| t.shape().num_elements())
            * 4;
        self.with(Wire::AllToAll(own), numel(&send), 4, || {
            self.inner.all_to_all_tensors(send)
        })
    }
    fn ring_pass_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        self.with(Wire::Once, numel(&send), 4, || {
            self.inner.ring_pass_tensors(send)
        })
    }
    fn ring_pass_both_tensors(
        &self,
        fwd: Vec<Tensor<4>>,
        back: Option<Vec<Tensor<4>>>,
    ) -> Result<(Vec<Tensor<4>>, Option<Vec<Tensor<4>>>)> {
        let n = numel(&fwd) + back.as_deref().map_or(0, numel);
        self.with(Wire::Once, n, 4, || {
            self.inner.ring_pass_both_tensors(fwd, back)
        })
    }
    fn all_reduce_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let n = t.shape().num_elements();
        self.with(Wire::AllReduce, n, 4, || self.inner.all_reduce_tensor(t))
    }
    fn reduce_scatter_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let n = t.shape().num_elements();
        self.with(Wire::ReduceScatter, n, 4, || {
            self.inner.reduce_scatter_tensor(t)
        })
    }
    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let n = t.shape().num_elements();
        self.with(Wire::AllGather, n, 4, || self.inner.all_gather_tensor(t))
    }
    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>> {
        self.with(Wire::AllGather, send.len(), 4, || {
            self.inner.all_gather(send)
        })
    }
}
