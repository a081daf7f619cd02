//! Writing a read's output: the copies from decoded chunks into output files, each needed
//! chunk fetched once, and the files made durable and renamed into place only once complete.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::into_process::{IntoProcess, Output, ProcessOut};
use super::{ReadEvent, ReadOptions};
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::format::{FileEntry, Manifest, ObjectEntry};
use crate::local::{DurableFile, RootLink, STREAM_BLOCK_BYTES};
use crate::store::Store;

/// One contiguous copy from a decoded object into an output file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyOp {
    pub(crate) out: usize,
    pub(crate) object: u32,
    pub(crate) obj_offset: u64,
    pub(crate) len: u64,
    pub(crate) out_offset: u64,
}

/// One file a read writes: its name under the destination, the bytes before its data region
/// (length prefix and header) and its full size.
pub(crate) struct OutFile {
    pub(crate) rel: String,
    pub(crate) prefix: Vec<u8>,
    pub(crate) total_bytes: u64,
}

/// What a read writes: the files, and the copies from decoded objects that fill them.
#[derive(Default)]
pub(crate) struct Layout {
    pub(crate) files: Vec<OutFile>,
    pub(crate) copies: Vec<CopyOp>,
}

/// Maps `[start, start+len)` of a file's data region to object copies landing at `out_offset`.
pub(crate) fn file_range_copies(
    f: &FileEntry,
    out: usize,
    start: u64,
    len: u64,
    mut out_offset: u64,
    ops: &mut Vec<CopyOp>,
) {
    let end = start + len;
    let mut seg_start = 0u64;
    for s in &f.segments {
        let seg_end = seg_start + s.len;
        let lo = start.max(seg_start);
        let hi = end.min(seg_end);
        if lo < hi {
            ops.push(CopyOp {
                out,
                object: s.object,
                obj_offset: s.offset + (lo - seg_start),
                len: hi - lo,
                out_offset,
            });
            out_offset += hi - lo;
        }
        if seg_end >= end {
            break;
        }
        seg_start = seg_end;
    }
}

