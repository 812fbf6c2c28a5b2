//! The communicator trait: the only way ranks talk. Buffers are host `f32` vectors; the model
//! code never knows which implementation (threads, MPI, NCCL) is behind it.
//!
//! The contract is the one MPI and NCCL impose, and the thread group enforces it so the test
//! suite sees what a real launch would: every rank calls the same collectives in the same order
//! with the same element counts (all-gather and all-to-all chunks of equal length on every
//! rank, reduce-scatter input a multiple of the group size). Large transfers go through
//! [`crate::parallel::bucket`], which keeps every single call below MPI's `i32` count limit.

use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};

use crate::error::{Error, Result};

/// Collectives over a fixed group of ranks. Every rank of the group must call the same
/// collectives in the same order. A failure of any rank makes the others' calls return an
/// error naming it instead of hanging.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Element-wise sum over the group, in place (equal lengths on every rank).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Element-wise sum in f64 (norms and losses, which must not lose precision in transit).
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()>;
    /// Every rank's `send` (the same length on every rank) into `recv` in rank order;
    /// `recv.len() == size() · send.len()`.
    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()>;
    /// Sum over the group of `buf` (`size() · out.len()` elements on every rank); this rank
    /// receives block `rank()` of the sum in `out`.
    ///
    /// The default is an all-reduce then a copy of the block; the thread group and MPI move
    /// only the blocks.
    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter", buf.len(), out.len(), self.size())?;
        let mut all = buf.to_vec();
        self.all_reduce_sum(&mut all)?;
        let start = self.rank() * out.len();
        out.copy_from_slice(&all[start..start + out.len()]);
        Ok(())
    }
    /// Rank `root` receives every rank's `send` (equal lengths) in rank order in `recv`
    /// (`size() · send.len()` elements); the other ranks pass `None`. The default gathers on
    /// every rank and keeps the root's copy; MPI moves the data to the root only.
    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        let mut all = vec![0.0; send.len() * self.size()];
        self.all_gather_into(send, &mut all)?;
        if self.rank() == root {
            let recv =
                recv.ok_or_else(|| Error::Invalid("gather: the root has no buffer".into()))?;
            recv.copy_from_slice(&all);
        }
        Ok(())
    }
    /// `send[j]` goes to rank j; returns what each rank sent to this one, in rank order. All
    /// chunks have the same length on every rank.
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>>;
    /// One step around the ring: `send` goes to rank `rank + 1` (mod size) and what rank
    /// `rank − 1` sent comes back (the same length on every rank). The default moves every
    /// rank's buffer to every rank (an all-gather); threads and MPI move one block.
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        let n = self.size();
        let mut all = self.all_gather(send)?;
        Ok(std::mem::take(&mut all[(self.rank() + n - 1) % n]))
    }
    /// Both ways round the ring at once: `fwd` goes to rank `rank + 1` and `back` to rank
    /// `rank − 1` (mod size); returns what rank `rank − 1` sent forward and what rank
    /// `rank + 1` sent back (each the same length on every rank). One exchange with both
    /// neighbours at once: chained, the blocks of the ranks d behind and d ahead arrive after d
    /// exchanges, every block after ⌈(n − 1)/2⌉ (the CP ring's forward,
    /// `parallel::ring_passes`). The default is a ring pass and then an all-gather; threads
    /// and MPI post both directions together.
    fn ring_pass_both(&self, fwd: &[f32], back: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let from_prev = self.ring_pass(fwd)?;
        let mut all = self.all_gather(back)?;
        let from_next = std::mem::take(&mut all[(self.rank() + 1) % self.size()]);
        Ok((from_prev, from_next))
    }
    /// Point to point: `buf` to rank `to` (pipeline stages hand activations and their gradients
    /// to their neighbours); rank `to` takes it with [`Communicator::recv`] of the same length.
    /// Messages from one rank to another arrive in the order sent. It never waits for the
    /// receive (threads queue the message, MPI posts a non-blocking send over a copy), so two
    /// neighbours may both send before either receives. Threads and MPI implement it; the
    /// default refuses by name.
    fn send(&self, to: usize, _buf: &[f32]) -> Result<()> {
        Err(no_point_to_point("send to", to, self.size()))
    }
    /// Point to point: the next message from rank `from`, into `buf` (its length must be the
    /// sent one).
    fn recv(&self, from: usize, _buf: &mut [f32]) -> Result<()> {
        Err(no_point_to_point("receive from", from, self.size()))
    }
    /// `send` to `to` and `recv` from `from` together, neither waiting for the other to finish.
    /// The default sends first, which is right where a send never waits for its receive
    /// (threads).
    fn send_recv(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) -> Result<()> {
        self.send(to, send)?;
        self.recv(from, recv)
    }
    /// Rank `root`'s `buf` to everyone.
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// A barrier around a phase known to be long and done by one rank (rank 0 writing a
    /// checkpoint of many GB): it waits as long as that takes, but a failed rank still ends it.
    fn barrier_unbounded(&self) -> Result<()> {
        self.barrier()
    }
    /// Tells the other ranks this one failed (they stop waiting and report `why`).
    fn abort(&self, why: &str);
    /// Takes `job` for this group's communication thread and returns what goes around the
    /// wait for it, or gives it back where there is none (the caller then runs it at once).
    /// Use [`crate::parallel::progress::start`].
    fn start_job(&self, job: Job) -> std::result::Result<Vec<Arc<dyn WaitHook>>, Job> {
        Err(job)
    }
    /// Whether [`Communicator::start_job`] runs jobs on a thread of their own (while the
    /// caller computes), so that work placed between a start and its wait is hidden.
    fn runs_jobs_apart(&self) -> bool {
        false
    }

    /// Whether tensors on `device` travel without host copies (NCCL on CUDA tensors); callers
    /// then pack and reduce on the device instead of staging host buffers.
    fn on_device(&self, _device: &Device) -> bool {
        false
    }
    /// [`Communicator::all_to_all`] of 4-D tensors (the Ulysses exchange): `send[j]` goes to rank j; returns what each
    /// rank sent here, in rank order, in `send`'s shape, device and dtype (every chunk has the
    /// same shape on every rank). The default stages host copies.
    fn all_to_all_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        host_all_to_all_tensors(self, send)
    }
    /// [`Communicator::ring_pass`] of 4-D tensors (a ring-attention block): every tensor of
    /// `send` goes to rank `rank + 1` in one message; returns rank `rank − 1`'s, in `send`'s
    /// shapes, device and dtype. The default stages host copies.
    fn ring_pass_tensors(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        let (flat, meta) = host_blocks(send, "ring_pass")?;
        Ok(blocks_from_host(&self.ring_pass(&flat)?, &meta))
    }
    /// [`Communicator::ring_pass_both`] of 4-D tensors: `fwd` to rank `rank + 1` and, where
    /// given, `back` to rank `rank − 1`; returns rank `rank − 1`'s forward blocks and rank
    /// `rank + 1`'s backward ones (every rank gives `back` or none does). The default stages
    /// host copies.
    #[allow(clippy::type_complexity)]
    fn ring_pass_both_tensors(
        &self,
        fwd: Vec<Tensor<4>>,
        back: Option<Vec<Tensor<4>>>,
    ) -> Result<(Vec<Tensor<4>>, Option<Vec<Tensor<4>>>)> {
        let Some(back) = back else {
            return Ok((self.ring_pass_tensors(fwd)?, None));
        };
        let (f, f_meta) = host_blocks(fwd, "ring_pass_both")?;
        let (b, b_meta) = host_blocks(back, "ring_pass_both")?;
        let (from_prev, from_next) = self.ring_pass_both(&f, &b)?;
        Ok((
            blocks_from_host(&from_prev, &f_meta),
            Some(blocks_from_host(&from_next, &b_meta)),
        ))
    }
    /// Element-wise sum over the group of a flat tensor (equal lengths on every rank). The
    /// default stages a host copy.
    fn all_reduce_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        host_all_reduce_tensor(self, t)
    }

    /// Reduce-scatter of a flat tensor of `size() · block` elements: this rank's block of the
    /// sum. The default stages host copies in one call (host groups use `parallel::bucket`).
    fn reduce_scatter_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        host_reduce_scatter_tensor(self, t)
    }
    /// All-gather of equal blocks: every rank's `t`, in rank order, as one flat tensor. The
    /// default stages host copies in one call.
    fn all_gather_tensor(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        host_all_gather_tensor(self, t)
    }

    /// Every rank's `send`, one vector per rank (see [`Communicator::all_gather_into`]).
    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>> {
        let mut recv = vec![0.0; send.len() * self.size()];
        self.all_gather_into(send, &mut recv)?;
        Ok((0..self.size())
            .map(|j| recv[j * send.len()..(j + 1) * send.len()].to_vec())
            .collect())
    }
}

