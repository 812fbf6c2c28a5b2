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
    for sig in [libc::SIGTERM, libc::SIGINT] {
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
        let done = child.wait_with_output().unwrap();
        assert_eq!(done.status.signal(), Some(sig), "{:?}", done.status);
        assert!(
            listing(dir.path()).is_empty(),
            "signal {sig} left {:?}",
            listing(dir.path())
        );
    }
}
