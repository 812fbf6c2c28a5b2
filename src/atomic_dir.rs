//! Directories written whole or not at all (`genslm convert`'s model directory): the files go
//! into `.NAME.partial-PID` beside the target, which is renamed into place when complete.
//!
//! A killed writer (`kill -9`, `timeout`, Slurm's SIGTERM) cannot remove its partial directory,
//! and a 2.5B model's is 10 GB. So the writer holds an advisory lock on a sibling file,
//! `.NAME.partial-PID.lock`, from before the directory exists until after it is renamed or
//! removed; the next writer of the same target removes every partial directory whose lock is
//! free (its writer is dead) and refuses, naming the process, when one is held (another writer
//! is filling it now). Only a directory and its lock are ever removed, never the target.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::atomic::LockState;
use crate::error::{Error, Result};

/// A directory being filled under a temporary name until [`AtomicDir::commit`].
#[derive(Debug)]
pub struct AtomicDir {
    target: PathBuf,
    tmp: PathBuf,
    lock_path: PathBuf,
    /// Held (locked) until the directory is renamed or removed.
    lock: Option<File>,
    committed: bool,
    /// Remove the directory and its lock if a signal ends the process first.
    _registered: [crate::interrupt::Registered; 2],
}

fn prefix(target: &Path) -> String {
    let name = target
        .file_name()
        .map(crate::atomic::temp_stem)
        .unwrap_or_else(|| "model".into());
    format!(".{name}.partial-")
}

fn lock_of(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    dir.with_file_name(name)
}

/// Opens and locks `path`, making sure the file locked is the one at `path`: a sweeper may
/// remove a lock file it finds free (an orphan of a writer killed before its directory
/// existed) in the moment between another writer's open and its lock. `false`: no locks on
/// this file system (nothing is swept then: no partial directory can be told from a live one).
fn take_lock(path: &Path) -> Result<(File, bool)> {
    for _attempt in 0..8 {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        if lock.try_lock().is_err() {
            return Ok((lock, false));
        }
        if same_file(&lock, path) {
            return Ok((lock, true));
        }
    }
    Err(Error::Invalid(format!(
        "{}: removed again and again while this convert took it; is another process \
         clearing this directory?",
        path.display()
    )))
}

/// Whether the open `file` is the file now at `path`.
fn same_file(file: &File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = file;
        path.exists()
    }
}

impl AtomicDir {
    /// Takes the lock, removes what dead writers of `target` left, and creates the empty
    /// temporary directory.
    pub fn create(target: &Path) -> Result<Self> {
        // Nested new directories are made, as `convert --out runs/new/model` expects.
        let parent = crate::run_lock::parent_dir(target);
        // A file where a directory of the path should be: named as such (it was a bare "File
        // exists" or "Not a directory").
        if let Some(file) = parent
            .ancestors()
            .find(|a| std::fs::metadata(a).is_ok())
            .filter(|a| !a.is_dir())
        {
            return Err(Error::Invalid(format!(
                "{}: {} is {}",
                target.display(),
                file.display(),
                crate::error::not_a_directory(file)
            )));
        }
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let tmp = target.with_file_name(format!("{}{}", prefix(target), std::process::id()));
        let lock_path = lock_of(&tmp);
        let (lock, locked) = take_lock(&lock_path)?;
        let dir = Self {
            target: target.to_path_buf(),
            _registered: [
                crate::interrupt::register(tmp.clone(), true),
                crate::interrupt::register(lock_path.clone(), false),
            ],
            tmp,
            lock_path,
            lock: Some(lock),
            committed: false,
        };
        if locked {
            dir.sweep()?;
        }
        // Ours from an earlier process of the same id (ids are reused), or nothing.
        let _ = std::fs::remove_dir_all(&dir.tmp);
        std::fs::create_dir_all(&dir.tmp).map_err(|e| Error::io(&dir.tmp, e))?;
        Ok(dir)
    }

