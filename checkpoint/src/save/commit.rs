//! The commit that makes a step exist: the newest durable attempt of each expected writer is
//! taken, every object it names is checked for its length, and the merged manifest is
//! validated and written create-only. Also reading a step's manifest back.

use std::collections::{BTreeMap, HashMap};

use futures::{StreamExt, TryStreamExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::now_unix_ms;
use crate::error::{Error, Result};
use crate::format::{
    self, FORMAT_VERSION, MANIFEST_BYTES_MAX, Manifest, PartRecord, PartRef, TensorEntry,
};
use crate::store::Store;

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

/// Adds one tensor record to a merged list, keyed by name.
pub(super) fn merge_tensor(
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
