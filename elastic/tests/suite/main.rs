//! The integration tests of `elastic`, in one binary (one link instead of one per file), a
//! module per area:
//!
//! - `decide_table`: the pure decision core against the cases in `testdata/decide.json`.
//! - `decide_props`: a seeded random sweep of the core (`ELASTIC_SEED=<n>` replays a failure).
//! - `scaling_table`: the scaling policy.
//! - `records`: record parsing, and the fuzz target's property on stable.
//! - `etcd`: rendezvous against a real etcd started by the `services` crate; these run one at
//!   a time, and re-execute this binary for the SIGKILL tests' member processes.
//!
//! `cargo test -p elastic --test suite etcd::` runs one module.

mod decide_props;
mod decide_table;
mod etcd;
mod records;
mod scaling_table;
