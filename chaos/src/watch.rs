//! Watches the checkpoint store while a run goes on: lists the committed steps every
//! [`WATCH_INTERVAL_MS`], verifies each step the first time it is seen committed, and records
//! what may never happen:
//!
//! - the newest committed step goes backwards;
//! - a step seen committed disappears while retention (the newest [`KEEP_STEPS`] are kept)
//!   cannot explain it;
//! - a step visible as committed is partial or corrupt (its manifest is written last, so every
//!   object it lists must already be there, whole).
//!
//! The watcher talks to the store directly, never through the fault proxy, so that store
//! faults do not blind it. [`CommitTracker`] is the pure part, tested with synthetic listings.

use std::collections::BTreeSet;
use std::time::Duration;

use checkpoint::{CancellationToken, Store};
use serde::Serialize;

/// How often the store is listed.
pub const WATCH_INTERVAL_MS: u64 = 500;
/// Committed steps the agents' retention keeps (`runtime`'s default `keep_steps`; the harness
/// passes no `--checkpoint-keep-last`).
pub const KEEP_STEPS: usize = runtime::pipeline::KEEP_STEPS_DEFAULT;
/// Violations and errors kept in the report, each.
const MESSAGES_MAX: usize = 50;
/// Attempts to verify one step before it is reported as unverifiable.
const VERIFY_ATTEMPTS_MAX: u32 = 3;

/// What the watcher saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct WatchReport {
    /// Listings taken.
    pub samples: u64,
    /// Every step ever seen committed, ascending.
    pub seen: Vec<u64>,
    /// Steps verified while they were committed.
    pub verified: Vec<u64>,
    /// The newest committed step went backwards, or a committed step vanished unexplained.
    pub regressions: Vec<String>,
    /// A step visible as committed did not verify.
    pub partial: Vec<String>,
    /// Store errors of the watcher itself (not violations).
    pub errors: Vec<String>,
}

fn push_bounded(v: &mut Vec<String>, m: String) {
    if v.len() < MESSAGES_MAX {
        v.push(m);
    }
}

/// The pure bookkeeping over successive listings of committed steps.
#[derive(Debug, Clone)]
pub struct CommitTracker {
    keep: usize,
    seen: BTreeSet<u64>,
    present: BTreeSet<u64>,
    newest: Option<u64>,
    pub regressions: Vec<String>,
}

impl CommitTracker {
    pub fn new(keep: usize) -> CommitTracker {
        CommitTracker {
            keep: keep.max(1),
            seen: BTreeSet::new(),
            present: BTreeSet::new(),
            newest: None,
            regressions: Vec::new(),
        }
    }

    /// Takes one listing (at `t_ms` since the run began); returns the steps seen for the first
    /// time.
    pub fn observe(&mut self, t_ms: u64, listed: &[u64]) -> Vec<u64> {
        let now: BTreeSet<u64> = listed.iter().copied().collect();
        let newest = now.last().copied();
        if let (Some(before), after) = (self.newest, newest)
            && after.is_none_or(|a| a < before)
        {
            push_bounded(
                &mut self.regressions,
                format!("at {t_ms} ms the newest committed step went from {before} to {after:?}"),
            );
        }
        for gone in self.present.difference(&now) {
            // Retention deletes only below the newest `keep` committed steps.
            let newer = now.range(gone + 1..).count();
            if newer < self.keep {
                push_bounded(
                    &mut self.regressions,
                    format!(
                        "at {t_ms} ms committed step {gone} vanished with only {newer} newer committed step(s) (retention keeps {})",
                        self.keep
                    ),
                );
            }
        }
        let fresh: Vec<u64> = now.difference(&self.seen).copied().collect();
        self.seen.extend(fresh.iter().copied());
        self.newest = self.newest.max(newest);
        self.present = now;
        fresh
    }

    /// Whether `step`, missing now, is explained by retention given the current listing.
    pub fn retired(&self, step: u64, listed: &[u64]) -> bool {
        listed.iter().filter(|s| **s > step).count() >= self.keep
    }

    pub fn seen(&self) -> Vec<u64> {
        self.seen.iter().copied().collect()
    }
}

