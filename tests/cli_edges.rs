//! `genslm train` and `score` at the edges: forged trainer states, run directories that
//! already hold a run, stale temporaries, checkpoint pruning, absurd windows, frozen ranks
//! (overflowing updates and endless skips: `cli_nonfinite.rs`).

mod common;

use std::path::Path;

use common::{arg, repo, run};
use genslm::train::metrics::read_metrics;

/// Tiny on the bundled genomes at seq 64, batch 4 (`train_cli::try_train`), quietly; never a
/// panic.
fn train(out: &Path, extra: &[&str]) -> (bool, String) {
    let args = [&["--quiet"][..], extra].concat();
    let (ok, err) = common::train_cli::try_train(out, &common::train_cli::data(), &args);
    assert!(!err.contains("panicked"), "{err}");
    (ok, err)
}

fn step_dirs(out: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

/// A hand-edited trainer state that cannot belong to the run is refused, naming the file.
#[test]
fn a_forged_trainer_state_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("forge");
    let (ok, err) = train(&out, &["--steps", "4", "--stop-after", "1"]);
    assert!(ok, "{err}");
    let state = out.join("checkpoints/step-1/trainer_state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    // genslm's own checkpoint: its sha256 manifest no longer matches the edited file.
    std::fs::write(&state, text.replace("\"step\": 1,", "\"step\": 99999,")).unwrap();
    let (ok, err) = train(&out, &["--steps", "4", "--resume"]);
    assert!(
        !ok && err.contains("trainer_state.json") && err.contains("sha256"),
        "{err}"
    );
    // A forger who also rewrites the manifest (with sha256sum, its format) meets the state's
    // own consistency checks.
    let ckpt = out.join("checkpoints/step-1");
    let rehash = || {
        let names: Vec<String> = std::fs::read_to_string(ckpt.join("checksums.sha256"))
            .unwrap()
            .lines()
            .map(|l| l[66..].to_string())
            .collect();
        let o = std::process::Command::new("sha256sum")
            .args(&names)
            .current_dir(&ckpt)
            .output()
            .expect("sha256sum (coreutils) runs");
        std::fs::write(ckpt.join("checksums.sha256"), o.stdout).unwrap();
    };
    for (from, to, want) in [
        (
            "\"step\": 1,",
            "\"step\": 99999,",
            "says step 99999 but is the checkpoint of step-1",
        ),
        (
            "\"loader_cursor\": 4,",
            "\"loader_cursor\": 7,",
            "data position 7",
        ),
    ] {
        assert!(text.contains(from), "{text}");
        std::fs::write(&state, text.replace(from, to)).unwrap();
        rehash();
        let (ok, err) = train(&out, &["--steps", "4", "--resume"]);
        assert!(
            !ok && err.contains("trainer_state.json") && err.contains(want),
            "{err}"
        );
    }
}

/// A fresh run into a directory holding a run is refused (dc757c5 mixed both runs'
/// checkpoints); `--overwrite` replaces it; stale temporaries of killed saves are removed;
/// `--keep-checkpoints 2` keeps two step directories.
#[test]
fn run_directories_are_claimed_cleaned_and_pruned() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, err) = train(
        &out,
        &[
            "--steps",
            "5",
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "2",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(step_dirs(&out), vec!["step-4", "step-5"]);

    let (ok, err) = train(&out, &["--steps", "2"]);
    assert!(
        !ok && err.contains("already holds a run") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(step_dirs(&out), vec!["step-4", "step-5"]);

    let stale_dir = out.join("checkpoints/.step-9.tmp-12345");
    std::fs::create_dir_all(&stale_dir).unwrap();
    std::fs::write(stale_dir.join("model.safetensors"), b"half").unwrap();
    std::fs::write(out.join("checkpoints/.latest.tmp-12345"), b"step-9").unwrap();
    let (ok, err) = train(&out, &["--steps", "2", "--overwrite"]);
    assert!(ok, "{err}");
    assert_eq!(step_dirs(&out), vec!["step-2"]);
    assert_eq!(read_metrics(&out.join("metrics.jsonl")).unwrap().len(), 2);
    let hidden: Vec<_> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "stale temporaries left: {hidden:?}");

    // A directory that holds a run's files but no run (the --config kept there, a dataset):
    // refused, nothing changed; --overwrite replaces them.
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    let cfg = std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap() + "# mine\n";
    std::fs::write(mine.join("config.toml"), &cfg).unwrap();
    std::fs::write(mine.join("data.parquet"), b"not yours").unwrap();
    let (ok, err) = train(&mine, &["--steps", "1"]);
    assert!(
        !ok && err.contains("holds config.toml, data.parquet but no run"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("config.toml")).unwrap(),
        cfg
    );
    assert_eq!(
        std::fs::read(mine.join("data.parquet")).unwrap(),
        b"not yours"
    );
    let (ok, err) = train(&mine, &["--steps", "1", "--overwrite"]);
    assert!(ok, "{err}");

    // A run that fails validation leaves no directory behind.
    let bad = dir.path().join("never");
    let (ok, err) = train(&bad, &["--steps", "2", "--seq-len", "1"]);
    assert!(!ok, "{err}");
    assert!(!bad.exists());
}

/// A short record scored with an enormous window costs its own length, not the window's
/// (dc757c5 padded every window to --seq-len: 25.6 GB for 961 codons at 10⁸).
#[test]
fn score_does_not_pad_to_an_absurd_window() {
    let model = common::trained_tiny();
    let dir = tempfile::tempdir().unwrap();
    let fa = common::write(
        dir.path(),
        "short.fa",
        b">s\nATGGCTTTACCGTAAATGGCTTTACCGTAA\n",
    );
    // tiny is rotary: a window past max_position_embeddings is allowed (the positions
    // extrapolate), and short records must not allocate it.
    let (ok, out, err) = run(&[
        "score",
        "--model",
        &arg(model),
        "--fasta",
        &arg(&fa),
        "--seq-len",
        "100000000",
    ]);
    assert!(ok, "{err}");
    let (ok2, out2, err2) = run(&[
        "score",
        "--model",
        &arg(model),
        "--fasta",
        &arg(&fa),
        "--seq-len",
        "64",
    ]);
    assert!(ok2, "{err2}");
    assert_eq!(out, out2);
}

/// `train` of tiny into `out` for `steps` steps, as a command to extend.
fn tiny_ranks(out: &Path, steps: &str) -> std::process::Command {
    let mut c = common::bin();
    c.args(["train", "--fasta", &arg(&repo().join("data"))])
        .args(["--config", &arg(&repo().join("configs/tiny.toml"))])
        .args([
            "--out",
            &arg(out),
            "--quiet",
            "--seq-len",
            "64",
            "--batch-size",
            "4",
        ])
        .args(["--steps", steps]);
    c
}

/// A thread rank frozen in a computation (test hook) no longer hangs the process: the others
/// time out, and the process exits with their message within the timeout plus a grace period
/// (dc757c5 waited forever to join the frozen thread).
#[test]
fn a_frozen_rank_ends_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frozen");
    let start = std::time::Instant::now();
    let o = tiny_ranks(&out, "5")
        .args(["--sp", "2", "--dp", "2", "--rank-timeout-s", "3"])
        .env("GENSLM_FREEZE_RANK", "2:2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("no answer from the other ranks"), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("internal error"),
        "{err}"
    );
    assert!(
        err.contains("rank 2 will hang without end at step 2 (a test hook)"),
        "{err}"
    );
    assert!(
        start.elapsed().as_secs() < 3 + 10,
        "took {:?}",
        start.elapsed()
    );
    // A mistyped hook is refused by name instead of running without its fault.
    let o = tiny_ranks(&dir.path().join("typo"), "5")
        .env("GENSLM_FAULT_RANK", "2-2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("GENSLM_FAULT_RANK=2-2: a test hook takes RANK:STEP"),
        "{err}"
    );
    for bad in ["0", "abc", "4294967296"] {
        let o = tiny_ranks(&dir.path().join("count"), "5")
            .env("GENSLM_MPI_MAX_COUNT", bad)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("GENSLM_MPI_MAX_COUNT={bad}:")),
            "{err}"
        );
    }
}

