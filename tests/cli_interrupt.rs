//! Ctrl-C and kill (SIGINT, SIGTERM) end a command with the signal's status and take its
//! temporary output with it: a stopped `generate` left `.NAME.tmp-PID` behind until the next
//! run to the same path swept it. `kill -9` cannot be caught (the sweep stays its answer).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{arg, trained_tiny};

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Waits, polling, until `ready`, at most a minute (then fails listing `dir`).
fn wait_until(dir: &Path, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{:?}",
            listing(dir)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A named pipe at `path`, which no one writes yet: a run reading it waits there.
fn fifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
}

#[test]
fn a_signal_removes_the_temporary_output() {
    let model = arg(trained_tiny());
    // The last: Ctrl-C pressed twice (the second killed the cleanup the first began).
    for (sig, twice) in [
        (libc::SIGTERM, false),
        (libc::SIGINT, false),
        (libc::SIGINT, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("samples.fa");
        // Long enough to be caught writing: 64 samples of 4,000 codons each.
        let mut child = common::bin()
            .args(["generate", "--model", &model, "--quiet", "--threads", "1"])
            .args(["--num", "64", "--max-codons", "4000", "--out", &arg(&out)])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while listing(dir.path()).is_empty() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no temporary file appeared"
            );
            if let Some(status) = child.try_wait().unwrap() {
                panic!("generate ended before it was signalled: {status}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let tmp = listing(dir.path());
        assert!(tmp[0].starts_with(".samples.fa.tmp-"), "{tmp:?}");
        // SAFETY: signals the child this test started.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
        if twice {
            std::thread::sleep(Duration::from_millis(1));
            // SAFETY: as above (the child may be gone already: no assertion).
            unsafe { libc::kill(child.id() as i32, sig) };
        }
        let done = child.wait_with_output().unwrap();
        assert_eq!(done.status.signal(), Some(sig), "{:?}", done.status);
        assert!(
            listing(dir.path()).is_empty(),
            "signal {sig} left {:?}",
            listing(dir.path())
        );
    }
}

/// A signal while `train --overwrite` reads its new data (here a named pipe no one writes
/// yet, so the moment is certain) puts the old run back: it had been removed before the new
/// data was read, and the signal left neither run.
#[test]
fn a_signal_during_an_overwrite_puts_the_old_run_back() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let repo = common::repo();
    let train = |fasta: &Path, extra: &[&str]| {
        let mut c = common::bin();
        c.args([
            "train",
            "--fasta",
            &arg(fasta),
            "--out",
            &arg(&out),
            "--quiet",
        ])
        .args(["--config", &arg(&repo.join("configs/tiny.toml"))])
        .args(["--seq-len", "32", "--batch-size", "2", "--steps", "2"])
        .args(extra)
        .stderr(std::process::Stdio::piped());
        c
    };
    let done = train(&repo.join("data/lambda_virus.fa"), &[])
        .output()
        .unwrap();
    assert!(done.status.success(), "{done:?}");
    let before = listing(&out);
    let pipe = dir.path().join("genome.fa");
    fifo(&pipe);
    let mut child = train(&pipe, &["--overwrite"]).spawn().unwrap();
    // Waiting on the pipe: the old run is moved aside by then.
    wait_until(&out, || {
        listing(&out).iter().any(|n| n.contains(".replaced-"))
    });
    // SAFETY: signals the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert_eq!(listing(&out), before);
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-2");
}

/// A signal in the middle of a replacement's training, before its first checkpoint, puts the
/// old run back as it was, and nothing of the new run stays (the old run was deleted once the
/// new data was read, and the signal left a run with metrics but no checkpoint).
#[test]
fn a_signal_before_the_replacements_first_checkpoint_puts_the_old_run_back() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let repo = common::repo();
    let train = |extra: &[&str]| {
        let mut c = common::bin();
        c.args(["train", "--quiet", "--out", &arg(&out)])
            .args(["--fasta", &arg(&repo.join("data/lambda_virus.fa"))])
            .args(["--config", &arg(&repo.join("configs/tiny.toml"))])
            .args(["--seq-len", "32", "--batch-size", "2"])
            .args(extra)
            .stderr(std::process::Stdio::piped());
        c
    };
    let done = train(&["--steps", "2"]).output().unwrap();
    assert!(done.status.success(), "{done:?}");
    let before = listing(&out);
    let old_metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let mut child = train(&["--steps", "1000000", "--overwrite", "--seed", "9"])
        .spawn()
        .unwrap();
    // Training: the new run's metrics have a step (its first checkpoint is a million away).
    wait_until(&out, || {
        std::fs::read(out.join("metrics.jsonl")).is_ok_and(|m| m != old_metrics && !m.is_empty())
    });
    // SAFETY: signals the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    assert_eq!(listing(&out), before);
    assert_eq!(
        std::fs::read(out.join("metrics.jsonl")).unwrap(),
        old_metrics
    );
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-2");
}

/// A `checkpoints/` with no `latest` is no run to refuse, and a fresh run into its directory
/// starts beside it; a signal while that run reads its data (a named pipe no one writes yet)
/// leaves it whole: it is not the run's to remove.
#[test]
fn a_signal_leaves_a_checkpoints_directory_the_run_did_not_make() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let kept = out.join("checkpoints/step-100");
    std::fs::create_dir_all(&kept).unwrap();
    std::fs::write(kept.join("notes.txt"), "mine").unwrap();
    let pipe = dir.path().join("genome.fa");
    fifo(&pipe);
    let repo = common::repo();
    let mut child = common::bin()
        .args([
            "train",
            "--quiet",
            "--out",
            &arg(&out),
            "--fasta",
            &arg(&pipe),
        ])
        .args(["--config", &arg(&repo.join("configs/tiny.toml"))])
        .args(["--seq-len", "32", "--batch-size", "2", "--steps", "2"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The lock is taken just before the directory is claimed; the pipe then holds the run.
    wait_until(&out, || out.join(".genslm.lock").exists());
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signals the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert_eq!(
        std::fs::read_to_string(kept.join("notes.txt"))
            .ok()
            .as_deref(),
        Some("mine"),
        "{:?}",
        listing(&out)
    );
}
