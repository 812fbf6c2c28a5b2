//! The communicator trait: the only way ranks talk. Buffers are host `f32` vectors; the model
//! code never knows which implementation (threads, MPI, NCCL) is behind it.

use crate::error::Result;

/// Collectives over a fixed group of ranks. Every rank of the group must call the same
/// collectives in the same order. A failure of any rank makes the others' calls return an
/// error naming it instead of hanging.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Element-wise sum over the group, in place.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `send`, in rank order.
    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>>;
    /// Sum over the group of equal-length `buf`s, then this rank's `rank()`-th of `size()`
    /// contiguous chunks (lengths given by `chunk_lens`, which all ranks pass identically).
    ///
    /// The default is an all-reduce then a slice (chunks may differ by one element, which the
    /// libraries' reduce-scatter does not allow); the thread group reads only its chunk.
    fn reduce_scatter_sum(&self, buf: &[f32], chunk_lens: &[usize]) -> Result<Vec<f32>> {
        let mut all = buf.to_vec();
        self.all_reduce_sum(&mut all)?;
        let start: usize = chunk_lens[..self.rank()].iter().sum();
        Ok(all[start..start + chunk_lens[self.rank()]].to_vec())
    }
    /// `send[j]` goes to rank j; returns what each rank sent to this one, in rank order.
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>>;
    /// Rank `root`'s `buf` to everyone.
    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Tells the other ranks this one failed (they stop waiting and report `why`).
    fn abort(&self, why: &str);
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
    fn all_gather(&self, send: &[f32]) -> Result<Vec<Vec<f32>>> {
        Ok(vec![send.to_vec()])
    }
    fn reduce_scatter_sum(&self, buf: &[f32], _chunk_lens: &[usize]) -> Result<Vec<f32>> {
        Ok(buf.to_vec())
    }
    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        Ok(send)
    }
    fn broadcast(&self, _buf: &mut Vec<f32>, _root: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self, _why: &str) {}
}
