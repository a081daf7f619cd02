//! Reading a chunk: streaming its stored bytes into a [`ChunkDecoder`] as they arrive, checking
//! its length and its checksums (stored, decoded, and per block where the manifest lists them)
//! before a byte of it is trusted, and
//! [`Store::verify`], which reads every chunk of a step.

use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use object_store::GetOptions;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::ReadOptions;
use crate::codec::{BlocksError, ChunkDecoder};
use crate::error::{Error, Result};
use crate::format::{Manifest, ObjectEntry};
use crate::local::STREAM_BLOCK_BYTES;
use crate::store::Store;

/// Batches of a chunk's pieces (as the store's client hands them over, a few KiB to a few
/// hundred KiB each, gathered until a batch holds a block: at most a block plus a piece) that
/// wait for its decoder, per chunk.
const PIECES_IN_FLIGHT: usize = 16;

/// Checks the block checksums computed over the whole of object `o` against its manifest's
/// (none to check in format 1).
pub(super) fn check_block_crcs(
    store: &Store,
    step: u64,
    o: &ObjectEntry,
    got: &[u32],
) -> Result<()> {
    if o.block_crc32c.is_empty() || got == o.block_crc32c.as_slice() {
        return Ok(());
    }
    let block = got
        .iter()
        .zip(&o.block_crc32c)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(o.block_crc32c.len()));
    Err(store.corrupt(
        step,
        &o.key,
        format!(
            "block {block}: crc32c {}, manifest says {}",
            got.get(block).map_or("none".into(), |c| format!("{c:08x}")),
            o.block_crc32c
                .get(block)
                .map_or("none".into(), |c| format!("{c:08x}"))
        ),
    ))
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

impl Store {
    pub(super) fn corrupt(&self, step: u64, key: &str, reason: String) -> Error {
        Error::Corrupt {
            store: self.url().to_string(),
            step,
            key: key.to_string(),
            reason,
        }
    }

    /// The error for object `o` of `step` found to be `size` bytes long.
    pub(super) fn truncated(&self, step: u64, o: &ObjectEntry, size: u64) -> Error {
        self.corrupt(
            step,
            &o.key,
            format!(
                "truncated or extended: {size} bytes, manifest says {}",
                o.stored_bytes
            ),
        )
    }

    /// Fetches the stored bytes of object `idx` whole, checking length and stored checksum
    /// (for copying a step as it is stored).
    pub(crate) async fn fetch_stored(
        &self,
        m: &Manifest,
        idx: usize,
        cancel: &CancellationToken,
    ) -> Result<bytes::Bytes> {
        let o = &m.objects[idx];
        let data = self.get(&o.key, cancel).await?;
        if data.len() as u64 != o.stored_bytes {
            return Err(self.truncated(m.step, o, data.len() as u64));
        }
        let crc = crc32c::crc32c(&data);
        if crc != o.stored_crc32c {
            return Err(self.crc_mismatch(m.step, o, "crc32c", crc, o.stored_crc32c));
        }
        Ok(data)
    }

    fn crc_mismatch(&self, step: u64, o: &ObjectEntry, what: &str, got: u32, want: u32) -> Error {
        self.corrupt(
            step,
            &o.key,
            format!("{what} {got:08x}, manifest says {want:08x}"),
        )
    }

    /// A GET of object `o` at `path` with `opts`, whose object must be as long as the
    /// manifest says.
    pub(super) async fn get_object(
        &self,
        step: u64,
        o: &ObjectEntry,
        path: &object_store::path::Path,
        opts: GetOptions,
    ) -> Result<object_store::GetResult> {
        let r = self
            .inner
            .get_opts(path, opts)
            .await
            .map_err(|e| self.err("get", &o.key, e))?;
        if r.meta.size != o.stored_bytes {
            return Err(self.truncated(step, o, r.meta.size));
        }
        Ok(r)
    }

