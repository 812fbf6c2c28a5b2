//! `genslm variants`: the table, prefix reuse against full recomputation, saturation with its
//! heatmap, and every bad input with its message. (Δ against transformers: scripts/check_variants.py.)

mod common;

use common::variants_cli::{cds, fasta, table, variants, VCF};
use common::{arg, gzip, listing, run, trained_tiny, write};

/// Windows are built and scored a chunk at a time (the memory bound of a long --saturate):
/// one variant per chunk, with prefix reuse, gives full recomputation's Δ.
#[test]
fn scoring_a_chunk_at_a_time_gives_the_same_deltas() {
    use genslm::infer::variants::{run_variants, VariantOptions, VariantSource};
    let dir = tempfile::tempdir().unwrap();
    let fa = fasta(dir.path());
    let mut opts = VariantOptions {
        source: VariantSource::Saturate { start: 4, end: 30 },
        window: Some(8),
        prefix_reuse: false,
        ..Default::default()
    };
    let (full, chunked) = (dir.path().join("full.tsv"), dir.path().join("chunk.tsv"));
    run_variants(trained_tiny(), std::slice::from_ref(&fa), &opts, &full).unwrap();
    opts.prefix_reuse = true;
    opts.chunk_tokens = 1;
    run_variants(trained_tiny(), &[fa], &opts, &chunked).unwrap();
    let (t1, t2) = (table(&full), table(&chunked));
    assert_eq!(t1.len(), 1 + 27 * 3);
    let d = t1[0].iter().position(|c| c == "delta_ll").unwrap();
    for (a, b) in t1.iter().zip(&t2).skip(1) {
        assert_eq!(a[..d], b[..d]);
        let (x, y): (f64, f64) = (a[d].parse().unwrap(), b[d].parse().unwrap());
        assert!((x - y).abs() < 1e-4, "{a:?} {b:?}");
    }
}

