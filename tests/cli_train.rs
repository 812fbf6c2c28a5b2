//! `genslm train` and `genslm score` end to end on the bundled genomes with the tiny config.

mod common;

use std::path::Path;

use common::train_cli::{data, losses, tiny, train, try_train};
use common::{repo, run};
use genslm::train::metrics::read_metrics;

#[test]
fn loss_decreases_on_bundled_genomes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(
        &out,
        &[
            "--steps",
            "80",
            "--lr",
            "5e-3",
            "--warmup",
            "4",
            "--val-every",
            "20",
        ],
    );
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.len(), 80);
    // An untrained model predicts nearly uniformly over 69 tokens: loss ≈ ln 69 = 4.234.
    assert!(
        (m[0].loss - 69f64.ln()).abs() < 0.1,
        "first loss {}",
        m[0].loss
    );
    let first: f64 = m[..5].iter().map(|x| x.loss).sum::<f64>() / 5.0;
    let last: f64 = m[75..].iter().map(|x| x.loss).sum::<f64>() / 5.0;
    assert!(
        last < first - 0.08,
        "loss did not decrease: {first} -> {last}"
    );
    let val: Vec<f64> = m.iter().filter_map(|x| x.val_loss).collect();
    assert_eq!(val.len(), 4, "validation at steps 20, 40, 60 and 80");
    assert!(val[3] < val[0] && val[3] < 69f64.ln() - 0.1, "{val:?}");
    for x in &m {
        assert!(x.tokens > 0 && x.tokens_per_s > 0.0 && x.tflops > 0.0 && x.peak_rss_mib > 1.0);
        assert!(x.grad_norm.is_finite() && x.lr > 0.0);
    }
    // The run directory holds the resolved config, the dataset and a HF checkpoint.
    for f in [
        "config.toml",
        "data.parquet",
        "checkpoints/latest",
        "checkpoints/step-80/config.json",
        "checkpoints/step-80/model.safetensors",
        "checkpoints/step-80/optimizer-rank00000-of-00001.safetensors",
        "checkpoints/step-80/trainer_state.json",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
}

#[test]
fn same_seed_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    train(&a, &["--steps", "6", "--seed", "7"]);
    train(&b, &["--steps", "6", "--seed", "7"]);
    assert_eq!(losses(&a), losses(&b));
    let c = dir.path().join("c");
    train(&c, &["--steps", "6", "--seed", "8"]);
    assert_ne!(losses(&a), losses(&c), "a different seed changes the run");
    // Activation checkpointing recomputes the same forward: the same curve (up to rounding).
    let d = dir.path().join("d");
    train(
        &d,
        &["--steps", "6", "--seed", "7", "--checkpoint-activations"],
    );
    for (x, y) in losses(&d).iter().zip(losses(&a)) {
        assert!((x - y).abs() <= 1e-5 * y.abs(), "checkpointed {x} vs {y}");
    }
    assert_eq!(losses(&d).len(), losses(&a).len());
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad_cfg = dir.path().join("bad.toml");
    let text = std::fs::read_to_string(tiny())
        .unwrap()
        .replace("num_heads = 4", "num_heads = 3");
    std::fs::write(&bad_cfg, text).unwrap();
    let out = dir.path().join("o");
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &data(),
        "--config",
        bad_cfg.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("bad.toml") && err.contains("num_heads"),
        "{err}"
    );
    let empty = dir.path().join("n.fa");
    // Every record is shorter than two codons: nothing to predict.
    std::fs::write(&empty, ">x\nACG\n>y\nAC\n").unwrap();
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        empty.to_str().unwrap(),
        "--config",
        &tiny(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    // Named by the FASTA, not the temporary file it was tokenized into.
    assert!(
        !ok && err.contains("n.fa: no training samples") && !err.contains(".new"),
        "{err}"
    );
    // Quantized collectives: an encoding that does not exist, and weights quantized where no
    // weights are gathered.
    let base = ["train", "--fasta", &data(), "--config", &tiny(), "--quiet"];
    let out = out.to_str().unwrap();
    let (ok, _, err) = run(&[&base[..], &["--out", out, "--quantize-grads", "int4"]].concat());
    assert!(
        !ok && err.contains("int4") && err.contains("int8, bf16, or fp32"),
        "{err}"
    );
    let flags = ["--out", out, "--dp", "2", "--quantize-weights", "int8"];
    let (ok, _, err) = run(&[&base[..], &flags[..]].concat());
    assert!(
        !ok && err.contains("--quantize-weights int8") && err.contains("--zero 3"),
        "{err}"
    );
}

