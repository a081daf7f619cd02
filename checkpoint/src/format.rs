//! The on-bucket format, version 1.
//!
//! # Key layout
//!
//! Every key is relative to the checkpoint URL's prefix:
//!
//! ```text
//! steps/<step:020>/data/<writer>-<attempt>/<chunk:06>.bin   chunk objects of one part
//! steps/<step:020>/parts/<writer>-<attempt>.json            part record, written after its data
//! steps/<step:020>/parts/<writer>.abandoned                 the writer gave the step up (optional)
//! steps/<step:020>/manifest.json                            the commit, written last
//! ```
//!
//! A writer that cannot save its part (its staging disk is full) may say so with a small JSON
//! object, `{"format_version":1,"step":S,"writer":W,"reason":"...","created_unix_ms":T}`, so
//! committers stop waiting for a part that will never come; it never commits or uncommits
//! anything, and gc removes it with the step's other leftovers.
//!
//! `<step:020>` is the step zero-padded to 20 digits so keys sort by step. `<writer>` is the
//! saver's id (`[A-Za-z0-9_.-]{1,64}`, e.g. `rank-3`) and `<attempt>` a random 128-bit hex id
//! made fresh for every save call, so a stale or retried writer never overwrites bytes that a
//! committed manifest references.
//!
//! # Commit rule
//!
//! A step exists, for every reader, exactly when `steps/<step>/manifest.json` exists. The
//! manifest is written with a create-only put (`PutMode::Create`) after every object it lists
//! is durable, so of two racing committers exactly one wins. Everything else under a step
//! without a manifest is a leftover that garbage collection removes after an age bound.
//!
//! # Manifest schema, format 3 (`manifest.json`, JSON)
//!
//! - `format_version`: `3` (this build reads `1`, `2` and `3`; a manifest of version 1 has no
//!   `block_crc32c`, and only version 3 writes `zstd-blocks`). Readers reject any other value
//!   before reading further.
//! - `step`, `created_unix_ms`, `world_size`, `metadata` (any JSON the trainer adds).
//! - `parts`: the `{writer, attempt}` pairs committed.
//! - `objects[]`: `key`, `stored_bytes`, `stored_crc32c` (of the bytes in the store),
//!   `codec` (`{"name":"raw"}`, `{"name":"zstd-blocks","width":w,"blocks":[n..]}`, and from
//!   older formats `{"name":"zstd"}` or
//!   `{"name":"zstd-planes","width":w,"planes":[{"zstd":bool,"stored_bytes":n}..]}`),
//!   `raw_bytes`, `raw_crc32c` (of the decoded bytes). A `zstd-blocks` object is its blocks of
//!   [`CHECK_BLOCK_BYTES`] decoded bytes each, stored one after another in `n` bytes each
//!   ([`crate::codec`] has the layout of a block). A `zstd-planes` object is the `w` planes of
//!   the aligned prefix, one after another, then the unaligned tail raw. A raw or `zstd-blocks`
//!   object also has `block_crc32c`: the crc32c of each [`CHECK_BLOCK_BYTES`] of its decoded
//!   bytes, so a reader that needs part of it reads, decodes and checks only the blocks that
//!   hold that part.
//! - `files[]`: `name` (relative path as pushed), `header` (the exact safetensors header
//!   text, padding included, so a pulled file is byte-identical), `data_bytes`, and
//!   `segments[]` of `{object, offset, len}`: the file's data region is these ranges of the
//!   objects' decoded bytes, in order.
//! - `tensors[]`: `name`, `dtype`, global `shape`, `sharded` (cut along dim 0 or replicated),
//!   and `shards[]` of `{dim0_offset, shape, file, data_offsets}`: where each shard sits in the
//!   global tensor, and which byte range of which file's data region holds it.
//!
//! Readers validate all of it before use: known version, safe names, lengths within bounds,
//! segments that cover every object byte exactly once, byte counts that agree with dtype × shape, shards that tile dim 0,
//! and headers that agree with the tensor list. Checksums are checked on every read.
//!
//! # Sharded tensors
//!
//! A writer declares that a tensor of its file is one shard of a bigger tensor cut along dim 0
//! in its safetensors header, `__metadata__["elastic.shards"]` ([`SHARDS_METADATA_KEY`]): JSON
//! text `{"<tensor>": {"global_shape": [...], "dim0_offset": n}}`. The file holds the rows
//! `[n, n + shape[0])` of the global tensor; a shard may hold no rows (`shape[0] == 0`). The
//! manifest lists every writer's shard; together they tile dim 0.
//!
//! A restore for rank `r` of a world of `W` gives every sharded tensor rows
//! `[min(r * c, R), min((r + 1) * c, R))` of its `R` rows, with `c = ceil(R / W)`: PyTorch's
//! `Shard(0)` rule, what a DTensor (and FSDP2) holds on that rank, so ranks past the last
//! chunk get `[0, ...]` tensors ([`crate::restore::rows_for_rank`]). The restored file declares
//! those rows in its own `elastic.shards`, so it can be saved again as it is.
//!
//! # What bad input gets
//!
//! Nothing below panics, and none of it costs a committed step. "Falls back" means: a read
//! of the newest step (`pull`, `export` or `restore` without `--step`, the agent's resume)
//! warns with the step and the bad object and takes the previous committed step that reads
//! whole; asked for by number, the step is an error naming the object.
//!
//! | input | what happens |
//! |---|---|
//! | a chunk with a flipped bit, truncated, extended or missing | the checksum or length check names the object; falls back |
//! | a chunk of a local directory cut shorter while a restore streams it | named as truncated with its new length, never read short; nothing of it is renamed into place; falls back |
//! | a symlink planted under a local store where a save writes (a step or data directory) | the save is refused naming it; nothing is written where it points |
//! | a manifest that is not JSON, of an unknown `format_version`, over [`MANIFEST_BYTES_MAX`], or breaking any rule above | `InvalidManifest` / `UnsupportedVersion` naming the key; falls back; `ls` shows it as "committed but invalid" |
//! | a manifest naming a file where another needs a directory (`a.safetensors` and `a.safetensors/b.safetensors`) | invalid manifest; falls back |
//! | a FIFO, socket, device or symlink where an object belongs (`file://`) | never opened (a FIFO would block); the object is "not a regular file"; falls back |
//! | a name with `..`, `.`, an empty component, a leading `/`, NUL, backslash or any control character (terminal escapes) | refused at push and in manifests; human output escapes control characters anyway |
//! | a safetensors header over [`HEADER_BYTES_MAX`], not UTF-8 or JSON, with unknown dtypes, gaps, overlaps, or offsets whose sums overflow | `InvalidSafetensors` naming the file |
//! | a step over [`STEP_MAX`] (2^53 - 1) | refused at push, save, commit and in manifests and worker messages |
//! | a push of a directory with no `*.safetensors` file, or one that is a symlink or not a regular file | refused, nothing written (symlinks are never followed) |
//! | a commit whose merged manifest would be over the read limit, or hold no file | `Rejected` before anything is written: the step number stays free |
//! | `gc` when the newest steps do not verify | they do not count toward `--keep-last`; the newest step that verifies is never deleted |
//! | `pull` into a non-empty directory, or through a symlink inside it | refused without `--force`; never through or over a symlink, even with it |
//! | `export` or `restore` (the command) into a directory that holds anything, onto a file, or through a symlink at the directory or inside it | refused before anything is read, nothing written (no `--force`) |
//! | `export --key K` of an entry the step does not hold | `NotExportable` listing the entries it holds; no fallback |
//! | `export` of an entry that is not a flat map of names to tensors (an optimizer's state, a list, a plain value), or whose skeleton in `metadata.state` has another tag, nesting, an unknown format or a tensor the step lacks | `NotExportable` naming the entry and the place; no fallback |
//! | `export --max-shard-size` of 0 or not a size (`5GB`, `500MB`, `2GiB`, bytes) | refused naming the flag |

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::codec::Codec;
use crate::header::{self, HEADER_BYTES_MAX};

