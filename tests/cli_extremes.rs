//! Every numeric flag of every command, and every numeric config field, at the extremes: no
//! panic (no "panicked at", no "internal error"), exit 0, 1 or 2, and a message on failure.

mod common;

use common::{arg, repo, run, trained_tiny};

const MAX: &str = "18446744073709551615";

fn check(args: &[&str]) {
    let o = common::bin().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let code = o.status.code();
    assert!(
        !err.contains("panicked") && !err.contains("internal error"),
        "{args:?}: {err}"
    );
    assert!(
        matches!(code, Some(0..=2)),
        "{args:?}: exit {code:?}: {err}"
    );
    if code != Some(0) {
        assert!(err.contains("error"), "{args:?}: no message: {err}");
    }
}

#[test]
fn every_numeric_flag_at_u64_max() {
    let dir = tempfile::tempdir().unwrap();
    let (data, tiny) = (
        arg(&repo().join("data/dwv.fasta.gz")),
        arg(&repo().join("configs/tiny.toml")),
    );
    let model = arg(trained_tiny());
    let out = |n: &str| arg(&dir.path().join(n));
    let train_flags = [
        "--steps",
        "--seq-len",
        "--batch-size",
        "--grad-accum",
        "--warmup",
        "--seed",
        "--val-every",
        "--checkpoint-every",
        "--stop-after",
        "--sp",
        "--dp",
        "--reduce-bucket-size",
        "--rank-timeout-s",
        "--max-consecutive-skips",
        "--keep-checkpoints",
        "--cp",
        "--tp",
        "--zero",
        "--threads",
        "--device",
    ];
    for (k, f) in train_flags.iter().enumerate() {
        let o = out(&format!("t{k}"));
        let mut a = vec![
            "train", "--fasta", &data, "--config", &tiny, "--out", &o, "--quiet",
        ];
        if *f != "--steps" {
            a.extend(["--steps", "1"]);
        }
        if !["--seq-len", "--batch-size"].contains(f) {
            a.extend(["--seq-len", "32", "--batch-size", "2"]);
        }
        a.extend([*f, MAX]);
        check(&a);
    }
    for f in [
        "--lr",
        "--val-fraction",
        "--max-grad-norm",
        "--weight-decay",
    ] {
        for v in ["1e308", "-1", "NaN", "inf"] {
            let o = out("tf");
            let _ = std::fs::remove_dir_all(&o);
            check(&[
                "train",
                "--fasta",
                &data,
                "--config",
                &tiny,
                "--out",
                &o,
                "--quiet",
                "--steps",
                "1",
                "--seq-len",
                "32",
                f,
                v,
            ]);
        }
    }
    for f in ["--seq-len", "--batch-size", "--stride", "--top-k"] {
        check(&["score", "--model", &model, "--fasta", &data, f, MAX]);
        let per_token = out("t.parquet");
        check(&[
            "score",
            "--model",
            &model,
            "--fasta",
            &data,
            "--per-token",
            &per_token,
            f,
            MAX,
        ]);
    }
    // variants: numeric flags, positions and ranges at the extremes.
    let fa = arg(&dir.path().join("v.fa"));
    std::fs::write(&fa, ">g\nATGGCTAAACTGGAATTCTAA\n").unwrap();
    let vcf = dir.path().join("v.vcf");
    std::fs::write(&vcf, format!("g\t{MAX}\t.\tA\tG\ng\t4\t.\tG\tT\n")).unwrap();
    let (vcf, vout) = (arg(&vcf), out("v.tsv"));
    for extra in [
        vec!["--window", MAX],
        vec!["--batch-size", MAX],
        vec!["--cds", "1..18446744073709551615"],
        vec!["--cds", "18446744073709551615..18446744073709551615"],
        vec!["--on-invalid", "skip", "--window", MAX],
    ] {
        let mut a = vec![
            "variants", "--model", &model, "--fasta", &fa, "--vcf", &vcf, "--out", &vout,
        ];
        a.extend(extra.iter().copied());
        check(&a);
    }
    for range in [
        "1..18446744073709551615",
        "18446744073709551615..18446744073709551615",
    ] {
        check(&[
            "variants",
            "--model",
            &model,
            "--fasta",
            &fa,
            "--saturate",
            range,
            "--out",
            &vout,
        ]);
    }
    for f in ["--seq-len", "--batch-size", "--stride"] {
        check(&[
            "embed",
            "--model",
            &model,
            "--fasta",
            &data,
            "--out",
            &out("e.parquet"),
            "--quiet",
            f,
            MAX,
        ]);
    }
    check(&[
        "embed",
        "--model",
        &model,
        "--fasta",
        &data,
        "--out",
        &out("e.parquet"),
        "--quiet",
        "--layer",
        MAX,
    ]);
    for (f, v) in [("--layers", "0,18446744073709551615"), ("--stride", MAX)] {
        check(&[
            "embed",
            "--model",
            &model,
            "--fasta",
            &data,
            "--out",
            &out("e.parquet"),
            "--quiet",
            "--pool",
            "none",
            f,
            v,
        ]);
    }
    let gen_out = out("g.fa");
    for f in [
        "--batch-size",
        "--max-codons",
        "--num",
        "--seed",
        "--top-k",
        "--top-p",
        "--temperature",
    ] {
        let mut a = vec![
            "generate", "--model", &model, "--out", &gen_out, "--quiet", f, MAX,
        ];
        if !["--max-codons", "--num"].contains(&f) {
            a.extend(["--num", "1", "--max-codons", "8"]);
        }
        check(&a);
    }
    let c25 = arg(&repo().join("configs/genslm-25m.toml"));
    for f in [
        "--batch-size",
        "--cp",
        "--dp",
        "--gpus-per-node",
        "--seq-len",
        "--sp",
        "--tp",
        "--zero",
    ] {
        check(&[
            "plan",
            "--config",
            &c25,
            "--gpus",
            "8",
            "--gpu-mem-gib",
            "80",
            f,
            MAX,
        ]);
    }
    check(&[
        "plan",
        "--config",
        &c25,
        "--gpus",
        MAX,
        "--gpu-mem-gib",
        "80",
    ]);
    check(&[
        "plan",
        "--config",
        &c25,
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "1e308",
    ]);
    check(&[
        "bench",
        "attention",
        "--config",
        &tiny,
        "--seq-lens",
        MAX,
        "--quiet",
    ]);
    check(&[
        "bench",
        "step",
        "--config",
        &tiny,
        "--attention",
        "flash",
        "--seq-len",
        MAX,
    ]);
    for f in ["--seq-len", "--sequences", "--batch-size"] {
        check(&["bench", "embed", "--config", &tiny, f, MAX, "--quiet"]);
    }
    for f in ["--codons", "--samples"] {
        check(&["bench", "generate", "--config", &tiny, f, MAX, "--quiet"]);
    }
    check(&[
        "bench",
        "ingest",
        "--dir",
        &out("bi"),
        "--mb",
        MAX,
        "--quiet",
    ]);
}

