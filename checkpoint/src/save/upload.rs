//! Uploading a writer's part: each planned chunk is read, checksummed, encoded and put,
//! `concurrency` at a time, and then the part record that names them; and the abandonment
//! marker of a writer that gives its part up.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use tokio_util::sync::CancellationToken;

use super::commit::merge_tensor;
use super::input::{InputFile, Src, collect_dir, open_input, plan_chunks};
use super::{PartInput, PartSource, SaveOptions, now_unix_ms};
use crate::codec;
use crate::error::{Error, Result};
use crate::format::{
    self, FORMAT_VERSION, FileEntry, ObjectEntry, PartRecord, Segment, ShardEntry, TensorEntry,
};
use crate::store::Store;

impl Store {
    /// Writes `len` bytes of `src` from `offset` as the raw object `key` of a `file://` store,
    /// durably (a temporary name, fsync, rename, fsync of the directory; never through a
    /// symlink under the store's root), streaming them a block at a time with the checksum
    /// computed on the way: the bytes are read once and written once, and memory holds one
    /// block.
    fn put_local_raw(&self, key: String, src: &Src, offset: u64, len: u64) -> Result<ObjectEntry> {
        let (root, rel) = self.local_object(&key).ok_or_else(|| {
            Error::InvalidInput(format!("{} is not a local directory", self.url()))
        })?;
        let out =
            crate::local::DurableFile::create_in(&root, &rel, crate::local::RootLink::Follow)?;
        let mut blocks = format::BlockCrcs::default();
        src.read_blocks(
            offset,
            len,
            crate::local::STREAM_BLOCK_BYTES,
            |at, block| {
                blocks.push(block);
                out.write_at(block, at)
            },
        )?;
        out.commit()?;
        let (crc, block_crc32c) = blocks.finish();
        Ok(ObjectEntry {
            key,
            stored_bytes: len,
            stored_crc32c: crc,
            codec: codec::Codec::Raw,
            raw_bytes: len,
            raw_crc32c: crc,
            block_crc32c,
        })
    }

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
                    .map_err(|e| Error::task_failed("walk", e))??
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
        .map_err(|e| Error::task_failed("header", e))??;
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
                    let store = self.clone();
                    async move {
                        if !compress && self.has_local_root() {
                            let entry = tokio::task::spawn_blocking(move || {
                                let f = &files[plan.file];
                                store.put_local_raw(
                                    key,
                                    &f.src,
                                    f.data_start + plan.start,
                                    plan.len,
                                )
                            })
                            .await
                            .map_err(|e| Error::task_failed("write", e))??;
                            if let Some(p) = &progress {
                                p(entry.raw_bytes);
                            }
                            return Ok::<_, Error>((i, entry));
                        }
                        let (stored, entry) = tokio::task::spawn_blocking(move || {
                            let f = &files[plan.file];
                            let raw = f
                                .src
                                .read_at(f.data_start + plan.start, plan.len as usize)?;
                            // The block checksums and the whole one, in one pass.
                            let mut crcs = format::BlockCrcs::default();
                            crcs.push(&raw);
                            let (raw_crc32c, block_crc32c) = crcs.finish();
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
                                block_crc32c,
                            };
                            Ok::<_, Error>((Bytes::from(stored), entry))
                        })
                        .await
                        .map_err(|e| Error::task_failed("encode", e))??;
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
}