/// The manifest format version this build writes. Version 2 added `block_crc32c` to raw
/// objects; version 3 the `zstd-blocks` codec, with `block_crc32c` too.
pub const FORMAT_VERSION: u32 = 3;
/// The oldest manifest format version this build reads (every one up to [`FORMAT_VERSION`]).
pub const FORMAT_VERSION_OLDEST_READ: u32 = 1;
/// The decoded bytes each checksum of an object's `block_crc32c` covers (the last block may be
/// shorter): the unit a ranged read fetches and checks, so a restore that needs part of a
/// chunk reads at most one block more than it needs at each end of each range.
pub const CHECK_BLOCK_BYTES: u64 = 256 * 1024;
/// The largest manifest or part record this crate reads.
pub const MANIFEST_BYTES_MAX: u64 = 256 * 1024 * 1024;
/// The largest decoded chunk a reader accepts (bounds restore memory per chunk).
pub const CHUNK_RAW_BYTES_LIMIT: u64 = 1024 * 1024 * 1024;
/// The longest file or tensor name accepted.
pub const NAME_BYTES_MAX: usize = 1024;
/// The largest step number: 2^53 - 1, the largest integer every JSON reader (JavaScript's,
/// and Python's through a float) holds exactly, so a step survives manifests, etcd records
/// and worker messages unchanged, and `step + 1` never overflows.
pub const STEP_MAX: u64 = (1 << 53) - 1;

