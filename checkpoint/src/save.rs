//! Streaming save of a rank's part, and the commit that makes a step exist.
//!
//! # Memory and concurrency bound
//!
//! A save reads, encodes and uploads at most `concurrency` chunks at a time. While a chunk is
//! encoded it holds its raw bytes, the encoded output and one byte plane with its compressed
//! form (at most `3 × chunk_bytes_max`); while it uploads, only the encoded bytes. So a save's
//! data memory is bounded by `3 × concurrency × chunk_bytes_max` (384 MiB with the defaults),
//! whatever the part's size. Headers are held in full (each bounded by
//! [`crate::header::HEADER_BYTES_MAX`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::codec;
use crate::error::{Error, Result};
use crate::format::{
    self, FORMAT_VERSION, FileEntry, MANIFEST_BYTES_MAX, Manifest, ObjectEntry, PartRecord,
    PartRef, Segment, ShardEntry, ShardSpec, TensorEntry,
};
use crate::header::{self, Header};
use crate::store::Store;

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

/// What commit needs to make a step exist.
#[derive(Debug, Clone)]
pub struct CommitRequest {
    pub world_size: u32,
    /// Writer ids whose parts must all be durable; commit fails naming the missing ones.
    /// When a writer saved several attempts, the newest durable one is taken, so writer ids
    /// should name the generation too (`g3-rank-0`): a zombie from an older generation then
    /// can never have its part picked.
    pub writers: Vec<String>,
    /// Trainer state: LR scaling, data-loader position, anything JSON.
    pub metadata: Value,
}

/// How a commit ended.
#[derive(Debug, Clone)]
pub enum CommitOutcome {
    /// This call wrote the manifest.
    Committed(Manifest),
    /// Another committer won the race (or the step was committed before); its manifest.
    AlreadyCommitted(Manifest),
}

impl CommitOutcome {
    pub fn manifest(&self) -> &Manifest {
        match self {
            CommitOutcome::Committed(m) | CommitOutcome::AlreadyCommitted(m) => m,
        }
    }
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[derive(Debug, Clone)]
enum Src {
    File(PathBuf),
    Buf(Bytes),
}

impl Src {
    fn len(&self) -> Result<u64> {
        match self {
            Src::File(p) => std::fs::metadata(p)
                .map(|m| m.len())
                .map_err(|e| Error::io(p, e)),
            Src::Buf(b) => Ok(b.len() as u64),
        }
    }

    fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        match self {
            Src::File(p) => {
                use std::os::unix::fs::FileExt;
                let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
                let mut buf = vec![0u8; len];
                f.read_exact_at(&mut buf, offset)
                    .map_err(|e| Error::io(p, e))?;
                Ok(buf)
            }
            Src::Buf(b) => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                b.get(start..start.saturating_add(len))
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| Error::InvalidInput("buffer read out of bounds".into()))
            }
        }
    }
}

struct InputFile {
    name: String,
    src: Src,
    header_text: String,
    header: Header,
    /// Where the data region starts in the file.
    data_start: u64,
}

fn open_input(name: String, src: Src) -> Result<InputFile> {
    format::validate_rel_name(&name).map_err(|reason| Error::InvalidName {
        name: name.clone(),
        reason,
    })?;
    let file_bytes = src.len()?;
    if file_bytes < 8 {
        return Err(Error::InvalidSafetensors {
            file: name,
            reason: format!("{file_bytes} bytes is shorter than the length prefix"),
        });
    }
    let prefix: [u8; 8] = src.read_at(0, 8)?.try_into().expect("8 bytes read");
    let n = header::header_len(prefix, &name, file_bytes)?;
    let text_bytes = src.read_at(8, n as usize)?;
    let header = header::parse_header(&text_bytes, &name)?;
    let data_start = 8 + n;
    // Checked: data offsets come from outside and may sum past u64 (`[0, 2^64-1]`).
    let described = data_start.checked_add(header.data_bytes);
    if described != Some(file_bytes) {
        return Err(Error::InvalidSafetensors {
            file: name,
            reason: match described {
                Some(d) => format!("file has {file_bytes} bytes but its header describes {d}"),
                None => {
                    format!("file has {file_bytes} bytes but its header describes more than 2^64")
                }
            },
        });
    }
    for t in &header.tensors {
        format::validate_rel_name(&t.name).map_err(|reason| Error::InvalidName {
            name: t.name.clone(),
            reason: format!("tensor in file {name}: {reason}"),
        })?;
    }
    let header_text = String::from_utf8(text_bytes).expect("parse_header checked UTF-8");
    Ok(InputFile {
        name,
        src,
        header_text,
        header,
        data_start,
    })
}

