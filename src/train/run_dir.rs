//! The run directory's life: claimed by one run at a time, cleaned of what killed saves left,
//! and pruned to the newest checkpoints.

use std::path::{Path, PathBuf};

use crate::atomic::is_number;
use crate::error::{Error, Result};
use crate::train::checkpoint::{checkpoints_dir, step_of};

use crate::run_lock::{RUN_FILES, RUN_MARKERS};

/// Makes `run` (which exists and is locked) ready for a run: refuses a fresh run into a
/// directory that already holds one unless `overwrite`, which moves that run aside (see
/// [`Replaced`]) — but never an entry that `inputs` (what this run reads) are or lie inside —
/// and removes the temporary files of killed saves.
pub fn claim(run: &Path, resume: bool, overwrite: bool, inputs: &[PathBuf]) -> Result<Replaced> {
    let mut replaced = Replaced::default();
    let existing = ["checkpoints/latest", "metrics.jsonl"]
        .iter()
        .map(|e| run.join(e))
        .filter(|p| p.exists())
        .collect::<Vec<_>>();
    // Files a run writes, found where no run is: a user's own (a `--config` kept in the
    // directory, a dataset), or what a run killed before its first step left. Replaced only
    // with --overwrite, as a run is.
    let files: Vec<PathBuf> = RUN_FILES
        .iter()
        .map(|e| run.join(e))
        .filter(|p| p.exists())
        .collect();
    let names = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.strip_prefix(run).unwrap_or(p).display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !resume && (!existing.is_empty() || !files.is_empty()) {
        if !overwrite && !existing.is_empty() {
            return Err(Error::Invalid(format!(
                "{} already holds a run ({}): pass --resume to continue it, --overwrite to \
                 replace it, or choose another --out",
                run.display(),
                names(&existing)
            )));
        }
        if !overwrite {
            return Err(Error::Invalid(format!(
                "{} holds {} but no run (no checkpoints, no metrics.jsonl): a run would \
                 replace them. Files of yours? Choose another --out. Left by a run killed before \
                 its first step? Pass --overwrite",
                run.display(),
                names(&files)
            )));
        }
        let inputs: Vec<PathBuf> = inputs
            .iter()
            .filter_map(|p| p.canonicalize().ok())
            .collect();
        // Everything a run writes is removed by --overwrite.
        let entries: Vec<PathBuf> = RUN_MARKERS
            .iter()
            .chain(&RUN_FILES)
            .map(|e| run.join(e))
            .collect();
        // Checked for all entries before anything is removed.
        for p in entries.iter().filter(|p| p.exists()) {
            let Ok(canon) = p.canonicalize() else {
                continue;
            };
            if let Some(input) = inputs.iter().find(|i| i.starts_with(&canon)) {
                return Err(Error::Invalid(format!(
                    "--overwrite would delete {}, but this run reads {} from it; move the input \
                     out of the run directory first, or choose another --out",
                    p.display(),
                    input.display()
                )));
            }
        }
        for p in entries {
            if std::fs::symlink_metadata(&p).is_ok() {
                replaced.move_aside(&p)?;
            }
        }
    }
    if !resume {
        // What stands under a run's names by the time a signal comes, where nothing stood
        // now, is this run's (its metrics and a first checkpoint too, while an old run is held
        // aside until then); a `checkpoints/` without `latest` (no run to refuse) is not.
        let names = RUN_FILES.iter().chain(&RUN_MARKERS);
        for name in names.filter(|n| std::fs::symlink_metadata(run.join(n)).is_err()) {
            let dir = *name == "checkpoints";
            replaced
                .fresh
                .push(crate::interrupt::register(run.join(name), dir));
        }
    }
    clean_stale(run, inputs)?;
    Ok(replaced)
}