    /// The temporary directory to fill.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Renames the filled directory to the target (which may exist only as an empty
    /// directory, as the caller checked before it started).
    pub fn commit(mut self) -> Result<()> {
        let taken = |e: std::io::Error| {
            if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST)) {
                Error::Invalid(format!(
                    "{}: something else was written there while this command ran (another \
                     convert?); it was left as it is and nothing was written",
                    self.target.display()
                ))
            } else {
                Error::io(&self.target, e)
            }
        };
        if self.target.is_dir() {
            std::fs::remove_dir(&self.target).map_err(taken)?;
        }
        std::fs::rename(&self.tmp, &self.target).map_err(taken)?;
        self.committed = true;
        Ok(())
    }

    /// Removes what dead writers of the same target left — a partial directory with its free
    /// lock, or a free lock alone (killed before its directory existed) — and refuses when a
    /// live one is filling its own. A directory without a lock file is not genslm's (a writer
    /// takes the lock before it makes the directory and drops it after the directory is gone):
    /// it is kept, whatever its name.
    fn sweep(&self) -> Result<()> {
        let parent = crate::run_lock::parent_dir(&self.target);
        let prefix = prefix(&self.target);
        let entries = std::fs::read_dir(parent).map_err(|e| Error::io(parent, e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
                continue;
            };
            let (pid, lock_only) = match rest.strip_suffix(".lock") {
                Some(pid) => (pid, true),
                None => (rest, false),
            };
            let kind_ok =
                entry
                    .file_type()
                    .is_ok_and(|t| if lock_only { t.is_file() } else { t.is_dir() });
            if !kind_ok || !crate::atomic::is_number(pid) {
                continue;
            }
            let dir = parent.join(format!("{prefix}{pid}"));
            if dir == self.tmp || (lock_only && dir.exists()) {
                // Ours, or a lock file seen with its directory (handled there).
                continue;
            }
            let lock_path = lock_of(&dir);
            match crate::atomic::lock_state(&lock_path) {
                LockState::Free => {}
                LockState::Held if !lock_only => {
                    return Err(crate::atomic::written_now(&self.target, pid, &dir))
                }
                _ => continue,
            }
            if !lock_only {
                let _ = std::fs::remove_dir_all(&dir);
            }
            let _ = std::fs::remove_file(&lock_path);
        }
        Ok(())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
        // The lock file goes while it is still held, so no sweeper takes the directory (now
        // renamed or removed) for a dead writer's in between.
        let _ = std::fs::remove_file(&self.lock_path);
        self.lock.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a killed writer leaves (a partial directory with a free lock, or none) is removed by
    /// the next writer; a held lock is another writer at work and is refused by process.
    #[cfg(unix)]
    #[test]
    fn dead_writers_partial_directories_are_removed_live_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model");
        let dead = dir.path().join(".model.partial-999999991");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("model.safetensors"), b"half").unwrap();
        std::fs::write(lock_of(&dead), b"").unwrap();
        // A directory without a lock file is not genslm's: kept. A free lock without its
        // directory (killed before making it) goes.
        let unlocked = dir.path().join(".model.partial-999999992");
        std::fs::create_dir(&unlocked).unwrap();
        std::fs::write(unlocked.join("notes.txt"), b"mine").unwrap();
        let orphan = lock_of(&dir.path().join(".model.partial-999999995"));
        std::fs::write(&orphan, b"").unwrap();
        // Another target's partial directory and a user's look-alike file stay.
        let other = dir.path().join(".model2.partial-999999993");
        std::fs::create_dir(&other).unwrap();
        let user = dir.path().join(".model.partial-notes");
        std::fs::create_dir(&user).unwrap();

        let live = dir.path().join(".model.partial-999999994");
        std::fs::create_dir(&live).unwrap();
        let held = File::create(lock_of(&live)).unwrap();
        held.lock().unwrap();
        let err = AtomicDir::create(&target).unwrap_err().to_string();
        assert!(
            err.contains("process 999999994") && err.contains("writing it now"),
            "{err}"
        );
        drop(held);

        let w = AtomicDir::create(&target).unwrap();
        for gone in [&dead, &live] {
            assert!(!gone.exists(), "{}", gone.display());
            assert!(!lock_of(gone).exists(), "{}", gone.display());
        }
        assert!(!orphan.exists());
        assert!(other.exists() && user.exists() && unlocked.join("notes.txt").exists());
        std::fs::write(w.path().join("config.json"), b"{}").unwrap();
        let tmp = w.path().to_path_buf();
        w.commit().unwrap();
        assert!(target.join("config.json").exists() && !tmp.exists());
        assert!(!lock_of(&tmp).exists());
    }

    /// A target filled by someone else while this writer ran is left as it is.
    #[test]
    fn a_target_filled_meanwhile_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("model");
        let w = AtomicDir::create(&target).unwrap();
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("theirs"), b"x").unwrap();
        let tmp = w.path().to_path_buf();
        let err = w.commit().unwrap_err().to_string();
        assert!(err.contains("while this command ran"), "{err}");
        assert!(target.join("theirs").exists() && !tmp.exists());
    }
}
