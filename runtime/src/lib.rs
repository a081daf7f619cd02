//! The elastic-run node agent and the worker client libraries.
//!
//! # Layout
//!
//! - [`agent`]: the node agent: one run from command line to exit code (standalone today;
//!   the seam where `elastic` generations plug in). [`signals`] and [`notice`] (cloud
//!   preemption notices) start its drain; [`logging`] sets up `tracing`.
//! - [`cli`]: the command line, torchrun's flags (and `PET_*` variables) plus elastic-run's.
//! - [`scaling`]: the pure scaling decision (LR scale, grad accumulation, global batch).
//! - [`worker_env`]: the environment contract every worker starts with, a pure function of a
//!   [`worker_env::WorkerSpec`] and a [`worker_env::GenerationView`].
//! - [`supervisor`]: starts, watches, restarts and stops the workers of one node;
//!   [`output`] prefixes their output lines with the rank.
//! - [`agent_socket`]: the agent ↔ worker Unix-socket protocol and its server.
//! - [`checkpoint_sink`]: the [`checkpoint_sink::CheckpointSink`] seam and the local `file://`
//!   sink.
//! - [`metrics`]: Prometheus counters and gauges, served on `--metrics-addr`.
//! - `python/`: the `elastic_run` worker client (pip-installable).
//!
//! # Seams for the other crates
//!
//! - **Membership (`elastic`)**: a generation record maps onto
//!   [`worker_env::GenerationView`] (world size, node rank and count, rank offset, master
//!   address and port, the [`scaling::Scaling`] decision, the resume step). The agent starts the
//!   supervisor with the first view and sends each later one as
//!   [`supervisor::Command::NewGeneration`]; the supervisor stops the workers (SIGTERM, grace,
//!   SIGKILL) and restarts them with the new ranks without spending a restart. A peer loss is
//!   the same command; a lost lease is [`supervisor::Command::Stop`]. Today
//!   [`agent::standalone_generation`] is the only source of views.
//! - **Checkpoints (`checkpoint`)**: [`checkpoint_sink::CheckpointSink`]. The agent collects
//!   `saved` reports until every local rank staged a step, then calls `commit` (in order, one
//!   at a time, from a bounded queue) and `latest` before the first worker starts. The object
//!   store sink replaces [`checkpoint_sink::LocalDirSink`] for non-`file://` URLs.

pub mod agent;
pub mod agent_socket;
pub mod checkpoint_sink;
pub mod cli;
pub mod logging;
pub mod metrics;
pub mod notice;
pub mod output;
pub mod scaling;
pub mod signals;
pub mod supervisor;
pub mod worker_env;
