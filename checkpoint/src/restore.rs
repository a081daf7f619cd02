//! Listing, verification, resharded restore and byte-identical pull.
//!
//! Reads are per chunk: a rank fetches only the chunks that hold bytes it needs, several at a
//! time (`concurrency`). A large chunk on a remote store comes as separate ranged requests in
//! parallel; on a local directory it is one read. Every chunk's stored and decoded checksums
//! are checked before a byte of it is used. Memory is bounded by
//! `3 × concurrency × (largest decoded chunk)`: stored bytes, decoded bytes and one plane
//! (while a remote chunk's ranges arrive: its stored bytes and up to 4 pieces of 8 MiB).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::codec;
use crate::error::{Error, Result};
use crate::format::{self, FileEntry, Manifest};
use crate::header::{self, HeaderTensor};
use crate::local::{DurableFile, write_durable};
use crate::save::Progress;
use crate::store::Store;

/// The file a restore writes for its rank, in the destination directory.
pub const RESTORE_FILE: &str = "state.safetensors";
/// The trainer metadata a restore writes next to it (with `step`, `rank`, `world_size`).
pub const RESTORE_METADATA_FILE: &str = "metadata.json";
/// Reads of a large object from a remote store are cut into ranges of this size...
const RANGE_BYTES: u64 = 8 * 1024 * 1024;
/// ...of which this many are in flight at once, per object.
const RANGES_IN_FLIGHT: usize = 4;

/// Tunables for reads.
#[derive(Clone)]
pub struct ReadOptions {
    /// Chunks fetched at once.
    pub concurrency: usize,
    pub progress: Option<Progress>,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            concurrency: 8,
            progress: None,
        }
    }
}

/// One step as `ls` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct StepInfo {
    pub step: u64,
    pub committed: bool,
    /// From the manifest, for committed steps whose manifest is valid.
    pub manifest: Option<StepSummary>,
    /// Why a manifest that exists could not be used.
    pub manifest_error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepSummary {
    pub created_unix_ms: u64,
    pub world_size: u32,
    pub stored_bytes: u64,
    pub raw_bytes: u64,
    pub objects: usize,
    pub files: usize,
    pub tensors: usize,
}

impl From<&Manifest> for StepSummary {
    fn from(m: &Manifest) -> Self {
        StepSummary {
            created_unix_ms: m.created_unix_ms,
            world_size: m.world_size,
            stored_bytes: m.stored_bytes(),
            raw_bytes: m.raw_bytes(),
            objects: m.objects.len(),
            files: m.files.len(),
            tensors: m.tensors.len(),
        }
    }
}

/// The result of reading every object of a step.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub step: u64,
    pub objects_checked: usize,
    pub stored_bytes: u64,
    /// `(key, reason)` of every object that failed.
    pub bad: Vec<(String, String)>,
}

/// What a restore wrote.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreReport {
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    pub path: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
    /// Newer committed steps that were skipped because they did not verify.
    pub skipped_steps: Vec<u64>,
    pub metadata: serde_json::Value,
}

/// One contiguous copy from a decoded object into an output file.
#[derive(Debug, Clone, Copy)]
struct CopyOp {
    out: usize,
    object: u32,
    obj_offset: u64,
    len: u64,
    out_offset: u64,
}

struct OutFile {
    rel: String,
    prefix: Vec<u8>,
    total_bytes: u64,
}

/// Maps `[start, start+len)` of a file's data region to object copies landing at `out_offset`.
fn file_range_copies(
    f: &FileEntry,
    out: usize,
    start: u64,
    len: u64,
    mut out_offset: u64,
    ops: &mut Vec<CopyOp>,
) {
    let end = start + len;
    let mut seg_start = 0u64;
    for s in &f.segments {
        let seg_end = seg_start + s.len;
        let lo = start.max(seg_start);
        let hi = end.min(seg_end);
        if lo < hi {
            ops.push(CopyOp {
                out,
                object: s.object,
                obj_offset: s.offset + (lo - seg_start),
                len: hi - lo,
                out_offset,
            });
            out_offset += hi - lo;
        }
        if seg_end >= end {
            break;
        }
        seg_start = seg_end;
    }
}

/// Rows `[lo, hi)` of dim 0 that `rank` of `world` gets of a tensor with `rows` rows.
pub fn rows_for_rank(rows: u64, rank: u32, world: u32) -> (u64, u64) {
    let cut = |r: u32| (u128::from(rows) * u128::from(r) / u128::from(world)) as u64;
    (cut(rank), cut(rank + 1))
}

