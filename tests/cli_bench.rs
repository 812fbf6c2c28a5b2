//! `genslm bench attention` and its hidden `bench step` run their cases and report numbers.

mod common;

use common::{repo, run};

#[test]
fn bench_attention_runs_every_case() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = run(&[
        "bench",
        "attention",
        "--config",
        cfg,
        "--seq-lens",
        "64",
        "--checkpoint-activations",
    ]);
    assert!(ok, "{err}");
    // One row per case: seq_len, case, step seconds, tokens/s, peak MiB.
    for case in ["flash", "flash+ckpt", "naive"] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(case))
            .unwrap_or_else(|| panic!("no {case} row in:\n{out}"));
        let nums: Vec<f64> = row
            .split_whitespace()
            .skip(2)
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(nums.len(), 3, "{row}");
        assert!(nums.iter().all(|x| *x > 0.0), "{row}");
    }
    // A step needs two tokens: a clear error, no panic.
    let (ok, _, err) = run(&[
        "bench",
        "step",
        "--config",
        cfg,
        "--seq-len",
        "1",
        "--attention",
        "flash",
    ]);
    assert!(!ok && err.contains("at least 2 tokens"), "{err}");
}

#[test]
fn bench_train_reports_throughput_and_threads() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = run(&[
        "bench",
        "train",
        "--config",
        cfg,
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--threads",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("threads 1:") && out.contains("tokens/s") && out.contains("GFLOP/s"),
        "{out}"
    );
    // The thread count and the step count must be positive: clear errors, no panic.
    for bad in [["--threads", "0"], ["--steps", "0"]] {
        let (ok, _, err) = run(&[
            "bench",
            "train",
            "--config",
            cfg,
            "--seq-len",
            "32",
            bad[0],
            bad[1],
        ]);
        assert!(
            !ok && err.contains(bad[0]) && !err.contains("panicked"),
            "{err}"
        );
    }
}

/// Several ranks through the trainer, behind a simulated 10 ms link: every step waits for at
/// least its loss and gradient reductions (two calls, 20 ms) and the wait is part of the step;
/// without the link the same run waits far less. A malformed link is refused by name.
#[test]
fn bench_train_on_ranks_behind_a_simulated_network() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let figures = |extra: &[&str]| -> (f64, f64, f64) {
        let mut a = vec![
            "bench",
            "train",
            "--config",
            cfg,
            "--seq-len",
            "32",
            "--steps",
            "2",
            "--dp",
            "2",
        ];
        a.extend_from_slice(extra);
        let (ok, out, err) = run(&a);
        assert!(ok, "{err}");
        // No note about a --warmup this command has no flag for (it came once per case).
        assert!(!err.contains("--warmup"), "{err}");
        let num = |before: &str| -> f64 {
            let at = out
                .find(before)
                .unwrap_or_else(|| panic!("{before} in {out}"));
            out[..at]
                .split_whitespace()
                .last()
                .unwrap()
                .parse()
                .unwrap()
        };
        (
            num(" s/step,"),
            num(" s/step in communication"),
            num(" MB/step"),
        )
    };
    let (step, comm, _) = figures(&["--simulate-network", "10ms,1GB/s"]);
    assert!(comm >= 0.02 && comm <= step, "{comm} s of a {step} s step");
    // Quantized collectives: ZeRO-3's gathers and reduce-scatters in int8 send about a
    // quarter of the bytes.
    let (_, _, fp32) = figures(&["--zero", "3"]);
    let int8 = ["--quantize-weights", "int8", "--quantize-grads", "int8"];
    let (_, _, q) = figures(&[&["--zero", "3"][..], &int8[..]].concat());
    assert!(fp32 > 3.5 * q && q > 0.0, "{fp32} MB vs {q} MB per step");
    let (_, local, _) = figures(&[]);
    assert!(
        local < comm / 2.0,
        "{local} without the link, {comm} with it"
    );
    let (ok, _, err) = run(&[
        "bench",
        "train",
        "--config",
        cfg,
        "--simulate-network",
        "fast",
    ]);
    assert!(!ok && err.contains("--simulate-network \"fast\""), "{err}");
    // Pipeline stages run 4·P micro-batches and report the measured bubble.
    let (ok, out, err) = run(&[
        "bench",
        "train",
        "--config",
        cfg,
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--pp",
        "2",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("pp 2")
            && out.contains("pipeline bubble")
            && out.contains("(8 micro-batches)"),
        "{out}"
    );
}

/// An attention case that cannot fit in memory is refused with the figures, not an aborted
/// allocation of terabytes.
#[test]
fn an_attention_case_too_large_is_refused() {
    let (ok, _, err) = run(&[
        "bench",
        "attention",
        "--seq",
        "1000000000",
        "--head-dim",
        "64",
    ]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("--seq 1000000000") && err.contains("GiB are available"),
        "{err}"
    );
    assert!(!err.contains("memory allocation"), "{err}");
}

