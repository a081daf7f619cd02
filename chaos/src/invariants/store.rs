//! The checkpoint store: every committed step verifies and restores, none seen committed is
//! lost (beyond what retention retires), and what the store watcher saw while the run went on.

use super::{Check, Outcome};
use crate::events::{Event, Record};
use crate::watch::KEEP_STEPS;

/// 2. Every committed step verifies and restores.
pub(super) fn committed_steps_verify(o: &Outcome) -> Check {
    Check::new(
        "committed_steps_verify",
        o.bad_steps.is_empty() && !o.committed.is_empty(),
        if o.bad_steps.is_empty() {
            format!(
                "{} committed steps verified: {:?}",
                o.committed.len(),
                o.committed
            )
        } else {
            format!("bad: {:?}", o.bad_steps)
        },
    )
}

/// 3. No committed step lost: each one seen committed is still there, unless retention
///    (the newest [`KEEP_STEPS`] are kept) removed it for a newer one.
pub(super) fn no_committed_step_lost(events: &[Record], o: &Outcome) -> Check {
    let newest_kept = o
        .committed
        .iter()
        .rev()
        .nth(KEEP_STEPS.saturating_sub(1))
        .copied()
        .unwrap_or(0);
    let lost: Vec<u64> = events
        .iter()
        .filter_map(|e| match e.event {
            Event::CheckpointCommitted { step, .. } => Some(step),
            _ => None,
        })
        .filter(|st| !o.committed.contains(st) && *st >= newest_kept)
        .collect();
    Check::new(
        "no_committed_step_lost",
        lost.is_empty(),
        if lost.is_empty() {
            "every step reported committed is in the store or was retired by retention".into()
        } else {
            format!("committed but missing: {lost:?}")
        },
    )
}

/// 7. While the run went on, the newest committed step never went back, no committed step
///    vanished that retention would have kept, and every step visible as committed
///    verified.
pub(super) fn live(o: &Outcome) -> [Check; 2] {
    let live = &o.live;
    [
        Check::new(
            "newest_commit_never_regresses",
            live.regressions.is_empty(),
            if live.regressions.is_empty() {
                format!(
                    "{} listings, steps seen committed: {:?}",
                    live.samples, live.seen
                )
            } else {
                live.regressions.join("; ")
            },
        ),
        Check::new(
            "visible_commits_complete",
            live.partial.is_empty(),
            if live.partial.is_empty() {
                format!(
                    "{} of {} steps verified while committed (the rest were retired first){}",
                    live.verified.len(),
                    live.seen.len(),
                    if live.errors.is_empty() {
                        String::new()
                    } else {
                        format!("; watcher errors: {:?}", live.errors)
                    }
                )
            } else {
                live.partial.join("; ")
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::tests::{committed, events, outcome};
    use super::*;

    #[test]
    fn steps_retention_retired_are_not_lost_and_the_rest_are() {
        // In the store at the end: the newest KEEP_STEPS of 10, 20, ..., 100.
        let mut o = outcome();
        o.committed = (1..=10u64).map(|i| 10 * i).collect();
        o.committed.drain(..o.committed.len() - KEEP_STEPS);
        let mut evs = events();
        evs.push(committed(9000, "a", 20, 2));
        assert!(
            no_committed_step_lost(&evs, &o).ok,
            "retired for newer ones"
        );
        // A step among the newest KEEP_STEPS missing is lost.
        evs.push(committed(9100, "a", 95, 2));
        let c = no_committed_step_lost(&evs, &o);
        assert!(!c.ok);
        assert_eq!(c.detail, "committed but missing: [95]");
    }
}
