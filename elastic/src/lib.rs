//! Who is in the job: membership and rendezvous on etcd v3, and the scaling policy.
//!
//! # Layout
//!
//! - [`core`]: the pure decision core. Time and observations in, a [`Decision`] and its
//!   [`Reason`] out; no etcd, no clock reads. Driven by the table in `testdata/decide.json`.
//! - [`scaling`]: the pure scaling policy (LR scale, global batch, grad accumulation, warm-up),
//!   with the per-worker batch and base LR possibly unknown, and the `ELASTIC_*` variables it
//!   exports (only the values it knows; the runtime writes no others).
//! - [`record`]: the versioned JSON records stored in etcd ([`Generation`] and friends) and
//!   their never-panicking parsers.
//! - [`keys`]: the etcd key layout under `/elastic-run/<job>/`, and why it keeps no garbage.
//! - [`etcd`]: the thin adapter that drives the core through etcd v3; [`Rendezvous::join`]
//!   returns the agent's [`Handle`]. Its files:
//!   - `etcd/connect.rs`, `etcd/config.rs`: how to reach etcd (endpoints, auth, TLS) and the
//!     [`RendezvousConfig`] with its checks.
//!   - `etcd/join.rs`: registration under a lease, the `MASTER_PORT` reservation, and the start
//!     of the two background tasks; `etcd/handle.rs`: the [`Handle`] and its [`Snapshot`].
//!   - `etcd/lease.rs`: lease renewal, and fencing before the TTL ends.
//!   - `etcd/driver.rs`: the per-handle task: read, watch, publish, campaign, re-sync;
//!     `etcd/view.rs`: the job as it sees it, parsed from the keys.
//!   - `etcd/leader.rs`: the leader's decisions (fenced generation freezing, the waiting
//!     notice, failing the job); `etcd/epoch.rs`: `ctl/epoch` on its retention lease.
//!   - `etcd/state.rs`: the job's outcome (`ctl/state`); `etcd/status.rs`: [`status`];
//!     `etcd/ops.rs`: single fenced etcd transactions.
//! - [`error`]: the public [`Error`] enum.
//!
//! # Tests
//!
//! - `cargo test -p elastic`: one integration test binary, `tests/suite/main.rs`, with a module
//!   per area: the decision table (`decide_table.rs`, reading `testdata/decide.json`), a seeded
//!   random sweep of the core (`decide_props.rs`; `ELASTIC_SEED=<n>` replays one), the scaling
//!   table (`scaling_table.rs`), record parsing (`records.rs`), and the real-etcd tests
//!   (`etcd.rs`; they start etcd through the `services` crate, `--nocapture` prints the
//!   measured detection times).
//! - `cargo run --release -p elastic --example scale -- 1000`: 1,000 members against one etcd;
//!   the figures are in `BENCHMARKS.md`.
//! - `elastic/fuzz` (own workspace, `cargo +nightly fuzz run records`): every record parser on
//!   arbitrary bytes; `tests/suite/records.rs` runs seeded mutations through the same entry point
//!   on stable.

pub mod core;
pub mod error;
pub mod etcd;
pub mod keys;
pub mod record;
pub mod scaling;

pub use crate::core::{Decision, JoinPolicy, Reason};
pub use crate::error::{Error, Result};
pub use crate::etcd::{Handle, Rendezvous, RendezvousConfig, Snapshot, Status, status};
pub use crate::record::{Generation, RankedMember};
pub use crate::scaling::{OnIndivisible, ScalingConfig, ScalingDecision, ScalingMode};
