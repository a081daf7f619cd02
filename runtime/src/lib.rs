//! The elastic-run node agent and the worker client libraries.
//!
//! # Layout
//!
//! - [`agent`]: the node agent, from command line to exit code: membership (standalone,
//!   static, or etcd v3 through the `elastic` crate), one worker group per generation,
//!   restarts, drains, checkpoint hand-off. [`signals`] and [`notice`] (cloud preemption
//!   notices; `notice/`: the watch and its types in `mod.rs`, one file per cloud, `aws.rs`,
//!   `gcp.rs`, `azure.rs`, and the shared HTTP client in `http.rs`) start its drain;
//!   [`logging`] sets up `tracing`; [`events`] writes the `--events-file` log that tools
//!   follow, one [`events::Event`] per line, read back as an [`events::Record`].
//! - [`cli`]: the command line, torchrun's flags (and `PET_*` variables) plus elastic-run's.
//!   [`status`]: `elastic-run status`.
//! - [`scaling`]: the workers' view of the `elastic` crate's scaling policy.
//! - [`worker_env`]: the environment contract every worker starts with, a pure function of a
//!   [`worker_env::WorkerSpec`] and a [`worker_env::GenerationView`].
//! - [`supervisor`]: starts, watches and stops the workers of one node (process groups,
//!   `PR_SET_PDEATHSIG`, hang watchdog); [`output`] prefixes their lines with the rank.
//! - [`agent_socket`]: the agent ↔ worker Unix-socket protocol and its server.
//! - [`checkpoint_sink`]: when every local rank has staged a step; [`store_sink`]: streams
//!   staged steps through the `checkpoint` crate to any store, commits them across nodes, and
//!   restores a committed step resharded for this node's ranks.
//! - [`metrics`]: Prometheus counters and gauges, served on `--metrics-addr`.
//! - `python/`: the `elastic_run` worker client (pip-installable); [`worker`]: the same
//!   contract for Rust workers, and `worker_tch` (feature `tch`) for `VarStore`s.
//! - `tests/`: end-to-end tests: `agent.rs` (one node), `elastic.rs` (several agents on a
//!   real etcd, S3 via moto, PyTorch gloo).

pub mod agent;
pub mod agent_socket;
pub mod checkpoint_sink;
pub mod cli;
pub mod events;
pub mod logging;
pub mod metrics;
pub mod notice;
pub mod output;
pub mod scaling;
pub mod signals;
pub mod status;
pub mod store_sink;
pub mod supervisor;
pub mod worker;
pub mod worker_env;
#[cfg(feature = "tch")]
pub mod worker_tch;
