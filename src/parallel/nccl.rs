//! NCCL communicator (feature `nccl`, through cudarc). Compiles without CUDA; not yet run on a
//! GPU. The host-buffer collectives of [`Communicator`] copy to and from the device around the
//! call; with the `cuda` feature the tensor collectives (`all_reduce_tensor`,
//! `all_to_all_tensors`: gradient reduction and the Ulysses exchange) run on burn-cuda's device
//! buffers directly (`nccl_device.rs`).
//!
//! The unique id is created on rank 0 and broadcast through a bootstrap communicator (MPI);
//! NCCL has no all-to-all, so it is built from grouped send/recv. cudarc panics when libnccl is
//! missing, so [`NcclComm::init`] checks for it first (cudarc looks for `libnccl.so`; NCCL
//! installs `libnccl.so.2`, which may need a `libnccl.so` link).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use crate::error::{Error, Result};
use crate::parallel::comm::{check_blocks, len_to_limbs, limbs_to_len, Communicator};

pub struct NcclComm {
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

// SAFETY: every call on the NCCL communicator goes through the mutex, one at a time.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank, self.size)
    }
}

fn nerr(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Invalid(format!("NCCL {what} failed: {e:?}"))
}

/// Whether the CUDA driver and NCCL libraries can be loaded on this machine.
pub fn libraries_present() -> bool {
    // SAFETY: these only try to dlopen the libraries.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

impl NcclComm {
    /// Joins the NCCL group of `bootstrap`'s ranks on GPU `device`.
    pub fn init(bootstrap: &dyn Communicator, device: usize) -> Result<Self> {
        if !libraries_present() {
            return Err(Error::Invalid(
                "NCCL: libcuda or libnccl.so not found (install NCCL; if only libnccl.so.2 \
                 exists, add a libnccl.so link to it on the library path)"
                    .into(),
            ));
        }
        // The 128-byte id travels as f32s (each byte exactly representable).
        let mut bytes: Vec<f32> = if bootstrap.rank() == 0 {
            let id = Id::new().map_err(|e| nerr("get unique id", e))?;
            id.internal().iter().map(|&b| b as u8 as f32).collect()
        } else {
            Vec::new()
        };
        bootstrap.broadcast(&mut bytes, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as u8 as std::ffi::c_char;
        }
        let ctx = CudaContext::new(device).map_err(|e| nerr("open device", e))?;
        // A stream of our own, not the legacy default stream: nccl_device.rs orders it against
        // cubecl's streams explicitly.
        let stream = ctx.new_stream().map_err(|e| nerr("create stream", e))?;
        let comm = Comm::from_rank(
            stream.clone(),
            bootstrap.rank(),
            bootstrap.size(),
            Id::uninit(internal),
        )
        .map_err(|e| nerr("init rank", e))?;
        Ok(Self {
            comm: Mutex::new(comm),
            stream,
            rank: bootstrap.rank(),
            size: bootstrap.size(),
        })
    }

    /// `f` on the device collectives of this communicator (locked for the call).
    #[cfg(feature = "cuda")]
    fn on_gpu<T>(&self, f: impl FnOnce(&crate::parallel::nccl_device::Nccl) -> T) -> T {
        let comm = self.lock();
        f(&crate::parallel::nccl_device::Nccl {
            comm: &comm,
            stream: &self.stream,
            size: self.size,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A host buffer summed in place over the group, through the device.
    fn all_reduce_host<T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        buf: &mut [T],
    ) -> Result<()> {
        let mut d = self.stream.clone_htod(buf).map_err(|e| nerr("copy", e))?;
        self.lock()
            .all_reduce_in_place(&mut d, &ReduceOp::Sum)
            .map_err(|e| nerr("all_reduce", e))?;
        let host = self.stream.clone_dtoh(&d).map_err(|e| nerr("copy", e))?;
        buf.clone_from_slice(&host);
        Ok(())
    }

    /// `send` to the device, `op` from it into a fresh device buffer of `recv.len()`, back
    /// into `recv`.
    fn through_device<E: std::fmt::Debug>(
        &self,
        what: &str,
        send: &[f32],
        recv: &mut [f32],
        op: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaSlice<f32>,
            &mut cudarc::driver::CudaSlice<f32>,
        ) -> std::result::Result<cudarc::nccl::result::NcclStatus, E>,
    ) -> Result<()> {
        let s = self.stream.clone_htod(send).map_err(|e| nerr("copy", e))?;
        let mut r = self
            .stream
            .alloc_zeros::<f32>(recv.len())
            .map_err(|e| nerr("alloc", e))?;
        op(&self.lock(), &s, &mut r).map_err(|e| nerr(what, e))?;
        let host = self.stream.clone_dtoh(&r).map_err(|e| nerr("copy", e))?;
        recv.copy_from_slice(&host);
        Ok(())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce_host(buf)
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce_host(buf)
    }

    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", recv.len(), send.len(), self.size)?;
        self.through_device("all_gather", send, recv, |c, s, r| c.all_gather(s, r))
    }

    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter", buf.len(), out.len(), self.size)?;
        self.through_device("reduce_scatter", buf, out, |c, s, r| {
            c.reduce_scatter(s, r, &ReduceOp::Sum)
        })
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let n = send.first().map_or(0, Vec::len);
        if send.len() != self.size || send.iter().any(|s| s.len() != n) {
            return Err(Error::Invalid("all_to_all: unequal chunks".into()));
        }
        let s = self
            .stream
            .clone_htod(&send.concat())
            .map_err(|e| nerr("copy", e))?;
        // One receive buffer per source rank, so each gets its own mutable view.
        let mut recv = Vec::with_capacity(self.size);
        for _ in 0..self.size {
            recv.push(
                self.stream
                    .alloc_zeros::<f32>(n)
                    .map_err(|e| nerr("alloc", e))?,
            );
        }
        {
            let comm = self.lock();
            let sends: Vec<_> = (0..self.size)
                .map(|j| s.slice(j * n..(j + 1) * n))
                .collect();
            let recvs: Vec<_> = recv.iter_mut().map(|r| r.slice_mut(..)).collect();
            let mut group = comm.group();
            for (j, (sv, rv)) in sends.into_iter().zip(recvs).enumerate() {
                group.send(sv, j as i32).map_err(|e| nerr("send", e))?;
                group.recv(rv, j as i32).map_err(|e| nerr("recv", e))?;
            }
        }
        recv.iter()
            .map(|r| self.stream.clone_dtoh(r).map_err(|e| nerr("copy", e)))
            .collect()
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        // The length rides on an all-reduce from the root (others contribute 0), as 16-bit
        // limbs: one f32 would be exact only below 2²⁴ elements.
        let mut len = if self.rank == root {
            len_to_limbs(buf.len())
        } else {
            [0.0; 4]
        };
        self.all_reduce_sum(&mut len)?;
        buf.resize(limbs_to_len(&len), 0.0);
        let mut d = self
            .stream
            .clone_htod(&buf[..])
            .map_err(|e| nerr("copy", e))?;
        self.lock()
            .broadcast_in_place(&mut d, root as i32)
            .map_err(|e| nerr("broadcast", e))?;
        *buf = self.stream.clone_dtoh(&d).map_err(|e| nerr("copy", e))?;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_sum(&mut [0.0])
    }

    #[cfg(feature = "cuda")]
    fn on_device(&self, device: &burn::tensor::Device) -> bool {
        crate::parallel::nccl_device::is_cuda(device)
    }

    #[cfg(feature = "cuda")]
    fn all_reduce_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        if crate::parallel::nccl_device::movable(&t) {
            self.on_gpu(|n| n.all_reduce(t))
        } else {
            crate::parallel::comm::host_all_reduce_tensor(self, t)
        }
    }

    #[cfg(feature = "cuda")]
    fn reduce_scatter_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        check_blocks(
            "reduce_scatter",
            t.dims()[0],
            t.dims()[0] / self.size,
            self.size,
        )?;
        if crate::parallel::nccl_device::movable(&t) {
            self.on_gpu(|n| n.reduce_scatter(t))
        } else {
            crate::parallel::comm::host_reduce_scatter_tensor(self, t)
        }
    }

    #[cfg(feature = "cuda")]
    fn all_gather_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        if crate::parallel::nccl_device::movable(&t) {
            self.on_gpu(|n| n.all_gather(t))
        } else {
            crate::parallel::comm::host_all_gather_tensor(self, t)
        }
    }

    #[cfg(feature = "cuda")]
    fn all_to_all_tensors(
        &self,
        send: Vec<burn::tensor::Tensor<4>>,
    ) -> Result<Vec<burn::tensor::Tensor<4>>> {
        let on_gpu = send.len() == self.size
            && send.iter().all(|t| {
                t.dtype() == burn::tensor::DType::F32
                    && crate::parallel::nccl_device::is_cuda(&t.device())
                    && t.dims() == send[0].dims()
            });
        if on_gpu {
            self.on_gpu(|n| n.all_to_all(send))
        } else {
            crate::parallel::comm::host_all_to_all_tensors(self, send)
        }
    }

    fn abort(&self, why: &str) {
        // NCCL ranks are launched by MPI; the MPI bootstrap's abort ends the job.
        eprintln!("error: NCCL rank {}: {why}", self.rank);
    }
}

