//! Sharded, streaming, atomically committed checkpoints in object storage.
//!
//! # Layout
//!
//! - [`alloc`]: the allocator setting the binaries make at start (freed buffers go back).
//! - [`format`](mod@format): the on-bucket format (key layout, manifest schema v1, commit rule). Start here.
//! - [`header`]: safetensors header reading and writing, with limits.
//! - [`codec`]: per-chunk compression (`raw`, `zstd-blocks`; `zstd` and `zstd-planes` of format 2
//!   are still read).
//! - [`store`]: [`Store`], a URL-addressed location with retries, deadlines, cancellation.
//! - [`save`]: streaming save of a writer's part, and [`Store::commit`].
//!   Its private submodules: `save/input.rs` (directory walk, headers, chunk plan),
//!   `save/upload.rs` ([`Store::save_part`]: encode and upload chunks, then the part record;
//!   [`Store::abandon_part`]) and `save/commit.rs` ([`Store::commit`]: merge the part records
//!   into the manifest; [`Store::read_manifest`]).
//! - [`restore`]: listing, verification, resharded restore and byte-identical pull. `restore.rs`
//!   plans each output file ([`Store::pull`], [`Store::restore`]); its private submodules:
//!   `restore/steps.rs` (which steps exist, [`Store::latest_committed`], the fallback past a
//!   step that does not verify), `restore/read.rs` (fetch a chunk and check its checksums,
//!   [`Store::verify`]) and `restore/write.rs` (copy decoded chunks into output files that
//!   appear only complete; export uses it too).
//! - [`export`](mod@export): one entry of a step's state (a module's weights) written as
//!   Hugging Face safetensors, one file or shards and an index ([`Store::export`]); the
//!   names come from the state skeleton in the manifest's metadata. It plans the output and
//!   leaves the reading and writing to `restore/write.rs`, as `pull` and `restore` do.
//! - [`retention`]: the retention policy (a pure planner) and garbage collection.
//! - [`copy`]: copying committed steps between stores.
//! - [`error`]: the public [`Error`] (with `is_permanent`, `is_integrity`).
//! - `local` (private): durable local writes (temp file, fsync, rename, fsync dir); its
//!   [`durable::write_file_durable`] and [`durable::fsync_dir`] are public as [`durable`].
//! - `src/bin/elastic-ckpt/`: the command-line tool
//!   (`push pull export restore ls show verify gc cp`).
//! - `tests/`: one test binary (`tests.rs`: conformance on memory/file/S3, bad input, crash,
//!   faults, CLI, GCS reads, PyTorch interop, export) plus `azure.rs` (Azurite needs its own
//!   process).
//! - `fuzz/`: cargo-fuzz targets, outside the workspace
//!   (`cd checkpoint/fuzz && cargo +nightly fuzz run manifest_parse`).
//! - `examples/bench.rs`: the figures in `BENCHMARKS.md`.
//!
//! # The API the node agent uses
//!
//! ```no_run
//! # async fn agent() -> checkpoint::Result<()> {
//! use checkpoint::*;
//! let store = Store::open("s3://bucket/job42")?; // or file:///…, az://…, gs://…, memory://
//! let cancel = CancellationToken::new();
//!
//! // Each rank (or node) saves its staged part; returns once its bytes are durable.
//! let part = PartInput {
//!     writer: "rank-3".into(),                       // unique per step
//!     source: PartSource::Dir("/dev/shm/job42/step-100/rank-3".into()),
//!     shards: Default::default(),                    // or __metadata__["elastic.shards"]
//! };
//! let record: PartRecord = store.save_part(100, part, &SaveOptions::default(), &cancel).await?;
//!
//! // One agent (any, or several racing) commits once every expected writer is durable.
//! let req = CommitRequest {
//!     world_size: 8,
//!     writers: (0..8).map(|r| format!("rank-{r}")).collect(),
//!     metadata: serde_json::json!({"lr_scale": 2.0, "loader_index": 12345}),
//! };
//! match store.commit(100, req, &cancel).await? {
//!     CommitOutcome::Committed(_) => {}          // we wrote the manifest
//!     CommitOutcome::AlreadyCommitted(_) => {}   // someone else did: same result
//! }
//!
//! // On (re)start: pick the step once, then every rank restores it into its staging dir.
//! let latest: Option<Manifest> = store.latest_committed(&cancel).await?;
//! if let Some(m) = latest {
//!     let report = store
//!         .restore(Some(m.step), 3, 4, "/dev/shm/job42/restore/rank-3".as_ref(),
//!                  &ReadOptions::default(), &cancel)
//!         .await?;
//!     // report.path is `<dest>/state.safetensors`; `<dest>/metadata.json` has the metadata.
//! }
//! # Ok(()) }
//! ```
//!
//! - [`Store::open`]`(url)` / [`Store::open_with_options`]`(url, [(key, value)])`: backends by
//!   URL; credentials from the usual environment (`AWS_*` incl. `AWS_ENDPOINT` and
//!   `AWS_ALLOW_HTTP`, `AZURE_*`, `GOOGLE_*`). `memory://` is a fresh empty store per call.
//!   Credentials never appear in errors or logs (URLs are shown without user-info or query).
//! - [`Store::save_part`]`(step, PartInput, &SaveOptions, &cancel) -> PartRecord`. Memory is
//!   bounded by `3 × concurrency × chunk_bytes_max` (384 MiB by default); each chunk is
//!   retried within [`StoreOptions::deadline_ms`]; chunks of 16 MiB and more go up multipart.
//!   Each call uses a fresh attempt id, so retrying a save is safe.
//! - [`Store::commit`]`(step, CommitRequest, &cancel) -> CommitOutcome`: lists the durable part
//!   records, takes the newest attempt of each expected writer, checks every object's length,
//!   validates the merged manifest and writes it create-only. Fails with
//!   [`Error::Incomplete`] naming missing writers.
//! - [`Store::latest_committed`], [`Store::committed_steps`], [`Store::read_manifest`],
//!   [`Store::list_steps`], [`Store::verify`], [`Store::pull`], [`Store::restore`],
//!   [`Store::export`], [`Store::gc`], [`Store::copy_step`].
//!
//! Restore with `step: None` picks the newest committed step that restores for this rank, and
//! falls back (with a warning) when it is corrupt or incomplete. Ranks restoring
//! independently could in principle land on different steps when a chunk only some ranks read
//! is corrupt; the agent should pick the step once ([`Store::latest_committed`]) and pass
//! `Some(step)` to every rank, treating a rank's failure as a failure of that step.
//!
//! Sharded tensors are cut along dim 0. A writer declares a shard through
//! [`PartInput::shards`] or its file's `__metadata__["elastic.shards"]`
//! (`{"name": {"global_shape": [..], "dim0_offset": n}}`); restore gives rank `r` of `W` the
//! rows PyTorch's `Shard(0)` gives it ([`restore::rows_for_rank`]: chunks of `ceil(rows / W)`,
//! possibly none) and declares them the same way in its output.

pub mod alloc;
pub mod codec;
pub mod copy;
pub mod error;
pub mod export;
pub mod format;
pub mod header;
mod local;

/// Durable local writes, the ones this crate makes its own local files with, for callers
/// that keep small files of their own next to a checkpoint (markers, state).
pub mod durable {
    pub use crate::local::{fsync_dir, write_file_durable};
}
pub mod restore;
pub mod retention;
pub mod save;
pub mod store;

pub use error::{Error, Result};
pub use export::ExportReport;
pub use format::{Manifest, PartRecord, ShardSpec};
pub use restore::{ReadEvent, ReadEvents, ReadOptions, RestoreReport};
pub use retention::RetentionPolicy;
pub use save::{CommitOutcome, CommitRequest, Compression, PartInput, PartSource, SaveOptions};
pub use store::{ReadStats, Store, StoreOptions};
pub use tokio_util::sync::CancellationToken;
