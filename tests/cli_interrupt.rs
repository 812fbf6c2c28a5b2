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
    let c_path = std::ffi::CString::new(pipe.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let mut child = train(&pipe, &["--overwrite"]).spawn().unwrap();
    let start = Instant::now();
    // Waiting on the pipe: the old run is moved aside by then.
    while !listing(&out).iter().any(|n| n.contains(".replaced-")) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{:?}",
            listing(&out)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    assert_eq!(listing(&out), before);
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-2");
}
