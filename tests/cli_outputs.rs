//! Where commands write: never over one of their own inputs, never to a name that says another
//! format than the one written, never to a file named `-`.

mod common;

use std::path::Path;

use common::{arg, repo, run};

/// No command writes its output over one of its own inputs (the output path given as the
/// FASTA, the VCF, or a file of the model it loads): each is refused, naming the input, and
/// the input keeps its bytes.
#[test]
fn an_output_that_is_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Names without a format's extension: outputs named .fa, .vcf or .safetensors where they
    // are written as another format are refused by their name first (below), before the input
    // check this test is about.
    let fasta = dir.path().join("lambda_sequence");
    std::fs::copy(repo().join("data/lambda_virus.fa"), &fasta).unwrap();
    let vcf = dir.path().join("cro_variants");
    std::fs::copy(repo().join("examples/lambda_cro.vcf"), &vcf).unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let from = common::tiny_checkpoint();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(f), model.join(f)).unwrap();
    }
    let weights = model.join("model.safetensors");
    // The manifest is read with the weights (and needed to load them again).
    let manifest = model.join("checksums.sha256");
    let lines: String = ["config.json", "model.safetensors"]
        .iter()
        .map(|f| {
            use sha2::Digest;
            let hash = sha2::Sha256::digest(std::fs::read(model.join(f)).unwrap());
            let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
            format!("{hex}  {f}\n")
        })
        .collect();
    std::fs::write(&manifest, lines).unwrap();
    let before: Vec<Vec<u8>> = [&fasta, &vcf, &weights, &manifest]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    // The weights through a link: caught by the file they are, not by the name.
    let link = dir.path().join("weights_link");
    std::os::unix::fs::symlink(&weights, &link).unwrap();
    let (fa, vc, m, w) = (arg(&fasta), arg(&vcf), arg(&model), arg(&link));
    let mf = arg(&manifest);
    let cases: [&[&str]; 6] = [
        &["tokenize", "--fasta", &fa, "--out", &fa],
        &["generate", "--model", &m, "--max-codons", "4", "--out", &mf],
        &["score", "--model", &m, "--fasta", &fa, "--per-token", &fa],
        &["embed", "--model", &m, "--fasta", &fa, "--out", &w],
        &[
            "variants", "--model", &m, "--fasta", &fa, "--vcf", &vc, "--out", &vc,
        ],
        &[
            "variants", "--model", &m, "--fasta", &fa, "--vcf", &vc, "--out", &fa,
        ],
    ];
    for args in cases {
        let mut args = args.to_vec();
        if args[0] == "variants" {
            args.extend(["--cds", "38041..38241"]);
        }
        args.push("--quiet");
        let (ok, _, err) = run(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains("an input of this command"), "{args:?}: {err}");
    }
    // A tokenized dataset is an input too: `embed --data X --out X` replaced it with the
    // embeddings (exit 0), through a link as well.
    let data = dir.path().join("data.parquet");
    let d = arg(&data);
    assert!(run(&["tokenize", "--fasta", &fa, "--out", &d, "--quiet"]).0);
    let data_link = dir.path().join("data_link.parquet");
    std::os::unix::fs::symlink(&data, &data_link).unwrap();
    let dl = arg(&data_link);
    let kept = std::fs::read(&data).unwrap();
    for args in [
        ["embed", "--model", &m, "--data", &d, "--out", &d],
        ["embed", "--model", &m, "--data", &dl, "--out", &d],
    ] {
        let (ok, _, err) = run(&args);
        assert!(
            !ok && err.contains("an input of this command"),
            "{args:?}: {err}"
        );
    }
    assert_eq!(std::fs::read(&data).unwrap(), kept);
    // A parquet output named as another format.
    for (flag, name) in [("--out", "emb.csv"), ("--out", "weights.safetensors")] {
        let out = arg(&dir.path().join(name));
        let (ok, _, err) = run(&["embed", "--model", &m, "--fasta", &fa, flag, &out]);
        assert!(
            !ok && err.contains("is written as parquet"),
            "{name}: {err}"
        );
    }
    let (ok, _, err) = run(&[
        "tokenize",
        "--fasta",
        &fa,
        "--out",
        &arg(&dir.path().join("t.tsv")),
    ]);
    assert!(!ok && err.contains("is written as parquet"), "{err}");
    // A picture named as another format, refused before any work (embed ran, then wrote it).
    let png = arg(&dir.path().join("pca.txt"));
    let emb = arg(&dir.path().join("e.parquet"));
    let cases: [&[&str]; 3] = [
        &[
            "embed", "--model", &m, "--fasta", &fa, "--out", &emb, "--plot", &png,
        ],
        &["plot", "--run", &arg(dir.path()), "--out", &png],
        &[
            "variants",
            "--model",
            &m,
            "--fasta",
            &fa,
            "--vcf",
            &vc,
            "--cds",
            "38041..38241",
            "--out",
            &emb,
            "--heatmap",
            &png,
        ],
    ];
    for args in cases {
        let (ok, _, err) = run(args);
        assert!(!ok && err.contains("is written as PNG"), "{args:?}: {err}");
    }
    assert!(!dir.path().join("pca.txt").exists() && !dir.path().join("e.parquet").exists());
    for (p, bytes) in [&fasta, &vcf, &weights, &manifest].iter().zip(before) {
        assert!(
            std::fs::read(p).unwrap() == bytes,
            "{} changed",
            p.display()
        );
    }
    assert!(!dir.path().join("emb.csv").exists() && !dir.path().join("t.tsv").exists());
}

