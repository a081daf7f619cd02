//! The invariants checked after every run, as pure functions of what the run left behind:
//! the agents' event log, the faults fired, the checkpoint store's state, the workers'
//! output and the process table.
//!
//! One file per family; [`check`] runs them in this order:
//!
//! - `job.rs`: the job's end (its target reached, or a clean failure where one is expected);
//! - `store.rs`: every committed step verifies and none is lost; what the store watcher saw
//!   while the run went on;
//! - `faults.rs`: what each fault cost ([`effects`]): lost work within its bound, and a
//!   reaction to every fault;
//! - `training.rs`: every generation follows the scaling policy; the final weights match a
//!   fault-free reference;
//! - `job.rs` again: no process left behind, and an event log that reads.

mod drain;
mod effects;
mod faults;
mod job;
mod store;
mod training;

use serde::Serialize;

pub use faults::{COMMIT_PIPELINE_CHECKPOINTS, STORE_BACKLOG_WINDOW_MS, effects};

use crate::events::Record;
use crate::scenario::{Fault, FaultKind, Scenario};

/// A fault as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct Fired {
    pub fault: Fault,
    /// Unix ms when it was injected.
    pub at_unix_ms: u64,
    /// Why it could not be injected (no worker left to signal, no way to fill the staging
    /// filesystem...); such a fault is reported but not judged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// What a run left behind.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcome {
    /// The highest `done step N` printed by rank 0, and its weights digest.
    pub done_step: Option<u64>,
    pub digest: Option<String>,
    /// `(node, exit code)` of every agent; `None` for one killed on purpose.
    pub exits: Vec<(String, Option<i32>)>,
    pub timed_out: bool,
    /// Committed steps in the store at the end.
    pub committed: Vec<u64>,
    /// `(step, reason)` of committed steps that failed to verify or restore.
    pub bad_steps: Vec<(u64, String)>,
    /// Processes of this run still alive at the end.
    pub leftovers: Vec<String>,
    pub reference_digest: Option<String>,
    /// With a reference run: how far the final model weights are from its (or why they could
    /// not be compared).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weights: Option<Result<crate::weights::WeightsDiff, String>>,
    /// What the store watcher saw during the run.
    pub live: crate::watch::WatchReport,
    /// `(node, message)`: the last `elastic-run: ...` error line of each agent that printed one.
    pub failure_messages: Vec<(String, String)>,
    /// The scenario's `expect_output` texts, each with the first worker output line that
    /// holds it (`None`: no line does, which fails the run).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub expected_output: Vec<(String, Option<String>)>,
    /// Lines of the event log that are no record (`FILE line N: ...`); any fails the run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unreadable_events: Vec<String>,
    /// Lines cut short by an agent killed while it wrote them: tolerated, listed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub truncated_events: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

/// Per-fault figures for the report.
#[derive(Debug, Clone, Serialize)]
pub struct FaultEffect {
    pub kind: FaultKind,
    pub node: usize,
    pub at_unix_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// First reaction of the job (a drain, a fence, a failure or a new generation), ms after.
    pub detection_ms: Option<u64>,
    /// The first training step of the next generation, ms after.
    pub recovery_ms: Option<u64>,
    /// The generation formed after it, its resume step, and the steps redone.
    pub next_generation: Option<u64>,
    pub resume_step: Option<u64>,
    pub lost_steps: Option<u64>,
}

impl Check {
    fn new(name: &'static str, ok: bool, detail: String) -> Check {
        Check { name, ok, detail }
    }
}