impl Store {
    /// Writes `layout`'s files under `dest` from the objects its copies name, fetching each
    /// needed object once, `concurrency` at a time, so memory holds a few decoded chunks and
    /// never a whole file or tensor. Files appear only complete (temp + rename), and none is
    /// renamed into place before every one is written, so a failed read leaves none of them
    /// behind. `root_link` says whether `dest` itself may be a symlink. Progress counts the
    /// bytes written; `opts.events` hears of the step (with `metadata`), its files and each
    /// chunk's bytes once they are checked and written, and of a failure. Returns false when
    /// no file was written: a read without copies ([`ReadOptions::no_copy`]) that pointed its
    /// events at the chunks, or a read into the reader's memory
    /// ([`ReadOptions::into_process`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn materialize(
        &self,
        m: &Manifest,
        layout: Layout,
        metadata: Option<&serde_json::Value>,
        dest: &Path,
        root_link: RootLink,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        crate::local::create_dir_private(dest)?;
        if let Some(ev) = &opts.events {
            ev(&ReadEvent::Step {
                step: m.step,
                metadata: metadata.cloned(),
            });
        }
        // Directories made for this step, removed again (when still empty) if it fails, so a
        // failed step leaves nothing behind for a fallback to mix with.
        let mut made_dirs = Vec::new();
        let r = self
            .materialize_into(m, layout, dest, root_link, opts, cancel, &mut made_dirs)
            .await;
        if let Err(e) = &r {
            for d in made_dirs.iter().rev() {
                let _ = std::fs::remove_dir(d);
            }
            // The temporary files are gone by now: `materialize_into` dropped them.
            if let Some(ev) = &opts.events {
                ev(&ReadEvent::Failed {
                    step: m.step,
                    error: format!("{e:#}"),
                });
            }
        }
        r
    }

    /// The work of [`Store::materialize`], noting every directory it makes in `made_dirs`.
    #[allow(clippy::too_many_arguments)]
    async fn materialize_into(
        &self,
        m: &Manifest,
        layout: Layout,
        dest: &Path,
        root_link: RootLink,
        opts: &ReadOptions,
        cancel: &CancellationToken,
        made_dirs: &mut Vec<PathBuf>,
    ) -> Result<bool> {
        let Layout {
            files: outs,
            copies: ops,
        } = layout;
        let mut by_object: BTreeMap<u32, Vec<CopyOp>> = BTreeMap::new();
        for op in ops {
            by_object.entry(op.object).or_default().push(op);
        }
        let point = self.can_point(m, &by_object, opts);
        let into = opts
            .into_process
            .as_ref()
            .filter(|_| !point && opts.events.is_some());
        let mut files = Vec::with_capacity(outs.len());
        let header = |o: &OutFile| {
            if let Some(ev) = &opts.events {
                ev(&ReadEvent::Header {
                    step: m.step,
                    name: o.rel.clone(),
                    bytes: o.total_bytes,
                    header: String::from_utf8_lossy(o.prefix.get(8..).unwrap_or_default())
                        .into_owned(),
                    targets: into.is_some(),
                });
            }
        };
        let process = match into {
            Some(into) => ask_targets(m.step, &outs, into, header).await?,
            None => {
                outs.iter().filter(|_| point).for_each(header);
                None
            }
        };
        let to_files = !point && process.is_none();
        for o in outs.iter().filter(|_| to_files) {
            // Never through a symlink inside `dest`, and never over one.
            let f = DurableFile::create_in(dest, &o.rel, root_link)?;
            made_dirs.extend(f.created_dirs.iter().cloned());
            f.set_len(o.total_bytes)?;
            f.write_at(&o.prefix, 0)?;
            if let Some(ev) = &opts.events {
                ev(&ReadEvent::File {
                    step: m.step,
                    name: o.rel.clone(),
                    path: f.tmp_path().to_path_buf(),
                    bytes: o.total_bytes,
                });
            }
            files.push(f);
        }
        let files = Arc::new(files);
        let output: Arc<dyn Output> = match process {
            Some(p) => Arc::new(p),
            None => files.clone(),
        };
        let outs = &outs;
        // The first failure stops the other chunks (at their next block or store call), and
        // every chunk in flight is waited for, so that no task still holds an output file when
        // this returns: a failed read leaves nothing behind.
        let abort = cancel.child_token();
        let abort = &abort;
        let mut chunks = futures::stream::iter(by_object)
            .map(|(object, ops)| {
                let output = output.clone();
                async move {
                    let n: u64 = ops.iter().map(|op| op.len).sum();
                    let ready = opts.events.as_ref().map(|_| ready_ranges(&ops));
                    let o = &m.objects[object as usize];
                    if point {
                        // Checked where it lies; the reader reads it there.
                        let (store, obj, abort) = (self.clone(), o.clone(), abort.clone());
                        let step = m.step;
                        let (ops, source) = tokio::task::spawn_blocking(move || {
                            store
                                .check_local_raw(step, &obj, &ops, &abort)
                                .map(|s| (ops, s))
                        })
                        .await
                        .map_err(|e| Error::task_failed("read", e))??;
                        if let Some(p) = &opts.progress {
                            p(n);
                        }
                        if let Some(ev) = &opts.events {
                            for (out, ranges) in source_ranges(&ops) {
                                ev(&ReadEvent::Source {
                                    step: m.step,
                                    name: outs[out].rel.clone(),
                                    path: source.path.clone(),
                                    bytes: o.stored_bytes,
                                    dev: source.dev,
                                    ino: source.ino,
                                    ctime_ns: source.ctime_ns,
                                    ranges,
                                });
                            }
                        }
                        return Ok(());
                    }
                    if let Some(runs) = super::ranged::needed_blocks(o, &ops) {
                        // Part of a raw chunk: only the blocks that hold it, each checked.
                        let stop = abort.clone();
                        let (key, url) = (o.key.clone(), self.url().to_string());
                        self.read_blocks(m, object as usize, runs, abort, move |at, b| {
                            if stop.is_cancelled() {
                                return Err(Error::Cancelled {
                                    op: format!("get {key} on {url}"),
                                });
                            }
                            write_block(&ops, &*output, at, b)
                        })
                        .await?;
                    } else if o.codec == Codec::Raw && self.has_local_root() {
                        let (store, o, abort) = (self.clone(), o.clone(), abort.clone());
                        let step = m.step;
                        tokio::task::spawn_blocking(move || {
                            store.stream_local_raw(step, &o, &ops, &*output, &abort)
                        })
                        .await
                        .map_err(|e| Error::task_failed("read", e))??;
                    } else {
                        // Decoded as it arrives, each block written where `ops` put it; a
                        // failure elsewhere stops it at the next block.
                        let (stop, key) = (abort.clone(), o.key.clone());
                        let url = self.url().to_string();
                        self.read_object(m, object as usize, false, abort, move |at, b| {
                            if stop.is_cancelled() {
                                return Err(Error::Cancelled {
                                    op: format!("get {key} on {url}"),
                                });
                            }
                            write_block(&ops, &*output, at, b)
                        })
                        .await?;
                    }
                    if let Some(p) = &opts.progress {
                        p(n);
                    }
                    if let (Some(ev), Some(ready)) = (&opts.events, ready) {
                        for (out, ranges) in ready {
                            ev(&ReadEvent::Ready {
                                step: m.step,
                                name: outs[out].rel.clone(),
                                ranges,
                            });
                        }
                    }
                    Ok::<_, Error>(())
                }
            })
            .buffer_unordered(opts.concurrency.max(1));
        let mut failed = None;
        while let Some(r) = chunks.next().await {
            // The first error is the one returned; the chunks it stops fail as cancelled,
            // which says nothing new.
            if let Err(e) = r
                && failed.is_none()
            {
                abort.cancel();
                failed = Some(e);
            }
        }
        drop(chunks);
        drop(output);
        if let Some(e) = failed {
            return Err(e);
        }
        if !to_files {
            return Ok(false);
        }
        let files = Arc::try_unwrap(files).map_err(|_| {
            Error::InvalidInput("output files still shared after all writes".into())
        })?;
        let sync = opts.sync;
        tokio::task::spawn_blocking(move || files.into_iter().try_for_each(|f| f.commit_as(sync)))
            .await
            .map_err(|e| Error::task_failed("fsync", e))??;
        Ok(true)
    }

    /// Whether a read of the objects `by_object` goes without copies: asked for
    /// ([`ReadOptions::no_copy`], with events to say where the bytes are), on a local
    /// directory whose paths the events can carry (UTF-8), and every object raw.
    fn can_point(
        &self,
        m: &Manifest,
        by_object: &BTreeMap<u32, Vec<CopyOp>>,
        opts: &ReadOptions,
    ) -> bool {
        opts.no_copy
            && opts.events.is_some()
            && self.local_root().is_some_and(|p| p.to_str().is_some())
            && by_object.keys().all(|&i| {
                m.objects
                    .get(i as usize)
                    .is_some_and(|o| o.codec == Codec::Raw)
            })
    }
}

