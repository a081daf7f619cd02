//! The pure rendezvous decision core: no etcd, no clock reads, no I/O.
//!
//! [`decide`] takes everything it needs as data (the time in milliseconds, the members the
//! leader observes, the current generation, the newest commit, the configuration) and returns a
//! [`Decision`] with its [`Reason`]. The etcd adapter feeds it and carries out the decision; the
//! table in `testdata/decide.json` drives it in tests.
//!
//! # Rules
//!
//! - *Eligible* members are present, not draining, and not `excluded` (left out of a regroup
//!   lately). A member is *waiting* when it is eligible and not in the current generation.
//! - **Initial formation** (no generation yet): freeze at once when `max` eligible members are
//!   present; freeze when at least `min` are present and the settle window since the last
//!   membership change has passed; otherwise wait.
//! - **Loss**: a member of the current generation that is no longer present is lost. The next
//!   generation keeps the eligible survivors in their existing relative order and appends all
//!   waiting members (the job restarts anyway, so every join policy admits them at this
//!   boundary), ordered by join time then node id, up to `max`. It is frozen at once at `max`,
//!   or when every lost member had drained (`drained`: it announced its leaving and saved
//!   first) and no member drains now, or when every survivor confirmed a regroup of the
//!   current generation (a collective failure, see below: a leader lost that way is deposed,
//!   and the next leader sees a loss) and no member drains now, else after the settle window.
//! - **Undersized** (the generation is smaller than `min`, which was raised since): re-form it
//!   as after a loss.
//! - **Draining**: while a member of the current generation is draining (saving before it
//!   leaves), keep the generation; it is re-formed when the member is gone.
//! - **Scale-up** (nothing lost, members waiting, fewer than `max` in the generation): the join
//!   policy says when the waiters are admitted:
//!   - `Immediate`: now (after the settle window, or at once when this reaches `max`);
//!   - `AfterCommit`: once a checkpoint was committed at or after the waiter joined, so the
//!     restart loses no work; only waiters that joined before that commit are admitted;
//!   - `Waiting(k)`: once `k` members are waiting (or the waiters would fill the job to `max`).
//! - **Below `min`**: wait for replacements until `below_min_timeout_ms` after the eligible
//!   count first dropped below `min`, then fail the job.
//! - **Collective failure** (a member's workers saw a collective fail, and it asked to regroup
//!   the current generation: `regroup.generation` equals `current_number`): every live member
//!   confirms by asking too. Once every present member of the generation confirmed, or
//!   `confirm_window_ms` after the first request, freeze a new generation at once with the
//!   members that confirmed, in their order, plus waiters up to `max` (as after a loss). A
//!   member that did not confirm is left out: a node that died, or cannot reach etcd, is not
//!   waited for until its lease lapses. Nodes left out are `excluded` from the waiters (the
//!   adapter excludes them for a lease TTL, unless they registered again), so a dead node whose
//!   lease still runs is not admitted back. Fewer than `min` confirmed, or the same members
//!   again (everyone confirmed and nobody waits: the workers' own failure, for the restart
//!   path and `--max-restarts` to decide), or a member draining: the other rules apply.
//!   Checked after a loss, before a restart request.
//! - **Restart** (a member asked to restart the current generation after its workers failed:
//!   `restart_requested_for` equals `current_number`): when nothing was lost, freeze a new
//!   generation at once, without the settle window, with the same members in the same order
//!   (but draining ones, who leave anyway), plus waiters up to `max` (every worker restarts
//!   anyway, so, as after a loss, every join policy admits them at this boundary), if that is
//!   at least `min`; otherwise the other rules apply. A request for an older generation is
//!   stale and ignored: it was served (or overtaken by a loss), so several requests for one
//!   generation give one new generation. A loss or an undersized generation is handled by its
//!   own rule first.
//! - **Stale resume** (the newest commit was saved by an older generation than the current
//!   one, and is newer than the step the current generation resumes from: the previous
//!   generation's commit pipeline finished it after the freeze): freeze a new generation at
//!   once with the same members in the same order, plus waiters up to `max`, so that it
//!   resumes from that commit rather than redo committed steps on a branch of its own. Checked
//!   after a loss, a restart request and a drain (each re-forms the generation anyway, or will).
//! - Members beyond `max` are spares: they wait until a slot frees.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// When new nodes are admitted into a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinPolicy {
    /// At the next settle boundary.
    Immediate,
    /// After the next checkpoint commit, so the restart loses no work.
    AfterCommit,
    /// Once this many nodes are waiting.
    Waiting(u32),
}

