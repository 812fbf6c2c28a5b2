//! Tests of `run_dir`: pruning, stale temporaries, later checkpoints.

use super::*;

fn steps(run: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(checkpoints_dir(run))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort_by_key(|n| step_of(n));
    v
}

/// A checkpoint as genslm writes one: its files and the manifest listing them.
fn checkpoint(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), b"w").unwrap();
    // Written directly: once `latest` exists, atomic writes refuse a run's files.
    let hash = crate::checksum::sha256_file(&dir.join("model.safetensors")).unwrap();
    let line = format!("{hash}  model.safetensors\n");
    std::fs::write(dir.join(crate::checksum::MANIFEST_FILE), line).unwrap();
}

/// Only a checkpoint whose manifest lists all it holds is pruned: a `step-N` of the
/// user's (notes in it, a run trained into it) was removed whole, and so were `step-03`
/// and `step-+3`, names genslm never writes.
#[test]
fn pruning_removes_only_what_genslm_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path();
    let root = checkpoints_dir(run);
    for n in [1, 2, 3, 4] {
        checkpoint(&root.join(format!("step-{n}")));
    }
    std::fs::write(root.join("step-2/notes.txt"), "mine").unwrap();
    std::fs::create_dir_all(root.join("step-1/checkpoints")).unwrap();
    for odd in ["step-03", "step-+3"] {
        checkpoint(&root.join(odd));
    }
    std::fs::write(root.join("latest"), "step-4\n").unwrap();
    prune_checkpoints(run, 1, None).unwrap();
    let mut left = steps(run);
    left.sort();
    assert_eq!(left, ["step-+3", "step-03", "step-1", "step-2", "step-4"]);
    assert!(root.join("step-2/notes.txt").exists());
}

/// A prune that fails part way leaves the checkpoint's manifest (it went first, and the
/// half-removed checkpoint was kept as a stranger's at every later save), and the next
/// prune finishes it.
#[test]
fn a_prune_stopped_part_way_is_finished_later() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path();
    let root = checkpoints_dir(run);
    for n in [1, 2] {
        checkpoint(&root.join(format!("step-{n}")));
    }
    let old = root.join("step-1");
    let mut refuse = |p: &Path| -> Result<()> {
        Err(Error::io(
            p,
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        ))
    };
    let e = remove_checkpoint(&old, &mut refuse)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    // Removed but for the manifest: still genslm's, still prunable.
    let mut calls = 0;
    let mut once = |p: &Path| -> Result<()> {
        calls += 1;
        if calls == 1 {
            remove_entry(p)
        } else {
            Err(Error::io(
                p,
                std::io::Error::from(std::io::ErrorKind::PermissionDenied),
            ))
        }
    };
    assert!(remove_checkpoint(&old, &mut once).is_err());
    assert!(old.join(crate::checksum::MANIFEST_FILE).is_file());
    assert!(!old.join("model.safetensors").exists());
    assert_eq!(crate::checksum::unlisted_entries(&old), Some(vec![]));
    std::fs::write(root.join("latest"), "step-2\n").unwrap();
    prune_checkpoints(run, 1, None).unwrap();
    assert_eq!(steps(run), ["step-2"]);
}

/// A prune killed part way left a half-emptied `step-N` (or an empty one) that was warned
/// about at every later save; now a checkpoint is renamed `.step-N.pruning` before it is
/// emptied. An empty `step-N` from before goes at the next prune; `.step-N.pruning` at the
/// next start, which spares this run's inputs.
#[test]
fn what_a_killed_prune_leaves_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path();
    let root = checkpoints_dir(run);
    for n in [3, 4] {
        checkpoint(&root.join(format!("step-{n}")));
    }
    let trash = root.join(".step-1.pruning");
    checkpoint(&trash);
    std::fs::remove_file(trash.join(crate::checksum::MANIFEST_FILE)).unwrap();
    std::fs::create_dir(root.join("step-2")).unwrap();
    std::fs::write(root.join("latest"), "step-4\n").unwrap();
    prune_checkpoints(run, 1, None).unwrap();
    assert_eq!(steps(run), ["step-4"]);
    assert!(
        trash.exists(),
        "left to the start, which knows the run's inputs"
    );
    // At a start: a pruning leftover goes, unless it holds an input; a user's look-alike
    // stays.
    let input = root.join(".step-9.pruning/genome.fa");
    std::fs::create_dir(input.parent().unwrap()).unwrap();
    std::fs::write(&input, ">a\nACG\n").unwrap();
    std::fs::create_dir(root.join(".step-x.pruning")).unwrap();
    clean_stale(run, std::slice::from_ref(&input)).unwrap();
    assert!(!trash.exists() && input.exists());
    assert!(root.join(".step-x.pruning").exists());
}