/// A started operation (`parallel::progress`): run on a communication thread with the
/// group's communicator.
pub type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// What a wrapper does around the wait for a started job (the clock of `comm_wait_s` times it).
pub trait WaitHook: Send + Sync + std::fmt::Debug {
    fn around_wait(&self, wait: &mut dyn FnMut());
}

/// The error of a communicator without point-to-point calls.
fn no_point_to_point(what: &str, peer: usize, size: usize) -> Error {
    Error::Invalid(format!(
        "{what} rank {peer} of {size}: this communicator has no point-to-point calls (threads \
         and MPI do)"
    ))
}

/// Checks a point-to-point peer and length: `op` names the call.
pub fn check_peer(op: &str, peer: usize, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::Invalid(format!(
            "{op}: rank {peer} does not exist in a group of {size}"
        )));
    }
    Ok(())
}

/// Shapes, devices and dtypes of staged tensors.
type BlockMeta = Vec<([usize; 4], Device, burn::tensor::DType)>;

/// Tensors as one host buffer, with what rebuilds them.
fn host_blocks(send: Vec<Tensor<4>>, op: &str) -> Result<(Vec<f32>, BlockMeta)> {
    let meta = send
        .iter()
        .map(|t| (t.dims(), t.device(), t.dtype()))
        .collect();
    let mut flat = Vec::new();
    for t in send {
        flat.extend(to_host(t, op)?);
    }
    Ok((flat, meta))
}

