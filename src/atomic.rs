//! Atomic writes: write under a temporary name beside the target, rename when complete.
//!
//! A crash or an error leaves either the old file or nothing, never a half-written file under
//! the final name. The temporary file is removed when the writer is dropped uncommitted.
//!
//! A writer holds an advisory lock (`flock`) on its temporary file until the rename, so the
//! next writer of the same target can tell the temporary files of live writers (locked: it
//! refuses, naming the process, instead of racing it to the rename) from those of writers
//! that died (unlocked: a `kill -9`; SIGINT/SIGTERM remove their own through
//! [`crate::interrupt`]; it removes them). On a file system
//! without locks neither happens and the writer goes on as before.
//!
//! No write replaces a file the same command reads: readers record their inputs
//! ([`note_input`]), and a writer aimed at one of them (by device and inode, so another spelling
//! of the path or a link is caught too) is refused when it starts and again before its rename
//! (inputs opened after the output was created).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// A file being written under a temporary name until [`AtomicFile::commit`].
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    committed: bool,
    /// Removes `tmp` if a signal ends the process first (dropped after `Drop` has run).
    _registered: crate::interrupt::Registered,
}

/// The files this process reads as inputs: (device, inode, path as the reader named it).
static INPUTS: Mutex<Vec<(u64, u64, PathBuf)>> = Mutex::new(Vec::new());

/// The (device, inode) of an existing file; `None` where there is none (or off Unix).
pub(crate) fn identity(path: &Path) -> Option<(u64, u64)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// Records `path` as an input of this command: no [`AtomicFile`] may replace it.
pub fn note_input(path: &Path) {
    if let Some((dev, ino)) = identity(path) {
        let mut inputs = INPUTS.lock().unwrap_or_else(|p| p.into_inner());
        if !inputs.iter().any(|&(d, i, _)| (d, i) == (dev, ino)) {
            inputs.push((dev, ino, path.to_path_buf()));
        }
    }
}

/// Refuses `target` where it is a file this command reads.
fn check_not_input(target: &Path) -> Result<()> {
    let Some(id) = identity(target) else {
        return Ok(());
    };
    let inputs = INPUTS.lock().unwrap_or_else(|p| p.into_inner());
    // The recorded path must still be that file: an input deleted since (a finished run's
    // temporary directory) frees its inode for a new file, which is no input.
    let same =
        |&&(d, i, ref path): &&(u64, u64, PathBuf)| (d, i) == id && identity(path) == Some(id);
    match inputs.iter().find(same) {
        None => Ok(()),
        Some((_, _, input)) => Err(Error::Invalid(format!(
            "{}: this output is {}, an input of this command; nothing was written. Choose \
             another output path",
            target.display(),
            input.display()
        ))),
    }
}

/// Refuses a `target` that exists as something other than a file, itself or through links:
/// the rename would replace it, and `--out /dev/full` (or `/dev/stdout`, a link to the
/// terminal or a pipe; a named pipe; a socket) is no place for a file: as root, the device
/// itself was replaced by the output. A link to a file is replaced by the new file (the file
/// it pointed to is kept).
pub fn check_replaceable(target: &Path) -> Result<()> {
    if let Some(hop) = descriptor_link(target) {
        return Err(Error::Invalid(format!(
            "{}: is {}, a link to one of this process's open files (its standard output, when \
             it is /dev/stdout or fd 1), not a file; an output is renamed over its path, which \
             would replace the link. Nothing was written: give the file's own path",
            target.display(),
            hop.display()
        )));
    }
    // `metadata` follows links; a dangling link (no metadata) is replaced like a file.
    let Ok(meta) = std::fs::metadata(target) else {
        return Ok(());
    };
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(());
    }
    let what = if kind.is_dir() {
        "a directory"
    } else {
        "a device, named pipe or socket"
    };
    Err(Error::Invalid(format!(
        "{}: is {what}, not a file; an output is written as a new file and renamed over its \
         path, which would replace it. Nothing was written: choose a file path",
        target.display()
    )))
}

