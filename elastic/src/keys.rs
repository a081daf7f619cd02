//! The etcd key layout of one job. Everything lives under `/elastic-run/<job>/`:
//!
//! | key                  | value             | lease                  | written by                       |
//! |----------------------|-------------------|------------------------|----------------------------------|
//! | `members/<node>`     | [`MemberRecord`]  | the member's own lease | the member (join)                |
//! | `ctl/leader`         | [`LeaderRecord`]  | the leader's lease     | create-only campaign             |
//! | `ctl/generation`     | [`Generation`]    | the leader's lease     | the leader, fenced               |
//! | `ctl/commit`         | [`CommitRecord`]  | the leader's lease     | `report_commit`                  |
//! | `ctl/drain/<node>`   | empty             | the member's own lease | `request_drain`                  |
//! | `ctl/waiting`        | [`WaitingRecord`] | the leader's lease     | the leader, below min            |
//! | `ctl/state`          | [`JobState`]      | a retention lease      | `finish` / the leader            |
//! | `ctl/restart/<node>` | [`RestartRecord`] | the member's own lease | `request_restart`                |
//! | `ctl/regroup/<node>` | [`RestartRecord`] | the member's own lease | `request_regroup`, and each live member's rendezvous task confirming it |
//! | `ctl/epoch`          | [`EpochRecord`]   | a retention lease      | the leader, with each generation |
//!
//! Why this shape:
//! - Followers watch only `ctl/`; only the leader watches `members/`. A join therefore wakes one
//!   watcher, not all of them, which keeps a 1,000-node rendezvous cheap.
//! - Every key is attached to a lease, so nothing piles up: when the last agent of a job dies,
//!   its keys expire with its lease. The generation and the newest commit hang on the leader's
//!   lease; when the leader dies, the new leader re-writes both from its own copy (every agent
//!   holds the last generation and commit it saw) before it re-forms the job. `ctl/state`
//!   keeps the outcome of a finished job for [`STATE_RETENTION_S`] so `status` can show it.
//! - `ctl/epoch` (the highest generation number frozen) is written in the same transaction as
//!   each generation, under a retention lease of [`STATE_RETENTION_S`] that the leader replaces
//!   every [`EPOCH_REFRESH_S`] while the job lives (revoking the one before). It outlives a
//!   total loss, so generation numbers keep growing, and expires a day after the job is gone.
//!   One key and at most a few leases per job id: nothing piles up.
//! - Restart requests are one key per requester, not one shared key: a request for an older
//!   generation written late must not overwrite a current one. The leader acts on a request
//!   while its generation is current, so any number of requests for one generation give one
//!   new generation; the keys go with the requesters' leases. Regroup requests (a collective
//!   failed) are the same, and a member confirms one by writing its own.
//!
//! [`MemberRecord`]: crate::record::MemberRecord
//! [`LeaderRecord`]: crate::record::LeaderRecord
//! [`Generation`]: crate::record::Generation
//! [`CommitRecord`]: crate::record::CommitRecord
//! [`JobState`]: crate::record::JobState
//! [`WaitingRecord`]: crate::record::WaitingRecord
//! [`RestartRecord`]: crate::record::RestartRecord
//! [`EpochRecord`]: crate::record::EpochRecord

/// How long a finished job's `ctl/state` stays readable, and `ctl/epoch` after the job's last
/// leader is gone.
pub const STATE_RETENTION_S: i64 = 24 * 3600;
/// How often a leader moves `ctl/epoch` to a fresh retention lease.
pub const EPOCH_REFRESH_S: u64 = 3600;

/// The root every job lives under.
pub const ROOT: &str = "/elastic-run/";

/// Keys of one job.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(job_id: &str) -> Self {
        Self {
            prefix: format!("{ROOT}{job_id}/"),
        }
    }
    /// `/elastic-run/<job>/`
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    pub fn members_prefix(&self) -> String {
        format!("{}members/", self.prefix)
    }
    pub fn member(&self, node_id: &str) -> String {
        format!("{}members/{node_id}", self.prefix)
    }
    pub fn ctl_prefix(&self) -> String {
        format!("{}ctl/", self.prefix)
    }
    pub fn leader(&self) -> String {
        format!("{}ctl/leader", self.prefix)
    }
    pub fn generation(&self) -> String {
        format!("{}ctl/generation", self.prefix)
    }
    pub fn commit(&self) -> String {
        format!("{}ctl/commit", self.prefix)
    }
    pub fn drain_prefix(&self) -> String {
        format!("{}ctl/drain/", self.prefix)
    }
    pub fn drain(&self, node_id: &str) -> String {
        format!("{}ctl/drain/{node_id}", self.prefix)
    }
    pub fn waiting(&self) -> String {
        format!("{}ctl/waiting", self.prefix)
    }
    pub fn state(&self) -> String {
        format!("{}ctl/state", self.prefix)
    }
    pub fn restart_prefix(&self) -> String {
        format!("{}ctl/restart/", self.prefix)
    }
    pub fn restart(&self, node_id: &str) -> String {
        format!("{}ctl/restart/{node_id}", self.prefix)
    }
    pub fn regroup(&self, node_id: &str) -> String {
        format!("{}ctl/regroup/{node_id}", self.prefix)
    }
    pub fn epoch(&self) -> String {
        format!("{}ctl/epoch", self.prefix)
    }
}