/// The tensors `meta` describes, from consecutive pieces of `got`.
fn blocks_from_host(got: &[f32], meta: &BlockMeta) -> Vec<Tensor<4>> {
    let mut at = 0;
    meta.iter()
        .map(|(shape, device, dtype)| {
            let n: usize = shape.iter().product();
            let piece = got[at..at + n].to_vec();
            at += n;
            Tensor::from_data(TensorData::new(piece, *shape), (device, *dtype))
        })
        .collect()
}

fn to_host<const D: usize>(t: Tensor<D>, op: &str) -> Result<Vec<f32>> {
    t.try_into_vec_as::<f32>()
        .map_err(|e| Error::Invalid(format!("{op}: tensor to host: {e:?}")))
}

/// A host vector back as a flat tensor on `device` in `dtype`.
fn flat_tensor(v: Vec<f32>, device: &Device, dtype: burn::tensor::DType) -> Tensor<1> {
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [n]), (device, dtype))
}

/// [`Communicator::all_to_all_tensors`] through host buffers.
pub fn host_all_to_all_tensors<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    send: Vec<Tensor<D>>,
) -> Result<Vec<Tensor<D>>> {
    let Some(first) = send.first() else {
        return comm.all_to_all(Vec::new()).map(|_| Vec::new());
    };
    let (shape, device, dtype) = (first.dims(), first.device(), first.dtype());
    let host = send
        .into_iter()
        .map(|t| to_host(t, "all_to_all"))
        .collect::<Result<Vec<_>>>()?;
    Ok(comm
        .all_to_all(host)?
        .into_iter()
        .map(|v| Tensor::from_data(TensorData::new(v, shape), (&device, dtype)))
        .collect())
}

/// [`Communicator::all_reduce_tensor`] through a host buffer.
pub fn host_all_reduce_tensor<C: Communicator + ?Sized>(
    comm: &C,
    t: Tensor<1>,
) -> Result<Tensor<1>> {
    let (device, dtype) = (t.device(), t.dtype());
    let mut v = to_host(t, "all_reduce")?;
    comm.all_reduce_sum(&mut v)?;
    Ok(flat_tensor(v, &device, dtype))
}

