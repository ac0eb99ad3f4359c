//! The isolation bench's two PNGs, drawn from the figures it measured (plotters into an RGB
//! buffer, written with `png`): each tenant's goodput and highest 1-second rate against
//! its limit per N, and the quiet tenant's RTT p99 per N with shares, without, and alone.
//! One panel per direction.

use std::{
    fs::File,
    io::BufWriter,
    path::{Path, PathBuf},
    sync::Once,
};

use plotters::{
    coord::{Shift, ranged1d::SegmentedCoord, types::RangedCoordi32},
    prelude::*,
};
use shareguard_tests::net::{self, Direction};

use crate::{Run, Setup, Variant, report};

const SIZE: (u32, u32) = (1400, 560);
/// The font plotters draws text with (ab_glyph: no fontconfig); the Debian package
/// `fonts-dejavu-core`, which scripts/bench.sh installs.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const FAMILY: &str = "sans-serif";
/// TCP goodput through an exact shaper of Ethernet frames: 1448 payload bytes per 1514.
const EXACT_SHAPER: f64 = 1448.0 / 1514.0;

const BLUE_: RGBColor = RGBColor(31, 119, 180);
const GREEN_: RGBColor = RGBColor(44, 160, 44);
const RED_: RGBColor = RGBColor(214, 39, 40);
const GREY: RGBColor = RGBColor(110, 110, 110);

fn load_font() {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        let bytes = std::fs::read(FONT).unwrap_or_else(|e| {
            panic!("{FONT}: {e} (install fonts-dejavu-core; scripts/bench.sh does)")
        });
        // plotters keeps registered fonts for the life of the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FAMILY, FontStyle::Normal, bytes)
            .unwrap_or_else(|_| panic!("{FONT} is not a font plotters can read"));
    });
}