/// `bench ingest --dir D` works in a directory of its own inside D: a user's `bench.fa` there
/// keeps its bytes, and nothing is left behind.
#[test]
fn bench_ingest_leaves_the_users_directory_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("bench.fa");
    std::fs::write(&mine, b">mine\nACGT\n").unwrap();
    let d = dir.path().to_str().unwrap();
    let (ok, out, err) = run(&["bench", "ingest", "--mb", "1", "--dir", d]);
    assert!(ok, "{err}");
    assert!(out.contains("plain") && out.contains("gzip"), "{out}");
    assert_eq!(std::fs::read(&mine).unwrap(), b">mine\nACGT\n");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "{left:?}");
}

/// `bench embed` measures real batches: with none of a size (0 sequences, batch 0, 0 codons)
/// there is nothing to time, and a throughput would be invented (a batch of 0 printed one).
#[test]
fn bench_embed_refuses_an_empty_measurement_and_runs_a_real_one() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let base = ["bench", "embed", "--config", cfg];
    for bad in ["--batch-size", "--sequences", "--seq-len"] {
        let mut a = base.to_vec();
        for f in ["--batch-size", "--sequences", "--seq-len"] {
            a.extend([f, if f == bad { "0" } else { "2" }]);
        }
        let (ok, out, err) = run(&a);
        assert!(
            !ok && err.contains(bad) && !out.contains("tokens/s"),
            "{bad}: {out}{err}"
        );
    }
    let mut a = base.to_vec();
    a.extend(["--seq-len", "16", "--sequences", "3", "--batch-size", "2"]);
    let (ok, out, err) = run(&a);
    assert!(ok, "{err}");
    // model seq_len sequences batch seconds sequences/s tokens/s
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("tiny "))
        .unwrap_or_else(|| panic!("no row in {out}"))
        .split_whitespace()
        .collect();
    assert_eq!(&row[1..4], ["16", "3", "2"], "{out}");
    assert!(row[6].parse::<f64>().unwrap() > 0.0, "{out}");
}

/// `bench variants` with nothing to measure (0 codons, 0 rounds, batch 0, a window of one
/// codon) is refused by flag, where --codons 0 printed a speed-up of 0.50x (0/0).
#[test]
fn bench_variants_refuses_an_empty_measurement() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    for (flag, v) in [
        ("--codons", "0"),
        ("--rounds", "0"),
        ("--batch-size", "0"),
        ("--window", "1"),
    ] {
        let mut a = vec!["bench", "variants", "--config", cfg, flag, v];
        if flag != "--window" {
            a.extend(["--window", "8"]);
        }
        let (ok, out, err) = run(&a);
        assert!(
            !ok && err.contains(flag) && !out.contains("speedup"),
            "{flag} {v}: {out}{err}"
        );
    }
}

/// Past a learned position table, each benchmark is refused by its own flag with the largest
/// size it runs, before its table's header (the messages named `--seq-len` and `--max-codons`,
/// flags these benchmarks do not have).
#[test]
fn benchmarks_past_learned_positions_are_refused_by_their_own_flag() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo().join("configs/tiny.toml"))
        .unwrap()
        .replace("position = \"rotary\"", "position = \"learned\"");
    assert!(text.contains("\"learned\""));
    let cfg = dir.path().join("learned.toml");
    std::fs::write(&cfg, text).unwrap();
    let cfg = cfg.to_str().unwrap();
    for (bench, flag, v, most) in [
        ("embed", "--seq-len", "3000", "at most 2048"),
        ("variants", "--window", "3000", "at most 2048"),
        ("generate", "--codons", "3000", "at most 2047"),
    ] {
        let (ok, out, err) = run(&["bench", bench, "--config", cfg, flag, v]);
        assert!(
            !ok && err.contains(&format!("{flag} {v}: "))
                && err.contains(most)
                && !out.contains("model "),
            "{bench}: {out}{err}"
        );
    }
}

/// A benchmark whose stdout reader is gone (`| head`) ends quietly: its table's `println!`
/// panicked ("internal error … please report it", exit 101).
#[test]
fn a_closed_stdout_ends_a_benchmark_quietly() {
    let cfg = repo().join("configs/tiny.toml");
    let (read_end, write_end) = std::io::pipe().unwrap();
    drop(read_end);
    let o = common::bin()
        .args(["bench", "variants", "--config", cfg.to_str().unwrap()])
        .args(["--window", "8", "--codons", "1", "--rounds", "1"])
        .stdout(write_end)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && !err.contains("internal error"),
        "{:?}: {err}",
        o.status
    );
}