/// The `block_crc32c` of bytes handed over in order, in pieces of any size, and the crc32c of
/// all of them, in one pass.
#[derive(Debug, Default, Clone)]
pub struct BlockCrcs {
    crcs: Vec<u32>,
    /// The crc32c of the finished blocks.
    whole: u32,
    crc: u32,
    /// Bytes of the current, unfinished block.
    filled: u64,
}

impl BlockCrcs {
    pub fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let take = (CHECK_BLOCK_BYTES - self.filled).min(bytes.len() as u64) as usize;
            self.crc = crc32c::crc32c_append(self.crc, &bytes[..take]);
            self.filled += take as u64;
            bytes = &bytes[take..];
            if self.filled == CHECK_BLOCK_BYTES {
                self.end_block();
            }
        }
    }

    fn end_block(&mut self) {
        self.whole = if self.filled == CHECK_BLOCK_BYTES {
            shift_by_block(self.whole) ^ self.crc
        } else {
            crc32c::crc32c_combine(self.whole, self.crc, self.filled as usize)
        };
        self.crcs.push(self.crc);
        (self.crc, self.filled) = (0, 0);
    }

    /// `(crc32c of all the bytes, block_crc32c)`.
    pub fn finish(mut self) -> (u32, Vec<u32>) {
        if self.filled > 0 {
            self.end_block();
        }
        (self.whole, self.crcs)
    }

    /// The `block_crc32c` of `bytes`.
    pub fn of(bytes: &[u8]) -> Vec<u32> {
        let mut b = BlockCrcs::default();
        b.push(bytes);
        b.finish().1
    }
}

/// `crc32c_combine(a, 0, CHECK_BLOCK_BYTES)`: the checksum `a` of some bytes carried past a
/// block of zeros, so that `shift_by_block(a) ^ b` combines it with a block's checksum `b`. The
/// combination is linear in `a`, so it is a table of its value at each bit: 32 xors at most
/// per block, where `crc32c_combine` works through a 32x32 matrix for each bit of the length.
fn shift_by_block(a: u32) -> u32 {
    static BY_BIT: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    let by_bit = BY_BIT.get_or_init(|| {
        std::array::from_fn(|i| crc32c::crc32c_combine(1 << i, 0, CHECK_BLOCK_BYTES as usize))
    });
    let (mut a, mut out) = (a, 0);
    while a != 0 {
        out ^= by_bit[a.trailing_zeros() as usize];
        a &= a - 1;
    }
    out
}

/// Checks a step number against [`STEP_MAX`].
pub fn validate_step(step: u64) -> Result<(), String> {
    if step > STEP_MAX {
        return Err(format!("step {step} is over the largest step {STEP_MAX}"));
    }
    Ok(())
}

pub const STEPS_DIR: &str = "steps";
pub const MANIFEST_FILE: &str = "manifest.json";

