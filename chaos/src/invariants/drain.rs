//! Why a preemption's drain may lose what a crash loses: it saves the step every rank agrees
//! on, so anything that takes a rank of its generation away around the drain (a fence, a kill,
//! a cut network, a full staging disk, a newer generation) leaves it nothing to save. Used by
//! the lost-work check (`faults.rs`); each rule names the soak that found it.

use super::Fired;
use super::effects::generation_at;
use crate::events::{Event, Record, generations};
use crate::scenario::{FaultKind, Network, Scenario};

/// Whether the drain of node `node`, whose preemption came at `t` and was acted on
/// `detection_ms` later, could not save its step for a reason outside it: then it may lose
/// what a crash loses.
pub(super) fn could_not_save(
    s: &Scenario,
    events: &[Record],
    fired: &[Fired],
    node: usize,
    t: u64,
    detection_ms: u64,
) -> bool {
    fenced_at(events, node, t)
        || fenced_during_drain(events, node, t)
        || peer_fenced_during_drain(events, node, t)
        || peer_killed_during_drain(events, fired, node, t)
        || cut_off_at(fired, node, t)
        || staging_full_anywhere_at(fired, t)
        || group_failed_at(events, fired, t)
        || superseded_at(events, t)
        || peer_cut_off_during(s, fired, node, t, t + detection_ms)
}

/// Whether node `node` was fenced at `t`: its last `fenced` event before `t` came after its
/// last `joined`.
fn fenced_at(events: &[Record], node: usize, t: u64) -> bool {
    fenced_name_at(events, &format!("node{node}"), t)
}

/// [`fenced_at`] for the node named `name`.
fn fenced_name_at(events: &[Record], name: &str, t: u64) -> bool {
    let last = |fenced: bool| {
        events
            .iter()
            .filter(|e| e.node == name && e.ts_ms <= t)
            .filter(|e| match e.event {
                Event::Fenced { .. } => fenced,
                Event::Joined { .. } => !fenced,
                _ => false,
            })
            .map(|e| e.ts_ms)
            .max()
    };
    match (last(true), last(false)) {
        (Some(f), Some(j)) => f >= j,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Whether node `node` itself was fenced while its drain that began at `t` was under way
/// (before it left the job or exited): its lease lapsed (etcd restarting, say), so it had to
/// stop its workers and could no longer commit the drained step. Soak 20261222, run 78: etcd
/// restarted, node0's notice came 1.1 s later, and its lease lapsed 96 ms into the drain.
fn fenced_during_drain(events: &[Record], node: usize, t: u64) -> bool {
    let me = format!("node{node}");
    let end = drain_end(events, node, t);
    events.iter().any(|e| {
        e.node == me && (t..=end).contains(&e.ts_ms) && matches!(e.event, Event::Fenced { .. })
    })
}

/// Whether a peer of `node` in the generation current at `t` was fenced at `t`, or was fenced
/// later while `node`'s drain was still under way (before `node` left the job or exited): its
/// workers were stopped (its lease lapsed, as every node's may while etcd restarts), so the
/// preempted node's workers can neither agree on the drained step with it nor get its part of
/// it. A lease that lapses 20 ms into the drain was lost to the same outage as one that lapsed
/// 20 ms before it (soak 20261219).
fn peer_fenced_during_drain(events: &[Record], node: usize, t: u64) -> bool {
    let g = generation_at(events, t);
    let me = format!("node{node}");
    let drain_end = drain_end(events, node, t);
    let members: std::collections::BTreeSet<&str> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::Generation {
                generation,
                members,
                ..
            } if *generation == g => Some(members),
            _ => None,
        })
        .flatten()
        .map(String::as_str)
        .collect();
    members.into_iter().filter(|m| *m != me).any(|m| {
        fenced_name_at(events, m, t)
            || events.iter().any(|e| {
                e.node == m
                    && (t..=drain_end).contains(&e.ts_ms)
                    && matches!(e.event, Event::Fenced { .. })
            })
    })
}