/// A job stopped (SIGSTOP, as Ctrl-Z or a Slurm suspend do) for 20 s, four times the rank
/// timeout, finishes normally once continued: only running time counts towards the timeout.
#[test]
fn a_suspended_run_finishes_after_it_is_continued() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("suspended");
    let child = tiny_ranks(&out, "300")
        .args([
            "--val-every",
            "0",
            "--sp",
            "2",
            "--dp",
            "2",
            "--rank-timeout-s",
            "5",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // Wait until training is under way, then stop the whole process for 20 s.
    let metrics = out.join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while !metrics.exists() && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    std::thread::sleep(std::time::Duration::from_secs(20));
    signal("-CONT");
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(read_metrics(&metrics).unwrap().len(), 300);
}

/// A garbage genslm.toml beside a checkpoint is an error naming it, not a silent fallback to
/// max_position_embeddings (dc757c5 embedded with the 2048 window instead of the trained one).
#[test]
fn a_garbage_genslm_toml_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("g");
    let (ok, err) = train(&out, &["--steps", "1"]);
    assert!(ok, "{err}");
    let toml = out.join("checkpoints/step-1/genslm.toml");
    std::fs::write(&toml, "this is not toml [").unwrap();
    let fa = arg(&repo().join("data/dwv.fasta.gz"));
    let (ok, _, err) = run(&["score", "--model", &arg(&out), "--fasta", &fa]);
    assert!(!ok && err.contains("genslm.toml"), "{err}");
    // An explicit window needs no training settings.
    let (ok, _, err) = run(&[
        "score",
        "--model",
        &arg(&out),
        "--fasta",
        &fa,
        "--seq-len",
        "64",
    ]);
    assert!(ok, "{err}");
}