pub fn step_dir(step: u64) -> String {
    format!("{STEPS_DIR}/{step:020}")
}
pub fn manifest_key(step: u64) -> String {
    format!("{}/{MANIFEST_FILE}", step_dir(step))
}
pub fn parts_dir(step: u64) -> String {
    format!("{}/parts", step_dir(step))
}
pub fn part_key(step: u64, writer: &str, attempt: &str) -> String {
    format!("{}/{writer}-{attempt}.json", parts_dir(step))
}
/// The suffix of an abandonment marker in a step's `parts/` directory.
pub const ABANDONED_SUFFIX: &str = ".abandoned";
/// The longest reason an abandonment marker keeps.
pub const ABANDON_REASON_BYTES_MAX: usize = 1024;
pub fn abandoned_key(step: u64, writer: &str) -> String {
    format!("{}/{writer}{ABANDONED_SUFFIX}", parts_dir(step))
}
/// Where every writer's data of a step lies.
pub fn data_root(step: u64) -> String {
    format!("{}/data", step_dir(step))
}
pub fn data_dir(step: u64, writer: &str, attempt: &str) -> String {
    format!("{}/{writer}-{attempt}", data_root(step))
}
pub fn data_key(step: u64, writer: &str, attempt: &str, chunk: usize) -> String {
    format!("{}/{chunk:06}.bin", data_dir(step, writer, attempt))
}
/// Parses the step out of a `steps/<step:020>` directory name.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    (name.len() == 20 && name.bytes().all(|b| b.is_ascii_digit()))
        .then(|| name.parse().ok())
        .flatten()
}

/// Checks a writer id: `[A-Za-z0-9_.-]{1,64}`, not starting with `.`.
pub fn validate_writer(writer: &str) -> Result<(), String> {
    if writer.is_empty()
        || writer.len() > 64
        || writer.starts_with('.')
        || !writer
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(format!(
            "writer id {writer:?} must be 1-64 of [A-Za-z0-9_.-], not starting with '.'"
        ));
    }
    Ok(())
}

/// Checks a relative name (file or tensor): not empty, not absolute, no `..`/`.`/empty
/// components, no NUL, backslash or other control character (a name is printed on terminals),
/// at most [`NAME_BYTES_MAX`] bytes.
pub fn validate_rel_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("name is empty".into());
    }
    if name.len() > NAME_BYTES_MAX {
        return Err(format!("name is over {NAME_BYTES_MAX} bytes"));
    }
    if name.contains('\0') {
        return Err("name contains NUL".into());
    }
    if name.contains('\\') {
        return Err("name contains a backslash".into());
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(format!(
            "name contains the control character U+{:04X}",
            u32::from(c)
        ));
    }
    if name.starts_with('/') {
        return Err("name is an absolute path".into());
    }
    if name
        .split('/')
        .any(|c| c == ".." || c == "." || c.is_empty())
    {
        return Err("name has a '..', '.' or empty path component".into());
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectEntry {
    pub key: String,
    pub stored_bytes: u64,
    pub stored_crc32c: u32,
    pub codec: Codec,
    pub raw_bytes: u64,
    pub raw_crc32c: u32,
    /// Raw (format 2 and on) and `zstd-blocks` objects: the crc32c of each
    /// [`CHECK_BLOCK_BYTES`] of the decoded object in order, so that part of it can be read and
    /// checked without reading all of it. Empty for the compressed codecs of format 2, and in
    /// format 1.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_crc32c: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Segment {
    pub object: u32,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub header: String,
    pub data_bytes: u64,
    pub segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub dim0_offset: u64,
    pub shape: Vec<u64>,
    pub file: u32,
    pub data_offsets: [u64; 2],
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub sharded: bool,
    pub shards: Vec<ShardEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartRef {
    pub writer: String,
    pub attempt: String,
}

/// The commit record of one step. See the module docs for the schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub step: u64,
    pub created_unix_ms: u64,
    pub world_size: u32,
    pub metadata: Value,
    pub parts: Vec<PartRef>,
    pub objects: Vec<ObjectEntry>,
    pub files: Vec<FileEntry>,
    pub tensors: Vec<TensorEntry>,
}

/// What one writer saved for a step: stored next to its data once the data is durable, and
/// merged into the manifest at commit. Indexes (`segments[].object`, `shards[].file`) are
/// local to the record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartRecord {
    pub format_version: u32,
    pub step: u64,
    pub writer: String,
    pub attempt: String,
    pub created_unix_ms: u64,
    pub objects: Vec<ObjectEntry>,
    pub files: Vec<FileEntry>,
    pub tensors: Vec<TensorEntry>,
}