/// A chunk file checked where it lies, as it was when checked: a reader that finds the same
/// device, inode, length and change time reads the bytes that were checked: a rename puts
/// another inode there, and a write in place moves the change time, which no caller can set
/// back. (The kernel may keep the change time at a clock tick's grain, a few milliseconds: a
/// write in the same tick as the file's previous change, or through a writable mapping made
/// before the check, can go unseen.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CheckedFile {
    pub path: PathBuf,
    pub dev: u64,
    pub ino: u64,
    pub bytes: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

impl CheckedFile {
    fn of(path: PathBuf, st: &std::fs::Metadata) -> CheckedFile {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        CheckedFile {
            path,
            dev: st.dev(),
            ino: st.ino(),
            bytes: st.len(),
            mtime_ns: ns(st.mtime(), st.mtime_nsec()),
            ctime_ns: ns(st.ctime(), st.ctime_nsec()),
        }
    }
}

/// The output ranges `[offset, length]` that `ops` fill, by output file, in order, with
/// ranges that meet joined.
fn ready_ranges(ops: &[CopyOp]) -> BTreeMap<usize, Vec<[u64; 2]>> {
    source_ranges(ops)
        .into_iter()
        .map(|(out, ranges)| {
            let mut joined: Vec<[u64; 2]> = Vec::with_capacity(ranges.len());
            for [at, len, _] in ranges {
                match joined.last_mut() {
                    Some(last) if last[0] + last[1] == at => last[1] += len,
                    _ => joined.push([at, len]),
                }
            }
            (out, joined)
        })
        .collect()
}

