//! Reading a restored rank's tensor file that the agent did not write (`--restore-no-copy`):
//! its `sources.json` ([`crate::protocol::RESTORED_SOURCES`]) gives the file's length and
//! header, and where each range of its data lies in the store's chunk files. Each chunk is
//! read only while it is the file the agent checked (the same device, inode, length and inode
//! change time, before and after the read), never through a symlink; every byte of the data
//! must come from exactly one range.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path};

use serde_json::Value;

use crate::client::WorkerError;
use crate::protocol::RESTORED_SOURCES_VERSION;

/// A chunk to read from: where, as it was when checked (device, inode, length, inode change
/// time), and its ranges `[at in the file, length, offset in the chunk]`.
struct Source<'a> {
    chunk: &'a Path,
    checked: (u64, u64, u64, i64),
    ranges: Vec<[u64; 3]>,
}

/// The bytes the tensor file would hold, read from the chunks `doc` (the parsed
/// `sources.json` at `path`) names. Everything the document says is checked before memory is
/// taken for the file or a chunk is opened.
pub(crate) fn assemble(path: &Path, doc: &Value) -> Result<Vec<u8>, WorkerError> {
    let bad = |reason: String| WorkerError::Format {
        path: path.to_path_buf(),
        reason,
    };
    if doc.get("version").and_then(Value::as_u64) != Some(u64::from(RESTORED_SOURCES_VERSION)) {
        return Err(bad(format!(
            "version {}, not {RESTORED_SOURCES_VERSION}",
            doc.get("version").unwrap_or(&Value::Null)
        )));
    }
    let header = doc.get("header").and_then(Value::as_str);
    let size = doc.get("bytes").and_then(Value::as_u64);
    let root = doc.get("root").and_then(Value::as_str).map(Path::new);
    let (Some(header), Some(size), Some(sources), Some(root)) = (
        header,
        size,
        doc.get("sources").and_then(Value::as_array),
        root,
    ) else {
        return Err(bad("no header, bytes, sources or root".into()));
    };
    if !root.is_absolute() {
        return Err(bad(format!(
            "root {} is not an absolute path",
            root.display()
        )));
    }
    let data_start = 8 + header.len() as u64;
    if size < data_start {
        return Err(bad(format!(
            "{size} bytes cannot hold a header of {}",
            header.len()
        )));
    }
    let mut plan = Vec::with_capacity(sources.len());
    // Every [at, at + n) given, to check that the data is covered once.
    let mut given: Vec<(u64, u64)> = Vec::new();
    for s in sources {
        let u = |k: &str| s.get(k).and_then(Value::as_u64);
        let (Some(chunk), Some(dev), Some(ino), Some(len), Some(ctime_ns), Some(ranges)) = (
            s.get("path").and_then(Value::as_str),
            u("dev"),
            u("ino"),
            u("bytes"),
            s.get("ctime_ns").and_then(Value::as_i64),
            s.get("ranges").and_then(Value::as_array),
        ) else {
            return Err(bad(format!("a source is {s}, not a checked chunk")));
        };
        let chunk = Path::new(chunk);
        let inside = chunk.starts_with(root)
            && chunk != root
            && chunk
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !inside {
            return Err(bad(format!(
                "chunk {} is not a file in the store's directory {}",
                chunk.display(),
                root.display()
            )));
        }
        let mut mine = Vec::with_capacity(ranges.len());
        for r in ranges {
            let r: Option<Vec<u64>> = r
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).collect());
            let Some(&[at, n, from]) = r.as_deref() else {
                return Err(bad(format!(
                    "a range of {} is not [at, length, offset]",
                    chunk.display()
                )));
            };
            let fits = at >= data_start
                && at.checked_add(n).is_some_and(|e| e <= size)
                && from.checked_add(n).is_some_and(|e| e <= len);
            if !fits {
                return Err(bad(format!(
                    "range [{at}, {n}, {from}] of {} lies outside the data [{data_start}, {size}) or the chunk ({len} bytes)",
                    chunk.display()
                )));
            }
            given.push((at, at + n));
            mine.push([at, n, from]);
        }
        plan.push(Source {
            chunk,
            checked: (dev, ino, len, ctime_ns),
            ranges: mine,
        });
    }
    given.sort_unstable();
    let mut at = data_start;
    for (lo, hi) in given {
        if lo != at {
            return Err(bad(format!(
                "bytes from {} of the data are {}",
                at.min(lo),
                if lo < at {
                    "given twice"
                } else {
                    "never given"
                }
            )));
        }
        at = hi;
    }
    if at != size {
        return Err(bad(format!("bytes from {at} of the data are never given")));
    }

    let size = usize::try_from(size).map_err(|_| bad(format!("{size} bytes")))?;
    let mut out = Vec::new();
    out.try_reserve_exact(size)
        .map_err(|_| bad(format!("{size} bytes do not fit in memory")))?;
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.resize(size, 0);
    for s in &plan {
        read_source(s, &mut out)?;
    }
    Ok(out)
}

