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
}

/// The colours of the series (tests look for them in the picture).
pub const LOSS: RGBColor = RGBColor(31, 119, 180);
pub const VAL: RGBColor = RGBColor(255, 127, 14);
pub const LR: RGBColor = RGBColor(44, 160, 44);
pub const SPEED: RGBColor = RGBColor(148, 103, 189);
pub const MEMORY: RGBColor = RGBColor(214, 39, 40);

/// Reads the step rows of `path` (rows without a step, such as events, are skipped); a resumed
/// run's repeated steps keep their last row.
pub fn read_metrics(path: &Path) -> Result<Curves> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut rows: std::collections::BTreeMap<u64, serde_json::Value> = Default::default();
    // A live run appends its rows: a last line without its newline may be half written, and is
    // left for the next plot rather than refused.
    let last = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(_) if i + 1 == last && !text.ends_with('\n') => break,
            Err(e) => {
                return Err(Error::Invalid(format!(
                    "{}: line {}: not a JSON object ({e})",
                    path.display(),
                    i + 1
                )))
            }
        };
        if let Some(step) = v.get("step").and_then(|s| s.as_u64()) {
            rows.insert(step, v);
        }
    }
    let mut c = Curves::default();
    let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_f64());
    for (step, v) in &rows {
        let Some(loss) = num(v, "loss") else {
            continue;
        };
        c.steps.push(*step as f64);
        c.loss.push(loss);
        c.lr.push(num(v, "lr").unwrap_or(f64::NAN));
        c.tokens_per_s
            .push(num(v, "tokens_per_s").unwrap_or(f64::NAN));
        c.peak_mib.push(num(v, "peak_rss_mib").unwrap_or(f64::NAN));
        if let Some(val) = num(v, "val_loss") {
            c.val.push((*step as f64, val));
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
            .build_cartesian_2d(xr, yr)
            .map_err(|x| e(&x))?;
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
            .map(|(&x, &y)| (x, y))
            .collect();
        chart
            .draw_series(std::iter::once(PathElement::new(
                line,
                colour.stroke_width(2),
            )))
            .map_err(|x| e(&x))?;
        if !points.is_empty() {
            chart
                .draw_series(std::iter::once(PathElement::new(
                    points.to_vec(),
                    VAL.stroke_width(2),
                )))
                .map_err(|x| e(&x))?;
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 5, VAL.filled())))
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

#[cfg(test)]
mod tests {
    use super::*;

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
        std::fs::write(&p, "{\"event\":\"start\"}\n").unwrap();
        let e = read_metrics(&p).unwrap_err().to_string();
        assert!(e.contains("no training steps recorded yet"), "{e}");
    }
}
