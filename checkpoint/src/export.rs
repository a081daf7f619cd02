//! Export: one entry of a step's state, a module's weights, written as Hugging Face
//! safetensors, the layout `transformers`, `safetensors.torch.load_file` and
//! `torch.distributed.checkpoint`'s `HuggingFaceStorageReader` read.
//!
//! # What is written
//!
//! `model.safetensors`; or, when the tensors add up to more than the largest shard size,
//! `model-00001-of-0000N.safetensors`... and `model.safetensors.index.json`
//! (`{"metadata": {"total_size": N}, "weight_map": {name: file}}`). Files are split as
//! Hugging Face splits them: greedily in order, a new file when the next tensor would pass the
//! limit, and a tensor larger than the limit in a file of its own. Tensors are named as in the
//! module's `state_dict()`, sharded tensors are written whole, and every header's
//! `__metadata__` holds `{"format": "pt", "elastic.step": S, "elastic.key": K}`.
//!
//! # Where the names come from
//!
//! The worker client saves a state mapping: its tensors are stored as `state/<entry>/<path>`,
//! and the manifest's `metadata.state` holds a JSON skeleton
//! (`{"format": "elastic_run.state/1", "entries": {"model": {"stateful": true, "value":
//! {"0.weight": {"$t": "state/model/0.weight"}, ...}}}}`). An entry exports when its value is
//! a flat object of names to tensors (`{"$t": tensor}`), as a module's `state_dict()` is;
//! anything else (an optimizer's nested state, a plain value) is refused with the place that
//! is not a tensor. A checkpoint saved in the client's older form (tensors `model/<name>`,
//! `optim/state/<i>/<name>`, `extra/<k>`, and no skeleton) exports its `model` entry.
//!
//! JSON objects keep no order, so tensors are taken in natural name order (`layers.2` before
//! `layers.10`), which keeps a model's layers in order across the shard files.
//!
//! # How
//!
//! The export is a read like [`Store::pull`]: each needed chunk is fetched once, its
//! checksums checked, and its bytes copied to their places in the output files, so memory
//! holds a few decoded chunks (`concurrency` of them) and never a whole tensor. Files appear
//! only complete and only together (temp name, fsync, rename, fsync the directory), mode 0600
//! in a directory made 0700. The target must be absent or an empty directory, and is never
//! written through a symlink.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::format::{Manifest, NAME_BYTES_MAX};
use crate::header::{self, HEADER_BYTES_MAX, HeaderTensor};
use crate::local::{RootLink, check_fresh_dir};
use crate::restore::{Layout, OutFile, ReadOptions, file_range_copies};
use crate::store::Store;

/// The entry exported when none is named.
pub const EXPORT_KEY_DEFAULT: &str = "model";
/// The largest shard file by default: Hugging Face's default, 5 GB.
pub const SHARD_BYTES_MAX_DEFAULT: u64 = 5_000_000_000;
/// The one file of an export that fits in a shard.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of an export in several files.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The state skeleton format the worker client writes into `metadata.state`.
pub const STATE_FORMAT: &str = "elastic_run.state/1";
/// The one module-like entry of the client's older form; its tensors are `model/<name>`.
const LEGACY_MODULE_KEY: &str = "model";

/// The name of shard file `i` (from 1) of `n`: `model-00001-of-00003.safetensors`.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}

