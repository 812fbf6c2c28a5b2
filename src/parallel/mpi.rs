//! MPI communicator (feature `mpi`): one rank per process, launched by `mpirun`/`srun`.
//!
//! The world is split into the SP groups (contiguous ranks) and DP groups with
//! `MPI_Comm_split`. A rank that fails calls `MPI_Abort`, which ends every process of the job
//! with a non-zero status, so no rank waits forever.

use std::sync::{Arc, Mutex};

use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{Error, Result};
use crate::parallel::comm::{check_blocks, Communicator};
use crate::parallel::ranks::Ranks;
use crate::parallel::topology::Topology;

/// An MPI communicator. MPI is initialised with `Threading::Serialized`: any thread may call
/// MPI as long as no two calls overlap, which the mutex guarantees (`Funneled` would require
/// every call to come from the thread that initialised MPI, which a Rust handle shared between
/// threads cannot promise).
pub struct MpiComm {
    comm: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
}

// SAFETY: see the type's comment: MPI runs `Serialized` and the mutex serialises the calls.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank, self.size)
    }
}

impl MpiComm {
    fn new(comm: SimpleCommunicator) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            comm: Mutex::new(comm),
            rank,
            size,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Initialises MPI; keep the returned universe alive until the end of `main`.
pub fn init() -> Result<mpi::environment::Universe> {
    let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Serialized)
        .ok_or_else(|| Error::Invalid("MPI was already initialised".into()))?;
    if level < mpi::Threading::Serialized {
        return Err(Error::Invalid(format!(
            "the MPI library offers thread level {level:?}; genslm needs Serialized (calls from \
             several threads, one at a time)"
        )));
    }
    Ok(universe)
}

/// This process's `Ranks` for a world split into DP × CP × SP × TP (`sp`, `cp` and `tp` given;
/// DP = world / (cp · sp · tp)).
pub fn mpi_ranks(
    universe: &mpi::environment::Universe,
    sp: usize,
    cp: usize,
    tp: usize,
) -> Result<Ranks> {
    let world = universe.world();
    let size = world.size() as usize;
    let group = sp * cp * tp;
    if group == 0 || !size.is_multiple_of(group) {
        return Err(Error::Invalid(format!(
            "mpirun started {size} processes, which --sp {sp} × --cp {cp} × --tp {tp} does not \
             divide"
        )));
    }
    let d = crate::parallel::Degrees {
        dp: size / group,
        cp,
        sp,
        tp,
    };
    let topo = Topology::of(world.rank() as usize, d)?;
    // Colours name each group by what its members share; MPI keeps them in world-rank order,
    // which is the order `Topology`'s group lists use.
    let split = |colour: usize, what: &str| -> Result<Arc<dyn Communicator>> {
        let c = world
            .split_by_color(Color::with_value(colour as i32))
            .ok_or_else(|| Error::Invalid(format!("MPI_Comm_split ({what} group) failed")))?;
        Ok(Arc::new(MpiComm::new(c)))
    };
    let (dp_r, sp_r, tp_r) = (topo.dp_rank(), topo.sp_rank(), topo.tp_rank());
    let tp_comm = split(topo.rank / tp, "TP")?;
    let data_comm = split(tp_r, "data")?;
    let sp_comm = split((topo.rank / (tp * sp)) * tp + tp_r, "SP")?;
    let cp_comm = split((dp_r * sp + sp_r) * tp + tp_r, "CP")?;
    let seq_comm = split(dp_r * tp + tp_r, "sequence")?;
    let dp_comm = split(sp_r * tp + tp_r, "DP")?;
    Ok(Ranks {
        topo,
        world: Arc::new(MpiComm::new(world)),
        tp: tp_comm,
        data: data_comm,
        sp: sp_comm,
        cp: cp_comm,
        seq: seq_comm,
        dp: dp_comm,
        bucket: crate::parallel::bucket::DEFAULT_BUCKET,
    })
}

/// MPI counts are `i32`: a larger buffer gets an error here instead of a panic inside rsmpi
/// (the training paths send large data through `parallel::bucket`, which stays below).
fn count(op: &str, n: usize) -> Result<()> {
    if n > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "MPI {op}: {n} elements exceed MPI's count limit of {}; send it in buckets",
            i32::MAX
        )));
    }
    Ok(())
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        count("all_reduce", buf.len())?;
        let send = buf.to_vec();
        self.lock()
            .all_reduce_into(&send[..], buf, mpi::collective::SystemOperation::sum());
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        count("all_reduce", buf.len())?;
        let send = buf.to_vec();
        self.lock()
            .all_reduce_into(&send[..], buf, mpi::collective::SystemOperation::sum());
        Ok(())
    }

    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        count("all_gather", recv.len())?;
        check_blocks("all_gather", recv.len(), send.len(), self.size)?;
        self.lock().all_gather_into(send, recv);
        Ok(())
    }

    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        count("reduce_scatter", buf.len())?;
        check_blocks("reduce_scatter", buf.len(), out.len(), self.size)?;
        self.lock()
            .reduce_scatter_block_into(buf, out, mpi::collective::SystemOperation::sum());
        Ok(())
    }

    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        count("gather", send.len() * self.size)?;
        let comm = self.lock();
        let at = comm.process_at_rank(root as i32);
        match recv {
            Some(recv) if self.rank == root => {
                check_blocks("gather", recv.len(), send.len(), self.size)?;
                at.gather_into_root(send, recv);
            }
            _ if self.rank == root => {
                return Err(Error::Invalid("gather: the root has no buffer".into()));
            }
            _ => at.gather_into(send),
        }
        Ok(())
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let n = send.first().map_or(0, Vec::len);
        if send.len() != self.size || send.iter().any(|s| s.len() != n) {
            return Err(Error::Invalid("all_to_all: unequal chunks".into()));
        }
        let flat = send.concat();
        count("all_to_all", flat.len())?;
        let mut recv = vec![0f32; flat.len()];
        self.lock().all_to_all_into(&flat[..], &mut recv[..]);
        Ok(recv
            .chunks(n.max(1))
            .map(|c| c.to_vec())
            .take(self.size)
            .collect())
    }

    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        count("ring_pass", send.len())?;
        let comm = self.lock();
        let n = self.size;
        let next = comm.process_at_rank(((self.rank + 1) % n) as i32);
        let prev = comm.process_at_rank(((self.rank + n - 1) % n) as i32);
        let mut recv = vec![0f32; send.len()];
        mpi::point_to_point::send_receive_into(send, &next, &mut recv[..], &prev);
        Ok(recv)
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let comm = self.lock();
        let mut len = [buf.len() as u64];
        comm.process_at_rank(root as i32)
            .broadcast_into(&mut len[..]);
        buf.resize(len[0] as usize, 0.0);
        for piece in buf.chunks_mut(i32::MAX as usize) {
            comm.process_at_rank(root as i32).broadcast_into(piece);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.lock().barrier();
        Ok(())
    }

    fn abort(&self, why: &str) {
        eprintln!("error: rank {}: {why}; aborting all ranks", self.rank);
        self.lock().abort(1);
    }
}
