//! `genslm plot`: a run's curves, each in its panel, from its metrics (and a hand-edited
//! metrics file named by line, not drawn in part), and embedding files that `genslm embed` did
//! not write: one dimension, a colour column of one huge value, a null inside a vector.

mod common;

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array, Float64Array, Int64Array};
use arrow_schema::{DataType, Field};
use common::{repo, run};

fn s(p: &Path) -> String {
    common::arg(p)
}

/// Counts of the curve colours in each quarter of a `plot --run` picture (top-left, top-right,
/// bottom-left, bottom-right).
fn colour_counts(png_path: &Path) -> Vec<[usize; 5]> {
    use genslm::curves::{LOSS, LR, MEMORY, SPEED, VAL};
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(png_path).unwrap(),
    ));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0u8; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    let (w, h) = (info.width as usize, info.height as usize);
    let colours = [LOSS, VAL, LR, SPEED, MEMORY].map(|c| [c.0, c.1, c.2]);
    let mut counts = vec![[0usize; 5]; 4];
    for y in 0..h {
        for x in 0..w {
            let p = &buf[(y * w + x) * 3..][..3];
            if let Some(k) = colours.iter().position(|c| c == p) {
                counts[usize::from(y >= h / 2) * 2 + usize::from(x >= w / 2)][k] += 1;
            }
        }
    }
    counts
}

/// `genslm plot --run`: each curve is drawn in its own panel from the run's metrics, the
/// validation points only where validation was measured; a directory that is not a run is a
/// clear error.
#[test]
fn plot_run_draws_each_curve_in_its_panel() {
    let dir = tempfile::tempdir().unwrap();
    // Neither input: the error names both (it named --embeddings only).
    let (ok, _, err) = run(&["plot", "--out", &s(&dir.path().join("none.png"))]);
    assert!(
        !ok && err.contains("--embeddings") && err.contains("--run"),
        "{err}"
    );
    let mut val_pixels = Vec::new();
    for (val_every, name) in [("2", "with_val"), ("0", "end_only")] {
        let out = dir.path().join(name);
        let (ok, _, err) = run(&[
            "train",
            "--fasta",
            &s(&repo().join("data")),
            "--config",
            &s(&repo().join("configs/tiny.toml")),
            "--out",
            &s(&out),
            "--steps",
            "6",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--val-every",
            val_every,
            "--quiet",
        ]);
        assert!(ok, "{err}");
        let png_path = dir.path().join(format!("{name}.png"));
        let (ok, _, err) = run(&["plot", "--run", &s(&out), "--out", &s(&png_path)]);
        assert!(ok, "{err}");
        assert!(err.contains("plotted 6 steps"), "{err}");
        let c = colour_counts(&png_path);
        // [loss, val, lr, tokens/s, memory] in [top-left, top-right, bottom-left, bottom-right]
        let (loss, val, lr, speed, mem) = (c[0][0], c[0][1], c[1][2], c[2][3], c[3][4]);
        assert!(loss > 100 && lr > 100 && speed > 100 && mem > 100, "{c:?}");
        // One circle (about 80 pixels) per validation row of the metrics, joined by a line.
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let val_rows = metrics
            .lines()
            .filter(|l| l.contains("\"val_loss\""))
            .count();
        assert!(val_rows >= 1, "{metrics}");
        assert!(val >= 60 * val_rows, "{val_rows} validation rows: {c:?}");
        val_pixels.push((val_rows, val));
        // Each curve only in its own panel.
        for (panel, counts) in c.iter().enumerate() {
            for (k, &n) in counts.iter().enumerate() {
                let home = match k {
                    0 | 1 => 0,
                    k => k - 1,
                };
                assert!(
                    panel == home || n == 0,
                    "colour {k} in panel {panel}: {c:?}"
                );
            }
        }
    }
    // Values near f64's limits (a hand-made metrics file): the axis's span overflowed to
    // infinity and the plot never finished.
    let run_dir = dir.path().join("end_only");
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    let mut huge = String::new();
    for (i, line) in metrics.lines().enumerate() {
        let mut m: serde_json::Value = serde_json::from_str(line).unwrap();
        m["loss"] = serde_json::json!(if i % 2 == 0 { 1e308 } else { -1e308 });
        huge.push_str(&format!("{m}\n"));
    }
    std::fs::write(run_dir.join("metrics.jsonl"), &huge).unwrap();
    let png = dir.path().join("huge.png");
    let (ok, _, err) = run(&["plot", "--run", &s(&run_dir), "--out", &s(&png)]);
    assert!(ok && png.is_file(), "{err}");
    // Every value past the axis's bound on one side: its ends crossed and drawing panicked.
    std::fs::write(
        run_dir.join("metrics.jsonl"),
        "{\"step\":1,\"loss\":-1e308}\n",
    )
    .unwrap();
    let (ok, _, err) = run(&["plot", "--run", &s(&run_dir), "--out", &s(&png)]);
    assert!(ok && png.is_file(), "{err}");
    let (ok, _, err) = run(&[
        "plot",
        "--run",
        &s(dir.path()),
        "--out",
        &s(&dir.path().join("x.png")),
    ]);
    assert!(!ok && err.contains("metrics.jsonl: missing; is"), "{err}");
}

