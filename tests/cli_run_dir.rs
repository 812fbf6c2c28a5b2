//! The run directory against concurrent and clumsy use (issue 37): one process at a time
//! (a lock the kernel releases when its holder dies), `--overwrite` never deletes the input
//! being read, `latest` never leads outside the run, and a genslm checkpoint whose manifest is
//! missing or edited is refused by every command that reads it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{arg, bin, repo, run};

fn tiny_args(out: &Path, steps: &str, seed: &str) -> Vec<String> {
    [
        "train",
        "--fasta",
        &arg(&repo().join("data")),
        "--config",
        &arg(&repo().join("configs/tiny.toml")),
        "--out",
        &arg(out),
        "--quiet",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--steps",
        steps,
        "--seed",
        seed,
        "--val-every",
        "0",
    ]
    .map(String::from)
    .to_vec()
}

fn train(out: &Path, steps: &str, extra: &[&str]) -> (bool, String) {
    let mut a = tiny_args(out, steps, "3");
    a.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let (ok, _, err) = run(&refs);
    (ok, err)
}

/// A child process killed when the test ends, whatever ends it.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A long training run in the background, once it holds the lock and has written its config.
fn start_long_run(out: &Path) -> Killed {
    let child = Killed(
        bin()
            .args(tiny_args(out, "1000000", "11"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let want = format!("process {} ", child.0.id());
    let t = Instant::now();
    while !(std::fs::read_to_string(out.join(".genslm.lock")).is_ok_and(|s| s.contains(&want))
        && out.join("config.toml").exists())
    {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the run did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn a_live_run_directory_refuses_a_second_train_a_resume_and_an_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut first = start_long_run(&out);
    let pid = format!("process {}", first.0.id());
    for extra in [&[][..], &["--resume"][..], &["--overwrite"][..]] {
        let (ok, err) = train(&out, "2", extra);
        assert!(!ok, "{extra:?} ran beside a live run");
        assert!(
            err.contains("in use by another genslm") && err.contains(&pid),
            "{extra:?}: {err}"
        );
    }
    // A tokenize into the run's directory needs its lock; its dataset is the run's alone.
    let tokenize_to = |name: &str| {
        let target = arg(&out.join(name));
        run(&[
            "tokenize",
            "--fasta",
            &arg(&repo().join("data")),
            "--out",
            &target,
        ])
    };
    let (ok, _, err) = tokenize_to("other.parquet");
    assert!(!ok, "tokenize wrote into a live run");
    assert!(
        err.contains("in use by another genslm") && err.contains(&pid),
        "{err}"
    );
    let (ok, _, err) = tokenize_to("data.parquet");
    assert!(!ok && err.contains("a file of the run in"), "{err}");
    // Nor may any other command's output replace a file of the run: its history, config or
    // checkpoint (embed, generate and score --per-token did, exit 0, lock or not).
    let fa = arg(&repo().join("data/lambda_virus.fa"));
    let model = arg(common::trained_tiny());
    for (args, file) in [
        (
            vec!["embed", "--model", &model, "--fasta", &fa],
            "data.parquet",
        ),
        (
            vec!["generate", "--model", &model, "--max-codons", "4"],
            "metrics.jsonl",
        ),
        (
            vec!["generate", "--model", &model, "--max-codons", "4"],
            "config.toml",
        ),
        (
            vec!["generate", "--model", &model, "--max-codons", "4"],
            "checkpoints/latest",
        ),
    ] {
        let target = arg(&out.join(file));
        let (ok, _, err) = run(&[&args[..], &["--out", &target, "--quiet"]].concat());
        assert!(!ok && err.contains("a file of the run in"), "{file}: {err}");
    }
    // The live run's files are untouched: still its own config (seed 11), still running.
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(config.contains("seed = 11"), "{config}");
    assert!(first.0.try_wait().unwrap().is_none(), "the first run died");
    // Killed, it leaves its lock file behind, which blocks nobody.
    drop(first);
    let (ok, err) = train(&out, "2", &["--overwrite"]);
    assert!(ok, "{err}");
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(config.contains("seed = 3"), "{config}");
    // Finished, its dataset is still its own (tokenize replaced it, exit 0, and the next
    // resume was refused for other data); other names are anyone's.
    let data = std::fs::read(out.join("data.parquet")).unwrap();
    let (ok, _, err) = tokenize_to("data.parquet");
    assert!(!ok && err.contains("a file of the run in"), "{err}");
    assert_eq!(std::fs::read(out.join("data.parquet")).unwrap(), data);
    let (ok, _, err) = tokenize_to("other.parquet");
    assert!(ok, "{err}");
}

/// A tokenize killed before its rename (SIGTERM from Slurm or `timeout`, kill -9) leaves its
/// temporary file; the next write of the same output removes it (nothing holds its lock).
#[test]
fn a_killed_writers_temporary_file_goes_with_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("genomes.parquet");
    let fasta = arg(&repo().join("data/lambda_virus.fa"));
    // What such a process leaves: its file under its process id, which no one holds locked.
    let leftover = dir.path().join(".genomes.parquet.tmp-999999993");
    std::fs::write(&leftover, b"PAR1 half a file").unwrap();
    let (ok, _, err) = run(&[
        "tokenize",
        "--fasta",
        &fasta,
        "--out",
        &arg(&out),
        "--quiet",
    ]);
    assert!(ok, "{err}");
    assert!(
        !leftover.exists(),
        "the dead writer's temporary file is still there"
    );
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["genomes.parquet"]);
}

/// A finished run's files are its own too (score --per-token over a checkpoint's optimizer
/// state made the next resume fail on a corrupt checkpoint), while other names inside the run
/// directory are anyone's.
#[test]
fn a_finished_runs_files_are_not_outputs_of_other_commands() {
    let dir = tempfile::tempdir().unwrap();
    let (out, step) = finished_run(dir.path());
    let fa = arg(&repo().join("data/lambda_virus.fa"));
    // A run's file is named as one whatever its name's format (metrics.jsonl was refused as
    // "not parquet" by --per-token, "not FASTA" by generate).
    for (args, flag) in [
        (
            vec!["score", "--model", &arg(&out), "--fasta", &fa],
            "--per-token",
        ),
        (
            vec!["generate", "--model", &arg(&out), "--max-codons", "4"],
            "--out",
        ),
    ] {
        let target = arg(&out.join("metrics.jsonl"));
        let (ok, _, err) = run(&[&args[..], &[flag, target.as_str()]].concat());
        assert!(
            !ok && err.contains("a file of the run in"),
            "{args:?}: {err}"
        );
    }
    let shard = step.join("checksums.sha256");
    assert!(shard.is_file());
    let before = std::fs::read(&shard).unwrap();
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &arg(&out),
        "--fasta",
        &fa,
        "--per-token",
        &arg(&shard),
    ]);
    assert!(!ok && err.contains("a file of the run in"), "{err}");
    assert_eq!(std::fs::read(&shard).unwrap(), before);
    let mine = out.join("scores.parquet");
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &arg(&out),
        "--fasta",
        &fa,
        "--per-token",
        &arg(&mine),
    ]);
    assert!(ok && mine.is_file(), "{err}");
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(ok, "{err}");
}

