//! The checks on what each fault cost ([`effects`]): lost work stays within its bound, and
//! every fault aimed at a node took effect.

pub use super::effects::effects;
use super::{Check, Fired, drain};
use crate::events::{Event, Record};
use crate::scenario::{FaultKind, Scenario, StoreKind};

/// Checkpoint intervals a node's training may run ahead of its newest commit: the step being
/// committed, one queued, one held by the agent loop, one in the socket channel, and the one a
/// waiting worker has just written (elastic-run's commit pipeline; a worker saving beyond it
/// waits).
pub use runtime::agent::COMMIT_PIPELINE_CHECKPOINTS;
/// How long after store trouble ends its backlog may still be draining.
pub const STORE_BACKLOG_WINDOW_MS: u64 = 30_000;
/// How far before or after a fault the commits lie whose store time may widen its bound.
pub const STORE_TIME_WINDOW_MS: u64 = 10_000;

/// Whether a store fault was active at `t` or ended less than the backlog window before it.
fn store_trouble_before(fired: &[Fired], t: u64) -> bool {
    fired.iter().any(|f| {
        f.skipped.is_none()
            && f.fault.kind.needs_s3()
            && f.at_unix_ms <= t
            && f.at_unix_ms + f.fault.duration_ms + STORE_BACKLOG_WINDOW_MS >= t
    })
}

/// The checkpoints given up among the steps `(resume, reached]` a fault undid: a worker with a
/// full staging filesystem skipped its snapshot, so no node could commit that step (every rank
/// given up at one step counts once).
fn given_up_between(events: &[Record], resume: u64, reached: u64) -> u64 {
    let steps: std::collections::BTreeSet<u64> = events
        .iter()
        .filter_map(|e| match e.event {
            Event::CheckpointSkipped { step, .. } if step > resume && step <= reached => Some(step),
            _ => None,
        })
        .collect();
    steps.len() as u64
}

/// The steps training may run past a checkpoint while the store takes it, around `t`: the
/// longest store time (`store_ms`: upload and commit, not time queued in the agent) of a commit
/// within [`STORE_TIME_WINDOW_MS`] of `t`, in steps of the scenario's pace (its step sleep, a
/// lower bound of a step's time, so the count errs high), rounded up. A slow store widens a
/// crash's bound by these; an agent that stalls between its commits does not.
fn steps_in_store_time(s: &Scenario, events: &[Record], t: u64) -> u64 {
    let store_ms = events
        .iter()
        .filter(|e| e.ts_ms + STORE_TIME_WINDOW_MS >= t && e.ts_ms <= t + STORE_TIME_WINDOW_MS)
        .filter_map(|e| match e.event {
            Event::CheckpointCommitted { store_ms, .. } => Some(store_ms),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let step_ms = (s.step_sleep_s * 1000.0).max(1.0);
    // Saturating float-to-int cast; the caller caps the bound at the pipeline's depth.
    (store_ms as f64 / step_ms).ceil() as u64
}

/// 4. Lost work per fault. After store trouble the agents hold a backlog of staged,
///    uncommitted checkpoints (at most the commit pipeline's depth: workers wait beyond it),
///    so a crash then may lose up to that many intervals. A crash may also lose one more
///    interval for each checkpoint that a full staging filesystem made the job give up
///    since its newest commit: those steps were never committed anywhere. Otherwise a crash
///    loses at most one interval plus the steps trained while the store took the checkpoint
///    before it ([`steps_in_store_time`]), never more than the pipeline's depth. A partition
///    or blackhole of a node on an S3 store is store trouble of its own (the node's way to the
///    store is cut): up to the pipeline's depth. A
///    preemption's bound of 0 is not widened by any of these: its drained step commits
///    regardless; it gets the crash's bound only when nothing was left to save (the node
///    fenced or cut off, a peer fenced, or cut off before its drain began, a staging filesystem full,
///    the group broken by a crash or already stopping for a newer generation). Steps lost are counted from the step training
///    resumed from, in the first generation after the fault that trained.
pub(super) fn lost_work_bounded(s: &Scenario, events: &[Record], fired: &[Fired]) -> Check {
    let mut bad = Vec::new();
    for e in effects(events, fired) {
        if e.skipped.is_some() {
            continue;
        }
        let backlog = store_trouble_before(fired, e.at_unix_ms);
        let given_up = match (e.resume_step, e.lost_steps) {
            (resume, Some(lost)) => {
                let resume = resume.unwrap_or(0);
                given_up_between(events, resume, resume + lost)
            }
            _ => 0,
        };
        let pipeline = s.checkpoint_interval * COMMIT_PIPELINE_CHECKPOINTS;
        // A partition or a blackhole cuts the node off from an S3 store too (its store proxy):
        // no commit of its lands while it lasts, and its workers may train on until the fence
        // stops them (nothing blocks the collectives of a node that trains alone).
        let cut_from_store = matches!(e.kind, FaultKind::Partition | FaultKind::Blackhole)
            && s.store == StoreKind::S3;
        let crash_bound = if backlog || cut_from_store {
            pipeline
        } else {
            pipeline.min(s.checkpoint_interval.saturating_add(steps_in_store_time(
                s,
                events,
                e.at_unix_ms,
            )))
        } + s.checkpoint_interval * given_up;
        let bound = match e.kind {
            // A node already fenced (cut off from etcd, its workers stopped) when the
            // preemption came has nothing left to save: it lost what a partition loses. So
            // has one whose peer was already fenced (every lease may lapse while etcd
            // restarts): the drained step lacks that peer's part.
            // Nor can a drain while any node's staging filesystem is full: the agreed step
            // lacks that node's part. Nor a drain of a group that a crash already broke, or
            // that a newer generation already stopped, or one a peer was cut off from before
            // the drain began (its workers cannot agree on the step with that peer).
            k if k.is_preemption()
                && drain::could_not_save(
                    s,
                    events,
                    fired,
                    e.node,
                    e.at_unix_ms,
                    e.detection_ms.unwrap_or(0),
                ) =>
            {
                Some(crash_bound)
            }
            k if k.is_preemption() => Some(0),
            FaultKind::SigkillAgent
            | FaultKind::SigkillWorker
            | FaultKind::Partition
            | FaultKind::Blackhole
            | FaultKind::SigstopWorker => Some(crash_bound),
            _ => None,
        };
        if let (Some(b), Some(l)) = (bound, e.lost_steps)
            && l > b
        {
            bad.push(format!("{:?} on node {}: lost {l} > {b}", e.kind, e.node));
        }
    }
    Check::new(
        "lost_work_bounded",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "0 for preemptions, at most the checkpoint interval plus the steps of a commit's store time otherwise ({COMMIT_PIPELINE_CHECKPOINTS} intervals within {STORE_BACKLOG_WINDOW_MS} ms of store trouble)"
            )
        } else {
            bad.join("; ")
        },
    )
}

