//! Atomic writes: write under a temporary name beside the target, rename when complete.
//!
//! A crash or an error leaves either the old file or nothing, never a half-written file under
//! the final name. The temporary file is removed when the writer is dropped uncommitted.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A file being written under a temporary name until [`AtomicFile::commit`].
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Creates `.NAME.tmp-PID` in the target's directory and returns it with its handle.
    pub fn create(target: &Path) -> Result<(Self, File)> {
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            return Err(Error::Invalid(format!(
                "{}: output directory {} does not exist",
                target.display(),
                dir.display()
            )));
        }
        let name = target
            .file_name()
            .ok_or_else(|| Error::Invalid(format!("{}: not a file name", target.display())))?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok((
            Self {
                target: target.to_path_buf(),
                tmp,
                committed: false,
            },
            file,
        ))
    }

    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Flushes `file` to disk and renames it to the target name.
    pub fn commit(mut self, file: File) -> Result<()> {
        file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.target).map_err(|e| Error::io(&self.target, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` to `target` atomically.
pub fn write_bytes(target: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let (guard, mut file) = AtomicFile::create(target)?;
    file.write_all(bytes)
        .map_err(|e| Error::io(guard.tmp_path(), e))?;
    guard.commit(file)
}
