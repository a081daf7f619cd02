//! Restores without copies (`--restore-no-copy`): from a `file://` store whose chunks are raw,
//! a rank's restore checks each chunk where it lies and writes no `state.safetensors`. What
//! it would have held is written down instead, in `rank-R/sources.json` (the worker protocol's
//! `RESTORED_SOURCES`): the file's length and safetensors header, and where each range of it
//! lies in the store's chunk files, each as it was when checked (device, inode, length, inode
//! change time). The worker's `elastic_run.load` reads every tensor from there into the
//! model, so each byte is copied once on its way from the store, and nothing of the state is
//! written into staging (`/dev/shm`).
//!
//! A chunk replaced or written since its check is not read: the worker's load fails, naming
//! it, and the restore is not reused ([`sources_still_checked`]): the next one checks the
//! chunks again.

use std::path::Path;
use std::sync::{Arc, Mutex};

use checkpoint::CancellationToken;
use checkpoint::restore::{RESTORE_FILE, ReadEvent, ReadOptions, RestoreReport};
use serde_json::{Value, json};
use worker::protocol::{METADATA_BYTES_MAX, RESTORED_SOURCES, RESTORED_SOURCES_VERSION};

use super::restore::write_durable;
use super::sink::{SinkError, StoreSink, read_json_bounded};