/// A group whose host-buffer collectives (losses, norms, checkpoint gathers, barriers, abort)
/// go through its bootstrap communicator (MPI) and whose tensor collectives go through NCCL,
/// on the device when the tensors are on a CUDA device.
#[derive(Debug)]
pub struct NcclGroup {
    host: Arc<dyn Communicator>,
    nccl: NcclComm,
}

impl NcclGroup {
    /// NCCL beside `host` on GPU `device`; the NCCL unique id travels over `host`.
    pub fn new(host: Arc<dyn Communicator>, device: usize) -> Result<Self> {
        let nccl = NcclComm::init(host.as_ref(), device)?;
        Ok(Self { host, nccl })
    }
}

impl Communicator for NcclGroup {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.host.all_reduce_sum(buf)
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.host.all_reduce_sum_f64(buf)
    }
    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.host.all_gather_into(send, recv)
    }
    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        self.host.reduce_scatter_sum(buf, out)
    }
    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        self.host.gather_into(send, recv, root)
    }
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        self.host.all_to_all(send)
    }
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        self.host.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn barrier_unbounded(&self) -> Result<()> {
        self.host.barrier_unbounded()
    }
    fn abort(&self, why: &str) {
        self.host.abort(why)
    }
    // The ring's K/V blocks are staged through the host group for now (ncclSend/ncclRecv on
    // device memory is the GPU follow-up).
    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        self.host.ring_pass(send)
    }
    fn ring_pass_both(&self, fwd: &[f32], back: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        self.host.ring_pass_both(fwd, back)
    }
    fn on_device(&self, device: &burn::tensor::Device) -> bool {
        self.nccl.on_device(device)
    }
    fn all_reduce_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        self.nccl.all_reduce_tensor(t)
    }
    fn all_to_all_tensors(
        &self,
        send: Vec<burn::tensor::Tensor<4>>,
    ) -> Result<Vec<burn::tensor::Tensor<4>>> {
        self.nccl.all_to_all_tensors(send)
    }
    fn reduce_scatter_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        self.nccl.reduce_scatter_tensor(t)
    }
    fn all_gather_tensor(&self, t: burn::tensor::Tensor<1>) -> Result<burn::tensor::Tensor<1>> {
        self.nccl.all_gather_tensor(t)
    }
}

/// `ranks` with NCCL beside each group (world, SP, DP) on GPU `device`: the tensor collectives
/// of training (gradient all-reduce, Ulysses all-to-all) then run on device memory.
pub fn with_nccl(
    ranks: crate::parallel::ranks::Ranks,
    device: usize,
) -> Result<crate::parallel::ranks::Ranks> {
    let wrap = |c: &Arc<dyn Communicator>| -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(NcclGroup::new(c.clone(), device)?))
    };
    Ok(crate::parallel::ranks::Ranks {
        world: wrap(&ranks.world)?,
        tp: wrap(&ranks.tp)?,
        data: wrap(&ranks.data)?,
        sp: wrap(&ranks.sp)?,
        cp: wrap(&ranks.cp)?,
        seq: wrap(&ranks.seq)?,
        dp: wrap(&ranks.dp)?,
        // NCCL's calls stay on the rank's thread and stream (issue 42: overlap on NCCL
        // streams, ordered by events, is not built yet).
        no_overlap: Some("NCCL collectives are not overlapped yet (issue 42)".into()),
        ..ranks
    })
}
