//! The job as a whole: it reached its target (or failed clearly where a failure is
//! expected), left no process behind, and left an event log that reads.

use super::{Check, Outcome};
use crate::events::Record;
use crate::scenario::{Expect, Scenario};

/// 1. The job reaches its target (or fails clearly when it must).
pub(super) fn ending(s: &Scenario, o: &Outcome) -> Check {
    match s.expect {
        Expect::Complete => Check::new(
            "target_reached",
            !o.timed_out && o.done_step == Some(s.steps),
            format!(
                "done step {:?} of {}, timed out: {}, exits {:?}",
                o.done_step, s.steps, o.timed_out, o.exits
            ),
        ),
        Expect::Fail => {
            // Failed, in time, and every agent that failed said why (`elastic-run: ...`).
            let failed: Vec<&String> = o
                .exits
                .iter()
                .filter(|(_, c)| matches!(c, Some(c) if *c != 0))
                .map(|(n, _)| n)
                .collect();
            let unexplained: Vec<&&String> = failed
                .iter()
                .filter(|n| !o.failure_messages.iter().any(|(m, _)| m == **n))
                .collect();
            Check::new(
                "fails_clearly",
                !o.timed_out && !failed.is_empty() && unexplained.is_empty(),
                format!(
                    "exits {:?}, timed out: {}, messages {:?}{}",
                    o.exits,
                    o.timed_out,
                    o.failure_messages,
                    if unexplained.is_empty() {
                        String::new()
                    } else {
                        format!(", no error message from {unexplained:?}")
                    }
                ),
            )
        }
    }
}

/// 7b. With `expect_output`: the workers printed each text (the fault landed where the
///     scenario aims it).
pub(super) fn expected_output(o: &Outcome) -> Option<Check> {
    if o.expected_output.is_empty() {
        return None;
    }
    let missing: Vec<&str> = o
        .expected_output
        .iter()
        .filter(|(_, hit)| hit.is_none())
        .map(|(w, _)| w.as_str())
        .collect();
    let detail = if missing.is_empty() {
        o.expected_output
            .iter()
            .filter_map(|(_, hit)| hit.as_deref())
            .collect::<Vec<_>>()
            .join("; ")
    } else {
        format!("no worker printed {missing:?}")
    };
    Some(Check::new("expected_output", missing.is_empty(), detail))
}

/// 8. Nothing left running.
pub(super) fn no_process_left(o: &Outcome) -> Check {
    Check::new(
        "no_process_left",
        o.leftovers.is_empty(),
        if o.leftovers.is_empty() {
            "no agent or worker of the run is alive".into()
        } else {
            format!("alive: {:?}", o.leftovers)
        },
    )
}

/// 9. Every line of the event log is a record (the checks above judge the records only): a
///    line cut short by an agent killed while writing it is tolerated and listed.
pub(super) fn event_log_readable(events: &[Record], o: &Outcome) -> Check {
    let cut = if o.truncated_events.is_empty() {
        String::new()
    } else {
        format!(
            "; cut off by a killed agent (tolerated): {}",
            o.truncated_events.join("; ")
        )
    };
    Check::new(
        "event_log_readable",
        o.unreadable_events.is_empty(),
        if o.unreadable_events.is_empty() {
            format!("{} records{cut}", events.len())
        } else {
            format!("not records: {}{cut}", o.unreadable_events.join("; "))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::super::check;
    use super::super::tests::{events, outcome, scenario};
    use super::*;

    #[test]
    fn an_expected_failure_must_be_clean_and_explained() {
        let mut s = scenario();
        s.expect = Expect::Fail;
        let mut o = outcome();
        o.exits = vec![("a".into(), Some(1)), ("b".into(), None)];
        let verdict = |o: &Outcome| {
            check(&s, &events(), &[], o)
                .into_iter()
                .find(|c| c.name == "fails_clearly")
                .unwrap()
        };
        assert!(!verdict(&o).ok, "no message");
        o.failure_messages = vec![("a".into(), "elastic-run: below min".into())];
        assert!(verdict(&o).ok);
        o.timed_out = true;
        assert!(!verdict(&o).ok, "a hang is no clean failure");
        o.timed_out = false;
        o.exits = vec![("a".into(), Some(0))];
        assert!(!verdict(&o).ok, "it did not fail");
    }

    #[test]
    fn expected_output_that_no_worker_printed_fails_the_run() {
        let s = scenario();
        let verdict = |o: &Outcome| {
            check(&s, &events(), &[], o)
                .into_iter()
                .find(|c| c.name == "expected_output")
        };
        let mut o = outcome();
        assert!(verdict(&o).is_none(), "no check without expect_output");
        o.expected_output = vec![
            (
                "vote".into(),
                Some("node1-0.out: the vote dropped step 7".into()),
            ),
            ("switched".into(), None),
        ];
        let c = verdict(&o).unwrap();
        assert!(!c.ok && c.detail.contains("switched"), "{}", c.detail);
        o.expected_output[1].1 = Some("node0-0.out: switched to generation 2".into());
        let c = verdict(&o).unwrap();
        assert!(c.ok && c.detail.contains("dropped step 7"), "{}", c.detail);
    }

    #[test]
    fn unreadable_event_lines_fail_the_run_and_cut_off_ones_are_only_listed() {
        let mut o = outcome();
        o.truncated_events = vec!["events.jsonl line 9 (no newline): {\"ts_ms\":12".into()];
        let c = event_log_readable(&events(), &o);
        assert!(c.ok, "{c:?}");
        assert!(c.detail.contains("line 9"), "{c:?}");
        o.unreadable_events = vec!["events.jsonl line 4: expected value: x".into()];
        let c = event_log_readable(&events(), &o);
        assert!(!c.ok);
        assert!(c.detail.contains("events.jsonl line 4"), "{c:?}");
    }
}