/// An embeddings file of `rows` vectors of `dim` (element `null` left null, if given) and a
/// colour column `c`.
/// Steps skipped for a non-finite loss stay on the learning-rate, speed and memory curves and
/// are counted; a lone loss value is drawn as a dot. A run of 6 steps, 5 skipped, was "plotted
/// 1 step" with four empty panels.
#[test]
fn skipped_steps_stay_on_the_other_curves() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let mut rows = String::from(
        "{\"step\":1,\"loss\":4.2,\"lr\":0.001,\"tokens_per_s\":900,\"peak_rss_mib\":300}\n",
    );
    for step in 2..=6 {
        rows.push_str(&format!(
            "{{\"step\":{step},\"loss\":null,\"lr\":{},\"tokens_per_s\":{},\
             \"peak_rss_mib\":{},\"skipped_nonfinite\":true}}\n",
            0.001 / step as f64,
            900 + 10 * step,
            300 + step
        ));
    }
    std::fs::write(run_dir.join("metrics.jsonl"), rows).unwrap();
    let png_path = dir.path().join("run.png");
    let (ok, _, err) = run(&["plot", "--run", &s(&run_dir), "--out", &s(&png_path)]);
    assert!(
        ok && err.contains(
            "plotted 6 steps (0 validation points, 5 steps skipped: non-finite or overflowing loss or gradient)"
        ),
        "{err}"
    );
    let c = colour_counts(&png_path);
    let (loss, lr, speed, mem) = (c[0][0], c[1][2], c[2][3], c[3][4]);
    assert!(loss > 20, "the lone loss value is not drawn: {c:?}");
    assert!(lr > 100 && speed > 100 && mem > 100, "{c:?}");
}

fn embeddings_file(path: &Path, dim: usize, rows: usize, null: Option<usize>, c: ArrayRef) {
    let values: Float32Array = (0..rows * dim)
        .map(|i| (Some(i) != null).then(|| ((i * 37 % 11) as f32).sin()))
        .collect();
    let item = Arc::new(Field::new("item", DataType::Float32, true));
    let emb = FixedSizeListArray::new(item, dim as i32, Arc::new(values), None);
    let batch = arrow_array::RecordBatch::try_from_iter([
        ("embedding", Arc::new(emb) as ArrayRef),
        ("c", c),
    ])
    .unwrap();
    let f = std::fs::File::create(path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(f, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// Files `genslm embed` did not write are plotted where they mean something and refused where
/// they do not: a 1-dimensional embedding panicked (index out of bounds), a colour column
/// whose one value is too large for ±0.5 to change it panicked in the colormap (0/0), and a
/// null inside a vector was projected as 0.
#[test]
fn hand_made_embedding_files_are_plotted_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plot = |name: &str| {
        let png = dir.path().join(format!("{name}.png"));
        let (ok, _, err) = run(&[
            "plot",
            "--embeddings",
            &s(&dir.path().join(format!("{name}.parquet"))),
            "--out",
            &s(&png),
            "--color",
            "c",
        ]);
        (ok && png.is_file(), err)
    };
    let varying: ArrayRef = Arc::new(Float64Array::from_iter_values((0..20).map(f64::from)));
    embeddings_file(
        &dir.path().join("dim1.parquet"),
        1,
        20,
        None,
        varying.clone(),
    );
    let (ok, err) = plot("dim1");
    assert!(ok && err.contains("PC2 0.0%"), "{err}");
    for (name, c) in [
        (
            "huge",
            Arc::new(Float64Array::from(vec![1.8e19; 20])) as ArrayRef,
        ),
        ("largest", Arc::new(Float64Array::from(vec![1e300; 20]))),
        ("i64max", Arc::new(Int64Array::from(vec![i64::MAX; 20]))),
    ] {
        embeddings_file(&dir.path().join(format!("{name}.parquet")), 4, 20, None, c);
        let (ok, err) = plot(name);
        assert!(ok, "{name}: {err}");
    }
    // Text as polars and newer pyarrow write it (Utf8View), with nulls: plotted, the nulls
    // grey outside the legend (the column was refused as "not numeric or string").
    let view: ArrayRef = Arc::new(arrow_array::StringViewArray::from_iter(
        (0..20).map(|i| (i % 2 == 0).then_some(if i < 10 { "a" } else { "b" })),
    ));
    embeddings_file(&dir.path().join("view.parquet"), 4, 20, None, view);
    let (ok, err) = plot("view");
    assert!(ok, "{err}");
    embeddings_file(
        &dir.path().join("null.parquet"),
        4,
        20,
        Some(4 * 7 + 2),
        varying,
    );
    let (ok, err) = plot("null");
    assert!(
        !ok && err.contains("row 7 holds a null at element 2"),
        "{err}"
    );
}

/// A loss spike of one step among 2,000 is drawn: the wide stroke's polygons came out empty
/// where the path turned straight back, and the spike to 10 left the panel's top empty (counted
/// in loss-coloured pixels of the top-left quarter, spike against none).
#[test]
fn a_one_step_spike_is_drawn() {
    let dir = tempfile::tempdir().unwrap();
    let mut counts = vec![];
    for spike in [None, Some(1000)] {
        let run_dir = dir.path().join(format!("r{spike:?}"));
        std::fs::create_dir(&run_dir).unwrap();
        let lines: String = (1..=2000)
            .map(|s| {
                let loss = if Some(s) == spike { 10.0 } else { 2.0 };
                format!("{{\"step\":{s},\"loss\":{loss},\"lr\":0.001}}\n")
            })
            .collect();
        std::fs::write(run_dir.join("metrics.jsonl"), lines).unwrap();
        let png = dir.path().join(format!("{spike:?}.png"));
        let (ok, _, err) = run(&["plot", "--run", &s(&run_dir), "--out", &s(&png)]);
        assert!(ok, "{err}");
        counts.push(colour_counts(&png)[0][0]);
    }
    assert!(
        counts[1] >= counts[0] + 100,
        "loss pixels without and with the spike: {counts:?}"
    );
}

/// `--color` colours embeddings only: with `--run` it is refused (it was ignored).
#[test]
fn color_with_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("c.png");
    let (ok, _, err) = run(&[
        "plot",
        "--run",
        dir.path().to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
        "--color",
        "loss",
    ]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}