#[test]
fn variants_table_prefix_reuse_and_full_recomputation_agree() {
    let dir = tempfile::tempdir().unwrap();
    let fa = fasta(dir.path());
    let vcf = write(dir.path(), "v.vcf.gz", &gzip(VCF.as_bytes()));
    let (fast, slow) = (dir.path().join("fast.tsv"), dir.path().join("slow.tsv"));
    for (out, extra) in [(&fast, None), (&slow, Some("--no-prefix-reuse"))] {
        let (o, f, v) = (arg(out), arg(&fa), arg(&vcf));
        let mut a = vec!["--fasta", &f, "--vcf", &v, "--out", &o, "--window", "12"];
        a.extend(extra);
        let (ok, _, err) = variants(&a);
        assert!(ok, "{err}");
    }
    let (t1, t2) = (table(&fast), table(&slow));
    assert_eq!(t1[0].len(), 17);
    // The summary gives the windows scored where they differ from --window: the range of the
    // table's ref_tokens (genslm69: one token per codon).
    let rt = t1[0].iter().position(|c| c == "ref_tokens").unwrap();
    let lens: Vec<usize> = t1[1..].iter().filter_map(|r| r[rt].parse().ok()).collect();
    let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
    assert!(
        (lo, hi) != (&12, &12),
        "the VCF has clipped and stretched windows"
    );
    let model = arg(trained_tiny());
    let loud = arg(&dir.path().join("loud.tsv"));
    let (f, v) = (arg(&fa), arg(&vcf));
    let (ok, _, err) = run(&[
        "variants", "--model", &model, "--fasta", &f, "--vcf", &v, "--out", &loud, "--window", "12",
    ]);
    assert!(
        ok && err.contains(&format!("window 12 codons ({lo}–{hi} scored")),
        "{err}"
    );
    assert_eq!(t1.len(), 1 + 9, "one row per ALT allele");
    let col = |name: &str| t1[0].iter().position(|c| c == name).unwrap();
    for (a, b) in t1.iter().zip(&t2).skip(1) {
        // Everything but the Δ columns is identical; the Δ agree within 1e-4.
        assert_eq!(a[..col("delta_ll")], b[..col("delta_ll")]);
        for c in [col("delta_ll"), col("delta_ll_codon"), col("delta_mean_ll")] {
            match (a[c].parse::<f64>(), b[c].parse::<f64>()) {
                (Ok(x), Ok(y)) => assert!((x - y).abs() < 1e-4, "{a:?} {b:?}"),
                _ => assert_eq!((a[c].as_str(), b[c].as_str()), ("NA", "NA")),
            }
        }
    }
    let row = |id: &str| t1.iter().find(|r| r[2] == id).unwrap().clone();
    let get = |id: &str, c: &str| row(id)[col(c)].clone();
    // Codon 2 GCT -> GTT: A2V (codon numbers 1-based in the CDS).
    assert_eq!(get("syn_or_mis", "aa_change"), "A2V");
    assert_eq!(get("syn_or_mis", "consequence"), "missense");
    assert_eq!(get("start", "consequence"), "start_lost");
    // The window of the first codon starts there; its own codon is never predicted.
    assert_eq!(get("start", "window_start"), "1");
    assert_eq!(get("start", "delta_ll_codon"), "NA");
    assert_eq!(get("last", "consequence"), "stop_lost");
    assert_eq!(
        get("last", "window_start"),
        "19",
        "clipped at the CDS end: 30 - 12 + 1"
    );
    assert_eq!(get("mnv", "aa_change"), "K3P");
    let ins: Vec<_> = t1.iter().filter(|r| r[2] == "ins").collect();
    assert_eq!(
        (
            ins[0][col("consequence")].as_str(),
            ins[1][col("consequence")].as_str()
        ),
        ("inframe_insertion", "frameshift")
    );
    assert_eq!(
        (
            ins[0][col("alt_tokens")].as_str(),
            ins[0][col("ref_tokens")].as_str()
        ),
        ("13", "12")
    );
    assert_eq!(get("del", "consequence"), "inframe_deletion");
    // --out *.parquet: the same table, NA as null.
    let pq = dir.path().join("fast.parquet");
    let (ok, _, err) = variants(&[
        "--fasta",
        &arg(&fa),
        "--vcf",
        &arg(&vcf),
        "--out",
        &arg(&pq),
        "--window",
        "12",
    ]);
    assert!(ok, "{err}");
    let f = std::fs::File::open(&pq).unwrap();
    let b = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
        .unwrap()
        .build()
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    use arrow_array::cast::AsArray;
    use arrow_array::Array;
    let d = b
        .column_by_name("delta_ll")
        .unwrap()
        .as_primitive::<arrow_array::types::Float64Type>();
    let ids = b.column_by_name("id").unwrap().as_string::<i32>();
    assert_eq!(b.num_rows(), t1.len() - 1);
    // The TSV's six decimals are the parquet's exact values rounded; the parquet keeps more.
    let mut finer = 0;
    for (i, r) in t1.iter().skip(1).enumerate() {
        assert_eq!(ids.value(i), r[2]);
        if let Ok(tsv) = r[col("delta_ll")].parse::<f64>() {
            assert!(
                (d.value(i) - tsv).abs() <= 5.0000001e-7,
                "{} vs {tsv}",
                d.value(i)
            );
            finer += usize::from(d.value(i) != tsv);
        } else {
            assert!(d.is_null(i));
        }
    }
    assert!(
        finer > 0,
        "parquet holds the six-decimal text, not the values"
    );
    let dc = b.column_by_name("delta_ll_codon").unwrap();
    assert!(dc.is_null(t1.iter().skip(1).position(|r| r[2] == "start").unwrap()));
    assert_eq!(get("end_del", "consequence"), "frameshift");
    // A deletion longer than the half window after it: the window stretches to hold it
    // (12 codons from codon 8 would end at codon 19; the deletion runs to base 61, codon 21).
    assert_eq!(get("long_del", "consequence"), "inframe_deletion");
    assert_eq!(
        (
            get("long_del", "ref_tokens").as_str(),
            get("long_del", "alt_tokens").as_str()
        ),
        ("14", "7")
    );
}

#[test]
fn saturation_writes_three_rows_per_base_and_a_heatmap() {
    let dir = tempfile::tempdir().unwrap();
    let fa = fasta(dir.path());
    let (out, png) = (dir.path().join("sat.tsv"), dir.path().join("sat.png"));
    let (ok, _, err) = variants(&[
        "--fasta",
        &arg(&fa),
        "--saturate",
        "4..12",
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&png),
        "--window",
        "16",
    ]);
    assert!(ok, "{err}");
    let t = table(&out);
    assert_eq!(t.len(), 1 + 9 * 3);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[1..4], b"PNG");
    assert!(t.iter().skip(1).all(|r| r[15] != "NA" && r[13] != "NA"));
    assert_eq!(listing(dir.path()), ["ref.fa", "sat.png", "sat.tsv"]);
}

