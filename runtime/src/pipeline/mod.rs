//! The commit pipeline, from a worker's `saved` to a committed step, and back at restore:
//!
//! 1. the socket server hands each staged part to the agent ([`crate::agent_socket`]);
//! 2. [`StepTracker`] says when every local rank has staged a step;
//! 3. the agent's committer queues complete steps, bounded, and commits them in order
//!    (`agent/pipeline.rs`);
//! 4. [`StoreSink`] uploads this node's parts and commits the step once every rank of the
//!    generation is durable, racing the other nodes (`commit.rs`), then applies retention;
//! 5. at a new generation, [`StoreSink::restore_or_older`] lays the resume step out for this
//!    node's ranks, falling back past steps that do not verify (`restore.rs`).

mod commit;
mod restore;
mod sink;
mod sources;
#[cfg(test)]
mod tests;
mod tracker;

pub use sink::{
    Committed, KEEP_STEPS_DEFAULT, RESTORED_MARKER, SinkError, SinkOptions, StepToCommit,
    StoreSink, writer_id,
};
pub use tracker::{PENDING_STEPS_MAX, StepTracker};