/// Why manifest bytes were rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    UnsupportedVersion(u64),
    Invalid(String),
}

#[derive(Deserialize)]
struct VersionProbe {
    format_version: Value,
}

fn probe_version(bytes: &[u8]) -> Result<(), ParseError> {
    if bytes.len() as u64 > MANIFEST_BYTES_MAX {
        return Err(ParseError::Invalid(format!(
            "{} bytes, over the limit of {MANIFEST_BYTES_MAX}",
            bytes.len()
        )));
    }
    let probe: VersionProbe = serde_json::from_slice(bytes)
        .map_err(|e| ParseError::Invalid(format!("not a manifest: {e}")))?;
    match probe.format_version.as_u64() {
        Some(v)
            if (u64::from(FORMAT_VERSION_OLDEST_READ)..=u64::from(FORMAT_VERSION)).contains(&v) =>
        {
            Ok(())
        }
        Some(v) => Err(ParseError::UnsupportedVersion(v)),
        None => Err(ParseError::Invalid(
            "format_version is not an unsigned integer".into(),
        )),
    }
}

impl Manifest {
    /// Parses and fully validates manifest bytes read from `steps/<step>/manifest.json`.
    pub fn parse(bytes: &[u8], step: u64) -> Result<Manifest, ParseError> {
        probe_version(bytes)?;
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| ParseError::Invalid(format!("schema: {e}")))?;
        m.validate(step).map_err(ParseError::Invalid)?;
        Ok(m)
    }

    /// Checks every internal rule of the format (see module docs).
    pub fn validate(&self, step: u64) -> Result<(), String> {
        if self.step != step {
            return Err(format!(
                "manifest says step {} but is stored as step {step}",
                self.step
            ));
        }
        validate_step(step)?;
        if self.world_size == 0 {
            return Err("world_size is 0".into());
        }
        validate_content(step, &self.objects, &self.files, &self.tensors, true)
    }

    /// Total stored bytes of all objects.
    pub fn stored_bytes(&self) -> u64 {
        self.objects.iter().map(|o| o.stored_bytes).sum()
    }
    /// Total decoded bytes of all objects.
    pub fn raw_bytes(&self) -> u64 {
        self.objects.iter().map(|o| o.raw_bytes).sum()
    }
}

impl PartRecord {
    pub fn parse(bytes: &[u8], step: u64) -> Result<PartRecord, ParseError> {
        probe_version(bytes)?;
        let p: PartRecord = serde_json::from_slice(bytes)
            .map_err(|e| ParseError::Invalid(format!("schema: {e}")))?;
        if p.step != step {
            return Err(ParseError::Invalid(format!(
                "part record says step {} but is stored as step {step}",
                p.step
            )));
        }
        validate_writer(&p.writer).map_err(ParseError::Invalid)?;
        validate_writer(&p.attempt).map_err(ParseError::Invalid)?;
        let prefix = format!("{}/", data_dir(step, &p.writer, &p.attempt));
        if let Some(o) = p.objects.iter().find(|o| !o.key.starts_with(&prefix)) {
            return Err(ParseError::Invalid(format!(
                "object {} is outside the part's data directory",
                o.key
            )));
        }
        validate_content(step, &p.objects, &p.files, &p.tensors, false)
            .map_err(ParseError::Invalid)?;
        Ok(p)
    }
}

