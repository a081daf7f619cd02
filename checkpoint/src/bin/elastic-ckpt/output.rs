//! What the tool prints: text made safe for a terminal, progress bars, sizes, times, JSON.

use std::io::IsTerminal;
use std::sync::Arc;

use anyhow::Result;
use checkpoint::save::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// Text from a checkpoint made safe for a terminal: control characters (escape sequences
/// included) are shown escaped, as `\u{1b}`, instead of reaching the terminal. Newlines and
/// tabs of the tool's own multi-line messages stay.
pub(crate) fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether a long transfer shows a progress bar: not under `--json`, and only on a terminal.
pub(crate) fn shows_bar(json: bool) -> bool {
    !json && std::io::stderr().is_terminal()
}

pub(crate) fn bar(json: bool, len: u64, what: &str) -> (ProgressBar, Option<Progress>) {
    if !shows_bar(json) {
        return (ProgressBar::hidden(), None);
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    let p = pb.clone();
    (pb, Some(Arc::new(move |n| p.inc(n))))
}

pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// UTC `YYYY-MM-DDTHH:MM:SSZ` from Unix milliseconds.
pub(crate) fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

pub(crate) fn print_json(v: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