/// Where `target`, or a link it leads through, is one of the process's file descriptors
/// (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`): the path that is. Such a link resolves to
/// whatever the descriptor is open on, a regular file when the shell redirected stdout to one,
/// so the checks on what it points to passed and the rename replaced the link (as root,
/// `/dev/stdout` itself) while the redirected file stayed empty.
fn descriptor_link(target: &Path) -> Option<PathBuf> {
    // `/proc/<self|thread-self|pid>/fd/…` and `…/task/<tid>/fd/…`: the rest of /proc
    // (`/proc/self/cwd/x.tsv`) reaches ordinary files.
    let in_proc_fd = |p: &Path| {
        let c: Vec<_> = p.components().map(|c| c.as_os_str()).collect();
        c.get(1).is_some_and(|s| *s == "proc")
            && (c.get(3).is_some_and(|s| *s == "fd")
                || (c.get(3).is_some_and(|s| *s == "task") && c.get(5).is_some_and(|s| *s == "fd")))
    };
    let is_descriptor = |p: &Path| {
        in_proc_fd(p)
            || p.starts_with("/dev/fd")
            || ["/dev/stdin", "/dev/stdout", "/dev/stderr"]
                .iter()
                .any(|d| p == Path::new(d))
    };
    let mut p = std::path::absolute(target).ok()?;
    // A link chain longer than the kernel follows (40) cannot be opened anyway.
    for _ in 0..40 {
        // The directory too, resolved: a user's link to /proc/self/fd as the output's folder.
        let dir = p.parent().and_then(|d| std::fs::canonicalize(d).ok());
        if is_descriptor(&p) || dir.as_deref().is_some_and(is_descriptor) {
            return Some(p);
        }
        let next = std::fs::read_link(&p).ok()?;
        p = match p.parent() {
            Some(d) if next.is_relative() => d.join(next),
            _ => next,
        };
    }
    None
}

/// The last component of `path` as spelled, when it is `.` or `..` (`Path` reads `x/.` as `x`).
fn dot_component(path: &Path) -> Option<&'static str> {
    let b = path.as_os_str().to_string_lossy();
    match b.trim_end_matches('/').rsplit('/').next() {
        Some(".") => Some("."),
        Some("..") => Some(".."),
        _ => None,
    }
}

/// Refuses an output path spelled as a directory (`out.tsv/`, `out/.`): the file was written
/// beside it and the rename onto it failed with a bare "Not a directory".
fn check_names_a_file(target: &Path) -> Result<()> {
    let dir_like = target.as_os_str().to_string_lossy().ends_with('/')
        || dot_component(target).is_some()
        || target.file_name().is_none();
    if dir_like {
        return Err(Error::Invalid(format!(
            "{}: names a directory (it ends in '/', '.' or '..'), not the output file: give a \
             file name",
            target.display()
        )));
    }
    Ok(())
}

/// Refuses a directory output spelled through `.` or `..` (`runs/x/.`, `runs/q/..`): Rust's
/// path reads `x/.` as `x`, and a rename onto it failed after the work with a bare "Invalid
/// argument", while `runs/q/..` trained into `runs/`. `-` too: it reads as stdout, and
/// `convert --out -` wrote a model directory named `-`.
pub fn check_dir_name(flag: &str, path: &Path) -> Result<()> {
    if path.as_os_str() == "-" {
        return Err(Error::Invalid(format!(
            "{flag} -: this command writes a directory, not to stdout: name it (e.g. {flag} \
             runs/demo)"
        )));
    }
    if let Some(last) = dot_component(path) {
        return Err(Error::Invalid(format!(
            "{flag} {}: ends in '{last}'; name the directory itself (e.g. {flag} runs/demo)",
            path.display()
        )));
    }
    Ok(())
}

/// Refuses an output whose directory does not exist. Commands that write more than one file
/// check each before the first is written: `variants --heatmap nodir/x.png` wrote its table,
/// then failed on the picture.
pub fn check_output_dir(target: &Path) -> Result<()> {
    let dir = crate::run_lock::parent_dir(target);
    if !dir.is_dir() {
        // A file where the directory should be is not "missing".
        let what = match crate::error::not_a_file(dir) {
            "missing" => "does not exist".to_string(),
            _ => format!("is {}", crate::error::not_a_directory(dir)),
        };
        return Err(Error::Invalid(format!(
            "{}: output directory {} {what}",
            target.display(),
            dir.display()
        )));
    }
    Ok(())
}