/// `--backend cuda` where it cannot run: without the feature, a message that says how to
/// rebuild; with it (a CUDA build on a machine without a GPU), one that names what is missing.
/// Exit code 1 and no panic either way, before anything is written.
#[test]
fn cuda_where_it_cannot_run_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let model = common::trained_tiny().to_str().unwrap().to_string();
    let emb = dir.path().join("e.parquet");
    let o = out.to_str().unwrap();
    let cases: [Vec<&str>; 4] = [
        vec![
            "train",
            "--fasta",
            "data/",
            "--config",
            "configs/tiny.toml",
            "--out",
            o,
        ],
        vec![
            "score",
            "--model",
            &model,
            "--fasta",
            "data/lambda_virus.fa",
        ],
        vec![
            "embed",
            "--model",
            &model,
            "--fasta",
            "data/",
            "--out",
            emb.to_str().unwrap(),
        ],
        vec![
            "generate",
            "--model",
            &model,
            "--num",
            "1",
            "--max-codons",
            "4",
        ],
    ];
    for args in cases {
        let r = common::bin()
            .args(&args)
            .args(["--backend", "cuda"])
            .current_dir(common::repo())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        if cfg!(feature = "cuda") {
            assert!(err.contains("--backend cuda:"), "{args:?}: {err}");
        } else {
            assert!(
                err.contains("built without the CUDA backend") && err.contains("--features cuda"),
                "{args:?}: {err}"
            );
        }
    }
    assert!(!out.exists() && !emb.exists(), "nothing is written");
}

#[test]
fn nonfinite_loss_stops_naming_the_step_or_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nan");
    let args = |o: &Path, skip: bool| {
        let mut v: Vec<String> = ["train", "--fasta", &data(), "--config", &tiny(), "--out"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.push(o.display().to_string());
        for s in [
            "--quiet",
            "--seq-len",
            "64",
            "--steps",
            "4",
            "--warmup",
            "0",
            "--lr",
            "1e30",
        ] {
            v.push(s.into());
        }
        if skip {
            v.push("--skip-nonfinite".into());
        }
        v
    };
    let a = args(&out, false);
    let (ok, _, err) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !ok && err.contains("not finite") && err.contains("step 2"),
        "{err}"
    );
    let out2 = dir.path().join("nan2");
    let a = args(&out2, true);
    let (ok, _, err) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    // Step 1's update left finite weights of ~1e29 that make every later forward NaN: steps 2
    // to 4 are skipped (under the limit of consecutive skips), and the NaN validation loss at
    // the end shows the weights, not a batch, are broken: the run fails without saving them
    // (it exited 0 with a checkpoint that scored NaN).
    assert!(
        !ok && err.contains("step 4: the last 3 step(s) were skipped")
            && err.contains("the weights themselves give non-finite losses"),
        "{err}"
    );
    let m = read_metrics(&out2.join("metrics.jsonl")).unwrap();
    assert_eq!(m.len(), 4, "every step is logged");
    assert!(m.iter().skip(1).all(|x| x.skipped_nonfinite), "{m:?}");
    assert!(
        !out2.join("checkpoints/latest").exists(),
        "the broken weights were saved"
    );
    // The same before a save that comes before the end: --stop-after (it saved them, exit 0).
    let out3 = dir.path().join("nan3");
    let mut a = args(&out3, true);
    let at = a.iter().position(|x| x == "--steps").unwrap();
    a[at + 1] = "8".into();
    a.extend(["--stop-after", "3"].map(String::from));
    let (ok, _, err) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !ok && err.contains("the weights themselves give non-finite losses"),
        "{err}"
    );
    assert!(
        !out3.join("checkpoints/latest").exists(),
        "saved at --stop-after"
    );
    // No step skipped: a save right after the update that broke the weights (the run's last
    // step, or --checkpoint-every 1) measured nothing and saved them, exit 0.
    for (name, extra) in [
        ("nan4", &["--steps", "1"][..]),
        ("nan5", &["--steps", "3", "--checkpoint-every", "1"][..]),
        // No validation split: the first training batch is the probe (saved unsaid).
        (
            "nan6",
            &[
                "--steps",
                "3",
                "--checkpoint-every",
                "1",
                "--val-fraction",
                "0",
            ][..],
        ),
    ] {
        let o = dir.path().join(name);
        let mut a = args(&o, true);
        let at = a.iter().position(|x| x == "--steps").unwrap();
        a.drain(at..at + 2);
        a.extend(extra.iter().map(|s| s.to_string()));
        let (ok, _, err) = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let what = match name {
            "nan6" => "step 1: the loss of the first training batch (no validation split) is NaN",
            _ => "step 1: the validation loss is NaN",
        };
        assert!(!ok && err.contains(what), "{name}: {err}");
        assert!(!o.join("checkpoints/step-1").exists(), "{name}: saved");
    }
}

