//! `genslm train --resume` end to end: a killed or finished run continues the same curve, a
//! changed setting is applied aloud or refused, and a damaged checkpoint is a clear error.

mod common;

use common::run;
use common::train_cli::{data, losses, strs, tiny, train, try_train};
use genslm::train::metrics::read_metrics;

#[test]
fn kill_and_resume_continues_the_same_curve() {
    let dir = tempfile::tempdir().unwrap();
    let (full, parts) = (dir.path().join("full"), dir.path().join("parts"));
    let common = [
        "--steps",
        "8",
        "--warmup",
        "2",
        "--val-every",
        "0",
        "--grad-accum",
        "2",
    ];
    train(&full, &common);
    // Interrupted after 3 steps (checkpoint written on stop), then resumed twice.
    let mut first: Vec<&str> = common.to_vec();
    first.extend(["--stop-after", "3"]);
    train(&parts, &first);
    assert_eq!(losses(&parts).len(), 3);
    let mut again: Vec<&str> = common.to_vec();
    again.extend(["--resume", "--stop-after", "2"]);
    train(&parts, &again);
    let mut last: Vec<&str> = common.to_vec();
    last.push("--resume");
    train(&parts, &last);
    assert_eq!(losses(&parts), losses(&full));
}

/// A finished 4-step run extended to 8 with `--resume --steps 8` logs steps 5–8; the first
/// four keep the rates of the 4-step schedule and the new ones follow the cosine of an 8-step
/// run (written out here in closed form: warm-up 2, lr 1e-3, floor 0.1·lr).
#[test]
fn a_finished_run_extends_with_resume_and_more_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ext");
    let common = ["--warmup", "2", "--lr", "1e-3", "--val-every", "0"];
    let mut four: Vec<&str> = common.to_vec();
    four.extend(["--steps", "4"]);
    train(&out, &four);
    let mut eight: Vec<&str> = common.to_vec();
    eight.extend(["--steps", "8", "--resume"]);
    let err = train(&out, &eight);
    assert!(err.contains("steps (checkpoint 4, now 8)"), "{err}");
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = m.iter().map(|m| m.step).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<u64>>());
    let cosine = |step: f64, total: f64| {
        let progress = (step - 2.0) / (total - 3.0);
        1e-3 * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
    };
    let want = [
        0.5e-3,
        1e-3,
        cosine(2.0, 4.0),
        cosine(3.0, 4.0),
        cosine(4.0, 8.0),
        cosine(5.0, 8.0),
        cosine(6.0, 8.0),
        cosine(7.0, 8.0),
    ];
    for (got, want) in m.iter().map(|m| m.lr).zip(want) {
        assert!((got - want).abs() <= 1e-12, "lr {got} vs {want}");
    }
    assert!(m.iter().all(|m| m.loss.is_finite()));
    // A resume that names no total keeps the run's 8 (the default 100 was taken, and the
    // schedule recomputed): nothing to do, as with --steps 8.
    let mut none: Vec<&str> = common.to_vec();
    none.push("--resume");
    let (ok, err) = try_train(&out, &data(), &none);
    assert!(
        !ok && err.contains("--steps 8: this run has done 8 steps"),
        "{err}"
    );
    // Finished again: a resume without a larger --steps says how to extend.
    let (ok, err) = try_train(&out, &data(), &eight);
    assert!(!ok && err.contains("larger --steps"), "{err}");
    // Fewer steps than done: the flag is named, not the checkpoint's trainer_state.json (which
    // read as forged), and no note on a schedule comes first.
    let mut six: Vec<&str> = common.to_vec();
    six.extend(["--steps", "6", "--resume"]);
    let (ok, err) = try_train(&out, &data(), &six);
    assert!(
        !ok && err.contains("--steps 6: this run has done 8 steps")
            && !err.contains("trainer_state.json")
            && !err.contains("recomputed"),
        "{err}"
    );
    // `latest` moved back by hand: the later checkpoint is the user's. A resume that would
    // save over it is refused before any work (it was replaced without a word); moved out of
    // checkpoints/, the resume runs.
    let ckpts = out.join("checkpoints");
    std::fs::write(ckpts.join("latest"), "step-4\n").unwrap();
    let weights = std::fs::read(ckpts.join("step-8/model.safetensors")).unwrap();
    let (ok, err) = try_train(&out, &data(), &eight);
    assert!(
        !ok && err.contains("checkpoints of later steps (step-8)") && err.contains("Move them out"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(ckpts.join("step-8/model.safetensors")).unwrap(),
        weights
    );
    std::fs::rename(ckpts.join("step-8"), dir.path().join("kept-step-8")).unwrap();
    train(&out, &eight);
    assert!(ckpts.join("step-8").is_dir());
}

