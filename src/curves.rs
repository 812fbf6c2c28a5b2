//! `genslm plot --run RUN`: a run's curves from its `metrics.jsonl`, one PNG of four panels —
//! training and validation loss, learning rate, tokens/s and peak memory over steps — because
//! people look at curves, not JSON. Drawn with the same code as the latent-space picture.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::plot::{range, render_png, tick_format, FONT};

/// Per-step values of a run (NaN where a row lacks the field).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Curves {
    pub steps: Vec<f64>,
    pub loss: Vec<f64>,
    pub lr: Vec<f64>,
    pub tokens_per_s: Vec<f64>,
    pub peak_mib: Vec<f64>,
    /// (step, validation loss) where one was measured.
    pub val: Vec<(f64, f64)>,
    /// Steps skipped for a non-finite loss (`--skip-nonfinite`): on every curve but the loss.
    pub skipped: usize,
}

/// The colours of the series (tests look for them in the picture).
pub const LOSS: RGBColor = RGBColor(31, 119, 180);
pub const VAL: RGBColor = RGBColor(255, 127, 14);
pub const LR: RGBColor = RGBColor(44, 160, 44);
pub const SPEED: RGBColor = RGBColor(148, 103, 189);
pub const MEMORY: RGBColor = RGBColor(214, 39, 40);

/// One row's fields that the curves use; the rest of the row is skipped unread (serde ignores
/// unknown fields without building them), so memory follows the steps, not the file.
#[derive(serde::Deserialize)]
struct Row {
    step: Option<serde_json::Value>,
    /// `Some(Null)` where the row says `"loss": null` (a skipped non-finite step), `None` where
    /// it has no loss at all.
    #[serde(default, deserialize_with = "present")]
    loss: Option<serde_json::Value>,
    lr: Option<serde_json::Value>,
    tokens_per_s: Option<serde_json::Value>,
    peak_rss_mib: Option<serde_json::Value>,
    val_loss: Option<serde_json::Value>,
    /// The step's update was skipped (its loss may be finite: a non-finite gradient).
    skipped_nonfinite: Option<serde_json::Value>,
}

/// A field that is in the row, null or not.
fn present<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<serde_json::Value>, D::Error> {
    <serde_json::Value as serde::Deserialize>::deserialize(d).map(Some)
}

/// What a step keeps: [loss, lr, tokens/s, peak MiB, validation loss] (NaN where absent),
/// and whether its update was skipped.
type Kept = ([f64; 5], bool);

/// No metrics row comes near this; a longer line is not one (and is not read whole).
const MAX_LINE: u64 = 1 << 20;

