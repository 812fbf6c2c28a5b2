//! The one progress-bar helper: indicatif bars on stderr for long work (ingest, training,
//! embedding, generation), hidden when the command runs with `--quiet`.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `total` units (a spinner when the total is unknown) drawn with `template`, or a
/// hidden one when `enabled` is false.
pub fn bar(enabled: bool, total: Option<u64>, template: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| {
        // A template is a literal of this crate; a typo must not stop a run.
        ProgressStyle::default_bar()
    }));
    bar
}