/// The core's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CoreConfig {
    pub min_nodes: u32,
    pub max_nodes: u32,
    /// How long membership must be unchanged before a generation is frozen below `max`.
    pub settle_ms: u64,
    pub join_policy: JoinPolicy,
    /// How long the job may stay below `min` before it fails.
    pub below_min_timeout_ms: u64,
    /// How long after a regroup request the members that did not confirm it are waited for.
    #[serde(default = "default_confirm_window_ms")]
    pub confirm_window_ms: u64,
}

/// [`CoreConfig::confirm_window_ms`] unless configured (`--rdzv-conf confirm_window_ms=`).
/// A live member's rendezvous task confirms on the watch event of the request, one etcd put
/// later: within 1-45 ms in the CI chaos scenarios on 2 loaded cores. The window mostly waits
/// for the member that was lost, so it is most of an in-place recovery; a live member it
/// misses is left out, fenced, and joins the next generation, healing from its peers.
pub const CONFIRM_WINDOW_MS_DEFAULT: u64 = 250;

fn default_confirm_window_ms() -> u64 {
    CONFIRM_WINDOW_MS_DEFAULT
}

/// A regroup of the current generation asked for (a member's collective failed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Regroup {
    /// The generation it names.
    pub generation: u64,
    /// When the leader first saw a request for it, on `now_ms`'s clock.
    pub since_ms: u64,
    /// The members that asked or confirmed.
    pub confirmed: Vec<String>,
}

impl CoreConfig {
    /// Checks the ranges: `1 <= min <= max`, and `k >= 1` for `Waiting(k)`.
    pub fn validate(&self) -> crate::Result<()> {
        if self.min_nodes == 0 {
            return Err(crate::Error::InvalidConfig {
                field: "min_nodes",
                reason: "must be at least 1".into(),
            });
        }
        if self.max_nodes < self.min_nodes {
            return Err(crate::Error::InvalidConfig {
                field: "max_nodes",
                reason: format!("{} is below min_nodes {}", self.max_nodes, self.min_nodes),
            });
        }
        if self.join_policy == JoinPolicy::Waiting(0) {
            return Err(crate::Error::InvalidConfig {
                field: "join_policy",
                reason: "waiting(k) needs k >= 1".into(),
            });
        }
        Ok(())
    }
}

/// A member's state as the leader observes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// Registered and renewing its lease.
    Alive,
    /// Announced that it leaves soon (preemption); not admitted into new generations.
    Draining,
}

/// One member as observed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observed {
    pub node_id: String,
    pub state: MemberState,
    /// When it registered, as an order key shared with [`CommitInfo::at`]. The etcd adapter
    /// uses the registration's etcd revision, which every node agrees on (no clock skew).
    pub joined_at: u64,
}

/// The newest committed checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitInfo {
    pub step: u64,
    /// When it was recorded, on the same order key as [`Observed::joined_at`].
    pub at: u64,
    /// The generation whose workers saved it, when the reporter knew.
    #[serde(default)]
    pub generation: Option<u64>,
}

/// Timing state derived from successive observations; see [`Tracker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Timing {
    /// When the observed membership (ids and states) last changed.
    pub changed_at_ms: u64,
    /// Since when fewer than `min` eligible members are present, if they are.
    pub below_min_since_ms: Option<u64>,
}

