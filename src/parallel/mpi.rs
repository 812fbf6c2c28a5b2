//! MPI communicator (feature `mpi`): one rank per process, launched by `mpirun`/`srun`.
//!
//! The world is split into the groups of [`Topology`] (TP, SP, CP, sequence, DP, data,
//! pipeline) with `MPI_Comm_split`. A rank that fails calls `MPI_Abort`, which ends every process of the job
//! with a non-zero status, so no rank waits forever.
//!
//! MPI's counts are `i32`: every operation here is sent in pieces of at most
//! [`MpiComm::max_count`] elements (2³¹−1), so a ring pass, tensor-parallel all-reduce or
//! Ulysses all-to-all of any size goes through instead of failing mid-step. Blocked
//! collectives (all-gather, reduce-scatter, gather, all-to-all) are cut within each rank's
//! block, so every piece is itself a well-formed collective. `GENSLM_MPI_MAX_COUNT` lowers the
//! piece size, so that the pieced path is tested at small sizes (`scripts/check_mpi.sh`).

use std::sync::{Arc, Mutex};

use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, Communicator as _, Process, SimpleCommunicator};
use mpi::traits::*;

use crate::error::{Error, Result};
use crate::parallel::comm::{check_blocks, check_peer, Communicator};
use crate::parallel::ranks::Ranks;
use crate::parallel::topology::{Degrees, Topology};

/// An MPI communicator. MPI is initialised with `Threading::Multiple` where the library offers
/// it (each group's communication thread and the rank's own thread then call MPI at once, on
/// different communicators), else `Serialized`, where overlap stays off and one thread calls
/// at a time. Calls on one communicator never overlap: the mutex serialises them (`Funneled`
/// would require every call to come from the thread that initialised MPI, which a Rust handle
/// shared between threads cannot promise).
pub struct MpiComm {
    comm: Mutex<SimpleCommunicator>,
    /// Point-to-point sends in flight (locked after `comm`).
    outbox: Mutex<Outbox>,
    rank: usize,
    size: usize,
    /// Most elements one MPI call carries.
    max_count: usize,
}