/// Sizes with nothing to measure are refused naming their flag (`bench attention --seq 0`
/// printed a debug dump, `bench generate --codons 0` named --max-codons, `bench ingest --mb 0`
/// an internal temporary file), `bench attention` whose every case failed exits 1 (it exited
/// 0), and `bench ingest --dir` does not create a missing directory (it made and left one).
/// Flags the run would ignore are refused: `--seq-lens` beside `--seq`, `--zero 4` on one rank.
#[test]
fn benchmarks_refuse_empty_sizes_by_flag() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("not/made");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["attention", "--seq", "0"], "--seq, --head-dim"),
        (vec!["attention", "--seq", "8", "--heads", "0"], "--heads"),
        (
            vec!["attention", "--config", cfg, "--seq-lens", "0"],
            "--seq-lens 0",
        ),
        (
            vec!["generate", "--config", cfg, "--codons", "0"],
            "--codons and --samples",
        ),
        (
            vec!["generate", "--config", cfg, "--samples", "0"],
            "--codons and --samples",
        ),
        (
            vec![
                "attention",
                "--config",
                cfg,
                "--seq",
                "64",
                "--seq-lens",
                "32",
            ],
            "cannot be used with",
        ),
        // The op alone takes --heads and --head-dim: a config was ignored there.
        (
            vec!["attention", "--config", cfg, "--seq", "64"],
            "cannot be used with",
        ),
        (vec!["train", "--config", cfg, "--zero", "4"], "--zero 4"),
        (vec!["ingest", "--mb", "0"], "--mb and --record-mb"),
        (
            vec!["ingest", "--mb", "1", "--dir", missing.to_str().unwrap()],
            "give an existing directory",
        ),
    ];
    for (args, words) in cases {
        let a = [&["bench"][..], &args].concat();
        let (ok, out, err) = run(&a);
        assert!(!ok && err.contains(words), "{a:?}: {out}{err}");
        assert!(!err.contains("AttnBenchCase"), "{a:?}: {err}");
    }
    assert!(!missing.exists() && !dir.path().join("not").exists());
}

/// Sizes whose data or passes cannot fit in memory are refused before anything is built,
/// naming the bench's own flags: `bench embed` and `bench variants` aborted on a failed
/// allocation or grew until the OOM killer ended them, `bench train` at --seq-len 2^31 filled
/// the memory with its records, `bench generate` named generate's flags; `bench ingest
/// --record-mb` past `--mb` wrote the record's size.
#[test]
fn benchmarks_past_the_memory_are_refused_by_flag() {
    let big = "2147483647";
    let cases: [(&[&str], &str); 6] = [
        (
            &["embed", "--seq-len", "100", "--sequences", big],
            "--sequences 2147483647 × --seq-len 100",
        ),
        (
            &[
                "variants", "--window", "100", "--codons", big, "--rounds", "1",
            ],
            "9 × --codons 2147483647",
        ),
        (
            &["generate", "--codons", "2147483646", "--samples", big],
            "KV cache of --samples 2147483647",
        ),
        (
            &["generate", "--codons", "2147483648"],
            "--codons 2147483648: must be below",
        ),
        (
            &["train", "--seq-len", "2147483648", "--steps", "1"],
            "--seq-len 2147483648: the predicted peak memory",
        ),
        (
            &["ingest", "--mb", "1", "--record-mb", "1000"],
            "--record-mb 1000 is larger than --mb 1",
        ),
    ];
    for (args, says) in cases {
        let mut a = vec!["bench", args[0]];
        if args[0] != "ingest" {
            a.extend(["--config", "tiny"]);
        }
        a.extend(&args[1..]);
        let (ok, out, err) = run(&a);
        assert!(!ok && err.contains(says), "{a:?}: {out}{err}");
        assert!(!err.contains("panicked"), "{a:?}: {err}");
        // train's way past its memory check is no flag of bench's.
        assert!(!err.contains("--skip-memory-check"), "{a:?}: {err}");
    }
}

/// Under a 4 GiB address-space limit, what the benchmarks hold is refused before it is made:
/// the model's weights (a genslm-2.5b was allocated until the process aborted, exit 134), and
/// each embedded record's embedding and allocation (10⁶ tiny records took 700 MB where 64 MB
/// of ids were counted, so 2·10⁷ passed the check and aborted).
#[cfg(target_os = "linux")]
#[test]
fn weights_and_records_count_in_the_benchmarks_memory_checks() {
    use std::os::unix::process::CommandExt;
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "embed",
                "--config",
                "genslm-2.5b",
                "--seq-len",
                "16",
                "--sequences",
                "1",
            ],
            "the model's weights",
        ),
        (
            &[
                "generate",
                "--config",
                "genslm-2.5b",
                "--codons",
                "4",
                "--cache-only",
            ],
            "the model's weights",
        ),
        (
            &[
                "variants",
                "--config",
                "genslm-2.5b",
                "--codons",
                "1",
                "--window",
                "8",
            ],
            "the model's weights",
        ),
        (
            &[
                "embed",
                "--config",
                "tiny",
                "--seq-len",
                "16",
                "--sequences",
                "20000000",
            ],
            "token ids with their embeddings",
        ),
    ];
    for (args, says) in cases {
        let mut cmd = common::bin();
        cmd.args(["--threads", "1", "bench"]).args(args);
        // SAFETY: setrlimit is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 4 << 30,
                    rlim_max: 4 << 30,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(says) && err.contains("GiB available"),
            "{args:?}: {err}"
        );
    }
}
