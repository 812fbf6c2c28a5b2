//! PNG pictures: the latent space of an embeddings file as a PCA scatter plot.
//!
//! Drawn with plotters into memory and encoded with `png`; text uses DejaVu Sans embedded in the
//! binary (the `dejavu` crate) through plotters' `ab_glyph` backend, so no system font (nor
//! fontconfig) is needed. Numeric colour columns get the viridis map and a colour bar; string
//! columns get one colour per category and a legend.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::colors::colormaps::ViridisRGB;

use crate::error::{Error, Result};
use crate::infer::embed_io::{read_embeddings, ColumnValues};
use crate::pca::pca;

/// What to draw.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotOptions {
    /// Column that colours the points (numeric: colour bar; string: legend).
    pub color: String,
    /// Title (default: names the file, the records and the layer).
    pub title: Option<String>,
    pub width: u32,
    pub height: u32,
}

impl Default for PlotOptions {
    fn default() -> Self {
        Self {
            color: "gc_content".into(),
            title: None,
            width: 1100,
            height: 800,
        }
    }
}

/// What was drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotSummary {
    pub points: usize,
    /// Share of variance along PC1 and PC2.
    pub ratios: [f64; 2],
}

pub(crate) const FONT: &str = "sans-serif";
/// At most this many categories get their own colour; the rest are grey.
const MAX_CATEGORIES: usize = 12;

/// Registers the embedded DejaVu Sans under the family name plotters asks for.
fn register_fonts() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
            && plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(
            "the embedded DejaVu Sans font failed to load".into(),
        ))
    }
}

fn draw_err(out: &Path) -> impl Fn(String) -> Error + '_ {
    move |e| Error::Invalid(format!("{}: drawing the plot failed: {e}", out.display()))
}

/// Padded axis range covering `v`.
pub(crate) fn range(v: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return -1.0..1.0;
    }
    // Bounded so that the span and its padding stay finite: values near f64's limits (a
    // hand-made metrics file with a loss of 1e308) made the axis infinite, and the plotting
    // library's tick loop never ended. Points past the bound are drawn clipped.
    // Both ends clamped: bounding only lo from below and hi from above left a series wholly past
    // the bound (every loss -1e308) with lo > hi, and drawing it panicked.
    let (lo, hi) = (
        lo.clamp(-AXIS_LIMIT, AXIS_LIMIT),
        hi.clamp(-AXIS_LIMIT, AXIS_LIMIT),
    );
    // A constant series (a fixed learning rate of 1e-3) is centred in a tenth of its value
    // either way, not in ±1 where it read as 0.
    let pad = if hi > lo {
        0.06 * (hi - lo)
    } else if lo != 0.0 {
        0.1 * lo.abs()
    } else {
        1.0
    };
    lo - pad..hi + pad
}

/// The largest magnitude an axis or a colour scale spans.
const AXIS_LIMIT: f64 = 1e300;

/// Reads `embeddings`, projects them on their first two principal components and writes a
/// scatter plot coloured by `opts.color` to `out` (PNG, atomically).
pub fn plot_embeddings(embeddings: &Path, out: &Path, opts: &PlotOptions) -> Result<PlotSummary> {
    let table = read_embeddings(embeddings, &opts.color)?;
    if table.n < 2 {
        return Err(Error::Invalid(format!(
            "{}: {} record(s); a projection needs at least 2",
            embeddings.display(),
            table.n
        )));
    }
    // Named by file and row (PCA's own message named neither, and counted rows from 0).
    if let Some(i) = table.values.iter().position(|v| !v.is_finite()) {
        return Err(Error::Invalid(format!(
            "{}: the embedding of row {} (of {}, counted from 1) holds a non-finite value at \
             element {}: embeddings of a model whose weights are broken?",
            embeddings.display(),
            i / table.dim + 1,
            table.n,
            i % table.dim
        )));
    }
    let p = pca(&table.values, table.n, table.dim, 2)?;
    // One score per component and row: a 1-dimensional embedding has one component, and its
    // points lie on PC1 (PC2 is 0, 0% of the variance).
    let k = p.components.len();
    let points: Vec<(f64, f64)> = (0..table.n)
        .map(|i| {
            let row = &p.scores[k * i..k * (i + 1)];
            (row[0], row.get(1).copied().unwrap_or(0.0))
        })
        .collect();
    let ratios = [
        p.ratio(0),
        if p.components.len() > 1 {
            p.ratio(1)
        } else {
            0.0
        },
    ];
    let name = embeddings
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let title = opts.title.clone().unwrap_or_else(|| {
        format!(
            "Latent space of {name}: PCA of {} records{}",
            table.n,
            table
                .layer
                .map(|l| format!(", layer {l}"))
                .unwrap_or_default()
        )
    });
    let labels = [
        format!("PC1 ({:.1}% of variance)", 100.0 * ratios[0]),
        format!("PC2 ({:.1}% of variance)", 100.0 * ratios[1]),
    ];
    scatter_png(
        out,
        &points,
        &table.color,
        &opts.color,
        &title,
        &labels,
        (opts.width, opts.height),
    )?;
    Ok(PlotSummary {
        points: table.n,
        ratios,
    })
}

