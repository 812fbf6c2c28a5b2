//! `genslm info` on every preset, and config validation errors.

mod common;

use common::{repo, run, write};

fn info(name: &str) -> String {
    let cfg = repo().join("configs").join(format!("{name}.toml"));
    let (ok, out, err) = run(&["info", "--config", cfg.to_str().unwrap()]);
    assert!(ok, "{name}: {err}");
    out
}

#[test]
fn presets_print_hugging_face_parameter_counts() {
    // Reference counts: printed by scripts/hf_param_counts.py, which builds Hugging Face
    // GPTNeoXForCausalLM for each shape and counts its parameters with PyTorch.
    let expected = [
        ("genslm-25m", "25,290,752"),
        ("genslm-2.5b", "2,533,931,008"),
        ("genslm-250m", "253,429,376"),
        ("genslm-25b", "25,574,854,656"),
        ("genslm-33b", "36,246,036,480"),
        ("tiny", "108,928"),
    ];
    for (name, count) in expected {
        let out = info(name);
        assert!(
            out.contains(&format!("parameters          {count}")),
            "{name}:\n{out}"
        );
    }
    for name in ["tiny", "genslm-25b", "genslm-33b"] {
        let out = info(name);
        for field in [
            "layers",
            "hidden",
            "heads",
            "vocabulary",
            "positions",
            "parameters",
            "weights",
            "gradients",
            "adam states",
        ] {
            assert!(out.contains(field), "{name} lacks {field}:\n{out}");
        }
    }
    // Memory in GiB for 25M: weights fp32 = 4 bytes × 25,290,752 = 0.09 GiB.
    let out = info("genslm-25m");
    assert!(out.contains("weights           0.09 GiB"), "{out}");
    // 33B: fp32 training holds 16 bytes per parameter; bf16 mixed precision 18 (bf16 working
    // weights 2, fp32 gradients 4, master 4, moments 8): 36,246,036,480 × 16 / 2³⁰ = 540.11
    // and × 18 / 2³⁰ = 607.62 GiB (it said 270.05, halving the fp32 state too).
    let out = info("genslm-33b");
    assert!(
        out.contains("total             540.11 GiB    607.62 GiB"),
        "{out}"
    );
}

/// A Hugging Face config.json (as convert takes), a model directory and a run directory give
/// the preset's report: the parameter count of the TOML the model was trained from.
#[test]
fn info_reads_config_json_and_model_directories() {
    let run = common::trained_tiny();
    let ckpt = common::tiny_checkpoint();
    let want = "parameters          108,928";
    for p in [run.to_path_buf(), ckpt.clone(), ckpt.join("config.json")] {
        let (ok, out, err) = run_info(&p);
        assert!(ok && out.contains(want), "{}: {err}{out}", p.display());
    }
    // Another name ending in .json is read as Hugging Face's too; a TOML named .json is not.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("neox.json");
    std::fs::copy(ckpt.join("config.json"), &other).unwrap();
    assert!(run_info(&other).1.contains(want));
    let toml = std::fs::read(repo().join("configs/tiny.toml")).unwrap();
    let (ok, _, err) = run_info(&write(dir.path(), "tiny.json", &toml));
    assert!(!ok && err.contains("tiny.json"), "{err}");
    let (ok, _, err) = run_info(dir.path());
    assert!(!ok && !err.contains("Is a directory"), "{err}");
}