#[test]
fn an_out_that_is_a_file_is_named_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("notes.txt");
    std::fs::write(&out, "mine\n").unwrap();
    for extra in [&[][..], &["--overwrite"], &["--resume"]] {
        let (ok, err) = train(&out, "2", extra);
        assert!(
            !ok && err.contains("notes.txt") && err.contains("not a directory"),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "mine\n");
    // Nor may it stand where a directory of the path must ("File exists (os error 17)").
    let (ok, err) = train(&out.join("run/x"), "2", &[]);
    assert!(
        !ok && err.contains("notes.txt is a file, not a directory"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "mine\n");
    // A link to nowhere is named as one (the lock's open said "No such file or directory").
    let link = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("gone"), &link).unwrap();
    let (ok, err) = train(&link, "2", &[]);
    assert!(
        !ok && err.contains("a symbolic link that leads nowhere"),
        "{err}"
    );
    assert!(!dir.path().join("gone").exists());
}

/// A run trained into another run's `checkpoints/` was deleted whole when that run pruned its
/// checkpoints; a `step-N` holding the user's files went the same way.
#[test]
fn pruning_and_nesting_leave_what_is_not_genslms() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = finished_run(dir.path());
    let nested = out.join("checkpoints/step-9");
    let (ok, err) = train(&nested, "2", &[]);
    assert!(!ok && err.contains("a file of the run"), "{err}");
    assert!(!nested.exists());
    let mine = out.join("checkpoints/step-1");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "mine").unwrap();
    let extra = [
        "--resume",
        "--keep-checkpoints",
        "1",
        "--checkpoint-every",
        "1",
    ];
    let (ok, err) = train(&out, "4", &extra);
    assert!(ok, "{err}");
    assert!(err.contains("step-1: not pruned"), "{err}");
    assert!(mine.join("notes.txt").exists());
    // What genslm wrote is pruned as before (step-2, the resume point, stays).
    assert!(!out.join("checkpoints/step-3").exists());
    assert!(out.join("checkpoints/step-4").exists());
}

