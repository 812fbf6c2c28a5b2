//! `train --overwrite` replaces a run only once the new one has started: never the inputs
//! it reads, never before its inputs are found and read, and a start that fails leaves the
//! old run — or the user's empty directory — as it was.

mod common;

use std::path::Path;

use common::{arg, repo, run};

fn train(out: &Path, steps: &str, extra: &[&str]) -> (bool, String) {
    let fasta = arg(&repo().join("data"));
    let config = arg(&repo().join("configs/tiny.toml"));
    let out = arg(out);
    let mut a = vec![
        "train",
        "--fasta",
        &fasta,
        "--config",
        &config,
        "--out",
        &out,
        "--quiet",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        steps,
        "--seed",
        "3",
        "--val-every",
        "0",
    ];
    a.extend(extra);
    let (ok, _, err) = run(&a);
    (ok, err)
}

/// `train INPUT --config CONFIG --out OUT --overwrite --quiet --steps 2`: a replacement
/// that must leave the old run as it was.
fn replace(input: (&str, &str), config: &str, out: &str) -> (bool, String, String) {
    let a = [
        "train",
        input.0,
        input.1,
        "--config",
        config,
        "--out",
        out,
        "--overwrite",
        "--quiet",
        "--steps",
        "2",
    ];
    run(&a)
}

/// Every entry of `dir` (names with a hash of their bytes, directories walked) but the lock
/// file (it names its holder), to compare a run before and after.
fn snapshot(dir: &Path) -> Vec<(String, u64)> {
    use std::hash::{Hash, Hasher};
    let hash = |b: &[u8]| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        b.hash(&mut h);
        h.finish()
    };
    let mut v = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = p.strip_prefix(dir).unwrap().display().to_string();
            if name == ".genslm.lock" {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
                v.push((name + "/", 0));
            } else {
                v.push((name, hash(&std::fs::read(&p).unwrap())));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn overwrite_refuses_to_delete_the_dataset_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    assert!(train(&out, "2", &[]).0);
    let data = out.join("data.parquet");
    let (ok, _, err) = replace(
        ("--data", &arg(&data)),
        &arg(&repo().join("configs/tiny.toml")),
        &arg(&out),
    );
    assert!(!ok);
    assert!(
        err.contains("--overwrite would delete") && err.contains("data.parquet"),
        "{err}"
    );
    assert!(data.is_file() && out.join("checkpoints/latest").is_file());
    // Nor a run whose replacement's inputs are not there (a mistyped --fasta or --data
    // deleted the old run, then failed on the missing file).
    for input in ["--fasta", "--data"] {
        let (ok, _, err) = replace(
            (input, &arg(&dir.path().join("typo.fa"))),
            &arg(&repo().join("configs/tiny.toml")),
            &arg(&out),
        );
        assert!(!ok && err.contains("typo.fa"), "{input}: {err}");
        assert!(
            data.is_file() && out.join("checkpoints/latest").is_file(),
            "{input}"
        );
    }
    // Nor the settings it reads: a user's config.toml in --out was replaced by the resolved
    // one (its comments gone, exit 0).
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    let text = format!(
        "# my settings\n{}",
        std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap()
    );
    let config = common::write(&mine, "config.toml", text.as_bytes());
    let (ok, _, err) = replace(
        ("--fasta", &arg(&repo().join("data/lambda_virus.fa"))),
        &arg(&config),
        &arg(&mine),
    );
    assert!(
        !ok && err.contains("--overwrite would delete") && err.contains("config.toml"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), text);
    // Nor a genome that `--fasta RUN` finds among the old run's entries: it was read from
    // the old run moved aside, then deleted with it (and the new run's record of its inputs
    // named a path gone, so it could not resume).
    let kept = out.join("checkpoints/genomes");
    std::fs::create_dir(&kept).unwrap();
    std::fs::copy(repo().join("data/lambda_virus.fa"), kept.join("g.fa")).unwrap();
    let before = snapshot(&out);
    let (ok, _, err) = replace(
        ("--fasta", &arg(&out)),
        &arg(&repo().join("configs/tiny.toml")),
        &arg(&out),
    );
    assert!(
        !ok && err.contains("--overwrite would delete") && err.contains("g.fa"),
        "{err}"
    );
    assert_eq!(snapshot(&out), before);
}