/// The presets are built in: a bare name works from any directory (bench's defaults were
/// paths that existed only in the repository's root), a file of that name wins, and an
/// unknown name lists the presets.
#[test]
fn presets_are_built_in_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let info_in = |name: &str| {
        let o = common::bin()
            .args(["info", "--config", name])
            .current_dir(dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        (
            o.status.success(),
            text,
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (ok, out, err) = info_in("genslm-25m");
    assert!(
        ok && out.contains("parameters          25,290,752"),
        "{err}"
    );
    let (ok, _, err) = info_in("genslm-7b");
    assert!(
        !ok && err.contains("built-in presets: tiny, genslm-25m"),
        "{err}"
    );
    let mine = std::fs::read_to_string(repo().join("configs/tiny.toml"))
        .unwrap()
        .replace("num_layers = 2", "num_layers = 3");
    write(dir.path(), "tiny", mine.as_bytes());
    let (ok, out, err) = info_in("tiny");
    assert!(ok && out.contains("layers              3"), "{err}{out}");
    // A directory of a preset's name (a run trained into `--out genslm-25m`) is no config and
    // does not hide the preset: it was "a directory, not a file".
    std::fs::create_dir(dir.path().join("genslm-25m")).unwrap();
    let plan = |config: &str| {
        let o = common::bin()
            .args([
                "plan",
                "--gpus",
                "8",
                "--gpu-mem-gib",
                "80",
                "--config",
                config,
            ])
            .current_dir(dir.path())
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (ok, err) = plan("genslm-25m");
    assert!(ok, "{err}");
    // plan reads a Hugging Face config.json as info does (it was a TOML parse error at `{`).
    let json = repo().join("tests/fixtures/hf_neox_tiny/config.json");
    let (ok, err) = plan(json.to_str().unwrap());
    assert!(ok, "{err}");
}

fn run_info(p: &std::path::Path) -> (bool, String, String) {
    run(&["info", "--config", p.to_str().unwrap()])
}

#[test]
fn bad_configs_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap();
    let cases = [
        (
            "heads.toml",
            base.replace("num_heads = 4", "num_heads = 5"),
            "num_heads",
        ),
        (
            "typo.toml",
            base.replace("num_layers", "num_layer"),
            "num_layer",
        ),
        (
            "type.toml",
            base.replace("hidden_size = 64", "hidden_size = \"big\""),
            "hidden_size",
        ),
        (
            "vocab.toml",
            base.replace("vocab_size = 69", "vocab_size = 10"),
            "vocab_size",
        ),
        (
            "pos.toml",
            base.replace("position = \"rotary\"", "position = \"sinusoid\""),
            "position",
        ),
    ];
    for (name, text, field) in cases {
        let p = write(dir.path(), name, text.as_bytes());
        let (ok, _, err) = run(&["info", "--config", p.to_str().unwrap()]);
        assert!(!ok, "{name} should fail");
        assert!(err.contains(name) && err.contains(field), "{name}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (ok, _, err) = run(&["info", "--config", "/no/such.toml"]);
    assert!(!ok && err.contains("/no/such.toml"), "{err}");
}

/// A full disk under stdout is an error naming it, not a panic (`print!` panicked).
#[test]
fn a_full_stdout_is_a_clear_error() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let tiny = repo().join("configs/tiny.toml");
    for args in [
        vec!["info", "--config", tiny.to_str().unwrap()],
        vec![
            "plan",
            "--config",
            tiny.to_str().unwrap(),
            "--gpus",
            "8",
            "--gpu-mem-gib",
            "80",
        ],
    ] {
        let o = common::bin()
            .args(&args)
            .stdout(full.try_clone().unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("writing to standard output") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

/// A stderr whose reader is gone (`2>&1 | head`) loses the notes, not the output: every
/// warning was a panic and the panic message a second one, which aborted the process with its
/// output left as `.NAME.tmp-PID`. Here stderr is a pipe closed before the command writes.
#[test]
fn a_closed_stderr_loses_the_notes_not_the_output() {
    let dir = tempfile::tempdir().unwrap();
    // A record of no whole codon under --drop-partial-codon: a warning, then the summary.
    let fa = write(dir.path(), "short.fa", b">a\nAT\n>b\nATGAAA\n");
    let out = dir.path().join("out.parquet");
    let (read_end, write_end) = std::io::pipe().unwrap();
    drop(read_end);
    let o = common::bin()
        .args([
            "tokenize",
            "--fasta",
            fa.to_str().unwrap(),
            "--drop-partial-codon",
        ])
        .args(["--out", out.to_str().unwrap()])
        .stderr(write_end)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{:?}", o.status);
    assert!(out.is_file());
    assert_eq!(common::listing(dir.path()), ["out.parquet", "short.fa"]);
}

/// RAYON_NUM_THREADS goes through --threads' bounds: an absurd or malformed value is a clear
/// error before any thread starts (3,000 threads aborted the process), a sane one works.
#[test]
fn the_thread_variable_is_checked_like_the_flag() {
    let cfg = repo().join("configs/tiny.toml");
    let go = |v: &str| {
        let out = common::bin()
            .args(["info", "--config", cfg.to_str().unwrap()])
            .env("RAYON_NUM_THREADS", v)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), err)
    };
    let (code, err) = go("100000");
    assert!(code == Some(2) || code == Some(1), "exit {code:?}: {err}");
    assert!(err.contains("RAYON_NUM_THREADS=100000: more than"), "{err}");
    let (code, err) = go("many");
    assert!(code == Some(2) || code == Some(1), "exit {code:?}: {err}");
    assert!(
        err.contains("RAYON_NUM_THREADS=many: not a whole number"),
        "{err}"
    );
    for ok in ["1", "0"] {
        let (code, err) = go(ok);
        assert_eq!(code, Some(0), "RAYON_NUM_THREADS={ok}: {err}");
    }
}

/// The subcommands a `--help` lists under "Commands:", without `help` itself.
fn subcommands(help: &str) -> Vec<&str> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect()
}

/// Every flag of every command says what it does in `--help`: the help text under a flag's
/// line is not empty (eleven `train` flags, --steps and --lr among them, had none).
#[test]
fn every_flag_is_described_in_help() {
    let (ok, top, err) = run(&["--help"]);
    assert!(ok, "{err}");
    let commands = subcommands(&top);
    assert!(
        commands.contains(&"train") && commands.contains(&"bench"),
        "{top}"
    );
    let mut undocumented = Vec::new();
    let mut check = |path: Vec<&str>| -> String {
        let mut args = path.clone();
        args.push("--help");
        let (ok, out, err) = run(&args);
        assert!(ok, "{args:?}: {err}");
        let lines: Vec<&str> = out.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            // A flag's line: `  -x, --name <V>` or `      --name <V>` (clap's two layouts).
            let t = l.trim_start();
            let indent = l.len() - t.len();
            let flag = (2..=6).contains(&indent)
                && (t.starts_with("--") || (t.starts_with('-') && t.get(2..4) == Some(", ")));
            if !flag {
                continue;
            }
            // Described on the same line (after two spaces) or on the next, indented deeper.
            let same_line = t.contains("  ");
            let next = lines.get(i + 1).copied().unwrap_or("");
            let below =
                next.len() - next.trim_start().len() > indent + 2 && !next.trim().is_empty();
            if !same_line && !below {
                undocumented.push(format!("{}: {}", path.join(" "), t));
            }
        }
        out
    };
    for c in &commands {
        let out = check(vec![c]);
        // Subcommands (bench's) are checked too.
        for s in subcommands(&out) {
            check(vec![c, s]);
        }
    }
    assert!(
        undocumented.is_empty(),
        "flags without help:\n{}",
        undocumented.join("\n")
    );
}

/// What is not a regular file is named, never waited on: a named pipe as convert's weights or
/// as a config (convert and info blocked until killed), a pipe where a model directory's
/// weights should be ("holds no model.safetensors"); a binary file given as a config; a
/// file as convert's output directory ("Not a directory (os error 20)"). A model directory is
/// taken as convert's --config, as info takes it.
#[cfg(unix)]
#[test]
fn pipes_binaries_and_files_in_the_wrong_place_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ckpt = common::tiny_checkpoint();
    let s = |p: &std::path::Path| common::arg(p);
    let fifo = |name: &str| {
        let p = d.join(name);
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        p
    };
    let (pipe_bin, pipe_cfg) = (fifo("p.bin"), fifo("cfg.json"));
    let piped = d.join("piped");
    std::fs::create_dir(&piped).unwrap();
    std::fs::copy(ckpt.join("config.json"), piped.join("config.json")).unwrap();
    let c = std::ffi::CString::new(piped.join("model.safetensors").to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let afile = write(d, "afile", b"mine");
    let arr = write(d, "arr.json", b"[1, 2]\n");
    let tiny = s(&repo().join("configs/tiny.toml"));
    let weights = s(&ckpt.join("model.safetensors"));
    let out = s(&d.join("out"));
    for (args, want) in [
        (
            vec!["convert", &s(&pipe_bin), "--config", &tiny, "--out", &out],
            "a named pipe (FIFO), not a file",
        ),
        (
            vec!["info", "--config", &s(&pipe_cfg)],
            "a named pipe (FIFO), not a file",
        ),
        (
            vec![
                "convert",
                &weights,
                "--config",
                &s(&pipe_cfg),
                "--out",
                &out,
            ],
            "a named pipe (FIFO), not a file",
        ),
        (
            vec!["convert", &s(&piped), "--out", &out],
            "model.safetensors: a named pipe (FIFO)",
        ),
        (
            vec!["info", "--config", &weights],
            "not text (invalid UTF-8",
        ),
        (
            vec!["convert", &s(&ckpt), "--out", &s(&afile)],
            "a file, not a directory",
        ),
        (
            vec!["convert", &s(&ckpt), "--out", &s(&d.join(".."))],
            "name the directory itself",
        ),
        // A file where a directory of the path should be (a bare "File exists" before), a
        // JSON array for a config, a model's file for its directory, a run for weights to
        // convert, an escape byte in a prompt (printed raw).
        (
            vec!["convert", &s(&ckpt), "--out", &s(&afile.join("sub"))],
            "afile is a file, not a directory",
        ),
        (vec!["info", "--config", &s(&arr)], "not a JSON object"),
        (
            vec!["generate", "--model", &weights],
            "a file of a model; give the model directory that holds it",
        ),
        (
            vec!["convert", &s(common::trained_tiny()), "--out", &out],
            "a genslm run directory",
        ),
        // A part of a run named for the run: pointed to it.
        (
            vec![
                "convert",
                &s(&common::trained_tiny().join("checkpoints")),
                "--out",
                &out,
            ],
            "part of the genslm run in",
        ),
        (
            vec![
                "generate",
                "--model",
                &s(&common::trained_tiny().join("metrics.jsonl")),
            ],
            "it is part of the run in",
        ),
        (
            vec!["generate", "--model", &s(&ckpt), "--prompt", "ATG\u{1b}[2J"],
            "character '\\u{1b}' at position 4",
        ),
    ] {
        let (ok, _, err) = run(&args);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read(&afile).unwrap(), b"mine");
    let (ok, _, err) = run(&["convert", &weights, "--config", &s(&ckpt), "--out", &out]);
    assert!(ok, "{err}");
    assert!(d.join("out/model.safetensors").is_file());
}

/// A config given through a pipe (`cmd | genslm info --config /dev/stdin`) is called a pipe,
/// not the named pipe (FIFO) it was called, which sent users looking for a `mkfifo`.
#[test]
fn an_anonymous_pipe_is_not_called_a_named_one() {
    use std::io::Write;
    let mut child = common::bin()
        .args(["info", "--config", "/dev/stdin"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Held open until the answer, so that the path is a pipe while it is looked at.
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"[model]\n").unwrap();
    let done = child.wait_with_output().unwrap();
    drop(stdin);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(
        !done.status.success() && err.contains("/dev/stdin: a pipe (") && !err.contains("FIFO"),
        "{err}"
    );
}

/// Runs `args` and kills it after 60 s: a command blocked on a pipe fails the test instead of
/// hanging the suite. Returns (exit success, stderr).
#[cfg(unix)]
fn run_or_kill(args: &[&str]) -> (bool, String) {
    let mut child = common::bin()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() > 60 {
            child.kill().unwrap();
            panic!("{args:?} still ran after 60 s (blocked on a pipe?)");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Named pipes that hung a command: a malformed FASTA from one (the error's hint opened it a
/// second time and waited for a writer that was gone), and one in place of a model
/// directory's sha256 manifest (read without the check its other files get).
#[cfg(unix)]
#[test]
fn named_pipes_that_hung_are_errors() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mkfifo = |p: &std::path::Path| {
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    };
    let fifo = d.join("cr.fa");
    mkfifo(&fifo);
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
            // Lines ending in CR alone: one line, a header with no sequence.
            let _ = f.write_all(b">a\rACGTAC\r");
        })
    };
    let out = d.join("o.parquet");
    let (ok, err) = run_or_kill(&[
        "tokenize",
        "--fasta",
        fifo.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    writer.join().unwrap();
    assert!(!ok && err.contains("cr.fa"), "{err}");
    assert!(!out.exists());
    // The same pipe inside a directory given: passed over by the walk, and named when
    // nothing else is found (it was "no FASTA files found", unexplained).
    let (ok, err) = run_or_kill(&[
        "tokenize",
        "--fasta",
        d.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("passed over") && err.contains("cr.fa (a named pipe (FIFO)"),
        "{err}"
    );
    let model = d.join("model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(common::tiny_checkpoint()).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() && e.file_name() != "checksums.sha256" {
            std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
        }
    }
    mkfifo(&model.join("checksums.sha256"));
    let lambda = repo().join("data/lambda_virus.fa");
    let (ok, err) = run_or_kill(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--fasta",
        lambda.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("a named pipe (FIFO)"), "{err}");
}