/// Sends in flight: `MPI_Isend` requests, each over a copy of its piece that stays allocated
/// until the request completes. A send thus never waits for its receive, as on threads: two
/// pipeline stages may both send (an activation forward, a gradient back) before either
/// receives, where blocking sends of rendezvous size would wait for each other forever. MPI
/// matches messages between two ranks in the order their sends were posted, so they still
/// arrive in order.
#[derive(Default)]
struct Outbox(Vec<(Request<'static, [f32]>, *mut [f32])>);

impl Outbox {
    /// Posts a non-blocking send of a copy of `piece` to `peer`.
    fn post(&mut self, peer: &Process<'_>, piece: &[f32]) {
        let copy: *mut [f32] = Box::into_raw(piece.to_vec().into_boxed_slice());
        // SAFETY: the copy is only read by MPI, and freed (`free`) once its request completed.
        let req = peer.immediate_send(StaticScope, unsafe { &*copy });
        self.0.push((req, copy));
    }

    /// Frees the copies of the sends that completed.
    fn reap(&mut self) {
        for (req, copy) in std::mem::take(&mut self.0) {
            match req.test() {
                Ok(_) => free(copy),
                Err(req) => self.0.push((req, copy)),
            }
        }
    }

    /// Waits for every send in flight.
    fn wait_all(&mut self) {
        for (req, copy) in self.0.drain(..) {
            req.wait();
            free(copy);
        }
    }
}

/// Frees a send's copy whose request has completed.
fn free(copy: *mut [f32]) {
    // SAFETY: made by `Box::into_raw` in `Outbox::post`; its request is complete, so MPI no
    // longer reads it, and nothing else holds it.
    drop(unsafe { Box::from_raw(copy) });
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // MPI must not finalise with sends in flight (nor may a request be dropped incomplete).
        let _comm = self.lock();
        self.outbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .wait_all();
    }
}

// SAFETY: see the type's comment: MPI runs `Multiple` or `Serialized` (then one thread calls
// MPI at a time), and the mutex serialises the calls on each communicator.
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
        // A bad value is refused before a run starts (train::fault::check_hooks); here, where
        // no error can be returned, it falls back to MPI's own limit.
        let max_count = crate::parallel::comm::mpi_max_count().unwrap_or(i32::MAX as usize);
        Self {
            comm: Mutex::new(comm),
            outbox: Mutex::new(Outbox::default()),
            rank,
            size,
            max_count,
        }
    }

    /// Elements of each rank's block per piece of a blocked collective (whose count is the
    /// whole `size` blocks).
    fn per_block(&self) -> usize {
        (self.max_count / self.size.max(1)).max(1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The thread level MPI gave, when below `Multiple` (set by [`init`]): overlapped collectives
/// (`parallel::progress`) need several threads in MPI at once.
static BELOW_MULTIPLE: std::sync::OnceLock<mpi::Threading> = std::sync::OnceLock::new();

/// Initialises MPI; keep the returned universe alive until the end of `main`. Asks for
/// `MPI_THREAD_MULTIPLE` (communication threads of several groups call MPI at once, issue 42);
/// a library that offers `Serialized` only still runs, with blocking collectives.
pub fn init() -> Result<mpi::environment::Universe> {
    let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| Error::Invalid("MPI was already initialised".into()))?;
    if level < mpi::Threading::Serialized {
        return Err(Error::Invalid(format!(
            "the MPI library offers thread level {level:?}; genslm needs Serialized (calls from \
             several threads, one at a time)"
        )));
    }
    if level < mpi::Threading::Multiple {
        let _ = BELOW_MULTIPLE.set(level);
    }
    Ok(universe)
}

/// This process's `Ranks` for a world split into DP × PP × CP × SP × TP (`d`'s PP, CP, SP
/// and TP degrees; DP = world / (pp · cp · sp · tp), whatever `d.dp` says).
pub fn mpi_ranks(universe: &mpi::environment::Universe, d: Degrees) -> Result<Ranks> {
    let world = universe.world();
    let size = world.size() as usize;
    let Degrees { pp, cp, sp, tp, .. } = d;
    let group = pp * sp * cp * tp;
    if group == 0 || !size.is_multiple_of(group) {
        return Err(Error::Invalid(format!(
            "mpirun started {size} processes, which --pp {pp} × --sp {sp} × --cp {cp} × --tp {tp} \
             does not divide"
        )));
    }
    let d = Degrees {
        dp: size / group,
        ..d
    };
    let topo = Topology::of(world.rank() as usize, d)?;
    // Each group's colour is its lowest world rank (the groups of one kind partition the
    // world); MPI keeps members in world-rank order, which is the order `Topology`'s lists use.
    let split = |members: Vec<usize>, what: &str| -> Result<Arc<dyn Communicator>> {
        let colour = members.iter().copied().min().unwrap_or(topo.rank);
        let c = world
            .split_by_color(Color::with_value(colour as i32))
            .ok_or_else(|| Error::Invalid(format!("MPI_Comm_split ({what} group) failed")))?;
        Ok(Arc::new(MpiComm::new(c)))
    };
    Ok(Ranks {
        topo,
        tp: split(topo.tp_group(), "TP")?,
        data: split(topo.data_group(), "data")?,
        sp: split(topo.sp_group(), "SP")?,
        cp: split(topo.cp_group(), "CP")?,
        seq: split(topo.seq_group(), "sequence")?,
        dp: split(topo.dp_group(), "DP")?,
        pp: split(topo.pp_group(), "pipeline")?,
        world: Arc::new(MpiComm::new(world)),
        bucket: crate::parallel::bucket::DEFAULT_BUCKET,
        megatron_sp: true,
        no_overlap: BELOW_MULTIPLE.get().map(|level| {
            format!(
                "the MPI library offers thread level {level:?}, not Multiple, so collectives \
                 stay on the rank's thread"
            )
        }),
        quantize: Default::default(),
    })
}

/// `(offset, len)` of the pieces of at most `per` elements that `len` elements are sent in.
/// The same on every rank for the same lengths, so each piece is one collective everywhere.
fn pieces(len: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    (0..len.div_ceil(per)).map(move |i| (i * per, per.min(len - i * per)))
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let comm = self.lock();
        for piece in buf.chunks_mut(self.max_count) {
            let send = piece.to_vec();
            comm.all_reduce_into(&send[..], piece, mpi::collective::SystemOperation::sum());
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        let comm = self.lock();
        for piece in buf.chunks_mut(self.max_count) {
            let send = piece.to_vec();
            comm.all_reduce_into(&send[..], piece, mpi::collective::SystemOperation::sum());
        }
        Ok(())
    }

    fn all_gather_into(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks("all_gather", recv.len(), send.len(), self.size)?;
        let (comm, b) = (self.lock(), send.len());
        for (at, len) in pieces(b, self.per_block()) {
            let mut got = vec![0f32; len * self.size];
            comm.all_gather_into(&send[at..at + len], &mut got[..]);
            for (r, block) in got.chunks(len).enumerate() {
                recv[r * b + at..][..len].copy_from_slice(block);
            }
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, buf: &[f32], out: &mut [f32]) -> Result<()> {
        check_blocks("reduce_scatter", buf.len(), out.len(), self.size)?;
        let (comm, b) = (self.lock(), out.len());
        for (at, len) in pieces(b, self.per_block()) {
            let send: Vec<f32> = (0..self.size)
                .flat_map(|r| &buf[r * b + at..][..len])
                .copied()
                .collect();
            comm.reduce_scatter_block_into(
                &send[..],
                &mut out[at..at + len],
                mpi::collective::SystemOperation::sum(),
            );
        }
        Ok(())
    }

    fn gather_into(&self, send: &[f32], recv: Option<&mut [f32]>, root: usize) -> Result<()> {
        let comm = self.lock();
        let at_root = comm.process_at_rank(root as i32);
        let b = send.len();
        let mut recv = match recv {
            Some(recv) if self.rank == root => {
                check_blocks("gather", recv.len(), b, self.size)?;
                Some(recv)
            }
            _ if self.rank == root => {
                return Err(Error::Invalid("gather: the root has no buffer".into()));
            }
            _ => None,
        };
        for (at, len) in pieces(b, self.per_block()) {
            let piece = &send[at..at + len];
            match recv.as_deref_mut() {
                Some(recv) => {
                    let mut got = vec![0f32; len * self.size];
                    at_root.gather_into_root(piece, &mut got[..]);
                    for (r, block) in got.chunks(len).enumerate() {
                        recv[r * b + at..][..len].copy_from_slice(block);
                    }
                }
                None => at_root.gather_into(piece),
            }
        }
        Ok(())
    }

    fn all_to_all(&self, send: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let n = send.first().map_or(0, Vec::len);
        if send.len() != self.size || send.iter().any(|s| s.len() != n) {
            return Err(Error::Invalid("all_to_all: unequal chunks".into()));
        }
        let comm = self.lock();
        let mut out = vec![Vec::with_capacity(n); self.size];
        for (at, len) in pieces(n, self.per_block()) {
            let flat: Vec<f32> = send
                .iter()
                .flat_map(|s| &s[at..at + len])
                .copied()
                .collect();
            let mut got = vec![0f32; flat.len()];
            comm.all_to_all_into(&flat[..], &mut got[..]);
            for (o, block) in out.iter_mut().zip(got.chunks(len)) {
                o.extend_from_slice(block);
            }
        }
        Ok(out)
    }

    fn ring_pass(&self, send: &[f32]) -> Result<Vec<f32>> {
        let comm = self.lock();
        let n = self.size;
        let next = comm.process_at_rank(((self.rank + 1) % n) as i32);
        let prev = comm.process_at_rank(((self.rank + n - 1) % n) as i32);
        // Every rank of the ring passes blocks of one length (the zigzag chunks are equal).
        let mut recv = vec![0f32; send.len()];
        for (at, len) in pieces(send.len(), self.max_count) {
            mpi::point_to_point::send_receive_into(
                &send[at..at + len],
                &next,
                &mut recv[at..at + len],
                &prev,
            );
        }
        Ok(recv)
    }

    /// Both directions at once: for each piece the two receives and the two sends are posted
    /// together (non-blocking) and waited for together, so an exchange costs one latency, not
    /// the two of a forward `sendrecv` followed by a backward one. Each direction has its own
    /// tag: on two ranks the next rank is the previous one, and the tags keep the forward and
    /// the backward block apart.
    fn ring_pass_both(&self, fwd: &[f32], back: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        const FORWARD: mpi::Tag = 1;
        const BACK: mpi::Tag = 2;
        let comm = self.lock();
        let n = self.size;
        let next = comm.process_at_rank(((self.rank + 1) % n) as i32);
        let prev = comm.process_at_rank(((self.rank + n - 1) % n) as i32);
        let (mut from_prev, mut from_next) = (vec![0f32; fwd.len()], vec![0f32; back.len()]);
        let (pf, pb): (Vec<_>, Vec<_>) = (
            pieces(fwd.len(), self.max_count).collect(),
            pieces(back.len(), self.max_count).collect(),
        );
        for i in 0..pf.len().max(pb.len()) {
            let (f, b) = (pf.get(i).copied(), pb.get(i).copied());
            let (got_f, got_b) = (&mut from_prev, &mut from_next);
            mpi::request::scope(|scope| {
                let r_f = f.map(|(at, len)| {
                    prev.immediate_receive_into_with_tag(scope, &mut got_f[at..at + len], FORWARD)
                });
                let r_b = b.map(|(at, len)| {
                    next.immediate_receive_into_with_tag(scope, &mut got_b[at..at + len], BACK)
                });
                let s_f = f.map(|(at, len)| {
                    next.immediate_send_with_tag(scope, &fwd[at..at + len], FORWARD)
                });
                let s_b = b.map(|(at, len)| {
                    prev.immediate_send_with_tag(scope, &back[at..at + len], BACK)
                });
                for r in [r_f, r_b, s_f, s_b].into_iter().flatten() {
                    r.wait();
                }
            });
        }
        Ok((from_prev, from_next))
    }

    fn send(&self, to: usize, buf: &[f32]) -> Result<()> {
        check_peer("send", to, self.size)?;
        let comm = self.lock();
        let mut outbox = self.outbox.lock().unwrap_or_else(|p| p.into_inner());
        outbox.reap();
        let peer = comm.process_at_rank(to as i32);
        for (at, len) in pieces(buf.len(), self.max_count) {
            outbox.post(&peer, &buf[at..at + len]);
        }
        Ok(())
    }

    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()> {
        check_peer("recv", from, self.size)?;
        let comm = self.lock();
        let peer = comm.process_at_rank(from as i32);
        for (at, len) in pieces(buf.len(), self.max_count) {
            let status = peer.receive_into(&mut buf[at..at + len]);
            let got = status.count(f32::equivalent_datatype()) as usize;
            if got != len {
                return Err(Error::Invalid(format!(
                    "recv: rank {} expected {len} elements from rank {from}, which sent {got}",
                    self.rank
                )));
            }
        }
        Ok(())
    }

    fn send_recv(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) -> Result<()> {
        check_peer("send_recv", to, self.size)?;
        check_peer("send_recv", from, self.size)?;
        // MPI_Sendrecv piece by piece: both sides cut at the same offsets, as send/recv do.
        // The two buffers may differ in length; the shorter one's pieces end first.
        let comm = self.lock();
        let (dest, source) = (
            comm.process_at_rank(to as i32),
            comm.process_at_rank(from as i32),
        );
        let (mut s, mut r) = (
            pieces(send.len(), self.max_count),
            pieces(recv.len(), self.max_count),
        );
        loop {
            match (s.next(), r.next()) {
                (Some((sa, sl)), Some((ra, rl))) => {
                    mpi::point_to_point::send_receive_into(
                        &send[sa..sa + sl],
                        &dest,
                        &mut recv[ra..ra + rl],
                        &source,
                    );
                }
                (Some((sa, sl)), None) => dest.send(&send[sa..sa + sl]),
                (None, Some((ra, rl))) => {
                    source.receive_into(&mut recv[ra..ra + rl]);
                }
                (None, None) => return Ok(()),
            }
        }
    }

    fn broadcast(&self, buf: &mut Vec<f32>, root: usize) -> Result<()> {
        let comm = self.lock();
        let mut len = [buf.len() as u64];
        comm.process_at_rank(root as i32)
            .broadcast_into(&mut len[..]);
        buf.resize(len[0] as usize, 0.0);
        for piece in buf.chunks_mut(self.max_count) {
            comm.process_at_rank(root as i32).broadcast_into(piece);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let comm = self.lock();
        comm.barrier();
        // Frees the copies of the sends the barrier saw through (a stage's whole parameters
        // after a checkpoint's gather).
        self.outbox.lock().unwrap_or_else(|p| p.into_inner()).reap();
        Ok(())
    }

    fn abort(&self, why: &str) {
        eprintln!("error: rank {}: {why}; aborting all ranks", self.rank);
        self.lock().abort(1);
    }
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_tile_the_buffer_exactly_once() {
        for len in [0, 1, 5, 6, 7, 1000] {
            for per in [1, 2, 3, 6, 7, 5000] {
                let mut covered = vec![0u8; len];
                let mut next = 0;
                for (at, n) in pieces(len, per) {
                    assert_eq!(at, next, "contiguous, in order");
                    assert!(n >= 1 && n <= per, "{len}/{per}: piece of {n}");
                    covered[at..at + n].iter_mut().for_each(|c| *c += 1);
                    next = at + n;
                }
                assert!(covered.iter().all(|&c| c == 1), "{len}/{per}");
            }
        }
    }
}
