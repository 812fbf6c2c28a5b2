//! One rank's view of the parallel layout: its topology and the groups it talks in.

use std::sync::Arc;
use std::time::Duration;

use crate::config::Quantize;
use crate::parallel::bucket::DEFAULT_BUCKET;
use crate::parallel::comm::{Communicator, Solo};
use crate::parallel::hooked::Hooked;
use crate::parallel::netsim::NetSim;
use crate::parallel::progress::Progress;
use crate::parallel::threads::{thread_group, ThreadComm};
use crate::parallel::timed::{ByteCount, CommClock};
use crate::parallel::topology::{Degrees, Topology};

#[derive(Debug, Clone)]
pub struct Ranks {
    pub topo: Topology,
    /// All DP × PP × CP × SP × TP ranks.
    pub world: Arc<dyn Communicator>,
    /// This rank's TP group (contiguous ranks; holds one layer's weights between them).
    pub tp: Arc<dyn Communicator>,
    /// The ranks holding this rank's TP slices of the weights (DP × CP × SP of this TP rank,
    /// [`Topology::data_group`]): gradients sum here; the world when TP is 1.
    pub data: Arc<dyn Communicator>,
    /// This rank's SP group (contiguous ranks).
    pub sp: Arc<dyn Communicator>,
    /// This rank's CP ring (same DP replica and SP rank).
    pub cp: Arc<dyn Communicator>,
    /// The ranks holding one sequence between them (CP × SP of this DP replica).
    pub seq: Arc<dyn Communicator>,
    /// The ranks holding the same parameter shards: the same SP rank in every DP replica and
    /// CP rank ([`Topology::dp_group`]).
    pub dp: Arc<dyn Communicator>,
    /// This rank's pipeline: the same DP, CP, SP and TP rank at every stage
    /// ([`Topology::pp_group`]; member `s` is stage `s`).
    pub pp: Arc<dyn Communicator>,
    /// Elements per call of the bucketed collectives (`parallel::bucket`): gradient
    /// reductions, ZeRO's reduce-scatter and all-gather, checkpoint gathers.
    pub bucket: usize,
    /// Under TP, Megatron sequence parallelism (the region between the layers' blocks split
    /// over the sequence; `model::tensor_parallel`): on unless `--no-megatron-sp`.
    pub megatron_sp: bool,
    /// Whether the groups may run collectives on several threads at once (thread ranks; MPI
    /// at `MPI_THREAD_MULTIPLE`), so that [`Ranks::overlapped`] can give them communication
    /// threads. `None`: they may; `Some(why)`: they may not, and why.
    pub no_overlap: Option<String>,
    /// Quantized collectives (`parallel::quant`; ZeRO++): ZeRO-3's weight all-gathers and the
    /// gradient reductions through host buffers. Unset: fp32.
    pub quantize: Quantized,
}

/// Which collectives travel quantized, and how (`[train] quantize_weights`, `quantize_grads`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quantized {
    pub weights: Option<Quantize>,
    pub grads: Option<Quantize>,
}

impl Ranks {
    pub fn single() -> Self {
        Self {
            topo: Topology::single(),
            world: Arc::new(Solo),
            tp: Arc::new(Solo),
            data: Arc::new(Solo),
            sp: Arc::new(Solo),
            cp: Arc::new(Solo),
            seq: Arc::new(Solo),
            dp: Arc::new(Solo),
            pp: Arc::new(Solo),
            bucket: DEFAULT_BUCKET,
            megatron_sp: true,
            no_overlap: None,
            quantize: Quantized::default(),
        }
    }

    /// The same ranks with quantized collectives (or fp32 ones).
    pub fn with_quantized(self, quantize: Quantized) -> Self {
        Self { quantize, ..self }
    }

    /// The same ranks with another bucket size.
    pub fn with_bucket(self, bucket: usize) -> Self {
        Self { bucket, ..self }
    }

    /// The same ranks with Megatron sequence parallelism on or off under TP.
    pub fn with_megatron_sp(self, megatron_sp: bool) -> Self {
        Self {
            megatron_sp,
            ..self
        }
    }

    /// The same ranks with every group wrapped by `wrap`. Fields that are one communicator
    /// (the world and the data group without TP, on threads) stay one: a group's collectives
    /// must keep one order, which two communication threads over it would not.
    fn wrapped(self, wrap: impl Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator>) -> Self {
        let mut done: Vec<(Arc<dyn Communicator>, Arc<dyn Communicator>)> = Vec::new();
        let mut once = |c: Arc<dyn Communicator>| {
            let same =
                |o: &Arc<dyn Communicator>| std::ptr::addr_eq(Arc::as_ptr(o), Arc::as_ptr(&c));
            if let Some((_, w)) = done.iter().find(|(o, _)| same(o)) {
                return w.clone();
            }
            let w = wrap(c.clone());
            done.push((c, w.clone()));
            w
        };
        Self {
            world: once(self.world),
            tp: once(self.tp),
            data: once(self.data),
            sp: once(self.sp),
            cp: once(self.cp),
            seq: once(self.seq),
            dp: once(self.dp),
            pp: once(self.pp),
            ..self
        }
    }

