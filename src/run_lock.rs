//! One process at a time in a run directory: an advisory lock (`flock`) on `DIR/.genslm.lock`,
//! taken before anything in the directory is read for a resume, removed by `--overwrite` or
//! cleaned, and held until the run ends. The kernel drops it when the holder exits, however it
//! exits, so a crashed or killed run never blocks the next one; the file itself stays (removing
//! it would let two processes lock two different files of one name).
//!
//! Linux's NFS client (v4, and v3 through its lock manager) turns `flock` into a lock the
//! server sees from every machine; Lustre and BeeGFS do only when mounted with their lock
//! option (`-o flock`), and refuse it otherwise — then the run goes on after a warning that
//! says nothing stops a second run, rather than not at all.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// The lock file's name inside a run directory.
pub const LOCK_FILE: &str = ".genslm.lock";

/// What marks a directory as holding a run (its progress).
pub const RUN_MARKERS: [&str; 2] = ["checkpoints", "metrics.jsonl"];
/// The other files a run writes, from its first moments (before any step).
pub const RUN_FILES: [&str; 3] = ["config.toml", "data.parquet", "data.sources.json"];

/// A held lock; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct RunLock {
    _file: Option<File>,
    pub path: PathBuf,
    _owner: RunOwner,
}

/// The run directories this process writes for (canonical paths; one entry per claim).
static OWNED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// This process's claim to write a run directory's own files: the lock's holder has one, and
/// so do the other ranks of a run (under MPI only rank 0 locks, the others write their
/// optimizer shards). Dropped, the claim ends.
#[derive(Debug)]
pub struct RunOwner(PathBuf);

impl RunOwner {
    pub fn register(dir: &Path) -> RunOwner {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        OWNED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dir.clone());
        RunOwner(dir)
    }
}

impl Drop for RunOwner {
    fn drop(&mut self) {
        let mut owned = OWNED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = owned.iter().position(|d| *d == self.0) {
            owned.remove(i);
        }
    }
}

/// Whether `dir` holds a run: its lock file, or a checkpoint.
fn is_run(dir: &Path) -> bool {
    dir.join(LOCK_FILE).is_file() || dir.join("checkpoints").join("latest").is_file()
}

/// The directory holding `path`: its parent, or `.` for a bare file name (whose parent is "").
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The run `path` is or belongs to (its directory, one of its files, anything under its
/// `checkpoints/`): for messages that point a user who named a part of a run to the run.
pub fn run_holding(path: &Path) -> Option<PathBuf> {
    if path.join("checkpoints").join("latest").is_file() {
        return Some(path.to_path_buf());
    }
    run_of(path)
}

/// The run directory `target` is one of the own files of: a run's markers, files or lock in
/// its directory, or anything under its `checkpoints/`.
fn run_of(target: &Path) -> Option<PathBuf> {
    let parent = parent_dir(target);
    let name = target.file_name()?.to_str().unwrap_or("");
    let own = RUN_MARKERS.contains(&name) || RUN_FILES.contains(&name) || name == LOCK_FILE;
    if own && is_run(parent) {
        return Some(parent.to_path_buf());
    }
    // Anything under a run's `checkpoints/`, however deep.
    let mut dirs = parent.ancestors().filter(|d| !d.as_os_str().is_empty());
    dirs.find_map(|d| {
        let up = d.parent().filter(|u| !u.as_os_str().is_empty());
        let up = up.unwrap_or(Path::new("."));
        (d.file_name()? == "checkpoints" && is_run(up)).then(|| up.to_path_buf())
    })
}

/// Refuses `target` where it is one of a run's own files (checkpoints, metrics, config,
/// dataset, lock) and this process does not write for that run: `embed --out RUN/metrics.jsonl`
/// or `score --per-token RUN/checkpoints/step-4/optimizer-….safetensors` replaced a run's
/// history or checkpoint, even while its `train` held the lock.
pub fn check_not_a_runs_file(target: &Path) -> Result<()> {
    let Some(run) = run_of(target) else {
        return Ok(());
    };
    let canon = run.canonicalize().unwrap_or_else(|_| run.clone());
    if OWNED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&canon)
    {
        return Ok(());
    }
    Err(Error::Invalid(format!(
        "{}: a file of the run in {} (its checkpoints, metrics, config, dataset or lock), \
         which only that run's train writes; nothing was written. Choose another output path \
         (other names inside {} are fine)",
        target.display(),
        run.display(),
        run.display()
    )))
}