/// Reads the step rows of `path` (rows without a step, such as events, are skipped); a resumed
/// run's repeated steps keep their last row. Streamed line by line: a long run's file is read
/// in memory proportional to its steps (reading it whole into JSON values took 6.6× its size).
pub fn read_metrics(path: &Path) -> Result<Curves> {
    use std::io::{BufRead, Read};
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 16, file);
    let mut rows: std::collections::BTreeMap<u64, Kept> = Default::default();
    let mut line = Vec::new();
    for n in 1.. {
        line.clear();
        let got = (&mut reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| Error::io(path, e))?;
        if got == 0 {
            break;
        }
        let complete = line.last() == Some(&b'\n');
        if !complete && got as u64 > MAX_LINE {
            return Err(Error::Invalid(format!(
                "{}: line {n} is longer than {} KiB: not a metrics row",
                path.display(),
                MAX_LINE >> 10
            )));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // An object, not an array that serde would read into the fields by position.
        let object = line.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
        let row: Row = match serde_json::from_slice(&line)
            .map_err(|e| e.to_string())
            .and_then(|r| {
                if object {
                    Ok(r)
                } else {
                    Err("not an object".into())
                }
            }) {
            Ok(r) => r,
            // A live run appends its rows: a last line without its newline may be half
            // written, and is left for the next plot rather than refused.
            Err(_) if !complete => break,
            Err(e) => {
                // serde's words name our own struct ("struct Row with 6 elements"): kept to
                // their first clause.
                let e = e.to_string();
                let why = e.split(", expected").next().unwrap_or(&e);
                return Err(Error::Invalid(format!(
                    "{}: line {n}: not a JSON object of a metrics row ({why})",
                    path.display()
                )));
            }
        };
        // A row genslm did not write is named, not left out of the picture: a step that is no
        // step number (-5, 2.5, "2") or a value that is no number vanished without a word.
        let bad = |what: String| Error::Invalid(format!("{}: line {n}: {what}", path.display()));
        let Some(step) = &row.step else {
            // Rows without a step (events) carry no curve; one with a loss was meant to.
            if row.loss.is_some() {
                return Err(bad("a `loss` without a `step`".into()));
            }
            continue;
        };
        let step = step
            .as_u64()
            .ok_or_else(|| bad(format!("`step` is {step}, not a step number (0, 1, 2, …)")))?;
        if row.loss.is_none() {
            return Err(bad(format!(
                "step {step} has no `loss` (null where it was not finite)"
            )));
        }
        let num = |name: &str, v: &Option<serde_json::Value>| match v {
            None | Some(serde_json::Value::Null) => Ok(f64::NAN),
            Some(x) => x
                .as_f64()
                .ok_or_else(|| bad(format!("`{name}` is {x}, not a number"))),
        };
        let skipped = match &row.skipped_nonfinite {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(x) => {
                return Err(bad(format!(
                    "`skipped_nonfinite` is {x}, not true or false"
                )))
            }
        };
        rows.insert(
            step,
            (
                [
                    num("loss", &row.loss)?,
                    num("lr", &row.lr)?,
                    num("tokens_per_s", &row.tokens_per_s)?,
                    num("peak_rss_mib", &row.peak_rss_mib)?,
                    num("val_loss", &row.val_loss)?,
                ],
                skipped,
            ),
        );
    }
    let mut c = Curves::default();
    for (step, ([loss, lr, speed, peak, val], skipped)) in rows {
        // A skipped step has no loss (or one whose gradient was not finite), and its learning
        // rate, speed and memory still count (they were dropped with it: a run of 6 steps, 5
        // skipped, plotted "1 step").
        c.skipped += usize::from(loss.is_nan() || skipped);
        c.steps.push(step as f64);
        c.loss.push(loss);
        c.lr.push(lr);
        c.tokens_per_s.push(speed);
        c.peak_mib.push(peak);
        if !val.is_nan() {
            c.val.push((step as f64, val));
        }
    }
    if c.steps.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no training steps recorded yet",
            path.display()
        )));
    }
    Ok(c)
}

/// Draws the curves of the run in `run` into the PNG `out`; returns them.
pub fn plot_run(run: &Path, out: &Path, title: Option<&str>) -> Result<Curves> {
    let metrics = run.join("metrics.jsonl");
    // The metrics file itself given: its directory is the run.
    if run.is_file() {
        return Err(Error::Invalid(format!(
            "--run {}: a file; give the run directory that holds it ({})",
            run.display(),
            crate::run_lock::parent_dir(run).display()
        )));
    }
    if !metrics.is_file() {
        return Err(Error::Invalid(format!(
            "{}: {}; is {} a run directory (train --out)?",
            metrics.display(),
            crate::error::not_a_file(&metrics),
            run.display()
        )));
    }
    let c = read_metrics(&metrics)?;
    let title = title.map(str::to_string).unwrap_or_else(|| {
        format!(
            "{}: {} steps",
            run.file_name().unwrap_or(run.as_os_str()).to_string_lossy(),
            c.steps.len()
        )
    });
    render_png(out, (1400, 950), |root| draw(root, &c, &title))?;
    Ok(c)
}