/// Parses a size the way Hugging Face spells it: plain bytes (`1000`), or digits with a unit,
/// `KB`/`MB`/`GB` (powers of 10) or `KiB`/`MiB`/`GiB` (powers of 2), case-insensitive; as in
/// Hugging Face, a lowercase final `b` of `Kb`/`Mb`/`Gb` means bits. Refuses 0.
pub fn parse_size_bytes(s: &str) -> std::result::Result<u64, String> {
    let upper = s.to_ascii_uppercase();
    let units: [(&str, u64); 6] = [
        ("GIB", 1 << 30),
        ("MIB", 1 << 20),
        ("KIB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
    ];
    let (digits, unit, bits) = match units.iter().find(|(u, _)| upper.ends_with(u)) {
        Some((u, mult)) => (
            &s[..s.len() - u.len()],
            *mult,
            u.len() == 2 && s.ends_with('b'),
        ),
        None => (s, 1, false),
    };
    let bad = || {
        format!(
            "{s:?} is not a size: use bytes or digits with a unit, e.g. 5GB, 500MB, 2GiB, 100KB"
        )
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n
        .checked_mul(unit)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    let bytes = if bits { bytes / 8 } else { bytes };
    if bytes == 0 {
        return Err(format!(
            "{s:?} is 0 bytes: a shard must hold at least 1 byte"
        ));
    }
    Ok(bytes)
}

/// Splits tensors of `sizes` bytes into files as Hugging Face does: in order, a new file when
/// the next tensor would take the current one past `max_bytes`, and a tensor larger than
/// `max_bytes` alone in a file of its own (placed before the file being filled). Returns the
/// indexes of each file's tensors.
pub fn split_shards(sizes: &[u64], max_bytes: u64) -> Vec<Vec<usize>> {
    let mut files = Vec::new();
    let mut current = Vec::new();
    let mut current_bytes = 0u64;
    for (i, &size) in sizes.iter().enumerate() {
        if size > max_bytes {
            files.push(vec![i]);
            continue;
        }
        if current_bytes.saturating_add(size) > max_bytes {
            files.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes += size;
    }
    if !current.is_empty() {
        files.push(current);
    }
    files
}

/// Compares names with runs of digits taken as numbers (`layers.2` before `layers.10`); names
/// that compare equal so (`a01`, `a1`) fall back to their bytes.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let n = x.iter().take_while(|c| c.is_ascii_digit()).count();
                let m = y.iter().take_while(|c| c.is_ascii_digit()).count();
                let strip = |s: &[u8]| -> usize { s.iter().take_while(|c| **c == b'0').count() };
                let (dx, dy) = (&x[strip(&x[..n])..n], &y[strip(&y[..m])..m]);
                let o = dx.len().cmp(&dy.len()).then_with(|| dx.cmp(dy));
                if o != Ordering::Equal {
                    return o;
                }
                (x, y) = (&x[n..], &y[m..]);
            }
            (Some(c), Some(d)) => {
                if c != d {
                    return c.cmp(d);
                }
                (x, y) = (&x[1..], &y[1..]);
            }
        }
    }
}

/// One tensor of an exported entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModuleTensor {
    /// Its name in the module's `state_dict()`, and in the exported file.
    pub name: String,
    /// Its index in the manifest's `tensors`.
    pub tensor: usize,
    pub bytes: u64,
}

/// One file an export writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedFile {
    pub name: String,
    pub tensors: Vec<ModuleTensor>,
}

/// What an export of one entry writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExportPlan {
    /// In order; several mean an index is written too.
    pub files: Vec<PlannedFile>,
    pub total_bytes: u64,
}

/// A short description of a JSON value for messages (never the value itself, which may be
/// large).
fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(_) => "a number".into(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "a list".into(),
        Value::Object(o) => match o.keys().next() {
            Some(k) if o.len() == 1 && k.starts_with('$') => format!("a {k:?} value"),
            _ => "a nested map".into(),
        },
    }
}

fn unknown_key<'a>(key: &str, held: impl Iterator<Item = &'a str>) -> String {
    let held: Vec<String> = held.map(|k| format!("{k:?}")).collect();
    if held.is_empty() {
        format!("the step holds no entry {key:?}, and no state entries at all")
    } else {
        format!(
            "the step holds no entry {key:?}; its entries are {}",
            held.join(", ")
        )
    }
}

fn not_module(place: &str, what: &str) -> String {
    format!(
        "{place} holds {what}, not a tensor: only a module-like entry (a flat map of names to \
         tensors, as a module's state_dict() is) exports"
    )
}