/// Every `*.safetensors` regular file under `root`, by relative name. The rule for links and
/// special files: a directory's symlinks are never followed, and an entry named
/// `*.safetensors` that is not a regular file (a symlink, a FIFO, a socket, a device) is
/// refused by name, so what is pushed is exactly what the directory holds. Other entries are
/// ignored. A directory with no `*.safetensors` file at all is refused too: an empty push
/// would become the newest step and hide every older one from `pull`.
fn collect_dir(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    /// Bounds the walk (symlink loops are not followed, but depth is bounded anyway).
    const DEPTH_MAX: usize = 32;
    /// Bounds the entries looked at.
    const ENTRIES_MAX: usize = 1_000_000;
    let mut seen = 0usize;
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            seen += 1;
            if seen > ENTRIES_MAX {
                return Err(Error::InvalidInput(format!(
                    "{} holds over {ENTRIES_MAX} entries",
                    root.display()
                )));
            }
            let path = entry.path();
            // `file_type` does not follow symlinks.
            let ft = entry.file_type().map_err(|e| Error::io(&path, e))?;
            let named_safetensors = path.extension().is_some_and(|e| e == "safetensors");
            if named_safetensors && !ft.is_file() && !ft.is_dir() {
                let what = if ft.is_symlink() {
                    "a symlink"
                } else {
                    "not a regular file"
                };
                return Err(Error::InvalidInput(format!(
                    "{} is {what}; push reads regular files only (copy the file in instead)",
                    path.display()
                )));
            }
            if ft.is_dir() {
                if depth + 1 > DEPTH_MAX {
                    return Err(Error::InvalidInput(format!(
                        "{} is nested over {DEPTH_MAX} levels",
                        path.display()
                    )));
                }
                stack.push((path, depth + 1));
            } else if ft.is_file() && named_safetensors {
                let rel = path.strip_prefix(root).expect("walked under root");
                let name = rel
                    .to_str()
                    .ok_or_else(|| Error::InvalidName {
                        name: rel.to_string_lossy().into_owned(),
                        reason: "not UTF-8".into(),
                    })?
                    .to_string();
                out.push((name, path));
            }
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidInput(format!(
            "{} holds no *.safetensors file; refusing to save an empty part",
            root.display()
        )));
    }
    out.sort();
    Ok(out)
}

#[derive(Debug, Clone)]
struct ChunkPlan {
    file: usize,
    /// Range in the file's data region.
    start: u64,
    len: u64,
    width: Option<u8>,
}

/// Cuts a file's data region into chunks of at most `max` bytes: small tensors are packed
/// together, a big tensor is split at element boundaries.
fn plan_chunks(file: usize, h: &Header, max: u64, out: &mut Vec<ChunkPlan>) {
    // Bytes per plane width (index 0: none, 1: 2, 2: 4, 3: 8) in the chunk being built.
    let mut widths = [0u64; 4];
    let mut cur_start = 0u64;
    let mut cur_len = 0u64;
    let slot = |w: Option<u8>| match w {
        Some(2) => 1,
        Some(4) => 2,
        Some(8) => 3,
        _ => 0,
    };
    let flush = |out: &mut Vec<ChunkPlan>, start: u64, len: u64, widths: &mut [u64; 4]| {
        if len == 0 {
            return;
        }
        let (best, bytes) = widths
            .iter()
            .enumerate()
            .max_by_key(|(_, b)| **b)
            .map(|(i, b)| (i, *b))
            .unwrap_or((0, 0));
        let width = (bytes * 2 > len)
            .then_some([0u8, 2, 4, 8][best])
            .filter(|w| *w > 0);
        out.push(ChunkPlan {
            file,
            start,
            len,
            width,
        });
        *widths = [0; 4];
    };
    for t in &h.tensors {
        let tb = t.data_offsets[1] - t.data_offsets[0];
        if tb == 0 {
            continue;
        }
        let w = header::plane_width_for(&t.dtype);
        if cur_len + tb <= max {
            if cur_len == 0 {
                cur_start = t.data_offsets[0];
            }
            cur_len += tb;
            widths[slot(w)] += tb;
            continue;
        }
        flush(out, cur_start, cur_len, &mut widths);
        let elem = header::dtype_size_bytes(&t.dtype).unwrap_or(1);
        let piece = (max - max % elem).max(elem);
        let mut start = t.data_offsets[0];
        let mut rest = tb;
        while rest > max {
            widths[slot(w)] = piece;
            flush(out, start, piece, &mut widths);
            start += piece;
            rest -= piece;
        }
        cur_start = start;
        cur_len = rest;
        widths[slot(w)] = rest;
    }
    flush(out, cur_start, cur_len, &mut widths);
}