/// Draws `points` coloured by `color` (named `color_name`) into the PNG `out`.
pub fn scatter_png(
    out: &Path,
    points: &[(f64, f64)],
    color: &ColumnValues,
    color_name: &str,
    title: &str,
    axis_labels: &[String; 2],
    (w, h): (u32, u32),
) -> Result<()> {
    render_png(out, (w, h), |root| {
        draw(root, points, color, color_name, title, axis_labels)
    })
}

/// Draws with `paint` on a white `w`×`h` canvas and writes it to `out` as PNG, atomically.
pub(crate) fn render_png(
    out: &Path,
    (w, h): (u32, u32),
    paint: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> std::result::Result<(), String>,
) -> Result<()> {
    register_fonts()?;
    let mut buf = vec![255u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        paint(&root).map_err(draw_err(out))?;
        root.present().map_err(|e| draw_err(out)(e.to_string()))?;
    }
    let mut png_bytes = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut png_bytes, w, h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc
            .write_header()
            .map_err(|e| draw_err(out)(e.to_string()))?;
        wr.write_image_data(&buf)
            .map_err(|e| draw_err(out)(e.to_string()))?;
    }
    crate::atomic::write_bytes(out, &png_bytes)
}

fn draw(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    points: &[(f64, f64)],
    color: &ColumnValues,
    color_name: &str,
    title: &str,
    axis_labels: &[String; 2],
) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (w, _) = root.dim_in_pixel();
    let side_width = match color {
        ColumnValues::Numeric(_) => 170,
        ColumnValues::Categorical(_) => 300,
    };
    let (main, side) = root.split_horizontally(w.saturating_sub(side_width));
    let radius = match points.len() {
        0..=200 => 6,
        201..=2000 => 4,
        _ => 2,
    };
    // Inside the bound `range` puts on an axis, so that every point maps to a pixel.
    let bound = |v: f64| v.clamp(-AXIS_LIMIT, AXIS_LIMIT);
    let points: Vec<(f64, f64)> = points.iter().map(|&(x, y)| (bound(x), bound(y))).collect();
    let (xr, yr) = (
        range(points.iter().map(|p| p.0)),
        range(points.iter().map(|p| p.1)),
    );
    let (xf, yf) = (
        tick_format(xr.end - xr.start),
        tick_format(yr.end - yr.start),
    );
    let mut chart = ChartBuilder::on(&main)
        .caption(title, (FONT, 26).into_font().style(FontStyle::Bold))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(80)
        .build_cartesian_2d(xr, yr)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_label_formatter(&xf)
        .y_label_formatter(&yf)
        .x_desc(axis_labels[0].as_str())
        .y_desc(axis_labels[1].as_str())
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 20))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|x| e(&x))?;
    match color {
        ColumnValues::Numeric(vals) => {
            let r = finite_range(vals);
            let style = |v: f64| -> RGBColor {
                let t = (v - r.0) / (r.1 - r.0);
                if t.is_finite() {
                    ViridisRGB.get_color(t.clamp(0.0, 1.0) as f32)
                } else {
                    RGBColor(160, 160, 160)
                }
            };
            chart
                .draw_series(
                    points
                        .iter()
                        .zip(vals)
                        .map(|(&p, &v)| Circle::new(p, radius, style(v).mix(0.85).filled())),
                )
                .map_err(|x| e(&x))?;
            colour_bar(&side, r, color_name)?;
        }
        ColumnValues::Categorical(cats) => {
            let mut counts: std::collections::HashMap<&str, usize> = Default::default();
            // Grown fallibly: ten million distinct ids (`--color id`) aborted the process when
            // the table's doubling did not fit.
            let oom = |_| format!("{} rows' colours do not fit in memory", cats.len());
            // Nulls are no category: grey, outside the legend.
            for c in cats.iter().flatten() {
                if !counts.contains_key(c.as_str()) {
                    counts.try_reserve(1).map_err(oom)?;
                }
                *counts.entry(c.as_str()).or_default() += 1;
            }
            let mut names: Vec<(&str, usize)> = counts.into_iter().collect();
            names.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            let shown = names.len().min(MAX_CATEGORIES);
            let grey = RGBColor(160, 160, 160);
            let colour_of = |c: Option<&str>| -> RGBColor {
                let Some(c) = c else { return grey };
                match names[..shown].iter().position(|(n, _)| *n == c) {
                    Some(k) => {
                        let p = Palette99::pick(k).to_rgba();
                        RGBColor(p.0, p.1, p.2)
                    }
                    None => grey,
                }
            };
            // Grey ("other") points first, so the named categories stay visible on top.
            let mut order: Vec<(bool, (f64, f64), RGBColor)> = Vec::new();
            order.try_reserve_exact(points.len()).map_err(oom)?;
            order.extend(points.iter().zip(cats).map(|(&p, c)| {
                let col = colour_of(c.as_deref());
                (col != grey, p, col)
            }));
            order.sort_by_key(|o| o.0);
            chart
                .draw_series(
                    order
                        .into_iter()
                        .map(|(_, p, col)| Circle::new(p, radius, col.mix(0.85).filled())),
                )
                .map_err(|x| e(&x))?;
            let mut entries: Vec<(String, RGBColor)> = names[..shown]
                .iter()
                .map(|(n, k)| (format!("{} ({k})", short(n)), colour_of(Some(n))))
                .collect();
            if names.len() > shown {
                entries.push((format!("{} other values", names.len() - shown), grey));
            }
            legend(&side, color_name, &entries)?;
        }
    }
    Ok(())
}

