//! Reading part of a raw chunk: only the blocks of its `block_crc32c` that hold bytes a read
//! needs, each checked against its checksum before a byte of it goes to the output. A restore
//! that re-cuts row-sharded state for another world size needs a slice of each tensor, not
//! whole chunks; this reads at most one block ([`CHECK_BLOCK_BYTES`]) more than needed at each
//! end of each range.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use object_store::GetOptions;
use tokio_util::sync::CancellationToken;

use super::write::CopyOp;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::{CHECK_BLOCK_BYTES, Manifest, ObjectEntry};
use crate::store::Store;

/// The runs `[first, end)` of block indexes of object `o` that hold the bytes `ops` take, in
/// order and merged; `None` when the whole object is to be read: it has no block checksums
/// (compressed, or written by format 1), or `ops` need a byte of every block.
pub(super) fn needed_blocks(o: &ObjectEntry, ops: &[CopyOp]) -> Option<Vec<(u64, u64)>> {
    if o.codec != Codec::Raw || o.block_crc32c.is_empty() {
        return None;
    }
    let blocks = o.block_crc32c.len() as u64;
    let mut wanted: Vec<(u64, u64)> = ops
        .iter()
        .filter(|op| op.len > 0)
        .map(|op| {
            let end = op.obj_offset.saturating_add(op.len);
            (
                (op.obj_offset / CHECK_BLOCK_BYTES).min(blocks),
                end.div_ceil(CHECK_BLOCK_BYTES).min(blocks),
            )
        })
        .collect();
    wanted.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(wanted.len());
    for (a, b) in wanted {
        match runs.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => runs.push((a, b)),
        }
    }
    let covered: u64 = runs.iter().map(|(a, b)| b - a).sum();
    (covered < blocks).then_some(runs)
}

/// Bytes `[start, end)` of block `block` of object `o`.
fn block_bytes(o: &ObjectEntry, block: u64) -> (u64, u64) {
    let start = block * CHECK_BLOCK_BYTES;
    (start, (start + CHECK_BLOCK_BYTES).min(o.stored_bytes))
}

impl Store {
    fn check_block(&self, step: u64, o: &ObjectEntry, block: u64, bytes: &[u8]) -> Result<()> {
        let want = o.block_crc32c[block as usize];
        let got = crc32c::crc32c(bytes);
        if got != want {
            let (a, b) = block_bytes(o, block);
            return Err(self.corrupt(
                step,
                &o.key,
                format!(
                    "block {block} (bytes {a}..{b}): crc32c {got:08x}, manifest says {want:08x}"
                ),
            ));
        }
        Ok(())
    }

