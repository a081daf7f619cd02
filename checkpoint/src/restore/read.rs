//! Reading a chunk: fetching its stored bytes (a large one from a remote store as parallel
//! ranged requests), checking its stored and decoded checksums before a byte of it is used,
//! and [`Store::verify`], which reads every chunk of a step.

use futures::StreamExt;
use object_store::ObjectStoreExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::ReadOptions;
use crate::codec;
use crate::error::{Error, Result};
use crate::format::{Manifest, ObjectEntry};
use crate::store::Store;

/// Reads of a large object from a remote store are cut into ranges of this size...
const RANGE_BYTES: u64 = 8 * 1024 * 1024;
/// ...of which this many are in flight at once, per object.
const RANGES_IN_FLIGHT: usize = 4;

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
                return Err(self.truncated(m.step, o, size));
            }
            self.fetch_ranges(m.step, &o.key, o.stored_bytes, cancel)
                .await?
                .into()
        } else {
            self.get(&o.key, cancel).await?
        };
        if data.len() as u64 != o.stored_bytes {
            return Err(self.truncated(m.step, o, data.len() as u64));
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
                            let b = self
                                .inner
                                .get_range(path, range.clone())
                                .await
                                .map_err(|e| self.err("get", key, e))?;
                            self.count_read(b.len() as u64);
                            Ok(b)
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

    /// Fetches object `idx` and checks every checksum, decoding it a block at a time (the
    /// decoded chunk is never held).
    pub(crate) async fn fetch_checked(
        &self,
        m: &Manifest,
        idx: usize,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let stored = self.fetch_stored(m, idx, cancel).await?;
        let o = m.objects[idx].clone();
        // A raw chunk's stored checksum is its raw checksum (the manifest validator
        // insists), and fetch_stored checked it: no second pass.
        if o.codec == codec::Codec::Raw {
            return Ok(());
        }
        let r = tokio::task::spawn_blocking(move || {
            let crc = codec::decode_blocks(
                &stored,
                &o.codec,
                o.raw_bytes,
                crate::local::STREAM_BLOCK_BYTES,
                |_, _| Ok::<_, std::convert::Infallible>(()),
            )
            .map_err(|e| match e {
                codec::BlocksError::Codec(reason) => reason,
                codec::BlocksError::Sink(never) => match never {},
            })?;
            if crc != o.raw_crc32c {
                return Err(format!(
                    "decoded crc32c {crc:08x}, manifest says {:08x}",
                    o.raw_crc32c
                ));
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::task_failed("decode", e))?;
        r.map_err(|reason| self.corrupt(m.step, &m.objects[idx].key, reason))
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