/// Refuses a directory holding what an `--overwrite` killed before its new run started
/// (`kill -9`, a crash) moved aside: the old run, under `.NAME.replaced-PID`. A resume said
/// only "no completed checkpoint", sending the user to `--overwrite`, which would bury it.
pub fn check_replaced_leftovers(run: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(run) else {
        return Ok(());
    };
    let mut left: Vec<(String, String)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let orig = tagged_entry(&name, REPLACED)?.to_string();
            Some((name, orig))
        })
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    left.sort();
    let moves: Vec<String> = left
        .iter()
        .map(|(aside, orig)| move_back_command(run, aside, orig))
        .collect();
    Err(Error::Invalid(format!(
        "{} holds {}: a run that `--overwrite` moved aside, left there when the process that \
         was replacing it was killed. Nothing was changed. To keep that run, remove what \
         stands under those names and move it back ({}); to drop it, delete them; then start \
         again",
        run.display(),
        left.iter()
            .map(|(a, _)| a.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        moves.join("; ")
    )))
}

/// What `--overwrite` renames the old run's entries to until the new run has saved its first
/// checkpoint (`.NAME.replaced-PID`), and then while it deletes them (`.NAME.removing-PID`).
const REPLACED: &str = ".replaced-";
const REMOVING: &str = ".removing-";

/// `path`'s entry renamed with `tag` by this process (`.NAME{tag}PID`).
fn tagged_path(path: &Path, tag: &str) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}{tag}{}", std::process::id()))
}

/// The run's entry name `name` was renamed from with `tag` ([`tagged_path`]), when it is one
/// of a run's own names and a process id follows.
fn tagged_entry<'a>(name: &'a str, tag: &str) -> Option<&'a str> {
    let (orig, pid) = name.strip_prefix('.')?.rsplit_once(tag)?;
    let ours = RUN_MARKERS.contains(&orig) || RUN_FILES.contains(&orig);
    (ours && is_number(pid)).then_some(orig)
}

/// Dropped without [`Replaced::remove`] (an error inside `claim` after the move, a panic
/// before the new run started): the old run is put back, not left aside unregistered.
impl Drop for Replaced {
    fn drop(&mut self) {
        if crate::interrupt::fired() {
            // The signal's thread undoes them: dropped here, their registrations could vanish
            // before it reads them.
            std::mem::forget(std::mem::take(&mut self.moved));
            std::mem::forget(std::mem::take(&mut self.fresh));
        } else if !self.moved.is_empty() {
            // A signal's cleanup waits: it would rename the same entries back.
            crate::interrupt::critical(|| self.restore());
        }
    }
}

/// The old run's entries, disowned ([`Replaced::disown`]) and registered for removal.
#[derive(Debug, Default)]
pub struct Trash(Vec<(PathBuf, crate::interrupt::Registered)>);

impl Trash {
    /// Deletes them. Housekeeping: a part that cannot be removed is named, not a reason to
    /// stop the new run. Every registration went before anything is deleted: a signal while
    /// the old checkpoints were being deleted (minutes on a network file system) renamed the
    /// old run's other files back over the new run's.
    pub fn delete(self) {
        for (aside, _g) in self.0 {
            if let Err(e) = remove_entry(&aside) {
                eprintln!("warning: {e}: the run --overwrite replaced; remove it yourself");
            }
        }
    }
}

/// The shell command that renames `run/aside` back to `run/orig`: `--` ends mv's options, so a
/// run directory named `-x` is a path to it (`mv -x/...` was an invalid option).
fn move_back_command(run: &Path, aside: &str, orig: &str) -> String {
    let q = |name: &str| shell_quoted(&run.join(name).display().to_string());
    format!("mv -- {} {}", q(aside), q(orig))
}