/// A finished 2-step run whose checkpoint the test then tampers with.
fn finished_run(dir: &Path) -> (PathBuf, PathBuf) {
    let out = dir.join("run");
    let (ok, err) = train(&out, "2", &[]);
    assert!(ok, "{err}");
    (out.clone(), out.join("checkpoints/step-2"))
}

fn score(model: &Path) -> (bool, String) {
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &arg(model),
        "--fasta",
        &arg(&repo().join("data/lambda_virus.fa")),
    ]);
    (ok, err)
}

#[test]
fn latest_outside_the_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = finished_run(dir.path());
    let (other, _) = finished_run(&dir.path().join("other"));
    std::fs::write(
        out.join("checkpoints/latest"),
        "../../other/run/checkpoints/step-2\n",
    )
    .unwrap();
    assert!(other.join("checkpoints/step-2").is_dir());
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("not a step-N checkpoint"), "{err}");
    let (ok, err) = score(&out);
    assert!(!ok && err.contains("not a step-N checkpoint"), "{err}");
}

#[test]
fn a_genslm_checkpoint_without_a_full_manifest_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (out, ckpt) = finished_run(dir.path());
    let manifest = ckpt.join("checksums.sha256");
    let full = std::fs::read_to_string(&manifest).unwrap();
    assert!(score(&out).0, "the intact checkpoint scores");

    // The manifest leaves out genslm.toml (which sets the default window): score and resume
    // refuse, naming it.
    let without: String = full
        .lines()
        .filter(|l| !l.ends_with("genslm.toml"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&manifest, without).unwrap();
    let (ok, err) = score(&out);
    assert!(!ok && err.contains("genslm.toml: not listed"), "{err}");
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("genslm.toml: not listed"), "{err}");

    // No manifest at all: every command that loads it refuses, naming what it saw.
    std::fs::remove_file(&manifest).unwrap();
    let (ok, err) = score(&out);
    assert!(!ok && err.contains("without its checksums.sha256"), "{err}");
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("without its checksums.sha256"), "{err}");
    let (ok, _, err) = run(&["generate", "--model", &arg(&out), "--max-codons", "8"]);
    assert!(!ok && err.contains("without its checksums.sha256"), "{err}");

    // The same files as a foreign model directory (no trainer state, no optimizer shards)
    // load without a manifest.
    for e in std::fs::read_dir(&ckpt).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "trainer_state.json" || name.starts_with("optimizer-rank") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    let (ok, err) = score(&ckpt);
    assert!(ok, "{err}");
}