/// Adds one tensor record to a merged list, keyed by name.
fn merge_tensor(
    tensors: &mut Vec<TensorEntry>,
    index: &mut HashMap<String, usize>,
    t: TensorEntry,
) -> std::result::Result<(), String> {
    let Some(&i) = index.get(&t.name) else {
        index.insert(t.name.clone(), tensors.len());
        tensors.push(t);
        return Ok(());
    };
    let have = &mut tensors[i];
    if have.dtype != t.dtype || have.shape != t.shape || have.sharded != t.sharded {
        return Err(format!(
            "tensor {:?} is saved twice with different dtype/shape/sharding ({} {:?} vs {} {:?})",
            t.name, have.dtype, have.shape, t.dtype, t.shape
        ));
    }
    if have.sharded {
        have.shards.extend(t.shards);
        have.shards.sort_by_key(|s| s.dim0_offset);
    }
    // A replicated tensor saved by several writers: they hold the same values; keep the first.
    Ok(())
}

impl Store {
    /// Uploads one writer's part of `step` and returns once every byte and the part record are
    /// durable. Safe to retry: every call uses a fresh attempt id, so nothing a committed
    /// manifest references is ever overwritten.
    pub async fn save_part(
        &self,
        step: u64,
        input: PartInput,
        opts: &SaveOptions,
        cancel: &CancellationToken,
    ) -> Result<PartRecord> {
        use tracing::Instrument;
        let span = tracing::info_span!("save_part", step, writer = %input.writer);
        self.save_part_inner(step, input, opts, cancel)
            .instrument(span)
            .await
    }

