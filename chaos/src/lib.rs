//! `elastic-chaos`: breaks an elastic-run job on purpose and checks, by invariants, that
//! training survives correctly.
//!
//! # Layout
//!
//! - [`scenario`]: the TOML scenario format and the seeded fault schedule (the same seed
//!   replays the same schedule).
//! - [`proxy`]: a TCP fault proxy (per-node etcd partitions and black holes; object-store
//!   outages, slowness and 503s).
//! - [`netns`]: a network namespace per simulated node, with a real address on a private
//!   bridge, for scenarios whose partitions must cut a node off from its peers too.
//! - [`harness`]: runs a scenario: etcd, moto, proxies, N `elastic-run` agents as simulated
//!   nodes (on loopback, or each in its own network namespace), the faults, then the checks and
//!   the report. `harness/`: the run loop in `mod.rs`, the nodes in `nodes.rs`, fault injection
//!   in `faults.rs` (the staging tmpfs mounts in `mounts.rs`), processes in `procs.rs`, what a
//!   run left in `end_state.rs`.
//! - [`events`]: the agents' `--events-file` read back as the runtime's typed records
//!   (`runtime::events::Record`); a line that is no record is reported by file and line.
//! - [`invariants`]: the checks, pure functions of the events, faults and end state;
//!   `invariants/`: one file per family (`job.rs`, `store.rs`, `faults.rs`, `training.rs`).
//!   The runtime constants they depend on (the commit pipeline's depth, retention's default)
//!   come from the `runtime` crate, not copies.
//! - [`watch`]: watches the checkpoint store during a run (the newest commit never goes back,
//!   nothing visible as committed is partial).
//! - [`report`]: the JSON report and the SVG timeline.
//! - [`weights`]: final weights against a fault-free reference, within a tolerance when the
//!   world size changed.
//! - `src/main.rs`: `elastic-chaos run SCENARIO` and `elastic-chaos soak --minutes N`.
//! - `scenarios/`: the CI campaign (SIGKILL, preemption, partition, store outage, store
//!   slowness and errors with a SIGKILL, a fixed-batch shrink compared with a reference run,
//!   a fenced node that joins again after the last leader left, store faults in place, a
//!   joiner whose source peer dies while the group forms, two nodes lost inside one
//!   confirmation window in place);
//!   `tests/campaign.rs` runs it.

pub mod events;
pub mod harness;
pub mod invariants;
pub mod netns;
pub mod proxy;
pub mod report;
pub mod scenario;
pub mod watch;
pub mod weights;