/// `s` as one shell word: as it is when it holds only characters no shell treats specially,
/// else in single quotes (a run directory named `my run` split the suggested `mv` in two).
fn shell_quoted(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./-+=:,@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The old run's entries `--overwrite` moved aside (`.NAME.replaced-PID`, in the run
/// directory): removed once the new run has saved its first checkpoint ([`Replaced::remove`],
/// through `old_run::Pending`), put back when it fails to ([`Replaced::restore`]) or a signal
/// ends it first. Removed up front, the old run was lost to a new one that then stopped on a
/// FASTA record it could not read.
#[derive(Debug, Default)]
pub struct Replaced {
    moved: Vec<(PathBuf, PathBuf, crate::interrupt::Registered)>,
    /// The run's names nothing was moved from: what the new run writes there goes with a
    /// signal, so that the old run comes back without the new one's dataset beside it.
    fresh: Vec<crate::interrupt::Registered>,
}

impl Replaced {
    fn move_aside(&mut self, p: &Path) -> Result<()> {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        let aside = tagged_path(p, REPLACED);
        if std::fs::symlink_metadata(&aside).is_ok() {
            self.restore();
            return Err(Error::Invalid(format!(
                "--overwrite moves the old run's {name} to {} until the new run has saved a \
                 checkpoint, but that name is taken; nothing was changed. Move it away, then \
                 retry",
                aside.display()
            )));
        }
        if let Err(e) = std::fs::rename(p, &aside) {
            self.restore();
            return Err(Error::Invalid(format!(
                "--overwrite moves the old run's {} aside until the new run has saved a \
                 checkpoint, but it cannot be moved: {e}; nothing was changed",
                p.display()
            )));
        }
        let back = crate::interrupt::register_rename(aside.clone(), p.to_path_buf());
        self.moved.push((p.to_path_buf(), aside, back));
        Ok(())
    }

    /// Whether nothing was moved aside.
    pub fn is_empty(&self) -> bool {
        self.moved.is_empty()
    }

    /// The new run stands on its own: the old one goes for good ([`Replaced::disown`], then
    /// [`Trash::delete`]).
    pub fn remove(mut self) {
        crate::interrupt::critical(|| self.disown()).delete();
    }

    /// The first half of [`Replaced::remove`], renames only: from here the old run goes
    /// whatever happens. Each entry is renamed to `.NAME.removing-PID` (what a `kill -9`
    /// during the deletion leaves, and the next start removes: a half-deleted run was offered
    /// back as one to restore) and registered for removal before its rename back is dropped,
    /// and the run's names are the new run's. Call it inside the `interrupt::critical` section
    /// that makes the new run stand alone (its first checkpoint's commit): a signal between
    /// the two, or half-way through these renames, put some of the old run's files back over
    /// the new run's, or deleted its first checkpoint.
    pub fn disown(&mut self) -> Trash {
        self.fresh.clear();
        let gone = std::mem::take(&mut self.moved)
            .into_iter()
            .map(|(p, aside, back)| {
                let trash = tagged_path(&p, REMOVING);
                let target = match std::fs::rename(&aside, &trash) {
                    Ok(()) => trash,
                    Err(_) => aside,
                };
                let dir = std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir());
                let g = crate::interrupt::register(target.clone(), dir);
                drop(back);
                (target, g)
            })
            .collect();
        Trash(gone)
    }

    /// The new run did not start: what it wrote under the old run's names goes, and the old
    /// run's entries come back, as they were.
    pub fn restore(&mut self) {
        self.fresh.clear();
        for (p, aside, back) in self.moved.drain(..).rev() {
            drop(back);
            if std::fs::symlink_metadata(&p).is_ok() {
                let _ = remove_entry(&p);
            }
            if let Err(e) = std::fs::rename(&aside, &p) {
                eprintln!(
                    "warning: {}: the old run's {}, moved aside by --overwrite, could not be \
                     put back ({e}); rename it yourself",
                    aside.display(),
                    p.display()
                );
            }
        }
    }
}

/// Whether `name` is a checkpoint being written (`.step-N.tmp`) or pruned (`.step-N.pruning`):
/// names only genslm gives, to directories only it fills.
fn trash_step(name: &str) -> bool {
    name.strip_prefix(".step-").is_some_and(|n| {
        [".tmp", ".pruning"]
            .iter()
            .any(|suffix| n.strip_suffix(suffix).is_some_and(is_number))
    })
}