/// What `ops` take of one object, by output file: `[offset in the output, length, offset in
/// the object]`, in order, with ranges that meet on both sides joined.
fn source_ranges(ops: &[CopyOp]) -> BTreeMap<usize, Vec<[u64; 3]>> {
    let mut by_out: BTreeMap<usize, Vec<[u64; 3]>> = BTreeMap::new();
    for op in ops.iter().filter(|op| op.len > 0) {
        by_out
            .entry(op.out)
            .or_default()
            .push([op.out_offset, op.len, op.obj_offset]);
    }
    for ranges in by_out.values_mut() {
        ranges.sort_unstable();
        let mut joined: Vec<[u64; 3]> = Vec::with_capacity(ranges.len());
        for &[at, len, from] in ranges.iter() {
            match joined.last_mut() {
                Some(last) if last[0] + last[1] == at && last[2] + last[1] == from => {
                    last[1] += len
                }
                _ => joined.push([at, len, from]),
            }
        }
        *ranges = joined;
    }
    by_out
}

/// Sends each of `outs`'s header (`header`) and asks the reader where that output goes in
/// its memory, one output at a time (so neither side waits on a full pipe). None when it
/// answers for one of them that it wants files, when the reader that answers is not the
/// process this one writes into (a wrapper stands between them), or when this process may
/// not write into it (the system denies it): the outputs are then written as files. Every
/// output is asked about, so the reader's answers are all read whatever the outcome.
async fn ask_targets(
    step: u64,
    outs: &[OutFile],
    into: &IntoProcess,
    header: impl Fn(&OutFile),
) -> Result<Option<ProcessOut>> {
    let mut answers = Vec::with_capacity(outs.len());
    let mut all = true;
    for o in outs {
        header(o);
        let (targets, name) = (into.targets.clone(), o.rel.clone());
        let answer = tokio::task::spawn_blocking(move || targets(step, &name))
            .await
            .map_err(|e| Error::task_failed("read the reader's targets", e))??;
        match answer {
            Some(t) if t.pid == into.pid() => answers.push((
                o.rel.clone(),
                t.ranges,
                [o.prefix.len() as u64, o.total_bytes],
            )),
            Some(t) => {
                tracing::warn!(
                    reader = t.pid,
                    parent = into.pid(),
                    "the reader is not this process's parent (a wrapper between them?); writing the state to a file instead"
                );
                all = false;
            }
            None => all = false,
        }
    }
    if !all {
        return Ok(None);
    }
    let p = ProcessOut::new(into, answers)?;
    Ok(p.probe()?.then_some(p))
}

/// Writes what `ops` take of the object bytes `block`, which start at `pos` in the object.
fn write_block(ops: &[CopyOp], out: &dyn Output, pos: u64, block: &[u8]) -> Result<()> {
    let end = pos + block.len() as u64;
    for op in ops {
        let (a, b) = (op.obj_offset.max(pos), (op.obj_offset + op.len).min(end));
        if a < b {
            out.write_at(
                op.out,
                &block[(a - pos) as usize..(b - pos) as usize],
                op.out_offset + (a - op.obj_offset),
            )?;
        }
    }
    Ok(())
}

impl Store {
    /// Copies what `ops` take of raw object `o` of a `file://` store straight from its file
    /// into the outputs; see [`Store::copy_local_raw`].
    fn stream_local_raw(
        &self,
        step: u64,
        o: &ObjectEntry,
        ops: &[CopyOp],
        out: &dyn Output,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let f = self.open_local_raw(step, o)?;
        self.copy_local_raw(step, o, &f, ops, out, cancel)?;
        self.count_read(o.stored_bytes);
        Ok(())
    }