/// `--out -` reads as stdout, but wrote a parquet file named `-` in the working directory
/// (embed, plot, variants and generate likewise): refused, nothing written.
#[test]
fn an_output_of_dash_is_refused_not_written_as_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let fa = common::repo().join("data/lambda_virus.fa");
    let model = common::trained_tiny();
    let cases: [Vec<&std::ffi::OsStr>; 3] = [
        vec!["tokenize".as_ref(), "--fasta".as_ref(), fa.as_os_str()],
        vec!["generate".as_ref(), "--model".as_ref(), model.as_os_str()],
        vec![
            "plot".as_ref(),
            "--embeddings".as_ref(),
            "e.parquet".as_ref(),
        ],
    ];
    for args in cases {
        let out = common::bin()
            .current_dir(dir.path())
            .args(&args)
            .args(["--out", "-"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--out -: this output is written to a file"),
            "{args:?}: {err}"
        );
    }
    assert!(!dir.path().join("-").exists());
}

/// Text outputs named as another format are refused before any work: `generate --out
/// x.parquet` wrote FASTA under a parquet name, `variants --out x.csv` a TSV.
#[test]
fn a_text_output_named_as_another_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = arg(common::trained_tiny());
    let fa = arg(&repo().join("data/lambda_virus.fa"));
    let vcf = arg(&repo().join("examples/lambda_cro.vcf"));
    let out = |name: &str| arg(&dir.path().join(name));
    let (ok, _, err) = run(&["generate", "--model", &model, "--out", &out("g.parquet")]);
    assert!(!ok && err.contains("is written as FASTA"), "{err}");
    let (ok, _, err) = run(&[
        "variants",
        "--model",
        &model,
        "--fasta",
        &fa,
        "--vcf",
        &vcf,
        "--cds",
        "38041..38241",
        "--out",
        &out("v.csv"),
    ]);
    assert!(!ok && err.contains("is written as TSV"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// An output path that is a link to a file descriptor (`/proc/self/fd/1`, what `/dev/stdout`
/// is) resolved, with stdout redirected to a file, to that regular file: the checks passed and
/// the rename replaced the link (as root, `/dev/stdout` itself) while the redirected file
/// stayed empty. Refused, the link and the redirected file as they were.
#[test]
fn a_link_to_a_file_descriptor_is_refused_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let fa = repo().join("data/lambda_virus.fa");
    let model = common::trained_tiny();
    let link = dir.path().join("mystdout.fa");
    std::os::unix::fs::symlink("/proc/self/fd/1", &link).unwrap();
    let fd_dir = dir.path().join("fds");
    std::os::unix::fs::symlink("/proc/self/fd", &fd_dir).unwrap();
    let cases: [(Vec<&std::ffi::OsStr>, &Path); 3] = [
        (
            vec!["tokenize".as_ref(), "--fasta".as_ref(), fa.as_os_str()],
            &link,
        ),
        (
            vec!["generate".as_ref(), "--model".as_ref(), model.as_os_str()],
            &link,
        ),
        // The output's folder a link to the descriptors.
        (
            vec!["generate".as_ref(), "--model".as_ref(), model.as_os_str()],
            &fd_dir.join("1"),
        ),
    ];
    for (args, out) in cases {
        let captured = dir.path().join("captured");
        let stdout = std::fs::File::create(&captured).unwrap();
        let res = common::bin()
            .args(&args)
            .arg("--out")
            .arg(out)
            .stdout(stdout)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(
            !res.status.success() && err.contains("a link to one of this process's open files"),
            "{args:?} {out:?}: {err}"
        );
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            Path::new("/proc/self/fd/1")
        );
        assert_eq!(std::fs::metadata(&captured).unwrap().len(), 0);
    }
}