/// Everything [`decide`] looks at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub now_ms: u64,
    pub members: Vec<Observed>,
    /// The current generation's members in rank order; `None` before the first generation.
    pub current: Option<Vec<String>>,
    pub last_commit: Option<CommitInfo>,
    pub timing: Timing,
    /// The current generation's number; 0 before the first.
    #[serde(default)]
    pub current_number: u64,
    /// The newest generation a member asked to restart (its workers failed), if any; the
    /// adapter leaves out requests naming a generation newer than the current one (none can
    /// exist but through a bug), so they cannot hide a current one. Only a request naming
    /// `current_number` counts.
    #[serde(default)]
    pub restart_requested_for: Option<u64>,
    /// The step the current generation resumes from; `None` when it started from scratch.
    #[serde(default)]
    pub current_resume_step: Option<u64>,
    /// A regroup asked for, if any (only one naming `current_number` counts).
    #[serde(default)]
    pub regroup: Option<Regroup>,
    /// Present members not admitted as waiters: left out of a regroup lately, with the same
    /// registration (they may be dead with a lease still running).
    #[serde(default)]
    pub excluded: Vec<String>,
    /// Members of the current generation the leader saw draining (they leave once their
    /// drained step is committed).
    #[serde(default)]
    pub drained: Vec<String>,
}

/// Why the core decided what it decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Reason {
    /// Nothing changed that needs a new generation.
    Stable,
    /// Members wait, but the generation is at `max`.
    Full { waiting: u32 },
    /// A member of the current generation is draining; re-form once it is gone.
    Draining { nodes: Vec<String> },
    /// Waiters are held back until a commit after they joined.
    AwaitingCommit { waiting: u32 },
    /// Waiters are held back until `k` are waiting.
    AwaitingJoiners { waiting: u32, k: u32 },
    /// Membership changed recently; wait for the settle window.
    Settling,
    /// `max` members are present.
    AtMax,
    /// At least `min` members and the settle window passed.
    Settled,
    /// Members of the current generation are gone.
    MembersLost { lost: Vec<String> },
    /// The current generation is smaller than `min` (raised since it was formed).
    Undersized { size: u32, min: u32 },
    /// Waiters admitted by the join policy.
    ScaleUp { admitted: Vec<String> },
    /// Fewer than `min` eligible members.
    BelowMin { present: u32, min: u32 },
    /// A member asked for a restart of the current generation (its workers failed).
    RestartRequested { generation: u64 },
    /// A member's collective failed: the members that confirmed in time re-form the job.
    CollectiveFailed {
        generation: u64,
        left_out: Vec<String>,
    },
    /// A regroup was asked for; waiting for these members to confirm.
    Confirming {
        generation: u64,
        waiting_for: Vec<String>,
    },
    /// The previous generation committed a newer step after the current one was frozen:
    /// its members would redo committed steps on another branch of the run.
    StaleResume {
        resume: Option<u64>,
        committed: u64,
        by_generation: u64,
    },
    /// Below `min` for longer than the timeout.
    BelowMinTimeout {
        present: u32,
        min: u32,
        waited_ms: u64,
    },
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reason::Stable => write!(f, "stable"),
            Reason::Full { waiting } => write!(f, "at max; {waiting} spare(s) waiting"),
            Reason::Draining { nodes } => write!(f, "draining: {}", nodes.join(",")),
            Reason::AwaitingCommit { waiting } => {
                write!(f, "{waiting} waiting for the next checkpoint commit")
            }
            Reason::AwaitingJoiners { waiting, k } => write!(f, "{waiting} of {k} joiners waiting"),
            Reason::Settling => write!(f, "settling"),
            Reason::AtMax => write!(f, "max nodes present"),
            Reason::Settled => write!(f, "min nodes present and settled"),
            Reason::MembersLost { lost } => write!(f, "members lost: {}", lost.join(",")),
            Reason::Undersized { size, min } => {
                write!(f, "generation of {size} is below min {min}")
            }
            Reason::ScaleUp { admitted } => write!(f, "admitting: {}", admitted.join(",")),
            Reason::BelowMin { present, min } => write!(f, "{present} present, below min {min}"),
            Reason::RestartRequested { generation } => {
                write!(f, "restart of generation {generation} requested")
            }
            Reason::CollectiveFailed {
                generation,
                left_out,
            } => {
                if left_out.is_empty() {
                    write!(
                        f,
                        "a collective of generation {generation} failed; every member confirmed"
                    )
                } else {
                    write!(
                        f,
                        "a collective of generation {generation} failed; left out (did not confirm): {}",
                        left_out.join(",")
                    )
                }
            }
            Reason::Confirming {
                generation,
                waiting_for,
            } => {
                write!(
                    f,
                    "regroup of generation {generation}: waiting for {} to confirm",
                    waiting_for.join(",")
                )
            }
            Reason::StaleResume {
                resume,
                committed,
                by_generation,
            } => match resume {
                Some(r) => write!(
                    f,
                    "generation {by_generation} committed step {committed} after this generation was frozen to resume from step {r}"
                ),
                None => write!(
                    f,
                    "generation {by_generation} committed step {committed} after this generation was frozen to start from scratch"
                ),
            },
            Reason::BelowMinTimeout {
                present,
                min,
                waited_ms,
            } => write!(
                f,
                "{present} present, below min {min} for {waited_ms} ms: giving up"
            ),
        }
    }
}

