//! [`StoreSink`]: the agent's handle on the checkpoint store, with its options and errors.
//! Its commit side is in `commit.rs`, its restore side in `restore.rs`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use checkpoint::{CancellationToken, ReadOptions, SaveOptions, Store};
use serde::{Deserialize, Serialize};

use checkpoint::restore::{RESTORE_FILE, RESTORE_METADATA_FILE};
use worker::protocol::{METADATA_BYTES_MAX, RESTORED_META, RESTORED_TENSORS};

use crate::state::StagedPart;

/// The marker listing the finished ranks of a restored step.
pub const RESTORED_MARKER: &str = "restored.json";
/// Version of `restored.json`; a marker of any other version is ignored (restored again).
pub(super) const MARKER_VERSION: u32 = 2;
/// Leftover (never committed) steps younger than this are kept by retention: they may be a
/// step other nodes are still uploading.
pub(super) const LEFTOVER_AGE_MS_MIN: u64 = 3_600_000;
/// Temporary names inside the restore root start with this.
pub(super) const TMP_PREFIX: &str = ".tmp-";
// What the restore lays out is what the workers read (`worker::protocol`'s restored layout).
const _: () = assert!(
    same_str(RESTORE_FILE, RESTORED_TENSORS) && same_str(RESTORE_METADATA_FILE, RESTORED_META)
);

const fn same_str(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Committed steps retention keeps unless told otherwise ([`SinkOptions::keep_steps`]).
pub const KEEP_STEPS_DEFAULT: usize = 3;

/// Tunables, with units in their names. `Debug` shows the keys of `store_config`, never
/// their values (they may be credentials).
#[derive(Clone)]
pub struct SinkOptions {
    /// How long a commit waits for every rank's part to become durable.
    pub commit_wait_ms: u64,
    /// Pause between commit attempts of an incomplete step.
    pub retry_pause_ms: u64,
    /// Committed steps kept by retention (at least 1; 0 makes retention refuse to run).
    pub keep_steps: usize,
    /// Retention also keeps every committed step divisible by this (at least 1).
    pub keep_every: Option<u64>,
    /// Chunking, compression and upload concurrency (bounds memory per part).
    /// [`StoreSink::open`] sets `save.compress` from `compression` and the store.
    pub save: SaveOptions,
    /// Whether chunks are compressed (`auto`: on remote object stores only).
    pub compression: checkpoint::Compression,
    /// Download concurrency of restores.
    pub read: ReadOptions,
    /// Backend configuration keys applied after the environment (`aws_endpoint`,
    /// `azure_storage_account_name`, ...); see `checkpoint::Store::open_with_options`.
    pub store_config: Vec<(String, String)>,
}

impl Default for SinkOptions {
    fn default() -> Self {
        SinkOptions {
            commit_wait_ms: 120_000,
            retry_pause_ms: 200,
            keep_steps: KEEP_STEPS_DEFAULT,
            keep_every: None,
            save: SaveOptions::default(),
            compression: checkpoint::Compression::Auto,
            read: ReadOptions::default(),
            store_config: Vec::new(),
        }
    }
}

impl std::fmt::Debug for SinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.store_config.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("SinkOptions")
            .field("commit_wait_ms", &self.commit_wait_ms)
            .field("retry_pause_ms", &self.retry_pause_ms)
            .field("keep_steps", &self.keep_steps)
            .field("keep_every", &self.keep_every)
            .field("save", &self.save)
            .field("compression", &self.compression)
            .field("read_concurrency", &self.read.concurrency)
            .field("store_config_keys", &keys)
            .finish()
    }
}

/// One step this node staged completely.
#[derive(Debug, Clone)]
pub struct StepToCommit {
    pub step: u64,
    pub generation: u64,
    pub world_size: u32,
    /// Every rank of THIS node in that generation, each `dir` = `staging/step-N/rank-R`
    /// holding `tensors.safetensors` and `meta.json` written by the worker client.
    pub parts: Vec<StagedPart>,
    /// Agent metadata (generation, world size, scaling decision...), stored in the manifest
    /// metadata under `"elastic"`.
    pub agent_metadata: serde_json::Value,
}

/// A committed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub step: u64,
    /// Bytes this node uploaded (as stored, after compression).
    pub bytes: u64,
    /// Whether this node wrote the manifest.
    pub by_this_node: bool,
    pub upload_ms: u64,
    pub commit_ms: u64,
}