pub fn check(s: &Scenario, events: &[Record], fired: &[Fired], o: &Outcome) -> Vec<Check> {
    let mut out = vec![
        job::ending(s, o),
        store::committed_steps_verify(o),
        store::no_committed_step_lost(events, o),
        faults::lost_work_bounded(s, events, fired),
        faults::faults_took_effect(s, events, fired),
        training::scaling_policy(s, events),
    ];
    out.extend(training::matches_reference(s, events, o));
    out.extend(store::live(o));
    out.extend(job::expected_output(o));
    out.push(job::no_process_left(o));
    out.push(job::event_log_readable(events, o));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{DrainReason, Event};

    pub(super) fn scenario() -> Scenario {
        Scenario::parse(
            "name='t'\nnodes=3\nmin_nodes=2\nmax_nodes=3\nsteps=50\ncheckpoint_interval=5\nbatch_size=8",
            "t",
        )
        .unwrap()
    }

    pub(super) fn rec(ts_ms: u64, node: &str, event: Event) -> Record {
        Record {
            ts_ms,
            node: node.into(),
            event,
        }
    }

    pub(super) fn generation(
        t: u64,
        node: &str,
        g: u64,
        world: u32,
        resume: Option<u64>,
        prev: Option<u64>,
    ) -> Record {
        let scale = f64::from(world) / 3.0;
        rec(
            t,
            node,
            Event::Generation {
                generation: g,
                world_size: world,
                node_rank: 0,
                rank_offset: 0,
                members: vec![node.into()],
                lr_scale: scale,
                lr: None,
                batch_size: None,
                global_batch: Some(8 * u64::from(world)),
                grad_accum_steps: 1,
                resume_step: resume,
                restored_bytes: None,
                heal_step: None,
                prev_last_step: prev,
                frozen_unix_ms: None,
                in_place: false,
            },
        )
    }

    pub(super) fn first_step(t: u64, node: &str, generation: u64, step: u64) -> Record {
        rec(t, node, Event::FirstStep { generation, step })
    }

    pub(super) fn committed(t: u64, node: &str, step: u64, generation: u64) -> Record {
        rec(
            t,
            node,
            Event::CheckpointCommitted {
                step,
                generation,
                bytes: 1_000,
                by_this_node: true,
                store_ms: 0,
            },
        )
    }

    pub(super) fn drain(t: u64, node: &str, reason: DrainReason) -> Record {
        rec(t, node, Event::DrainStarted { reason })
    }

    pub(super) fn joined(t: u64, node: &str, rejoin: bool) -> Record {
        rec(
            t,
            node,
            Event::Joined {
                addr: "127.0.0.1".into(),
                rejoin,
            },
        )
    }

    pub(super) fn fenced(t: u64, node: &str) -> Record {
        rec(
            t,
            node,
            Event::Fenced {
                reason: "lease expired".into(),
            },
        )
    }

    pub(super) fn events() -> Vec<Record> {
        vec![
            generation(1000, "a", 1, 3, None, None),
            first_step(2000, "a", 1, 1),
            committed(3000, "a", 10, 1),
            rec(
                4000,
                "b",
                Event::WorkerFailed {
                    generation: 1,
                    rank: 5,
                    exit_code: 137,
                },
            ),
            generation(6000, "a", 2, 2, Some(10), Some(13)),
            first_step(9000, "a", 2, 11),
        ]
    }

    pub(super) fn outcome() -> Outcome {
        Outcome {
            done_step: Some(50),
            committed: vec![10, 45, 50],
            exits: vec![("a".into(), Some(0))],
            ..Default::default()
        }
    }

    pub(super) fn fired(kind: FaultKind) -> Vec<Fired> {
        vec![Fired {
            fault: Fault {
                at_ms: 0,
                kind,
                node: 2,
                duration_ms: 0,
                delay_ms: 0,
            },
            at_unix_ms: 3500,
            skipped: None,
        }]
    }

    pub(super) fn failed(c: Vec<Check>) -> Vec<&'static str> {
        c.into_iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn a_clean_run_passes_every_check() {
        let c = check(
            &scenario(),
            &events(),
            &fired(FaultKind::SigkillAgent),
            &outcome(),
        );
        assert!(c.iter().all(|c| c.ok), "{c:#?}");
        let e = effects(&events(), &fired(FaultKind::SigkillAgent));
        assert_eq!(e[0].detection_ms, Some(500));
        assert_eq!(e[0].recovery_ms, Some(5500));
        assert_eq!(e[0].lost_steps, Some(3));
    }

    #[test]
    fn each_violation_is_caught() {
        let s = scenario();
        // A preemption must lose nothing.
        assert_eq!(
            failed(check(
                &s,
                &events(),
                &fired(FaultKind::SigtermAgent),
                &outcome()
            )),
            ["lost_work_bounded"]
        );
        // A committed step vanished.
        let mut o = outcome();
        o.committed = vec![45, 50, 55, 60];
        o.committed.retain(|s| *s != 55);
        let mut evs = events();
        evs.push(committed(9500, "a", 55, 2));
        assert_eq!(failed(check(&s, &evs, &[], &o)), ["no_committed_step_lost"]);
        // The wrong LR.
        let mut evs = events();
        let Event::Generation { lr_scale, .. } = &mut evs[4].event else {
            panic!("a generation")
        };
        *lr_scale = 1.0;
        assert_eq!(failed(check(&s, &evs, &[], &outcome())), ["scaling_policy"]);
        // What the store watcher saw during the run.
        let mut o = outcome();
        o.live.regressions = vec!["newest went from 10 to 5".into()];
        o.live.partial = vec!["step 15 was visible as committed but crc".into()];
        assert_eq!(
            failed(check(&s, &events(), &[], &o)),
            ["newest_commit_never_regresses", "visible_commits_complete"]
        );
        // A skipped fault is not judged.
        let mut skipped = fired(FaultKind::SigtermAgent);
        skipped[0].skipped = Some("no agent".into());
        assert!(failed(check(&s, &events(), &skipped, &outcome())).is_empty());
        // Unfinished, corrupt, leftovers.
        let mut o = outcome();
        o.done_step = Some(40);
        o.bad_steps = vec![(50, "crc".into())];
        o.leftovers = vec!["pid 1".into()];
        assert_eq!(
            failed(check(&s, &events(), &[], &o)),
            [
                "target_reached",
                "committed_steps_verify",
                "no_process_left"
            ]
        );
        // An event log line that is no record.
        let mut o = outcome();
        o.unreadable_events = vec!["events.jsonl line 7: expected value: x".into()];
        assert_eq!(
            failed(check(&s, &events(), &[], &o)),
            ["event_log_readable"]
        );
    }
}
