//! `genslm plan` from the command line: the report, the sweep, the JSON, the published
//! comparison, and the values it refuses.

mod common;

use common::{repo, run};

#[test]
fn cli_plans_sweeps_and_compares() {
    let cfg = repo().join("configs/genslm-25m.toml");
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = run(&[
        "plan",
        "--config",
        cfg,
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "80",
        "--sp",
        "8",
        "--zero",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["layout"]["sp"], 8);
    assert_eq!(v["layout"]["dp"], 1);
    assert!(v["max_seq_len"].as_u64().unwrap() > 100_000);
    for k in [
        "parameters",
        "gradients",
        "optimizer_states",
        "activations",
        "attention",
        "position_table",
        "logits",
        "communication",
        "workspace",
    ] {
        assert!(v["at_max_seq_len"]["memory"][k].is_number(), "{k}");
    }

    let (ok, out, err) = run(&[
        "plan",
        "--config",
        cfg,
        "--gpus",
        "64",
        "--gpu-mem-gib",
        "40",
        "--sweep",
    ]);
    assert!(ok, "{err}");
    for count in ["1", "2", "4", "8", "16", "32", "64"] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some(count)),
            "{out}"
        );
    }

    let (ok, out, err) = run(&["plan", "--compare-published"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("(c) new Megatron-DS") && out.contains("128 / "),
        "{out}"
    );
    assert!(
        out.contains("10143818") && out.contains("The cells that miss"),
        "{out}"
    );
    let (ok, out, _) = run(&["plan", "--compare-published", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["published_cells"], 18);
    assert_eq!(v["logged_runs"].as_array().map(Vec::len), Some(14));
    assert_eq!(v["misses"].as_array().map(Vec::len), Some(3));

    // Errors name the problem and exit non-zero.
    let (ok, _, err) = run(&[
        "plan",
        "--config",
        cfg,
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "80",
        "--sp",
        "3",
    ]);
    assert!(!ok && err.contains("heads"), "{err}");
    // 0, and a "positive" 1e-300 that planned 0 bytes.
    for mem in ["0", "1e-300"] {
        let (ok, _, err) = run(&["plan", "--config", cfg, "--gpus", "8", "--gpu-mem-gib", mem]);
        assert!(
            !ok && err.contains("gpu-mem-gib") && err.len() < 200,
            "{err}"
        );
    }
    let (ok, _, err) = run(&[
        "plan",
        "--config",
        "/nonexistent.toml",
        "--gpus",
        "1",
        "--gpu-mem-gib",
        "8",
    ]);
    assert!(!ok && err.contains("nonexistent"), "{err}");
}

/// `plan --seq-len 0` is refused (it printed the memory "at 0 tokens").
#[test]
fn plan_refuses_a_sequence_of_no_tokens() {
    let cfg = repo().join("configs/genslm-25m.toml");
    let (ok, _, err) = run(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--seq-len",
        "0",
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "40",
    ]);
    assert!(
        !ok && err.contains("--seq-len 0: a training sequence holds at least 2 tokens"),
        "{err}"
    );
    // One token, and degrees or micro-batches of 0, as train refuses them.
    let base = [
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "40",
    ];
    for (flag, v) in [
        ("--seq-len", "1"),
        ("--tp", "0"),
        ("--pp", "0"),
        ("--grad-accum", "0"),
    ] {
        let (ok, _, err) = run(&[&base[..], &[flag, v]].concat());
        assert!(
            !ok && err.contains(&format!("{flag} {v}")),
            "{flag} {v}: {err}"
        );
    }
}