    /// Reads object `idx` and hands its decoded bytes to `sink(offset, bytes)` in order, in
    /// blocks of at most [`STREAM_BLOCK_BYTES`], decoding while the stored bytes arrive
    /// ([`ChunkDecoder`], on a blocking thread). The checksums (per block too where the
    /// manifest lists them) and the length are checked at the end: until this returns `Ok`,
    /// what the sink was given is not to be trusted. A remote object comes as one GET,
    /// resumed from where it broke off when a transient error cuts it; at most
    /// [`PIECES_IN_FLIGHT`] batches of its pieces wait for the decoder. With `every_checksum`,
    /// a compressed chunk's stored checksum is checked too, where block checksums make it
    /// redundant for the decoded bytes (`verify` checks every checksum the manifest lists).
    pub(crate) async fn read_object<S>(
        &self,
        m: &Manifest,
        idx: usize,
        every_checksum: bool,
        cancel: &CancellationToken,
        mut sink: S,
    ) -> Result<()>
    where
        S: FnMut(u64, &[u8]) -> Result<()> + Send + 'static,
    {
        let o = m.objects[idx].clone();
        let step = m.step;
        // Numbers that disagree are refused before a request is made.
        let mut d = ChunkDecoder::new(&o.codec, o.raw_bytes, o.stored_bytes, STREAM_BLOCK_BYTES)
            .map_err(|reason| self.corrupt(step, &o.key, reason))?;
        // A chunk with block checksums has them checked, so that a chunk that reads whole
        // also reads in part; they stand in for the passes of its whole decoded checksum and,
        // since they cover every decoded byte, of its stored checksum: one pass in all.
        if !o.block_crc32c.is_empty() {
            d.sum_blocks();
        }
        if every_checksum {
            d.keep_stored_sum();
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<bytes::Bytes>>(PIECES_IN_FLIGHT);
        let store = self.clone();
        let decoder = tokio::task::spawn_blocking(move || {
            let corrupt = |e: BlocksError<Error>| match e {
                BlocksError::Codec(reason) => store.corrupt(step, &o.key, reason),
                BlocksError::Sink(e) => e,
            };
            while let Some(batch) = rx.blocking_recv() {
                for piece in batch {
                    d.push(piece, &mut sink).map_err(corrupt)?;
                }
            }
            let sums = d.finish(&mut sink).map_err(corrupt)?;
            if let Some(blocks) = &sums.blocks {
                check_block_crcs(&store, step, &o, blocks)?;
            }
            if let Some(stored) = sums.stored
                && stored != o.stored_crc32c
            {
                return Err(store.crc_mismatch(step, &o, "crc32c", stored, o.stored_crc32c));
            }
            if sums.decoded != o.raw_crc32c {
                return Err(store.crc_mismatch(
                    step,
                    &o,
                    "decoded crc32c",
                    sums.decoded,
                    o.raw_crc32c,
                ));
            }
            Ok(())
        });
        let fed = self.feed_object(m, idx, &tx, cancel).await;
        drop(tx);
        // Always wait for the decoder, so that nothing still writes through the sink when
        // this returns.
        let decoded = decoder.await.map_err(|e| Error::task_failed("decode", e))?;
        // A feed that stopped because the decoder stopped taking pieces leaves the decoder's
        // error to say why; a feed that failed says why itself.
        fed.and(decoded)
    }

    /// Sends the stored bytes of object `idx` to `tx` in order. Returns `false` when the
    /// receiver stopped taking them.
    async fn feed_object(
        &self,
        m: &Manifest,
        idx: usize,
        tx: &tokio::sync::mpsc::Sender<Vec<bytes::Bytes>>,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        let o = &m.objects[idx];
        if self.has_local_root() {
            // A local file is read whole: the page cache needs no streaming.
            let data = self.get(&o.key, cancel).await?;
            if data.len() as u64 != o.stored_bytes {
                return Err(self.truncated(m.step, o, data.len() as u64));
            }
            return Ok(tx.send(vec![data]).await.is_ok());
        }
        let path = self.path(&o.key);
        let received = AtomicU64::new(0);
        // The version the first response came from: a resumed read asks for that one only, so
        // that an object replaced in between is an error, not two objects stitched together.
        let e_tag = std::sync::Mutex::new(None::<String>);
        let (path, received, e_tag) = (&path, &received, &e_tag);
        self.retry("get", &o.key, cancel, || async move {
            let from = received.load(Ordering::Relaxed);
            if from == o.stored_bytes && from > 0 {
                // Every byte arrived before the body broke off.
                return Ok(true);
            }
            let opts = GetOptions {
                range: (from > 0).then(|| (from..o.stored_bytes).into()),
                if_match: if from > 0 {
                    e_tag.lock().unwrap_or_else(|e| e.into_inner()).clone()
                } else {
                    None
                },
                ..Default::default()
            };
            let r = self.get_object(m.step, o, path, opts).await?;
            if from == 0 {
                *e_tag.lock().unwrap_or_else(|e| e.into_inner()) = r.meta.e_tag.clone();
            }
            let mut pieces = r.into_stream();
            // Bytes of this response received, and handed to the decoder.
            let (mut got, mut sent) = (0u64, 0u64);
            // Pieces are gathered into a batch of at least a block before they are handed
            // over, without a copy: one wake-up of the decoder per block, not per piece.
            let mut pending: Vec<bytes::Bytes> = Vec::new();
            let mut pending_bytes = 0u64;
            let fed = loop {
                let end = match pieces.next().await {
                    Some(Ok(piece)) => {
                        let n = piece.len() as u64;
                        let at = from + got;
                        if n > o.stored_bytes - at {
                            break Err(self.truncated(m.step, o, at + n));
                        }
                        got += n;
                        if n > 0 {
                            pending.push(piece);
                            pending_bytes += n;
                        }
                        if pending_bytes < STREAM_BLOCK_BYTES as u64 {
                            continue;
                        }
                        None
                    }
                    // The body ended or broke off: what arrived goes on first.
                    None => Some(Ok(true)),
                    Some(Err(e)) => Some(Err(self.err("get", &o.key, e))),
                };
                if pending_bytes > 0 {
                    if tx.send(std::mem::take(&mut pending)).await.is_err() {
                        break Ok(false);
                    }
                    sent += std::mem::take(&mut pending_bytes);
                    received.store(from + sent, Ordering::Relaxed);
                }
                if let Some(end) = end {
                    break end;
                }
            };
            self.count_read(got);
            let fed = fed?;
            let end = from + sent;
            if fed && end != o.stored_bytes {
                return Err(self.truncated(m.step, o, end));
            }
            Ok(fed)
        })
        .await
    }

    /// Fetches object `idx` and checks every checksum, decoding it as it arrives (the decoded
    /// chunk is never held).
    pub(crate) async fn fetch_checked(
        &self,
        m: &Manifest,
        idx: usize,
        cancel: &CancellationToken,
    ) -> Result<()> {
        self.read_object(m, idx, true, cancel, |_, _| Ok(())).await
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
                let r = self.fetch_checked(m, i, cancel).await;
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
}
