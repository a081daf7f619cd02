//! The invariants checked after every run, as pure functions of what the run left behind:
//! the agents' event log, the faults fired, the checkpoint store's state, the workers'
//! output and the process table.

use serde::Serialize;
use serde_json::Value;

use crate::scenario::{Expect, Fault, FaultKind, Scenario};

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

fn ev<'a>(events: &'a [Value], name: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    events.iter().filter(move |e| e["event"] == name)
}

fn ts(e: &Value) -> u64 {
    e["ts_ms"].as_u64().unwrap_or(0)
}

/// The generation current at `t` (the newest generation event before it).
fn generation_at(events: &[Value], t: u64) -> u64 {
    ev(events, "generation")
        .filter(|e| ts(e) <= t)
        .filter_map(|e| e["generation"].as_u64())
        .max()
        .unwrap_or(0)
}

pub fn effects(events: &[Value], fired: &[Fired]) -> Vec<FaultEffect> {
    fired
        .iter()
        .map(|f| {
            let t = f.at_unix_ms;
            let g0 = generation_at(events, t);
            let detection_ms = events
                .iter()
                .filter(|e| ts(e) >= t)
                .filter(|e| {
                    matches!(
                        e["event"].as_str(),
                        Some("drain_started" | "fenced" | "worker_failed")
                    ) || (e["event"] == "generation" && e["generation"].as_u64() > Some(g0))
                })
                .map(|e| ts(e) - t)
                .min();
            let next = ev(events, "generation")
                .filter(|e| ts(e) >= t && e["generation"].as_u64() > Some(g0))
                .filter_map(|e| e["generation"].as_u64())
                .min();
            let (resume_step, lost_steps, recovery_ms) = match next {
                Some(g) => {
                    let gens: Vec<&Value> = ev(events, "generation")
                        .filter(|e| e["generation"].as_u64() == Some(g))
                        .collect();
                    let resume = gens.iter().find_map(|e| e["resume_step"].as_u64());
                    let reached = gens
                        .iter()
                        .filter_map(|e| e["prev_last_step"].as_u64())
                        .max();
                    // `prev_last_step` is the newest step any generation reported. When the
                    // generation the fault hit never trained (it was still starting), those
                    // steps were lost by the fault that ended an earlier one, not by this.
                    let next_ts = gens.iter().map(|e| ts(e)).min().unwrap_or(u64::MAX);
                    let g0_trained = ev(events, "first_step")
                        .any(|e| e["generation"].as_u64() == Some(g0) && ts(e) < next_ts);
                    let lost = reached.map(|r| {
                        if g0_trained {
                            r.saturating_sub(resume.unwrap_or(0))
                        } else {
                            0
                        }
                    });
                    // Training again: the first step of that generation or of any later one
                    // (a generation can be superseded before it trains, as when a partitioned
                    // node comes back at once).
                    let rec = ev(events, "first_step")
                        .filter(|e| ts(e) >= t && e["generation"].as_u64() >= Some(g))
                        .map(|e| ts(e) - t)
                        .min();
                    (resume, lost, rec)
                }
                None => (None, None, None),
            };
            FaultEffect {
                kind: f.fault.kind,
                node: f.fault.node,
                at_unix_ms: t,
                skipped: f.skipped.clone(),
                detection_ms,
                recovery_ms,
                next_generation: next,
                resume_step,
                lost_steps,
            }
        })
        .collect()
}

/// The expected scaling of a world size under the scenario's policy.
fn expected_scaling(s: &Scenario, world: u64) -> Option<elastic::ScalingDecision> {
    let mode = s.lr_scaling.parse().ok()?;
    let cfg = elastic::ScalingConfig {
        mode,
        per_worker_batch: Some(s.batch_size),
        base_world_size: u64::from(s.base_world()),
        base_lr: Some(0.05),
        global_batch: s.global_batch,
        on_indivisible: elastic::OnIndivisible::Nearest,
        warmup_steps: None,
    };
    cfg.decide(world, None).ok()
}