impl RunLock {
    /// Locks `dir` (which must exist) for `what` (e.g. "train"), or says who holds it.
    pub fn acquire(dir: &Path, what: &str) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        // The lock file is written (who holds it): a symbolic link planted in its place would
        // have its target overwritten (a user's file, anything the user may write), and a
        // named pipe or directory gave a bare "Invalid argument". Only a plain file, or none.
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            if !m.file_type().is_file() {
                let what = if m.file_type().is_symlink() {
                    "a symbolic link"
                } else {
                    crate::error::not_a_file(&path)
                };
                return Err(Error::Invalid(format!(
                    "{}: {what}, where genslm keeps its lock file (a plain file); nothing was \
                     changed. Remove it, or choose another --out",
                    path.display()
                )));
            }
        }
        let mut open = OpenOptions::new();
        open.read(true).write(true).create(true).truncate(false);
        // Closes the window between the check and the open: a link made meanwhile fails.
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut open, libc::O_NOFOLLOW);
        let file = open.open(&path).map_err(|e| Error::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                // The holder wrote who it is right after locking; a reader may catch the
                // moment between, hence the fallback.
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                return Err(Error::Invalid(format!(
                    "{}: in use by another genslm ({}); nothing was changed. Wait for it to end \
                     (the lock goes when that process exits, even if it is killed), or choose \
                     another --out",
                    dir.display(),
                    if holder.is_empty() {
                        "it is starting"
                    } else {
                        holder
                    }
                )));
            }
            Err(TryLockError::Error(e)) if unsupported(&e) => {
                eprintln!(
                    "warning: {}: this file system does not support file locks ({e}); nothing \
                     stops a second run from writing into this directory at the same time",
                    path.display()
                );
                return Ok(RunLock {
                    _file: None,
                    path,
                    _owner: RunOwner::register(dir),
                });
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        let who = holder_line(what);
        let written = (|| {
            file.set_len(0)?;
            (&file).write_all(who.as_bytes())
        })();
        written.map_err(|e| Error::io(&path, e))?;
        Ok(RunLock {
            _file: Some(file),
            path,
            _owner: RunOwner::register(dir),
        })
    }
}

/// Locks the directory that will hold `file` for `what` when it is a run directory (it holds
/// [`LOCK_FILE`]): `tokenize --out RUN/data.parquet` must not race a live `train` in RUN.
pub fn if_in_run_dir(file: &Path, what: &str) -> Result<Option<RunLock>> {
    let dir = parent_dir(file);
    if !dir.join(LOCK_FILE).is_file() {
        return Ok(None);
    }
    RunLock::acquire(dir, what).map(Some)
}

/// Errors a file system without locks answers `flock` with.
fn unsupported(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::Unsupported;
    // ENOLCK (37), ENOSYS (38), EOPNOTSUPP (95): what NFS without a lock manager, Lustre and
    // BeeGFS without their lock option, and FUSE file systems return.
    e.kind() == Unsupported || matches!(e.raw_os_error(), Some(37 | 38 | 95))
}

/// Who holds the lock, for the message a second process prints.
fn holder_line(what: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "an unknown host".into());
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "genslm {what}, process {} on {host}, since {}\n",
        std::process::id(),
        utc(since)
    )
}

/// `secs` after the Unix epoch as a UTC date and time (`2026-11-29 15:20:03 UTC`): the days
/// to a civil date by the proleptic Gregorian calendar's 400-year cycle.
fn utc(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    // Days from 0000-03-01, so that the leap day ends each cycle's year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dates from `date -u -d @SECS` (GNU coreutils), not from this code.
    #[test]
    fn lock_times_read_as_utc_dates() {
        for (secs, want) in [
            (0, "1970-01-01 00:00:00 UTC"),
            (951_782_400, "2000-02-29 00:00:00 UTC"),
            (1_795_962_193, "2026-11-29 14:23:13 UTC"),
            (4_107_542_399, "2100-02-28 23:59:59 UTC"),
            (4_107_542_400, "2100-03-01 00:00:00 UTC"),
        ] {
            assert_eq!(utc(secs), want, "{secs}");
        }
    }

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_freed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path(), "train").unwrap();
        // flock locks belong to an open file: a second open of the same file conflicts even
        // inside one process, as another process's would.
        let e = RunLock::acquire(dir.path(), "train")
            .unwrap_err()
            .to_string();
        let pid = format!("process {}", std::process::id());
        assert!(
            e.contains("in use by another genslm") && e.contains(&pid),
            "{e}"
        );
        drop(first);
        let again = RunLock::acquire(dir.path(), "tokenize").unwrap();
        let holder = std::fs::read_to_string(&again.path).unwrap();
        assert!(holder.starts_with("genslm tokenize, process"), "{holder}");
    }

    #[test]
    fn a_lock_file_left_by_a_dead_process_does_not_block() {
        let dir = tempfile::tempdir().unwrap();
        // What a killed run leaves: the file, with its holder line, and no lock on it.
        std::fs::write(dir.path().join(LOCK_FILE), "genslm train, process 1 on x\n").unwrap();
        RunLock::acquire(dir.path(), "train").unwrap();
    }

    /// A link planted where the lock goes would have had its target overwritten with the
    /// holder line (a user's file); a named pipe there gave "Invalid argument".
    #[test]
    fn a_lock_path_that_is_no_plain_file_is_refused_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("notes.txt");
        std::fs::write(&victim, "precious").unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&victim, run.join(LOCK_FILE)).unwrap();
        let e = RunLock::acquire(&run, "train").unwrap_err().to_string();
        assert!(
            e.contains("a symbolic link") && e.contains(LOCK_FILE),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // A dangling link: no file is created at its target either.
        let gone = dir.path().join("gone");
        std::fs::remove_file(run.join(LOCK_FILE)).unwrap();
        std::os::unix::fs::symlink(&gone, run.join(LOCK_FILE)).unwrap();
        assert!(RunLock::acquire(&run, "train").is_err());
        assert!(!gone.exists());
        std::fs::remove_file(run.join(LOCK_FILE)).unwrap();
        std::fs::create_dir(run.join(LOCK_FILE)).unwrap();
        let e = RunLock::acquire(&run, "train").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
    }
}