/// A legend entry of bounded width (file paths shortened to their names).
fn short(s: &str) -> String {
    let name = s.rsplit('/').next().unwrap_or(s);
    if name.chars().count() > 30 {
        format!("{}…", name.chars().take(29).collect::<String>())
    } else {
        name.to_string()
    }
}

/// Tick labels with as many decimals as the axis span needs, and no "-0".
pub(crate) fn tick_format(span: f64) -> impl Fn(&f64) -> String {
    let decimals = if span > 0.0 && span.is_finite() {
        (1 - span.log10().floor() as i32).clamp(0, 8) as usize
    } else {
        2
    };
    move |v: &f64| {
        // Past a million the digits outgrow the label area: scientific notation.
        if span.is_finite() && span >= 1e6 && *v != 0.0 {
            return format!("{v:.2e}");
        }
        let t = format!("{v:.decimals$}");
        if t.trim_start_matches('-')
            .chars()
            .all(|c| c == '0' || c == '.')
        {
            t.trim_start_matches('-').to_string()
        } else {
            t
        }
    }
}

fn finite_range(v: &[f64]) -> (f64, f64) {
    let (lo, hi) = v
        .iter()
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    // As `range`: a span of 2e308 is infinite, and the colour of every point NaN (the
    // colormap panicked on it). Both ends clamped, as there.
    let (lo, hi) = if lo.is_finite() {
        (
            lo.clamp(-AXIS_LIMIT, AXIS_LIMIT),
            hi.clamp(-AXIS_LIMIT, AXIS_LIMIT),
        )
    } else {
        (lo, hi)
    };
    if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi > lo {
        (lo, hi)
    } else {
        // A constant column: ±0.5 around it, or a tenth of its value where 0.5 is below its
        // precision (every value 1.8e19 gave a span of 0, each colour 0/0, and the colormap
        // panicked).
        let pad = 0.5f64.max(0.1 * lo.abs());
        (lo - pad, hi + pad)
    }
}

/// A legend in its own panel: the column name, then one coloured dot and label per entry.
fn legend(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    name: &str,
    entries: &[(String, RGBColor)],
) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let (x0, mut y) = (10, 90);
    let title = (FONT, 18).into_font().style(FontStyle::Bold);
    area.draw(&Text::new(name.to_string(), (x0, y), title))
        .map_err(|x| e(&x))?;
    y += 34;
    for (label, c) in entries {
        area.draw(&Circle::new((x0 + 8, y + 8), 6, c.filled()))
            .map_err(|x| e(&x))?;
        area.draw(&Text::new(label.clone(), (x0 + 22, y), (FONT, 15)))
            .map_err(|x| e(&x))?;
        y += 24;
    }
    Ok(())
}

fn colour_bar(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    (lo, hi): (f64, f64),
    name: &str,
) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let mut bar = ChartBuilder::on(area)
        .margin_top(80)
        .margin_bottom(100)
        .margin_left(10)
        .margin_right(10)
        .set_label_area_size(LabelAreaPosition::Right, 90)
        .build_cartesian_2d(0.0..1.0, lo..hi)
        .map_err(|x| e(&x))?;
    bar.configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_labels(8)
        .y_label_formatter(&tick_format(hi - lo))
        .y_desc(name)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 18))
        .draw()
        .map_err(|x| e(&x))?;
    let steps = 200;
    bar.draw_series((0..steps).map(|i| {
        let a = lo + (hi - lo) * i as f64 / steps as f64;
        let b = lo + (hi - lo) * (i + 1) as f64 / steps as f64;
        let c = ViridisRGB.get_color((i as f32 + 0.5) / steps as f32);
        Rectangle::new([(0.0, a), (1.0, b)], c.filled())
    }))
    .map_err(|x| e(&x))?;
    Ok(())
}