impl StoreSink {
    /// Restores rank `rank` of `world_size` at `step` into `dest`: `state.safetensors`, or,
    /// when the options ask for a read without copies and the store allows it (a `file://`
    /// store, every chunk raw), `sources.json` in its place. A step whose sources do not fit
    /// in [`METADATA_BYTES_MAX`] is restored again with copies.
    pub(super) async fn restore_rank(
        &self,
        step: u64,
        rank: u32,
        world_size: u32,
        dest: &Path,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport, SinkError> {
        let failed = |e| self.restore_error(step, rank, world_size, e, cancel);
        if !self.opts.read.no_copy {
            return self
                .store
                .restore(Some(step), rank, world_size, dest, &self.opts.read, cancel)
                .await
                .map_err(failed);
        }
        // Events of the step being read: one header and a source per chunk range set, so
        // bounded by the step's manifest (itself bounded by the store's format limits).
        let seen: Arc<Mutex<Vec<ReadEvent>>> = Arc::default();
        let opts = ReadOptions {
            events: Some({
                let seen = seen.clone();
                Arc::new(move |e: &ReadEvent| {
                    let mut v = seen.lock().unwrap_or_else(|p| p.into_inner());
                    if matches!(e, ReadEvent::Step { .. }) {
                        v.clear();
                    }
                    if matches!(e, ReadEvent::Header { .. } | ReadEvent::Source { .. }) {
                        v.push(e.clone());
                    }
                })
            }),
            into_process: None,
            ..self.opts.read.clone()
        };
        let report = self
            .store
            .restore(Some(step), rank, world_size, dest, &opts, cancel)
            .await
            .map_err(failed)?;
        if report.written {
            return Ok(report); // compressed chunks, or another store: the file, as without
        }
        let events = std::mem::take(&mut *seen.lock().unwrap_or_else(|p| p.into_inner()));
        let local = |reason: String| SinkError::Local {
            path: dest.join(RESTORED_SOURCES),
            reason,
        };
        let root = self
            .store
            .local_root()
            .and_then(Path::to_str)
            .ok_or_else(|| {
                local("read without copies from a store that is not a local directory".into())
            })?;
        let doc = sources_doc(self.url(), root, step, &events).map_err(local)?;
        let bytes = serde_json::to_vec(&doc).map_err(|e| local(e.to_string()))?;
        if bytes.len() as u64 > METADATA_BYTES_MAX {
            tracing::warn!(
                step,
                rank,
                bytes = bytes.len(),
                "the step's sources are over the metadata limit; restoring it with copies"
            );
            let with_copies = ReadOptions {
                no_copy: false,
                events: None,
                ..opts
            };
            return self
                .store
                .restore(Some(step), rank, world_size, dest, &with_copies, cancel)
                .await
                .map_err(failed);
        }
        let path = dest.join(RESTORED_SOURCES);
        tokio::task::spawn_blocking(move || write_durable(&path, &bytes))
            .await
            .map_err(|e| local(format!("the write's task failed: {e}")))??;
        Ok(report)
    }
}

/// The `sources.json` of step `step` restored from `store` (a local directory, `root`)
/// without copies, from the restore's events: its one `header` event and its `source`
/// events, each of a chunk inside `root`.
fn sources_doc(store: &str, root: &str, step: u64, events: &[ReadEvent]) -> Result<Value, String> {
    let bad = |what: String| format!("step {step}: {what}");
    let mut head = None;
    let mut sources = Vec::new();
    for e in events {
        match e {
            ReadEvent::Header {
                step: s,
                name,
                bytes,
                header,
                targets: false,
            } if *s == step && name == RESTORE_FILE && head.is_none() => {
                head = Some((*bytes, header.clone()));
            }
            ReadEvent::Source {
                step: s,
                name,
                path,
                bytes,
                dev,
                ino,
                ctime_ns,
                ranges,
            } if *s == step && name == RESTORE_FILE => {
                if !path.starts_with(root) {
                    return Err(bad(format!("chunk {} lies outside {root}", path.display())));
                }
                let path = path.to_str().ok_or_else(|| {
                    bad(format!("chunk {} is not named in UTF-8", path.display()))
                })?;
                sources.push(json!({
                    "path": path, "bytes": bytes, "dev": dev, "ino": ino,
                    "ctime_ns": ctime_ns, "ranges": ranges,
                }));
            }
            other => return Err(bad(format!("an unexpected restore event {other:?}"))),
        }
    }
    let (bytes, header) = head.ok_or_else(|| bad("read without copies, but no header".into()))?;
    Ok(json!({
        "version": RESTORED_SOURCES_VERSION,
        "store": store,
        "root": root,
        "step": step,
        "name": RESTORE_FILE,
        "bytes": bytes,
        "header": header,
        "sources": sources,
    }))
}

/// Whether `rank_dir`'s `sources.json` still names chunk files as they were checked: each
/// one a regular file (not through a symlink) of the same device, inode, length and inode
/// change time. A restore whose chunks changed is not reused.
pub(super) fn sources_still_checked(rank_dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(doc) = read_json_bounded(&rank_dir.join(RESTORED_SOURCES)) else {
        return false;
    };
    if doc.get("version").and_then(Value::as_u64) != Some(u64::from(RESTORED_SOURCES_VERSION)) {
        return false;
    }
    let Some(sources) = doc.get("sources").and_then(Value::as_array) else {
        return false;
    };
    sources.iter().all(|s| {
        let field = |k: &str| s.get(k).and_then(Value::as_u64);
        let Some(path) = s.get("path").and_then(Value::as_str) else {
            return false;
        };
        let Ok(m) = std::fs::symlink_metadata(path) else {
            return false;
        };
        let ctime_ns = m
            .ctime()
            .saturating_mul(1_000_000_000)
            .saturating_add(m.ctime_nsec());
        m.is_file()
            && field("dev") == Some(m.dev())
            && field("ino") == Some(m.ino())
            && field("bytes") == Some(m.len())
            && s.get("ctime_ns").and_then(Value::as_i64) == Some(ctime_ns)
    })
}

/// Whether a kept or just restored rank directory holds its tensors: `state.safetensors`, or
/// `sources.json` whose chunks are still as checked.
pub(super) fn rank_tensors_present(rank_dir: &Path) -> bool {
    rank_dir.join(RESTORE_FILE).is_file()
        || (rank_dir.join(RESTORED_SOURCES).is_file() && sources_still_checked(rank_dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(step: u64) -> ReadEvent {
        ReadEvent::Header {
            step,
            name: RESTORE_FILE.into(),
            bytes: 100,
            header: "{}".into(),
            targets: false,
        }
    }

    #[test]
    fn sources_are_written_from_one_header_and_its_sources_and_nothing_else() {
        let source = ReadEvent::Source {
            step: 4,
            name: RESTORE_FILE.into(),
            path: "/s/chunks/a".into(),
            bytes: 64,
            dev: 1,
            ino: 2,
            ctime_ns: 3,
            ranges: vec![[10, 64, 0]],
        };
        let doc = sources_doc("file:///s", "/s", 4, &[header(4), source.clone()]).unwrap();
        assert_eq!(doc["version"], 1);
        assert_eq!(doc["store"], "file:///s");
        assert_eq!(doc["root"], "/s");
        assert_eq!(doc["bytes"], 100);
        assert_eq!(doc["sources"][0]["ranges"], json!([[10, 64, 0]]));
        let doc = |root, events: &[ReadEvent]| sources_doc("file:///s", root, 4, events);
        assert!(doc("/s", &[]).is_err(), "no header");
        assert!(doc("/s", &[header(4), header(4)]).is_err());
        assert!(doc("/s", &[header(3)]).is_err(), "another step");
        assert!(
            doc("/t", &[header(4), source]).is_err(),
            "a chunk outside the root"
        );
    }

    #[test]
    fn a_restore_is_reused_only_while_its_chunks_are_as_checked() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let chunk = d.path().join("chunk");
        std::fs::write(&chunk, b"0123456789").unwrap();
        let rank = d.path().join("rank-0");
        std::fs::create_dir(&rank).unwrap();
        let write = |m: &std::fs::Metadata| {
            let doc = json!({"version": 1, "sources": [{
                "path": chunk.to_str().unwrap(), "bytes": m.len(), "dev": m.dev(), "ino": m.ino(),
                "ctime_ns": m.ctime() * 1_000_000_000 + m.ctime_nsec(), "ranges": [[0, 10, 0]],
            }]});
            std::fs::write(rank.join(RESTORED_SOURCES), doc.to_string()).unwrap();
        };
        write(&std::fs::metadata(&chunk).unwrap());
        assert!(rank_tensors_present(&rank));
        // Replaced: another inode at the path.
        let other = d.path().join("other");
        std::fs::write(&other, b"0123456789").unwrap();
        std::fs::rename(&other, &chunk).unwrap();
        assert!(!rank_tensors_present(&rank));
        write(&std::fs::metadata(&chunk).unwrap());
        assert!(rank_tensors_present(&rank));
        // A symlink in its place is not followed.
        std::fs::remove_file(&chunk).unwrap();
        std::os::unix::fs::symlink(&other, &chunk).unwrap();
        assert!(!rank_tensors_present(&rank));
    }
}