    /// The same ranks with a communication thread per group of more than one rank (started
    /// collectives overlap compute; `parallel::progress`), where the groups allow it and `on`.
    pub fn overlapped(self, on: bool) -> Self {
        if !on || self.no_overlap.is_some() {
            return self;
        }
        self.wrapped(|c| if c.size() > 1 { Progress::wrap(c) } else { c })
    }

    /// The same ranks behind a simulated network (benchmarks and tests only).
    pub fn delayed(self, net: NetSim) -> Self {
        self.wrapped(|c| Hooked::wrap(c, net))
    }

    /// The same ranks with every group's calls timed into one clock (a step's `comm_wait_s`).
    pub fn timed(self) -> (Self, Arc<CommClock>) {
        let clock = Arc::new(CommClock::default());
        (self.wrapped(|c| Hooked::wrap(c, clock.clone())), clock)
    }

    /// The same ranks with the bytes of every group's calls counted into one total (a step's
    /// `comm_bytes`); wrap before [`Ranks::overlapped`] so started collectives count too.
    pub fn counted(self) -> (Self, Arc<ByteCount>) {
        let count = Arc::new(ByteCount::default());
        (self.wrapped(|c| Hooked::wrap(c, count.clone())), count)
    }

    pub fn is_root(&self) -> bool {
        self.topo.rank == 0
    }
}

/// The ranks of a `dp × sp` layout as threads of this process, one `Ranks` per thread.
pub fn thread_ranks(dp: usize, sp: usize, timeout: Duration) -> Vec<Ranks> {
    thread_grid(Degrees::new(dp, 1, sp), timeout)
}

/// The ranks of a `dp × pp × cp × sp × tp` grid as threads of this process, one `Ranks` per thread.
pub fn thread_grid(d: Degrees, timeout: Duration) -> Vec<Ranks> {
    let n = d.world();
    let topos: Vec<Topology> = (0..n)
        .map(|rank| Topology::of(rank, d).expect("rank inside the grid"))
        .collect();
    // One thread group per distinct member list; each rank takes its handle by position, one
    // handle for every field of its `Ranks` that names the same group. The SP and CP groups are
    // their own even where another field has their members (as under MPI, where every field is
    // a split of its own): Ulysses' exchanges and the ring's passes then run on communication
    // threads of their own, not queued behind the data group's gradient reductions.
    type Handles = Vec<(ThreadComm, Option<Arc<dyn Communicator>>)>;
    let mut groups: std::collections::HashMap<(&str, Vec<usize>), Handles> = Default::default();
    let mut handle = |role: &'static str, members: Vec<usize>, rank: usize| {
        let at = members.iter().position(|&m| m == rank).expect("a member");
        let g = groups.entry((role, members)).or_insert_with_key(|(_, m)| {
            thread_group(m.len(), timeout)
                .into_iter()
                .map(|c| (c, None))
                .collect()
        });
        let (comm, arc) = &mut g[at];
        arc.get_or_insert_with(|| Arc::new(comm.clone())).clone()
    };
    topos
        .into_iter()
        .map(|topo| Ranks {
            topo,
            world: handle("", (0..n).collect(), topo.rank),
            tp: handle("", topo.tp_group(), topo.rank),
            data: handle("", topo.data_group(), topo.rank),
            sp: handle("sp", topo.sp_group(), topo.rank),
            cp: handle("cp", topo.cp_group(), topo.rank),
            seq: handle("", topo.seq_group(), topo.rank),
            dp: handle("", topo.dp_group(), topo.rank),
            pp: handle("", topo.pp_group(), topo.rank),
            bucket: DEFAULT_BUCKET,
            megatron_sp: true,
            no_overlap: None,
            quantize: Quantized::default(),
        })
        .collect()
}

/// Aborts every group of a rank (so peers in any group stop waiting).
pub fn abort_all(r: &Ranks, why: &str) {
    r.world.abort(why);
    r.tp.abort(why);
    r.data.abort(why);
    r.sp.abort(why);
    r.cp.abort(why);
    r.seq.abort(why);
    r.dp.abort(why);
    r.pp.abort(why);
}