impl AtomicFile {
    /// Creates `.NAME.tmp-PID` in the target's directory and returns it with its handle.
    pub fn create(target: &Path) -> Result<(Self, File)> {
        // A run's own file first: its message says whose it is (a checkpoint's manifest is
        // also an input of a command that loads that checkpoint).
        check_names_a_file(target)?;
        crate::run_lock::check_not_a_runs_file(target)?;
        check_not_input(target)?;
        check_replaceable(target)?;
        check_output_dir(target)?;
        let dir = crate::run_lock::parent_dir(target).to_path_buf();
        let name = target
            .file_name()
            .ok_or_else(|| Error::Invalid(format!("{}: not a file name", target.display())))?;
        let prefix = format!(".{}.tmp-", temp_stem(name));
        let tmp = dir.join(format!("{prefix}{}", std::process::id()));
        // Before the file exists, so that no moment leaves it unregistered (a signal between
        // the two left `.latest.tmp-PID`), and before the sweep, which may take a while in a
        // large directory.
        let registered = crate::interrupt::register(tmp.clone(), false);
        // Named by the output (the temporary's name alone, "nb/.x.png.tmp-PID: Permission
        // denied", read as some other file's trouble).
        let file = File::create(&tmp).map_err(|e| {
            Error::Invalid(format!(
                "{}: cannot write the output: {e} (creating its temporary file {} beside it)",
                target.display(),
                tmp.display()
            ))
        })?;
        if file.try_lock().is_ok() {
            if let Err(e) = sweep(&dir, &prefix, &tmp, target) {
                drop(file);
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        }
        Ok((
            Self {
                target: target.to_path_buf(),
                _registered: registered,
                tmp,
                committed: false,
            },
            file,
        ))
    }

    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Flushes `file` to disk and renames it to the target name. The file (and its lock)
    /// is closed only after the rename, so no other writer takes it for a dead one's.
    pub fn commit(mut self, file: File) -> Result<()> {
        check_not_input(&self.target)?;
        check_replaceable(&self.target)?;
        file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| Error::io(&self.target, e))?;
        drop(file);
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

/// The part of an output's file name its temporary names carry: the whole name, or, past 200
/// bytes, its first 183 and a hash of all of it, so that `.NAME.tmp-PID` (or `.NAME.partial-PID.lock`) stays within the
/// file system's 255 bytes (a valid output name of 240 bytes was refused as "File name too
/// long", naming the temporary).
pub fn temp_stem(name: &std::ffi::OsStr) -> String {
    let full = name.to_string_lossy();
    if full.len() <= 200 {
        return full.into_owned();
    }
    // Cut at a character, and told apart by a hash of the whole name: two outputs sharing their
    // first bytes had one temporary name, and each writer refused the other's output as its own.
    let mut cut = 183;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    let hash = full.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    format!("{}~{hash:016x}", &full[..cut])
}

/// Whether `s` is a number as temporary names carry one (the process id of `.NAME.tmp-PID`
/// and `atomic_dir`'s `.NAME.partial-PID`, the step of a run's `.step-N.tmp`): digits only.
pub(crate) fn is_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Who holds the advisory lock on a writer's file: that writer, alive (`Held`); nobody, so it
/// died (`Free`); or it cannot be told (`Unknown`: the file is gone, or the file system has no
/// locks), when nothing may be removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockState {
    Held,
    Free,
    Unknown,
}

pub(crate) fn lock_state(path: &Path) -> LockState {
    let Ok(file) = OpenOptions::new().read(true).open(path) else {
        return LockState::Unknown;
    };
    match file.try_lock() {
        Ok(()) => LockState::Free,
        Err(TryLockError::WouldBlock) => LockState::Held,
        Err(TryLockError::Error(_)) => LockState::Unknown,
    }
}

/// The refusal when another process is writing `target` now (its temporary `partial`).
pub(crate) fn written_now(target: &Path, pid: &str, partial: &Path) -> Error {
    Error::Invalid(format!(
        "{}: another genslm (process {pid}) is writing it now ({}); nothing was changed. Wait \
         for it to end, or choose another output",
        target.display(),
        partial.display()
    ))
}

/// Removes the unlocked temporary files of `target` that dead writers left (`PREFIXpid`, other
/// than ours), or refuses when one is locked: another process is writing `target` now.
fn sweep(dir: &Path, prefix: &str, own: &Path, target: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut live = None;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let path = entry.path();
        if !is_number(pid) || path == own {
            continue;
        }
        // Unknown: gone since the listing (renamed by its writer, or swept by another).
        match lock_state(&path) {
            LockState::Free => {
                let _ = std::fs::remove_file(&path);
            }
            LockState::Held => live = Some((pid.to_string(), path)),
            LockState::Unknown => {}
        }
    }
    match live {
        None => Ok(()),
        Some((pid, path)) => Err(written_now(target, &pid, &path)),
    }
}

/// Names that say another format than parquet: a table written as `emb.csv` fails (or is
/// misread) in whatever opens it by its name.
const NOT_PARQUET: &[&str] = &[
    "csv",
    "tsv",
    "txt",
    "json",
    "jsonl",
    "npy",
    "npz",
    "h5",
    "hdf5",
    "pt",
    "pth",
    "bin",
    "safetensors",
    "png",
    "pdf",
    "svg",
    "fa",
    "fasta",
    "fna",
    "fastq",
    "fq",
    "vcf",
    "gz",
    "zst",
    "xz",
    "bz2",
    "toml",
];

