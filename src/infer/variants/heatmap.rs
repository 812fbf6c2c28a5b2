//! The in-silico mutagenesis picture: position × base, each cell the Δ log-likelihood of that
//! substitution (blue: the model finds it less likely, red: more), the reference base of each
//! position in grey, codon boundaries of the CDS frame as vertical lines, and each codon's amino
//! acid above it.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::code::translate;
use super::VariantRow;
use crate::error::Result;
use crate::plot::{render_png, FONT};

const BASES: [u8; 4] = *b"ACGT";

/// Diverging colour for `x` in [−1, 1]: blue → white → red.
pub fn diverging(x: f64) -> RGBColor {
    let x = x.clamp(-1.0, 1.0);
    let mix = |a: u8, b: u8, t: f64| (a as f64 + (b as f64 - a as f64) * t).round() as u8;
    let (blue, red, white) = (
        (33u8, 102u8, 172u8),
        (178u8, 24u8, 43u8),
        (247u8, 247u8, 247u8),
    );
    let (end, t) = if x < 0.0 { (blue, -x) } else { (red, x) };
    RGBColor(
        mix(white.0, end.0, t),
        mix(white.1, end.1, t),
        mix(white.2, end.2, t),
    )
}

/// Draws the heatmap of `rows` (single-base substitutions of `seq` over `region`, 1-based
/// inclusive) to `out`; `cds_start` (1-based) gives the codon frame.
pub fn draw(
    out: &Path,
    rows: &[VariantRow],
    seq: &[u8],
    region: (u64, u64),
    cds_start: u64,
    model: &str,
) -> Result<()> {
    let n = (region.1 - region.0 + 1) as usize;
    let mut cell = vec![[f64::NAN; 4]; n];
    for r in rows {
        let v = &r.variant;
        let (Some(d), Some(b)) = (&r.delta, v.alt.bytes().next()) else {
            continue;
        };
        if v.pos < region.0 || v.pos > region.1 || v.alt.len() != 1 {
            continue;
        }
        if let Some(k) = BASES.iter().position(|&x| x == b) {
            cell[(v.pos - region.0) as usize][k] = d.total;
        }
    }
    let scale = cell
        .iter()
        .flatten()
        .filter(|x| x.is_finite())
        .fold(0.0f64, |m, x| m.max(x.abs()))
        .max(1e-6);
    let chrom = rows
        .first()
        .map_or("", |r| r.variant.chrom.as_str())
        .to_string();
    let title = format!(
        "In-silico mutagenesis of {chrom}:{}..{} (Δ log-likelihood, {model})",
        region.0, region.1
    );
    // Wide enough for the cells and for the title (about 12 pixels a character at its size,
    // beside the colour bar's 150): a short region's title ran off both edges.
    let for_title = title.chars().count() as u32 * 12 + 190;
    let width = (n as u32 * 14 + 260).max(for_title).clamp(900, 6000);
    render_png(out, (width, 420), |root| {
        paint(root, &cell, seq, region, cds_start, scale, &title)
    })
}

fn paint(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    cell: &[[f64; 4]],
    seq: &[u8],
    region: (u64, u64),
    cds_start: u64,
    scale: f64,
    title: &str,
) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let (w, _) = root.dim_in_pixel();
    let (main, side) = root.split_horizontally(w.saturating_sub(150));
    let (x0, x1) = (region.0 as f64 - 0.5, region.1 as f64 + 0.5);
    let mut chart = ChartBuilder::on(&main)
        .caption(title, (FONT, 20).into_font().style(FontStyle::Bold))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(50)
        .build_cartesian_2d(x0..x1, 0.0..4.6)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .y_labels(10)
        .y_label_formatter(&|y: &f64| {
            // Rows are [k, k+1): a base's letter sits at its row's middle.
            let i = (*y - 0.5).round().max(0.0) as usize;
            if (*y - 0.5 - i as f64).abs() < 0.01 && i < 4 {
                (BASES[i] as char).to_string()
            } else {
                String::new()
            }
        })
        // Positions are whole: a tick between two (a region of one base has only such ticks)
        // gets no label, where each read as the same position.
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .x_desc("position (1-based); codons of the CDS frame between the lines")
        .y_desc("ALT base")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(|x| e(&x))?;
    let grey = RGBColor(200, 200, 200);
    for (i, c) in cell.iter().enumerate() {
        let pos = region.0 + i as u64;
        let refb = seq[(pos - 1) as usize];
        for (k, &v) in c.iter().enumerate() {
            let colour = if BASES[k] == refb {
                grey
            } else if v.is_finite() {
                diverging(v / scale)
            } else {
                WHITE
            };
            let (xa, ya) = (pos as f64 - 0.5, k as f64);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(xa, ya), (xa + 1.0, ya + 1.0)],
                    colour.filled(),
                )))
                .map_err(|x| e(&x))?;
        }
    }
    // Codon boundaries of the CDS frame, and each codon's amino acid above its first base.
    for pos in region.0..=region.1 {
        if pos < cds_start || !(pos - cds_start).is_multiple_of(3) {
            continue;
        }
        let x = pos as f64 - 0.5;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x, 0.0), (x, 4.6)],
                BLACK.stroke_width(1),
            )))
            .map_err(|x| e(&x))?;
        let at = (pos - 1) as usize;
        if let Some(codon) = seq.get(at..at + 3) {
            let label = format!("{}", translate(codon) as char);
            chart
                .draw_series(std::iter::once(Text::new(
                    label,
                    (pos as f64 + 0.6, 4.45),
                    (FONT, 13).into_font(),
                )))
                .map_err(|x| e(&x))?;
        }
    }
    // Colour bar.
    let bar = side.margin(60, 60, 20, 70);
    let (_, bh) = bar.dim_in_pixel();
    let steps = 50;
    for s in 0..steps {
        let t = 1.0 - 2.0 * s as f64 / (steps - 1) as f64;
        let y = (s as u32 * bh / steps as u32) as i32;
        bar.draw(&Rectangle::new(
            [(0, y), (20, y + (bh / steps as u32) as i32 + 1)],
            diverging(t).filled(),
        ))
        .map_err(|x| e(&x))?;
    }
    for (t, y) in [(scale, 0), (0.0, bh as i32 / 2), (-scale, bh as i32 - 10)] {
        bar.draw(&Text::new(format!("{t:+.2}"), (26, y), (FONT, 13)))
            .map_err(|x| e(&x))?;
    }
    side.draw(&Text::new("Δ LL (nats)", (10, 30), (FONT, 14)))
        .map_err(|x| e(&x))?;
    Ok(())
}
