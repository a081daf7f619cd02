//! What a run left behind, read after it: each agent's last error line, rank 0's final line,
//! and every committed step verified and restored.

use std::path::Path;

use super::FINAL_STATE_DIR;

/// The last line an agent printed to say why it failed (`elastic-run: ...`).
pub(super) fn failure_message(err_log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(err_log).ok()?;
    text.lines()
        .rev()
        .find(|l| l.starts_with("elastic-run: "))
        .map(|l| l.chars().take(500).collect())
}

/// Rank 0's final line over every node's output: `(step, digest)` of the highest `done step`.
pub(super) fn final_line(logs: &Path) -> (Option<u64>, Option<String>) {
    let mut best: Option<(u64, String)> = None;
    for e in std::fs::read_dir(logs).into_iter().flatten().flatten() {
        if !e.file_name().to_string_lossy().ends_with(".out") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for l in text.lines() {
            let Some(rest) = l.split("] done step ").nth(1) else {
                continue;
            };
            let step = rest.split_whitespace().next().and_then(|s| s.parse().ok());
            let digest = rest.split(" weights ").nth(1).map(|s| s.trim().to_string());
            if let (Some(st), Some(d)) = (step, digest)
                && best.as_ref().is_none_or(|b| st >= b.0)
            {
                best = Some((st, d));
            }
        }
    }
    match best {
        Some((s, d)) => (Some(s), Some(d)),
        None => (None, None),
    }
}

/// `object_store` options for the store URL, from the agents' environment.
pub(super) fn store_options(env: &[(String, String)]) -> Vec<(String, String)> {
    services::s3_store_options(env)
}

/// Verifies and restores every committed step.
pub(super) async fn check_store(
    url: &str,
    opts: Vec<(String, String)>,
    tmp: &Path,
) -> (Vec<u64>, Vec<(u64, String)>) {
    let cancel = checkpoint::CancellationToken::new();
    let store = match checkpoint::Store::open_with_options(url, opts) {
        Ok(s) => s,
        Err(e) => return (vec![], vec![(0, format!("open {url}: {e}"))]),
    };
    let committed = match store.committed_steps(&cancel).await {
        Ok(c) => c,
        Err(e) => return (vec![], vec![(0, format!("list: {e}"))]),
    };
    let mut bad = vec![];
    for step in &committed {
        match store.verify(*step, &Default::default(), &cancel).await {
            Ok(r) if r.bad.is_empty() => {}
            Ok(r) => bad.push((*step, format!("{:?}", r.bad))),
            Err(e) => bad.push((*step, e.to_string())),
        }
    }
    for step in &committed {
        let dest = tmp.join(format!("restore-check/step-{step}"));
        match store
            .restore(Some(*step), 0, 1, &dest, &Default::default(), &cancel)
            .await
        {
            // The newest step, restored whole, is kept for comparing weights.
            Ok(_) if Some(step) == committed.last() => {
                let _ = std::fs::remove_dir_all(tmp.join(FINAL_STATE_DIR));
                let _ = std::fs::rename(&dest, tmp.join(FINAL_STATE_DIR));
            }
            Ok(_) => {}
            Err(e) => bad.push((*step, format!("restore: {e}"))),
        }
    }
    let _ = std::fs::remove_dir_all(tmp.join("restore-check"));
    (committed, bad)
}
