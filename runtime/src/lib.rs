//! The elastic-run node agent. The Rust worker client and the agent ↔ worker protocol are the
//! `elastic-run-worker` crate (`runtime/worker/`, lib `worker`); the Python client is
//! `python/`.
//!
//! # Layout
//!
//! - [`agent`]: the node agent, from command line to exit code: membership (standalone,
//!   static, or etcd v3 through the `elastic` crate), one worker group per generation,
//!   restarts, drains, checkpoint hand-off. [`signals`] and [`notice`] (cloud preemption
//!   notices) start its drain; [`logging`] sets up `tracing`; [`events`] writes the
//!   `--events-file` log that tools follow.
//! - [`cli`]: the command line, torchrun's flags (and `PET_*` variables) plus elastic-run's.
//!   [`status`]: `elastic-run status`.
//! - [`scaling`]: the workers' view of the `elastic` crate's scaling policy.
//! - [`worker_env`]: the environment contract every worker starts with, a pure function of a
//!   [`worker_env::WorkerSpec`] and a [`worker_env::GenerationView`].
//! - [`supervisor`]: starts, watches and stops the workers of one node (process groups,
//!   `PR_SET_PDEATHSIG`, hang watchdog); [`output`] prefixes their lines with the rank.
//! - [`state`]: [`state::AgentState`], what the agent tells its workers and learned from them
//!   (shared by the socket server, the supervisor, the committer and the agent loop), and the
//!   handling of one worker request, checked against [`worker::protocol`].
//! - [`agent_socket`]: the Unix-socket server workers talk to; each line goes to
//!   [`state::AgentState::handle_line`].
//! - [`checkpoint_sink`]: when every local rank has staged a step; [`store_sink`]: streams
//!   staged steps through the `checkpoint` crate to any store, commits them across nodes, and
//!   restores a committed step resharded for this node's ranks.
//! - [`metrics`]: Prometheus counters and gauges, served on `--metrics-addr`; it renders from
//!   its own counters and the gauges a [`metrics::Source`] hands it (the agent's state is
//!   one), and imports none of the modules above.
//! - `python/`: the `elastic_run` worker client (pip-installable); `worker/`: the
//!   `elastic-run-worker` crate, the protocol and the same client for Rust workers (feature
//!   `tch`: `VarStore`s).
//! - `tests/`: end-to-end tests: `agent.rs` (one node), `elastic.rs` (several agents on a
//!   real etcd, S3 via moto, PyTorch gloo), `store_sink.rs` (the store sink on real stores).

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
pub mod state;
pub mod status;
pub mod store_sink;
pub mod supervisor;
pub mod worker_env;
