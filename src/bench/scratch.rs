//! `bench ingest`'s scratch directory: its own `genslm-bench-ingest-XXXX` inside the directory
//! given (or the system's temporary one), refused when the disk cannot hold what it writes, and
//! cleaned up after a kill.
//!
//! A killed benchmark (Ctrl-C, `timeout`, SIGTERM) cannot remove its scratch, gigabytes of
//! FASTA, and it used to stay, under a hidden name in `$TMPDIR`. So the benchmark holds a lock on
//! `.lock` inside its scratch while it runs, and the next one removes every scratch directory
//! of this name whose lock is free. A scratch without `.lock` (its benchmark was killed between
//! making the directory and the lock, or it is starting now) is left alone.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const PREFIX: &str = "genslm-bench-ingest-";
const LOCK: &str = ".lock";
/// What a benchmark writes into its scratch (and the temporary names of its parquet outputs).
const FILES: [&str; 5] = [
    LOCK,
    "bench.fa",
    "bench.fa.gz",
    "bench-plain.parquet",
    "bench-gzip.parquet",
];

/// The scratch directory of a running benchmark: removed with its files when dropped.
#[derive(Debug)]
pub struct Scratch {
    dir: tempfile::TempDir,
    _lock: File,
    /// Removes the directory if Ctrl-C or kill ends the benchmark (gigabytes of files).
    _registered: crate::interrupt::Registered,
}

impl Scratch {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Bytes the ingest benchmark writes for `mb` megabytes of FASTA in records of `record_mb`:
/// the FASTA (whole records, so up to one record past `mb`, line breaks included), its gzip
/// copy (random DNA: ~0.3 of it) and the two parquet outputs (~0.35 each), with a margin.
/// (Sized from `mb` alone, `--mb 1001 --record-mb 1000` wrote twice what was checked.)
pub fn ingest_disk_bytes(mb: usize, record_mb: usize) -> u64 {
    let fasta = (mb as u64 + record_mb as u64 * 61 / 60 + 1).saturating_mul(1_000_000);
    fasta.saturating_mul(5) / 2
}

/// Bytes free to an unprivileged writer on the file system holding `dir`, where it can be read.
pub fn free_disk_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid C string and `s` a properly sized out-parameter.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return None;
        }
        Some((s.f_bavail as u64).saturating_mul(s.f_frsize as u64))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

/// Makes the scratch directory inside `base` (default: the system temporary directory), after
/// removing what killed benchmarks left there and checking that `need` bytes fit on its disk.
pub fn create(base: Option<&Path>, need: u64, flag: &str) -> Result<Scratch> {
    let (base, named): (PathBuf, bool) = match base {
        Some(b) => (b.to_path_buf(), true),
        None => (crate::atomic::temp_dir(), false),
    };
    let whose = if named {
        "--dir".to_string()
    } else {
        "the system temporary directory (TMPDIR, or /tmp)".to_string()
    };
    if !base.is_dir() {
        return Err(Error::Invalid(format!(
            "{}: {}; {whose} must be an existing directory for the scratch files",
            base.display(),
            crate::error::not_a_directory(&base)
        )));
    }
    sweep(&base);
    if let Some(free) = free_disk_bytes(&base) {
        if need > free {
            return Err(Error::Invalid(format!(
                "{flag}: the benchmark writes about {:.1} GB of scratch files, but the disk of \
                 {} ({whose}) has {:.1} GB free; use a smaller {flag}, or --dir on a larger disk",
                need as f64 / 1e9,
                base.display(),
                free as f64 / 1e9
            )));
        }
    }
    let dir = tempfile::Builder::new()
        .prefix(PREFIX)
        .tempdir_in(&base)
        .map_err(|e| Error::io(&base, e))?;
    let lock_path = dir.path().join(LOCK);
    let lock = File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
    // Without locks (some network file systems) nothing marks it live; nothing is swept then
    // either, as a sweeper cannot take a lock it cannot test.
    let _ = lock.try_lock();
    let registered = crate::interrupt::register(dir.path().to_path_buf(), true);
    Ok(Scratch {
        dir,
        _lock: lock,
        _registered: registered,
    })
}

/// Removes the scratch directories in `base` whose benchmark is dead (`.lock` there, free).
fn sweep(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let is_ours = e.file_name().to_string_lossy().starts_with(PREFIX)
            && e.file_type().is_ok_and(|t| t.is_dir());
        if !is_ours {
            continue;
        }
        // Only what the benchmark writes, as plain files: a directory of this name holding
        // anything else (a user's results, a user's folder named `bench.fa`) is kept.
        let only_ours = std::fs::read_dir(e.path()).is_ok_and(|d| {
            d.flatten().all(|f| {
                let n = f.file_name().to_string_lossy().into_owned();
                f.file_type().is_ok_and(|t| t.is_file())
                    && (FILES.contains(&n.as_str())
                        || FILES.iter().any(|b| n.starts_with(&format!(".{b}.tmp-"))))
            })
        });
        if !only_ours {
            continue;
        }
        if crate::atomic::lock_state(&e.path().join(LOCK)) == crate::atomic::LockState::Free {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead benchmark's scratch (free lock) goes; a live one's (held lock), one without a
    /// lock, and the user's files stay.
    #[cfg(unix)]
    #[test]
    fn dead_scratch_is_removed_live_scratch_kept() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        let mk = |name: &str, lock: bool| {
            let d = base.join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("bench.fa"), b">a\nACGT\n").unwrap();
            if lock {
                std::fs::write(d.join(LOCK), b"").unwrap();
            }
            d
        };
        let dead = mk("genslm-bench-ingest-dead", true);
        let theirs = mk("genslm-bench-ingest-mine", true);
        std::fs::write(theirs.join("results.csv"), b"mine").unwrap();
        let live = mk("genslm-bench-ingest-live", true);
        let unlocked = mk("genslm-bench-ingest-nolock", false);
        let user = mk("my-genomes", true);
        // A user's folder named like the benchmark's FASTA, inside a dead scratch: kept.
        let nested = mk("genslm-bench-ingest-nested", true);
        std::fs::remove_file(nested.join("bench.fa")).unwrap();
        std::fs::create_dir(nested.join("bench.fa")).unwrap();
        std::fs::write(nested.join("bench.fa/results.txt"), b"mine").unwrap();
        let held = File::open(live.join(LOCK)).unwrap();
        held.lock().unwrap();
        let s = create(Some(base), 0, "--mb").unwrap();
        assert!(!dead.exists());
        assert!(live.exists() && unlocked.exists() && user.exists());
        assert!(theirs.join("results.csv").exists());
        assert!(nested.join("bench.fa/results.txt").exists());
        let mine = s.path().to_path_buf();
        assert!(mine.join(LOCK).exists());
        drop(s);
        assert!(!mine.exists());
    }

    /// More than the disk holds is refused before anything is written, naming the sizes.
    #[cfg(unix)]
    #[test]
    fn a_scratch_larger_than_the_disk_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_disk_bytes(dir.path()).unwrap();
        let e = create(Some(dir.path()), free + (1 << 40), "--mb")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--mb") && e.contains("GB free"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = create(Some(&file), 0, "--mb").unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