#[test]
fn resume_refuses_changed_settings_and_missing_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &data(),
        "--config",
        &tiny(),
        "--out",
        out.to_str().unwrap(),
        "--resume",
        "--quiet",
    ]);
    assert!(!ok && err.contains("cannot resume"), "{err}");
    train(&out, &["--steps", "4", "--stop-after", "2"]);
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &data(),
        "--config",
        &tiny(),
        "--out",
        out.to_str().unwrap(),
        "--resume",
        "--quiet",
        "--steps",
        "4",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
    ]);
    assert!(!ok && err.contains("seq_len"), "{err}");
}

/// One flipped byte inside tensor data still parses as safetensors; the checkpoint's
/// sha256 manifest catches it on `score` and on `--resume`, naming the file. The manifest is
/// checked independently by coreutils' `sha256sum -c`.
#[test]
fn a_flipped_byte_inside_a_tensor_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, &["--steps", "2"]);
    let ckpt = out.join("checkpoints/step-2");
    let check = std::process::Command::new("sha256sum")
        .args(["-c", "--quiet", "checksums.sha256"])
        .current_dir(&ckpt)
        .status()
        .expect("sha256sum (coreutils) runs");
    assert!(check.success(), "sha256sum -c rejects genslm's manifest");
    let score = || {
        let (ok, _, err) = run(&[
            "score",
            "--model",
            out.to_str().unwrap(),
            "--fasta",
            &data(),
        ]);
        (ok, err)
    };
    let resume = || try_train(&out, &data(), &["--resume", "--steps", "4"]);
    // Flips a byte in the middle of the tensor data (past the JSON header).
    let flip = |file: &str| {
        let path = ckpt.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let at = header + (bytes.len() - header) / 2;
        bytes[at] ^= 0x10;
        std::fs::write(&path, bytes).unwrap();
    };
    for (file, commands) in [
        ("model.safetensors", 2),
        ("optimizer-rank00000-of-00001.safetensors", 1),
    ] {
        flip(file);
        let mut outcomes = vec![resume()];
        if commands == 2 {
            outcomes.push(score());
        }
        for (ok, err) in outcomes {
            assert!(!ok, "a flipped byte in {file} was accepted");
            assert!(
                err.contains(file) && err.contains("corrupt checkpoint") && err.contains("sha256"),
                "{err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
        flip(file);
    }
    // A rank's optimizer shard that is gone is named (it said only that a parameter's moments
    // were not all there).
    let shard = ckpt.join("optimizer-rank00000-of-00001.safetensors");
    let kept = std::fs::read(&shard).unwrap();
    std::fs::remove_file(&shard).unwrap();
    let (ok, err) = resume();
    assert!(
        !ok && err.contains("optimizer-rank00000-of-00001.safetensors: missing, but checksums"),
        "{err}"
    );
    std::fs::write(&shard, kept).unwrap();
    // Without the manifest the checkpoint is refused: it is plainly genslm's own (optimizer
    // shards), so deleting the manifest does not switch the check off.
    flip("model.safetensors");
    std::fs::remove_file(ckpt.join("checksums.sha256")).unwrap();
    let (ok, err) = score();
    assert!(!ok && err.contains("without its checksums.sha256"), "{err}");
    // As a foreign model directory (no trainer state, no optimizer shards) the same flipped
    // file loads: safetensors alone cannot tell.
    std::fs::remove_file(ckpt.join("trainer_state.json")).unwrap();
    std::fs::remove_file(ckpt.join("optimizer-rank00000-of-00001.safetensors")).unwrap();
    let (ok, err) = score();
    assert!(ok, "{err}");
}

#[test]
fn corrupt_checkpoint_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, &["--steps", "2"]);
    let weights = out.join("checkpoints/step-2/model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, _, err) = run(&[
        "score",
        "--model",
        out.to_str().unwrap(),
        "--fasta",
        &data(),
    ]);
    assert!(!ok, "score on a corrupt checkpoint must fail");
    assert!(
        err.contains("corrupt checkpoint") && err.contains("model.safetensors"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (ok, err) = try_train(&out, &data(), &["--resume", "--steps", "4"]);
    assert!(!ok && err.contains("corrupt checkpoint"), "{err}");
    let (ok, _, err) = run(&[
        "score",
        "--model",
        dir.path().to_str().unwrap(),
        "--fasta",
        &data(),
    ]);
    assert!(!ok && err.contains("not a model directory"), "{err}");
}

#[test]
fn sigkill_mid_run_then_resume_matches_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let (full, killed) = (dir.path().join("full"), dir.path().join("killed"));
    let settings = [
        "--steps",
        "60",
        "--checkpoint-every",
        "3",
        "--val-every",
        "0",
        "--warmup",
        "5",
    ];
    train(&full, &settings);
    // Start the same run and SIGKILL it as soon as a checkpoint exists (wherever it is then,
    // possibly in the middle of writing the next one).
    let mut args: Vec<String> = ["train", "--fasta", &data(), "--config", &tiny(), "--out"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(killed.display().to_string());
    for a in ["--quiet", "--seq-len", "64", "--batch-size", "4"]
        .iter()
        .chain(&settings)
    {
        args.push(a.to_string());
    }
    let mut child = common::bin().args(&args).spawn().unwrap();
    let latest = killed.join("checkpoints/latest");
    let t0 = std::time::Instant::now();
    while !latest.exists() && t0.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let mut resume: Vec<&str> = settings.to_vec();
    resume.push("--resume");
    train(&killed, &resume);
    assert_eq!(losses(&killed), losses(&full));
}

/// dc757c5 kept the checkpoint's weight decay and reset `attention` to flash without a word,
/// and continued an old data position over different records. A resume now applies the safe
/// changes and says so (and records them), and refuses different data, naming it.
#[test]
fn resume_applies_safe_changes_aloud_and_refuses_other_data() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let base = ["--steps", "4", "--val-every", "0", "--quiet"];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let first = with(&["--stop-after", "1", "--attention", "naive"]);
    let (ok, err) = try_train(&out, &data(), &strs(&first));
    assert!(ok, "{err}");
    let parquet_before = std::fs::metadata(out.join("data.parquet"))
        .unwrap()
        .modified()
        .unwrap();

    // A changed weight decay and attention kernel are applied, with a note each.
    let second = with(&[
        "--resume",
        "--stop-after",
        "1",
        "--weight-decay",
        "0.2",
        "--attention",
        "flash",
    ]);
    let (ok, err) = try_train(&out, &data(), &strs(&second));
    assert!(ok, "{err}");
    assert!(
        err.contains("weight_decay (checkpoint 0.01, now 0.2)"),
        "{err}"
    );
    assert!(
        err.contains("attention (checkpoint naive, now flash)"),
        "{err}"
    );
    // The unchanged FASTA was not tokenized again.
    let parquet_after = std::fs::metadata(out.join("data.parquet"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(parquet_before, parquet_after);
    let state = std::fs::read_to_string(out.join("checkpoints/step-2/trainer_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(state["train"]["weight_decay"], 0.2);
    assert_eq!(state["adamw"]["weight_decay"], 0.2);
    let cfg = std::fs::read_to_string(out.join("checkpoints/step-2/genslm.toml")).unwrap();
    assert!(cfg.contains("attention = \"flash\""), "{cfg}");

    // Other FASTA: refused, naming the data; the run's dataset and config stay as they were.
    let other = dir.path().join("other.fa");
    std::fs::write(
        &other,
        ">x\nATGGCTTTACCGTAAATGGCTTTACCGTAAATGGCTTTACCGTAAATGGCTTTACCGTAA\n".repeat(40),
    )
    .unwrap();
    let config_before = std::fs::read_to_string(out.join("config.toml")).unwrap();
    let third = with(&["--resume", "--weight-decay", "0.2"]);
    let (ok, err) = try_train(&out, other.to_str().unwrap(), &strs(&third));
    assert!(!ok && err.contains("training data differs"), "{err}");
    // Named as the user gave it, not as the temporary file it was tokenized into.
    assert!(
        err.contains("the FASTA input (") && err.contains("other.fa") && !err.contains(".new"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("config.toml")).unwrap(),
        config_before
    );
    assert!(!out.join(".data.parquet.new").exists());

    // Changed optimizer betas or model shape: refused, listing them; nothing rewritten.
    let (ok, err) = try_train(
        &out,
        &data(),
        &strs(&with(&["--resume", "--weight-decay", "0.2", "--lr", "0.5"])),
    );
    assert!(!ok && err.contains("lr (checkpoint"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("config.toml")).unwrap(),
        config_before
    );

    // The original data and settings still resume to the end.
    let (ok, err) = try_train(
        &out,
        &data(),
        &strs(&with(&["--resume", "--weight-decay", "0.2"])),
    );
    assert!(ok, "{err}");
    assert_eq!(losses(&out).len(), 4);
}

/// The run's tokenized copy of an unchanged FASTA input (`RUN/data.parquet`) is a cache: cut
/// short or replaced by other data, the FASTA is tokenized again and the resume continues the
/// same curve (it was refused, telling the user to resume with the same FASTA, which they had).
#[test]
fn a_damaged_copy_of_the_fasta_is_tokenized_again() {
    let dir = tempfile::tempdir().unwrap();
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    let common = ["--steps", "4", "--warmup", "2", "--val-every", "0"];
    train(&full, &common);
    let mut first: Vec<&str> = common.to_vec();
    first.extend(["--stop-after", "2"]);
    train(&part, &first);
    let copy = part.join("data.parquet");
    let bytes = std::fs::read(&copy).unwrap();
    let mut resume: Vec<&str> = common.to_vec();
    resume.extend(["--resume", "--stop-after", "1"]);
    for (damage, says) in [
        (bytes[..bytes.len() / 2].to_vec(), "parquet"),
        (
            // Another run's dataset: other records, a valid file.
            {
                let other = dir.path().join("other");
                let fa = common::write(dir.path(), "o.fa", b">o\nATGGCTAAACTGGAATTCCGT\n");
                let (ok, err) = try_train(&other, &common::arg(&fa), &["--steps", "1"]);
                assert!(ok, "{err}");
                std::fs::read(other.join("data.parquet")).unwrap()
            },
            "the training data differs",
        ),
    ] {
        std::fs::write(&copy, damage).unwrap();
        let err = train(&part, &resume);
        assert!(
            err.contains("the run's tokenized copy of its unchanged FASTA input")
                && err.contains(says),
            "{err}"
        );
        // Repaired: tokenized again, it is the copy the run wrote.
        assert_eq!(std::fs::read(&copy).unwrap(), bytes);
    }
    assert_eq!(losses(&part), losses(&full));
}

/// What `latest` names is missing, or the checkpoint lost its config.json: named as such (both
/// were bare "No such file or directory" errors).
#[test]
fn a_latest_naming_nothing_and_a_lost_config_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    train(&out, &["--steps", "4", "--stop-after", "2"]);
    let ckpts = out.join("checkpoints");
    std::fs::write(ckpts.join("latest"), "step-99\n").unwrap();
    let (ok, err) = try_train(&out, &data(), &["--steps", "4", "--resume"]);
    assert!(
        !ok && err.contains("names step-99, which is missing"),
        "{err}"
    );
    std::fs::write(ckpts.join("latest"), "step-2\n").unwrap();
    std::fs::remove_file(ckpts.join("step-2/config.json")).unwrap();
    let (ok, err) = try_train(&out, &data(), &["--steps", "4", "--resume"]);
    assert!(
        !ok && err.contains("config.json: missing, but checksums.sha256 lists it"),
        "{err}"
    );
}