/// Config fields far past any model: refused by `info` and `train`, naming the field (dc757c5
/// panicked with "capacity overflow" and `info` printed a wrapped parameter count).
#[test]
fn numeric_config_fields_at_the_extremes() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap();
    let data = arg(&repo().join("data/dwv.fasta.gz"));
    for (field, old) in [
        ("hidden_size", "hidden_size = 64"),
        ("num_layers", "num_layers = 2"),
        ("num_heads", "num_heads = 4"),
        ("intermediate_size", "intermediate_size = 256"),
        ("vocab_size", "vocab_size = 69"),
        ("max_position_embeddings", "max_position_embeddings = 2048"),
    ] {
        for v in ["4611686018427387904", "9223372036854775807"] {
            assert!(text.contains(old), "{old}");
            let cfg = dir.path().join(format!("{field}.toml"));
            std::fs::write(&cfg, text.replace(old, &format!("{field} = {v}"))).unwrap();
            for args in [
                vec!["info", "--config", &arg(&cfg)],
                vec![
                    "train",
                    "--fasta",
                    &data,
                    "--config",
                    &arg(&cfg),
                    "--out",
                    &arg(&dir.path().join("r")),
                    "--quiet",
                ],
            ] {
                let (ok, _, err) = run(&args);
                assert!(
                    !ok && err.contains(field) && !err.contains("panicked"),
                    "{field}={v}: {err}"
                );
            }
        }
    }
}

