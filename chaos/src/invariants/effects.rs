//! What each fault cost ([`effects`]): how soon the job reacted (detection), how soon it
//! trained again (recovery), the generation it went on in and the steps it redid.

use super::{FaultEffect, Fired};
use crate::events::{Event, Record, first_steps, generations};

/// The generation current at `t` (the newest generation event before it).
pub(super) fn generation_at(events: &[Record], t: u64) -> u64 {
    generations(events)
        .filter(|g| g.record.ts_ms <= t)
        .map(|g| g.generation)
        .max()
        .unwrap_or(0)
}

/// When every node that recorded generation `g` by `t` last (re)entered it: the earliest of
/// their newest records of it. A node fenced while etcd restarted records the generation again
/// when it joins it again; while another node still holds its first record, this is that one.
fn g0_entered_by_all(events: &[Record], g: u64, t: u64) -> u64 {
    let mut newest: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for s in generations(events).filter(|s| s.generation == g && s.record.ts_ms <= t) {
        let e = newest.entry(s.record.node.as_str()).or_default();
        *e = (*e).max(s.record.ts_ms);
    }
    newest.values().copied().min().unwrap_or(0)
}

pub fn effects(events: &[Record], fired: &[Fired]) -> Vec<FaultEffect> {
    fired
        .iter()
        .map(|f| {
            let t = f.at_unix_ms;
            let g0 = generation_at(events, t);
            let detection_ms = events
                .iter()
                .filter(|e| e.ts_ms >= t)
                .filter(|e| match e.event {
                    Event::DrainStarted { .. }
                    | Event::Fenced { .. }
                    | Event::WorkerFailed { .. } => true,
                    Event::Generation { generation, .. } => generation > g0,
                    _ => false,
                })
                .map(|e| e.ts_ms - t)
                .min();
            let next = generations(events)
                .filter(|g| g.record.ts_ms >= t && g.generation > g0)
                .map(|g| g.generation)
                .min();
            // A node that joins a generation again after it trained (fenced while etcd
            // restarted, say) records that generation once more, with the steps trained in it
            // as `prev_last_step`: those are not what this fault undid. Only the records from
            // before a generation first trained count here.
            let before_training = |g: &crate::events::GenerationSeen<'_>| {
                first_steps(events)
                    .filter(|(_, gen_, _)| *gen_ == g.generation)
                    .map(|(e, _, _)| e.ts_ms)
                    .min()
                    .is_none_or(|first| g.record.ts_ms <= first)
            };
            let (resume_step, lost_steps, recovery_ms) = match next {
                Some(n) => {
                    let gens: Vec<_> = generations(events)
                        .filter(|g| g.generation == n)
                        .filter(before_training)
                        .collect();
                    // What training resumed from: `n`'s resume step, or, when `n` was
                    // superseded before it trained (re-formed to resume from a newer commit
                    // of its predecessor, or broken by another fault), that of the first
                    // later generation that trained.
                    let trained = first_steps(events)
                        .filter(|(e, g, _)| e.ts_ms >= t && *g >= n)
                        .map(|(_, g, _)| g)
                        .min()
                        .unwrap_or(n);
                    let resumed: Vec<_> = generations(events)
                        .filter(|g| g.generation == trained)
                        .filter(before_training)
                        .collect();
                    let resume = resumed
                        .iter()
                        .find_map(|g| g.resume_step)
                        .or_else(|| gens.iter().find_map(|g| g.resume_step))
                        // Only nodes that healed from peers: they went on from at least the
                        // step they joined at.
                        .or_else(|| resumed.iter().chain(&gens).find_map(|g| g.heal_step));
                    let reached = resumed
                        .iter()
                        .chain(gens.iter())
                        .filter_map(|g| g.prev_last_step)
                        .max();
                    // `prev_last_step` is the newest step any generation reported. When the
                    // generation the fault hit never trained (it was still starting), those
                    // steps were lost by the fault that ended an earlier one, not by this.
                    let next_ts = gens
                        .iter()
                        .map(|g| g.record.ts_ms)
                        .min()
                        .unwrap_or(u64::MAX);
                    // Nor when every node of it joined it again (fenced while etcd restarted)
                    // and restarted its workers from a commit, and it has not trained since:
                    // the steps past that commit were lost when they were fenced.
                    let g0_entered = g0_entered_by_all(events, g0, t);
                    let g0_trained = first_steps(events)
                        .any(|(e, g, _)| g == g0 && e.ts_ms >= g0_entered && e.ts_ms < next_ts);
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
                    let rec = first_steps(events)
                        .filter(|(e, g, _)| e.ts_ms >= t && *g >= n)
                        .map(|(e, _, _)| e.ts_ms - t)
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
