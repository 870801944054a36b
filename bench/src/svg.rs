//! A dependency-free SVG plot: one panel per table, a horizontal bar per row (median) with a whisker
//! from min to max; baselines in grey.

use crate::common::Table;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders every table as one SVG document.
pub fn render(title: &str, tables: &[Table]) -> String {
    let (w, label_w, bar_w, row_h) = (980.0, 360.0, 520.0, 18.0);
    let mut y = 40.0;
    let mut body = String::new();
    for t in tables {
        let max = t
            .rows
            .iter()
            .map(|r| r.gbps.max)
            .fold(0.0f64, f64::max)
            .max(1e-9);
        body.push_str(&format!(
            "<text x=\"10\" y=\"{y}\" font-size=\"14\" font-weight=\"bold\">{}</text>\n",
            esc(&t.scenario)
        ));
        y += 8.0;
        for r in &t.rows {
            y += row_h;
            let bw = r.gbps.median / max * bar_w;
            let (x0, x1) = (
                label_w + r.gbps.min / max * bar_w,
                label_w + r.gbps.max / max * bar_w,
            );
            let fill = if r.baseline { "#9e9e9e" } else { "#1f77b4" };
            body.push_str(&format!(
                "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n<rect x=\"{label_w}\" y=\"{}\" width=\"{bw:.1}\" height=\"{}\" fill=\"{fill}\"/>\n<line x1=\"{x0:.1}\" x2=\"{x1:.1}\" y1=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<text x=\"{}\" y=\"{}\" font-size=\"11\">{:.2} GB/s{}</text>\n",
                label_w - 6.0,
                y - 4.0,
                esc(&r.label),
                y - row_h + 4.0,
                row_h - 6.0,
                y - row_h / 2.0 + 1.0,
                y - row_h / 2.0 + 1.0,
                label_w + bar_w + 8.0,
                y - 4.0,
                r.gbps.median,
                r.ratio.map_or(String::new(), |x| format!("  ×{x:.2}"))
            ));
        }
        y += 30.0;
    }
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{}\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"16\">{}</text>\n{body}</svg>\n",
        y + 10.0,
        esc(title)
    )
}