/// Draws both plots of `variant` into `dir` and returns their paths.
pub fn draw(runs: &[Run], dir: &Path, variant: &Variant) -> Vec<PathBuf> {
    load_font();
    let mut dirs: Vec<Direction> = Vec::new();
    for r in runs {
        if !dirs.contains(&r.dir) {
            dirs.push(r.dir);
        }
    }
    let (suffix, load, nic) = (variant.suffix(), variant.load(), variant.nic());
    let goodput = dir.join(format!("isolation-goodput{suffix}.png"));
    write_png(
        &goodput,
        &format!(
            "Each tenant's goodput and highest 1-s rate / its share, N tenants {load} on one {nic} NIC"
        ),
        &dirs,
        |area, d| goodput_panel(area, runs, d, &load),
    );
    let rtt = dir.join(format!("isolation-rtt{suffix}.png"));
    write_png(
        &rtt,
        &format!("Quiet tenant's ping RTT p99 across the {nic} NIC, beside N tenants {load}"),
        &dirs,
        |area, d| rtt_panel(area, runs, d, &load),
    );
    vec![goodput, rtt]
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

fn write_png(path: &Path, title: &str, dirs: &[Direction], panel: impl Fn(&Area<'_>, Direction)) {
    let (w, h) = SIZE;
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area();
        root.fill(&WHITE).unwrap();
        let root = root.titled(title, (FAMILY, 22)).unwrap();
        let panels = root.split_evenly((1, dirs.len().max(1)));
        for (area, &d) in panels.iter().zip(dirs) {
            panel(area, d);
        }
        root.present().unwrap();
    }
    let file = File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut enc = png::Encoder::new(BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()
        .and_then(|mut wr| wr.write_image_data(&buf))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// One column per label; a value sits at `SegmentValue::CenterOf(k)`.
fn category_axis(labels: &[String]) -> SegmentedCoord<RangedCoordi32> {
    // An i32 range includes its end: 0..len-1 is len columns.
    (0..labels.len().max(1) as i32 - 1).into_segmented()
}

fn label_at(labels: &[String], x: &SegmentValue<i32>) -> String {
    match x {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => usize::try_from(*i)
            .ok()
            .and_then(|i| labels.get(i).cloned())
            .unwrap_or_default(),
        SegmentValue::Last => String::new(),
    }
}

/// A horizontal line across the whole plot.
fn across(y: f64) -> [(SegmentValue<i32>, f64); 2] {
    [(SegmentValue::Exact(0), y), (SegmentValue::Last, y)]
}

fn goodput_panel(area: &Area<'_>, runs: &[Run], dir: Direction, load: &str) {
    // "alone" first (each size by itself), then each N with shares.
    let shares = report::by_n(runs, dir);
    let mut labels = vec!["alone".to_owned()];
    labels.extend(shares.iter().map(|(n, _, _)| n.to_string()));
    let alone: Vec<&Run> = runs
        .iter()
        .filter(|r| r.dir == dir && r.setup == Setup::Shares && r.label.starts_with("alone"))
        .collect();
    let columns: Vec<(i32, &Run)> = alone
        .iter()
        .map(|r| (0, *r))
        .chain(
            shares
                .iter()
                .enumerate()
                .map(|(k, (_, r, _))| (k as i32 + 1, *r)),
        )
        .collect();
    // Larger shares left of the column's centre, smaller right, so neither hides the other.
    let points = |ten: bool, peak: bool| -> Vec<(i32, f64)> {
        columns
            .iter()
            .flat_map(|&(x, r)| {
                r.flows
                    .iter()
                    .filter(move |f| f.ten == ten)
                    .filter_map(move |f| {
                        let l = f.limit_bps? as f64;
                        let y = if peak {
                            f.peak_bps
                        } else {
                            f.m.bits_per_second
                        } / l;
                        Some((x, y))
                    })
            })
            .collect()
    };
    // From 0.9 to 1.05 unless a tenant falls outside: then it shows, wherever it is.
    let ys: Vec<f64> = [true, false]
        .iter()
        .flat_map(|&ten| [points(ten, false), points(ten, true)])
        .flatten()
        .map(|p| p.1)
        .filter(|y| y.is_finite())
        .collect();
    let lo = ys.iter().copied().fold(0.9, f64::min) - 0.02;
    let top = ys.iter().copied().fold(1.05, f64::max) + 0.02;
    // Room above the points for the legend.
    let hi = top + (top - lo) * 0.6;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{dir}"), (FAMILY, 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(category_axis(&labels), lo..hi)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc(format!("tenants {load} (N)"))
        .y_desc("rate / limit")
        .x_labels(labels.len())
        .x_label_formatter(&|x| label_at(&labels, x))
        .label_style((FAMILY, 15))
        .axis_desc_style((FAMILY, 16))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .unwrap();
    for (y, color, name) in [
        (1.0, RED_, "limit"),
        (
            EXACT_SHAPER,
            GREY,
            "goodput of an exact L2 shaper (1448/1514)",
        ),
    ] {
        chart
            .draw_series(DashedLineSeries::new(
                across(y),
                6,
                4,
                color.stroke_width(2),
            ))
            .unwrap()
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    for (ten, color, size) in [(true, BLUE_, "10 x min (50M)"), (false, GREEN_, "min (5M)")] {
        let dx = if ten { -10 } else { 10 };
        let at = |(k, y): (i32, f64)| EmptyElement::at((SegmentValue::CenterOf(k), y));
        chart
            .draw_series(
                points(ten, false)
                    .into_iter()
                    .map(|p| at(p) + Circle::new((dx, 0), 4, color.filled())),
            )
            .unwrap()
            .label(format!("{size}: goodput"))
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
        chart
            .draw_series(
                points(ten, true)
                    .into_iter()
                    .map(|p| at(p) + Cross::new((dx, 0), 5, color.stroke_width(2))),
            )
            .unwrap()
            .label(format!("{size}: highest 1 s"))
            .legend(move |(x, y)| Cross::new((x + 10, y), 5, color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(GREY)
        .draw()
        .unwrap();
}

fn rtt_panel(area: &Area<'_>, runs: &[Run], dir: Direction, load: &str) {
    let rows = report::by_n(runs, dir);
    let labels: Vec<String> = rows.iter().map(|(n, _, _)| n.to_string()).collect();
    let base = report::alone_p99(runs, dir);
    let p99 = |r: &Run| net::percentile(&r.quiet, 99.0);
    let before: Vec<(SegmentValue<i32>, f64)> = rows
        .iter()
        .enumerate()
        .filter_map(|(k, (_, s, _))| {
            runs.iter()
                .take_while(|r| !std::ptr::eq(*r, *s))
                .filter(|r| r.dir == dir && report::is_alone(r))
                .last()
                .map(|r| (SegmentValue::CenterOf(k as i32), p99(r)))
        })
        .collect();
    let shared: Vec<(SegmentValue<i32>, f64)> = rows
        .iter()
        .enumerate()
        .map(|(k, (_, s, _))| (SegmentValue::CenterOf(k as i32), p99(s)))
        .collect();
    let whole: Vec<(SegmentValue<i32>, f64)> = rows
        .iter()
        .enumerate()
        .filter_map(|(k, (_, _, w))| w.map(|w| (SegmentValue::CenterOf(k as i32), p99(w))))
        .collect();
    let all: Vec<f64> = before
        .iter()
        .chain(&shared)
        .chain(&whole)
        .map(|p| p.1)
        .chain([base])
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min) / 1.5;
    let hi = all.iter().copied().fold(0.0, f64::max) * 1.5;
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{dir}"), (FAMILY, 20))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(category_axis(&labels), (lo..hi).log_scale())
        .unwrap();
    chart
        .configure_mesh()
        .x_desc(format!("tenants {load} (N)"))
        .y_desc("quiet tenant's ping RTT p99, ms (log)")
        .x_labels(labels.len())
        .x_label_formatter(&|x| label_at(&labels, x))
        .y_labels(12)
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FAMILY, 15))
        .axis_desc_style((FAMILY, 16))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .unwrap();
    chart
        .draw_series(DashedLineSeries::new(
            across(base * 1.1),
            6,
            4,
            GREEN_.stroke_width(2),
        ))
        .unwrap()
        .label(format!("target: alone (median {base:.3} ms) + 10%"))
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], GREEN_.stroke_width(2)));
    for (pts, color, name) in [
        (before, GREY, "alone, just before"),
        (shared, BLUE_, "beside N tenants with shares"),
        (
            whole,
            RED_,
            "beside N tenants, no shares (NIC whole to one tenant)",
        ),
    ] {
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .unwrap()
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .unwrap();
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(GREY)
        .draw()
        .unwrap();
}