/// Checkpoint intervals a node's training may run ahead of its newest commit: the step being
/// committed, one queued, one held by the agent loop, one in the socket channel, and the one a
/// waiting worker has just written (elastic-run's commit pipeline; a worker saving beyond it
/// waits).
pub const COMMIT_PIPELINE_CHECKPOINTS: u64 = 5;
/// How long after store trouble ends its backlog may still be draining.
pub const STORE_BACKLOG_WINDOW_MS: u64 = 30_000;

/// Whether node `node` was fenced at `t`: its last `fenced` event before `t` came after its
/// last `joined`.
fn fenced_at(events: &[Value], node: usize, t: u64) -> bool {
    let name = format!("node{node}");
    let last = |what: &str| {
        events
            .iter()
            .filter(|e| e["event"] == what && e["node"] == name.as_str() && ts(e) <= t)
            .map(ts)
            .max()
    };
    match (last("fenced"), last("joined")) {
        (Some(f), Some(j)) => f >= j,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Whether node `node`'s staging filesystem was full at `t`.
/// Whether some node's staging filesystem was full at `t`. A drain's step needs every rank's
/// part, so one full node makes the whole drain's save fail, wherever the preemption hit.
fn staging_full_anywhere_at(fired: &[Fired], t: u64) -> bool {
    fired.iter().any(|f| {
        f.skipped.is_none()
            && f.fault.kind == FaultKind::StagingFull
            && f.at_unix_ms <= t
            && t <= f.at_unix_ms + f.fault.duration_ms
    })
}

/// Whether a store fault was active at `t` or ended less than the backlog window before it.
fn store_trouble_before(fired: &[Fired], t: u64) -> bool {
    fired.iter().any(|f| {
        f.skipped.is_none()
            && f.fault.kind.needs_s3()
            && f.at_unix_ms <= t
            && f.at_unix_ms + f.fault.duration_ms + STORE_BACKLOG_WINDOW_MS >= t
    })
}

pub fn check(s: &Scenario, events: &[Value], fired: &[Fired], o: &Outcome) -> Vec<Check> {
    let mut out = Vec::new();
    let mut add =
        |name: &'static str, ok: bool, detail: String| out.push(Check { name, ok, detail });

    // 1. The job reaches its target (or fails clearly when it must).
    match s.expect {
        Expect::Complete => add(
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
            add(
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

    // 2. Every committed step verifies and restores.
    add(
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
    );

    // 3. No committed step lost: each one seen committed is still there, unless retention
    //    (the newest 3 are kept) removed it for a newer one.
    let newest_kept = o.committed.iter().rev().nth(2).copied().unwrap_or(0);
    let lost: Vec<u64> = ev(events, "checkpoint_committed")
        .filter_map(|e| e["step"].as_u64())
        .filter(|st| !o.committed.contains(st) && *st >= newest_kept)
        .collect();
    add(
        "no_committed_step_lost",
        lost.is_empty(),
        if lost.is_empty() {
            "every step reported committed is in the store or was retired by retention".into()
        } else {
            format!("committed but missing: {lost:?}")
        },
    );

    // 4. Lost work per fault. After store trouble the agents hold a backlog of staged,
    //    uncommitted checkpoints (at most the commit pipeline's depth: workers wait beyond it),
    //    so a crash then may lose up to that many intervals.
    let mut bad = Vec::new();
    for e in effects(events, fired) {
        if e.skipped.is_some() {
            continue;
        }
        let backlog = store_trouble_before(fired, e.at_unix_ms);
        let crash_bound = if backlog {
            s.checkpoint_interval * COMMIT_PIPELINE_CHECKPOINTS
        } else {
            s.checkpoint_interval
        };
        let bound = match e.kind {
            // A node already fenced (cut off from etcd, its workers stopped) when the
            // preemption came has nothing left to save: it lost what a partition loses.
            // Nor can a drain while any node's staging filesystem is full: the agreed step
            // lacks that node's part.
            k if k.is_preemption()
                && (fenced_at(events, e.node, e.at_unix_ms)
                    || staging_full_anywhere_at(fired, e.at_unix_ms)) =>
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
    add(
        "lost_work_bounded",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "0 for preemptions, at most the checkpoint interval otherwise ({COMMIT_PIPELINE_CHECKPOINTS} intervals within {STORE_BACKLOG_WINDOW_MS} ms of store trouble)"
            )
        } else {
            bad.join("; ")
        },
    );

    // 4b. Every fault aimed at a node hit it while it trained (else the scenario proves
    //     nothing): the job reacted with a drain, a fence, a failure or a new generation.
    //     Random scenarios (`soak`) may miss (a worker kill while workers restart, a full
    //     staging while nobody saves): there the misses are listed, not judged.
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
    add(
        "faults_took_effect",
        missed.is_empty() || !s.require_fault_effect,
        if missed.is_empty() {
            format!("{} fault(s) injected", fired.len())
        } else {
            format!("no reaction to: {}", missed.join(", "))
        },
    );

    // 5. Every generation follows the scaling policy.
    let mut bad = Vec::new();
    for g in ev(events, "generation") {
        let world = g["world_size"].as_u64().unwrap_or(0);
        let Some(want) = expected_scaling(s, world) else {
            bad.push(format!("no decision for world {world}"));
            continue;
        };
        let scale = g["lr_scale"].as_f64().unwrap_or(f64::NAN);
        let accum = g["grad_accum_steps"].as_u64().unwrap_or(0);
        let global = g["global_batch"].as_u64();
        if (scale - want.lr_scale).abs() > 1e-9
            || accum != want.grad_accum_steps
            || global != want.global_batch
        {
            bad.push(format!(
                "generation {} world {world}: lr x{scale} accum {accum} global {global:?}, expected lr x{} accum {} global {:?}",
                g["generation"], want.lr_scale, want.grad_accum_steps, want.global_batch
            ));
        }
    }
    add(
        "scaling_policy",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "{} generation records follow `{}`",
                ev(events, "generation").count(),
                s.lr_scaling
            )
        } else {
            bad.join("; ")
        },
    );

    // 6. Against a fault-free reference: bitwise equal weights while the world size stayed
    //    the base one; within `weights_rtol` once it changed (gradients summed in another
    //    order).
    if s.compare_reference {
        let base = u64::from(s.base_world());
        let mut worlds: Vec<u64> = ev(events, "generation")
            .filter_map(|g| g["world_size"].as_u64())
            .collect();
        worlds.sort_unstable();
        worlds.dedup();
        if worlds.iter().all(|w| *w == base) {
            add(
                "matches_reference",
                o.digest.is_some() && o.digest == o.reference_digest,
                format!(
                    "world {base} throughout: digest {:?}, reference {:?}",
                    o.digest, o.reference_digest
                ),
            );
        } else {
            let (ok, detail) = match &o.weights {
                Some(Ok(d)) => (
                    d.max_rel_diff <= s.weights_rtol,
                    format!(
                        "worlds {worlds:?}: largest relative difference {:.3e} (in {}) over {} model tensors, tolerance {:.1e}",
                        d.max_rel_diff, d.worst, d.tensors, s.weights_rtol
                    ),
                ),
                Some(Err(e)) => (false, format!("weights not compared: {e}")),
                None => (false, "no reference weights".into()),
            };
            add("matches_reference_within_tolerance", ok, detail);
        }
    }

    // 7. While the run went on, the newest committed step never went back, no committed step
    //    vanished that retention would have kept, and every step visible as committed
    //    verified.
    let live = &o.live;
    add(
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
    );
    add(
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
    );

    // 8. Nothing left running.
    add(
        "no_process_left",
        o.leftovers.is_empty(),
        if o.leftovers.is_empty() {
            "no agent or worker of the run is alive".into()
        } else {
            format!("alive: {:?}", o.leftovers)
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn scenario() -> Scenario {
        Scenario::parse(
            "name='t'\nnodes=3\nmin_nodes=2\nmax_nodes=3\nsteps=50\ncheckpoint_interval=5\nbatch_size=8",
            "t",
        )
        .unwrap()
    }

    fn generation(
        t: u64,
        node: &str,
        g: u64,
        world: u64,
        resume: Option<u64>,
        prev: Option<u64>,
    ) -> Value {
        let scale = world as f64 / 3.0;
        json!({"ts_ms": t, "node": node, "event": "generation", "generation": g, "world_size": world,
               "lr_scale": scale, "grad_accum_steps": 1, "global_batch": 8 * world,
               "resume_step": resume, "prev_last_step": prev})
    }

    fn events() -> Vec<Value> {
        vec![
            generation(1000, "a", 1, 3, None, None),
            json!({"ts_ms": 2000, "node": "a", "event": "first_step", "generation": 1, "step": 1}),
            json!({"ts_ms": 3000, "node": "a", "event": "checkpoint_committed", "step": 10, "generation": 1}),
            json!({"ts_ms": 4000, "node": "b", "event": "worker_failed", "generation": 1}),
            generation(6000, "a", 2, 2, Some(10), Some(13)),
            json!({"ts_ms": 9000, "node": "a", "event": "first_step", "generation": 2, "step": 11}),
        ]
    }

    fn outcome() -> Outcome {
        Outcome {
            done_step: Some(50),
            committed: vec![10, 45, 50],
            exits: vec![("a".into(), Some(0))],
            ..Default::default()
        }
    }

    fn fired(kind: FaultKind) -> Vec<Fired> {
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
    fn a_fault_in_a_generation_that_never_trained_loses_nothing_of_its_own() {
        // Generation 2 resumes from 10 after the kill (13 reached) and is preempted before its
        // first step; generation 3 resumes from 10 again with prev_last_step still 13.
        let mut evs = events();
        evs.truncate(5);
        evs.push(json!({"ts_ms": 6500, "node": "a", "event": "drain_started", "reason": "notice"}));
        evs.push(generation(7000, "a", 3, 1, Some(10), Some(13)));
        evs.push(
            json!({"ts_ms": 9000, "node": "a", "event": "first_step", "generation": 3, "step": 11}),
        );
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
        let lost = check(&scenario(), &evs, &f, &outcome())
            .into_iter()
            .find(|c| c.name == "lost_work_bounded")
            .unwrap();
        assert!(lost.ok, "{lost:?}");
        // Had generation 2 trained, the notice would own the loss.
        evs.push(
            json!({"ts_ms": 6200, "node": "a", "event": "first_step", "generation": 2, "step": 11}),
        );
        assert_eq!(effects(&evs, &f)[1].lost_steps, Some(3));
    }

    #[test]
    fn a_crash_soon_after_store_trouble_may_lose_the_commit_backlog() {
        let s = scenario();
        // The kill at 3500 ms costs 13 steps: the newest commit was step 0.
        let mut evs = events();
        evs[4]["resume_step"] = json!(0);
        let lost_ok = |f: &[Fired]| {
            check(&s, &evs, f, &outcome())
                .into_iter()
                .find(|c| c.name == "lost_work_bounded")
                .unwrap()
                .ok
        };
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
        evs[4]["resume_step"] = json!(0);
        let mut evs_late = evs.clone();
        for e in &mut evs_late {
            e["ts_ms"] = json!(e["ts_ms"].as_u64().unwrap() + 100_000);
        }
        let mut f = vec![slow(1_000)];
        let mut k = fired(FaultKind::SigkillAgent);
        k[0].at_unix_ms += 100_000;
        f.extend(k);
        assert!(
            !check(&s, &evs_late, &f, &outcome())
                .into_iter()
                .find(|c| c.name == "lost_work_bounded")
                .unwrap()
                .ok
        );
    }

    #[test]
    fn weights_match_bitwise_at_the_base_world_and_within_tolerance_after_a_change() {
        let mut s = scenario();
        s.compare_reference = true;
        let verdict = |evs: &[Value], o: &Outcome| {
            check(&s, evs, &[], o)
                .into_iter()
                .find(|c| c.name.starts_with("matches_reference"))
                .map(|c| (c.name, c.ok))
                .unwrap()
        };
        let diff = |d: f64| {
            Some(Ok(crate::weights::WeightsDiff {
                tensors: 6,
                max_rel_diff: d,
                worst: "model/0.weight".into(),
            }))
        };
        // World 3 throughout: digests decide.
        let same: Vec<Value> = events().into_iter().take(4).collect();
        let mut o = outcome();
        o.digest = Some("ab".into());
        o.reference_digest = Some("ab".into());
        assert_eq!(verdict(&same, &o), ("matches_reference", true));
        o.reference_digest = Some("cd".into());
        o.weights = diff(0.0);
        assert_eq!(verdict(&same, &o), ("matches_reference", false));
        // 3 -> 2: the tolerance decides, and a missing comparison fails.
        o.weights = diff(1e-6);
        assert_eq!(
            verdict(&events(), &o),
            ("matches_reference_within_tolerance", true)
        );
        o.weights = diff(1e-3);
        assert_eq!(
            verdict(&events(), &o),
            ("matches_reference_within_tolerance", false)
        );
        o.weights = Some(Err("no state".into()));
        assert!(!verdict(&events(), &o).1);
        o.weights = None;
        assert!(!verdict(&events(), &o).1);
    }

    #[test]
    fn a_preemption_of_a_fenced_node_may_lose_what_a_crash_loses() {
        let s = scenario();
        let lost_ok = |evs: &[Value]| {
            check(&s, evs, &fired(FaultKind::SigtermAgent), &outcome())
                .into_iter()
                .find(|c| c.name == "lost_work_bounded")
                .unwrap()
                .ok
        };
        // events() loses 3 steps at the fault (3500 ms): a preemption must lose none...
        let mut evs = events();
        evs.push(json!({"ts_ms": 500, "node": "node2", "event": "joined"}));
        assert!(!lost_ok(&evs));
        // ...unless its node was fenced when the signal came (and had not joined again).
        evs.push(json!({"ts_ms": 3400, "node": "node2", "event": "fenced"}));
        assert!(lost_ok(&evs));
        evs.push(json!({"ts_ms": 3450, "node": "node2", "event": "joined"}));
        assert!(!lost_ok(&evs), "joined again before the signal");
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
        let ok = |f: &[Fired]| {
            check(&s, &evs, f, &outcome())
                .into_iter()
                .find(|c| c.name == "lost_work_bounded")
                .unwrap()
                .ok
        };
        assert!(ok(&f));
        f[0].fault.node = 1;
        assert!(ok(&f), "a peer's full staging fails the drain's step too");
        f[0].fault.duration_ms = 2_000;
        assert!(
            !ok(&f),
            "staging that had room again before the signal is no excuse"
        );
    }

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
    fn each_violation_is_caught() {
        let s = scenario();
        let failed = |c: Vec<Check>| {
            c.into_iter()
                .filter(|c| !c.ok)
                .map(|c| c.name)
                .collect::<Vec<_>>()
        };
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
        evs.push(json!({"ts_ms": 9500, "node": "a", "event": "checkpoint_committed", "step": 55}));
        assert_eq!(failed(check(&s, &evs, &[], &o)), ["no_committed_step_lost"]);
        // The wrong LR.
        let mut evs = events();
        evs[4]["lr_scale"] = json!(1.0);
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
    }
}