/// The `(name, manifest tensor index)` pairs of entry `key` from a state skeleton.
fn from_skeleton(
    state: &Value,
    key: &str,
    by_name: &HashMap<&str, usize>,
) -> std::result::Result<Vec<(String, usize)>, String> {
    match state.get("format") {
        Some(Value::String(f)) if f == STATE_FORMAT => {}
        other => {
            return Err(format!(
                "metadata.state.format is {}, not {STATE_FORMAT:?}",
                other.map_or("missing".to_string(), describe)
            ));
        }
    }
    let entries = state
        .get("entries")
        .and_then(Value::as_object)
        .ok_or("metadata.state.entries is not an object")?;
    let entry = entries
        .get(key)
        .ok_or_else(|| unknown_key(key, entries.keys().map(String::as_str)))?;
    let at = format!("state[{key:?}]");
    let value = entry
        .as_object()
        .filter(|e| e.get("stateful").is_some_and(Value::is_boolean))
        .and_then(|e| e.get("value"))
        .ok_or_else(|| {
            format!(
                "{at} is {}, not {{\"stateful\": bool, \"value\": ...}}",
                describe(entry)
            )
        })?;
    let Value::Object(map) = value else {
        return Err(not_module(&at, &describe(value)));
    };
    // The client writes a map some of whose keys start with "$" as {"$dict": {...}}; any
    // other object with a "$" key is a tagged value, one key alone.
    let map = match map.keys().find(|k| k.starts_with('$')) {
        None => map,
        Some(tag) if map.len() != 1 => {
            return Err(format!(
                "{at}: an object with the key {tag:?} and others is not a tagged value"
            ));
        }
        Some(tag) if tag == "$dict" => match &map[tag] {
            Value::Object(inner) => inner,
            other => {
                return Err(format!(
                    "{at}: $dict holds {}, not an object",
                    describe(other)
                ));
            }
        },
        Some(_) => return Err(not_module(&at, &describe(value))),
    };
    if map.is_empty() {
        return Err(format!("{at} holds no tensors"));
    }
    let mut out = Vec::with_capacity(map.len());
    for (name, v) in map {
        let place = format!("{at}[{name:?}]");
        let tensor = match v {
            Value::Object(o) if o.len() == 1 && o.contains_key("$t") => &o["$t"],
            other => return Err(not_module(&place, &describe(other))),
        };
        let Value::String(tensor) = tensor else {
            return Err(format!(
                "{place}: $t holds {}, not a tensor name",
                describe(tensor)
            ));
        };
        let idx = by_name.get(tensor.as_str()).ok_or_else(|| {
            format!("{place} refers to the tensor {tensor:?}, which the step does not hold")
        })?;
        out.push((name.clone(), *idx));
    }
    Ok(out)
}

/// The `(name, manifest tensor index)` pairs of entry `key` of a checkpoint without a state
/// skeleton: `model/<name>` tensors.
fn from_legacy(m: &Manifest, key: &str) -> std::result::Result<Vec<(String, usize)>, String> {
    let held: BTreeSet<&str> = m
        .tensors
        .iter()
        .filter_map(|t| t.name.split_once('/').map(|(entry, _)| entry))
        .collect();
    if !held.contains(key) {
        return Err(unknown_key(key, held.into_iter()));
    }
    if key != LEGACY_MODULE_KEY {
        return Err(format!(
            "the step was saved without a state skeleton (the client's model=/optimizer=/extra= \
             form), where only the {LEGACY_MODULE_KEY:?} entry is a module's state: only a \
             module-like entry exports"
        ));
    }
    let prefix = format!("{LEGACY_MODULE_KEY}/");
    Ok(m.tensors
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.name.strip_prefix(&prefix).map(|n| (n.to_string(), i)))
        .collect())
}

/// The tensors of entry `key` of a step, in natural name order. The error says why the entry
/// does not export (unknown, not module-like, malformed), naming the place.
pub fn module_tensors(m: &Manifest, key: &str) -> std::result::Result<Vec<ModuleTensor>, String> {
    let by_name: HashMap<&str, usize> = m
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let pairs = match m.metadata.get("state") {
        Some(state) if state.get("entries").is_some() => from_skeleton(state, key, &by_name)?,
        _ => from_legacy(m, key)?,
    };
    let mut out = Vec::with_capacity(pairs.len());
    for (name, idx) in pairs {
        if name.is_empty() || name == "__metadata__" || name.len() > NAME_BYTES_MAX {
            return Err(format!(
                "state[{key:?}] names a tensor {:?}, which a safetensors file cannot hold",
                name.chars().take(64).collect::<String>()
            ));
        }
        let t = &m.tensors[idx];
        let bytes = header::tensor_bytes(&t.name, &t.dtype, &t.shape)?;
        out.push(ModuleTensor {
            name,
            tensor: idx,
            bytes,
        });
    }
    out.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    Ok(out)
}