/// Watches `store` until `stop` is cancelled; returns what it saw.
pub async fn watch(store: Store, t0: std::time::Instant, stop: CancellationToken) -> WatchReport {
    let cancel = CancellationToken::new();
    let mut tracker = CommitTracker::new(KEEP_STEPS);
    let mut report = WatchReport::default();
    // Steps seen but not yet verified, with the attempts so far.
    let mut todo: Vec<(u64, u32)> = Vec::new();
    loop {
        let stopping = stop.is_cancelled();
        match store.committed_steps(&cancel).await {
            Ok(listed) => {
                report.samples += 1;
                let t_ms = t0.elapsed().as_millis() as u64;
                todo.extend(tracker.observe(t_ms, &listed).into_iter().map(|s| (s, 0)));
                let mut again = Vec::new();
                for (step, attempts) in std::mem::take(&mut todo) {
                    match verify_one(&store, step, &tracker, &cancel).await {
                        Verdict::Good => report.verified.push(step),
                        Verdict::Retired => {}
                        Verdict::Bad(why) => push_bounded(
                            &mut report.partial,
                            format!("step {step} was visible as committed but {why}"),
                        ),
                        Verdict::Unknown(e) if attempts + 1 >= VERIFY_ATTEMPTS_MAX => {
                            push_bounded(
                                &mut report.errors,
                                format!("step {step} could not be verified: {e}"),
                            );
                        }
                        Verdict::Unknown(_) => again.push((step, attempts + 1)),
                    }
                }
                todo = again;
            }
            Err(e) => push_bounded(&mut report.errors, format!("list: {e}")),
        }
        if stopping {
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_millis(WATCH_INTERVAL_MS)) => {}
        }
    }
    report.seen = tracker.seen();
    report.regressions = tracker.regressions;
    report
}

enum Verdict {
    Good,
    /// Gone meanwhile, and retention explains it.
    Retired,
    Bad(String),
    /// A store error that says nothing about the step.
    Unknown(String),
}

async fn verify_one(
    store: &Store,
    step: u64,
    tracker: &CommitTracker,
    cancel: &CancellationToken,
) -> Verdict {
    let why = match store.verify(step, &Default::default(), cancel).await {
        Ok(r) if r.bad.is_empty() => return Verdict::Good,
        Ok(r) => format!("{} object(s) failed: {:?}", r.bad.len(), r.bad),
        Err(e) if e.is_integrity() => e.to_string(),
        Err(e) => return Verdict::Unknown(e.to_string()),
    };
    // Retention uncommits (deletes the manifest) before it deletes data: a step whose manifest
    // is gone now was retired under the verifier, if enough newer steps exist.
    match store.committed_steps(cancel).await {
        Ok(now) if !now.contains(&step) && tracker.retired(step, &now) => Verdict::Retired,
        Ok(_) => Verdict::Bad(why),
        Err(e) => Verdict::Unknown(format!("{why}; then list: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_commits_and_retention_are_fine() {
        let mut t = CommitTracker::new(3);
        assert_eq!(t.observe(0, &[]), Vec::<u64>::new());
        assert_eq!(t.observe(1, &[5]), [5]);
        assert_eq!(t.observe(2, &[5, 10, 15]), [10, 15]);
        // 20 committed and retention dropped 5: three newer steps remain.
        assert_eq!(t.observe(3, &[10, 15, 20]), [20]);
        assert_eq!(t.observe(4, &[20, 25, 30]), [25, 30]);
        assert!(t.regressions.is_empty(), "{:?}", t.regressions);
        assert_eq!(t.seen(), [5, 10, 15, 20, 25, 30]);
    }

    #[test]
    fn the_newest_step_going_backwards_is_caught() {
        let mut t = CommitTracker::new(3);
        t.observe(0, &[5, 10]);
        t.observe(1, &[5]);
        assert_eq!(t.regressions.len(), 2, "{:?}", t.regressions);
        assert!(t.regressions[0].contains("from 10 to Some(5)"));
        assert!(t.regressions[1].contains("step 10 vanished"));
    }

    #[test]
    fn a_step_vanishing_without_newer_ones_is_caught() {
        let mut t = CommitTracker::new(3);
        t.observe(0, &[5, 10, 15]);
        // 5 vanished with only two newer steps: retention would have kept it.
        t.observe(1, &[10, 15]);
        assert_eq!(t.regressions.len(), 1, "{:?}", t.regressions);
        assert!(t.regressions[0].contains("committed step 5 vanished with only 2"));
        // Everything gone at once: the newest regressed too.
        let mut t = CommitTracker::new(3);
        t.observe(0, &[5]);
        t.observe(1, &[]);
        assert!(t.regressions[0].contains("from 5 to None"));
    }

    #[test]
    fn retired_needs_keep_newer_steps() {
        let t = CommitTracker::new(3);
        assert!(t.retired(5, &[10, 15, 20]));
        assert!(!t.retired(5, &[10, 15]));
    }
}
