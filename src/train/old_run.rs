//! The old run `train --overwrite` replaces, from the new run's start to its first checkpoint.
//!
//! The old run's entries were moved aside (`run_dir::Replaced`). Removed as soon as the new run
//! had read its data, the old run was lost to a Ctrl-C a minute into the new one, to a rank that
//! failed to read the dataset, or to a loss gone NaN at step 2, none of which left a run to
//! resume. Held here, it goes once the new run's first checkpoint is committed, and comes back
//! when the new run ends before that (or a signal ends it: the registrations).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::run_lock::{RUN_FILES, RUN_MARKERS};
use crate::train::run_dir::{remove_entry, Replaced, Trash};

#[derive(Debug)]
enum State {
    /// Aside, to be put back if the new run ends without a checkpoint.
    Held(Replaced),
    /// The new run's first checkpoint is committed: being deleted.
    Disowned(Trash),
}

/// The old run of one run directory (none where `--overwrite` moved nothing aside).
#[derive(Debug, Default)]
pub struct Pending {
    state: Option<State>,
    run: PathBuf,
    /// The lock file this start added to a directory that had none (a user's directory of
    /// run files), registered for a signal: removed with the new run's files when the old run
    /// comes back.
    new_lock: Option<(PathBuf, crate::interrupt::Registered)>,
}

impl Pending {
    /// `replaced` of the run directory `run`, held only when it moved something aside.
    pub fn new(
        replaced: Replaced,
        run: &Path,
        new_lock: Option<(PathBuf, crate::interrupt::Registered)>,
    ) -> Self {
        if replaced.is_empty() {
            replaced.remove();
            return Self::default();
        }
        Self {
            state: Some(State::Held(replaced)),
            run: run.to_path_buf(),
            new_lock,
        }
    }

    /// The new run stands on its own: renames only, for the `interrupt::critical` section that
    /// commits its first checkpoint (see [`Replaced::disown`]).
    fn disown(&mut self) {
        if let Some(State::Held(mut r)) = self.state.take() {
            self.state = Some(State::Disowned(r.disown()));
            self.new_lock = None;
        }
    }

    /// The new run stands on its own: the old one goes for good.
    pub fn started(mut self) {
        match self.state.take() {
            Some(State::Held(mut r)) => crate::interrupt::critical(|| r.disown()).delete(),
            Some(State::Disowned(t)) => t.delete(),
            None => {}
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        match self.state.take() {
            None => {}
            // The new run's checkpoint stands: the old run goes, whatever ended the run.
            Some(State::Disowned(t)) => t.delete(),
            // After a signal its thread puts the old run back (`Replaced`'s drop leaves that
            // to it, and so does this the lock file's registration).
            Some(State::Held(_)) if crate::interrupt::fired() => {
                std::mem::forget(self.new_lock.take());
            }
            Some(State::Held(mut replaced)) => {
                let (run, lock) = (self.run.clone(), self.new_lock.take());
                // As one section, which a signal's cleanup waits for: it renamed the old run
                // back while these removals ran, and they deleted it.
                crate::interrupt::critical(move || {
                    // What stands under the run's names is the new run's: its files, its
                    // metrics, a checkpoint whose save failed (the old run's entries are put
                    // back over theirs).
                    for name in RUN_FILES.iter().chain(&RUN_MARKERS) {
                        let _ = remove_entry(&run.join(name));
                    }
                    replaced.restore();
                    if let Some((lock, _registered)) = lock {
                        let _ = std::fs::remove_file(lock);
                    }
                });
            }
        }
    }
}

/// A [`Pending`] shared by a run's ranks (threads of this process clone it with their options):
/// rank 0 disowns it when it commits its first checkpoint and deletes it after; the launcher
/// settles it when the run ends.
#[derive(Debug, Clone, Default)]
pub struct OldRun(Arc<Mutex<Option<Pending>>>);

impl OldRun {
    pub fn hold(pending: Pending) -> Self {
        Self(Arc::new(Mutex::new(Some(pending))))
    }

    fn take(&self) -> Option<Pending> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Inside the critical section that commits a checkpoint: from here the old run goes.
    pub fn disown(&self) {
        if let Some(p) = self.0.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.disown();
        }
    }