    async fn save_part_inner(
        &self,
        step: u64,
        input: PartInput,
        opts: &SaveOptions,
        cancel: &CancellationToken,
    ) -> Result<PartRecord> {
        format::validate_writer(&input.writer).map_err(|reason| Error::InvalidName {
            name: input.writer.clone(),
            reason,
        })?;
        format::validate_step(step).map_err(Error::InvalidInput)?;
        if opts.chunk_bytes_max == 0 || opts.chunk_bytes_max as u64 > format::CHUNK_RAW_BYTES_LIMIT
        {
            return Err(Error::InvalidInput(format!(
                "chunk_bytes_max must be 1..={}",
                format::CHUNK_RAW_BYTES_LIMIT
            )));
        }
        let attempt = format!("{:032x}", rand::random::<u128>());
        tracing::debug!(%attempt, "save started");

        let sources: Vec<(String, Src)> = match input.source {
            PartSource::Dir(d) => {
                let d2 = d.clone();
                tokio::task::spawn_blocking(move || collect_dir(&d2))
                    .await
                    .map_err(|e| Error::InvalidInput(format!("walk task: {e}")))??
                    .into_iter()
                    .map(|(n, p)| (n, Src::File(p)))
                    .collect()
            }
            PartSource::Files(f) => f.into_iter().map(|(n, p)| (n, Src::File(p))).collect(),
            PartSource::Buffers(b) => b.into_iter().map(|(n, b)| (n, Src::Buf(b))).collect(),
        };
        let files: Vec<InputFile> = tokio::task::spawn_blocking(move || {
            sources
                .into_iter()
                .map(|(n, s)| open_input(n, s))
                .collect::<Result<Vec<_>>>()
        })
        .await
        .map_err(|e| Error::InvalidInput(format!("header task: {e}")))??;
        let files = Arc::new(files);

        let mut plans = Vec::new();
        for (i, f) in files.iter().enumerate() {
            plan_chunks(i, &f.header, opts.chunk_bytes_max as u64, &mut plans);
        }
        tracing::debug!(step, chunks = plans.len(), "part planned");

        let writer = input.writer.clone();
        // Unordered, so a slow chunk does not hold finished ones' slots; sorted back after.
        let mut objects: Vec<(usize, ObjectEntry)> =
            futures::stream::iter(plans.iter().cloned().enumerate())
                .map(|(i, plan)| {
                    let files = files.clone();
                    let key = format::data_key(step, &writer, &attempt, i);
                    let compress = opts.compress;
                    let progress = opts.progress.clone();
                    async move {
                        let (stored, entry) = tokio::task::spawn_blocking(move || {
                            let f = &files[plan.file];
                            let raw = f
                                .src
                                .read_at(f.data_start + plan.start, plan.len as usize)?;
                            let raw_crc32c = crc32c::crc32c(&raw);
                            let raw_bytes = raw.len() as u64;
                            let (stored, codec) = if compress {
                                codec::encode(&raw, plan.width, true)
                            } else {
                                (raw, codec::Codec::Raw)
                            };
                            let stored_crc32c = if codec == codec::Codec::Raw {
                                raw_crc32c
                            } else {
                                crc32c::crc32c(&stored)
                            };
                            let entry = ObjectEntry {
                                key,
                                stored_bytes: stored.len() as u64,
                                stored_crc32c,
                                codec,
                                raw_bytes,
                                raw_crc32c,
                            };
                            Ok::<_, Error>((Bytes::from(stored), entry))
                        })
                        .await
                        .map_err(|e| Error::InvalidInput(format!("encode task: {e}")))??;
                        self.put(&entry.key, stored, cancel).await?;
                        if let Some(p) = &progress {
                            p(entry.raw_bytes);
                        }
                        Ok::<_, Error>((i, entry))
                    }
                })
                .buffer_unordered(opts.concurrency.max(1))
                .try_collect()
                .await?;
        objects.sort_by_key(|(i, _)| *i);
        let objects: Vec<ObjectEntry> = objects.into_iter().map(|(_, o)| o).collect();

        // Files and tensors, with local indexes into `objects`.
        let mut file_entries = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        let mut index = HashMap::new();
        for (fi, f) in files.iter().enumerate() {
            let segments = plans
                .iter()
                .enumerate()
                .filter(|(_, p)| p.file == fi)
                .map(|(oi, p)| Segment {
                    object: oi as u32,
                    offset: 0,
                    len: p.len,
                })
                .collect();
            file_entries.push(FileEntry {
                name: f.name.clone(),
                header: f.header_text.clone(),
                data_bytes: f.header.data_bytes,
                segments,
            });
            let declared = format::shards_from_metadata(&f.header.metadata).map_err(|reason| {
                Error::InvalidSafetensors {
                    file: f.name.clone(),
                    reason,
                }
            })?;
            for t in &f.header.tensors {
                let spec = input.shards.get(&t.name).or_else(|| declared.get(&t.name));
                let entry = TensorEntry {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape: spec.map_or_else(|| t.shape.clone(), |s| s.global_shape.clone()),
                    sharded: spec.is_some(),
                    shards: vec![ShardEntry {
                        dim0_offset: spec.map_or(0, |s| s.dim0_offset),
                        shape: t.shape.clone(),
                        file: fi as u32,
                        data_offsets: t.data_offsets,
                    }],
                };
                merge_tensor(&mut tensors, &mut index, entry)
                    .map_err(|reason| Error::InvalidInput(format!("file {}: {reason}", f.name)))?;
            }
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let record = PartRecord {
            format_version: FORMAT_VERSION,
            step,
            writer: input.writer.clone(),
            attempt: attempt.clone(),
            created_unix_ms: now_unix_ms(),
            objects,
            files: file_entries,
            tensors,
        };
        // Check before writing what a reader will check after reading.
        let json = serde_json::to_vec(&record).expect("part record serializes");
        PartRecord::parse(&json, step)
            .map_err(|e| Error::InvalidInput(format!("part of writer {}: {e:?}", input.writer)))?;
        self.put(
            &format::part_key(step, &input.writer, &attempt),
            json.into(),
            cancel,
        )
        .await?;
        tracing::info!(
            step,
            writer = %input.writer,
            objects = record.objects.len(),
            raw_bytes = record.objects.iter().map(|o| o.raw_bytes).sum::<u64>(),
            stored_bytes = record.objects.iter().map(|o| o.stored_bytes).sum::<u64>(),
            "part durable"
        );
        Ok(record)
    }

    /// Says that `writer` will never save its part of `step` (its staging disk is full, say),
    /// so that committers waiting for it give the step up at once with
    /// [`Error::Abandoned`] instead of waiting for their deadline. Commits nothing, deletes
    /// nothing; a part the writer saved anyway still counts.
    pub async fn abandon_part(
        &self,
        step: u64,
        writer: &str,
        reason: &str,
        cancel: &CancellationToken,
    ) -> Result<()> {
        format::validate_writer(writer).map_err(|reason| Error::InvalidName {
            name: writer.to_string(),
            reason,
        })?;
        format::validate_step(step).map_err(Error::InvalidInput)?;
        let mut cut = reason.len().min(format::ABANDON_REASON_BYTES_MAX);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let body = serde_json::json!({
            "format_version": FORMAT_VERSION,
            "step": step,
            "writer": writer,
            "reason": &reason[..cut],
            "created_unix_ms": now_unix_ms(),
        });
        let bytes = serde_json::to_vec(&body).expect("marker serializes");
        self.put(&format::abandoned_key(step, writer), bytes.into(), cancel)
            .await
    }

    /// Reads and validates the manifest of `step`.
    pub async fn read_manifest(&self, step: u64, cancel: &CancellationToken) -> Result<Manifest> {
        let key = format::manifest_key(step);
        let bytes = match self.get_bounded(&key, MANIFEST_BYTES_MAX, cancel).await {
            Err(e) if e.store_kind() == Some(crate::error::StoreErrorKind::NotFound) => {
                return Err(Error::StepNotFound {
                    store: self.url().to_string(),
                    step,
                });
            }
            // Over the size limit: bad data, so readers fall back like for any bad manifest.
            Err(Error::Store {
                kind: crate::error::StoreErrorKind::NotSupported,
                message,
                ..
            }) => {
                return Err(Error::InvalidManifest {
                    store: self.url().to_string(),
                    key,
                    reason: message,
                });
            }
            r => r?,
        };
        Manifest::parse(&bytes, step).map_err(|e| self.manifest_error(&key, e))
    }

    pub(crate) fn manifest_error(&self, key: &str, e: format::ParseError) -> Error {
        match e {
            format::ParseError::UnsupportedVersion(version) => Error::UnsupportedVersion {
                store: self.url().to_string(),
                key: key.to_string(),
                version,
                supported: FORMAT_VERSION,
            },
            format::ParseError::Invalid(reason) => Error::InvalidManifest {
                store: self.url().to_string(),
                key: key.to_string(),
                reason,
            },
        }
    }

    /// Writes the manifest of `step` once every expected writer's part is durable: exactly one
    /// of several racing committers writes it; the others get
    /// [`CommitOutcome::AlreadyCommitted`] with the winner's manifest.
    pub async fn commit(
        &self,
        step: u64,
        req: CommitRequest,
        cancel: &CancellationToken,
    ) -> Result<CommitOutcome> {
        let incomplete = |reason: String| Error::Incomplete {
            store: self.url().to_string(),
            step,
            reason,
        };
        if req.world_size == 0 || req.writers.is_empty() {
            return Err(incomplete(
                "world_size and writers must not be empty".into(),
            ));
        }
        let rejected = |reason: String| Error::Rejected {
            store: self.url().to_string(),
            step,
            reason,
        };
        format::validate_step(step).map_err(rejected)?;
        match self.read_manifest(step, cancel).await {
            Ok(m) => return Ok(CommitOutcome::AlreadyCommitted(m)),
            Err(Error::StepNotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        // The newest durable attempt of each writer, and the writers that gave the step up.
        let mut chosen: BTreeMap<String, PartRecord> = BTreeMap::new();
        let mut abandoned: BTreeMap<String, String> = BTreeMap::new();
        for (key, _, _) in self.list(&format::parts_dir(step), cancel).await? {
            if let Some(writer) = key
                .strip_suffix(format::ABANDONED_SUFFIX)
                .and_then(|k| k.rsplit('/').next())
                && req.writers.iter().any(|w| w == writer)
            {
                abandoned.insert(writer.to_string(), key.clone());
                continue;
            }
            if !key.ends_with(".json") {
                continue;
            }
            let bytes = self.get_bounded(&key, MANIFEST_BYTES_MAX, cancel).await?;
            let rec = match PartRecord::parse(&bytes, step) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(step, key, error = ?e, "ignoring invalid part record");
                    continue;
                }
            };
            if !req.writers.contains(&rec.writer) {
                continue;
            }
            let newer = chosen.get(&rec.writer).is_none_or(|have| {
                (rec.created_unix_ms, &rec.attempt) > (have.created_unix_ms, &have.attempt)
            });
            if newer {
                chosen.insert(rec.writer.clone(), rec);
            }
        }
        let missing: Vec<&String> = req
            .writers
            .iter()
            .filter(|w| !chosen.contains_key(*w))
            .collect();
        if let Some((writer, key)) = missing
            .iter()
            .find_map(|w| abandoned.get_key_value(w.as_str()))
        {
            let reason = match self
                .get_bounded(
                    key,
                    format::ABANDON_REASON_BYTES_MAX as u64 * 2 + 512,
                    cancel,
                )
                .await
            {
                Ok(b) => serde_json::from_slice::<Value>(&b)
                    .ok()
                    .and_then(|v| v.get("reason").and_then(Value::as_str).map(str::to_string))
                    .unwrap_or_else(|| "no reason given".into()),
                Err(e) => format!("its marker {key} does not read: {e}"),
            };
            return Err(Error::Abandoned {
                store: self.url().to_string(),
                step,
                writer: writer.clone(),
                reason,
            });
        }
        if !missing.is_empty() {
            return Err(incomplete(format!(
                "no durable part from writers {missing:?}"
            )));
        }

        // Every object must be present with its recorded length before the manifest names it.
        // Owned (key, length) pairs: a stream of borrowing closures would make this future
        // fail `Send` checks of callers that spawn it.
        let all: Vec<(String, u64)> = chosen
            .values()
            .flat_map(|r| r.objects.iter())
            .map(|o| (o.key.clone(), o.stored_bytes))
            .collect();
        futures::stream::iter(all)
            .map(|(key, len)| async move {
                let size = self.head(&key, cancel).await?;
                if size != len {
                    return Err(incomplete(format!(
                        "object {key} has {size} bytes, its part says {len}"
                    )));
                }
                Ok(())
            })
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await?;

        let mut manifest = Manifest {
            format_version: FORMAT_VERSION,
            step,
            created_unix_ms: now_unix_ms(),
            world_size: req.world_size,
            metadata: req.metadata,
            parts: Vec::new(),
            objects: Vec::new(),
            files: Vec::new(),
            tensors: Vec::new(),
        };
        let mut index = HashMap::new();
        for rec in chosen.into_values() {
            let obj_base = manifest.objects.len() as u32;
            let file_base = manifest.files.len() as u32;
            manifest.parts.push(PartRef {
                writer: rec.writer,
                attempt: rec.attempt,
            });
            manifest.objects.extend(rec.objects);
            for mut f in rec.files {
                f.segments.iter_mut().for_each(|s| s.object += obj_base);
                manifest.files.push(f);
            }
            for mut t in rec.tensors {
                t.shards.iter_mut().for_each(|s| s.file += file_base);
                merge_tensor(&mut manifest.tensors, &mut index, t).map_err(incomplete)?;
            }
        }
        manifest.tensors.sort_by(|a, b| a.name.cmp(&b.name));
        manifest.validate(step).map_err(incomplete)?;
        if manifest.files.is_empty() {
            return Err(rejected(
                "its parts hold no file: an empty step would hide every older one".into(),
            ));
        }
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        // Check before writing what every reader checks after reading: a manifest over the
        // read limit would be committed, unreadable, and its step number taken for good.
        let limit = self.opts.manifest_bytes_max.min(MANIFEST_BYTES_MAX);
        if json.len() as u64 > limit {
            return Err(rejected(format!(
                "its manifest would be {} bytes, over the limit of {limit} \
                 (headers of {} bytes in {} files, {} tensors)",
                json.len(),
                manifest
                    .files
                    .iter()
                    .map(|f| f.header.len() as u64)
                    .sum::<u64>(),
                manifest.files.len(),
                manifest.tensors.len()
            )));
        }
        let key = format::manifest_key(step);
        if self.put_create(&key, json.into(), cancel).await? {
            tracing::info!(step, objects = manifest.objects.len(), "step committed");
            return Ok(CommitOutcome::Committed(manifest));
        }
        let existing = self.read_manifest(step, cancel).await?;
        tracing::info!(step, "another committer won the race for this step");
        Ok(CommitOutcome::AlreadyCommitted(existing))
    }
}

/// Splits replicated (DDP) tensors across `world` ranks so that each byte is written once in
/// total and ranks write about the same number of bytes (largest first, onto the least loaded
/// rank). Deterministic: every rank computes the same split from the same list.
pub fn split_by_bytes(tensors: &[(String, u64)], world: u32) -> Vec<Vec<String>> {
    let world = world.max(1) as usize;
    let mut order: Vec<&(String, u64)> = tensors.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut load = vec![0u64; world];
    let mut out = vec![Vec::new(); world];
    for (name, bytes) in order {
        let (rank, _) = load
            .iter()
            .enumerate()
            .min_by_key(|(i, l)| (**l, *i))
            .expect("world >= 1");
        load[rank] += bytes;
        out[rank].push(name.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_of(tensors: &[(&str, &str, u64)]) -> Header {
        let mut off = 0;
        let mut h = Header::default();
        for (name, dtype, bytes) in tensors {
            let elem = header::dtype_size_bytes(dtype).unwrap();
            h.tensors.push(header::HeaderTensor {
                name: name.to_string(),
                dtype: dtype.to_string(),
                shape: vec![bytes / elem],
                data_offsets: [off, off + bytes],
            });
            off += bytes;
        }
        h.data_bytes = off;
        h
    }

    #[test]
    fn chunks_pack_small_tensors_split_big_ones_and_cover_the_data_exactly() {
        let h = header_of(&[
            ("a", "F32", 40),
            ("b", "F32", 40),
            ("big", "BF16", 250),
            ("c", "U8", 3),
            ("d", "F32", 100),
        ]);
        let mut plans = Vec::new();
        plan_chunks(0, &h, 100, &mut plans);
        let mut pos = 0;
        for p in &plans {
            assert_eq!(p.start, pos, "{plans:?}");
            assert!(p.len <= 100 && p.len > 0);
            pos += p.len;
        }
        assert_eq!(pos, h.data_bytes);
        assert_eq!(plans[0].len, 80, "a and b packed: {plans:?}");
        assert_eq!(plans[0].width, Some(4));
        assert_eq!(plans[1].width, Some(2));
    }

    #[test]
    fn ddp_split_writes_each_tensor_once_and_balances_bytes() {
        let tensors: Vec<(String, u64)> = (0..50)
            .map(|i| (format!("t{i}"), (i * 7919 % 1000 + 1) as u64))
            .collect();
        for world in [1u32, 2, 3, 8, 64] {
            let split = split_by_bytes(&tensors, world);
            assert_eq!(split.len(), world as usize);
            let mut all: Vec<&String> = split.iter().flatten().collect();
            all.sort();
            all.dedup();
            assert_eq!(all.len(), tensors.len());
            let size: HashMap<&String, u64> = tensors.iter().map(|(n, b)| (n, *b)).collect();
            let loads: Vec<u64> = split
                .iter()
                .map(|r| r.iter().map(|n| size[n]).sum())
                .collect();
            let max_t = tensors.iter().map(|t| t.1).max().unwrap();
            assert!(loads.iter().max().unwrap() - loads.iter().min().unwrap() <= max_t);
            assert_eq!(split, split_by_bytes(&tensors, world), "deterministic");
        }
    }
}