/// What the leader should do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Decision {
    /// Keep the current generation (or keep waiting without a deadline).
    Keep { reason: Reason },
    /// Write a new generation with these members in rank order.
    Freeze {
        members: Vec<String>,
        reason: Reason,
    },
    /// Decide again at `until_ms` (or earlier, if membership changes).
    Wait { until_ms: u64, reason: Reason },
    /// Fail the job.
    Fail { reason: Reason },
}

impl Decision {
    pub fn reason(&self) -> &Reason {
        match self {
            Decision::Keep { reason }
            | Decision::Freeze { reason, .. }
            | Decision::Wait { reason, .. }
            | Decision::Fail { reason } => reason,
        }
    }
}

/// Decides what the leader does now. Pure: the same input always gives the same decision.
pub fn decide(cfg: &CoreConfig, input: &Input) -> Decision {
    let now = input.now_ms;
    let by_id: BTreeMap<&str, &Observed> = input
        .members
        .iter()
        .map(|m| (m.node_id.as_str(), m))
        .collect();
    let excluded: BTreeSet<&str> = input.excluded.iter().map(String::as_str).collect();
    let eligible_count = input
        .members
        .iter()
        .filter(|m| m.state == MemberState::Alive && !excluded.contains(m.node_id.as_str()))
        .count() as u32;
    let settle_until = input.timing.changed_at_ms.saturating_add(cfg.settle_ms);
    let max = cfg.max_nodes as usize;

    let current: &[String] = input.current.as_deref().unwrap_or(&[]);
    let in_current: BTreeSet<&str> = current.iter().map(String::as_str).collect();
    let mut waiting: Vec<&Observed> = input
        .members
        .iter()
        .filter(|m| m.state == MemberState::Alive && !in_current.contains(m.node_id.as_str()))
        .filter(|m| !excluded.contains(m.node_id.as_str()))
        .collect();
    waiting
        .sort_by(|a, b| (a.joined_at, a.node_id.as_str()).cmp(&(b.joined_at, b.node_id.as_str())));

    let below_min = |present: u32| -> Decision {
        let since = input.timing.below_min_since_ms.unwrap_or(now);
        let deadline = since.saturating_add(cfg.below_min_timeout_ms);
        if now >= deadline {
            Decision::Fail {
                reason: Reason::BelowMinTimeout {
                    present,
                    min: cfg.min_nodes,
                    waited_ms: now - since,
                },
            }
        } else {
            Decision::Wait {
                until_ms: deadline,
                reason: Reason::BelowMin {
                    present,
                    min: cfg.min_nodes,
                },
            }
        }
    };
    // Freeze `members` at once at max, after the settle window otherwise.
    let freeze_settled = |members: Vec<String>, reason: Reason| -> Decision {
        if members.len() >= max || now >= settle_until {
            let reason = if members.len() >= max && input.current.is_none() {
                Reason::AtMax
            } else {
                reason
            };
            Decision::Freeze { members, reason }
        } else {
            Decision::Wait {
                until_ms: settle_until,
                reason: Reason::Settling,
            }
        }
    };

    // `kept` and then the waiters, up to `max`, frozen at once when that is at least `min`
    // (a regroup and a restart re-form the job anyway, so every join policy admits waiters).
    let freeze_with_waiters = |mut members: Vec<String>, reason: Reason| -> Option<Decision> {
        members.extend(waiting.iter().map(|m| m.node_id.clone()));
        members.truncate(max);
        (members.len() as u32 >= cfg.min_nodes).then_some(Decision::Freeze { members, reason })
    };

    if input.current.is_none() {
        if eligible_count < cfg.min_nodes {
            return below_min(eligible_count);
        }
        let members: Vec<String> = waiting
            .iter()
            .take(max)
            .map(|m| m.node_id.clone())
            .collect();
        return freeze_settled(members, Reason::Settled);
    }

    let lost: Vec<String> = current
        .iter()
        .filter(|id| !by_id.contains_key(id.as_str()))
        .cloned()
        .collect();
    // A generation below `min` (only possible when `min` was raised between runs) is re-formed
    // like one that lost members.
    let undersized = (current.len() as u32) < cfg.min_nodes;
    // A member draining is saving with the others: the draining rule keeps the generation.
    let draining_now = current
        .iter()
        .any(|id| matches!(by_id.get(id.as_str()), Some(m) if m.state == MemberState::Draining));
    if !lost.is_empty() || undersized {
        let mut members: Vec<String> = current
            .iter()
            .filter(|id| matches!(by_id.get(id.as_str()), Some(m) if m.state == MemberState::Alive))
            .cloned()
            .collect();
        // Every survivor confirmed a regroup of this generation: their workers saw the lost
        // member's collectives fail, and they wait for nothing more (a leader lost that way is
        // deposed, and its successor sees the loss, not the regroup).
        let regroup_confirmed = input.regroup.as_ref().is_some_and(|r| {
            r.generation == input.current_number
                && members.iter().all(|id| r.confirmed.contains(id))
        });
        members.extend(waiting.iter().map(|m| m.node_id.clone()));
        members.truncate(max);
        if (members.len() as u32) < cfg.min_nodes {
            return below_min(eligible_count);
        }
        if members.as_slice() == current {
            // Nothing to gain from a restart: the same members, still below `min`.
            return below_min(eligible_count);
        }
        let drained: BTreeSet<&str> = input.drained.iter().map(String::as_str).collect();
        // The survivors wait for nothing more: the drained members said they would go, and
        // went; another one still draining would start a settle of its own when it goes.
        let all_drained = !lost.is_empty()
            && lost.iter().all(|id| drained.contains(id.as_str()))
            && !draining_now;
        let reason = if lost.is_empty() {
            Reason::Undersized {
                size: current.len() as u32,
                min: cfg.min_nodes,
            }
        } else {
            Reason::MembersLost { lost }
        };
        if all_drained || (regroup_confirmed && !draining_now) {
            return Decision::Freeze { members, reason };
        }
        return freeze_settled(members, reason);
    }

    if let Some(r) = &input.regroup
        && input.current.is_some()
        && r.generation == input.current_number
        && !draining_now
    {
        let confirmed: BTreeSet<&str> = r.confirmed.iter().map(String::as_str).collect();
        let alive: Vec<&String> = current
            .iter()
            .filter(|id| matches!(by_id.get(id.as_str()), Some(m) if m.state == MemberState::Alive))
            .collect();
        let unconfirmed: Vec<String> = alive
            .iter()
            .filter(|id| !confirmed.contains(id.as_str()))
            .map(|id| id.to_string())
            .collect();
        let window_end = r.since_ms.saturating_add(cfg.confirm_window_ms);
        if !unconfirmed.is_empty() && now < window_end {
            return Decision::Wait {
                until_ms: window_end,
                reason: Reason::Confirming {
                    generation: r.generation,
                    waiting_for: unconfirmed,
                },
            };
        }
        let kept: Vec<String> = alive
            .iter()
            .filter(|id| confirmed.contains(id.as_str()))
            .map(|id| id.to_string())
            .collect();
        let reason = Reason::CollectiveFailed {
            generation: r.generation,
            left_out: unconfirmed,
        };
        // Only a change of members re-forms the job: when every member confirmed and nobody
        // waits, the failure is the workers' own (or a link between live nodes), and the
        // failure path (restart requests, counted against `--max-restarts`) decides, rather than
        // a regroup that would form the same generation again and again.
        match freeze_with_waiters(kept, reason) {
            Some(Decision::Freeze { members, .. }) if members.as_slice() == current => {}
            Some(d) => return d,
            None => {}
        }
    }

    if input.current.is_some() && input.restart_requested_for == Some(input.current_number) {
        // The same members (but those draining, who leave anyway), plus waiters up to `max`,
        // at once: every node restarts anyway.
        let kept: Vec<String> = current
            .iter()
            .filter(|id| matches!(by_id.get(id.as_str()), Some(m) if m.state == MemberState::Alive))
            .cloned()
            .collect();
        let reason = Reason::RestartRequested {
            generation: input.current_number,
        };
        if let Some(d) = freeze_with_waiters(kept, reason) {
            return d;
        }
    }

    let draining: Vec<String> = current
        .iter()
        .filter(|id| matches!(by_id.get(id.as_str()), Some(m) if m.state == MemberState::Draining))
        .cloned()
        .collect();
    if !draining.is_empty() {
        return Decision::Keep {
            reason: Reason::Draining { nodes: draining },
        };
    }
    // A step the previous generation's commit pipeline finished after the current one was
    // frozen: re-form with the same members (and waiters, who are admitted at a restart) so
    // that they resume from it instead of redoing it.
    if let Some(c) = input.last_commit
        && let Some(by) = c.generation
        && by < input.current_number
        && input.current_resume_step.is_none_or(|r| r < c.step)
    {
        let mut members = current.to_vec();
        members.extend(waiting.iter().map(|m| m.node_id.clone()));
        members.truncate(max);
        return Decision::Freeze {
            members,
            reason: Reason::StaleResume {
                resume: input.current_resume_step,
                committed: c.step,
                by_generation: by,
            },
        };
    }
    if waiting.is_empty() {
        return Decision::Keep {
            reason: Reason::Stable,
        };
    }
    let free_slots = max.saturating_sub(current.len());
    if free_slots == 0 {
        return Decision::Keep {
            reason: Reason::Full {
                waiting: waiting.len() as u32,
            },
        };
    }
    let admitted: Vec<&Observed> = match cfg.join_policy {
        JoinPolicy::Immediate => waiting.iter().take(free_slots).copied().collect(),
        JoinPolicy::AfterCommit => {
            let eligible: Vec<&Observed> = match input.last_commit {
                Some(c) => waiting
                    .iter()
                    .filter(|m| m.joined_at <= c.at)
                    .take(free_slots)
                    .copied()
                    .collect(),
                None => Vec::new(),
            };
            if eligible.is_empty() {
                return Decision::Keep {
                    reason: Reason::AwaitingCommit {
                        waiting: waiting.len() as u32,
                    },
                };
            }
            eligible
        }
        JoinPolicy::Waiting(k) => {
            if (waiting.len() as u32) < k && waiting.len() < free_slots {
                return Decision::Keep {
                    reason: Reason::AwaitingJoiners {
                        waiting: waiting.len() as u32,
                        k,
                    },
                };
            }
            waiting.iter().take(free_slots).copied().collect()
        }
    };
    let admitted_ids: Vec<String> = admitted.iter().map(|m| m.node_id.clone()).collect();
    let mut members: Vec<String> = current.to_vec();
    members.extend(admitted_ids.iter().cloned());
    freeze_settled(
        members,
        Reason::ScaleUp {
            admitted: admitted_ids,
        },
    )
}

/// Derives [`Timing`] from successive observations: the adapter calls [`Tracker::observe`]
/// with every new view of the members and passes the result to [`decide`].
#[derive(Debug, Clone, Default)]
pub struct Tracker {
    last: Option<BTreeMap<String, MemberState>>,
    timing: Timing,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// `excluded`: members left out of a regroup lately ([`Input::excluded`]); like draining
    /// ones, they do not count toward `min_nodes`.
    pub fn observe(
        &mut self,
        now_ms: u64,
        members: &[Observed],
        excluded: &[String],
        min_nodes: u32,
    ) -> Timing {
        let view: BTreeMap<String, MemberState> = members
            .iter()
            .map(|m| (m.node_id.clone(), m.state))
            .collect();
        if self.last.as_ref() != Some(&view) {
            self.timing.changed_at_ms = now_ms;
            self.last = Some(view);
        }
        let eligible = members
            .iter()
            .filter(|m| m.state == MemberState::Alive && !excluded.contains(&m.node_id))
            .count() as u32;
        if eligible < min_nodes {
            self.timing.below_min_since_ms.get_or_insert(now_ms);
        } else {
            self.timing.below_min_since_ms = None;
        }
        self.timing
    }
}
