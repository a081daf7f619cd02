//! The agent's checkpoint sink: streams staged steps through the `checkpoint` crate to any
//! store (`file://`, `s3://`, `az://`, `gs://`, `memory://`), commits them across nodes, and
//! restores a committed step laid out for this node's ranks.
//!
//! # Saving
//!
//! Every local rank's staged `rank-<R>/tensors.safetensors` is uploaded as its own part:
//! writer id `g<generation>-rank-<R>` (the generation in the id means a zombie of an older
//! generation can never have its part picked), file name `rank-<R>/tensors.safetensors` (file
//! names must be unique within a step, and this one mirrors the staging layout in
//! `elastic-ckpt pull`). Then the agent commits the step once every rank `0..world` of the
//! generation is durable. The other nodes upload theirs at the same time and every agent
//! races to commit: the checkpoint crate's create-only manifest makes exactly one win, the
//! others see `AlreadyCommitted`. An incomplete step is retried every
//! [`SinkOptions::retry_pause_ms`] until [`SinkOptions::commit_wait_ms`] passes or the commit
//! is cancelled (a lost peer never uploads its part). The manifest metadata is
//! `{"elastic": <agent metadata>, "state": <meta.json "state" of this node's lowest rank>}`;
//! every rank records the same replicated state, so any node can commit. After a commit this
//! node wrote, retention keeps the newest [`SinkOptions::keep_steps`] committed steps that
//! pass the cheap check (and every multiple of [`SinkOptions::keep_every`]); see `retain`.
//!
//! # Restoring
//!
//! ```text
//! <restore_root>/step-<N>/rank-<R>/state.safetensors   what rank R needs (DDP: every tensor)
//! <restore_root>/step-<N>/rank-<R>/metadata.json       the checkpoint crate's restore metadata:
//!                                                      step, rank, world_size, saved_world_size,
//!                                                      metadata {"elastic", "state"}
//! <restore_root>/step-<N>/restored.json                which ranks are complete (written after each)
//! ```
//!
//! Local bytes come first. A step without sharded tensors gives every rank the same bytes: it
//! is read from the store once per node and hard-linked for the other ranks (each gets its own
//! `metadata.json` with its rank and world size), and reused as it is by later generations at
//! any world size. Steps with sharded tensors are restored per rank and reused only for the
//! same world size. A rank directory appears by rename of a finished temporary one, and
//! `restored.json` lists only finished ranks, so a crash never leaves a half restore that
//! looks complete. Only the step restored last is kept (restores live in `/dev/shm`, memory).

use std::collections::BTreeSet;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use checkpoint::restore::{RESTORE_FILE, RESTORE_METADATA_FILE};
use checkpoint::{
    CancellationToken, CommitOutcome, CommitRequest, Manifest, PartInput, PartSource, ReadOptions,
    RetentionPolicy, SaveOptions, Store,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::Instrument;
use worker::protocol::{
    FORMAT_VERSION, METADATA_BYTES_MAX, RESTORED_META, RESTORED_TENSORS, STAGED_META,
    STAGED_TENSORS,
};

use crate::state::StagedPart;
use crate::worker_env::ResumePoint;

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

/// The marker listing the finished ranks of a restored step.
pub const RESTORED_MARKER: &str = "restored.json";
/// Version of `restored.json`; a marker of any other version is ignored (restored again).
const MARKER_VERSION: u32 = 2;
/// Leftover (never committed) steps younger than this are kept by retention: they may be a
/// step other nodes are still uploading.
const LEFTOVER_AGE_MS_MIN: u64 = 3_600_000;
/// Temporary names inside the restore root start with this.
const TMP_PREFIX: &str = ".tmp-";

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
            keep_steps: 3,
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
    #[error("{op} cancelled")]
    Cancelled { op: String },
}

impl SinkError {
    /// Whether this is a cancellation (not a failure of the store or the data).
    pub fn is_cancelled(&self) -> bool {
        matches!(self, SinkError::Cancelled { .. })
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SinkError + 'a {
    move |source| SinkError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// What `restored.json` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Restored {
    version: u32,
    step: u64,
    /// The world the ranks were restored for (only binding when `dense` is false).
    world_size: u32,
    /// Finished ranks.
    ranks: BTreeSet<u32>,
    /// No sharded tensors: every rank's tensors are the same, at any world size.
    dense: bool,
    /// The store the bytes came from (without credentials): another job's step N staged in
    /// the same directory is not this one's.
    store: String,
}

/// Streams staged steps to a store; see the module docs.
pub struct StoreSink {
    store: Store,
    restore_root: PathBuf,
    opts: SinkOptions,
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

    /// Uploads this node's parts, then commits the step once every rank `0..world_size` of
    /// the generation is durable (see the module docs).
    pub async fn commit(
        &self,
        s: StepToCommit,
        cancel: &CancellationToken,
    ) -> Result<Committed, SinkError> {
        let span = tracing::info_span!("commit", step = s.step, generation = s.generation);
        self.commit_inner(s, cancel).instrument(span).await
    }