impl Store {
    /// Every step that has a directory, ascending, committed or not.
    pub async fn steps(&self, cancel: &CancellationToken) -> Result<Vec<u64>> {
        let mut steps: Vec<u64> = self
            .list_dirs(format::STEPS_DIR, cancel)
            .await?
            .iter()
            .filter_map(|n| format::parse_step_dir(n))
            .collect();
        steps.sort_unstable();
        Ok(steps)
    }

    /// Steps whose manifest exists, ascending (validity not checked).
    pub async fn committed_steps(&self, cancel: &CancellationToken) -> Result<Vec<u64>> {
        let steps = self.steps(cancel).await?;
        let flags: Vec<(u64, bool)> = futures::stream::iter(steps)
            .map(|s| async move {
                match self.head(&format::manifest_key(s), cancel).await {
                    Ok(_) => Ok((s, true)),
                    Err(e) if e.store_kind() == Some(crate::error::StoreErrorKind::NotFound) => {
                        Ok((s, false))
                    }
                    // Something stands where the manifest belongs: the step counts as
                    // committed and invalid, so readers see it, say why, and fall back.
                    Err(e)
                        if e.store_kind()
                            == Some(crate::error::StoreErrorKind::NotARegularFile) =>
                    {
                        Ok((s, true))
                    }
                    Err(e) => Err(e),
                }
            })
            .buffered(16)
            .try_collect()
            .await?;
        Ok(flags.into_iter().filter(|f| f.1).map(|f| f.0).collect())
    }

    /// Every step with its state, for `ls`.
    pub async fn list_steps(&self, cancel: &CancellationToken) -> Result<Vec<StepInfo>> {
        let committed: BTreeSet<u64> = self.committed_steps(cancel).await?.into_iter().collect();
        let mut out = Vec::new();
        for step in self.steps(cancel).await? {
            if !committed.contains(&step) {
                out.push(StepInfo {
                    step,
                    committed: false,
                    manifest: None,
                    manifest_error: None,
                });
                continue;
            }
            let (manifest, manifest_error) = match self.read_manifest(step, cancel).await {
                Ok(m) => (Some(StepSummary::from(&m)), None),
                Err(e) if e.is_integrity() => (None, Some(e.to_string())),
                Err(e) => return Err(e),
            };
            out.push(StepInfo {
                step,
                committed: true,
                manifest,
                manifest_error,
            });
        }
        Ok(out)
    }

    /// Checks that every object a manifest lists exists with its recorded length.
    pub async fn check_objects_present(
        &self,
        m: &Manifest,
        cancel: &CancellationToken,
    ) -> Result<()> {
        // Owned (key, length) pairs: a stream of futures borrowing each entry would make
        // every future awaiting this one fail rustc's higher-ranked `Send` check once spawned
        // (the agent's commit loop runs retention, which calls this).
        let objects: Vec<(String, u64)> = m
            .objects
            .iter()
            .map(|o| (o.key.clone(), o.stored_bytes))
            .collect();
        let step = m.step;
        futures::stream::iter(objects)
            .map(|(key, stored_bytes)| async move {
                let size = self.head(&key, cancel).await?;
                if size != stored_bytes {
                    return Err(self.corrupt(
                        step,
                        &key,
                        format!("{size} bytes, manifest says {stored_bytes}"),
                    ));
                }
                Ok(())
            })
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await
            .map(|_| ())
    }

