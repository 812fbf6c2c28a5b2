//! NCCL on burn-cuda device memory (features `nccl` + `cuda`): the collectives read and write
//! the tensors' own device buffers, with no copy through the host.
//!
//! How NCCL's stream is ordered against burn's. cubecl enqueues burn's kernels on a per-thread
//! CUDA stream of its own, which it does not expose; NCCL runs on this communicator's stream
//! (a separate non-blocking stream of the same primary context, so the device addresses are
//! valid in both). Each collective therefore:
//! 1. makes its inputs contiguous and allocates fresh, contiguous outputs (cubecl's CUDA
//!    layout may pad rows; an input buffer may be shared with other tensors, so nothing is
//!    written in place);
//! 2. takes every buffer's device address with `get_resource`, whose guard keeps the
//!    allocation alive and in place while held;
//! 3. waits on the host until cubecl's stream has finished the work that writes the inputs
//!    (`client.sync()`), then enqueues the NCCL call on our stream;
//! 4. waits for our stream (`synchronize`) before dropping the guards and handing the outputs
//!    to burn. cubecl reuses a released buffer on its own stream at once, so nothing NCCL
//!    touches may be released earlier.
//!
//! The two host waits cost latency per collective, not bandwidth; the buckets of
//! `parallel::bucket` keep the count of collectives per step small.

use std::sync::Arc;