#[test]
fn score_prints_tsv_per_record() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    train(&out, &["--steps", "30", "--lr", "3e-3"]);
    let lambda = repo().join("data/lambda_virus.fa");
    let (ok, stdout, err) = run(&[
        "score",
        "--model",
        out.to_str().unwrap(),
        "--fasta",
        lambda.to_str().unwrap(),
        "--seq-len",
        "64",
    ]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "id\tn_tokens\tmean_nll\tperplexity");
    assert_eq!(lines.len(), 2);
    let f: Vec<&str> = lines[1].split('\t').collect();
    assert!(f[0].contains("NC_001416"));
    // 48,502 bases → 16,168 tokens in windows of 64: 253 windows (the last has 40 tokens).
    let n: usize = f[1].parse().unwrap();
    assert_eq!(n, 16_168 - 253);
    let nll: f64 = f[2].parse().unwrap();
    let ppl: f64 = f[3].parse().unwrap();
    assert!((ppl - nll.exp()).abs() / ppl < 1e-3);
    assert!(nll < 69f64.ln(), "a trained model beats uniform: {nll}");
}

#[test]
fn a_failing_rank_stops_the_others_quickly() {
    let dir = tempfile::tempdir().unwrap();
    // Under PP the failing stage leaves its neighbour waiting for a message.
    for (k, (layout, fault, rank)) in [
        (&["--sp", "2", "--dp", "2"][..], "3:2", "rank 3"),
        (&["--pp", "2", "--grad-accum", "2"][..], "0:2", "rank 0"),
        (&["--pp", "2", "--grad-accum", "2"][..], "1:3", "rank 1"),
        // The others are inside a step with started collectives in flight (ZeRO-3's gathers
        // ahead and reduce-scatters on their communication threads) when rank 1 fails.
        (
            &["--dp", "2", "--zero", "3", "--checkpoint-activations"][..],
            "1:2",
            "rank 1",
        ),
        (
            &["--dp", "2", "--sp", "2", "--zero", "2"][..],
            "2:3",
            "rank 2",
        ),
        // The CP ring's forward exchanges, chained on the communication threads, wait for
        // the failed rank's blocks.
        (&["--cp", "4"][..], "2:3", "rank 2"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = dir.path().join(format!("fault{k}"));
        let start = std::time::Instant::now();
        let o = common::bin()
            .args([
                "train",
                "--fasta",
                &data(),
                "--config",
                &tiny(),
                "--out",
                out.to_str().unwrap(),
                "--quiet",
                "--seq-len",
                "64",
                "--batch-size",
                "4",
                "--steps",
                "5",
            ])
            .args(layout)
            .env("GENSLM_FAULT_RANK", fault)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{layout:?}: {err}");
        assert!(
            err.contains(rank) && err.contains("injected fault"),
            "{layout:?}: {err}"
        );
        assert!(start.elapsed().as_secs() < 60, "{layout:?}");
    }
}

/// `SLURM_NTASKS` is set in every `sbatch -n N` script: it is not a launch, so `--dp 2` runs
/// two thread ranks (dc757c5 bailed out as if mpirun had started 4 processes).
#[test]
fn slurm_batch_variables_are_not_an_mpi_launch() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("slurm");
    let o = common::bin()
        .args([
            "train",
            "--fasta",
            &data(),
            "--config",
            &tiny(),
            "--out",
            out.to_str().unwrap(),
        ])
        .args([
            "--quiet",
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--dp",
            "2",
        ])
        .env("SLURM_NTASKS", "4")
        .env("SLURM_NPROCS", "4")
        .env("SLURM_JOB_ID", "1234")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(losses(&out).len(), 2);
}