    /// Checks what `ops` take of raw object `o` of a `file://` store where it lies, without
    /// copying it: the blocks that hold it ([`super::ranged::needed_blocks`]), or the whole
    /// object. Returns the file as checked: its identity is taken before and after the
    /// check and must not change between, so a file rewritten while it was checked is an
    /// error, and a reader that finds the same identity later reads what was checked.
    fn check_local_raw(
        &self,
        step: u64,
        o: &ObjectEntry,
        ops: &[CopyOp],
        cancel: &CancellationToken,
    ) -> Result<CheckedFile> {
        let path = self.local_file(&o.key).ok_or_else(|| {
            Error::InvalidInput(format!("{} is not a local directory", self.url()))
        })?;
        let f = self.open_local_raw(step, o)?;
        let identity = |f: &std::fs::File| {
            f.metadata()
                .map(|st| CheckedFile::of(path.clone(), &st))
                .map_err(|e| self.local_error("get", &o.key, e))
        };
        let before = identity(&f)?;
        match super::ranged::needed_blocks(o, ops) {
            Some(runs) => self.check_local_blocks(step, o, &f, &runs, cancel)?,
            None => {
                self.copy_local_raw(step, o, &f, &[], &Vec::<DurableFile>::new(), cancel)?;
                self.count_read(o.stored_bytes);
            }
        }
        if identity(&f)? != before {
            return Err(self.corrupt(step, &o.key, "the file changed while it was checked".into()));
        }
        Ok(before)
    }

    /// Opens the file of raw object `o` of a `file://` store (a regular file only: never
    /// through a symlink, never a FIFO) and checks its length against the manifest.
    pub(super) fn open_local_raw(&self, step: u64, o: &ObjectEntry) -> Result<std::fs::File> {
        let path = self.local_file(&o.key).ok_or_else(|| {
            Error::InvalidInput(format!("{} is not a local directory", self.url()))
        })?;
        let f =
            crate::local::open_regular(&path).map_err(|e| self.local_error("get", &o.key, e))?;
        let size = f
            .metadata()
            .map_err(|e| self.local_error("get", &o.key, e))?
            .len();
        if size != o.stored_bytes {
            return Err(self.truncated(step, o, size));
        }
        Ok(f)
    }

