//! Streaming save of a rank's part, and the commit that makes a step exist.
//!
//! - `input` (private): reading a part's input (a directory walk, safetensors headers) and
//!   planning its chunks.
//! - `upload` (private): [`Store::save_part`] (read, encode and upload the chunks, then the
//!   part record) and [`Store::abandon_part`].
//! - `commit` (private): [`Store::commit`] (merge the durable part records into the manifest
//!   and write it create-only) and [`Store::read_manifest`].
//! - Here: the options and inputs of a save. Which rank writes which replicated tensor is the
//!   worker's rule (`elastic-run-worker`'s `assign_keys`, and the Python client's): a part
//!   holds whatever its writer staged.
//!
//! # Memory and concurrency bound
//!
//! A save reads, encodes and uploads at most `concurrency` chunks at a time. While a chunk is
//! encoded it holds its raw bytes, the encoded output and one byte plane with its compressed
//! form (at most `3 × chunk_bytes_max`); while it uploads, only the encoded bytes. So a save's
//! data memory is bounded by `3 × concurrency × chunk_bytes_max` (384 MiB with the defaults),
//! whatever the part's size. Headers are held in full (each bounded by
//! [`crate::header::HEADER_BYTES_MAX`]).

mod commit;
mod input;
mod upload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::format::ShardSpec;
use crate::store::Store;

pub use commit::{CommitOutcome, CommitRequest};

/// Called with a byte count as data is moved.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// Where a part's safetensors files come from.
#[derive(Debug, Clone)]
pub enum PartSource {
    /// Every `*.safetensors` file under a directory (recursively), named by its path relative
    /// to it.
    Dir(PathBuf),
    /// Named files on disk.
    Files(Vec<(String, PathBuf)>),
    /// Named in-memory safetensors buffers.
    Buffers(Vec<(String, Bytes)>),
}

/// One writer's contribution to a step.
#[derive(Debug, Clone)]
pub struct PartInput {
    /// Writer id, unique within the step (e.g. `rank-3`): `[A-Za-z0-9_.-]{1,64}`.
    pub writer: String,
    pub source: PartSource,
    /// Tensors that are shards of a bigger tensor cut along dim 0. Declarations found in a
    /// file's `__metadata__["elastic.shards"]` are used too; these take precedence.
    pub shards: BTreeMap<String, ShardSpec>,
}

/// Whether to compress chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Compression {
    /// On remote object stores, not on `file://` or `memory://`
    /// ([`Store::compression_pays`]).
    #[default]
    Auto,
    /// Try every chunk (each is still stored raw when compression does not pay).
    Always,
    /// Store every chunk raw.
    Never,
}

impl Compression {
    /// The `compress` flag of [`SaveOptions`] for saves into `store`.
    pub fn for_store(self, store: &Store) -> bool {
        match self {
            Compression::Auto => store.compression_pays(),
            Compression::Always => true,
            Compression::Never => false,
        }
    }
}

/// Tunables for a save.
#[derive(Clone)]
pub struct SaveOptions {
    /// Upper bound of one chunk's decoded size.
    pub chunk_bytes_max: usize,
    /// Chunks read, encoded and uploaded at once.
    pub concurrency: usize,
    /// Try compression per chunk (stored raw when it does not pay).
    pub compress: bool,
    pub progress: Option<Progress>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            chunk_bytes_max: 32 * 1024 * 1024,
            concurrency: 4,
            compress: true,
            progress: None,
        }
    }
}

impl std::fmt::Debug for SaveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("chunk_bytes_max", &self.chunk_bytes_max)
            .field("concurrency", &self.concurrency)
            .field("compress", &self.compress)
            .finish()
    }
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
