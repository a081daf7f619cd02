//! The etcd v3 adapter: registers this node, keeps its lease, elects a leader, and lets the
//! leader drive the [`core`](crate::core) by fenced transactions. The key layout is in
//! [`keys`](crate::keys).
//!
//! - `connect.rs`: how to reach etcd ([`Connect`]: endpoints, [`Auth`], [`Tls`]).
//! - `config.rs`: [`RendezvousConfig`] and its checks.
//! - `join.rs`: [`Rendezvous::join`]: registration under a fresh lease, the `MASTER_PORT`
//!   reservation, and the start of the three background tasks.
//! - `handle.rs`: the agent's [`Handle`] and the [`Snapshot`] it reads.
//! - `lease.rs`: lease renewal, and fencing before the TTL ends (first background task).
//! - `driver.rs`: the per-handle task (second background task): read, watch, publish the
//!   snapshot, campaign, re-sync.
//! - `view.rs`: the job as the driver sees it, parsed from the keys.
//! - `regroup.rs`: a member's side of a regroup: confirming it, and deposing a leader that
//!   does not confirm within the window.
//! - `leader.rs`: the leader's decisions: generation freezing, the waiting notice, failing the
//!   job.
//! - `epoch.rs`: the leader's upkeep of `ctl/epoch` on its retention lease.
//! - `state.rs`: the job's outcome (`ctl/state`): finish, fail, and a stale one cleared.
//! - `status.rs`: [`status`], a job read without joining.
//! - `commit.rs`: recording commits in `ctl/commit`, awaited or by the handle's third
//!   background task, which never holds up the agent's loop.
//! - `ops.rs`: single fenced etcd operations ([`campaign`], [`write_generation`]).
//!
//! # Timing
//!
//! - A member renews its lease every TTL/3. When no renewal was acknowledged for
//!   `TTL - fence_margin` (default margin TTL/4), [`Handle::fenced`] resolves: the member
//!   learns it is out *before* etcd expires the lease and peers act on it.
//! - A SIGKILLed member is gone when etcd expires its lease (TTL, plus up to ~0.5 s of etcd's
//!   expiry sweep); the leader re-forms after the settle window. A graceful [`Handle::leave`]
//!   revokes the lease, so peers see it within milliseconds.
//! - The leader key hangs on the leader's lease; when it dies, the others campaign at once,
//!   so a new leader is in place within one TTL of the old leader's last renewal.
//! - etcd restarts shorter than `TTL - fence_margin` are ridden out (leases survive a restart);
//!   longer outages fence every member, as lost leases. Generation numbers keep growing
//!   across such a total loss (`ctl/epoch`, see [`keys`](crate::keys)).
//! - [`Handle::request_restart`] is one put; the leader freezes the restart generation as soon
//!   as its watch delivers it (no settle window), so every member sees the new generation a
//!   few etcd round trips later (1-20 ms on loopback in `tests/suite/etcd.rs`).
//! - A watch that falls behind an etcd compaction (etcd cancels it with the compact revision)
//!   re-reads the job and watches again from there; [`Handle::watch_compactions_total`]
//!   counts it.

mod commit;
mod config;
mod connect;
mod driver;
mod epoch;
mod handle;
mod join;
mod leader;
mod lease;
mod ops;
mod regroup;
mod state;
mod status;
mod view;

pub use config::RendezvousConfig;
pub use connect::{Auth, Connect, Tls};
pub use handle::{Handle, Snapshot};
pub use join::Rendezvous;
pub use ops::{campaign, write_generation};
pub use status::{Status, status};

/// Default lease TTL.
pub const LEASE_TTL_MS_DEFAULT: u64 = 10_000;
/// Default settle window.
pub const SETTLE_MS_DEFAULT: u64 = 1_000;
/// Default time the job may stay below `min` nodes.
pub const BELOW_MIN_TIMEOUT_MS_DEFAULT: u64 = 600_000;
/// Bound on any single etcd request (besides the lease logic, which has its own deadline).
pub const REQUEST_TIMEOUT_MS_DEFAULT: u64 = 5_000;