fn draw(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    c: &Curves,
    title: &str,
) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let body = root
        .titled(title, (FONT, 28).into_font().style(FontStyle::Bold))
        .map_err(|x| e(&x))?;
    let panels = body.split_evenly((2, 2));
    let loss_and_val: Vec<f64> = c
        .loss
        .iter()
        .copied()
        .chain(c.val.iter().map(|v| v.1))
        .collect();
    let panel = |area: &DrawingArea<BitMapBackend<'_>, Shift>,
                 name: &str,
                 ys: &[f64],
                 all_y: &[f64],
                 colour: RGBColor,
                 points: &[(f64, f64)]| {
        if all_y.iter().all(|y| !y.is_finite()) {
            return area
                .draw(&Text::new(
                    format!("{name}: not recorded"),
                    (30, 40),
                    (FONT, 20),
                ))
                .map_err(|x| e(&x));
        }
        let xr = range(c.steps.iter().copied());
        let yr = range(all_y.iter().copied().filter(|y| y.is_finite()));
        let (xf, yf) = (
            tick_format(xr.end - xr.start),
            tick_format(yr.end - yr.start),
        );
        let mut chart = ChartBuilder::on(area)
            .caption(name, (FONT, 20))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(xr, yr.clone())
            .map_err(|x| e(&x))?;
        // Values past the axis (which `range` bounds) are drawn at its edge: a point at 1e308
        // mapped to a pixel beyond i32.
        let clip = |&(x, y): &(f64, f64)| (x, y.clamp(yr.start, yr.end));
        chart
            .configure_mesh()
            .x_label_formatter(&xf)
            .y_label_formatter(&yf)
            .x_desc("step")
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 16))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(|x| e(&x))?;
        let line: Vec<(f64, f64)> = c
            .steps
            .iter()
            .zip(ys)
            .filter(|(_, y)| y.is_finite())
            .map(|(&x, &y)| clip(&(x, y)))
            .collect();
        // A panel is ~650 pixels wide: a noisy curve of 500k steps took 30 s to stroke.
        let line = envelope(line, 1024);
        // A lone value is no line: drawn as a dot (one step's curves were empty panels).
        if let [only] = line[..] {
            chart
                .draw_series(std::iter::once(Circle::new(only, 4, colour.filled())))
                .map_err(|x| e(&x))?;
        }
        // A path stroked 2 pixels wide, and 1 pixel wide over it: the wide stroke is drawn as
        // polygons, which come out empty where the path turns back on itself, so a one-step
        // spike (up and straight down) was not drawn at all.
        let strokes = |path: &[(f64, f64)], colour: RGBColor| {
            [2, 1].map(|width| PathElement::new(path.to_vec(), colour.stroke_width(width)))
        };
        chart
            .draw_series(strokes(&line, colour))
            .map_err(|x| e(&x))?;
        if !points.is_empty() {
            // Validation every step of a long run: a marker per point took most of the time.
            let points = envelope(points.iter().map(clip).collect(), 1024);
            chart
                .draw_series(strokes(&points, VAL))
                .map_err(|x| e(&x))?;
            chart
                .draw_series(points.into_iter().map(|p| Circle::new(p, 5, VAL.filled())))
                .map_err(|x| e(&x))?;
        }
        Ok(())
    };
    let val_name = if c.val.is_empty() {
        "loss (no validation recorded)"
    } else {
        "loss (blue: training, orange: validation)"
    };
    panel(&panels[0], val_name, &c.loss, &loss_and_val, LOSS, &c.val)?;
    panel(&panels[1], "learning rate", &c.lr, &c.lr, LR, &[])?;
    panel(
        &panels[2],
        "tokens/s",
        &c.tokens_per_s,
        &c.tokens_per_s,
        SPEED,
        &[],
    )?;
    panel(
        &panels[3],
        "peak memory (MiB, resident)",
        &c.peak_mib,
        &c.peak_mib,
        MEMORY,
        &[],
    )?;
    Ok(())
}

