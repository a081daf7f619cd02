//! The agent's decisions, pure: what a running group must do when etcd's view changes
//! ([`must_stop`]), what the node does after a worker group ended ([`after_group`]), and
//! whether a failed restore is worth another try ([`restore_is_retryable`]). The I/O around
//! them (the select loop, the committer, etcd) lives in the sibling modules and carries out
//! what these return. Driven by `runtime/testdata/agent_decide.json` and a seeded sweep
//! (`runtime/tests/suite/agent_decide.rs`), in the shape of `elastic::core`.

use elastic::{Generation, Snapshot};
use serde::{Deserialize, Serialize};

/// Why a running group was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopWhy {
    /// A newer generation was frozen (this node may or may not be in it).
    NewGeneration,
    /// This node's lease is about to lapse: peers will re-form without it.
    Fenced,
    /// The job lost members and waits below `min` for replacements.
    Waiting,
    /// Another node marked the job failed.
    JobFailed,
    /// Another node marked the job finished (its workers reached the target, and the step is
    /// committed). Workers of the same generation end on their own; the agent stops any that
    /// have not ended after [`FINISH_GRACE_MS`] (a joiner waiting to heal from a member that
    /// finished would wait forever).
    JobFinished,
}

/// How long workers may go on after another node marked the job finished before the agent
/// stops them.
pub const FINISH_GRACE_MS: u64 = 10_000;

/// Whether the running generation `g` must stop now, given what etcd shows. Generations are
/// ordered by number, never by their leaders' clocks: numbers only grow (`ctl/epoch` keeps
/// them growing across a total loss), while two leaders' `created_unix_ms` may be skewed.
pub fn must_stop(snap: &Snapshot, g: &Generation) -> Option<StopWhy> {
    if snap
        .generation
        .as_ref()
        .is_some_and(|newest| newest.number > g.number)
    {
        return Some(StopWhy::NewGeneration);
    }
    if snap
        .waiting
        .as_ref()
        .is_some_and(|w| w.generation == g.number)
    {
        return Some(StopWhy::Waiting);
    }
    if snap
        .job_state
        .as_ref()
        .is_some_and(|s| s.outcome == elastic::record::Outcome::Failed)
    {
        return Some(StopWhy::JobFailed);
    }
    if snap
        .job_state
        .as_ref()
        .is_some_and(|s| s.outcome == elastic::record::Outcome::Succeeded)
    {
        return Some(StopWhy::JobFinished);
    }
    None
}

/// How a worker group ended, as the decision sees it (the supervisor's `Outcome` without
/// its details).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ended {
    /// Every worker exited 0 on its own.
    Succeeded,
    /// A drain ended the group; `clean`: every worker exited 0 before the deadline.
    Drained { clean: bool },
    /// The agent stopped the group ([`StopWhy`]).
    Stopped,
    /// A worker failed (non-zero exit, a signal, a hang).
    Failed,
}

/// Whose drain was running when the group ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainOf {
    /// This node leaves (a signal, a preemption notice).
    Local,
    /// A peer leaves; this node saves with it and stays.
    Peer,
}

/// What a failure is, once the agent looked at the membership (etcd mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureSeen {
    /// Not looked at yet.
    Unknown,
    /// The same members after the settle window (or a restart generation with them): the
    /// workers themselves failed.
    SameMembers,
    /// A peer came or went: its collective partners failed with it.
    MembershipChanged,
}

/// Everything the decision after a worker group depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AfterGroup {
    pub ended: Ended,
    #[serde(default)]
    pub drain: Option<DrainOf>,
    /// The workers agreed among themselves to stop for another node's drain (they may hear
    /// of it before this agent does).
    #[serde(default)]
    pub peer_stop: bool,
    /// etcd membership (else standalone or static: one view forever).
    pub etcd: bool,
    /// Why the agent stopped the group, when it did.
    #[serde(default)]
    pub stop_why: Option<StopWhy>,
    #[serde(default = "unknown")]
    pub failure: FailureSeen,
    /// Failures counted so far, and `--max-restarts`.
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub max_restarts: u32,
}

fn unknown() -> FailureSeen {
    FailureSeen::Unknown
}

/// What the node does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// This node's drain is over: commit what was staged within the grace, report it, leave
    /// the job; exit 0 when `clean` and every commit landed, else 143.
    Leave { clean: bool },
    /// The training finished: commit what is pending, mark the job finished, leave; exit 0
    /// when every commit landed, else 1.
    Finish,
    /// A peer's drain is over here: commit the agreed step and run the next generation
    /// (the one without the peer).
    NextAfterPeerDrain { clean: bool },
    /// The workers stopped as if drained, with no drain anywhere: leave, exit 1.
    Abort,
    /// The agent stopped the group: let pending commits settle, join again when fenced,
    /// and run the next generation.
    Regroup { rejoin: bool },
    /// A worker failed: first see whether the membership changes within the settle window.
    WatchMembership,
    /// A failure that is not the workers' own (a peer's drain, a membership change): run the
    /// next generation without counting it.
    NextUncounted,
    /// A counted failure with restarts left: count it, ask for a restart generation.
    Restart,
    /// A counted failure past `--max-restarts`: mark the job failed, leave, exit with the
    /// worker's code.
    FailJob,
}