/// The shared validation of objects, files and tensors. `complete` demands that sharded
/// tensors' shards tile dim 0 (a manifest); a part record holds only some shards.
pub fn validate_content(
    step: u64,
    objects: &[ObjectEntry],
    files: &[FileEntry],
    tensors: &[TensorEntry],
    complete: bool,
) -> Result<(), String> {
    let data_prefix = format!("{}/data/", step_dir(step));
    let mut keys = BTreeSet::new();
    for o in objects {
        let rest = o
            .key
            .strip_prefix(&data_prefix)
            .ok_or_else(|| format!("object {} is outside {data_prefix}", o.key))?;
        validate_rel_name(rest).map_err(|e| format!("object {}: {e}", o.key))?;
        if !keys.insert(o.key.as_str()) {
            return Err(format!("object {} is listed twice", o.key));
        }
        // zstd never grows data by more than a small fraction; anything bigger is forged.
        if o.stored_bytes > CHUNK_RAW_BYTES_LIMIT + CHUNK_RAW_BYTES_LIMIT / 64 + 4096 {
            return Err(format!(
                "object {}: stored_bytes {} over the limit for a chunk",
                o.key, o.stored_bytes
            ));
        }
        if o.raw_bytes > CHUNK_RAW_BYTES_LIMIT {
            return Err(format!(
                "object {}: raw_bytes {} over the limit of {CHUNK_RAW_BYTES_LIMIT}",
                o.key, o.raw_bytes
            ));
        }
        o.codec
            .check(o.raw_bytes, o.stored_bytes)
            .map_err(|e| format!("object {}: {e}", o.key))?;
        if o.codec == Codec::Raw && o.raw_crc32c != o.stored_crc32c {
            return Err(format!(
                "object {}: raw codec with different raw and stored checksums",
                o.key
            ));
        }
        if matches!(o.codec, Codec::ZstdBlocks { .. }) && o.block_crc32c.is_empty() {
            return Err(format!(
                "object {}: zstd-blocks without block checksums",
                o.key
            ));
        }
        if !o.block_crc32c.is_empty() {
            if !matches!(o.codec, Codec::Raw | Codec::ZstdBlocks { .. }) {
                return Err(format!(
                    "object {}: block checksums on a {} object",
                    o.key,
                    o.codec.name()
                ));
            }
            let want = o.raw_bytes.div_ceil(CHECK_BLOCK_BYTES);
            if o.block_crc32c.len() as u64 != want {
                return Err(format!(
                    "object {}: {} block checksums for {} bytes (want {want})",
                    o.key,
                    o.block_crc32c.len(),
                    o.raw_bytes
                ));
            }
        }
    }

    // Segments: in bounds, and no byte of any object claimed twice.
    let mut claimed: Vec<(u32, u64, u64, &str)> = Vec::new();
    let mut names = BTreeSet::new();
    let mut headers = Vec::with_capacity(files.len());
    for f in files {
        validate_rel_name(&f.name).map_err(|e| format!("file {:?}: {e}", f.name))?;
        if !names.insert(f.name.as_str()) {
            return Err(format!("file {:?} is listed twice", f.name));
        }
        if f.header.len() as u64 > HEADER_BYTES_MAX {
            return Err(format!(
                "file {:?}: header of {} bytes over the limit of {HEADER_BYTES_MAX}",
                f.name,
                f.header.len()
            ));
        }
        let h = header::parse_header(f.header.as_bytes(), &f.name).map_err(|e| e.to_string())?;
        if h.data_bytes != f.data_bytes {
            return Err(format!(
                "file {:?}: header describes {} data bytes, manifest says {}",
                f.name, h.data_bytes, f.data_bytes
            ));
        }
        let mut total = 0u64;
        for s in &f.segments {
            let o = objects
                .get(s.object as usize)
                .ok_or_else(|| format!("file {:?}: segment names object #{}", f.name, s.object))?;
            let end = s.offset.checked_add(s.len).filter(|e| *e <= o.raw_bytes);
            if s.len == 0 || end.is_none() {
                return Err(format!(
                    "file {:?}: segment {}+{} is out of bounds of object {} ({} bytes)",
                    f.name, s.offset, s.len, o.key, o.raw_bytes
                ));
            }
            claimed.push((s.object, s.offset, s.offset + s.len, f.name.as_str()));
            total = total.checked_add(s.len).ok_or("segment lengths overflow")?;
        }
        if total != f.data_bytes {
            return Err(format!(
                "file {:?}: segments hold {total} bytes, data_bytes is {}",
                f.name, f.data_bytes
            ));
        }
        headers.push(h);
    }
    // No file may stand where another needs a directory (`a.safetensors` and
    // `a.safetensors/b.safetensors`): the step could never be laid out.
    for name in &names {
        for (i, _) in name.match_indices('/') {
            if names.contains(&name[..i]) {
                return Err(format!(
                    "file {name:?} lies under {:?}, which is a file too",
                    &name[..i]
                ));
            }
        }
    }
    claimed.sort();
    for w in claimed.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            return Err(format!(
                "files {:?} and {:?} claim overlapping bytes of object {}",
                w[0].3, w[1].3, objects[w[0].0 as usize].key
            ));
        }
    }

    // With no overlaps, equal sums mean every object byte belongs to exactly one file.
    let mut used = vec![0u64; objects.len()];
    for c in &claimed {
        used[c.0 as usize] += c.2 - c.1;
    }
    if let Some((o, u)) = objects.iter().zip(&used).find(|(o, u)| o.raw_bytes != **u) {
        return Err(format!(
            "object {}: files use {u} of its {} bytes",
            o.key, o.raw_bytes
        ));
    }

    let by_file: Vec<HashMap<&str, &header::HeaderTensor>> = headers
        .iter()
        .map(|h| h.tensors.iter().map(|t| (t.name.as_str(), t)).collect())
        .collect();
    let mut tnames = BTreeSet::new();
    for t in tensors {
        validate_rel_name(&t.name).map_err(|e| format!("tensor {:?}: {e}", t.name))?;
        if !tnames.insert(t.name.as_str()) {
            return Err(format!("tensor {:?} is listed twice", t.name));
        }
        header::tensor_bytes(&t.name, &t.dtype, &t.shape)?;
        if t.shards.is_empty() {
            return Err(format!("tensor {:?} has no shards", t.name));
        }
        if !t.sharded && (t.shards.len() != 1 || t.shards[0].shape != t.shape) {
            return Err(format!(
                "tensor {:?}: replicated tensor must have one full shard",
                t.name
            ));
        }
        if t.sharded && t.shape.is_empty() {
            return Err(format!("tensor {:?}: a scalar cannot be sharded", t.name));
        }
        let mut shards: Vec<&ShardEntry> = t.shards.iter().collect();
        shards.sort_by_key(|s| s.dim0_offset);
        let mut next_row = 0u64;
        for s in shards {
            if s.shape.len() != t.shape.len() || s.shape.get(1..) != t.shape.get(1..) {
                return Err(format!(
                    "tensor {:?}: shard shape {:?} does not fit global shape {:?}",
                    t.name, s.shape, t.shape
                ));
            }
            if t.sharded && (s.dim0_offset < next_row || (complete && s.dim0_offset != next_row)) {
                return Err(format!(
                    "tensor {:?}: shards do not tile dim 0 (shard at row {}, expected {next_row})",
                    t.name, s.dim0_offset
                ));
            }
            next_row = s
                .dim0_offset
                .saturating_add(s.shape.first().copied().unwrap_or(1));
            if t.sharded && Some(&next_row) > t.shape.first() {
                return Err(format!(
                    "tensor {:?}: shard rows end at {next_row}, past {}",
                    t.name, t.shape[0]
                ));
            }
            let bytes = header::tensor_bytes(&t.name, &t.dtype, &s.shape)?;
            if s.data_offsets[1].checked_sub(s.data_offsets[0]) != Some(bytes) {
                return Err(format!(
                    "tensor {:?}: {} {:?} needs {bytes} bytes but the shard holds {:?}",
                    t.name, t.dtype, s.shape, s.data_offsets
                ));
            }
            let ht = by_file
                .get(s.file as usize)
                .ok_or_else(|| format!("tensor {:?}: shard names file #{}", t.name, s.file))?
                .get(t.name.as_str())
                .ok_or_else(|| {
                    format!(
                        "tensor {:?} is not in the header of file {:?}",
                        t.name, files[s.file as usize].name
                    )
                })?;
            if ht.dtype != t.dtype || ht.shape != s.shape || ht.data_offsets != s.data_offsets {
                return Err(format!(
                    "tensor {:?}: manifest and header of file {:?} disagree",
                    t.name, files[s.file as usize].name
                ));
            }
        }
        if complete && t.sharded && Some(&next_row) != t.shape.first() {
            return Err(format!(
                "tensor {:?}: shards cover {next_row} rows of {}",
                t.name, t.shape[0]
            ));
        }
    }
    Ok(())
}