/// Errors of the sink, each naming the step, rank or store that failed. Store URLs are
/// shown without credentials.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    #[error("opening checkpoint store {url}: {source}")]
    Open {
        url: String,
        source: Box<checkpoint::Error>,
    },
    #[error("invalid request: {0}")]
    InvalidInput(String),
    #[error("step {step}, rank {rank}: staged snapshot {path}: {reason}")]
    Staged {
        step: u64,
        rank: u32,
        path: PathBuf,
        reason: String,
    },
    #[error("step {step}: uploading rank {rank}'s part to {url} failed: {source}")]
    Upload {
        step: u64,
        rank: u32,
        url: String,
        source: Box<checkpoint::Error>,
    },
    #[error(
        "step {step}: not every rank's part became durable in {url} within {commit_wait_ms} ms (waited {waited_ms} ms): {reason}"
    )]
    Incomplete {
        step: u64,
        url: String,
        commit_wait_ms: u64,
        waited_ms: u64,
        reason: String,
    },
    #[error("step {step}: commit to {url} failed: {source}")]
    Commit {
        step: u64,
        url: String,
        source: Box<checkpoint::Error>,
    },
    #[error("step {step}: restore for rank {rank} of {world} from {url} failed: {source}")]
    Restore {
        step: u64,
        rank: u32,
        world: u32,
        url: String,
        source: Box<checkpoint::Error>,
    },
    #[error("reading checkpoint store {url}: {source}")]
    Read {
        url: String,
        source: Box<checkpoint::Error>,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Local { path: PathBuf, reason: String },
    /// A durable local write (restore marker, rank metadata) failed; the error names the path.
    #[error(transparent)]
    Durable(Box<checkpoint::Error>),
    #[error("{op} cancelled")]
    Cancelled { op: String },
    /// A blocking task panicked or was cancelled: not bad input, not a store error.
    #[error("{task} task failed: {message}")]
    TaskFailed { task: &'static str, message: String },
}

impl SinkError {
    /// Whether this is a cancellation (not a failure of the store or the data).
    pub fn is_cancelled(&self) -> bool {
        matches!(self, SinkError::Cancelled { .. })
    }
}

pub(super) fn io<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> SinkError + 'a {
    move |source| SinkError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// What `restored.json` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Restored {
    pub(super) version: u32,
    pub(super) step: u64,
    /// The world the ranks were restored for (only binding when `dense` is false).
    pub(super) world_size: u32,
    /// Finished ranks.
    pub(super) ranks: BTreeSet<u32>,
    /// No sharded tensors: every rank's tensors are the same, at any world size.
    pub(super) dense: bool,
    /// The store the bytes came from (without credentials): another job's step N staged in
    /// the same directory is not this one's.
    pub(super) store: String,
}

/// Streams staged steps to a store; see the module docs.
pub struct StoreSink {
    pub(super) store: Store,
    pub(super) restore_root: PathBuf,
    pub(super) opts: SinkOptions,
}

impl StoreSink {
    /// `url`: the `--checkpoint-url` string (a plain path or `file://`, `s3://`, `az://`,
    /// `gs://`, `memory://`). `restore_root`: where restored steps are laid out.
    pub fn open(url: &str, restore_root: PathBuf, opts: SinkOptions) -> Result<Self, SinkError> {
        let store =
            Store::open_with_options(url, opts.store_config.iter().cloned()).map_err(|source| {
                SinkError::Open {
                    url: shown_url(url),
                    source: Box::new(source),
                }
            })?;
        let mut opts = opts;
        opts.save.compress = opts.compression.for_store(&store);
        Ok(Self::with_store(store, restore_root, opts))
    }

    /// A sink over an already opened store (shared `memory://` stores in tests, wrappers).
    pub fn with_store(store: Store, restore_root: PathBuf, opts: SinkOptions) -> Self {
        StoreSink {
            store,
            restore_root,
            opts,
        }
    }

    /// The store's URL, without credentials.
    pub fn url(&self) -> &str {
        self.store.url()
    }

    /// The store underneath (read-only uses: `elastic-run status`, tests).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The newest committed step that verifies (older ones are taken when the newest is
    /// corrupt), or `None`.
    pub async fn latest_step(&self, cancel: &CancellationToken) -> Result<Option<u64>, SinkError> {
        let cancelled = || SinkError::Cancelled {
            op: "reading the newest committed step".into(),
        };
        let r = tokio::select! {
            r = self.store.latest_committed(cancel) => r,
            () = cancel.cancelled() => return Err(cancelled()),
        };
        match r {
            Ok(m) => Ok(m.map(|m| m.step)),
            Err(_) if cancel.is_cancelled() => Err(cancelled()),
            Err(source) => Err(SinkError::Read {
                url: self.url().to_string(),
                source: Box::new(source),
            }),
        }
    }
}

/// `g<generation>-rank-<rank>`.
pub fn writer_id(generation: u64, rank: u32) -> String {
    format!("g{generation}-rank-{rank}")
}

/// A URL as it may appear in a message: no user-info, query or fragment.
pub(super) fn shown_url(url: &str) -> String {
    let base = url.split(['?', '#']).next().unwrap_or("");
    match base.split_once("://") {
        Some((scheme, rest)) => {
            let (auth, path) = rest.split_once('/').unwrap_or((rest, ""));
            let host = auth.rsplit_once('@').map_or(auth, |(_, h)| h);
            if path.is_empty() && !rest.contains('/') {
                format!("{scheme}://{host}")
            } else {
                format!("{scheme}://{host}/{path}")
            }
        }
        None => base.to_string(),
    }
}

/// Runs local file work off the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SinkError> + Send + 'static,
) -> Result<T, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SinkError::TaskFailed {
            task: "local file",
            message: e.to_string(),
        })?
}

pub(super) fn read_json_bounded(path: &Path) -> Result<serde_json::Value, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    // A staged `meta.json` is bounded by the protocol; `metadata.json` and the marker (the
    // agent's own files) by the same number.
    if meta.len() > METADATA_BYTES_MAX {
        return Err(format!("larger than {METADATA_BYTES_MAX} bytes"));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))
}
