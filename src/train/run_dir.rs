//! The run directory's life: claimed by one run at a time, cleaned of what killed saves left,
//! and pruned to the newest checkpoints.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::train::checkpoint::checkpoints_dir;

/// What a run writes into its directory (removed by `--overwrite`).
const RUN_ENTRIES: [&str; 5] = [
    "checkpoints",
    "metrics.jsonl",
    "config.toml",
    "data.parquet",
    "data.sources.json",
];

/// Makes `run` ready for a run: refuses a fresh run into a directory that already holds one
/// (unless `overwrite`, which removes that run first), creates it if needed, and removes the
/// temporary files of killed saves. Returns whether the directory was created here (so a run
/// that fails before its first step can remove it again).
pub fn claim(run: &Path, resume: bool, overwrite: bool) -> Result<bool> {
    let existing = ["checkpoints/latest", "metrics.jsonl"]
        .iter()
        .map(|e| run.join(e))
        .filter(|p| p.exists())
        .collect::<Vec<_>>();
    if !resume && !existing.is_empty() {
        if !overwrite {
            return Err(Error::Invalid(format!(
                "{} already holds a run ({}): pass --resume to continue it, --overwrite to \
                 replace it, or choose another --out",
                run.display(),
                existing
                    .iter()
                    .map(|p| p.strip_prefix(run).unwrap_or(p).display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        for e in RUN_ENTRIES {
            let p = run.join(e);
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else if p.exists() {
                std::fs::remove_file(&p)
            } else {
                Ok(())
            };
            r.map_err(|e| Error::io(&p, e))?;
        }
    }
    let created = !run.exists();
    std::fs::create_dir_all(run).map_err(|e| Error::io(run, e))?;
    clean_stale(run)?;
    Ok(created)
}

/// Removes the temporary entries (`.NAME.tmp-PID`, `.step-N.tmp/`, `.data.parquet.new`)
/// that a killed save leaves in the run and checkpoint directories. Only the process that
/// prepares the run calls it, before any rank writes.
pub fn clean_stale(run: &Path) -> Result<()> {
    for dir in [run.to_path_buf(), checkpoints_dir(run)] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let temporary =
                name.contains(".tmp-") || name.ends_with(".tmp") || name.ends_with(".new");
            if name.starts_with('.') && temporary {
                let p = e.path();
                let r = if p.is_dir() {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
                r.map_err(|e| Error::io(&p, e))?;
            }
        }
    }
    Ok(())
}

/// Keeps the newest `keep` checkpoint directories (`step-N`) and removes older ones; the one
/// `latest` names is never removed. `keep == 0` keeps all.
pub fn prune_checkpoints(run: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let root = checkpoints_dir(run);
    let latest = std::fs::read_to_string(root.join("latest")).unwrap_or_default();
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(&root)
        .map_err(|e| Error::io(&root, e))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            (name != latest.trim()).then(|| (n, e.path()))
        })
        .collect();
    steps.sort();
    // `latest` itself is one of the kept ones.
    let removable = steps.len().saturating_sub(keep.saturating_sub(1));
    for (_, p) in steps.into_iter().take(removable) {
        std::fs::remove_dir_all(&p).map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}