/// Reads `s`'s ranges into `out`, only while its chunk is the file that was checked: the same
/// device, inode, length and inode change time before and after the reads, never through a
/// symlink.
fn read_source(s: &Source<'_>, out: &mut [u8]) -> Result<(), WorkerError> {
    let changed = || WorkerError::Format {
        path: s.chunk.to_path_buf(),
        reason: "not the chunk the agent checked (replaced or changed since)".into(),
    };
    let f = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(s.chunk)
        .map_err(|e| WorkerError::Io {
            op: "open a checked chunk",
            path: s.chunk.to_path_buf(),
            source: e,
        })?;
    let identity = |f: &File| {
        f.metadata().ok().filter(|m| m.is_file()).map(|m| {
            let ns = m
                .ctime()
                .saturating_mul(1_000_000_000)
                .saturating_add(m.ctime_nsec());
            (m.dev(), m.ino(), m.len(), ns)
        })
    };
    if identity(&f) != Some(s.checked) {
        return Err(changed());
    }
    for &[at, n, from] in &s.ranges {
        // Within `out` and the chunk: checked by `assemble`.
        let dest = &mut out[at as usize..(at + n) as usize];
        f.read_exact_at(dest, from).map_err(|e| WorkerError::Io {
            op: "read a checked chunk",
            path: s.chunk.to_path_buf(),
            source: e,
        })?;
    }
    // Written while it was read: what was read may be neither the old bytes nor new.
    if identity(&f) != Some(s.checked) {
        return Err(changed());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_file_is_put_together_from_checked_chunks_and_refused_when_one_changed() {
        let d = tempfile::tempdir().unwrap();
        let chunk = d.path().join("chunk");
        std::fs::write(&chunk, b"abcdefgh").unwrap();
        let m = std::fs::metadata(&chunk).unwrap();
        let doc = |ranges: Value| {
            json!({"version": 1, "header": "{}", "bytes": 16, "root": d.path(), "sources": [{
                "path": chunk.to_str().unwrap(), "bytes": 8, "dev": m.dev(), "ino": m.ino(),
                "ctime_ns": m.ctime() * 1_000_000_000 + m.ctime_nsec(), "ranges": ranges,
            }]})
        };
        let p = d.path().join("sources.json");
        let got = assemble(&p, &doc(json!([[10, 4, 4], [14, 2, 0]]))).unwrap();
        assert_eq!(&got[..8], &2u64.to_le_bytes());
        assert_eq!(&got[8..], b"{}efghab");
        for ranges in [
            json!([[10, 4, 4]]),               // bytes 14-16 never given
            json!([[10, 4, 4], [12, 4, 0]]),   // bytes 12-14 twice
            json!([[9, 4, 4], [13, 3, 0]]),    // inside the header
            json!([[10, 4, 6], [14, 2, 0]]),   // past the chunk's end
            json!([[10, "4", 4], [14, 2, 0]]), // not a number
        ] {
            assert!(assemble(&p, &doc(ranges.clone())).is_err(), "{ranges}");
        }
        // A length the ranges do not fill is refused before any memory is taken for it.
        let mut huge = doc(json!([[10, 4, 4], [14, 2, 0]]));
        huge["bytes"] = json!(1u64 << 50);
        let e = assemble(&p, &huge).unwrap_err();
        assert!(e.to_string().contains("never given"), "{e}");
        // A chunk outside the store's directory is not opened.
        let mut outside = doc(json!([[10, 4, 4], [14, 2, 0]]));
        outside["root"] = json!("/elsewhere");
        let e = assemble(&p, &outside).unwrap_err();
        assert!(e.to_string().contains("not a file in the store"), "{e}");
        // Replaced since the check: refused, naming the chunk.
        let other = d.path().join("other");
        std::fs::write(&other, b"abcdefgh").unwrap();
        std::fs::rename(&other, &chunk).unwrap();
        let e = assemble(&p, &doc(json!([[10, 4, 4], [14, 2, 0]]))).unwrap_err();
        assert!(
            e.to_string().contains("not the chunk the agent checked"),
            "{e}"
        );
    }

    #[test]
    fn random_and_mutated_sources_never_panic() {
        // A seeded xorshift: ELASTIC_SEED=<n> replays one run.
        let mut seed: u64 = std::env::var("ELASTIC_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed_50c5);
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let d = tempfile::tempdir().unwrap();
        let chunk = d.path().join("chunk");
        std::fs::write(&chunk, b"abcdefgh").unwrap();
        let m = std::fs::metadata(&chunk).unwrap();
        let valid = json!({"version": 1, "header": "{}", "bytes": 16, "root": d.path(), "sources": [{
            "path": chunk.to_str().unwrap(), "bytes": 8, "dev": m.dev(), "ino": m.ino(),
            "ctime_ns": m.ctime() * 1_000_000_000 + m.ctime_nsec(), "ranges": [[10, 4, 4], [14, 2, 0]],
        }]});
        let p = d.path().join("sources.json");
        assert!(assemble(&p, &valid).is_ok());
        let odd = |r: u64| -> Value {
            match r % 9 {
                0 => json!(u64::MAX),
                1 => json!(i64::MIN),
                2 => json!(-1),
                3 => json!(r % 32),
                4 => json!("x"),
                5 => json!(null),
                6 => json!([r % 20, r % 7, r % 9]),
                7 => json!(1e300),
                _ => json!(usize::MAX as u64 / 2),
            }
        };
        let fields = ["version", "header", "bytes", "root", "sources"];
        let source_fields = ["path", "bytes", "dev", "ino", "ctime_ns", "ranges"];
        for _ in 0..5000 {
            let mut doc = valid.clone();
            for _ in 0..1 + next() % 3 {
                let r = next();
                let value = odd(next());
                // The place mutated, where the document (already mutated) still has it.
                let place = match r % 4 {
                    0 => Some(&mut doc[fields[(r >> 8) as usize % fields.len()]]),
                    1 => doc
                        .pointer_mut("/sources/0")
                        .and_then(Value::as_object_mut)
                        .map(|o| {
                            o.entry(source_fields[(r >> 8) as usize % source_fields.len()])
                                .or_insert(Value::Null)
                        }),
                    2 => doc.pointer_mut(&format!("/sources/0/ranges/{}", (r >> 8) % 2)),
                    _ => doc.pointer_mut(&format!("/sources/0/ranges/0/{}", (r >> 8) % 3)),
                };
                if let Some(v) = place {
                    *v = value;
                }
            }
            // Whatever it holds: an error or the bytes, never a panic.
            let _ = assemble(&p, &doc);
        }
    }
}