/// A bad training setting is blamed on where it came from: the flag that gave it (the config
/// file was named "after command-line overrides", sending the user to a file that was right),
/// or the file when no flag did.
#[test]
fn a_bad_setting_names_the_flag_or_the_file_that_gave_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = train(
        &dir.path().join("a"),
        &["--steps", "1", "--weight-decay", "NaN"],
    );
    assert!(
        !ok && err.contains("error: --weight-decay: field `weight_decay` (NaN)")
            && !err.contains("tiny.toml"),
        "{err}"
    );
    // A run directory spelled through '.' or '..' (runs/q/.. trained into runs/).
    for spelled in ["q/..", "q/."] {
        let (ok, err) = train(&dir.path().join(spelled), &["--steps", "1"]);
        assert!(
            !ok && err.contains("name the directory itself"),
            "{spelled}: {err}"
        );
    }
    assert!(!dir.path().join("q").exists());
    // A learning rate f32 cannot hold (1e-45 is 0 there, 1e39 infinite) is refused by flag;
    // a skip limit without skipping is noted.
    for lr in ["1e-45", "1e39"] {
        let (ok, err) = train(&dir.path().join("lr"), &["--steps", "1", "--lr", lr]);
        assert!(
            !ok && err.contains("--lr: field `lr`") && err.contains("in f32"),
            "{lr}: {err}"
        );
    }
    let (ok, err) = train(
        &dir.path().join("skips"),
        &[
            "--steps",
            "1",
            "--max-consecutive-skips",
            "3",
            "--val-fraction",
            "0",
        ],
    );
    assert!(
        ok && err.contains("note: --max-consecutive-skips counts"),
        "{err}"
    );
    let text = std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap();
    let bad = format!("{text}\n[train]\nweight_decay = -1.0\n");
    assert!(!text.contains("[train]"), "tiny.toml grew a [train] table");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, bad).unwrap();
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &arg(&repo().join("data")),
        "--config",
        &arg(&cfg),
        "--out",
        &arg(&dir.path().join("b")),
        "--quiet",
    ]);
    assert!(
        !ok && err.contains("bad.toml: field `weight_decay`") && !err.contains("overrides"),
        "{err}"
    );
    // The flag of the same name overrides the file's bad value (it was refused over it).
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &arg(&repo().join("data/lambda_virus.fa")),
        "--config",
        &arg(&cfg),
        "--out",
        &arg(&dir.path().join("c")),
        "--quiet",
        "--steps",
        "1",
        "--seq-len",
        "64",
        "--weight-decay",
        "0.1",
    ]);
    assert!(ok, "{err}");
}