/// Entries named for steps a resume would reach are refused, whatever they are (a file
/// or a dangling link made the save fail mid-run); names that are no step, steps not
/// passed and steps before the resume point are not.
#[cfg(unix)]
#[test]
fn later_checkpoints_a_resume_would_reach_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path();
    let root = checkpoints_dir(run);
    for d in ["step-3", "step-4", "step-6", "step-07", "step-12"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(root.join("step-9"), b"mine").unwrap();
    std::os::unix::fs::symlink(run.join("gone"), root.join("step-10")).unwrap();
    let e = check_later_checkpoints(run, 4, 10).unwrap_err().to_string();
    assert!(e.contains("(step-6, step-9, step-10)"), "{e}");
    assert!(check_later_checkpoints(run, 4, 5).is_ok());
    assert!(check_later_checkpoints(run, 10, 11).is_ok());
    assert!(check_later_checkpoints(&run.join("none"), 0, 10).is_ok());
}

#[test]
fn pruning_spares_latest_the_resume_point_and_later_steps() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path();
    let root = checkpoints_dir(run);
    for n in [2, 4, 6, 8, 10] {
        checkpoint(&root.join(format!("step-{n}")));
    }
    // A rollback: `latest` moved back to step-6, the run resumed from step-4 (its own
    // earlier rollback) and then wrote step-6 again.
    std::fs::write(root.join("latest"), "step-6\n").unwrap();
    prune_checkpoints(run, 1, Some(4)).unwrap();
    assert_eq!(steps(run), ["step-4", "step-6", "step-8", "step-10"]);
    // keep 2: latest and the one before it; step-2 went already.
    checkpoint(&root.join("step-2"));
    prune_checkpoints(run, 2, None).unwrap();
    assert_eq!(steps(run), ["step-4", "step-6", "step-8", "step-10"]);
    prune_checkpoints(run, 1, None).unwrap();
    assert_eq!(steps(run), ["step-6", "step-8", "step-10"]);
    // keep 0 keeps everything; a `latest` pointing elsewhere stops the pruning.
    prune_checkpoints(run, 0, None).unwrap();
    std::fs::write(root.join("latest"), "../../other/checkpoints/step-2\n").unwrap();
    let e = prune_checkpoints(run, 1, None).unwrap_err().to_string();
    assert!(e.contains("not a step-N checkpoint"), "{e}");
    assert_eq!(steps(run), ["step-6", "step-8", "step-10"]);
}

/// The command that moves a killed `--overwrite`'s leftover back works, run by a shell as
/// printed, for a relative run directory whose name starts with `-` (mv read it as options)
/// or holds a space and a quote.
#[test]
fn the_move_back_command_works_for_any_run_name() {
    let dir = tempfile::tempdir().unwrap();
    for run in ["-x", "my run's", "--"] {
        std::fs::create_dir(dir.path().join(run)).unwrap();
        std::fs::write(dir.path().join(run).join(".config.toml.replaced-7"), "old").unwrap();
        let cmd = move_back_command(Path::new(run), ".config.toml.replaced-7", "config.toml");
        let status = std::process::Command::new("sh")
            .current_dir(dir.path())
            .args(["-c", &cmd])
            .status()
            .unwrap();
        assert!(status.success(), "{cmd}");
        let back = std::fs::read_to_string(dir.path().join(run).join("config.toml"));
        assert_eq!(back.ok().as_deref(), Some("old"), "{cmd}");
    }
}