    /// After a checkpoint: the old run goes (the slow part, outside the commit's section).
    pub fn saved(&self) {
        if let Some(p) = self.take() {
            p.started();
        }
    }

    /// The run ended: the old run goes if the new one ended well or saved a checkpoint, else
    /// it comes back. Called while the run's lock is held.
    pub fn settle(&self, ok: bool) {
        if let Some(p) = self.take() {
            match ok {
                true => p.started(),
                false => drop(p),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::run_dir::claim;

    /// Every file under `dir` but the lock, with its text, sorted.
    fn listing(dir: &Path) -> Vec<(String, String)> {
        fn walk(dir: &Path, prefix: &str, out: &mut Vec<(String, String)>) {
            for e in std::fs::read_dir(dir).unwrap().flatten() {
                let p = e.path();
                let name = format!("{prefix}{}", e.file_name().to_string_lossy());
                if name == crate::run_lock::LOCK_FILE {
                    continue;
                }
                if p.is_dir() {
                    walk(&p, &format!("{name}/"), out);
                } else {
                    out.push((name, std::fs::read_to_string(&p).unwrap()));
                }
            }
        }
        let mut out = Vec::new();
        walk(dir, "", &mut out);
        out.sort();
        out
    }

    /// The old run `--overwrite` replaces stays aside until the new run's first checkpoint:
    /// dropped before it (the run failed), the old run's entries are back as they were and
    /// the new run's files, metrics and half-saved checkpoint are gone; once a checkpoint was
    /// committed (disowned), or the run ended well, the old run is gone and the new run's
    /// files stay. The user's own file is never touched.
    #[test]
    fn the_old_run_comes_back_unless_the_new_one_saved() {
        for end in ["failed", "saved then failed", "ended well"] {
            let dir = tempfile::tempdir().unwrap();
            let run = dir.path().join("run");
            std::fs::create_dir_all(run.join("checkpoints/step-4")).unwrap();
            std::fs::write(run.join("checkpoints/step-4/model.safetensors"), "w4").unwrap();
            std::fs::write(run.join("checkpoints/latest"), "step-4").unwrap();
            std::fs::write(run.join("metrics.jsonl"), "{\"step\":4}\n").unwrap();
            std::fs::write(run.join("config.toml"), "old").unwrap();
            std::fs::write(run.join("notes.txt"), "mine").unwrap();
            let before = listing(&run);
            let replaced = claim(&run, false, true, &[]).unwrap();
            // What the new run writes before its first checkpoint.
            std::fs::write(run.join("config.toml"), "new").unwrap();
            std::fs::write(run.join("data.parquet"), "new data").unwrap();
            std::fs::write(run.join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
            std::fs::create_dir_all(run.join("checkpoints/.step-1.tmp")).unwrap();
            let old = OldRun::hold(Pending::new(replaced, &run, None));
            match end {
                "failed" => {
                    old.settle(false);
                    assert_eq!(listing(&run), before, "{end}");
                    continue;
                }
                "saved then failed" => {
                    std::fs::remove_dir(run.join("checkpoints/.step-1.tmp")).unwrap();
                    std::fs::create_dir(run.join("checkpoints/step-1")).unwrap();
                    std::fs::write(run.join("checkpoints/step-1/model.safetensors"), "w1").unwrap();
                    std::fs::write(run.join("checkpoints/latest"), "step-1").unwrap();
                    old.disown();
                    old.settle(false);
                }
                _ => old.settle(true),
            }
            let mut want = vec![
                ("config.toml".to_string(), "new".to_string()),
                ("data.parquet".into(), "new data".into()),
                ("metrics.jsonl".into(), "{\"step\":1}\n".into()),
                ("notes.txt".into(), "mine".into()),
            ];
            if end == "saved then failed" {
                want.insert(0, ("checkpoints/latest".into(), "step-1".into()));
                want.insert(
                    1,
                    ("checkpoints/step-1/model.safetensors".into(), "w1".into()),
                );
            }
            assert_eq!(listing(&run), want, "{end}");
        }
    }
}