/// When the drain of node `node` that began at `t` ended: the node left the job or exited
/// (`t` when neither was recorded).
fn drain_end(events: &[Record], node: usize, t: u64) -> u64 {
    let me = format!("node{node}");
    events
        .iter()
        .filter(|e| e.node == me && e.ts_ms >= t)
        .filter(|e| matches!(e.event, Event::Left { .. } | Event::Exit { .. }))
        .map(|e| e.ts_ms)
        .min()
        .unwrap_or(t)
}

/// Whether another node's agent or worker was killed (or a worker stopped) while node `node`'s
/// drain that began at `t` was under way: a rank of the generation is gone, so the drained step
/// cannot be agreed on or saved by every rank, and the drain loses what that crash loses (soak
/// 20261221: a SIGKILL 0.3 s into a peer's drain).
fn peer_killed_during_drain(events: &[Record], fired: &[Fired], node: usize, t: u64) -> bool {
    let end = drain_end(events, node, t);
    fired.iter().any(|f| {
        f.skipped.is_none()
            && f.fault.node != node
            && matches!(
                f.fault.kind,
                FaultKind::SigkillAgent | FaultKind::SigkillWorker | FaultKind::SigstopWorker
            )
            && (t..=end).contains(&f.at_unix_ms)
    })
}

/// Whether node `node` was cut off from etcd (a partition or a blackhole of it in effect) at
/// `t`: like a fenced node, it cannot tell its peers of a drain, and is fenced moments later.
fn cut_off_at(fired: &[Fired], node: usize, t: u64) -> bool {
    fired.iter().any(|f| {
        f.skipped.is_none()
            && f.fault.node == node
            && matches!(f.fault.kind, FaultKind::Partition | FaultKind::Blackhole)
            && f.at_unix_ms <= t
            && t <= f.at_unix_ms + f.fault.duration_ms
    })
}

/// Whether a node other than `node` was partitioned or blackholed at some time in `[from, to]`
/// with every node in a network namespace (so the fault takes its link to its peers down too,
/// not only its way to etcd and the store): while the preempted node's drain got going, a peer
/// its workers cannot reach cannot agree on the drained step nor save its part of it. On the
/// loopback these faults cut etcd and the store only, and the workers still agree.
fn peer_cut_off_during(s: &Scenario, fired: &[Fired], node: usize, from: u64, to: u64) -> bool {
    s.network == Network::Netns
        && fired.iter().any(|f| {
            f.skipped.is_none()
                && f.fault.node != node
                && matches!(f.fault.kind, FaultKind::Partition | FaultKind::Blackhole)
                && f.at_unix_ms <= to
                && from <= f.at_unix_ms + f.fault.duration_ms
        })
}

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

/// Whether the worker group current at `t` had already failed by then: a worker of that
/// generation failed, or an agent or a worker was killed in it. Its survivors cannot save an
/// agreed step (a rank is gone), so the group restarts from the newest commit, and a drain
/// then loses what that failure loses.
fn group_failed_at(events: &[Record], fired: &[Fired], t: u64) -> bool {
    let g = generation_at(events, t);
    let worker_failed = events.iter().any(|e| {
        e.ts_ms <= t && matches!(e.event, Event::WorkerFailed { generation, .. } if generation == g)
    });
    worker_failed
        || fired.iter().any(|f| {
            f.skipped.is_none()
                && matches!(
                    f.fault.kind,
                    FaultKind::SigkillAgent | FaultKind::SigkillWorker
                )
                && f.at_unix_ms <= t
                && generation_at(events, f.at_unix_ms) == g
        })
}

/// Whether a generation newer than the one current at `t` had been frozen by then: the
/// group running at `t` was already stopping for it (to admit a node, say) and restarts
/// from the newest commit, so a drain then has nothing left to save; it loses what that
/// generation change loses.
fn superseded_at(events: &[Record], t: u64) -> bool {
    let g = generation_at(events, t);
    generations(events).any(|s| s.generation > g && s.frozen_unix_ms.is_some_and(|f| f <= t))
}