    /// The newest committed step whose manifest is valid and whose objects are all present.
    /// Newer steps that fail are skipped with a warning that says why.
    pub async fn latest_committed(&self, cancel: &CancellationToken) -> Result<Option<Manifest>> {
        for step in self.committed_steps(cancel).await?.into_iter().rev() {
            let r = async {
                let m = self.read_manifest(step, cancel).await?;
                self.check_objects_present(&m, cancel).await?;
                Ok::<_, Error>(m)
            }
            .await;
            match r {
                Ok(m) => return Ok(Some(m)),
                Err(e) if e.is_integrity() => {
                    tracing::warn!(step, error = %e, "committed step does not verify; falling back to the previous committed step");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    fn corrupt(&self, step: u64, key: &str, reason: String) -> Error {
        Error::Corrupt {
            store: self.url().to_string(),
            step,
            key: key.to_string(),
            reason,
        }
    }

    /// Fetches the stored bytes of object `idx`, checking length and stored checksum.
    pub(crate) async fn fetch_stored(
        &self,
        m: &Manifest,
        idx: usize,
        cancel: &CancellationToken,
    ) -> Result<bytes::Bytes> {
        let o = &m.objects[idx];
        // A local file is read whole: splitting a read of the page cache only adds copies.
        let data: bytes::Bytes = if o.stored_bytes > RANGE_BYTES && self.is_remote() {
            // Check the length first: ranges past the end of a truncated object are errors
            // that look transient on some stores.
            let size = self.head(&o.key, cancel).await?;
            if size != o.stored_bytes {
                return Err(self.corrupt(
                    m.step,
                    &o.key,
                    format!(
                        "truncated or extended: {size} bytes, manifest says {}",
                        o.stored_bytes
                    ),
                ));
            }
            self.fetch_ranges(m.step, &o.key, o.stored_bytes, cancel)
                .await?
                .into()
        } else {
            self.get(&o.key, cancel).await?
        };
        if data.len() as u64 != o.stored_bytes {
            return Err(self.corrupt(
                m.step,
                &o.key,
                format!(
                    "truncated or extended: {} bytes, manifest says {}",
                    data.len(),
                    o.stored_bytes
                ),
            ));
        }
        let crc = crc32c::crc32c(&data);
        if crc != o.stored_crc32c {
            return Err(self.corrupt(
                m.step,
                &o.key,
                format!("crc32c {crc:08x}, manifest says {:08x}", o.stored_crc32c),
            ));
        }
        Ok(data)
    }

    /// Reads `len` bytes of `key` as [`RANGES_IN_FLIGHT`] concurrent ranged requests of
    /// [`RANGE_BYTES`], each copied into place as it arrives, so memory stays at one copy of
    /// the object plus the pieces in flight. (`ObjectStore::get_ranges` would coalesce
    /// adjacent ranges into a single request.)
    async fn fetch_ranges(
        &self,
        step: u64,
        key: &str,
        len: u64,
        cancel: &CancellationToken,
    ) -> Result<Vec<u8>> {
        let total = usize::try_from(len)
            .map_err(|_| self.corrupt(step, key, format!("{len} bytes do not fit in memory")))?;
        let path = self.path(key);
        let path = &path;
        let mut buf = vec![0u8; total];
        let mut pieces = futures::stream::iter((0..len).step_by(RANGE_BYTES as usize))
            .map(|start| {
                let range = start..(start + RANGE_BYTES).min(len);
                async move {
                    let bytes = self
                        .retry("get", key, cancel, || async {
                            self.inner
                                .get_range(path, range.clone())
                                .await
                                .map_err(|e| self.err("get", key, e))
                        })
                        .await?;
                    Ok::<_, Error>((range, bytes))
                }
            })
            .buffer_unordered(RANGES_IN_FLIGHT);
        while let Some(piece) = pieces.next().await {
            let (range, bytes) = piece?;
            if bytes.len() as u64 != range.end - range.start {
                return Err(self.corrupt(
                    step,
                    key,
                    format!(
                        "range {}..{} returned {} bytes",
                        range.start,
                        range.end,
                        bytes.len()
                    ),
                ));
            }
            buf[range.start as usize..range.end as usize].copy_from_slice(&bytes);
        }
        Ok(buf)
    }

    /// Fetches and decodes object `idx`, checking every checksum.
    pub(crate) async fn fetch_decoded(
        &self,
        m: &Manifest,
        idx: usize,
        cancel: &CancellationToken,
    ) -> Result<bytes::Bytes> {
        let stored = self.fetch_stored(m, idx, cancel).await?;
        let o = m.objects[idx].clone();
        let raw = tokio::task::spawn_blocking(move || {
            // A raw chunk's stored checksum is its raw checksum (the manifest validator
            // insists), and fetch_stored checked it: no copy, no second pass.
            if o.codec == codec::Codec::Raw {
                return Ok(stored);
            }
            let raw = bytes::Bytes::from(codec::decode(&stored, &o.codec, o.raw_bytes)?);
            drop(stored);
            let crc = crc32c::crc32c(&raw);
            if crc != o.raw_crc32c {
                return Err(format!(
                    "decoded crc32c {crc:08x}, manifest says {:08x}",
                    o.raw_crc32c
                ));
            }
            Ok(raw)
        })
        .await
        .map_err(|e| Error::InvalidInput(format!("decode task: {e}")))?;
        raw.map_err(|reason| self.corrupt(m.step, &m.objects[idx].key, reason))
    }

    /// Reads every object of `step` and checks lengths and checksums. The report lists every
    /// bad object; store errors other than a missing object abort.
    pub async fn verify(
        &self,
        step: u64,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<VerifyReport> {
        let m = self.read_manifest(step, cancel).await?;
        let m = &m;
        let results: Vec<(usize, Result<()>)> = futures::stream::iter(0..m.objects.len())
            .map(|i| async move {
                let r = self.fetch_decoded(m, i, cancel).await.map(|_| ());
                if let Some(p) = &opts.progress {
                    p(m.objects[i].stored_bytes);
                }
                (i, r)
            })
            .buffer_unordered(opts.concurrency.max(1))
            .collect()
            .await;
        let mut bad = Vec::new();
        for (i, r) in results {
            match r {
                Ok(()) => {}
                Err(e) if e.is_integrity() => bad.push((m.objects[i].key.clone(), e.to_string())),
                Err(e) => return Err(e),
            }
        }
        bad.sort();
        Ok(VerifyReport {
            step,
            objects_checked: m.objects.len(),
            stored_bytes: m.stored_bytes(),
            bad,
        })
    }

    /// Writes `outs` under `dest` from the objects that `ops` name, fetching each needed
    /// object once, `concurrency` at a time. Files appear only complete (temp + rename).
    async fn materialize(
        &self,
        m: &Manifest,
        outs: Vec<OutFile>,
        ops: Vec<CopyOp>,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<()> {
        crate::local::create_dir_private(dest)?;
        // Directories made for this step, removed again (when still empty) if it fails, so a
        // failed step leaves nothing behind for a fallback to mix with.
        let mut made_dirs = Vec::new();
        let r = self
            .materialize_into(m, &outs, ops, dest, opts, cancel, &mut made_dirs)
            .await;
        if r.is_err() {
            for d in made_dirs.iter().rev() {
                let _ = std::fs::remove_dir(d);
            }
        }
        r
    }

    /// The work of [`Store::materialize`], noting every directory it makes in `made_dirs`.
    #[allow(clippy::too_many_arguments)]
    async fn materialize_into(
        &self,
        m: &Manifest,
        outs: &[OutFile],
        ops: Vec<CopyOp>,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
        made_dirs: &mut Vec<PathBuf>,
    ) -> Result<()> {
        let mut files = Vec::with_capacity(outs.len());
        for o in outs {
            // Never through a symlink inside `dest`, and never over one.
            let f = DurableFile::create_under(dest, &o.rel)?;
            made_dirs.extend(f.created_dirs.iter().cloned());
            f.set_len(o.total_bytes)?;
            f.write_at(&o.prefix, 0)?;
            files.push(f);
        }
        let files = Arc::new(files);
        let mut by_object: BTreeMap<u32, Vec<CopyOp>> = BTreeMap::new();
        for op in ops {
            by_object.entry(op.object).or_default().push(op);
        }
        futures::stream::iter(by_object)
            .map(|(object, ops)| {
                let files = files.clone();
                async move {
                    let raw = self.fetch_decoded(m, object as usize, cancel).await?;
                    let n = raw.len() as u64;
                    tokio::task::spawn_blocking(move || {
                        for op in ops {
                            let s = op.obj_offset as usize;
                            files[op.out].write_at(&raw[s..s + op.len as usize], op.out_offset)?;
                        }
                        Ok::<_, Error>(())
                    })
                    .await
                    .map_err(|e| Error::InvalidInput(format!("write task: {e}")))??;
                    if let Some(p) = &opts.progress {
                        p(n);
                    }
                    Ok::<_, Error>(())
                }
            })
            .buffer_unordered(opts.concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        let files = Arc::try_unwrap(files).map_err(|_| {
            Error::InvalidInput("output files still shared after all writes".into())
        })?;
        tokio::task::spawn_blocking(move || files.into_iter().try_for_each(DurableFile::commit))
            .await
            .map_err(|e| Error::InvalidInput(format!("fsync task: {e}")))?
    }

    /// Resolves `step` (or the newest committed one when `None`).
    pub async fn resolve_step(&self, step: Option<u64>, cancel: &CancellationToken) -> Result<u64> {
        match step {
            Some(s) => Ok(s),
            None => self
                .latest_committed(cancel)
                .await?
                .map(|m| m.step)
                .ok_or_else(|| Error::NoCommittedStep {
                    store: self.url().to_string(),
                }),
        }
    }

    /// Runs `attempt` on the committed steps from the newest down until one succeeds. A step
    /// that fails with an integrity error (a corrupt or missing object, a bad manifest) is
    /// skipped with a warning naming the step and the bad object, and the next older one is
    /// tried; any other error (the store unreachable, cancellation) ends the search. Returns
    /// the result and the steps skipped, newest first.
    pub(crate) async fn newest_committed_that<T, F, Fut>(
        &self,
        what: &'static str,
        cancel: &CancellationToken,
        mut attempt: F,
    ) -> Result<(T, Vec<u64>)>
    where
        F: FnMut(u64) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut skipped = Vec::new();
        for step in self.committed_steps(cancel).await?.into_iter().rev() {
            match attempt(step).await {
                Ok(v) => return Ok((v, skipped)),
                Err(e) if e.is_integrity() => {
                    tracing::warn!(step, error = %e, "committed step does not {what}; falling back to the previous committed step");
                    skipped.push(step);
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::NoCommittedStep {
            store: self.url().to_string(),
        })
    }

    /// [`Store::pull`] of the newest committed step that pulls whole: a step whose manifest
    /// is invalid or one of whose objects is missing or fails its checksum is skipped (with a
    /// warning) for the previous one. Nothing of a skipped step is left under `dest` (files
    /// appear only once all of a step's bytes were read and checked). Returns the manifest
    /// pulled and the steps skipped, newest first.
    pub async fn pull_newest(
        &self,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<(Manifest, Vec<u64>)> {
        self.newest_committed_that("pull", cancel, |step| self.pull(step, dest, opts, cancel))
            .await
    }

    /// Writes every file of a step under `dest`, byte-identical to what was pushed.
    pub async fn pull(
        &self,
        step: u64,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<Manifest> {
        let m = self.read_manifest(step, cancel).await?;
        let mut outs = Vec::new();
        let mut ops = Vec::new();
        for (i, f) in m.files.iter().enumerate() {
            let mut prefix = (f.header.len() as u64).to_le_bytes().to_vec();
            prefix.extend_from_slice(f.header.as_bytes());
            let data_start = prefix.len() as u64;
            file_range_copies(f, i, 0, f.data_bytes, data_start, &mut ops);
            outs.push(OutFile {
                rel: f.name.clone(),
                total_bytes: data_start + f.data_bytes,
                prefix,
            });
        }
        self.materialize(&m, outs, ops, dest, opts, cancel).await?;
        Ok(m)
    }

    /// Restores what `rank` of `world` needs from `step` into `dest/state.safetensors` (and
    /// `dest/metadata.json`): every replicated tensor whole, and rows
    /// `[rows*rank/world, rows*(rank+1)/world)` of every sharded tensor, re-cut from however
    /// many shards it was saved as. Shards are declared again in the output's
    /// `__metadata__["elastic.shards"]`, so saving the restored file keeps them sharded.
    ///
    /// With `step == None`, takes the newest committed step that restores, and falls back to
    /// older ones (with a warning naming the step and the reason) when it is corrupt or
    /// incomplete.
    pub async fn restore(
        &self,
        step: Option<u64>,
        rank: u32,
        world: u32,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidInput(format!(
                "rank {rank} is not in a world of {world}"
            )));
        }
        if let Some(step) = step {
            return self
                .restore_step(step, rank, world, dest, opts, cancel)
                .await;
        }
        let (mut report, skipped) = self
            .newest_committed_that("restore", cancel, |step| async move {
                // Every rank checks the whole step's presence, not only its own chunks, so
                // ranks that need different chunks still agree on a step that lost an object.
                let m = self.read_manifest(step, cancel).await?;
                self.check_objects_present(&m, cancel).await?;
                self.restore_step(step, rank, world, dest, opts, cancel)
                    .await
            })
            .await?;
        report.skipped_steps = skipped;
        Ok(report)
    }

    async fn restore_step(
        &self,
        step: u64,
        rank: u32,
        world: u32,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport> {
        let m = self.read_manifest(step, cancel).await?;
        let mut out_tensors = Vec::new();
        let mut ops = Vec::new();
        let mut shards_md = serde_json::Map::new();
        let mut offset = 0u64;
        for t in &m.tensors {
            let (shape, pieces): (Vec<u64>, Vec<(u32, u64, u64)>) = if !t.sharded {
                let s = &t.shards[0];
                (
                    t.shape.clone(),
                    vec![(
                        s.file,
                        s.data_offsets[0],
                        s.data_offsets[1] - s.data_offsets[0],
                    )],
                )
            } else {
                let (lo, hi) = rows_for_rank(t.shape[0], rank, world);
                let mut row_shape = t.shape.clone();
                row_shape[0] = 1;
                let row_bytes = header::tensor_bytes(&t.name, &t.dtype, &row_shape)
                    .map_err(Error::InvalidInput)?;
                let mut pieces = Vec::new();
                for s in &t.shards {
                    let s_lo = s.dim0_offset;
                    let s_hi = s_lo + s.shape[0];
                    let (a, b) = (lo.max(s_lo), hi.min(s_hi));
                    if a < b {
                        pieces.push((
                            s.file,
                            s.data_offsets[0] + (a - s_lo) * row_bytes,
                            (b - a) * row_bytes,
                        ));
                    }
                }
                let mut shape = t.shape.clone();
                shape[0] = hi - lo;
                shards_md.insert(
                    t.name.clone(),
                    serde_json::json!({"global_shape": t.shape, "dim0_offset": lo}),
                );
                (shape, pieces)
            };
            let bytes: u64 = pieces.iter().map(|p| p.2).sum();
            out_tensors.push((
                HeaderTensor {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape,
                    data_offsets: [offset, offset + bytes],
                },
                pieces,
            ));
            offset += bytes;
        }
        let mut md = BTreeMap::new();
        md.insert("elastic.step".to_string(), step.to_string());
        md.insert("elastic.rank".to_string(), rank.to_string());
        md.insert("elastic.world_size".to_string(), world.to_string());
        if !shards_md.is_empty() {
            md.insert(
                format::SHARDS_METADATA_KEY.to_string(),
                serde_json::Value::Object(shards_md).to_string(),
            );
        }
        let tensors: Vec<HeaderTensor> = out_tensors.iter().map(|(t, _)| t.clone()).collect();
        let prefix = header::write_header(&tensors, &md);
        let data_start = prefix.len() as u64;
        for (t, pieces) in &out_tensors {
            let mut at = data_start + t.data_offsets[0];
            for &(file, start, len) in pieces {
                file_range_copies(&m.files[file as usize], 0, start, len, at, &mut ops);
                at += len;
            }
        }
        let out = OutFile {
            rel: RESTORE_FILE.to_string(),
            total_bytes: data_start + offset,
            prefix,
        };
        self.materialize(&m, vec![out], ops, dest, opts, cancel)
            .await?;
        let meta = serde_json::json!({
            "step": step, "rank": rank, "world_size": world,
            "saved_world_size": m.world_size, "metadata": m.metadata,
        });
        let meta_path = dest.join(RESTORE_METADATA_FILE);
        let meta_bytes = serde_json::to_vec_pretty(&meta).expect("json");
        tokio::task::spawn_blocking(move || write_durable(&meta_path, &meta_bytes))
            .await
            .map_err(|e| Error::InvalidInput(format!("write task: {e}")))??;
        tracing::info!(step, rank, world, bytes = offset, "restored");
        Ok(RestoreReport {
            step,
            rank,
            world_size: world,
            path: dest.join(RESTORE_FILE),
            tensors: out_tensors.len(),
            bytes: offset,
            skipped_steps: Vec::new(),
            metadata: m.metadata.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_for_rank_tiles_every_world_size() {
        for rows in [0u64, 1, 5, 7, 64, 1001] {
            for world in [1u32, 2, 3, 4, 8] {
                let mut next = 0;
                for r in 0..world {
                    let (lo, hi) = rows_for_rank(rows, r, world);
                    assert_eq!(lo, next);
                    assert!(hi >= lo && hi - lo <= rows / u64::from(world) + 1);
                    next = hi;
                }
                assert_eq!(next, rows);
            }
        }
    }

    #[test]
    fn file_ranges_map_across_segment_boundaries() {
        let f = FileEntry {
            name: "f".into(),
            header: String::new(),
            data_bytes: 30,
            segments: vec![
                format::Segment {
                    object: 0,
                    offset: 5,
                    len: 10,
                },
                format::Segment {
                    object: 1,
                    offset: 0,
                    len: 20,
                },
            ],
        };
        let mut ops = Vec::new();
        file_range_copies(&f, 0, 8, 10, 100, &mut ops);
        assert_eq!(ops.len(), 2);
        assert_eq!(
            (
                ops[0].object,
                ops[0].obj_offset,
                ops[0].len,
                ops[0].out_offset
            ),
            (0, 13, 2, 100)
        );
        assert_eq!(
            (
                ops[1].object,
                ops[1].obj_offset,
                ops[1].len,
                ops[1].out_offset
            ),
            (1, 0, 8, 102)
        );
    }
}