/// Sharding declared by a writer for one tensor: where its local rows sit in the global one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    pub global_shape: Vec<u64>,
    pub dim0_offset: u64,
}

/// The safetensors `__metadata__` key under which a writer may declare shards, as a JSON
/// object `{tensor: {"global_shape": [...], "dim0_offset": n}}`.
pub const SHARDS_METADATA_KEY: &str = "elastic.shards";

/// Reads shard declarations from a header's metadata.
pub fn shards_from_metadata(
    md: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, ShardSpec>, String> {
    match md.get(SHARDS_METADATA_KEY) {
        None => Ok(BTreeMap::new()),
        Some(s) => serde_json::from_str(s).map_err(|e| format!("{SHARDS_METADATA_KEY}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_crcs_do_not_depend_on_how_the_bytes_are_cut() {
        let block = CHECK_BLOCK_BYTES as usize;
        let data: Vec<u8> = (0..2 * block + 3).map(|i| (i * 7 % 251) as u8).collect();
        let whole = BlockCrcs::of(&data);
        assert_eq!(
            whole,
            vec![
                crc32c::crc32c(&data[..block]),
                crc32c::crc32c(&data[block..2 * block]),
                crc32c::crc32c(&data[2 * block..]),
            ]
        );
        let mut cut = BlockCrcs::default();
        for piece in data.chunks(block / 3 + 1) {
            cut.push(piece);
        }
        assert_eq!(cut.finish(), (crc32c::crc32c(&data), whole));
        assert_eq!(BlockCrcs::of(&data[..block]).len(), 1);
        assert!(BlockCrcs::of(&[]).is_empty());
    }

    #[test]
    fn a_block_is_combined_by_table_as_crc32c_combine_does() {
        let mut x = 0x9e37_79b9u32;
        for _ in 0..1000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let b = x.rotate_left(7);
            assert_eq!(
                shift_by_block(x) ^ b,
                crc32c::crc32c_combine(x, b, CHECK_BLOCK_BYTES as usize)
            );
        }
        assert_eq!(shift_by_block(0), 0);
    }

    #[test]
    fn path_traversing_and_absolute_names_are_rejected() {
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a//b",
            "a/./b",
            "nul\0byte",
            "",
            "a\\..\\b",
        ] {
            assert!(validate_rel_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in [
            "model.safetensors",
            "rank-0/optim.safetensors",
            "layers.0.weight",
        ] {
            validate_rel_name(good).unwrap();
        }
    }

    #[test]
    fn step_keys_sort_by_step_and_parse_back() {
        assert!(manifest_key(9) < manifest_key(10));
        assert_eq!(parse_step_dir("00000000000000000042"), Some(42));
        assert_eq!(parse_step_dir("42"), None);
        assert_eq!(parse_step_dir("0000000000000000004x"), None);
        assert_eq!(
            data_key(3, "rank-1", "ab", 7),
            "steps/00000000000000000003/data/rank-1-ab/000007.bin"
        );
    }

    #[test]
    fn unknown_version_is_rejected_before_the_schema() {
        let e = Manifest::parse(br#"{"format_version": 4, "whatever": 1}"#, 1).unwrap_err();
        assert_eq!(e, ParseError::UnsupportedVersion(4));
        for garbled in [
            &b"{"[..],
            b"null",
            b"\xff\xfe",
            br#"{"format_version":"1"}"#,
        ] {
            assert!(matches!(
                Manifest::parse(garbled, 1),
                Err(ParseError::Invalid(_))
            ));
        }
    }
}