/// [`Communicator::reduce_scatter_tensor`] through host buffers.
pub fn host_reduce_scatter_tensor<C: Communicator + ?Sized>(
    comm: &C,
    t: Tensor<1>,
) -> Result<Tensor<1>> {
    let (device, dtype) = (t.device(), t.dtype());
    let flat = to_host(t, "reduce_scatter")?;
    let mut out = vec![0.0; flat.len() / comm.size().max(1)];
    comm.reduce_scatter_sum(&flat, &mut out)?;
    Ok(flat_tensor(out, &device, dtype))
}

/// [`Communicator::all_gather_tensor`] through host buffers.
pub fn host_all_gather_tensor<C: Communicator + ?Sized>(
    comm: &C,
    t: Tensor<1>,
) -> Result<Tensor<1>> {
    let (device, dtype) = (t.device(), t.dtype());
    let block = to_host(t, "all_gather")?;
    let mut out = vec![0.0; block.len() * comm.size()];
    comm.all_gather_into(&block, &mut out)?;
    Ok(flat_tensor(out, &device, dtype))
}

/// The most elements one MPI call carries: `GENSLM_MPI_MAX_COUNT` when set (lowered by
/// scripts/check_mpi.sh so that the pieced path is tested at small sizes), else MPI's own
/// limit, `i32::MAX`. A value that is not a whole number from 1 to `i32::MAX` is refused,
/// naming it: junk was ignored and 0 taken as 1 (every collective cut into one-element calls).
pub fn mpi_max_count() -> Result<usize> {
    let limit = i32::MAX as usize;
    let Some(value) = std::env::var_os("GENSLM_MPI_MAX_COUNT") else {
        return Ok(limit);
    };
    match value.to_str().and_then(|v| v.parse::<usize>().ok()) {
        Some(n) if (1..=limit).contains(&n) => Ok(n),
        _ => Err(Error::Invalid(format!(
            "GENSLM_MPI_MAX_COUNT={}: the most elements per MPI call must be a whole number \
             from 1 to {limit} (a test setting; unset it for a normal run)",
            value.to_string_lossy()
        ))),
    }
}

/// Checks `total == size · block` (reduce-scatter, all-gather shapes).
pub fn check_blocks(op: &str, total: usize, block: usize, size: usize) -> Result<()> {
    if block.checked_mul(size) != Some(total) {
        return Err(Error::Invalid(format!(
            "{op}: {total} elements is not {size} ranks × {block}; collectives need equal \
             blocks on every rank"
        )));
    }
    Ok(())
}

/// A length sent through an f32 collective: four 16-bit limbs, each exact in an f32 (a
/// single f32 is exact only below 2²⁴). Used where the only transport is a float buffer.
pub fn len_to_limbs(n: usize) -> [f32; 4] {
    let n = n as u64;
    [0, 16, 32, 48].map(|s| ((n >> s) & 0xFFFF) as f32)
}

/// The inverse of [`len_to_limbs`].
pub fn limbs_to_len(l: &[f32; 4]) -> usize {
    l.iter()
        .enumerate()
        .map(|(i, &x)| (x as u64) << (16 * i))
        .sum::<u64>() as usize
}

/// A group of one: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _buf: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", recv.len(), send.len(), 1)?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter", buf.len(), out.len(), 1)?;
        out.copy_from_slice(buf);
        Ok(())
    }
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        Ok(send)
    }
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        Ok(send.to_vec())
    }
    fn broadcast(&self, _buf: &mut Vec<f32>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self, _why: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_survive_float_transport_beyond_2_pow_24() {
        for n in [0usize, 1, (1 << 24) + 1, (1 << 31) + 3, (1 << 40) + 12345] {
            assert_eq!(limbs_to_len(&len_to_limbs(n)), n);
        }
        // What a single f32 would have done to the same length.
        assert_ne!((((1usize << 24) + 1) as f32) as usize, (1 << 24) + 1);
    }
}
