//! Reading part of a chunk: only the blocks of its `block_crc32c` that hold bytes a read
//! needs, each decoded (a `zstd-blocks` chunk) and checked against its checksum before a byte
//! of it goes to the output. A restore that re-cuts row-sharded state for another world size
//! needs a slice of each tensor, not whole chunks; this reads at most one block
//! ([`CHECK_BLOCK_BYTES`] of decoded bytes) more than needed at each end of each range.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use object_store::GetOptions;
use tokio_util::sync::CancellationToken;

use super::write::CopyOp;
use crate::codec::{BlockDecoder, Codec, block_raw_range};
use crate::error::{Error, Result};
use crate::format::{CHECK_BLOCK_BYTES, Manifest, ObjectEntry};
use crate::store::Store;

/// The runs `[first, end)` of block indexes of object `o` that hold the bytes `ops` take, in
/// order and merged; `None` when the whole object is to be read: it has no block checksums
/// (a compressed codec of format 2, or format 1), or `ops` need a byte of every block.
pub(super) fn needed_blocks(o: &ObjectEntry, ops: &[CopyOp]) -> Option<Vec<(u64, u64)>> {
    if !matches!(o.codec, Codec::Raw | Codec::ZstdBlocks { .. }) || o.block_crc32c.is_empty() {
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

/// The blocks of one object read in part: where each block's stored bytes lie, and what
/// turns them into its decoded bytes.
struct Blocks {
    o: ObjectEntry,
    /// The stored bytes `[start, end)` of each block.
    stored: Vec<(u64, u64)>,
    /// `None` for a raw object, whose stored bytes are its decoded bytes.
    dec: Option<BlockDecoder>,
}

impl Blocks {
    fn new(store: &Store, step: u64, o: &ObjectEntry) -> Result<Self> {
        let bad = |reason: String| store.corrupt(step, &o.key, reason);
        o.codec.check(o.raw_bytes, o.stored_bytes).map_err(bad)?;
        let stored = o
            .codec
            .stored_blocks(o.raw_bytes)
            .filter(|s| s.len() == o.block_crc32c.len())
            .ok_or_else(|| bad("not readable in blocks".into()))?;
        let dec = match &o.codec {
            Codec::ZstdBlocks { width, .. } => Some(BlockDecoder::new(*width).map_err(bad)?),
            _ => None,
        };
        Ok(Self {
            o: o.clone(),
            stored,
            dec,
        })
    }

    /// Decodes block `block` from its stored bytes and checks it against its checksum:
    /// `(offset in the decoded object, decoded bytes)`.
    fn open<'a>(
        &'a mut self,
        store: &Store,
        step: u64,
        block: u64,
        stored: &'a [u8],
    ) -> Result<(u64, &'a [u8])> {
        let (a, b) = block_raw_range(self.o.raw_bytes, block);
        let bytes = match &mut self.dec {
            None => stored,
            Some(dec) => dec.decode(stored, (b - a) as usize).map_err(|e| {
                store.corrupt(
                    step,
                    &self.o.key,
                    format!("block {block} (bytes {a}..{b}): {e}"),
                )
            })?,
        };
        let want = self.o.block_crc32c[block as usize];
        let got = crc32c::crc32c(bytes);
        if got != want {
            return Err(store.corrupt(
                step,
                &self.o.key,
                format!(
                    "block {block} (bytes {a}..{b}): crc32c {got:08x}, manifest says {want:08x}"
                ),
            ));
        }
        Ok((a, bytes))
    }
}

impl Store {
    /// Reads the blocks `runs` ([`needed_blocks`]) of object `idx` and hands each to
    /// `sink(offset in the decoded object, bytes)` once it is decoded and its checksum
    /// matched, in order. On a local directory each block is read from the file with `pread`;
    /// on a remote store each run is one ranged GET, resumed from its first unchecked block
    /// when a transient error cuts it, and only of the version its first response came from.
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
        let step = m.step;
        let blocks = Blocks::new(self, step, &m.objects[idx])?;
        if self.has_local_root() {
            let (store, cancel) = (self.clone(), cancel.clone());
            return tokio::task::spawn_blocking(move || {
                store.read_local_blocks(step, blocks, &runs, &cancel, sink)
            })
            .await
            .map_err(|e| Error::task_failed("read", e))?;
        }
        let state = Mutex::new((blocks, sink));
        let e_tag = Mutex::new(None::<String>);
        for run in runs {
            self.get_blocks(step, run, &e_tag, cancel, &state).await?;
        }
        Ok(())
    }

    fn read_local_blocks<S>(
        &self,
        step: u64,
        blocks: Blocks,
        runs: &[(u64, u64)],
        cancel: &CancellationToken,
        sink: S,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()>,
    {
        let f = self.open_local_raw(step, &blocks.o)?;
        self.read_open_blocks(step, blocks, &f, runs, cancel, sink)
    }

    /// Checks the blocks `runs` of raw object `o` in its open file `f`, reading them and
    /// keeping nothing.
    pub(super) fn check_local_blocks(
        &self,
        step: u64,
        o: &ObjectEntry,
        f: &std::fs::File,
        runs: &[(u64, u64)],
        cancel: &CancellationToken,
    ) -> Result<()> {
        let blocks = Blocks::new(self, step, o)?;
        self.read_open_blocks(step, blocks, f, runs, cancel, |_, _| Ok(()))
    }

    /// [`Store::read_local_blocks`] from the object's open file `f`.
    fn read_open_blocks<S>(
        &self,
        step: u64,
        mut blocks: Blocks,
        f: &std::fs::File,
        runs: &[(u64, u64)],
        cancel: &CancellationToken,
        mut sink: S,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()>,
    {
        let o = blocks.o.clone();
        let longest = blocks.stored.iter().map(|(a, b)| b - a).max().unwrap_or(0);
        let mut buf = vec![0u8; usize::try_from(longest).unwrap_or(0)];
        let mut read = 0u64;
        let r = (|| {
            for &(first, end) in runs {
                for block in first..end {
                    if cancel.is_cancelled() {
                        return Err(Error::Cancelled {
                            op: format!("get {} on {}", o.key, self.url()),
                        });
                    }
                    let (a, b) = blocks.stored[block as usize];
                    let bytes = &mut buf[..(b - a) as usize];
                    self.read_local_at(step, &o, f, bytes, a)?;
                    read += b - a;
                    let (at, decoded) = blocks.open(self, step, block, bytes)?;
                    sink(at, decoded)?;
                }
            }
            Ok(())
        })();
        self.count_read(read);
        r
    }

    /// One ranged GET of the blocks `[first, end)` of a remote object, resumed after a
    /// transient error from the first block not yet handed to the sink.
    async fn get_blocks<S>(
        &self,
        step: u64,
        (first, end): (u64, u64),
        e_tag: &Mutex<Option<String>>,
        cancel: &CancellationToken,
        state: &Mutex<(Blocks, S)>,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()>,
    {
        let (o, stored) = {
            let st = state.lock().unwrap_or_else(|e| e.into_inner());
            (st.0.o.clone(), st.0.stored.clone())
        };
        let path = self.path(&o.key);
        let hi = stored[(end - 1) as usize].1;
        // The first block not yet checked and handed over.
        let next = AtomicU64::new(first);
        let (path, next, o, stored) = (&path, &next, &o, &stored);
        self.retry("get", &o.key, cancel, || async move {
            let mut block = next.load(Ordering::Relaxed);
            if block >= end {
                return Ok(());
            }
            let from = stored[block as usize].0;
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
                    if block >= end {
                        // More than the range asked for.
                        break 'body Err(self.truncated(step, o, hi + piece.len() as u64));
                    }
                    let (a, b) = stored[block as usize];
                    let want = (b - a) as usize;
                    let take = (want - buf.len()).min(piece.len());
                    buf.extend_from_slice(&piece.split_to(take));
                    if buf.len() == want {
                        let handed = {
                            let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                            let (blocks, sink) = &mut *st;
                            blocks
                                .open(self, step, block, &buf)
                                .and_then(|(at, bytes)| sink(at, bytes))
                        };
                        if handed.is_err() {
                            break 'body handed;
                        }
                        block += 1;
                        next.store(block, Ordering::Relaxed);
                        buf.clear();
                    }
                }
            };
            self.count_read(got);
            fed?;
            if block != end {
                let pos = stored[block as usize].0 + buf.len() as u64;
                return Err(self.truncated(step, o, pos));
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