/// A launcher's variables that are no launch are named (they were ignored: the process
/// trained alone); torchrun's processes are refused together, not left to race for the run
/// directory's lock; a command that does not split its work says so under a launcher.
#[test]
fn launcher_variables_are_read_or_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("launched");
    let out_s = out.to_str().unwrap().to_string();
    let (data, tiny) = (data(), tiny());
    let args = [
        "train", "--fasta", &data, "--config", &tiny, "--out", &out_s, "--quiet", "--steps", "1",
    ];
    for (vars, says) in [
        (
            &[("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "1")][..],
            "OMPI_COMM_WORLD_RANK=5 with OMPI_COMM_WORLD_SIZE=1",
        ),
        (
            &[("PMI_RANK", "0"), ("PMI_SIZE", "abc")],
            "PMI_SIZE=\"abc\"",
        ),
        (
            &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")],
            "not torchrun's rendezvous",
        ),
    ] {
        let o = common::bin()
            .args(args)
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{vars:?}: {err}");
        assert!(!out.exists(), "{vars:?}");
    }
    let fa = repo().join("data/lambda_virus.fa");
    let model = common::trained_tiny();
    let o = common::bin()
        .args(["score", "--model", model.to_str().unwrap(), "--fasta"])
        .arg(&fa)
        .args(["--quiet"])
        .envs([("PMI_RANK", "0"), ("PMI_SIZE", "2")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && err.contains("`genslm score` does not split its work"),
        "{err}"
    );
}

/// `--pp` and its settings from the command line: every step logs each stage's busy and idle
/// time and the bubble; bad settings are refused by name before anything is written.
#[test]
fn pipeline_flags_train_and_log_the_bubble() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pp");
    let flags = ["--steps", "2", "--pp", "2", "--grad-accum", "2"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        flags.iter().chain(extra).copied().collect()
    };
    train(
        &out,
        &with(&["--pp-schedule", "gpipe", "--pp-layers", "1,1"]),
    );
    let m = read_metrics(&out.join("metrics.jsonl")).unwrap();
    assert_eq!(m.len(), 2);
    for row in &m {
        let (busy, idle) = (
            row.pp_busy_s.as_ref().unwrap(),
            row.pp_idle_s.as_ref().unwrap(),
        );
        assert_eq!((busy.len(), idle.len()), (2, 2));
        assert!(busy.iter().all(|&b| b > 0.0) && idle.iter().all(|&i| i >= 0.0));
        let bubble = row.pp_bubble.unwrap();
        assert!(bubble.is_finite() && bubble >= 0.0, "{bubble}");
    }
    for (extra, says) in [
        (
            &["--pp-schedule", "zigzag"][..],
            "expected one of gpipe, 1f1b",
        ),
        (
            &["--pp-layers", "2,1"][..],
            "add up to the model's 2 layers",
        ),
        (
            &["--pp-virtual", "2"][..],
            "needs --pp-schedule interleaved",
        ),
        (&["--zero", "2"][..], "--zero 2"),
        (
            // The cut is named before the schedule's size: 2·10⁹ chunks of a 2-layer model.
            &["--pp-schedule", "interleaved", "--pp-virtual", "1000000000"][..],
            "2000000000 chunks of layers",
        ),
    ] {
        let bad = dir.path().join("bad");
        let (ok, err) = try_train(&bad, &data(), &with(extra));
        assert!(!ok && err.contains(says), "{extra:?}: {err}");
        assert!(!bad.exists(), "{extra:?} wrote {}", bad.display());
    }
    // Pipeline settings without stages are a mistake, not silently ignored.
    let bad = dir.path().join("bad");
    let (ok, err) = try_train(&bad, &data(), &["--pp-schedule", "gpipe"]);
    assert!(!ok && err.contains("give --pp P"), "{err}");
    // The same from a config file (pp_virtual = 2 or an interleaved schedule with one stage
    // trained and was recorded); the file's default schedule is no setting.
    let text = std::fs::read_to_string(tiny()).unwrap();
    let cfg = dir.path().join("chunks.toml");
    for (line, says) in [
        ("pp_virtual = 2", Some("chunks.toml: pp_virtual = 2")),
        (
            "pp_schedule = \"interleaved\"",
            Some("chunks.toml: pp_schedule = \"interleaved\""),
        ),
        ("pp_schedule = \"1f1b\"", None),
    ] {
        std::fs::write(&cfg, format!("{text}\n[train]\n{line}\n")).unwrap();
        let (ok, _, err) = run(&[
            "train",
            "--fasta",
            &data(),
            "--config",
            &cfg.display().to_string(),
            "--out",
            &bad.display().to_string(),
            "--quiet",
            "--steps",
            "1",
            "--seq-len",
            "32",
        ]);
        match says {
            Some(says) => {
                assert!(
                    !ok && err.contains(says) && err.contains("give --pp P"),
                    "{err}"
                );
                assert!(!bad.exists());
            }
            None => assert!(ok, "{line}: {err}"),
        }
    }
}
