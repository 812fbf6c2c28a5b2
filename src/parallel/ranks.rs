//! One rank's view of the parallel layout: its topology and the three groups it talks in.

use std::sync::Arc;
use std::time::Duration;

use crate::parallel::bucket::DEFAULT_BUCKET;
use crate::parallel::comm::{Communicator, Solo};
use crate::parallel::threads::thread_group;
use crate::parallel::topology::Topology;

#[derive(Debug, Clone)]
pub struct Ranks {
    pub topo: Topology,
    /// All DP × SP ranks.
    pub world: Arc<dyn Communicator>,
    /// This rank's SP group (contiguous ranks).
    pub sp: Arc<dyn Communicator>,
    /// This rank's DP group (same SP rank in every DP replica).
    pub dp: Arc<dyn Communicator>,
    /// Elements per call of the bucketed collectives (`parallel::bucket`): gradient
    /// reductions, ZeRO's reduce-scatter and all-gather, checkpoint gathers.
    pub bucket: usize,
}

impl Ranks {
    pub fn single() -> Self {
        Self {
            topo: Topology::single(),
            world: Arc::new(Solo),
            sp: Arc::new(Solo),
            dp: Arc::new(Solo),
            bucket: DEFAULT_BUCKET,
        }
    }

    /// The same ranks with another bucket size.
    pub fn with_bucket(self, bucket: usize) -> Self {
        Self { bucket, ..self }
    }

    pub fn is_root(&self) -> bool {
        self.topo.rank == 0
    }
}

/// The ranks of a `dp × sp` layout as threads of this process, one `Ranks` per thread.
pub fn thread_ranks(dp: usize, sp: usize, timeout: Duration) -> Vec<Ranks> {
    let world = thread_group(dp * sp, timeout);
    let sp_groups: Vec<_> = (0..dp).map(|_| thread_group(sp, timeout)).collect();
    let dp_groups: Vec<_> = (0..sp).map(|_| thread_group(dp, timeout)).collect();
    (0..dp * sp)
        .map(|rank| {
            let topo = Topology::new(rank, dp, sp).expect("rank inside the grid");
            Ranks {
                topo,
                world: Arc::new(world[rank].clone()),
                sp: Arc::new(sp_groups[topo.dp_rank()][topo.sp_rank()].clone()),
                dp: Arc::new(dp_groups[topo.sp_rank()][topo.dp_rank()].clone()),
                bucket: DEFAULT_BUCKET,
            }
        })
        .collect()
}

/// Aborts every group of a rank (so peers in any group stop waiting).
pub fn abort_all(r: &Ranks, why: &str) {
    r.world.abort(why);
    r.sp.abort(why);
    r.dp.abort(why);
}