use burn::backend::{Cube, DispatchDevice};
use burn::tensor::{DType, Device, Shape, Tensor};
use burn_cubecl::cubecl::__private::Runtime;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeDevice;
use cudarc::driver::{
    sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::ReduceOp;

use cudarc::nccl::Comm;

use super::stream_order::{grouped, settled};
use crate::error::{Error, Result};

/// `Runtime` is public only through cubecl's doc-hidden re-export; this is the one name the
/// CUDA server's storage type can be reached by.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// Whether `device` is a CUDA device (through an autodiff wrapper or not).
pub fn is_cuda(device: &Device) -> bool {
    fn inner(d: &DispatchDevice) -> bool {
        match d {
            DispatchDevice::Autodiff(ad) => inner(ad),
            DispatchDevice::Cube(CubeDevice::Cuda(_)) => true,
            _ => false,
        }
    }
    inner(device.as_dispatch())
}

/// Whether NCCL can move `t`'s memory directly: an f32 tensor on a CUDA device.
pub fn movable(t: &Tensor<1>) -> bool {
    t.dtype() == DType::F32 && is_cuda(&t.device())
}

/// A borrowed device address as cudarc's slice traits want it. The memory belongs to cubecl;
/// the `get_resource` guard held beside this keeps it in place, and the caller synchronises
/// (see the module comment), so the returned `SyncOnDrop` does nothing.
struct Raw {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<f32> for Raw {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<f32> for Raw {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for Raw {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

fn cube<const D: usize>(t: Tensor<D>) -> Result<CubeTensor> {
    t.try_into_primitive::<Cube>()
        .map(into_contiguous)
        .map_err(|e| Error::Invalid(format!("NCCL: not a CUDA tensor: {e:?}")))
}

fn fresh(like: &CubeTensor, dims: &[usize]) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        like.dtype,
    )
}

fn gerr(e: impl std::fmt::Debug) -> Error {
    Error::Invalid(format!("NCCL: CUDA buffer of a burn tensor: {e:?}"))
}

fn nerr(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Invalid(format!("NCCL {what} failed on device buffers: {e:?}"))
}

/// What the device collectives need of an NCCL communicator (`parallel::nccl` holds it): the
/// communicator (locked by the caller), its stream and the group size.
pub struct Nccl<'a> {
    pub comm: &'a Comm,
    pub stream: &'a Arc<CudaStream>,
    pub size: usize,
}

impl Nccl<'_> {
    /// One NCCL call from an f32 CUDA tensor into a fresh one of `out_len` elements, following
    /// the ordering of the module comment.
    fn one_to_one(
        &self,
        what: &str,
        t: Tensor<1>,
        out_len: usize,
        call: impl FnOnce(&Comm, &Raw, &mut Raw) -> std::result::Result<(), NcclError>,
    ) -> Result<Tensor<1>> {
        let n = t.dims()[0];
        let x = cube(t)?;
        let out = fresh(&x, &[out_len]);
        let src = x
            .client
            .get_resource::<CudaServer>(x.handle.clone())
            .map_err(gerr)?;
        let dst = x
            .client
            .get_resource::<CudaServer>(out.handle.clone())
            .map_err(gerr)?;
        block_on(x.client.sync()).map_err(gerr)?;
        let send = self.raw(src.resource().ptr, n);
        let mut recv = self.raw(dst.resource().ptr, out_len);
        // The stream is waited for even when the call fails (stream_order).
        let called = call(self.comm, &send, &mut recv).map_err(|e| nerr(what, e));
        settled(called, || self.sync())?;
        drop((src, dst, x));
        Ok(Tensor::from_primitive::<Cube>(out))
    }

    /// Sum over the group of an f32 CUDA tensor, device to device.
    pub fn all_reduce(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let n = t.dims()[0];
        self.one_to_one("all_reduce", t, n, |c, s, r| {
            c.all_reduce(s, r, &ReduceOp::Sum).map(drop)
        })
    }

    /// Reduce-scatter of a flat f32 CUDA tensor (`size · block` elements): this rank's block
    /// of the sum, device to device.
    pub fn reduce_scatter(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let block = t.dims()[0] / self.size;
        self.one_to_one("reduce_scatter", t, block, |c, s, r| {
            c.reduce_scatter(s, r, &ReduceOp::Sum).map(drop)
        })
    }

    /// All-gather of equal f32 CUDA blocks into one flat tensor, device to device.
    pub fn all_gather(&self, t: Tensor<1>) -> Result<Tensor<1>> {
        let n = t.dims()[0] * self.size;
        self.one_to_one("all_gather", t, n, |c, s, r| c.all_gather(s, r).map(drop))
    }

    /// All-to-all of f32 CUDA tensors of one shape: grouped sends and receives (NCCL has no
    /// all-to-all call), device to device.
    pub fn all_to_all(&self, send: Vec<Tensor<4>>) -> Result<Vec<Tensor<4>>> {
        let dims = send[0].dims();
        let n: usize = dims.iter().product();
        let xs = send.into_iter().map(cube).collect::<Result<Vec<_>>>()?;
        let outs: Vec<CubeTensor> = xs.iter().map(|x| fresh(x, &dims)).collect();
        let client = xs[0].client.clone();
        let srcs = xs
            .iter()
            .map(|x| client.get_resource::<CudaServer>(x.handle.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(gerr)?;
        let dsts = outs
            .iter()
            .map(|x| client.get_resource::<CudaServer>(x.handle.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(gerr)?;
        block_on(client.sync()).map_err(gerr)?;
        let comm = self.comm;
        cudarc::nccl::result::group_start().map_err(|e| nerr("group start", e))?;
        // The group is closed and the stream waited for whatever happened (stream_order), so
        // NCCL is usable afterwards and no buffer is released while it may still touch it.
        grouped(
            srcs.len(),
            |j| {
                let send = self.raw(srcs[j].resource().ptr, n);
                let mut recv = self.raw(dsts[j].resource().ptr, n);
                comm.send(&send, j as i32).map_err(|e| nerr("send", e))?;
                comm.recv(&mut recv, j as i32)
                    .map(drop)
                    .map_err(|e| nerr("recv", e))
            },
            || {
                cudarc::nccl::result::group_end()
                    .map(drop)
                    .map_err(|e| nerr("group end", e))
            },
            || self.sync(),
        )?;
        drop((srcs, dsts, xs));
        Ok(outs
            .into_iter()
            .map(Tensor::from_primitive::<Cube>)
            .collect())
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| nerr("synchronize", e))
    }

    fn raw(&self, ptr: u64, len: usize) -> Raw {
        Raw {
            ptr,
            len,
            stream: self.stream.clone(),
        }
    }
}
