//! The worker side of elastic-run, for Rust training processes: what a worker needs and
//! nothing of the agent (no async runtime, no stores, no etcd).
//!
//! - [`protocol`]: the agent ↔ worker contract, shared with the agent (the `runtime` crate
//!   serves and checks it with these very types): the socket's [`protocol::Request`] and
//!   [`protocol::Reply`], the staged and restored snapshot layout and its format version, and
//!   the limits the agent enforces ([`protocol::MESSAGE_BYTES_MAX`],
//!   [`protocol::STEP_MAX`], [`protocol::METADATA_BYTES_MAX`]).
//! - [`Worker`]: the client. It reads the environment `elastic-run` sets, reports progress,
//!   asks whether to stop or checkpoint, saves this rank's share of a snapshot into staging
//!   ([`Worker::save_tensors`]) and loads the restored step ([`Worker::load_tensors`]).
//! - For `tch` models, the `elastic-run-worker-tch` crate (`runtime/worker-tch`, lib
//!   `worker_tch`) saves and loads `VarStore`s (a model, and an optimizer's state kept as a
//!   second `VarStore`) through a [`Worker`]. It is a crate of its own so that only programs
//!   that use tch link libtorch.
//!
//! The Python client (`runtime/python/elastic_run`) speaks the same protocol and writes the
//! same snapshots; `tests/python_client.rs` checks that it still parses here.
//!
//! ```no_run
//! # fn main() -> Result<(), worker::WorkerError> {
//! let mut w = worker::Worker::from_env()?;
//! let start = w.load_tensors()?.map_or(0, |l| l.step);
//! for step in start + 1..=100 {
//!     // ... train one step ...
//!     w.report_progress(step)?;
//!     let stop = w.should_stop(step)?;
//!     if stop || w.should_checkpoint(step) {
//!         w.save_tensors(step, &[], serde_json::json!({"data_pos": step}))?;
//!     }
//!     if stop {
//!         break;
//!     }
//! }
//! # Ok(())
//! # }
//! ```

mod client;
pub mod protocol;
mod sources;

pub use client::{Loaded, SnapshotTensor, Worker, WorkerError, assign_keys};
