//! Was this process started by a parallel launcher (mpirun, mpiexec, srun) as one of several
//! ranks? Only variables that a launcher sets *per process* count: `SLURM_NTASKS` alone is set
//! in any `sbatch -n N` script, where a plain `genslm train --dp 4` must still run its ranks as
//! threads of one process. Also where a process sits on its node (local rank, processes per
//! node), which picks its GPU and sizes its CPU thread pool.

/// A launch: this process's rank among `world` processes, and the launcher that says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world: usize,
    pub launcher: &'static str,
}

/// The launcher genslm cannot join: torchrun's ranks meet through its rendezvous (a TCP
/// store), not MPI.
pub const TORCHRUN: &str = "torchrun";

/// The launch this process is part of, when started as one of several ranks; an error naming
/// the variables when a launcher's are malformed or contradict each other.
pub fn launched() -> Result<Option<Launch>, String> {
    detect(|k| std::env::var(k).ok())
}

/// [`launched`] over any environment (`get` looks a variable up).
pub fn detect(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>, String> {
    // (per-process rank variable, world size variable, launcher)
    const LAUNCHERS: [(&str, &str, &str); 5] = [
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "Open MPI's mpirun",
        ),
        ("PMI_RANK", "PMI_SIZE", "an MPICH/PMI launcher"),
        ("PMIX_RANK", "PMIX_SIZE", "a PMIx launcher"),
        ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun"),
        // torchrun, and the launchers that copy it (deepspeed, accelerate): recognised so that
        // its processes are refused together instead of racing for one run directory.
        ("RANK", "WORLD_SIZE", TORCHRUN),
    ];
    for (rank_var, size_var, launcher) in LAUNCHERS {
        let Some(rank) = get(rank_var) else {
            continue;
        };
        // `sbatch` sets SLURM_PROCID=0 for the batch script, with no step size: no launch.
        let Some(size) = get(size_var) else {
            continue;
        };
        let number = |var: &str, v: &str| {
            v.trim().parse::<usize>().map_err(|_| {
                let what = if v.trim().parse::<i64>().is_ok() {
                    "negative, where ranks and sizes count from 0"
                } else {
                    "not a whole number"
                };
                format!(
                    "{var}={v:?} ({launcher}): {what}; genslm reads it to know its rank \
                     (unset it, or start genslm with the launcher that sets it)"
                )
            })
        };
        let (rank, world) = (number(rank_var, &rank)?, number(size_var, &size)?);
        if world == 0 || rank >= world {
            return Err(format!(
                "{rank_var}={rank} with {size_var}={world} ({launcher}): a rank must be below \
                 the number of processes; unset them, or start genslm with the launcher that \
                 sets them"
            ));
        }
        if world > 1 {
            return Ok(Some(Launch {
                rank,
                world,
                launcher,
            }));
        }
        return Ok(None);
    }
    Ok(None)
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

/// Refuses a local-rank variable that is set but no number: the GPU would silently come from
/// the next variable, or be GPU 0 for every process of the node.
pub fn check_local_rank(get: impl Fn(&str) -> Option<String>) -> Result<(), String> {
    for var in LOCAL_RANK_VARS {
        if let Some(v) = get(var) {
            if v.trim().parse::<usize>().is_err() {
                return Err(format!(
                    "{var}={v:?}: not a local rank (a number from 0); it picks this process's \
                     GPU. Unset it, or pass --device"
                ));
            }
        }
    }
    Ok(())
}

/// How many processes the launcher started on this node, when it says.
pub fn local_size(get: impl Fn(&str) -> Option<String>) -> Option<usize> {
    // The first that says a positive number: a 0 or a word falls through to the next, as
    // `unread_local_size` says it does (a 0 stopped the search, and all cores were taken).
    LOCAL_SIZE_VARS.iter().find_map(|&k| processes(&get(k)?))
}

/// A local-size value as a number of processes: a positive whole number, else none.
fn processes(v: &str) -> Option<usize> {
    v.trim().parse().ok().filter(|&n| n > 0)
}

/// A local-size variable consulted but unread (set to no positive number), in words: the
/// threads per process then come from the next variable or all the cores, which oversubscribes
/// the node without a word.
pub fn unread_local_size(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    // The first variable set; read, it says nothing.
    let (i, var, v) =
        (LOCAL_SIZE_VARS.iter().enumerate()).find_map(|(i, &k)| Some((i, k, get(k)?)))?;
    if processes(&v).is_some() {
        return None;
    }
    let instead = LOCAL_SIZE_VARS[i + 1..]
        .iter()
        .find(|&&k| get(k).as_deref().and_then(processes).is_some())
        .map_or("all the cores".to_string(), |k| k.to_string());
    Some(format!(
        "{var}={v:?} is not a number of processes on this node: ignored, and each process \
         takes its CPU threads from {instead}; pass --threads to set them"
    ))
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
        let world = |vars: &[(&str, &str)]| detect(env(vars)).unwrap().map(|l| l.world);
        // Inside `sbatch -n 4`, before any srun: threads. (The batch step sets SLURM_PROCID.)
        assert_eq!(
            world(&[
                ("SLURM_NTASKS", "4"),
                ("SLURM_NPROCS", "4"),
                ("SLURM_PROCID", "0")
            ]),
            None
        );
        // One task of `srun -n 4`.
        assert_eq!(
            detect(env(&[
                ("SLURM_NTASKS", "4"),
                ("SLURM_PROCID", "2"),
                ("SLURM_STEP_NUM_TASKS", "4")
            ])),
            Ok(Some(Launch {
                rank: 2,
                world: 4,
                launcher: "srun"
            }))
        );
        assert_eq!(
            world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "3")]),
            Some(3)
        );
        assert_eq!(world(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]), Some(2));
        let torch = detect(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
        ]));
        assert_eq!(torch.unwrap().unwrap().launcher, TORCHRUN);
        // A single-process launch is not a parallel one.
        assert_eq!(
            world(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "1")]),
            None
        );
    }

    /// A launcher's variables that cannot be a launch were ignored: the process trained alone,
    /// as if it were the only one.
    #[test]
    fn malformed_or_contradicting_launch_variables_are_named() {
        for (vars, want) in [
            (
                &[
                    ("OMPI_COMM_WORLD_RANK", "0"),
                    ("OMPI_COMM_WORLD_SIZE", "-2"),
                ][..],
                "OMPI_COMM_WORLD_SIZE=\"-2\" (Open MPI's mpirun): negative",
            ),
            (
                &[("PMI_RANK", "0"), ("PMI_SIZE", "abc")],
                "PMI_SIZE=\"abc\" (an MPICH/PMI launcher): not a whole number",
            ),
            (
                &[("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "1")],
                "OMPI_COMM_WORLD_RANK=5 with OMPI_COMM_WORLD_SIZE=1",
            ),
            (&[("RANK", "x"), ("WORLD_SIZE", "4")], "RANK=\"x\""),
            (&[("PMIX_RANK", "0"), ("PMIX_SIZE", "0")], "PMIX_SIZE=0"),
        ] {
            let e = detect(env(vars)).unwrap_err();
            assert!(e.contains(want), "{vars:?}: {e}");
        }
    }

    #[test]
    fn local_rank_and_size_come_from_per_process_variables() {
        assert_eq!(
            local_rank(env(&[("SLURM_LOCALID", "1")])),
            Some((1, "SLURM_LOCALID"))
        );
        // Garbage is not a local rank, and is named before a GPU is chosen.
        assert_eq!(local_rank(env(&[("LOCAL_RANK", "x")])), None);
        let e = check_local_rank(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "-1")])).unwrap_err();
        assert!(e.contains("OMPI_COMM_WORLD_LOCAL_RANK=\"-1\""), "{e}");
        assert!(check_local_rank(env(&[("SLURM_LOCALID", "3")])).is_ok());
        assert_eq!(
            local_size(env(&[("OMPI_COMM_WORLD_LOCAL_SIZE", "4")])),
            Some(4)
        );
        assert_eq!(local_size(env(&[("MPI_LOCALNRANKS", "0")])), None);
        // A value not read is said, naming what was used instead; one after the used is not.
        let w = unread_local_size(env(&[("MPI_LOCALNRANKS", "abc")])).unwrap();
        assert!(
            w.contains("MPI_LOCALNRANKS=\"abc\"") && w.contains("all the cores"),
            "{w}"
        );
        let w = unread_local_size(env(&[
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "0"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ]))
        .unwrap();
        assert!(w.contains("from SLURM_NTASKS_PER_NODE"), "{w}");
        let both = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "0"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ];
        assert_eq!(local_size(env(&both)), Some(4), "what the warning says");
        let fine = [
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MPI_LOCALNRANKS", "abc"),
        ];
        assert_eq!(unread_local_size(env(&fine)), None);
        assert_eq!(unread_local_size(env(&[])), None);
        assert_eq!(local_size(env(&[])), None);
    }
}