/// A trainer state edited to say another step, its manifest re-hashed to match (so the
/// checksums pass): the step must be the one the checkpoint's directory is named for, and the
/// data position and optimizer count must agree with it.
#[test]
fn a_forged_trainer_state_with_a_rehashed_manifest_is_refused() {
    use sha2::{Digest, Sha256};
    let dir = tempfile::tempdir().unwrap();
    let (out, ckpt) = finished_run(dir.path());
    let state_path = ckpt.join("trainer_state.json");
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_path).unwrap()).unwrap();
    let forge = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut s = good.clone();
        edit(&mut s);
        let text = serde_json::to_string_pretty(&s).unwrap();
        std::fs::write(&state_path, &text).unwrap();
        let hash: String = Sha256::digest(text.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let manifest = ckpt.join("checksums.sha256");
        let lines: String = std::fs::read_to_string(&manifest)
            .unwrap()
            .lines()
            .map(|l| match l.ends_with("trainer_state.json") {
                true => format!("{hash}  trainer_state.json\n"),
                false => format!("{l}\n"),
            })
            .collect();
        std::fs::write(&manifest, lines).unwrap();
    };
    let per_step = good["loader_cursor"].as_u64().unwrap() / 2;
    // Step 1 with the data position of step 1: consistent in itself, but this is step-2.
    forge(&|s| {
        s["step"] = 1.into();
        s["optimizer_step"] = 1.into();
        s["loader_cursor"] = per_step.into();
    });
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(
        !ok && err.contains("says step 1 but is the checkpoint of step-2"),
        "{err}"
    );
    // The right step with the data position of another.
    forge(&|s| s["loader_cursor"] = (3 * per_step).into());
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("does not match step 2"), "{err}");
    // More optimizer steps than training steps.
    forge(&|s| s["optimizer_step"] = 3.into());
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("optimizer step 3 is past"), "{err}");
    // The untouched state resumes.
    forge(&|_| {});
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(ok, "{err}");
}

/// Odd things where a checkpoint has files: each is named for what it is, at once (a named
/// pipe read as a file would block for ever), and a resume with nothing to resume says how
/// to start over.
#[test]
fn odd_files_in_a_checkpoint_are_named_for_what_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let (out, ckpt) = finished_run(dir.path());
    let latest = out.join("checkpoints/latest");
    let saved = std::fs::read(&latest).unwrap();
    std::fs::remove_file(&latest).unwrap();
    std::os::unix::fs::symlink(&latest, &latest).unwrap();
    let (ok, err) = score(&out);
    assert!(
        !ok && err.contains("latest: a symbolic link that leads nowhere"),
        "{err}"
    );
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(
        !ok && err.contains("latest: a symbolic link that leads nowhere"),
        "{err}"
    );
    // A link to the step's directory, and no `latest` at all beside a complete checkpoint:
    // the way out names the checkpoint (the missing one sent the user to --overwrite, which
    // deletes it).
    let step = String::from_utf8(saved.clone()).unwrap();
    let step = step.trim();
    std::fs::remove_file(&latest).unwrap();
    std::os::unix::fs::symlink(step, &latest).unwrap();
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(
        !ok && err.contains(&format!(
            "latest: a directory, not a file (a link to {step})"
        )) && err.contains(&format!("latest && echo {step} > ")),
        "{err}"
    );
    std::fs::remove_file(&latest).unwrap();
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(
        !ok && err.contains(&format!("holds checkpoints ({step})"))
            && err.contains("--overwrite would delete them"),
        "{err}"
    );
    std::fs::write(&latest, saved).unwrap();

    let weights = ckpt.join("model.safetensors");
    std::fs::rename(&weights, dir.path().join("weights")).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&weights)
        .status()
        .unwrap();
    assert!(made.success());
    let (ok, err) = score(&out);
    assert!(
        !ok && err.contains("model.safetensors: a named pipe (FIFO), not a file"),
        "{err}"
    );
    std::fs::remove_file(&weights).unwrap();
    std::fs::create_dir(&weights).unwrap();
    let (ok, err) = score(&out);
    assert!(
        !ok && err.contains("model.safetensors: a directory, not a file"),
        "{err}"
    );

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (ok, err) = train(&empty, "4", &["--resume"]);
    assert!(
        !ok && err.contains("no completed checkpoint yet") && err.contains("--overwrite"),
        "{err}"
    );
}

