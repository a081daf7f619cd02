//! Who is in the job: membership and rendezvous on etcd v3, and the scaling policy.
//!
//! # Layout
//!
//! - [`core`]: the pure decision core. Time and observations in, a [`Decision`] and its
//!   [`Reason`] out; no etcd, no clock reads. Driven by the table in `testdata/decide.json`.
//! - [`scaling`]: the pure scaling policy (LR scale, global batch, grad accumulation, warm-up)
//!   and the `ELASTIC_*` variables it exports.
//! - [`record`]: the versioned JSON records stored in etcd ([`Generation`] and friends) and
//!   their never-panicking parsers.
//! - [`keys`]: the etcd key layout under `/elastic-run/<job>/`, and why it keeps no garbage.
//! - [`etcd`]: the thin adapter that drives the core through etcd v3: leases, leader election,
//!   fenced generation writes, watches; [`Rendezvous::join`] returns the agent's [`Handle`].
//! - [`error`]: the public [`Error`] enum.
//!
//! # Tests
//!
//! - `cargo test -p elastic`: the decision table (`testdata/decide.json`), a seeded random
//!   sweep of the core (`ELASTIC_SEED=<n>` replays one), the scaling table, record parsing,
//!   and the real-etcd tests in `tests/etcd.rs` (they start etcd through the `services` crate;
//!   `--nocapture` prints the measured detection times).
//! - `cargo run --release -p elastic --example scale -- 1000`: 1,000 members against one etcd;
//!   the figures are in `BENCHMARKS.md`.
//! - `elastic/fuzz` (own workspace, `cargo +nightly fuzz run records`): every record parser on
//!   arbitrary bytes; `tests/records.rs` runs seeded mutations through the same entry point
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