/// The system's directory for temporary files: `TMPDIR` when set to something, else `/tmp`
/// (an empty `TMPDIR` means unset, by convention; `std::env::temp_dir` took it as the path "",
/// and bench ingest said "error: : missing").
pub fn temp_dir() -> PathBuf {
    match std::env::var_os("TMPDIR") {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ if cfg!(unix) => PathBuf::from("/tmp"),
        _ => std::env::temp_dir(),
    }
}

/// Refuses `-` as a file output (`flag` names it; `instead` says what to do): it reads as
/// stdout, but was written as a file named `-` in the working directory.
pub fn check_not_stdout(flag: &str, path: &Path, instead: &str) -> Result<()> {
    if path.as_os_str() == "-" {
        return Err(Error::Invalid(format!(
            "{flag} -: this output is written to a file, not to stdout; {instead}"
        )));
    }
    Ok(())
}

/// The checks every named output gets before its format's: not `-`, and not a run's own file
/// (which says more than the name's format: `generate --out RUN/metrics.jsonl` was refused as
/// "not FASTA").
fn check_output(flag: &str, path: &Path, instead: &str) -> Result<()> {
    check_not_stdout(flag, path, instead)?;
    // Before any work: the rename at the end failed after it, with a bare "Not a directory".
    check_names_a_file(path).map_err(|e| Error::Invalid(format!("{flag} {e}")))?;
    // A directory (or pipe) at the path, named with its flag (the later check did not say
    // which of a command's outputs it was).
    check_replaceable(path).map_err(|e| Error::Invalid(format!("{flag} {e}")))?;
    crate::run_lock::check_not_a_runs_file(path)
}

/// Refuses a parquet output (`flag` names it) whose extension names another format, or `-`.
pub fn check_parquet_name(flag: &str, path: &Path) -> Result<()> {
    check_output(flag, path, "name the file (parquet needs one)")?;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext {
        Some(e) if NOT_PARQUET.contains(&e.as_str()) => Err(Error::Invalid(format!(
            "{flag} {}: this file is written as parquet, and its .{e} name says otherwise; \
             name it .parquet (pandas.read_parquet and pyarrow read it)",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Refuses a PNG output (`flag` names it) whose extension names another format: image viewers
/// and notebooks go by the name, so `--plot x.txt` wrote a picture nothing would open as one.
/// A name without an extension is taken as given.
pub fn check_png_name(flag: &str, path: &Path) -> Result<()> {
    check_output(flag, path, "name the file")?;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext {
        Some(e) if e != "png" => Err(Error::Invalid(format!(
            "{flag} {}: this file is written as PNG, and its .{e} name says otherwise; name \
             it .png",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// Refuses a text output (`flag` names it) whose extension names a known format other than
/// `format`, whose names `fits` lists (the first is suggested): `generate --out x.parquet`
/// wrote FASTA under a parquet name, `variants --out x.csv` a TSV. Unknown extensions pass.
pub fn check_text_name(flag: &str, path: &Path, format: &str, fits: &[&str]) -> Result<()> {
    check_output(flag, path, "name the file")?;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    match ext {
        Some(e)
            if !fits.contains(&e.as_str())
                && (e == "parquet" || NOT_PARQUET.contains(&e.as_str())) =>
        {
            Err(Error::Invalid(format!(
                "{flag} {}: this file is written as {format}, and its .{e} name says otherwise; \
                 name it .{}",
                path.display(),
                fits.first().copied().unwrap_or("txt")
            )))
        }
        _ => Ok(()),
    }
}

/// Refuses a command's outputs where two are one file (`embed --out X --plot X` wrote the
/// embeddings, then replaced them with the picture): compared by their directory's real path
/// and their name, before any work.
pub fn distinct_outputs(outputs: &[(&str, &Path)]) -> Result<()> {
    let real = |p: &Path| {
        let dir = crate::run_lock::parent_dir(p);
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        p.file_name().map(|n| dir.join(n))
    };
    for (i, (a, pa)) in outputs.iter().enumerate() {
        for (b, pb) in &outputs[i + 1..] {
            let same = match (real(pa), real(pb)) {
                (Some(x), Some(y)) => {
                    x == y || identity(&x).is_some_and(|id| identity(&y) == Some(id))
                }
                _ => false,
            };
            if same {
                return Err(Error::Invalid(format!(
                    "{a} and {b} are the same file ({}): the second would replace the first. \
                     Nothing was written: give them different paths",
                    pa.display()
                )));
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `target` atomically.
pub fn write_bytes(target: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let (guard, mut file) = AtomicFile::create(target)?;
    file.write_all(bytes)
        .map_err(|e| Error::io(guard.tmp_path(), e))?;
    guard.commit(file)
}

#[cfg(test)]
#[path = "atomic_tests.rs"]
mod tests;