#[test]
fn bad_variants_are_clear_errors_or_skipped_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let out = dir.path().join("out.tsv");
    let cases = [
        (
            "gene\t5\t.\tG\tT\n",
            "line 1: REF 'G' does not match the reference at gene:5 ('C')",
        ),
        (
            "chr9\t5\t.\tC\tT\n",
            "line 1: CHROM 'chr9' is not a record of the FASTA input (records: gene)",
        ),
        (
            "gene\tfive\t.\tC\tT\n",
            "line 1: POS 'five' is not a positive integer",
        ),
        ("gene\t5\t.\tC\n", "line 1: 4 tab-separated column(s)"),
        (
            "gene\t5\t.\tC\t<DEL>\n",
            "line 1: ALT '<DEL>' is a symbolic allele",
        ),
        (
            "gene\t89\t.\tAAT\tA\n",
            "line 1: REF 'AAT' at gene:89 runs past the record's end (90 bases)",
        ),
    ];
    for (line, want) in cases {
        let vcf = write(dir.path(), "bad.vcf", format!("#header\n{line}").as_bytes());
        let (ok, _, err) = variants(&["--fasta", &fa, "--vcf", &arg(&vcf), "--out", &arg(&out)]);
        let want = want.replace("line 1", "line 2");
        assert!(
            !ok && err.contains(&want) && err.contains("bad.vcf"),
            "{line}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "nothing written on error");
        // The same line with --on-invalid skip: a warning, and the good variant is scored.
        let mixed = write(
            dir.path(),
            "mixed.vcf",
            format!("{line}gene\t5\t.\tC\tT\n").as_bytes(),
        );
        let (ok, _, err) = variants(&[
            "--fasta",
            &fa,
            "--vcf",
            &arg(&mixed),
            "--out",
            &arg(&out),
            "--on-invalid",
            "skip",
        ]);
        assert!(
            ok && err.contains("skipped (--on-invalid skip)"),
            "{line}: {err}"
        );
        assert_eq!(table(&out).len(), 2, "{line}");
        std::fs::remove_file(&out).unwrap();
    }
    // A variant outside the --cds is annotated, not scored.
    let vcf = write(
        dir.path(),
        "out.vcf",
        b"gene\t2\t.\tT\tC\ngene\t11\t.\tT\tG\ngene\t3\tanchored\tGGCT\tG\n",
    );
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&vcf),
        "--out",
        &arg(&out),
        "--cds",
        "4..90",
    ]);
    assert!(ok, "{err}");
    let t = table(&out);
    assert_eq!((t[1][5].as_str(), t[1][13].as_str()), ("outside_cds", "NA"));
    assert_ne!(t[2][13], "NA");
    // The anchor base sits before the CDS, the deleted codon inside it: inside, scored.
    assert_eq!(
        (t[3][5].as_str(), t[3][6].as_str()),
        ("inframe_deletion", "A1del")
    );
    assert_ne!(t[3][13], "NA");
    // Flags that cannot work.
    for (args, want) in [
        (
            vec!["--cds", "4..900"],
            "--cds 4..900: record 'gene' has only 90 bases",
        ),
        (vec!["--cds", "9..4"], "--cds '9..4': START 9 is past END 4"),
        (vec!["--window", "1"], "--window 1: must be at least 2"),
        (vec!["--batch-size", "0"], "--batch-size 0"),
    ] {
        let mut a = vec![
            "--fasta",
            fa.as_str(),
            "--vcf",
            vcf.to_str().unwrap(),
            "--out",
        ];
        let o = arg(&out);
        a.push(&o);
        a.extend(args.iter().copied());
        let (ok, _, err) = variants(&a);
        assert!(!ok && err.contains(want), "{args:?}: {err}");
    }
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&vcf),
        "--out",
        &arg(&out),
        "--heatmap",
        "x.png",
    ]);
    assert!(!ok && err.contains("--saturate"), "{err}");
}