/// Flags whose only effect is on something the request turns off are refused by name
/// (`--host-mem-gib` without `--offload`, `--pp-virtual` with one stage or a schedule without
/// chunks were ignored without a word), and accepted where they act.
#[test]
fn flags_that_would_do_nothing_are_refused() {
    let base = [
        "plan",
        "--config",
        "genslm-25b",
        "--gpus",
        "64",
        "--gpu-mem-gib",
        "40",
    ];
    for (extra, said) in [
        (&["--host-mem-gib", "100"][..], "nothing is offloaded"),
        (
            &[
                "--pp",
                "1",
                "--pp-virtual",
                "2",
                "--pp-schedule",
                "interleaved",
            ][..],
            "give --pp P",
        ),
        (
            &["--pp-virtual", "2"][..],
            "needs --pp-schedule interleaved",
        ),
    ] {
        let (ok, _, err) = run(&[&base[..], extra].concat());
        assert!(!ok && err.contains(said), "{extra:?}: {err}");
    }
    for extra in [
        &["--host-mem-gib", "100", "--offload", "optimizer"][..],
        &["--pp-virtual", "2", "--pp-schedule", "interleaved"][..],
    ] {
        let (ok, out, err) = run(&[&base[..], extra].concat());
        assert!(ok && out.contains("longest sequence"), "{extra:?}: {err}");
        // Chunks of stages are searched among layouts with stages (pp 1 was chosen, V 2).
        if extra.contains(&"--pp-virtual") {
            assert!(out.contains("interleaved V 2"), "{out}");
        }
    }
    let small = [
        "plan",
        "--config",
        "genslm-25m",
        "--gpus",
        "8",
        "--gpu-mem-gib",
        "80",
        "--pp-virtual",
        "2",
        "--pp-schedule",
        "interleaved",
    ];
    let (ok, out, err) = run(&small);
    assert!(ok && out.contains("interleaved V 2"), "{out}{err}");
    // --compare-published plans its own published setups: flags it would ignore are refused.
    for extra in [
        ["--device", "cpu"],
        ["--host-mem-gib", "4"],
        ["--tp", "2"],
        ["--zero", "3"],
        ["--pp-schedule", "zb"],
        ["--offload", "all"],
        ["--batch-size", "2"],
    ] {
        let (ok, _, err) = run(&[&["plan", "--compare-published"][..], &extra[..]].concat());
        assert!(
            !ok && err.contains("cannot be used with"),
            "{extra:?}: {err}"
        );
    }
}

