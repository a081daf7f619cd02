//! Writing a read's output: the copies from decoded chunks into output files, each needed
//! chunk fetched once, and the files made durable and renamed into place only once complete.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use tokio_util::sync::CancellationToken;

use super::ReadOptions;
use crate::error::{Error, Result};
use crate::format::{FileEntry, Manifest};
use crate::local::{DurableFile, RootLink};
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
    /// bytes written.
    pub(crate) async fn materialize(
        &self,
        m: &Manifest,
        layout: Layout,
        dest: &Path,
        root_link: RootLink,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<()> {
        crate::local::create_dir_private(dest)?;
        // Directories made for this step, removed again (when still empty) if it fails, so a
        // failed step leaves nothing behind for a fallback to mix with.
        let mut made_dirs = Vec::new();
        let r = self
            .materialize_into(m, layout, dest, root_link, opts, cancel, &mut made_dirs)
            .await;
        if r.is_err() {
            for d in made_dirs.iter().rev() {
                let _ = std::fs::remove_dir(d);
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
    ) -> Result<()> {
        let Layout {
            files: outs,
            copies: ops,
        } = layout;
        let mut files = Vec::with_capacity(outs.len());
        for o in &outs {
            // Never through a symlink inside `dest`, and never over one.
            let f = DurableFile::create_in(dest, &o.rel, root_link)?;
            made_dirs.extend(f.created_dirs.iter().cloned());
            f.set_len(o.total_bytes)?;
            f.write_at(&o.prefix, 0)?;
            files.push(f);
        }
        let files = Arc::new(files);
        let mut by_object: BTreeMap<u32, Vec<CopyOp>> = BTreeMap::new();
        for op in ops {
            by_object.entry(op.object).or_default().push(op);
        }
        futures::stream::iter(by_object)
            .map(|(object, ops)| {
                let files = files.clone();
                async move {
                    let raw = self.fetch_decoded(m, object as usize, cancel).await?;
                    let n: u64 = ops.iter().map(|op| op.len).sum();
                    tokio::task::spawn_blocking(move || {
                        for op in ops {
                            let s = op.obj_offset as usize;
                            files[op.out].write_at(&raw[s..s + op.len as usize], op.out_offset)?;
                        }
                        Ok::<_, Error>(())
                    })
                    .await
                    .map_err(|e| Error::task_failed("write", e))??;
                    if let Some(p) = &opts.progress {
                        p(n);
                    }
                    Ok::<_, Error>(())
                }
            })
            .buffer_unordered(opts.concurrency.max(1))
            .try_collect::<Vec<()>>()
            .await?;
        let files = Arc::try_unwrap(files).map_err(|_| {
            Error::InvalidInput("output files still shared after all writes".into())
        })?;
        tokio::task::spawn_blocking(move || files.into_iter().try_for_each(DurableFile::commit))
            .await
            .map_err(|e| Error::task_failed("fsync", e))?
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
}
