//! Was this process started by a parallel launcher (mpirun, mpiexec, srun) as one of several
//! ranks? Only variables that a launcher sets *per process* count: `SLURM_NTASKS` alone is set
//! in any `sbatch -n N` script, where a plain `genslm train --dp 4` must still run its ranks as
//! threads of one process. Also where a process sits on its node (local rank, processes per
//! node), which picks its GPU and sizes its CPU thread pool.

/// `(world size, launcher)` when started as one of several ranks by a launcher.
pub fn launched_world_size() -> Option<(usize, &'static str)> {
    detect(|k| std::env::var(k).ok())
}

/// [`launched_world_size`] over any environment (`get` looks a variable up).
pub fn detect(get: impl Fn(&str) -> Option<String>) -> Option<(usize, &'static str)> {
    // (per-process rank variable, world size variable, launcher)
    const LAUNCHERS: [(&str, &str, &str); 4] = [
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "Open MPI's mpirun",
        ),
        ("PMI_RANK", "PMI_SIZE", "an MPICH/PMI launcher"),
        ("PMIX_RANK", "PMIX_SIZE", "a PMIx launcher"),
        ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun"),
    ];
    LAUNCHERS.iter().find_map(|&(rank, size, by)| {
        get(rank)?;
        let n = get(size)?.trim().parse::<usize>().ok()?;
        (n > 1).then_some((n, by))
    })
}

/// Per-process local-rank variables of the launchers (Open MPI, MPICH/Intel MPI, Slurm,
/// torchrun-style), in the order they are consulted.
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "LOCAL_RANK",
];

/// Variables a launcher sets to the number of its processes on this node.
const LOCAL_SIZE_VARS: [&str; 3] = [
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
];

/// This process's rank among the processes of its node, with the variable it came from.
pub fn local_rank(get: impl Fn(&str) -> Option<String>) -> Option<(usize, &'static str)> {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|&k| Some((get(k)?.trim().parse().ok()?, k)))
}

/// How many processes the launcher started on this node, when it says.
pub fn local_size(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    LOCAL_SIZE_VARS
        .iter()
        .find_map(|&k| get(k)?.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An environment of the given variables only.
    pub(crate) fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn batch_scripts_are_not_launches_but_ranks_are() {
        // Inside `sbatch -n 4`, before any srun: threads.
        assert_eq!(
            detect(env(&[("SLURM_NTASKS", "4"), ("SLURM_NPROCS", "4")])),
            None
        );
        // One task of `srun -n 4`.
        assert_eq!(
            detect(env(&[
                ("SLURM_NTASKS", "4"),
                ("SLURM_PROCID", "2"),
                ("SLURM_STEP_NUM_TASKS", "4")
            ])),
            Some((4, "srun"))
        );
        assert_eq!(
            detect(env(&[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "3")
            ])),
            Some((3, "Open MPI's mpirun"))
        );
        assert_eq!(
            detect(env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])).map(|x| x.0),
            Some(2)
        );
        // A single-process launch is not a parallel one.
        assert_eq!(
            detect(env(&[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "1")
            ])),
            None
        );
    }

    #[test]
    fn local_rank_and_size_come_from_per_process_variables() {
        assert_eq!(
            local_rank(env(&[("SLURM_LOCALID", "1")])),
            Some((1, "SLURM_LOCALID"))
        );
        // Garbage is not a local rank.
        assert_eq!(local_rank(env(&[("LOCAL_RANK", "x")])), None);
        assert_eq!(
            local_size(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "4")])),
            Some(4)
        );
        assert_eq!(local_size(env(&[("MPI_LOCALNRANKS", "0")])), None);
        assert_eq!(local_size(env(&[])), None);
    }
}