/// Why, in a word a log can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    LocalDrain,
    WorkersFinished,
    PeerDrain,
    /// The workers stopped for a peer's drain that this agent did not hear of.
    PeerStopUnheard,
    DrainedWithoutDrain,
    StoppedByAgent,
    Fenced,
    FailedDuringPeerDrain,
    FailureUnexplained,
    MembershipChanged,
    RestartsLeft,
    RestartsExhausted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    #[serde(flatten)]
    pub action: Action,
    pub reason: Reason,
}

fn decision(action: Action, reason: Reason) -> Decision {
    Decision { action, reason }
}

/// What the node does after a worker group ended. Rules, checked by the sweep:
/// - a local drain ends the node, however the workers ended;
/// - only a failure counts, and only once the membership was seen unchanged (standalone and
///   static have one membership, so there every failure counts); a peer's drain or a
///   membership change never counts;
/// - [`Action::Restart`] only below `--max-restarts`, [`Action::FailJob`] only at it;
/// - the job is marked finished only when the workers finished on their own, with no drain.
pub fn after_group(a: &AfterGroup) -> Decision {
    use Action as A;
    use Reason as R;
    let clean = matches!(a.ended, Ended::Succeeded | Ended::Drained { clean: true });
    if a.drain == Some(DrainOf::Local) {
        return decision(A::Leave { clean }, R::LocalDrain);
    }
    let peer_drain = a.drain == Some(DrainOf::Peer);
    match a.ended {
        // A static job's workers agreeing on a stop is the job's end there: no generation
        // without the peer will come.
        Ended::Succeeded if !peer_drain && (!a.peer_stop || !a.etcd) => {
            decision(A::Finish, R::WorkersFinished)
        }
        Ended::Succeeded | Ended::Drained { .. } if peer_drain => {
            decision(A::NextAfterPeerDrain { clean }, R::PeerDrain)
        }
        Ended::Succeeded | Ended::Drained { .. } if a.peer_stop => {
            decision(A::NextAfterPeerDrain { clean }, R::PeerStopUnheard)
        }
        Ended::Succeeded | Ended::Drained { .. } => decision(A::Abort, R::DrainedWithoutDrain),
        Ended::Stopped => {
            let fenced = a.etcd && a.stop_why == Some(StopWhy::Fenced);
            let reason = if fenced { R::Fenced } else { R::StoppedByAgent };
            decision(A::Regroup { rejoin: fenced }, reason)
        }
        Ended::Failed if peer_drain => decision(A::NextUncounted, R::FailedDuringPeerDrain),
        Ended::Failed => match (a.etcd, a.failure) {
            (true, FailureSeen::Unknown) => decision(A::WatchMembership, R::FailureUnexplained),
            (true, FailureSeen::MembershipChanged) => {
                decision(A::NextUncounted, R::MembershipChanged)
            }
            _ if a.restarts >= a.max_restarts => decision(A::FailJob, R::RestartsExhausted),
            _ => decision(A::Restart, R::RestartsLeft),
        },
    }
}

/// Whether a failed restore may succeed when tried again: local I/O (a full staging disk)
/// and store trouble may pass; a bad request or a cancellation does not. A step that does
/// not verify never reaches here: the sink falls back to an older one.
pub fn restore_is_retryable(e: &crate::pipeline::SinkError) -> bool {
    use crate::pipeline::SinkError as E;
    match e {
        // A panicked task is a bug: trying again runs the same code on the same bytes.
        E::Cancelled { .. } | E::InvalidInput(_) | E::TaskFailed { .. } => false,
        E::Restore { source, .. } => !source.is_integrity(),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_or_an_unreachable_store_is_retried_but_bad_data_and_cancels_are_not() {
        use crate::pipeline::SinkError as E;
        let full = E::Io {
            op: "write",
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&full));
        let restore = |source| E::Restore {
            step: 7,
            rank: 0,
            world: 2,
            url: "file:///b".into(),
            source: Box::new(source),
        };
        let enospc = checkpoint::Error::Io {
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&restore(enospc)));
        let corrupt = checkpoint::Error::Corrupt {
            store: "file:///b".into(),
            step: 7,
            key: "k".into(),
            reason: "crc32c".into(),
        };
        assert!(!restore_is_retryable(&restore(corrupt)));
        assert!(!restore_is_retryable(&E::Cancelled { op: "x".into() }));
        assert!(!restore_is_retryable(&E::InvalidInput("x".into())));
        assert!(!restore_is_retryable(&E::TaskFailed {
            task: "local file",
            message: "panicked".into()
        }));
    }
}