/// A memory that holds any length is reported at the longest sequence `--seq-len` takes
/// (2³¹ tokens), said to be genslm's limit, and that length is one `plan --seq-len` accepts
/// (the search's ceiling, 2⁴⁰, was printed as the answer before).
#[test]
fn a_boundless_memory_reports_the_longest_sequence_genslm_trains() {
    let cfg = repo().join("configs/tiny.toml");
    let cfg = cfg.to_str().unwrap();
    let base = ["plan", "--config", cfg, "--gpus", "1", "--gpu-mem-gib"];
    let (ok, out, err) = run(&[&base[..], &["1000000000"]].concat());
    assert!(ok, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("longest sequence"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("2,147,483,648 tokens"), "{line}");
    assert!(line.contains("the most genslm trains"), "{line}");
    let (ok, _, err) = run(&[&base[..], &["1000000000", "--seq-len", "2147483648"]].concat());
    assert!(ok, "{err}");
    // An ordinary memory's answer is below the limit and says nothing of it.
    let (ok, out, err) = run(&[&base[..], &["1"]].concat());
    assert!(ok, "{err}");
    assert!(!out.contains("the most genslm trains"), "{out}");
}

/// A sequence of half the layout's pieces or fewer is planned (the what-if stays useful) with
/// a note that the trainer refuses it; one token more has no such note.
#[test]
fn a_window_shorter_than_its_pieces_is_noted() {
    let cfg = repo().join("configs/tiny.toml");
    let plan = |len: &str| {
        let (ok, out, err) = run(&[
            "plan",
            "--config",
            cfg.to_str().unwrap(),
            "--gpus",
            "8",
            "--cp",
            "8",
            "--gpu-mem-gib",
            "40",
            "--seq-len",
            len,
        ]);
        assert!(ok, "{err}");
        out
    };
    let out = plan("8");
    assert!(
        out.contains("refuses this layout at --seq-len 8: it cuts every window into 16 pieces"),
        "{out}"
    );
    assert!(!plan("9").contains("refuses this layout"));
    // Where the flags leave a choice, a layout the trainer runs at that length is chosen (sp 4
    // × cp 2 was, noted as refused, beside cp 2 × dp 4).
    let (ok, out, err) = run(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--gpus",
        "8",
        "--cp",
        "2",
        "--gpu-mem-gib",
        "80",
        "--seq-len",
        "3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let l = &v["layout"];
    let n = |k: &str| l[k].as_u64().unwrap();
    assert!(n("sp") * n("tp") * 2 * n("cp") < 2 * 3, "{l}");
}

/// Where no layout fits, the one shown is the one needing the least memory per rank (ZeRO-0,
/// 4.4× ZeRO-3's need, was shown as "best"): the minimum over each layout asked for by name.
#[test]
fn where_nothing_fits_the_closest_layout_is_shown() {
    let cfg = repo().join("configs/genslm-33b.toml");
    let cfg = cfg.to_str().unwrap();
    let plan = |extra: &[&str]| {
        let mut a = vec![
            "plan",
            "--config",
            cfg,
            "--gpus",
            "4",
            "--gpu-mem-gib",
            "0.5",
            "--sp",
            "1",
            "--cp",
            "1",
            "--pp",
            "1",
            "--json",
        ];
        a.extend_from_slice(extra);
        let (ok, out, err) = run(&a);
        ok.then(|| serde_json::from_str::<serde_json::Value>(&out).unwrap())
            .ok_or(err)
    };
    let mut least = u64::MAX;
    for tp in ["1", "2", "4"] {
        for zero in ["0", "1", "2", "3"] {
            if let Ok(v) = plan(&["--tp", tp, "--zero", zero]) {
                assert_eq!(v["max_seq_len"], 0, "tp {tp} zero {zero} fits in 0.5 GiB?");
                least = least.min(v["total_bytes_at_max"].as_u64().unwrap());
            }
        }
    }
    let v = plan(&[]).unwrap();
    assert_eq!(v["max_seq_len"], 0);
    assert_eq!(v["total_bytes_at_max"].as_u64().unwrap(), least, "{v}");
    let (ok, out, _) = run(&[
        "plan",
        "--config",
        cfg,
        "--gpus",
        "4",
        "--gpu-mem-gib",
        "0.5",
    ]);
    assert!(ok && out.contains("this one comes closest"), "{out}");
}

/// Byte counts past 2^64 (naive attention at 2^31 tokens) are written as they are: the parts
/// add up to their phase's total (they were capped at 18446744073709551615, so the parts
/// outgrew the total they belong to).
#[test]
fn json_byte_counts_past_u64_are_not_capped() {
    let cfg = repo().join("configs/genslm-25m.toml");
    let (ok, out, err) = run(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--gpus",
        "4",
        "--gpu-mem-gib",
        "80",
        "--attention",
        "naive",
        "--seq-len",
        "2147483648",
        "--sp",
        "1",
        "--zero",
        "1",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let at = &v["at_seq_len"];
    let parts: f64 = at["memory"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_f64().unwrap())
        .sum();
    let phase = at["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p[0] == at["phase"])
        .unwrap()[1]
        .as_f64()
        .unwrap();
    // s² fp32 scores per head, 2^62 · 4 bytes alone: past u64.
    assert!(
        at["memory"]["attention"].as_f64().unwrap() > u64::MAX as f64,
        "{at}"
    );
    assert!((parts - phase).abs() <= 1e-9 * phase, "{parts} vs {phase}");
}

/// A config's [train] settings are not plan's: said, not silently dropped; a preset (no
/// [train]) gets no such note.
#[test]
fn a_configs_train_settings_are_said_to_be_unread() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo().join("configs/tiny.toml")).unwrap();
    let path = dir.path().join("t.toml");
    std::fs::write(
        &path,
        format!("{text}\n[train]\nzero = 3\nbatch_size = 8\n"),
    )
    .unwrap();
    let plan = |cfg: &str| {
        let (ok, _, err) = run(&["plan", "--config", cfg, "--gpus", "2", "--gpu-mem-gib", "8"]);
        assert!(ok, "{err}");
        err
    };
    let err = plan(path.to_str().unwrap());
    assert!(
        err.contains("[train] settings (zero, batch_size) are not read by plan")
            || err.contains("[train] settings (batch_size, zero) are not read by plan"),
        "{err}"
    );
    assert!(!plan("tiny").contains("[train]"));
}