/// The user's own hidden files in --out survive a run, whatever they are called (a
/// `.thesis.tmp/` directory, `.vimrc.new` and `.x.tmp-1` were removed as stale temporaries,
/// and so was an input under `.stage.tmp/`, before it was read); the temporaries a killed
/// save leaves are still removed by the next run.
#[test]
fn only_genslms_own_temporaries_are_cleaned() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("u");
    std::fs::create_dir_all(out.join(".thesis.tmp")).unwrap();
    std::fs::write(out.join(".thesis.tmp/ch1.txt"), "precious").unwrap();
    std::fs::write(out.join(".vimrc.new"), "k").unwrap();
    std::fs::write(out.join(".x.tmp-1"), "k").unwrap();
    std::fs::create_dir(out.join(".stage.tmp")).unwrap();
    let fa = out.join(".stage.tmp/lambda.fa");
    std::fs::copy(repo().join("data/lambda_virus.fa"), &fa).unwrap();
    let train_on = |steps: &str, extra: &[&str]| {
        let mut a = tiny_args(&out, steps, "3");
        a[2] = arg(&fa);
        a.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        let (ok, _, err) = run(&refs);
        assert!(ok, "{err}");
    };
    let mine = [
        ".thesis.tmp/ch1.txt",
        ".vimrc.new",
        ".x.tmp-1",
        ".stage.tmp/lambda.fa",
    ];
    train_on("2", &[]);
    for f in mine {
        assert!(out.join(f).is_file(), "{f} removed");
    }
    // What a save killed part-way leaves: removed by the resume.
    let ck = out.join("checkpoints");
    std::fs::create_dir(ck.join(".step-9.tmp")).unwrap();
    let stale = [
        ck.join(".step-9.tmp/model.safetensors"),
        ck.join(".latest.tmp-4242"),
        out.join(".config.toml.tmp-4242"),
        out.join(".data.parquet.new"),
        // The dataset's own atomic temporary, left by a kill -9 while it was written.
        out.join("..data.parquet.new.tmp-4242"),
        // What a kill -9 leaves while --overwrite deletes the run it replaced.
        out.join(".metrics.jsonl.removing-4242"),
    ];
    for f in &stale {
        std::fs::write(f, "half").unwrap();
    }
    train_on("4", &["--resume"]);
    assert!(!ck.join(".step-9.tmp").exists());
    for f in &stale {
        assert!(!f.exists(), "{} left", f.display());
    }
    for f in mine {
        assert!(out.join(f).is_file(), "{f} removed");
    }
}

/// A run's files replaced by named pipes: refused, naming the file, where reading them waited
/// for a writer forever (metrics.jsonl on resume, data.sources.json, a parquet dataset).
#[test]
fn named_pipes_among_a_runs_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, err) = train(&out, "2", &[]);
    assert!(ok, "{err}");
    let fifo = |p: &Path| {
        std::fs::remove_file(p).unwrap();
        assert!(std::process::Command::new("mkfifo")
            .arg(p)
            .status()
            .unwrap()
            .success());
    };
    fifo(&out.join("metrics.jsonl"));
    let (ok, err) = train(&out, "4", &["--resume"]);
    assert!(!ok && err.contains("metrics.jsonl: a named pipe"), "{err}");
    fifo(&out.join("data.parquet"));
    let (ok, _, err) = run(&[
        "embed",
        "--model",
        &arg(&out),
        "--data",
        &arg(&out.join("data.parquet")),
        "--out",
        &arg(&dir.path().join("e.parquet")),
    ]);
    assert!(!ok && err.contains("data.parquet: a named pipe"), "{err}");
}