/// The files an export of entry `key` writes, shards of at most `shard_bytes_max` bytes
/// (bar a tensor larger than that, alone in its file).
pub fn plan(
    m: &Manifest,
    key: &str,
    shard_bytes_max: u64,
) -> std::result::Result<ExportPlan, String> {
    let tensors = module_tensors(m, key)?;
    let total_bytes = tensors
        .iter()
        .try_fold(0u64, |acc, t| acc.checked_add(t.bytes))
        .ok_or("the entry's tensors add up to more bytes than a file can hold")?;
    let sizes: Vec<u64> = tensors.iter().map(|t| t.bytes).collect();
    let groups = split_shards(&sizes, shard_bytes_max);
    let n = groups.len();
    let files = groups
        .into_iter()
        .enumerate()
        .map(|(i, group)| PlannedFile {
            name: if n == 1 {
                SINGLE_FILE.to_string()
            } else {
                shard_file_name(i + 1, n)
            },
            tensors: group.into_iter().map(|t| tensors[t].clone()).collect(),
        })
        .collect();
    Ok(ExportPlan { files, total_bytes })
}

/// The output files of `plan` and the copies that fill them. Within a file, tensors of wider
/// elements come first, so every tensor's data starts aligned to its element size (the data
/// region itself starts 8-aligned).
fn layout(m: &Manifest, plan: &ExportPlan, key: &str) -> std::result::Result<Layout, String> {
    let mut out = Layout::default();
    let mut md = BTreeMap::new();
    md.insert("format".to_string(), "pt".to_string());
    md.insert("elastic.step".to_string(), m.step.to_string());
    md.insert("elastic.key".to_string(), key.to_string());
    for (fi, f) in plan.files.iter().enumerate() {
        let mut order: Vec<&ModuleTensor> = f.tensors.iter().collect();
        order.sort_by_key(|t| {
            std::cmp::Reverse(header::dtype_size_bytes(&m.tensors[t.tensor].dtype).unwrap_or(1))
        });
        let mut headers = Vec::with_capacity(order.len());
        let mut offset = 0u64;
        for t in &order {
            let e = &m.tensors[t.tensor];
            headers.push(HeaderTensor {
                name: t.name.clone(),
                dtype: e.dtype.clone(),
                shape: e.shape.clone(),
                data_offsets: [offset, offset + t.bytes],
            });
            offset += t.bytes;
        }
        let prefix = header::write_header(&headers, &md);
        if prefix.len() as u64 - 8 > HEADER_BYTES_MAX {
            return Err(format!(
                "the header of {} would be {} bytes, over the limit of {HEADER_BYTES_MAX}: \
                 pass a smaller shard size",
                f.name,
                prefix.len() - 8
            ));
        }
        let data_start = prefix.len() as u64;
        for (t, h) in order.iter().zip(&headers) {
            let e = &m.tensors[t.tensor];
            // A sharded tensor's shards tile dim 0 (the manifest was validated), so the whole
            // tensor is their bytes in row order.
            let mut shards: Vec<_> = e.shards.iter().collect();
            shards.sort_by_key(|s| s.dim0_offset);
            let mut at = data_start + h.data_offsets[0];
            for s in shards {
                let len = s.data_offsets[1] - s.data_offsets[0];
                file_range_copies(
                    &m.files[s.file as usize],
                    fi,
                    s.data_offsets[0],
                    len,
                    at,
                    &mut out.copies,
                );
                at += len;
            }
        }
        out.files.push(OutFile {
            rel: f.name.clone(),
            total_bytes: data_start + offset,
            prefix,
        });
    }
    if plan.files.len() > 1 {
        let weight_map: serde_json::Map<String, Value> = plan
            .files
            .iter()
            .flat_map(|f| {
                f.tensors
                    .iter()
                    .map(|t| (t.name.clone(), Value::String(f.name.clone())))
            })
            .collect();
        let index = serde_json::json!({
            "metadata": {"total_size": plan.total_bytes},
            "weight_map": weight_map,
        });
        let mut bytes = serde_json::to_vec_pretty(&index).map_err(|e| e.to_string())?;
        bytes.push(b'\n');
        // Written last: once the index is in place, so is every file it names.
        out.files.push(OutFile {
            rel: INDEX_FILE.to_string(),
            total_bytes: bytes.len() as u64,
            prefix: bytes,
        });
    }
    Ok(out)
}