    /// Reads the blocks `runs` ([`needed_blocks`]) of raw object `idx` and hands each to
    /// `sink(offset in the object, bytes)` once its checksum matched, in order. On a local
    /// directory each block is read from the file with `pread`; on a remote store each run is
    /// one ranged GET, resumed from its first unchecked block when a transient error cuts it,
    /// and only of the version its first response came from.
    pub(super) async fn read_blocks<S>(
        &self,
        m: &Manifest,
        idx: usize,
        runs: Vec<(u64, u64)>,
        cancel: &CancellationToken,
        sink: S,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()> + Send + 'static,
    {
        let o = m.objects[idx].clone();
        let step = m.step;
        if self.has_local_root() {
            let (store, cancel) = (self.clone(), cancel.clone());
            return tokio::task::spawn_blocking(move || {
                store.read_local_blocks(step, &o, &runs, &cancel, sink)
            })
            .await
            .map_err(|e| Error::task_failed("read", e))?;
        }
        let sink = Mutex::new(sink);
        let e_tag = Mutex::new(None::<String>);
        for run in runs {
            self.get_blocks(step, &o, run, &e_tag, cancel, &sink)
                .await?;
        }
        Ok(())
    }

    fn read_local_blocks<S>(
        &self,
        step: u64,
        o: &ObjectEntry,
        runs: &[(u64, u64)],
        cancel: &CancellationToken,
        mut sink: S,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()>,
    {
        let f = self.open_local_raw(step, o)?;
        let mut buf = vec![0u8; CHECK_BLOCK_BYTES.min(o.stored_bytes) as usize];
        let mut read = 0u64;
        let r = (|| {
            for &(first, end) in runs {
                for block in first..end {
                    if cancel.is_cancelled() {
                        return Err(Error::Cancelled {
                            op: format!("get {} on {}", o.key, self.url()),
                        });
                    }
                    let (a, b) = block_bytes(o, block);
                    let bytes = &mut buf[..(b - a) as usize];
                    self.read_local_at(step, o, &f, bytes, a)?;
                    read += b - a;
                    self.check_block(step, o, block, bytes)?;
                    sink(a, bytes)?;
                }
            }
            Ok(())
        })();
        self.count_read(read);
        r
    }

    /// One ranged GET of the blocks `[first, end)` of remote object `o`, resumed after a
    /// transient error from the first block not yet handed to `sink`.
    async fn get_blocks<S>(
        &self,
        step: u64,
        o: &ObjectEntry,
        (first, end): (u64, u64),
        e_tag: &Mutex<Option<String>>,
        cancel: &CancellationToken,
        sink: &Mutex<S>,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()>,
    {
        let path = self.path(&o.key);
        let hi = block_bytes(o, end - 1).1;
        // The first byte not yet checked and handed over: always the start of a block.
        let next = AtomicU64::new(block_bytes(o, first).0);
        let (path, next) = (&path, &next);
        self.retry("get", &o.key, cancel, || async move {
            let from = next.load(Ordering::Relaxed);
            if from >= hi {
                return Ok(());
            }
            let opts = GetOptions {
                range: Some((from..hi).into()),
                if_match: e_tag.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                ..Default::default()
            };
            let r = self.get_object(step, o, path, opts).await?;
            {
                let mut pinned = e_tag.lock().unwrap_or_else(|e| e.into_inner());
                if pinned.is_none() {
                    pinned.clone_from(&r.meta.e_tag);
                }
            }
            let mut pieces = r.into_stream();
            let mut buf: Vec<u8> = Vec::new();
            let mut pos = from;
            let mut got = 0u64;
            // Every way out of the body goes through the count of bytes read.
            let fed = 'body: loop {
                let mut piece = match pieces.next().await {
                    None => break Ok(()),
                    Some(Err(e)) => break Err(self.err("get", &o.key, e)),
                    Some(Ok(p)) => p,
                };
                got += piece.len() as u64;
                while !piece.is_empty() {
                    if pos >= hi {
                        // More than the range asked for.
                        break 'body Err(self.truncated(step, o, hi + piece.len() as u64));
                    }
                    let block = pos / CHECK_BLOCK_BYTES;
                    let (_, b) = block_bytes(o, block);
                    let want = (b - pos) as usize;
                    let take = (want - buf.len()).min(piece.len());
                    buf.extend_from_slice(&piece.split_to(take));
                    if buf.len() == want {
                        let handed = self.check_block(step, o, block, &buf).and_then(|()| {
                            (sink.lock().unwrap_or_else(|e| e.into_inner()))(pos, &buf)
                        });
                        if handed.is_err() {
                            break 'body handed;
                        }
                        pos = b;
                        next.store(pos, Ordering::Relaxed);
                        buf.clear();
                    }
                }
            };
            self.count_read(got);
            fed?;
            if pos != hi {
                return Err(self.truncated(step, o, pos + buf.len() as u64));
            }
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(bytes: u64) -> ObjectEntry {
        ObjectEntry {
            key: "k".into(),
            stored_bytes: bytes,
            stored_crc32c: 0,
            codec: Codec::Raw,
            raw_bytes: bytes,
            raw_crc32c: 0,
            block_crc32c: vec![0; bytes.div_ceil(CHECK_BLOCK_BYTES) as usize],
        }
    }

    fn op(obj_offset: u64, len: u64) -> CopyOp {
        CopyOp {
            out: 0,
            object: 0,
            obj_offset,
            len,
            out_offset: 0,
        }
    }

    #[test]
    fn needed_blocks_are_the_blocks_the_copies_touch_merged() {
        const B: u64 = CHECK_BLOCK_BYTES;
        let o = object(10 * B + 5);
        assert_eq!(needed_blocks(&o, &[op(B + 1, 10)]), Some(vec![(1, 2)]));
        // Two ranges in one block and one that runs into the next: one run.
        assert_eq!(
            needed_blocks(&o, &[op(3 * B + 10, 5), op(3 * B, 1), op(4 * B - 1, 2)]),
            Some(vec![(3, 5)])
        );
        assert_eq!(
            needed_blocks(&o, &[op(9 * B, 1), op(0, 1)]),
            Some(vec![(0, 1), (9, 10)])
        );
        // The short last block.
        assert_eq!(needed_blocks(&o, &[op(10 * B, 5)]), Some(vec![(10, 11)]));
        // Every block needed: read whole.
        assert_eq!(needed_blocks(&o, &[op(0, 10 * B + 5)]), None);
        assert_eq!(
            needed_blocks(&o, &[op(0, 6 * B), op(6 * B - 1, 5 * B)]),
            None
        );
        // No block checksums, or compressed: whole.
        let mut v1 = o.clone();
        v1.block_crc32c.clear();
        assert_eq!(needed_blocks(&v1, &[op(0, 1)]), None);
    }
}