/// A sequence far past the memory of this machine is refused before any work, naming the
/// predicted and the available memory.
#[test]
fn a_run_that_cannot_fit_is_refused_before_work() {
    let dir = tempfile::tempdir().unwrap();
    let o = arg(&dir.path().join("big"));
    let (ok, _, err) = run(&[
        "train",
        "--fasta",
        &arg(&repo().join("data")),
        "--config",
        &arg(&repo().join("configs/genslm-25m.toml")),
        "--out",
        &o,
        "--seq-len",
        "1000000",
        "--quiet",
    ]);
    assert!(
        !ok && err.contains("predicted peak memory") && err.contains("GiB available"),
        "{err}"
    );
    assert!(!dir.path().join("big").exists(), "refused before any work");
}

/// A record of 600k codons scored or embedded in one window, under an address-space limit of
/// 2 GiB: the forward pass would need about 2.6 GiB and abort on allocation; it is refused
/// before, naming the figures and the flags that lower it.
#[test]
fn a_window_that_cannot_fit_is_refused_by_score_and_embed() {
    let dir = tempfile::tempdir().unwrap();
    let mut fasta = b">long\n".to_vec();
    let mut x: u32 = 7;
    for _ in 0..1_800_000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        fasta.push(b"ACGT"[(x >> 16) as usize % 4]);
    }
    fasta.push(b'\n');
    let long = dir.path().join("long.fa");
    std::fs::write(&long, fasta).unwrap();
    let model = arg(trained_tiny());
    let (long, out) = (arg(&long), arg(&dir.path().join("e.parquet")));
    for cmd in [
        format!("score --model '{model}' --fasta '{long}' --seq-len 700000"),
        format!("embed --model '{model}' --fasta '{long}' --seq-len 700000 --out '{out}' --quiet"),
    ] {
        let script = format!(
            "ulimit -v 2097152 && exec '{}' {cmd}",
            env!("CARGO_BIN_EXE_genslm")
        );
        let o = std::process::Command::new("sh")
            .args(["-c", &script])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{cmd}: {err}");
        assert!(
            err.contains("window(s) of 600000 tokens needs about")
                && err.contains("GiB available here; lower --seq-len"),
            "{cmd}: {err}"
        );
    }
    assert!(!dir.path().join("e.parquet").exists());
}

/// `GENSLM_SIMD` (src/isa.rs): an unknown tier, or one above what the CPU has, stops every
/// command before work with exit 2 and the variable's name; a tier the CPU has runs.
#[test]
fn simd_tier_variable_is_checked_before_work() {
    let fa = arg(&repo().join("data/lambda_virus.fa"));
    let dir = tempfile::tempdir().unwrap();
    let out = arg(&dir.path().join("t.parquet"));
    let args = ["tokenize", "--fasta", &fa, "--out", &out, "--quiet"];
    for bad in ["sse9", "avx1024"] {
        let o = common::bin()
            .env("GENSLM_SIMD", bad)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains(&format!("GENSLM_SIMD={bad}")), "{err}");
        assert!(!dir.path().join("t.parquet").exists());
    }
    for ok in ["scalar", "auto"] {
        let o = common::bin()
            .env("GENSLM_SIMD", ok)
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{ok}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