/// `line` with at most four points per `buckets`-th of its x span: of each run of consecutive
/// points in one bucket, the first, the lowest, the highest and the last, in their order. The
/// drawn curve keeps its every peak and trough at a pixel's width, where a stride would drop
/// spikes (a loss spike is what one looks for).
fn envelope(line: Vec<(f64, f64)>, buckets: usize) -> Vec<(f64, f64)> {
    if line.len() <= 4 * buckets {
        return line;
    }
    let (lo, hi) = line
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.0), b.max(p.0))
        });
    let width = (hi - lo) / buckets as f64;
    let bucket = |x: f64| match width > 0.0 {
        true => (((x - lo) / width) as usize).min(buckets - 1),
        false => 0,
    };
    let mut out = Vec::with_capacity(4 * buckets);
    let mut i = 0;
    while i < line.len() {
        let b = bucket(line[i].0);
        let end = i + line[i..].iter().take_while(|p| bucket(p.0) == b).count();
        let run = &line[i..end];
        let by_y = |a: &&(f64, f64), c: &&(f64, f64)| a.1.total_cmp(&c.1);
        let low = run
            .iter()
            .enumerate()
            .min_by(|a, c| by_y(&a.1, &c.1))
            .map(|m| m.0);
        let high = run
            .iter()
            .enumerate()
            .max_by(|a, c| by_y(&a.1, &c.1))
            .map(|m| m.0);
        let mut keep = [Some(0), low, high, Some(run.len() - 1)];
        keep.sort();
        let mut last = None;
        for k in keep.into_iter().flatten() {
            if last != Some(k) {
                out.push(run[k]);
                last = Some(k);
            }
        }
        i = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The envelope of a noisy curve of 200k steps keeps at most four points per bucket, its
    /// first and last point, and, in every bucket, the lowest and highest value there (checked
    /// against a plain scan of the bucket's x range).
    #[test]
    fn the_envelope_keeps_every_buckets_extremes() {
        let mut rng = crate::rng::SplitMix64::new(5);
        let line: Vec<(f64, f64)> = (0..200_000)
            .map(|i| {
                (
                    i as f64,
                    (rng.below(1000) as f64) - if i == 123_457 { 1e6 } else { 0.0 },
                )
            })
            .collect();
        let buckets = 100;
        let env = envelope(line.clone(), buckets);
        assert!(env.len() <= 4 * buckets, "{}", env.len());
        assert_eq!(
            (env[0], env[env.len() - 1]),
            (line[0], line[line.len() - 1])
        );
        assert!(env.windows(2).all(|w| w[0].0 < w[1].0), "in order");
        let width = 200_000.0 / buckets as f64;
        for b in 0..buckets {
            let inside = |p: &&(f64, f64)| ((p.0 / width) as usize).min(buckets - 1) == b;
            let extremes = |v: Vec<&(f64, f64)>| {
                let ys: Vec<f64> = v.iter().map(|p| p.1).collect();
                (
                    ys.iter().cloned().fold(f64::INFINITY, f64::min),
                    ys.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                )
            };
            let want = extremes(line.iter().filter(inside).collect());
            let got = extremes(env.iter().filter(inside).collect());
            assert_eq!(got, want, "bucket {b}");
        }
        // Short curves are drawn as they are.
        assert_eq!(envelope(line[..400].to_vec(), 100), line[..400]);
    }

    #[test]
    fn rows_are_read_by_step_with_the_last_of_a_repeated_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(
            &p,
            "{\"event\":\"start\"}\n\
             {\"step\":2,\"loss\":3.0,\"lr\":0.1}\n\
             {\"step\":1,\"loss\":4.0,\"lr\":0.2,\"val_loss\":4.5,\"peak_rss_mib\":10}\n\
             \n\
             {\"step\":2,\"loss\":2.5,\"lr\":0.1,\"tokens_per_s\":7}\n",
        )
        .unwrap();
        let c = read_metrics(&p).unwrap();
        assert_eq!(c.steps, [1.0, 2.0]);
        assert_eq!(c.loss, [4.0, 2.5]);
        assert_eq!(c.val, [(1.0, 4.5)]);
        assert!(c.tokens_per_s[0].is_nan() && c.tokens_per_s[1] == 7.0);
        assert!(c.peak_mib[0] == 10.0 && c.peak_mib[1].is_nan());
        std::fs::write(&p, "{\"step\":1,\"loss\":1}\nnot json\n").unwrap();
        let e = read_metrics(&p).unwrap_err().to_string();
        assert!(e.contains("line 2: not a JSON object"), "{e}");
        // A live run's half-written last row is left out; the same row complete is refused.
        std::fs::write(&p, "{\"step\":1,\"loss\":1}\n{\"step\":2,\"lo").unwrap();
        assert_eq!(read_metrics(&p).unwrap().steps, [1.0]);
        std::fs::write(&p, "{\"step\":1,\"loss\":1}\n{\"step\":2,\"lo\n").unwrap();
        assert!(read_metrics(&p).is_err());
        // A line no metrics row could be is refused by its number, not read whole.
        let mut long = b"{\"step\":1,\"loss\":1}\n{\"note\":\"".to_vec();
        long.extend(std::iter::repeat_n(b'x', 3 << 20));
        long.extend(b"\"}\n");
        std::fs::write(&p, &long).unwrap();
        let e = read_metrics(&p).unwrap_err().to_string();
        assert!(e.contains("line 2 is longer than 1024 KiB"), "{e}");
        // Each field of each row is read: a row whose loss is not a number is not a step.
        std::fs::write(
            &p,
            "{\"step\":1,\"loss\":null}\n{\"step\":3,\"loss\":0.5,\"extra\":[1,{\"a\":2}]}\n",
        )
        .unwrap();
        // A skipped step (null loss) keeps its place on the other curves, and is counted.
        let c = read_metrics(&p).unwrap();
        assert_eq!((c.steps, c.skipped), (vec![1.0, 3.0], 1));
        // A skipped update with a finite loss (a non-finite gradient) counts too.
        std::fs::write(
            &p,
            "{\"step\":1,\"loss\":2.0,\"skipped_nonfinite\":true}\n{\"step\":2,\"loss\":1.5}\n",
        )
        .unwrap();
        assert_eq!(read_metrics(&p).unwrap().skipped, 1);
        assert!(c.loss[0].is_nan() && c.loss[1] == 0.5);
        std::fs::write(&p, "{\"step\":1,\"loss\":1}\n[2, 0.5, 0.1, 9, 9, 9]\n").unwrap();
        let e = read_metrics(&p).unwrap_err().to_string();
        assert!(e.contains("line 2: not a JSON object"), "{e}");
        assert!(!e.contains("struct"), "serde's name of our own type: {e}");
        // The metrics file given as the run: its directory is named.
        let e = plot_run(&p, &dir.path().join("c.png"), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a file; give the run directory that holds it"),
            "{e}"
        );
        std::fs::write(&p, "{\"event\":\"start\"}\n").unwrap();
        let e = read_metrics(&p).unwrap_err().to_string();
        assert!(e.contains("no training steps recorded yet"), "{e}");
        // Rows genslm did not write are named by line, not left out of the curves.
        for (row, says) in [
            (
                "{\"step\":-5,\"loss\":1}",
                "`step` is -5, not a step number",
            ),
            (
                "{\"step\":2.5,\"loss\":1}",
                "`step` is 2.5, not a step number",
            ),
            (
                "{\"step\":\"2\",\"loss\":1}",
                "`step` is \"2\", not a step number",
            ),
            ("{\"step\":1e30,\"loss\":1}", "not a step number"),
            (
                "{\"step\":2,\"loss\":\"abc\"}",
                "`loss` is \"abc\", not a number",
            ),
            (
                "{\"step\":2,\"loss\":1,\"lr\":[1]}",
                "`lr` is [1], not a number",
            ),
            ("{\"step\":2}", "step 2 has no `loss`"),
            ("{\"loss\":3.0}", "a `loss` without a `step`"),
        ] {
            std::fs::write(&p, format!("{{\"step\":1,\"loss\":1}}\n{row}\n")).unwrap();
            let e = read_metrics(&p).unwrap_err().to_string();
            assert!(e.contains("line 2: ") && e.contains(says), "{row}: {e}");
        }
    }
}