/// Removes the temporary entries a killed save leaves: in the run directory, `.NAME.tmp-PID`
/// of the files a run writes and `.data.parquet.new`; in `checkpoints/`, `.step-N.tmp/`,
/// `.step-N.pruning/` and `.latest.tmp-PID`. Only those names: the directory may hold the
/// user's own files, whatever they are called (a `.thesis.tmp/` of the user's was removed
/// whole when every dot-name ending in `.tmp` or `.new` counted as ours), and nothing that
/// holds one of this run's `inputs` is removed. Only the process that prepares the run calls it, before any rank
/// writes.
pub fn clean_stale(run: &Path, inputs: &[PathBuf]) -> Result<()> {
    let inputs: Vec<PathBuf> = inputs
        .iter()
        .filter_map(|p| p.canonicalize().ok())
        .collect();
    let atomic_of = |name: &str, targets: &[&str]| {
        targets.iter().any(|t| {
            name.strip_prefix(&format!(".{t}.tmp-"))
                .is_some_and(is_number)
        })
    };
    let in_run = |name: &str| {
        name == ".data.parquet.new"
            // The rest of a run `--overwrite` replaced, killed while it deleted it.
            || tagged_entry(name, REMOVING).is_some()
            || atomic_of(name, &[".data.parquet.new"])
            || atomic_of(name, &RUN_FILES)
            || atomic_of(name, &RUN_MARKERS)
    };
    let in_checkpoints = |name: &str| atomic_of(name, &["latest"]) || trash_step(name);
    for (dir, ours) in [
        (run.to_path_buf(), &in_run as &dyn Fn(&str) -> bool),
        (checkpoints_dir(run), &in_checkpoints),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if !ours(&e.file_name().to_string_lossy()) {
                continue;
            }
            if let Ok(canon) = p.canonicalize() {
                if inputs.iter().any(|i| i.starts_with(&canon)) {
                    continue;
                }
            }
            let r = if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            r.map_err(|e| Error::io(&p, e))?;
        }
    }
    Ok(())
}

/// Keeps `latest` and the newest `keep − 1` checkpoints before it, and removes older ones.
/// Never removed: `latest`, the checkpoint this run resumed from (`resumed_from`: its
/// rollback point), and checkpoints of later steps than `latest` (left by a run that went
/// further before `latest` was moved back: the user's; a resume that would reach them is
/// refused, [`check_later_checkpoints`]). `keep == 0` keeps all.
pub fn prune_checkpoints(run: &Path, keep: usize, resumed_from: Option<u64>) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let root = checkpoints_dir(run);
    let latest = root.join("latest");
    // Validated (a step-N of this run) before its number is read.
    let (text, _) = crate::model::io::read_latest(&latest)?;
    let Some(newest) = step_of(&text) else {
        return Ok(());
    };
    let mut older: Vec<(u64, PathBuf)> = std::fs::read_dir(&root)
        .map_err(|e| Error::io(&root, e))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| Some((step_of(&e.file_name().to_string_lossy())?, e.path())))
        .filter(|&(n, _)| n < newest && Some(n) != resumed_from)
        .collect();
    older.sort();
    // `latest` itself is one of the kept ones.
    let removable = older.len().saturating_sub(keep - 1);
    for (_, p) in older.into_iter().take(removable) {
        // Only what genslm wrote: a checkpoint whose manifest lists every file in it. A
        // `step-N` directory holding anything else (the user's notes, another run trained
        // into it) was removed whole; it is kept, and said so.
        match crate::checksum::unlisted_entries(&p) {
            Some(other) if other.is_empty() => {
                // Renamed out of the way first (one atomic step), then emptied: a kill part way
                // leaves `.step-N.pruning`, which the next start removes (sparing this run's
                // inputs, as it spares them in `.step-N.tmp`), never a
                // half-emptied `step-N` that looks like a stranger's (it was warned about at
                // every later save). Housekeeping: a checkpoint that cannot be removed
                // (another owner's file, NFS permissions) must not stop the training that has
                // just saved a newer one.
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                let trash = p.with_file_name(format!(".{name}.pruning"));
                let removed = std::fs::rename(&p, &trash)
                    .map_err(|e| Error::io(&p, e))
                    .and_then(|_| {
                        // A signal while it is emptied takes the rest with it.
                        let _gone = crate::interrupt::register(trash.clone(), true);
                        remove_checkpoint(&trash, &mut remove_entry)
                    });
                // After a signal its cleanup took the rest: nothing to say.
                if let Err(e) = removed.or_else(|e| {
                    if crate::interrupt::fired() {
                        Ok(())
                    } else {
                        Err(e)
                    }
                }) {
                    eprintln!(
                        "warning: {e}: not pruned (--keep-checkpoints); what is left is removed \
                         when the run next starts"
                    );
                }
            }
            // An empty `step-N` (what a prune killed before this one's renaming left) holds
            // nothing of anyone's.
            None if std::fs::remove_dir(&p).is_ok() => {}
            other => eprintln!(
                "warning: {}: not pruned (--keep-checkpoints): {}; remove it yourself if it \
                 is not needed",
                p.display(),
                match other {
                    Some(names) => format!(
                        "it holds files no genslm checkpoint writes ({})",
                        names.join(", ")
                    ),
                    None => format!("it has no {}", crate::checksum::MANIFEST_FILE),
                }
            ),
        }
    }
    Ok(())
}

