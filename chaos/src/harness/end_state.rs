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

/// For each of `wanted`, the first line of the workers' output (`*.out` under `logs`, in file
/// name order) that holds it, as `FILE: LINE` cut to 300 characters; `None` when no line does.
pub(super) fn lines_holding(logs: &Path, wanted: &[String]) -> Vec<(String, Option<String>)> {
    let mut found: Vec<(String, Option<String>)> =
        wanted.iter().map(|w| (w.clone(), None)).collect();
    if wanted.is_empty() {
        return found;
    }
    let mut files: Vec<_> = std::fs::read_dir(logs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "out"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for (w, hit) in found.iter_mut().filter(|(_, hit)| hit.is_none()) {
            if let Some(l) = text.lines().find(|l| l.contains(w.as_str())) {
                *hit = Some(format!("{name}: {l}").chars().take(300).collect());
            }
        }
    }
    found
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_holding_finds_the_first_line_of_each_text_in_worker_output_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("node0-0.out"),
            "step 1\nrank 0: the vote dropped step 7: x\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("node1-0.out"),
            "rank 1: the vote dropped step 9: y\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("node2-0.err"), "switched to generation 3\n").unwrap();
        let found = lines_holding(
            dir.path(),
            &[
                "the vote dropped".to_string(),
                "switched to generation".to_string(),
            ],
        );
        assert_eq!(
            found,
            vec![
                (
                    "the vote dropped".to_string(),
                    Some("node0-0.out: rank 0: the vote dropped step 7: x".to_string())
                ),
                ("switched to generation".to_string(), None),
            ]
        );
        assert!(lines_holding(dir.path(), &[]).is_empty());
    }
}