    async fn commit_inner(
        &self,
        s: StepToCommit,
        cancel: &CancellationToken,
    ) -> Result<Committed, SinkError> {
        let step = s.step;
        let cancelled = || SinkError::Cancelled {
            op: format!("commit of step {step}"),
        };
        if cancel.is_cancelled() {
            return Err(cancelled());
        }
        let mut parts = s.parts.clone();
        parts.sort_by_key(|p| p.rank);
        check_parts(step, s.world_size, &parts)?;
        // Every part is checked before any byte goes up; the state comes from the lowest rank.
        let state = {
            let (parts, world_size) = (parts.clone(), s.world_size);
            blocking(move || {
                let mut states = parts
                    .iter()
                    .map(|p| read_staged(step, world_size, p))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(states.swap_remove(0))
            })
            .await?
        };
        let t0 = Instant::now();

        // A step that is already committed (by an earlier generation that reached it) exists
        // for every reader: uploading again would only leave bytes for the collector.
        match self.store.read_manifest(step, cancel).await {
            Ok(m) => {
                tracing::info!(
                    step,
                    world = m.world_size,
                    "step already committed; nothing to upload"
                );
                return Ok(Committed {
                    step,
                    bytes: 0,
                    by_this_node: false,
                    upload_ms: 0,
                    commit_ms: t0.elapsed().as_millis() as u64,
                });
            }
            Err(checkpoint::Error::StepNotFound { .. }) => {}
            Err(_) if cancel.is_cancelled() => return Err(cancelled()),
            // Unreadable manifest: let the commit below decide (it reads it again).
            Err(e) => tracing::warn!(step, error = %e, "reading the step's manifest failed"),
        }

        let mut bytes = 0u64;
        for p in &parts {
            let input = PartInput {
                writer: writer_id(s.generation, p.rank),
                source: PartSource::Files(vec![(
                    format!("rank-{}/{STAGED_TENSORS}", p.rank),
                    p.dir.join(STAGED_TENSORS),
                )]),
                shards: Default::default(),
            };
            let t = Instant::now();
            let record = tokio::select! {
                r = self.store.save_part(step, input, &self.opts.save, cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            }
            .map_err(|source| {
                if cancel.is_cancelled() {
                    cancelled()
                } else {
                    SinkError::Upload {
                        step,
                        rank: p.rank,
                        url: self.url().to_string(),
                        source: Box::new(source),
                    }
                }
            })?;
            let part_bytes: u64 = record.objects.iter().map(|o| o.stored_bytes).sum();
            bytes += part_bytes;
            tracing::debug!(
                step,
                rank = p.rank,
                bytes = part_bytes,
                ms = t.elapsed().as_millis() as u64,
                "part durable"
            );
        }
        let upload_ms = t0.elapsed().as_millis() as u64;
        tracing::info!(
            step,
            bytes,
            upload_ms,
            ranks = parts.len(),
            "this node's parts are durable"
        );

        let req = CommitRequest {
            world_size: s.world_size,
            writers: (0..s.world_size)
                .map(|r| writer_id(s.generation, r))
                .collect(),
            metadata: serde_json::json!({"elastic": s.agent_metadata, "state": state}),
        };
        let t1 = Instant::now();
        let wait = Duration::from_millis(self.opts.commit_wait_ms);
        let pause = Duration::from_millis(self.opts.retry_pause_ms.max(1));
        let mut attempts = 0u64;
        let (by_this_node, manifest) = loop {
            attempts += 1;
            let r = tokio::select! {
                r = self.store.commit(step, req.clone(), cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            };
            match r {
                Ok(CommitOutcome::Committed(m)) => break (true, m),
                Ok(CommitOutcome::AlreadyCommitted(m)) => break (false, m),
                Err(checkpoint::Error::Incomplete { reason, .. }) => {
                    let waited = t1.elapsed();
                    if waited >= wait {
                        return Err(SinkError::Incomplete {
                            step,
                            url: self.url().to_string(),
                            commit_wait_ms: self.opts.commit_wait_ms,
                            waited_ms: waited.as_millis() as u64,
                            reason,
                        });
                    }
                    if attempts == 1 {
                        tracing::debug!(step, %reason, "waiting for the other nodes' parts");
                    }
                    // Never sleep past the deadline: one last attempt happens right at it.
                    let nap = pause.min(wait - waited);
                    tokio::select! {
                        () = tokio::time::sleep(nap) => {}
                        () = cancel.cancelled() => return Err(cancelled()),
                    }
                }
                Err(_) if cancel.is_cancelled() => return Err(cancelled()),
                Err(source) => {
                    return Err(SinkError::Commit {
                        step,
                        url: self.url().to_string(),
                        source: Box::new(source),
                    });
                }
            }
        };
        let commit_ms = t1.elapsed().as_millis() as u64;
        if !by_this_node && !written_by_generation(&manifest, s.generation) {
            tracing::warn!(
                step,
                generation = s.generation,
                "step was committed by another generation; this node's upload is unused"
            );
        }
        tracing::info!(
            step,
            bytes,
            upload_ms,
            commit_ms,
            attempts,
            by_this_node,
            "step committed"
        );
        if by_this_node {
            self.retain(step, cancel).await;
        }
        Ok(Committed {
            step,
            bytes,
            by_this_node,
            upload_ms,
            commit_ms,
        })
    }

    /// Retention after `committed`, a commit this node wrote. It runs on every commit, so it
    /// stays cheap: gc's `Present` check (manifests read, objects HEADed, no data read) of
    /// the newest `keep_steps` steps only. A flipped bit goes unseen, which is safe here:
    /// `committed` is pinned (counted as verifying, never deleted), and it is good, since this
    /// agent checksummed its chunks as it uploaded them and the commit found every part
    /// durable. It is normally the newest step; when a newer one that passes the cheap check
    /// is corrupt (an older step was restored past it), the pin still keeps `committed`. A step
    /// that does not pass (a garbled manifest, a missing or truncated object) does not count
    /// toward `keep_steps`. `elastic-ckpt gc` reads the steps it keeps in full.
    async fn retain(&self, committed: u64, cancel: &CancellationToken) {
        let policy = RetentionPolicy {
            keep_last: self.opts.keep_steps,
            keep_every: self.opts.keep_every,
            leftover_age_ms_min: LEFTOVER_AGE_MS_MIN,
            check: checkpoint::retention::GcCheck::Present,
            pinned: Some(committed),
        };
        match self.store.gc(&policy, false, cancel).await {
            Ok(r) if r.objects_deleted > 0 => tracing::info!(
                objects = r.objects_deleted,
                bytes = r.bytes_deleted,
                keep_steps = policy.keep_last,
                "retention removed old steps"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention failed (the commit stands)"),
        }
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

    /// Restores `step` for this node's `ranks` of a `world_size` world into
    /// `restore_root/step-N/rank-R/` and returns `ResumePoint { step, dir: restore_root/step-N }`;
    /// see the module docs for what is reused.
    pub async fn restore(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<ResumePoint, SinkError> {
        let span = tracing::info_span!("restore", step, world = world_size);
        self.restore_inner(step, ranks, world_size, cancel)
            .instrument(span)
            .await
    }

    /// [`StoreSink::restore`] of `step`, or, when that step does not verify (a chunk fails
    /// its checksum, an object is missing or truncated, the manifest is invalid or names a
    /// file that cannot be laid out), of the newest older committed step that does. Each
    /// step skipped is logged with the bad object. Returns the point restored and the steps
    /// skipped, newest first. Any other error (the store unreachable, cancellation, local
    /// I/O such as a full disk) is returned as it is: it says nothing about the step.
    ///
    /// Every node of a generation falls back alike for a replicated (DDP) step, since each
    /// node reads all of its bytes. A sharded step read only in part by each node could in
    /// principle send nodes to different steps when the corruption lies in one node's rows.
    pub async fn restore_or_older(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<(ResumePoint, Vec<u64>), SinkError> {
        let integrity =
            |e: &SinkError| matches!(e, SinkError::Restore { source, .. } if source.is_integrity());
        let first = match self.restore(step, ranks.clone(), world_size, cancel).await {
            Ok(p) => return Ok((p, Vec::new())),
            Err(e) if integrity(&e) => e,
            Err(e) => return Err(e),
        };
        tracing::warn!(step, error = %first, "committed step does not restore; falling back to the previous committed step");
        let mut skipped = vec![step];
        let older = tokio::select! {
            r = self.store.committed_steps(cancel) => r,
            () = cancel.cancelled() => return Err(SinkError::Cancelled { op: format!("restore of step {step}") }),
        }
        .map_err(|source| SinkError::Read {
            url: self.url().to_string(),
            source: Box::new(source),
        })?;
        for s in older.into_iter().rev().filter(|s| *s < step) {
            match self.restore(s, ranks.clone(), world_size, cancel).await {
                Ok(p) => {
                    tracing::warn!(step = s, skipped = ?skipped, "resuming from an older committed step");
                    return Ok((p, skipped));
                }
                Err(e) if integrity(&e) => {
                    tracing::warn!(step = s, error = %e, "committed step does not restore either; falling back further");
                    skipped.push(s);
                }
                Err(e) => return Err(e),
            }
        }
        Err(first)
    }

    async fn restore_inner(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<ResumePoint, SinkError> {
        let cancelled = || SinkError::Cancelled {
            op: format!("restore of step {step}"),
        };
        if world_size == 0 || ranks.is_empty() || ranks.end > world_size {
            return Err(SinkError::InvalidInput(format!(
                "restore of step {step}: ranks {ranks:?} are not a non-empty part of a world of {world_size}"
            )));
        }
        if cancel.is_cancelled() {
            return Err(cancelled());
        }
        let t0 = Instant::now();
        let root = self.restore_root.clone();
        let dir = root.join(format!("step-{step}"));
        {
            let (root, dir) = (root.clone(), dir.clone());
            blocking(move || prepare_restore_dir(&root, &dir, step)).await?;
        }

        // What finished ranks can be kept.
        let marker = read_marker(&dir)
            .filter(|m| m.version == MARKER_VERSION && m.step == step && m.store == self.url());
        let (mut done, mut dense) = match marker {
            Some(m) if m.dense || m.world_size == world_size => {
                let present = m
                    .ranks
                    .iter()
                    .copied()
                    .filter(|r| rank_files_present(&dir, *r))
                    .collect::<BTreeSet<u32>>();
                (present, Some(m.dense))
            }
            other => {
                if other.is_some() || dir.join(RESTORED_MARKER).exists() {
                    // Sharded rows of another world, or bytes of another store (or an older
                    // marker): nothing is reusable. The marker goes first so a crash while
                    // removing never leaves it naming a lost rank.
                    remove_durably(&dir.join(RESTORED_MARKER), &dir)?;
                }
                let d = dir.clone();
                blocking(move || remove_rank_dirs(&d)).await?;
                (BTreeSet::new(), None)
            }
        };
        let want: Vec<u32> = ranks.clone().collect();
        let missing: Vec<u32> = want.iter().copied().filter(|r| !done.contains(r)).collect();
        let mut from_store = 0usize;
        let mut bytes = 0u64;

        // Only missing ranks of a sharded (or unknown) step, or a dense step with nothing
        // local to link from, need the store.
        let linkable = dense == Some(true) && !done.is_empty();
        if !missing.is_empty() && !linkable {
            let manifest = tokio::select! {
                r = self.store.read_manifest(step, cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            }
            .map_err(|source| self.restore_error(step, ranks.start, world_size, source, cancel))?;
            let is_dense = manifest.tensors.iter().all(|t| !t.sharded);
            if dense.is_some_and(|d| d != is_dense) {
                // The marker disagrees with the manifest: trust neither the local bytes.
                remove_durably(&dir.join(RESTORED_MARKER), &dir)?;
                let d = dir.clone();
                blocking(move || remove_rank_dirs(&d)).await?;
                done.clear();
            }
            dense = Some(is_dense);
            let todo: Vec<u32> = if is_dense && done.is_empty() {
                missing[..1].to_vec()
            } else if is_dense {
                vec![]
            } else {
                missing.clone()
            };
            for r in todo {
                let tmp = dir.join(format!("{TMP_PREFIX}rank-{r}"));
                {
                    let tmp = tmp.clone();
                    blocking(move || remove_if_exists(&tmp)).await?;
                }
                let report = tokio::select! {
                    res = self.store.restore(Some(step), r, world_size, &tmp, &self.opts.read, cancel) => res,
                    () = cancel.cancelled() => return Err(cancelled()),
                }
                .map_err(|source| self.restore_error(step, r, world_size, source, cancel))?;
                if report.step != step || report.rank != r || report.world_size != world_size {
                    return Err(SinkError::Local {
                        path: tmp,
                        reason: format!(
                            "restore wrote step {} rank {} of {} instead of step {step} rank {r} of {world_size}",
                            report.step, report.rank, report.world_size
                        ),
                    });
                }
                bytes += report.bytes;
                from_store += 1;
                let d = dir.clone();
                blocking(move || install_rank(&d, &tmp, r)).await?;
                done.insert(r);
                write_marker(
                    &dir,
                    &marker_of(self.url(), step, world_size, &done, is_dense),
                )?;
            }
        }

        // Dense steps: every other rank links the bytes already here, with its own metadata.
        let dense = dense.unwrap_or(false);
        if dense {
            let source_rank = *done.first().ok_or_else(|| SinkError::Local {
                path: dir.clone(),
                reason: format!("step {step}: no restored rank to link from"),
            })?;
            let (d, want, have) = (dir.clone(), want.clone(), done.clone());
            blocking(move || {
                for r in want {
                    if have.contains(&r) {
                        // Kept or just restored: only its rank and world may be stale.
                        write_rank_metadata(&d, r, world_size)?;
                    } else {
                        link_rank(&d, source_rank, r, world_size)?;
                    }
                }
                Ok(())
            })
            .await?;
            done.extend(ranks.clone());
        }
        // Assert after the writes: every wanted rank has its files.
        for r in &want {
            if !rank_files_present(&dir, *r) {
                return Err(SinkError::Local {
                    path: dir.join(format!("rank-{r}")),
                    reason: format!("step {step}: rank {r} is missing after the restore"),
                });
            }
        }
        write_marker(&dir, &marker_of(self.url(), step, world_size, &done, dense))?;
        tracing::info!(
            step,
            ranks = ?ranks,
            world = world_size,
            dense,
            from_store,
            bytes,
            ms = t0.elapsed().as_millis() as u64,
            "step restored"
        );
        Ok(ResumePoint { step, dir })
    }

    fn restore_error(
        &self,
        step: u64,
        rank: u32,
        world: u32,
        source: checkpoint::Error,
        cancel: &CancellationToken,
    ) -> SinkError {
        if cancel.is_cancelled() {
            return SinkError::Cancelled {
                op: format!("restore of step {step}"),
            };
        }
        SinkError::Restore {
            step,
            rank,
            world,
            url: self.url().to_string(),
            source: Box::new(source),
        }
    }
}

/// `g<generation>-rank-<rank>`.
pub fn writer_id(generation: u64, rank: u32) -> String {
    format!("g{generation}-rank-{rank}")
}

fn written_by_generation(m: &Manifest, generation: u64) -> bool {
    let prefix = format!("g{generation}-rank-");
    m.parts.iter().all(|p| p.writer.starts_with(&prefix))
}

/// A URL as it may appear in a message: no user-info, query or fragment.
fn shown_url(url: &str) -> String {
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

fn marker_of(
    store: &str,
    step: u64,
    world_size: u32,
    ranks: &BTreeSet<u32>,
    dense: bool,
) -> Restored {
    Restored {
        version: MARKER_VERSION,
        step,
        world_size,
        ranks: ranks.clone(),
        dense,
        store: store.to_string(),
    }
}

/// The request's own consistency: ranks unique, inside the world, all of this step.
fn check_parts(step: u64, world_size: u32, parts: &[StagedPart]) -> Result<(), SinkError> {
    let bad = |reason: String| Err(SinkError::InvalidInput(format!("step {step}: {reason}")));
    if world_size == 0 {
        return bad("world size is 0".into());
    }
    if parts.is_empty() {
        return bad("no staged parts".into());
    }
    if parts.len() > world_size as usize {
        return bad(format!("{} parts for a world of {world_size}", parts.len()));
    }
    let mut seen = BTreeSet::new();
    for p in parts {
        if p.step != step {
            return bad(format!("rank {}'s part is of step {}", p.rank, p.step));
        }
        if p.rank >= world_size {
            return bad(format!(
                "rank {} is outside a world of {world_size}",
                p.rank
            ));
        }
        if !seen.insert(p.rank) {
            return bad(format!("rank {} staged twice", p.rank));
        }
    }
    Ok(())
}

fn read_json_bounded(path: &Path) -> Result<serde_json::Value, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    // A staged `meta.json` is bounded by the protocol; `metadata.json` and the marker (the
    // agent's own files) by the same number.
    if meta.len() > METADATA_BYTES_MAX {
        return Err(format!("larger than {METADATA_BYTES_MAX} bytes"));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))
}

/// Checks one staged part (`meta.json` of this step, rank and world; a tensor file) and
/// returns the trainer's JSON state from its `meta.json` (`{}` when it has none).
fn read_staged(step: u64, world_size: u32, p: &StagedPart) -> Result<serde_json::Value, SinkError> {
    let staged = |path: PathBuf, reason: String| SinkError::Staged {
        step,
        rank: p.rank,
        path,
        reason,
    };
    let tensors = p.dir.join(STAGED_TENSORS);
    if !tensors.is_file() {
        return Err(staged(tensors, "missing".into()));
    }
    let path = p.dir.join(STAGED_META);
    let v = read_json_bounded(&path).map_err(|r| staged(path.clone(), r))?;
    let field = |k: &str| v.get(k).and_then(|x| x.as_u64());
    match field("format_version") {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        other => {
            return Err(staged(
                path,
                format!(
                    "unknown snapshot format version {other:?} (this agent reads {FORMAT_VERSION})"
                ),
            ));
        }
    }
    if field("step") != Some(step) {
        return Err(staged(path, format!("is not a snapshot of step {step}")));
    }
    if field("rank") != Some(u64::from(p.rank)) {
        return Err(staged(path, format!("is not rank {}'s snapshot", p.rank)));
    }
    if field("world_size").is_some_and(|w| w != u64::from(world_size)) {
        return Err(staged(
            path,
            format!("was saved for a world other than {world_size}"),
        ));
    }
    let state = v.get("state").cloned().unwrap_or(serde_json::json!({}));
    if !state.is_object() {
        return Err(staged(path, "\"state\" is not a JSON object".into()));
    }
    Ok(state)
}

/// Runs local file work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SinkError> + Send + 'static,
) -> Result<T, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SinkError::Local {
            path: PathBuf::new(),
            reason: format!("local file task failed: {e}"),
        })?
}

/// Creates `dir`, removes every other restored step and leftover temporaries (only the newest
/// restored step is kept: restores live in `/dev/shm`, memory).
fn prepare_restore_dir(root: &Path, dir: &Path, step: u64) -> Result<(), SinkError> {
    create_private_dir_all(dir)?;
    // Found ones too (laid out before restores were private): weights are not for others.
    for d in [root, dir] {
        make_private(d)?;
    }
    let keep = format!("step-{step}");
    for e in std::fs::read_dir(root).map_err(io("read", root))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if (name.starts_with("step-") && name != keep) || name.starts_with(TMP_PREFIX) {
            match remove_if_exists(&e.path()) {
                Ok(()) => tracing::debug!(dir = %e.path().display(), "older restore removed"),
                Err(err) => tracing::warn!(error = %err, "removing an older restore failed"),
            }
        }
    }
    for e in std::fs::read_dir(dir).map_err(io("read", dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(TMP_PREFIX) || name.starts_with(&format!(".{RESTORED_MARKER}")) {
            remove_if_exists(&e.path())?;
        }
    }
    Ok(())
}

fn remove_if_exists(p: &Path) -> Result<(), SinkError> {
    let r = match std::fs::symlink_metadata(p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SinkError::Io {
            op: "remove",
            path: p.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

fn remove_durably(p: &Path, dir: &Path) -> Result<(), SinkError> {
    remove_if_exists(p)?;
    sync_dir(dir)
}

fn remove_rank_dirs(dir: &Path) -> Result<(), SinkError> {
    for e in std::fs::read_dir(dir).map_err(io("read", dir))?.flatten() {
        if e.file_name().to_string_lossy().starts_with("rank-") {
            remove_if_exists(&e.path())?;
        }
    }
    sync_dir(dir)
}

fn rank_files_present(dir: &Path, rank: u32) -> bool {
    let d = dir.join(format!("rank-{rank}"));
    d.join(RESTORE_FILE).is_file() && d.join(RESTORE_METADATA_FILE).is_file()
}

fn sync_dir(dir: &Path) -> Result<(), SinkError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", dir))
}

/// Temp file (0600), fsync, rename, fsync the directory.
fn write_durable(path: &Path, bytes: &[u8]) -> Result<(), SinkError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        // A leftover temp file keeps its old mode through open: set it.
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("rename", &tmp))?;
    sync_dir(dir)
}

fn read_marker(dir: &Path) -> Option<Restored> {
    let v = read_json_bounded(&dir.join(RESTORED_MARKER)).ok()?;
    serde_json::from_value(v).ok()
}

fn write_marker(dir: &Path, r: &Restored) -> Result<(), SinkError> {
    let bytes = serde_json::to_vec(r).map_err(|e| SinkError::Local {
        path: dir.join(RESTORED_MARKER),
        reason: e.to_string(),
    })?;
    write_durable(&dir.join(RESTORED_MARKER), &bytes)
}

/// Moves a finished restore of `rank` (in `tmp`) to `dir/rank-<rank>`.
fn install_rank(dir: &Path, tmp: &Path, rank: u32) -> Result<(), SinkError> {
    if !tmp.join(RESTORE_FILE).is_file() || !tmp.join(RESTORE_METADATA_FILE).is_file() {
        return Err(SinkError::Local {
            path: tmp.to_path_buf(),
            reason: format!("the restore of rank {rank} left no {RESTORE_FILE}"),
        });
    }
    // Whatever wrote them, restored weights are for this user only.
    make_private_tree(tmp)?;
    sync_dir(tmp)?;
    let dest = dir.join(format!("rank-{rank}"));
    remove_if_exists(&dest)?;
    std::fs::rename(tmp, &dest).map_err(io("rename", tmp))?;
    sync_dir(dir)
}

/// Rewrites `rank-<at>/metadata.json` to say rank `rank` of `world_size` (a dense step's
/// files serve every rank; only this small file differs between them).
fn write_rank_metadata(dir: &Path, rank: u32, world_size: u32) -> Result<(), SinkError> {
    let path = dir.join(format!("rank-{rank}")).join(RESTORE_METADATA_FILE);
    rewrite_metadata(&path, &path, rank, world_size)
}

fn rewrite_metadata(from: &Path, to: &Path, rank: u32, world_size: u32) -> Result<(), SinkError> {
    let mut v = read_json_bounded(from).map_err(|reason| SinkError::Local {
        path: from.to_path_buf(),
        reason,
    })?;
    let Some(obj) = v.as_object_mut() else {
        return Err(SinkError::Local {
            path: from.to_path_buf(),
            reason: "not a JSON object".into(),
        });
    };
    if obj.get("rank").and_then(|r| r.as_u64()) == Some(u64::from(rank))
        && obj.get("world_size").and_then(|w| w.as_u64()) == Some(u64::from(world_size))
        && from == to
    {
        return Ok(());
    }
    obj.insert("rank".into(), rank.into());
    obj.insert("world_size".into(), world_size.into());
    let bytes = serde_json::to_vec_pretty(&v).map_err(|e| SinkError::Local {
        path: to.to_path_buf(),
        reason: e.to_string(),
    })?;
    write_durable(to, &bytes)
}

/// Makes `rank-<to>` hold `rank-<from>`'s tensors (hard link, a copy where links fail) and its
/// own metadata, built in a temporary directory and renamed into place.
fn link_rank(dir: &Path, from: u32, to: u32, world_size: u32) -> Result<(), SinkError> {
    let src = dir.join(format!("rank-{from}"));
    let tmp = dir.join(format!("{TMP_PREFIX}rank-{to}"));
    remove_if_exists(&tmp)?;
    create_private_dir_all(&tmp)?;
    let (a, b) = (src.join(RESTORE_FILE), tmp.join(RESTORE_FILE));
    if std::fs::hard_link(&a, &b).is_err() {
        std::fs::copy(&a, &b).map_err(io("copy", &a))?;
        std::fs::File::open(&b)
            .and_then(|f| f.sync_all())
            .map_err(io("fsync", &b))?;
    }
    rewrite_metadata(
        &src.join(RESTORE_METADATA_FILE),
        &tmp.join(RESTORE_METADATA_FILE),
        to,
        world_size,
    )?;
    install_rank(dir, &tmp, to)
}

/// `create_dir_all` with every directory it makes 0700.
fn create_private_dir_all(dir: &Path) -> Result<(), SinkError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io("create", dir))
}

/// Sets a real directory to 0700 and a regular file to 0600; symlinks are left alone.
fn make_private(p: &Path) -> Result<(), SinkError> {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::symlink_metadata(p).map_err(io("stat", p))?;
    let want = if m.is_dir() {
        0o700
    } else if m.is_file() {
        0o600
    } else {
        return Ok(());
    };
    if m.permissions().mode() & 0o7777 != want {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(want))
            .map_err(io("chmod", p))?;
    }
    Ok(())
}

/// [`make_private`] on `dir` and everything below it (symlinks not followed).
fn make_private_tree(dir: &Path) -> Result<(), SinkError> {
    make_private(dir)?;
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        for e in std::fs::read_dir(dir).map_err(io("read", dir))? {
            make_private_tree(&e.map_err(io("read", dir))?.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;
    use safetensors::tensor::TensorView;
    use std::collections::HashMap;

    #[test]
    fn writer_ids_name_the_generation() {
        assert_eq!(writer_id(3, 7), "g3-rank-7");
    }

    #[test]
    fn urls_in_messages_lose_credentials() {
        assert_eq!(
            shown_url("s3://key:secret@bucket/job?sig=x"),
            "s3://bucket/job"
        );
        assert_eq!(shown_url("memory://"), "memory://");
        assert_eq!(shown_url("/a/b"), "/a/b");
        let o = SinkOptions {
            store_config: vec![("aws_secret_access_key".into(), "hunter2".into())],
            ..Default::default()
        };
        let shown = format!("{o:?}");
        assert!(shown.contains("aws_secret_access_key") && !shown.contains("hunter2"));
    }

    fn part(dir: &Path, rank: u32, step: u64) -> StagedPart {
        StagedPart {
            rank,
            step,
            dir: dir.join(format!("rank-{rank}")),
        }
    }

    /// A staged part as the worker clients write it: one F32 tensor per rank.
    fn stage(root: &Path, step: u64, rank: u32, world: u32, meta: serde_json::Value) {
        let d = root.join(format!("rank-{rank}"));
        std::fs::create_dir_all(&d).unwrap();
        let data: Vec<u8> = (0..4u32)
            .flat_map(|i| ((rank * 10 + i) as f32).to_le_bytes())
            .collect();
        let name = format!("model/w{rank}");
        let views = vec![(
            name.clone(),
            TensorView::new(Dtype::F32, vec![4], &data).unwrap(),
        )];
        safetensors::serialize_to_file(
            views,
            None::<HashMap<String, String>>,
            &d.join(STAGED_TENSORS),
        )
        .unwrap();
        let mut m = serde_json::json!({"format_version": 1, "step": step, "rank": rank,
            "world_size": world, "keys": [name]});
        if let Some(o) = meta.as_object() {
            for (k, v) in o {
                m[k] = v.clone();
            }
        }
        std::fs::write(d.join(STAGED_META), m.to_string()).unwrap();
    }

    fn fast() -> SinkOptions {
        SinkOptions {
            commit_wait_ms: 300,
            retry_pause_ms: 20,
            ..Default::default()
        }
    }

    #[test]
    fn staged_meta_must_match_step_rank_and_format() {
        let tmp = tempfile::tempdir().unwrap();
        stage(
            tmp.path(),
            5,
            1,
            2,
            serde_json::json!({"state": {"extra": {"a": 1}}}),
        );
        let p = part(tmp.path(), 1, 5);
        assert_eq!(read_staged(5, 2, &p).unwrap()["extra"]["a"], 1);
        let e = read_staged(
            6,
            2,
            &StagedPart {
                step: 6,
                ..p.clone()
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("step 6"), "{e}");
        let e = read_staged(5, 3, &p).unwrap_err();
        assert!(e.to_string().contains("world"), "{e}");
        stage(
            tmp.path(),
            5,
            1,
            2,
            serde_json::json!({"format_version": 9}),
        );
        let e = read_staged(5, 2, &p).unwrap_err();
        assert!(e.to_string().contains("format version Some(9)"), "{e}");
        std::fs::write(p.dir.join(STAGED_META), "not json").unwrap();
        assert!(
            read_staged(5, 2, &p)
                .unwrap_err()
                .to_string()
                .contains("not JSON")
        );
        std::fs::remove_file(p.dir.join(STAGED_TENSORS)).unwrap();
        assert!(
            read_staged(5, 2, &p)
                .unwrap_err()
                .to_string()
                .contains("missing")
        );
    }

    #[test]
    fn requests_with_foreign_or_repeated_ranks_are_refused() {
        let p = |rank, step| StagedPart {
            rank,
            step,
            dir: "/x".into(),
        };
        assert!(check_parts(1, 2, &[p(0, 1), p(1, 1)]).is_ok());
        for (world, parts, want) in [
            (2, vec![], "no staged parts"),
            (0, vec![p(0, 1)], "world size is 0"),
            (2, vec![p(2, 1)], "outside a world of 2"),
            (2, vec![p(0, 1), p(0, 1)], "staged twice"),
            (2, vec![p(0, 2)], "of step 2"),
            (1, vec![p(0, 1), p(1, 1)], "2 parts for a world of 1"),
        ] {
            let e = check_parts(1, world, &parts).unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_nodes_race_and_exactly_one_commits_on_a_shared_memory_store() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging/step-7");
        for r in 0..4 {
            let state = serde_json::json!({"state": {"extra": {"pos": 7}}});
            stage(&staging, 7, r, 4, state);
        }
        let store = Store::open("memory://").unwrap();
        let opts = SinkOptions {
            commit_wait_ms: 30_000,
            ..fast()
        };
        let a = StoreSink::with_store(store.clone(), tmp.path().join("ra"), opts.clone());
        let b = StoreSink::with_store(store.clone(), tmp.path().join("rb"), opts);
        let req = |ranks: Range<u32>, node: &str| StepToCommit {
            step: 7,
            generation: 2,
            world_size: 4,
            parts: ranks.map(|r| part(&staging, r, 7)).collect(),
            agent_metadata: serde_json::json!({"node": node}),
        };
        let c = CancellationToken::new();
        let (ra, rb) = tokio::join!(a.commit(req(0..2, "a"), &c), b.commit(req(2..4, "b"), &c));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert!(ra.by_this_node ^ rb.by_this_node, "{ra:?} {rb:?}");
        assert!(ra.bytes > 0 && rb.bytes > 0);
        let m = store.read_manifest(7, &c).await.unwrap();
        assert_eq!(m.metadata["state"]["extra"]["pos"], 7);
        let node = if ra.by_this_node { "a" } else { "b" };
        assert_eq!(m.metadata["elastic"]["node"], node);
        assert_eq!(m.parts.len(), 4);
        assert_eq!(a.latest_step(&c).await.unwrap(), Some(7));
        // A late commit of the same step uploads nothing.
        let late = a.commit(req(0..2, "a"), &c).await.unwrap();
        assert_eq!((late.bytes, late.by_this_node), (0, false));

        // Dense: one read from the store, links for the rest, each with its own metadata.
        let p = a.restore(7, 0..3, 3, &c).await.unwrap();
        assert_eq!(p.dir, tmp.path().join("ra/step-7"));
        let md = |r: u32| -> serde_json::Value {
            let path = p.dir.join(format!("rank-{r}/{RESTORE_METADATA_FILE}"));
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
        };
        for r in 0..3 {
            let m = md(r);
            assert_eq!(
                (m["rank"].as_u64(), m["world_size"].as_u64()),
                (Some(r.into()), Some(3))
            );
            assert_eq!(m["metadata"]["state"]["extra"]["pos"], 7);
        }
        // An empty store and the same restore root: only local bytes can serve these.
        let empty = StoreSink::with_store(
            Store::open("memory://").unwrap(),
            tmp.path().join("ra"),
            fast(),
        );
        assert_eq!(empty.restore(7, 1..2, 2, &c).await.unwrap(), p);
        assert_eq!(md(1)["world_size"], 2);
        assert_eq!(empty.restore(7, 0..4, 4, &c).await.unwrap(), p);
        assert_eq!(
            (md(3)["rank"].as_u64(), md(3)["world_size"].as_u64()),
            (Some(3), Some(4))
        );
        let e = empty.restore(8, 0..1, 1, &c).await.unwrap_err();
        assert!(matches!(e, SinkError::Restore { step: 8, .. }), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restored_and_linked_weights_are_private_to_this_user() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("s/step-4");
        stage(&staging, 4, 0, 1, serde_json::json!({}));
        let sink = StoreSink::with_store(
            Store::open("memory://").unwrap(),
            tmp.path().join("r"),
            fast(),
        );
        let c = CancellationToken::new();
        let s = StepToCommit {
            step: 4,
            generation: 1,
            world_size: 1,
            parts: vec![part(&staging, 0, 4)],
            agent_metadata: serde_json::json!({}),
        };
        sink.commit(s, &c).await.unwrap();
        // A restore root laid out before restores were private is made private too.
        std::fs::create_dir(tmp.path().join("r")).unwrap();
        std::fs::set_permissions(tmp.path().join("r"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        // Dense: rank 0 from the store, rank 1 linked to it, each with rewritten metadata.
        let p = sink.restore(4, 0..2, 2, &c).await.unwrap();
        assert!(p.dir.join("rank-1").join(RESTORE_FILE).is_file());
        let mut seen = (0, 0);
        let mut todo = vec![tmp.path().join("r")];
        while let Some(d) = todo.pop() {
            let m = std::fs::symlink_metadata(&d).unwrap();
            let mode = m.permissions().mode() & 0o7777;
            if m.is_dir() {
                assert_eq!(mode, 0o700, "{}", d.display());
                seen.0 += 1;
                todo.extend(std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()));
            } else {
                assert_eq!(mode, 0o600, "{}", d.display());
                seen.1 += 1;
            }
        }
        // r, step-4, rank-0, rank-1; the marker and both ranks' tensors and metadata.
        assert!(seen.0 >= 4 && seen.1 >= 5, "{seen:?}");
    }

    #[tokio::test]
    async fn a_lone_node_times_out_naming_the_missing_writers() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("s");
        stage(&staging, 3, 0, 2, serde_json::json!({}));
        let store = Store::open("memory://").unwrap();
        let sink = StoreSink::with_store(store, tmp.path().join("r"), fast());
        let s = StepToCommit {
            step: 3,
            generation: 5,
            world_size: 2,
            parts: vec![part(&staging, 0, 3)],
            agent_metadata: serde_json::json!({}),
        };
        let t = Instant::now();
        let e = sink
            .commit(s.clone(), &CancellationToken::new())
            .await
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, SinkError::Incomplete { step: 3, .. }), "{msg}");
        assert!(
            msg.contains("g5-rank-1") && !msg.contains("g5-rank-0"),
            "{msg}"
        );
        assert!(t.elapsed() >= Duration::from_millis(300), "gave up early");

        let c = CancellationToken::new();
        let opts = SinkOptions {
            commit_wait_ms: 3_600_000,
            ..fast()
        };
        let slow = StoreSink::with_store(
            Store::open("memory://").unwrap(),
            tmp.path().join("r2"),
            opts,
        );
        let c2 = c.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            c2.cancel();
        });
        let e = slow.commit(s.clone(), &c).await.unwrap_err();
        assert!(e.is_cancelled(), "{e}");
        assert!(slow.commit(s, &c).await.unwrap_err().is_cancelled());
        assert!(slow.latest_step(&c).await.unwrap_err().is_cancelled());
        assert!(
            slow.restore(3, 0..1, 1, &c)
                .await
                .unwrap_err()
                .is_cancelled()
        );
    }

    /// Retention after each commit: the newest `keep_steps`, every multiple of `keep_every`,
    /// and always the step just committed, even when it is older than the newest.
    #[tokio::test]
    async fn retention_keeps_keep_steps_milestones_and_the_step_just_committed() {
        async fn commit_step(sink: &StoreSink, root: &Path, step: u64) -> Committed {
            let staging = root.join(format!("staging/step-{step}"));
            stage(&staging, step, 0, 1, serde_json::json!({}));
            let s = StepToCommit {
                step,
                generation: 1,
                world_size: 1,
                parts: vec![part(&staging, 0, step)],
                agent_metadata: serde_json::json!({}),
            };
            sink.commit(s, &CancellationToken::new()).await.unwrap()
        }
        let tmp = tempfile::tempdir().unwrap();
        let c = CancellationToken::new();
        let commit = |sink, step| commit_step(sink, tmp.path(), step);
        let store = Store::open("memory://").unwrap();
        let opts = SinkOptions {
            keep_steps: 2,
            keep_every: Some(4),
            ..fast()
        };
        let sink = StoreSink::with_store(store.clone(), tmp.path().join("r"), opts);
        for step in 1..=6 {
            assert!(commit(&sink, step).await.by_this_node);
        }
        assert_eq!(store.committed_steps(&c).await.unwrap(), [4, 5, 6]);

        let store = Store::open("memory://").unwrap();
        let opts = SinkOptions {
            keep_steps: 1,
            ..fast()
        };
        let sink = StoreSink::with_store(store.clone(), tmp.path().join("r2"), opts);
        commit(&sink, 10).await;
        // Older than the newest (as after a restore fell back past step 10): still kept.
        commit(&sink, 5).await;
        assert_eq!(store.committed_steps(&c).await.unwrap(), [5, 10]);
        commit(&sink, 6).await;
        assert_eq!(store.committed_steps(&c).await.unwrap(), [6, 10]);
    }
}