/// Removes a checkpoint genslm wrote: every entry but its manifest, then the manifest, then the
/// directory, each with `remove`. Stopped part way, what is left is still listed by its
/// manifest, so it is still genslm's and pruned again later (removed in directory order, a
/// checkpoint could lose its manifest first and then be kept as a stranger's forever).
fn remove_checkpoint(dir: &Path, remove: &mut dyn FnMut(&Path) -> Result<()>) -> Result<()> {
    let manifest = dir.join(crate::checksum::MANIFEST_FILE);
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        if p != manifest {
            remove(&p)?;
        }
    }
    remove(&manifest)?;
    std::fs::remove_dir(dir).map_err(|e| Error::io(dir, e))
}

/// Removes a file or link (never what it points at), or a directory with its contents.
pub(crate) fn remove_entry(p: &Path) -> Result<()> {
    let is_dir = std::fs::symlink_metadata(p)
        .map_err(|e| Error::io(p, e))?
        .is_dir();
    let r = if is_dir {
        std::fs::remove_dir_all(p)
    } else {
        std::fs::remove_file(p)
    };
    r.map_err(|e| Error::io(p, e))
}

/// N of a `step-N` directory name, as genslm writes it (`step-03` or `step-+3` are not).
/// Refuses a resume from step `done` to `total` while `step-N` directories of steps in
/// between exist: left when `latest` was moved back by hand, they are the user's, and the run
/// would save over them (a checkpoint is replaced by the one of its step) or, once past them,
/// prune them as older than `latest`. Said before any work, with the way out.
pub fn check_later_checkpoints(run: &Path, done: u64, total: u64) -> Result<()> {
    let root = checkpoints_dir(run);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Ok(());
    };
    // Any entry of such a name (a file, a link, a dangling one): a save meets it too.
    let mut later: Vec<u64> = entries
        .flatten()
        .filter_map(|e| step_of(&e.file_name().to_string_lossy()))
        .filter(|&n| n > done && n <= total)
        .collect();
    if later.is_empty() {
        return Ok(());
    }
    later.sort_unstable();
    let names: Vec<String> = later.iter().map(|n| format!("step-{n}")).collect();
    Err(Error::Invalid(format!(
        "cannot resume from step {done}: {} holds checkpoints of later steps ({}), left when \
         `latest` was moved back (or, for one, by a run killed while it saved that step); a \
         run to step {total} would save over them or prune them as it passes their steps. Move \
         them out of {} to keep them (or delete them), or point `latest` at the one to resume \
         from, then resume",
        root.display(),
        names.join(", "),
        root.display()
    )))
}

#[cfg(test)]
#[path = "run_dir_tests.rs"]
mod tests;