/// A replacement that fails on its data — a FASTA with an unreadable record, a dataset of
/// another vocabulary — after the old run's inputs were found: the old run was deleted first
/// (exit 1, nothing left to resume). Now it is moved aside and put back, every byte, and a
/// user's empty directory stays empty (a failed start left its dataset and lock in it).
#[test]
fn a_replacement_that_fails_to_start_leaves_the_old_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    assert!(train(&out, "2", &[]).0);
    let before = snapshot(&out);
    let bad = common::write(dir.path(), "bad.fa", b">one\nACGTACGTAC\n>two\nACG!TTT\n");
    let other = dir.path().join("other.parquet");
    let (ok, _, err) = run(&[
        "tokenize",
        "--fasta",
        &arg(&repo().join("data/lambda_virus.fa")),
        "--out",
        &arg(&other),
        "--vocab",
        "genslm71",
    ]);
    assert!(ok, "{err}");
    let config = arg(&repo().join("configs/tiny.toml"));
    for (input, path, want) in [("--fasta", &bad, "two"), ("--data", &other, "genslm71")] {
        let (ok, _, err) = replace((input, &arg(path)), &config, &arg(&out));
        assert!(!ok && err.contains(want), "{input}: {err}");
        assert_eq!(snapshot(&out), before, "{input}: the old run changed");
    }
    // Nor a replacement that fails before its first checkpoint, a loss gone NaN at the first
    // steps: the old run was deleted once the data was read, and nothing was left to resume.
    let (ok, err) = train(&out, "3", &["--overwrite", "--lr", "1e30", "--warmup", "0"]);
    assert!(!ok && err.contains("--lr"), "{err}");
    assert_eq!(snapshot(&out), before, "the old run changed");
    // Replaced once the new run has its first checkpoint, with nothing of the old one left
    // aside.
    let (ok, err) = train(&out, "1", &["--overwrite"]);
    assert!(ok, "{err}");
    let names: Vec<String> = snapshot(&out).into_iter().map(|(n, _)| n).collect();
    assert!(
        names
            .iter()
            .all(|n| !n.contains("replaced") && !n.contains("removing")),
        "{names:?}"
    );
    assert!(
        names.contains(&"checkpoints/step-1/".to_string()),
        "{names:?}"
    );
    assert!(
        !names.contains(&"checkpoints/step-2/".to_string()),
        "{names:?}"
    );

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &arg(&bad),
        "--config",
        &config,
        "--out",
        &arg(&empty),
        "--quiet",
    ]);
    assert!(!ok && err.contains("two"), "{err}");
    assert_eq!(common::listing(&empty), Vec::<String>::new());
}

/// What a `kill -9` in the middle of an `--overwrite` leaves (the old run under
/// `.NAME.replaced-PID`) stops every later train into the directory, naming it; the `mv`
/// commands the message gives, run by a shell as they are printed (a directory name with a
/// space and a quote), put the run back, and it resumes.
#[test]
fn a_killed_overwrites_leftovers_are_named_with_commands_that_restore_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("my run's");
    assert!(train(&out, "2", &[]).0);
    for name in ["checkpoints", "metrics.jsonl", "config.toml"] {
        let aside = out.join(format!(".{name}.replaced-4242"));
        std::fs::rename(out.join(name), aside).unwrap();
    }
    for extra in [&["--resume"][..], &["--overwrite"], &[]] {
        let (ok, err) = train(&out, "4", extra);
        assert!(
            !ok && err.contains(".checkpoints.replaced-4242")
                && err.contains("Nothing was changed"),
            "{extra:?}: {err}"
        );
    }
    let (_, err) = train(&out, "4", &["--resume"]);
    let cmds = err
        .split("move it back (")
        .nth(1)
        .and_then(|r| r.split("); to drop it").next())
        .unwrap_or_else(|| panic!("{err}"));
    let status = std::process::Command::new("sh")
        .args(["-c", cmds])
        .status()
        .unwrap();
    assert!(status.success(), "{cmds}");
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(ok, "{err}");
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-4");
}