/// A model directory whose weights hold tensors its config.json has no place for (the config
/// edited to fewer layers, or a stray tensor added) is refused by name, not loaded without them.
#[test]
fn weights_the_config_does_not_describe_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let from = common::tiny_checkpoint();
    std::fs::copy(
        from.join("model.safetensors"),
        model.join("model.safetensors"),
    )
    .unwrap();
    let text = std::fs::read_to_string(from.join("config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&text).unwrap();
    let layers = cfg["num_hidden_layers"].as_u64().unwrap();
    assert!(layers >= 2, "the tiny model has {layers} layers");
    cfg["num_hidden_layers"] = (layers - 1).into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let fa = arg(&repo().join("data/lambda_virus.fa"));
    let (ok, _, err) = run(&["score", "--model", &arg(&model), "--fasta", &fa, "--quiet"]);
    let last = format!("gpt_neox.layers.{}.", layers - 1);
    assert!(!ok, "scored with a layer dropped");
    assert!(
        err.contains("is not a parameter of the model") && err.contains(&last),
        "{err}"
    );
}

/// Weights that are finite but overflow in fp32 (a final LayerNorm scaled to 3e38) give NaN
/// outputs: score, embed and variants refuse them with a message instead of writing NaN rows.
#[test]
fn outputs_that_overflow_are_refused() {
    use genslm::model::tensors::{read_safetensors, write_safetensors_streamed, Streamed};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let from = common::tiny_checkpoint();
    std::fs::copy(from.join("config.json"), model.join("config.json")).unwrap();
    let (tensors, _) = read_safetensors(&from.join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let streamed: Vec<Streamed<'_>> = names
        .iter()
        .map(|&n| {
            let t = &tensors[n];
            let huge = n == "gpt_neox.final_layer_norm.weight";
            Streamed {
                name: n.clone(),
                shape: t.shape.clone(),
                values: Box::new(move || match huge {
                    true => vec![3e38; t.data.len()],
                    false => t.data.clone(),
                }),
            }
        })
        .collect();
    let weights = model.join("model.safetensors");
    write_safetensors_streamed(&weights, &streamed, Default::default()).unwrap();
    let (m, fa) = (arg(&model), arg(&repo().join("data/lambda_virus.fa")));
    let vcf = arg(&repo().join("examples/lambda_cro.vcf"));
    let out = arg(&dir.path().join("out"));
    let cases: [&[&str]; 3] = [
        &["score", "--model", &m, "--fasta", &fa, "--seq-len", "64"],
        &[
            "embed",
            "--model",
            &m,
            "--fasta",
            &fa,
            "--out",
            &out,
            "--seq-len",
            "64",
        ],
        &[
            "variants", "--model", &m, "--fasta", &fa, "--vcf", &vcf, "--out", &out,
        ],
    ];
    for args in cases {
        let mut args = args.to_vec();
        if args[0] == "variants" {
            args.extend(["--cds", "38041..38241"]);
        }
        let (ok, stdout, err) = run(&args);
        assert!(!ok, "{args:?} succeeded: {stdout}");
        assert!(err.contains("not finite"), "{args:?}: {err}");
        assert!(
            !dir.path().join("out").exists(),
            "{args:?} wrote its output"
        );
    }
}

/// A warm-up as long as the run is noted (the learning rate never got past its ramp, without
/// a word); a shorter one is not.
#[test]
fn a_warmup_as_long_as_the_run_is_noted() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = train(&dir.path().join("a"), &["--steps", "2", "--warmup", "2"]);
    assert!(
        ok && err.contains("note: --warmup 2 is not shorter than --steps 2"),
        "{err}"
    );
    let (ok, err) = train(&dir.path().join("b"), &["--steps", "3", "--warmup", "2"]);
    assert!(ok && !err.contains("--warmup"), "{err}");
    // The peak said is the schedule's last value, checked against the log: 4 of 8 warm-up
    // steps reach half of --lr (it said "--lr at most").
    let c = dir.path().join("c");
    let (ok, err) = train(&c, &["--steps", "4", "--warmup", "8", "--lr", "0.004"]);
    assert!(
        ok && err.contains("reaching 0.002 (50% of --lr 0.004) at its last step"),
        "{err}"
    );
    let m = read_metrics(&c.join("metrics.jsonl")).unwrap();
    assert!((m.last().unwrap().lr - 0.002).abs() < 1e-12, "{m:?}");
}