/// One file an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportedFile {
    pub name: String,
    pub tensors: usize,
    /// Bytes of tensor data in it.
    pub bytes: u64,
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    pub step: u64,
    pub key: String,
    pub dir: PathBuf,
    /// The safetensors files, in order.
    pub files: Vec<ExportedFile>,
    /// [`INDEX_FILE`] when the export is in several files.
    pub index: Option<String>,
    pub tensors: usize,
    /// Bytes of tensor data (the index's `total_size`).
    pub bytes: u64,
    /// Newer committed steps that were skipped because they did not read whole.
    pub skipped_steps: Vec<u64>,
}

impl Store {
    /// Writes entry `key` (a module's weights; [`EXPORT_KEY_DEFAULT`] is `model`) of `step`
    /// under `dest` as Hugging Face safetensors, in files of at most `shard_bytes_max` bytes of
    /// tensor data (see the module docs). `dest` must be absent or an empty directory, not a
    /// symlink.
    ///
    /// With `step == None`, exports the newest committed step that reads whole: a newer one
    /// whose manifest is invalid or one of whose chunks is missing or fails its checksum is
    /// skipped with a warning naming the step and the object, as [`Store::pull_newest`] does.
    /// An entry that does not export ([`Error::NotExportable`]) ends the search.
    pub async fn export(
        &self,
        step: Option<u64>,
        key: &str,
        dest: &Path,
        shard_bytes_max: u64,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<ExportReport> {
        if shard_bytes_max == 0 {
            return Err(Error::InvalidInput(
                "the largest shard size is 0 bytes; a shard must hold at least 1 byte".into(),
            ));
        }
        check_fresh_dir(dest, "export target")?;
        let existed = std::fs::symlink_metadata(dest).is_ok();
        let r = match step {
            Some(step) => {
                self.export_step(step, key, dest, shard_bytes_max, opts, cancel)
                    .await
            }
            None => self
                .newest_committed_that("export", cancel, |step| {
                    self.export_step(step, key, dest, shard_bytes_max, opts, cancel)
                })
                .await
                .map(|(mut report, skipped)| {
                    report.skipped_steps = skipped;
                    report
                }),
        };
        if r.is_err() && !existed {
            // Only removes the directory this call made, and only while it is empty.
            let _ = std::fs::remove_dir(dest);
        }
        r
    }

    async fn export_step(
        &self,
        step: u64,
        key: &str,
        dest: &Path,
        shard_bytes_max: u64,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<ExportReport> {
        let m = self.read_manifest(step, cancel).await?;
        let refused = |reason| Error::NotExportable {
            store: self.url().to_string(),
            step,
            key: key.to_string(),
            reason,
        };
        let plan = plan(&m, key, shard_bytes_max).map_err(refused)?;
        let layout = layout(&m, &plan, key).map_err(refused)?;
        let opts = &opts.writing_files();
        self.materialize(&m, layout, None, dest, RootLink::Refuse, opts, cancel)
            .await?;
        let tensors = plan.files.iter().map(|f| f.tensors.len()).sum();
        tracing::info!(
            step,
            key,
            files = plan.files.len(),
            tensors,
            bytes = plan.total_bytes,
            "exported"
        );
        Ok(ExportReport {
            step,
            key: key.to_string(),
            dir: dest.to_path_buf(),
            index: (plan.files.len() > 1).then(|| INDEX_FILE.to_string()),
            files: plan
                .files
                .iter()
                .map(|f| ExportedFile {
                    name: f.name.clone(),
                    tensors: f.tensors.len(),
                    bytes: f.tensors.iter().map(|t| t.bytes).sum(),
                })
                .collect(),
            tensors,
            bytes: plan.total_bytes,
            skipped_steps: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests;