    /// Fills `buf` from byte `pos` of the open file `f` of object `o`; a file that ends early
    /// is named as truncated, with its length now.
    pub(super) fn read_local_at(
        &self,
        step: u64,
        o: &ObjectEntry,
        f: &std::fs::File,
        buf: &mut [u8],
        pos: u64,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;

        f.read_exact_at(buf, pos).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                self.truncated(step, o, f.metadata().map_or(pos, |m| m.len()))
            } else {
                self.local_error("get", &o.key, e)
            }
        })
    }

    /// Streams raw object `o` from its open file `f` into the outputs `out` as `ops` say:
    /// [`STREAM_BLOCK_BYTES`] at a time, each block read, added to the checksum and written out
    /// while it is still in the core's cache, so the bytes are touched once and memory holds
    /// one block. The whole object is read (the checksum covers all of it) even when `ops`
    /// take only part. The checksum is checked at the end, and a file that ends early is named
    /// as truncated: until then the bytes lie only in the output files' temporary names,
    /// which a failed read never renames into place.
    fn copy_local_raw(
        &self,
        step: u64,
        o: &ObjectEntry,
        f: &std::fs::File,
        ops: &[CopyOp],
        out: &dyn Output,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let block_bytes = usize::try_from(o.stored_bytes)
            .unwrap_or(usize::MAX)
            .clamp(1, STREAM_BLOCK_BYTES);
        let mut buf = vec![0u8; block_bytes];
        // The whole object's checksum and its block checksums, in one pass.
        let mut crcs = crate::format::BlockCrcs::default();
        let mut pos = 0u64;
        while pos < o.stored_bytes {
            if cancel.is_cancelled() {
                return Err(Error::Cancelled {
                    op: format!("get {} on {}", o.key, self.url()),
                });
            }
            let n = (o.stored_bytes - pos).min(buf.len() as u64);
            let block = &mut buf[..n as usize];
            self.read_local_at(step, o, f, block, pos)?;
            crcs.push(block);
            write_block(ops, out, pos, block)?;
            pos += n;
        }
        let (crc, blocks) = crcs.finish();
        if crc != o.stored_crc32c {
            return Err(self.corrupt(
                step,
                &o.key,
                format!("crc32c {crc:08x}, manifest says {:08x}", o.stored_crc32c),
            ));
        }
        super::read::check_block_crcs(self, step, o, &blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format;

    #[test]
    fn file_ranges_map_across_segment_boundaries() {
        let f = FileEntry {
            name: "f".into(),
            header: String::new(),
            data_bytes: 30,
            segments: vec![
                format::Segment {
                    object: 0,
                    offset: 5,
                    len: 10,
                },
                format::Segment {
                    object: 1,
                    offset: 0,
                    len: 20,
                },
            ],
        };
        let mut ops = Vec::new();
        file_range_copies(&f, 0, 8, 10, 100, &mut ops);
        assert_eq!(ops.len(), 2);
        assert_eq!(
            (
                ops[0].object,
                ops[0].obj_offset,
                ops[0].len,
                ops[0].out_offset
            ),
            (0, 13, 2, 100)
        );
        assert_eq!(
            (
                ops[1].object,
                ops[1].obj_offset,
                ops[1].len,
                ops[1].out_offset
            ),
            (1, 0, 8, 102)
        );
    }

    /// A chunk cut shorter after it was opened (and its length checked) meets its end while
    /// streaming: named as truncated with its new length, never read short, and nothing of
    /// it lands in place.
    #[tokio::test]
    async fn a_local_chunk_cut_while_it_streams_is_named_truncated() {
        use crate::save::{PartInput, PartSource, SaveOptions};

        let root = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("file://{}", root.path().display())).unwrap();
        let data: Vec<u8> = (0..(3 * STREAM_BLOCK_BYTES + 77) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut file = Vec::new();
        let header = format!(
            r#"{{"t":{{"dtype":"U8","shape":[{}],"data_offsets":[0,{}]}}}}"#,
            data.len(),
            data.len()
        );
        file.extend_from_slice(&(header.len() as u64).to_le_bytes());
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&data);
        let cancel = CancellationToken::new();
        let opts = SaveOptions {
            compress: false,
            ..Default::default()
        };
        let input = PartInput {
            writer: "w".into(),
            source: PartSource::Buffers(vec![("f.safetensors".into(), file.into())]),
            shards: Default::default(),
        };
        store.save_part(4, input, &opts, &cancel).await.unwrap();
        let req = crate::save::CommitRequest {
            world_size: 1,
            writers: vec!["w".into()],
            metadata: serde_json::Value::Null,
        };
        store.commit(4, req, &cancel).await.unwrap();
        let m = store.read_manifest(4, &cancel).await.unwrap();
        let o = &m.objects[0];
        assert_eq!(o.codec, Codec::Raw);
        let f = store.open_local_raw(4, o).unwrap();
        // Cut inside the third block.
        let cut = 2 * STREAM_BLOCK_BYTES as u64 + 1000;
        std::fs::OpenOptions::new()
            .write(true)
            .open(store.local_file(&o.key).unwrap())
            .unwrap()
            .set_len(cut)
            .unwrap();
        let out_dir = tempfile::tempdir().unwrap();
        let out = DurableFile::create_in(out_dir.path(), "out", RootLink::Refuse).unwrap();
        out.set_len(o.stored_bytes).unwrap();
        let ops = [CopyOp {
            out: 0,
            object: 0,
            obj_offset: 0,
            len: o.stored_bytes,
            out_offset: 0,
        }];
        let outs = vec![out];
        let err = store
            .copy_local_raw(4, o, &f, &ops, &outs, &cancel)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Corrupt { step: 4, reason, .. }
                if reason.contains(&format!("truncated or extended: {cut} bytes"))),
            "{err}"
        );
        drop(outs);
        assert_eq!(std::fs::read_dir(out_dir.path()).unwrap().count(), 0);
    }
}