/// 4b. Every fault aimed at a node hit it while it trained (else the scenario proves
///     nothing): the job reacted with a drain, a fence, a failure or a new generation.
///     Random scenarios (`soak`) may miss (a worker kill while workers restart, a full
///     staging while nobody saves): there the misses are listed, not judged.
pub(super) fn faults_took_effect(s: &Scenario, events: &[Record], fired: &[Fired]) -> Check {
    let missed: Vec<String> = effects(events, fired)
        .iter()
        .filter(|e| {
            // Store faults and etcd restarts need no reaction (agents ride them out).
            !(matches!(e.kind, FaultKind::Join | FaultKind::EtcdRestart) || e.kind.needs_s3())
                && e.detection_ms.is_none()
        })
        .map(|e| match &e.skipped {
            Some(why) => format!("{:?} on node {} (skipped: {why})", e.kind, e.node),
            None => format!("{:?} on node {}", e.kind, e.node),
        })
        .collect();
    Check::new(
        "faults_took_effect",
        missed.is_empty() || !s.require_fault_effect,
        if missed.is_empty() {
            format!("{} fault(s) injected", fired.len())
        } else {
            format!("no reaction to: {}", missed.join(", "))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::super::check;
    use super::super::tests::{
        committed, drain, events, fenced, fired, first_step, generation, joined, outcome, rec,
        scenario,
    };
    use super::*;
    use crate::events::DrainReason;
    use crate::scenario::{Fault, Network};

    fn lost_work_check(s: &Scenario, evs: &[Record], f: &[Fired]) -> Check {
        check(s, evs, f, &outcome())
            .into_iter()
            .find(|c| c.name == "lost_work_bounded")
            .unwrap()
    }

    #[test]
    fn a_fault_in_a_generation_that_never_trained_loses_nothing_of_its_own() {
        // Generation 2 resumes from 10 after the kill (13 reached) and is preempted before its
        // first step; generation 3 resumes from 10 again with prev_last_step still 13.
        let mut evs = events();
        evs.truncate(5);
        evs.push(drain(6500, "a", DrainReason::Notice));
        evs.push(generation(7000, "a", 3, 1, Some(10), Some(13)));
        evs.push(first_step(9000, "a", 3, 11));
        let mut f = fired(FaultKind::SigkillAgent);
        f.push(Fired {
            fault: Fault {
                at_ms: 0,
                kind: FaultKind::Notice,
                node: 0,
                duration_ms: 0,
                delay_ms: 0,
            },
            at_unix_ms: 6400,
            skipped: None,
        });
        let e = effects(&evs, &f);
        assert_eq!(e[0].lost_steps, Some(3), "the kill lost 11..13");
        assert_eq!(
            e[1].lost_steps,
            Some(0),
            "the notice hit a generation with no step"
        );
        let lost = lost_work_check(&scenario(), &evs, &f);
        assert!(lost.ok, "{lost:?}");
        // Had generation 2 trained, the notice would own the loss.
        evs.push(first_step(6200, "a", 2, 11));
        assert_eq!(effects(&evs, &f)[1].lost_steps, Some(3));
    }

    #[test]
    fn a_crash_soon_after_store_trouble_may_lose_the_commit_backlog() {
        let s = scenario();
        // The kill at 3500 ms costs 13 steps: the newest commit was step 0.
        let mut evs = events();
        set_resume_step(&mut evs[4], 0);
        let lost_ok = |f: &[Fired]| lost_work_check(&s, &evs, f).ok;
        assert!(!lost_ok(&fired(FaultKind::SigkillAgent)), "13 > interval 5");
        let slow = |at_unix_ms: u64| Fired {
            fault: Fault {
                at_ms: 0,
                kind: FaultKind::StoreSlow,
                node: 0,
                duration_ms: 2_000,
                delay_ms: 1_500,
            },
            at_unix_ms,
            skipped: None,
        };
        let mut f = vec![slow(1_000)];
        f.extend(fired(FaultKind::SigkillAgent));
        assert!(lost_ok(&f), "13 <= 5 intervals after a slow store");
        // Store trouble long over (or only after the kill) excuses nothing.
        let mut f = fired(FaultKind::SigkillAgent);
        f.push(slow(3_600));
        assert!(!lost_ok(&f));
        set_resume_step(&mut evs[4], 0);
        let mut evs_late = evs.clone();
        for e in &mut evs_late {
            e.ts_ms += 100_000;
        }
        let mut f = vec![slow(1_000)];
        let mut k = fired(FaultKind::SigkillAgent);
        k[0].at_unix_ms += 100_000;
        f.extend(k);
        assert!(!lost_work_check(&s, &evs_late, &f).ok);
    }

    #[test]
    fn a_partition_that_cuts_a_node_off_from_an_s3_store_may_lose_the_commit_backlog() {
        // The fault at 3500 ms costs 13 steps (resume 0): more than one interval of 5.
        let mut evs = events();
        set_resume_step(&mut evs[4], 0);
        for kind in [FaultKind::Partition, FaultKind::Blackhole] {
            let f = fired(kind);
            assert!(
                !lost_work_check(&scenario(), &evs, &f).ok,
                "{kind:?}, file store: 13 > 5"
            );
            let mut s3 = scenario();
            s3.store = StoreKind::S3;
            assert!(
                lost_work_check(&s3, &evs, &f).ok,
                "{kind:?}, S3: 13 <= 5 intervals"
            );
        }
        // A crash on S3 is not store trouble.
        let mut s3 = scenario();
        s3.store = StoreKind::S3;
        assert!(!lost_work_check(&s3, &evs, &fired(FaultKind::SigkillAgent)).ok);
    }

    #[test]
    fn a_slow_store_widens_a_crash_bound_by_the_steps_of_its_store_time_and_a_stall_does_not() {
        // The kill at 3500 ms costs 13 steps (resume 0): one interval of 5 plus 8 steps.
        let s = scenario();
        let mut evs = events();
        set_resume_step(&mut evs[4], 0);
        let f = fired(FaultKind::SigkillAgent);
        let with_store_ms = |store_ms: u64, at: u64| {
            let mut evs = evs.clone();
            let Event::CheckpointCommitted { store_ms: ms, .. } = &mut evs[2].event else {
                unreachable!()
            };
            *ms = store_ms;
            evs[2].ts_ms = at;
            lost_work_check(&s, &evs, &f).ok
        };
        // 50 ms steps: 400 ms in the store is 8 steps of training, 350 ms only 7.
        assert!(with_store_ms(400, 3000));
        assert!(!with_store_ms(350, 3000));
        // A commit long after the crash says nothing of the store at the crash.
        assert!(!with_store_ms(400, 3500 + STORE_TIME_WINDOW_MS + 1));
        // A store however slow widens the bound to the pipeline's depth and no more.
        let mut deeper = evs.clone();
        let Event::Generation { prev_last_step, .. } = &mut deeper[4].event else {
            unreachable!()
        };
        *prev_last_step = Some(s.checkpoint_interval * COMMIT_PIPELINE_CHECKPOINTS + 1);
        let Event::CheckpointCommitted { store_ms, .. } = &mut deeper[2].event else {
            unreachable!()
        };
        *store_ms = u64::MAX;
        assert!(!lost_work_check(&s, &deeper, &f).ok);
    }

    #[test]
    fn a_preemption_of_a_group_a_crash_already_broke_may_lose_what_the_crash_loses() {
        // Generation 2 resumes from 10 with 13 reached: 3 steps lost. A worker of generation 1
        // failed at 4000 ms (exit 137).
        let s = scenario();
        let evs = events();
        let sigterm_at = |t: u64| {
            let mut f = fired(FaultKind::SigtermAgent);
            f[0].at_unix_ms = t;
            f
        };
        assert!(
            !lost_work_check(&s, &evs, &sigterm_at(3500)).ok,
            "before the failure: 3 > 0"
        );
        assert!(
            lost_work_check(&s, &evs, &sigterm_at(4500)).ok,
            "after it: the crash's bound"
        );
        // A worker killed before the SIGTERM breaks the group too, whoever reports it.
        let no_report: Vec<Record> = evs
            .iter()
            .filter(|e| !matches!(e.event, Event::WorkerFailed { .. }))
            .cloned()
            .collect();
        assert!(!lost_work_check(&s, &no_report, &sigterm_at(4500)).ok);
        let mut f = fired(FaultKind::SigkillWorker);
        f.extend(sigterm_at(4500));
        assert!(lost_work_check(&s, &no_report, &f).ok);
        // A failure of an earlier generation does not excuse a drain of a later one.
        let mut later = evs.clone();
        later.push(first_step(9500, "a", 2, 11));
        let Event::Generation { prev_last_step, .. } = &mut later[4].event else {
            unreachable!()
        };
        *prev_last_step = Some(13);
        later.push(generation(12_000, "a", 3, 2, Some(10), Some(13)));
        let e = effects(&later, &sigterm_at(10_000));
        assert_eq!(e[0].lost_steps, Some(3), "{e:?}");
        assert!(!lost_work_check(&s, &later, &sigterm_at(10_000)).ok);
    }

    fn set_frozen(r: &mut Record, at: u64) {
        let Event::Generation { frozen_unix_ms, .. } = &mut r.event else {
            panic!("not a generation: {r:?}")
        };
        *frozen_unix_ms = Some(at);
    }

    /// Generation 1 trains to 13 with 10 committed; generation 2 (frozen at 5000 ms to admit
    /// a node) names the older commit 5 and never trains: it is re-formed as generation 3
    /// (frozen at 6800 ms), which resumes from 10.
    fn superseded_events() -> Vec<Record> {
        let mut g2 = generation(6000, "b", 2, 3, Some(5), None);
        set_frozen(&mut g2, 5000);
        let mut g3 = generation(7000, "a", 3, 3, Some(10), Some(13));
        set_frozen(&mut g3, 6800);
        vec![
            generation(1000, "a", 1, 2, None, None),
            first_step(2000, "a", 1, 1),
            committed(3000, "a", 10, 1),
            g2,
            g3,
            first_step(8000, "a", 3, 11),
        ]
    }

    /// Generation 2 restarts every node without a restore (`heal_step` 30): no live rank
    /// held it, so each agent restored it on its workers' request; training had reached 34.
    fn healed_restart(on_demand_step: Option<u64>) -> Vec<Record> {
        let mut evs = vec![
            generation(1000, "a", 1, 2, None, None),
            first_step(2000, "a", 1, 1),
            committed(3000, "a", 30, 1),
        ];
        for node in ["a", "b"] {
            let mut g = generation(5000, node, 2, 2, None, Some(34));
            if let Event::Generation { heal_step, .. } = &mut g.event {
                *heal_step = Some(30);
            }
            evs.push(g);
            if let Some(step) = on_demand_step {
                evs.push(rec(
                    5500,
                    node,
                    Event::RestoredOnDemand {
                        generation: 2,
                        step,
                        bytes: 100,
                    },
                ));
            }
        }
        evs.push(first_step(6000, "a", 2, 31));
        evs
    }

    #[test]
    fn a_generation_that_healed_resumed_from_what_was_restored_on_request_or_its_heal_step() {
        let mut f = fired(FaultKind::SigkillWorker);
        f[0].at_unix_ms = 4000;
        // Restored on request: from that step (an older one when the newer did not verify).
        for (restored, lost) in [(30, 4), (25, 9)] {
            let e = effects(&healed_restart(Some(restored)), &f);
            assert_eq!(e[0].resume_step, Some(restored), "{e:?}");
            assert_eq!(e[0].lost_steps, Some(lost), "{e:?}");
        }
        // Healed from peers: at least from the step joined at.
        let e = effects(&healed_restart(None), &f);
        assert_eq!(
            (e[0].resume_step, e[0].lost_steps),
            (Some(30), Some(4)),
            "{e:?}"
        );
    }

    #[test]
    fn a_generation_superseded_before_it_trained_costs_what_the_one_that_trained_resumed_from() {
        let evs = superseded_events();
        let mut f = fired(FaultKind::Join);
        f[0].at_unix_ms = 4500;
        let e = effects(&evs, &f);
        assert_eq!(e[0].next_generation, Some(2));
        assert_eq!(e[0].resume_step, Some(10), "{e:?}");
        assert_eq!(e[0].lost_steps, Some(3), "11..13, not 6..13: {e:?}");
    }

    #[test]
    fn a_preemption_after_a_newer_generation_was_frozen_may_lose_what_that_change_loses() {
        let s = scenario();
        let evs = superseded_events();
        let sigterm_at = |t: u64| {
            let mut f = fired(FaultKind::SigtermAgent);
            f[0].at_unix_ms = t;
            f
        };
        assert_eq!(effects(&evs, &sigterm_at(5100))[0].lost_steps, Some(3));
        assert!(
            lost_work_check(&s, &evs, &sigterm_at(5100)).ok,
            "the workers were stopping for generation 2 already"
        );
        assert!(
            !lost_work_check(&s, &evs, &sigterm_at(4900)).ok,
            "before the freeze the drain could save: 3 > 0"
        );
        // Without the freeze time (fixed membership) nothing excuses it.
        let mut unknown = evs.clone();
        for r in &mut unknown {
            if let Event::Generation { frozen_unix_ms, .. } = &mut r.event {
                *frozen_unix_ms = None;
            }
        }
        assert!(!lost_work_check(&s, &unknown, &sigterm_at(5100)).ok);
    }

    #[test]
    fn a_preemption_whose_drain_begins_after_a_peer_was_cut_off_may_lose_what_a_crash_loses() {
        // Generation 1 trains to 13 with 10 committed; generation 2 resumes from 10. A notice
        // at 3500 ms on node 2 is acted on at 4400 ms (its drain starts then); node 0 is
        // partitioned at 4200 ms, in between, every node in a namespace of its own.
        let mut s = scenario();
        s.network = Network::Netns;
        let evs = vec![
            generation(1000, "a", 1, 3, None, None),
            first_step(2000, "a", 1, 1),
            committed(3000, "a", 10, 1),
            drain(4400, "c", DrainReason::Notice),
            generation(6000, "a", 2, 2, Some(10), Some(13)),
            first_step(9000, "a", 2, 11),
        ];
        let cut_at = |kind: FaultKind, t: u64, node: usize| Fired {
            fault: Fault {
                at_ms: 0,
                kind,
                node,
                duration_ms: 4000,
                delay_ms: 0,
            },
            at_unix_ms: t,
            skipped: None,
        };
        let partition_at = |t: u64, node: usize| cut_at(FaultKind::Partition, t, node);
        // A blackhole takes a namespace's link down as a partition does (soak seed 20261217,
        // run 35: node1 blackholed 51 ms after a notice reached node0, whose agent acted on it
        // 0.6 s later, by when the workers' collective with node1 had stalled).
        let mut blackholed = fired(FaultKind::Notice);
        blackholed.push(cut_at(FaultKind::Blackhole, 4200, 0));
        assert!(lost_work_check(&s, &evs, &blackholed).ok);
        let mut f = fired(FaultKind::Notice);
        f.push(partition_at(4200, 0));
        assert_eq!(effects(&evs, &f)[0].detection_ms, Some(900));
        assert!(
            lost_work_check(&s, &evs, &f).ok,
            "the drain began with node 0 cut off"
        );
        // A peer cut off only after the drain began is no excuse: the drain had its chance.
        let mut later = fired(FaultKind::Notice);
        later.push(partition_at(4600, 0));
        assert!(!lost_work_check(&s, &evs, &later).ok);
        // Nor is the preempted node's own later partition (that is `cut_off_at`'s matter).
        let mut own = fired(FaultKind::Notice);
        own.push(partition_at(4200, 2));
        assert!(!lost_work_check(&s, &evs, &own).ok);
        // On the loopback a partition cuts etcd only: the workers still agree and save.
        s.network = Network::Loopback;
        assert!(!lost_work_check(&s, &evs, &f).ok);
    }

    fn set_resume_step(r: &mut Record, step: u64) {
        let Event::Generation { resume_step, .. } = &mut r.event else {
            panic!("not a generation: {r:?}")
        };
        *resume_step = Some(step);
    }

    #[test]
    fn after_store_trouble_a_crash_may_lose_the_runtimes_pipeline_depth_and_no_more() {
        let s = scenario();
        let mut evs = events();
        set_resume_step(&mut evs[4], 0);
        let mut evs_one_more = evs.clone();
        let Event::Generation { prev_last_step, .. } = &mut evs_one_more[4].event else {
            unreachable!()
        };
        *prev_last_step = Some(s.checkpoint_interval * COMMIT_PIPELINE_CHECKPOINTS + 1);
        let slow = Fired {
            fault: Fault {
                at_ms: 0,
                kind: FaultKind::StoreOutage,
                node: 0,
                duration_ms: 2_000,
                delay_ms: 0,
            },
            at_unix_ms: 1_000,
            skipped: None,
        };
        let mut f = vec![slow];
        f.extend(fired(FaultKind::SigkillAgent));
        assert!(lost_work_check(&s, &evs, &f).ok);
        assert!(!lost_work_check(&s, &evs_one_more, &f).ok);
    }

    #[test]
    fn a_crash_may_lose_one_more_interval_per_checkpoint_given_up_since_the_newest_commit() {
        let s = scenario();
        // The kill at 3500 ms costs 13 steps (resume 0): more than one interval of 5.
        let mut evs = events();
        set_resume_step(&mut evs[4], 0);
        let skipped = |t: u64, node: &str, step: u64, rank: u32| {
            rec(
                t,
                node,
                Event::CheckpointSkipped {
                    step,
                    generation: 1,
                    rank,
                    reason: "no space left on device".into(),
                },
            )
        };
        let ok = |evs: &[Record], kind: FaultKind| lost_work_check(&s, evs, &fired(kind)).ok;
        assert!(!ok(&evs, FaultKind::SigstopWorker));
        // Step 10 given up by two ranks counts once: 5 + 5 < 13.
        evs.push(skipped(2900, "a", 10, 0));
        evs.push(skipped(2900, "b", 10, 1));
        assert!(!ok(&evs, FaultKind::SigstopWorker));
        // A step given up outside the lost range excuses nothing.
        let mut outside = evs.clone();
        outside.push(skipped(3100, "a", 15, 0));
        assert!(!ok(&outside, FaultKind::SigstopWorker));
        // Steps 5 and 10 given up: 5 + 2 x 5 >= 13.
        evs.push(skipped(2500, "a", 5, 0));
        assert!(ok(&evs, FaultKind::SigstopWorker));
        assert!(ok(&evs, FaultKind::SigkillAgent));
        // A preemption still loses nothing, whatever was given up before.
        let mut pre = evs.clone();
        pre.push(joined(500, "node2", false));
        assert!(!ok(&pre, FaultKind::SigtermAgent));
    }

    /// Soak seed 20261218, run 45: node0 was drained (generation 2 resumed from its step 10 and
    /// trained on), then etcd restarted, and a fenced peer joined generation 2 again, recording
    /// it once more with the steps trained in it (30) as `prev_last_step`. Those steps are not
    /// what the drain undid.
    #[test]
    fn a_generation_recorded_again_after_it_trained_does_not_count_its_training_as_lost() {
        let s = scenario();
        let evs = vec![
            generation(1000, "a", 1, 3, None, None),
            first_step(2000, "a", 1, 1),
            committed(3000, "a", 10, 1),
            generation(6000, "a", 2, 2, Some(10), Some(10)),
            first_step(9000, "a", 2, 11),
            generation(12_000, "b", 2, 2, Some(10), Some(30)),
        ];
        let f = fired(FaultKind::SigtermAgent);
        let e = &effects(&evs, &f)[0];
        assert_eq!((e.resume_step, e.lost_steps), (Some(10), Some(0)));
        assert!(lost_work_check(&s, &evs, &f).ok);
        // Recorded before the generation trained, a higher step is what the fault undid.
        let mut early = evs.clone();
        early[5].ts_ms = 8_000;
        assert_eq!(effects(&early, &f)[0].lost_steps, Some(20));
        assert!(!lost_work_check(&s, &early, &f).ok);
    }

    /// Soak seed 20261232, run 42: etcd restarted, every node was fenced and joined generation
    /// 1 again, its workers restarted from step 25 (they had reached 28), and node1 was
    /// preempted while they were still starting. Steps 26..28 were lost by the fence, not by
    /// the drain, which had nothing newer than step 25 to save.
    #[test]
    fn a_preemption_before_a_generation_joined_again_trains_loses_nothing_of_its_own() {
        let s = scenario();
        let at = |kind: FaultKind, at_unix_ms: u64| Fired {
            fault: Fault {
                at_ms: 0,
                kind,
                node: 1,
                duration_ms: 0,
                delay_ms: 0,
            },
            at_unix_ms,
            skipped: None,
        };
        let f = vec![
            at(FaultKind::EtcdRestart, 3_500),
            at(FaultKind::SigtermAgent, 9_900),
        ];
        let evs = vec![
            generation(1_000, "a", 1, 3, None, None),
            generation(1_000, "b", 1, 3, None, None),
            first_step(2_000, "a", 1, 1),
            committed(3_000, "a", 25, 1),
            fenced(4_300, "a"),
            fenced(4_400, "b"),
            joined(4_450, "b", true),
            generation(4_500, "b", 1, 3, Some(25), Some(28)),
            joined(6_850, "a", true),
            generation(6_900, "a", 1, 3, Some(25), Some(28)),
            generation(10_000, "a", 2, 2, Some(25), Some(28)),
            generation(10_000, "b", 2, 2, Some(25), Some(28)),
            first_step(12_700, "a", 2, 26),
        ];
        let e = effects(&evs, &f);
        assert_eq!(e[0].lost_steps, Some(3), "the fence lost 26..28: {e:?}");
        assert_eq!(e[1].lost_steps, Some(0), "the drain lost nothing: {e:?}");
        assert!(lost_work_check(&s, &evs, &f).ok);
        // Trained again after every node joined it again: the drain's loss is its own.
        let mut trained = evs.clone();
        trained.push(first_step(7_500, "a", 1, 26));
        trained.sort_by_key(|r| r.ts_ms);
        assert_eq!(effects(&trained, &f)[1].lost_steps, Some(3));
        assert!(!lost_work_check(&s, &trained, &f).ok);
        // Only one node joined again, the other kept its first record (and trained on): the
        // generation trained since, as far as the records tell.
        let one: Vec<Record> = evs
            .iter()
            .filter(|r| !(r.node == "a" && r.ts_ms == 6_900))
            .cloned()
            .collect();
        assert_eq!(effects(&one, &f)[1].lost_steps, Some(3));
    }

    /// [`events`] with node2 (the preempted node of [`fired`]) joined and a member of
    /// generation 1 beside node0 and node1.
    fn events_with_node2_in_generation_1() -> Vec<Record> {
        let mut evs = events();
        evs.push(joined(500, "node2", false));
        for e in evs.iter_mut() {
            if let Event::Generation {
                generation: 1,
                members,
                ..
            } = &mut e.event
            {
                *members = vec!["node0".into(), "node1".into(), "node2".into()];
            }
        }
        evs
    }

    /// Soak seed 20261216, run 78: etcd restarted, the leases of node0 and node1 lapsed and
    /// they stopped their workers, and 0.4 s later node2 was preempted: its drain could not
    /// save a step without their parts. Soak seed 20261219, run 14: the same with the lease
    /// lapsing just after the signal.
    #[test]
    fn a_preemption_after_a_peer_of_its_generation_was_fenced_may_lose_what_a_crash_loses() {
        let s = scenario();
        let lost_ok = |evs: &[Record]| lost_work_check(&s, evs, &fired(FaultKind::SigtermAgent)).ok;
        let mut evs = events_with_node2_in_generation_1();
        assert!(!lost_ok(&evs));
        evs.push(fenced(3400, "node7"));
        assert!(!lost_ok(&evs), "a node outside the generation");
        // Fenced after the signal: once the drained node left, the peer's fence is no cause.
        evs.push(rec(
            3_900,
            "node2",
            Event::Left {
                step: Some(60),
                workers_running: false,
            },
        ));
        let mut late = evs.clone();
        late.push(fenced(4_000, "node1"));
        assert!(!lost_ok(&late), "fenced after the drained node left");
        // Soak seed 20261219, run 14: the peer's lease lapsed 21 ms into the drain, its lease
        // renewals having failed since etcd restarted a second before.
        let mut during = evs.clone();
        during.push(fenced(3_521, "node1"));
        assert!(lost_ok(&during), "fenced while the drain was under way");
        evs.push(fenced(3400, "node1"));
        assert!(lost_ok(&evs));
        evs.push(joined(3450, "node1", true));
        assert!(!lost_ok(&evs), "the peer joined again before the signal");
    }

    /// Soak seed 20261222, run 78: etcd restarted, node0's notice came 1.1 s later, and its own
    /// lease lapsed 96 ms into the drain: a fenced node stops its workers and cannot commit.
    #[test]
    fn a_preemption_whose_own_lease_lapses_during_the_drain_may_lose_what_a_crash_loses() {
        let s = scenario();
        let lost_ok = |evs: &[Record]| lost_work_check(&s, evs, &fired(FaultKind::SigtermAgent)).ok;
        let mut evs = events_with_node2_in_generation_1();
        evs.push(rec(
            3_640,
            "node2",
            Event::Left {
                step: Some(60),
                workers_running: false,
            },
        ));
        assert!(!lost_ok(&evs), "no fence: 3 > 0");
        let mut after = evs.clone();
        after.push(fenced(3_700, "node2"));
        assert!(!lost_ok(&after), "fenced after it left");
        evs.push(fenced(3_596, "node2"));
        assert!(lost_ok(&evs), "fenced while its drain was under way");
    }

    /// Soak seed 20261221, run 36: node2 was preempted, and 0.3 s into its drain node0 was
    /// SIGKILLed: the drained step could not be saved by every rank.
    #[test]
    fn a_preemption_whose_peer_is_killed_during_the_drain_may_lose_what_a_crash_loses() {
        let s = scenario();
        let mut evs = events();
        evs.push(joined(500, "node2", false));
        evs.push(rec(
            3_900,
            "node2",
            Event::Left {
                step: None,
                workers_running: false,
            },
        ));
        let with_kill = |kind: FaultKind, node: usize, at_unix_ms: u64| {
            let mut f = fired(FaultKind::SigtermAgent);
            f.push(Fired {
                fault: Fault {
                    at_ms: 0,
                    kind,
                    node,
                    duration_ms: 0,
                    delay_ms: 0,
                },
                at_unix_ms,
                skipped: None,
            });
            f
        };
        let lost_ok = |f: &[Fired]| {
            lost_work_check(&s, &evs, f)
                .detail
                .lines()
                .all(|l| !l.contains("SigtermAgent"))
        };
        assert!(!lost_ok(&fired(FaultKind::SigtermAgent)), "no kill: 3 > 0");
        for kind in [
            FaultKind::SigkillAgent,
            FaultKind::SigkillWorker,
            FaultKind::SigstopWorker,
        ] {
            assert!(
                lost_ok(&with_kill(kind, 0, 3_800)),
                "{kind:?} during the drain"
            );
            assert!(
                !lost_ok(&with_kill(kind, 0, 4_000)),
                "{kind:?} after the drained node left"
            );
        }
        assert!(
            !lost_ok(&with_kill(FaultKind::EtcdRestart, 0, 3_800)),
            "not a kill"
        );
    }

    #[test]
    fn a_preemption_of_a_fenced_node_may_lose_what_a_crash_loses() {
        let s = scenario();
        let lost_ok = |evs: &[Record]| lost_work_check(&s, evs, &fired(FaultKind::SigtermAgent)).ok;
        // events() loses 3 steps at the fault (3500 ms): a preemption must lose none...
        let mut evs = events();
        evs.push(joined(500, "node2", false));
        assert!(!lost_ok(&evs));
        // ...unless its node was fenced when the signal came (and had not joined again).
        evs.push(fenced(3400, "node2"));
        assert!(lost_ok(&evs));
        evs.push(joined(3450, "node2", true));
        assert!(!lost_ok(&evs), "joined again before the signal");
        // ...or unless it was cut off from etcd when the signal came (fenced only later).
        for kind in [FaultKind::Blackhole, FaultKind::Partition] {
            let mut f = fired(FaultKind::SigtermAgent);
            let cut = |node: usize, duration_ms: u64| Fired {
                fault: Fault {
                    at_ms: 0,
                    kind,
                    node,
                    duration_ms,
                    delay_ms: 0,
                },
                at_unix_ms: 3_000,
                skipped: None,
            };
            f.insert(0, cut(2, 2_000));
            assert!(lost_work_check(&s, &evs, &f).ok, "{kind:?}");
            f[0] = cut(1, 2_000);
            assert!(
                !lost_work_check(&s, &evs, &f).ok,
                "{kind:?} of another node"
            );
            f[0] = cut(2, 100);
            assert!(
                !lost_work_check(&s, &evs, &f).ok,
                "{kind:?} over before the signal"
            );
        }
        // A full staging filesystem on any node makes the drain's save fail.
        let mut f = fired(FaultKind::SigtermAgent);
        f.insert(
            0,
            Fired {
                fault: Fault {
                    at_ms: 0,
                    kind: FaultKind::StagingFull,
                    node: 2,
                    duration_ms: 4_000,
                    delay_ms: 0,
                },
                at_unix_ms: 1_000,
                skipped: None,
            },
        );
        let ok = |f: &[Fired]| lost_work_check(&s, &evs, f).ok;
        assert!(ok(&f));
        f[0].fault.node = 1;
        assert!(ok(&f), "a peer's full staging fails the drain's step too");
        f[0].fault.duration_ms = 2_000;
        assert!(
            !ok(&f),
            "staging that had room again before the signal is no excuse"
        );
    }
}
