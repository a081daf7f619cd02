//! The elastic-run node agent. The Rust worker client and the agent ↔ worker protocol are the
//! `elastic-run-worker` crate (`runtime/worker/`, lib `worker`); the Python client is
//! `python/`.
//!
//! # Layout
//!
//! - [`agent`]: the node agent, from command line to exit code, as a pure decision core
//!   with thin I/O around it (`runtime/src/agent/`): [`agent::decide`] says what a running
//!   group must do when etcd's view changes and what follows the end of a group (table:
//!   `testdata/agent_decide.json`); `config.rs` reads the command line; `start.rs` creates
//!   what the agent runs with; `rdzv_host.rs` finds or serves the etcd of `--rdzv-backend
//!   c10d` at the endpoint `rdzv_endpoint.rs` parses and matches against this machine; `membership.rs` follows the job (fixed, or an etcd member);
//!   `group.rs` runs one worker group; `after.rs` carries out the decision; `drain.rs`,
//!   `committer.rs` (the agent's commit queue) and `dirs.rs` (run and staging directories)
//!   serve them. [`signals`] and [`notice`] (cloud preemption notices; `notice/`: the
//!   watch and its types in `mod.rs`, one file per cloud, `aws.rs`, `gcp.rs`, `azure.rs`,
//!   and the shared HTTP client in `http.rs`) start its drain; [`logging`] sets up
//!   `tracing`; [`events`] writes the `--events-file` log that tools follow, one
//!   [`events::Event`] per line, read back as an [`events::Record`].
//! - [`cli`]: the command line, torchrun's flags (and `PET_*` variables) plus elastic-run's,
//!   split into the flags (`cli/mod.rs`), their value types (`values.rs`), the store options
//!   (`store.rs`) and the scaling flags (`scaling.rs`, read into the `elastic` crate's
//!   [`elastic::ScalingConfig`]). [`status`]: `elastic-run status`.
//! - [`worker_env`]: the environment contract every worker starts with, a pure function of a
//!   [`worker_env::WorkerSpec`] and a [`worker_env::GenerationView`]. The scaling policy and
//!   its `ELASTIC_*` variables are the `elastic` crate's ([`elastic::scaling`]): standalone
//!   and static runs decide with it here, etcd runs take the leader's decision from the
//!   generation record.
//! - [`supervisor`]: starts, watches and stops the workers of one node (process groups,
//!   `PR_SET_PDEATHSIG`, hang watchdog); [`failure`] is what a failed worker reports
//!   (torchrun's root-cause summary, the `@record` error file); [`logs`]
//!   says where each worker's stdout and stderr go (inherited by default; `--redirects`,
//!   `--tee`, `--log-dir` in torchrun's layout), and [`output`] copies teed lines to their
//!   files and, prefixed, to the console.
//! - [`state`]: [`state::AgentState`], what the agent tells its workers and learned from them
//!   (shared by the socket server, the supervisor, the committer and the agent loop), and the
//!   handling of one worker request, checked against [`worker::protocol`].
//! - [`agent_socket`]: the Unix-socket server workers talk to; each line goes to
//!   [`state::AgentState::handle_line`].
//! - [`pipeline`]: the commit pipeline: [`pipeline::StepTracker`] says when every local rank
//!   has staged a step; [`pipeline::StoreSink`] streams staged steps through the `checkpoint`
//!   crate to any store and commits them across nodes (`commit.rs`), and restores a committed
//!   step resharded for this node's ranks (`restore.rs`).
//! - [`metrics`]: Prometheus counters and gauges, served on `--metrics-addr`; it renders from
//!   its own counters and the gauges a [`metrics::Source`] hands it (the agent's state is
//!   one), and imports none of the modules above.
//! - `python/`: the `elastic_run` worker client (pip-installable); `worker/`: the
//!   `elastic-run-worker` crate, the protocol and the same client for Rust workers (feature
//!   `tch`: `VarStore`s).
//! - `tests/`: one integration binary (`tests/tests.rs`): `suite/agent.rs` (one node),
//!   `suite/elastic.rs` (several agents on a real etcd, S3 via moto, PyTorch gloo),
//!   `suite/store_sink.rs` (the sink on real stores), `suite/agent_decide.rs` (the decision
//!   table and sweep).

pub mod agent;
pub mod agent_socket;
pub mod cli;
pub mod events;
pub mod failure;
pub mod logging;
pub mod logs;
pub mod metrics;
pub mod notice;
pub mod output;
pub mod pipeline;
pub mod signals;
pub mod standby;
pub mod state;
pub mod status;
pub mod supervisor;
pub mod worker_env;