/// A record id that appears twice in the FASTA input is refused, naming it and both files,
/// instead of scoring against whichever record came last.
#[test]
fn a_duplicate_record_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = fasta(dir.path());
    let other = cds().replace("GCT", "GCC");
    let second = write(
        dir.path(),
        "more.fa",
        format!(">gene\n{other}\n").as_bytes(),
    );
    let vcf = write(dir.path(), "one.vcf", b"#header\ngene\t5\t.\tC\tT\n");
    let out = dir.path().join("out.tsv");
    let (f1, f2) = (arg(&first), arg(&second));
    let (v, o) = (arg(&vcf), arg(&out));
    let args = ["--fasta", &f1, "--fasta", &f2, "--vcf", &v, "--out", &o];
    let (ok, _, err) = variants(&args);
    assert!(!ok && !out.exists(), "{err}");
    assert!(
        err.contains("more.fa: record id 'gene' appears twice (first in") && err.contains("ref.fa"),
        "{err}"
    );
    // The same with --saturate (no VCF).
    let sat = [
        "--fasta",
        &f1,
        "--fasta",
        &f2,
        "--saturate",
        "1..6",
        "--out",
        &o,
    ];
    let (ok, _, err) = variants(&sat);
    assert!(!ok && err.contains("appears twice"), "{err}");
}

/// A VCF with nothing to score names itself (and the CHROM asked for); `--heatmap` without
/// `--saturate` is refused before anything is computed or written.
#[test]
fn nothing_to_score_and_a_heatmap_without_saturate_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let out = dir.path().join("out.tsv");
    let empty = write(
        dir.path(),
        "empty.vcf",
        b"##fileformat=VCFv4.2\n#CHROM\tPOS\n",
    );
    let (ok, _, err) = variants(&["--fasta", &fa, "--vcf", &arg(&empty), "--out", &arg(&out)]);
    assert!(
        !ok && err.contains("empty.vcf: no variants to score"),
        "{err}"
    );
    let one = write(dir.path(), "one.vcf", b"#header\ngene\t5\t.\tC\tT\n");
    let png = dir.path().join("h.png");
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&one),
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&png),
    ]);
    assert!(
        !ok && err.contains("--heatmap draws --saturate's variants"),
        "{err}"
    );
    assert!(!out.exists() && !png.exists(), "written before the refusal");
    // A region none of whose variants is scored (before the CDS): no blank map with a ±0
    // colour bar, but a warning; the table says why for each row.
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--cds",
        "4..90",
        "--saturate",
        "1..3",
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&png),
    ]);
    assert!(
        ok && err.contains("not drawn, none of the region's variants"),
        "{err}"
    );
    assert!(out.exists() && !png.exists());
    // A file already at --heatmap is not this run's map: the warning says it was left, and
    // the summary does not name it as written.
    std::fs::write(&png, b"OLD").unwrap();
    let model = arg(trained_tiny());
    let (ok, _, err) = run(&[
        "variants",
        "--model",
        &model,
        "--fasta",
        &fa,
        "--cds",
        "4..90",
        "--saturate",
        "1..3",
        "--out",
        &arg(&out),
        "--heatmap",
        &arg(&png),
    ]);
    assert!(
        ok && err.contains("not drawn, none of the region's variants was scored (the file")
            && err.contains("the file already there is left as it was"),
        "{err}"
    );
    assert!(!err.contains("heatmap: "), "{err}");
    assert_eq!(std::fs::read(&png).unwrap(), b"OLD");
}

/// A one-codon deletion in a 2-codon window leaves ALT 1 codon: nothing to predict, so it is not
/// scored, and the note says the window is why (it blamed the CDS), beside a variant that is
/// outside the CDS, counted on its own line.
#[test]
fn unscored_variants_are_counted_by_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fa = arg(&fasta(dir.path()));
    let vcf = write(
        dir.path(),
        "v.vcf",
        b"#CHROM\tPOS\tID\tREF\tALT\ngene\t48\tdel\tTAAA\tT\ngene\t2\tbefore\tT\tC\n",
    );
    let out = dir.path().join("out.tsv");
    let (ok, _, err) = variants(&[
        "--fasta",
        &fa,
        "--vcf",
        &arg(&vcf),
        "--out",
        &arg(&out),
        "--window",
        "2",
        "--cds",
        "4..90",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("1 variant(s) not scored: REF's or ALT's window holds fewer than 2 codons")
            && err.contains("a larger --window"),
        "{err}"
    );
    assert!(err.contains("1 variant(s) outside the CDS"), "{err}");
    assert!(!err.contains("incomplete last codon"), "{err}");
    let t = table(&out);
    let col = |name: &str| t[0].iter().position(|c| c == name).unwrap();
    let del = t.iter().find(|r| r[col("id")] == "del").unwrap();
    assert_eq!(del[col("delta_ll")], "NA", "{t:?}");
    assert_ne!(del[col("consequence")], "outside_cds", "{t:?}");
}
