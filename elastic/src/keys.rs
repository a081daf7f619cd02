//! The etcd key layout of one job. Everything lives under `/elastic-run/<job>/`:
//!
//! | key                       | value            | lease                  | written by            |
//! |---------------------------|------------------|------------------------|-----------------------|
//! | `members/<node>`          | [`MemberRecord`] | the member's own lease | the member (join)     |
//! | `ctl/leader`              | [`LeaderRecord`] | the leader's lease     | create-only campaign  |
//! | `ctl/generation`          | [`Generation`]   | the leader's lease     | the leader, fenced    |
//! | `ctl/commit`              | [`CommitRecord`] | the leader's lease     | `report_commit`       |
//! | `ctl/drain/<node>`        | empty            | the member's own lease | `request_drain`       |
//! | `ctl/waiting`             | [`WaitingRecord`]| the leader's lease     | the leader, below min |
//! | `ctl/state`               | [`JobState`]     | a retention lease      | `finish` / the leader |
//!
//! Why this shape:
//! - Followers watch only `ctl/`; only the leader watches `members/`. A join therefore wakes one
//!   watcher, not all of them, which keeps a 1,000-node rendezvous cheap.
//! - Every key is attached to a lease, so nothing piles up: when the last agent of a job dies,
//!   its keys expire with its lease. The generation and the newest commit hang on the leader's
//!   lease; when the leader dies, the new leader re-writes both from its own copy (every agent
//!   holds the last generation and commit it saw) before it re-forms the job. `ctl/state`
//!   keeps the outcome of a finished job for [`STATE_RETENTION_S`] so `status` can show it.
//!
//! [`MemberRecord`]: crate::record::MemberRecord
//! [`LeaderRecord`]: crate::record::LeaderRecord
//! [`Generation`]: crate::record::Generation
//! [`CommitRecord`]: crate::record::CommitRecord
//! [`JobState`]: crate::record::JobState
//! [`WaitingRecord`]: crate::record::WaitingRecord

/// How long a finished job's `ctl/state` stays readable.
pub const STATE_RETENTION_S: i64 = 24 * 3600;

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
}
