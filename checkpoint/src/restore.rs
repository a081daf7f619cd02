//! Listing, verification, resharded restore and byte-identical pull.
//!
//! - `steps` (private): which steps exist and which one to read ([`Store::latest_committed`],
//!   the fallback past a step that does not verify).
//! - `read` (private): fetching a chunk and checking its checksums ([`Store::verify`]).
//! - `write` (private): laying the fetched bytes out in the output files, which appear only
//!   complete.
//! - Here: [`Store::pull`] and [`Store::restore`], which plan what each output file holds.
//!
//! Reads are per chunk: a rank fetches only the chunks that hold bytes it needs, several at a time
//! (`concurrency`). A chunk on a remote store comes as one GET whose body is decoded as it arrives
//! (a body that breaks off is resumed from where it stopped). A chunk of which a rank needs only
//! part (a slice of row-sharded state re-cut for another world size) is read only in the blocks
//! of 256 KiB of decoded bytes that hold that part (`ranged`: one ranged GET per run of blocks,
//! or `pread`s): a raw chunk's blocks as they are, a `zstd-blocks` chunk's each from its own
//! stored bytes, decoded alone. Each block is checked against its own checksum
//! (`block_crc32c`) before a byte of it is written. A chunk written by format 1, or compressed
//! by format 2 (`zstd`, `zstd-planes`), is read whole. No decoded chunk is assembled in memory:
//! its bytes go into the output a block of 256 KiB at a time, each block checksummed on the way
//! while still in cache, and every chunk's length and stored and decoded checksums are checked
//! before the output that holds its bytes is renamed into place. A raw chunk on a local
//! directory streams from its file, so it is read once, written once and never held. A raw,
//! `zstd-blocks` or `zstd` chunk from a remote store is never held either: at most 16 pieces of
//! its body (as the HTTP client hands them over) and one block wait for its decoder. A
//! `zstd-planes` chunk holds its planes (the size of the chunk) until the last one is in. Memory
//! is bounded by `concurrency × (largest chunk + 16 pieces)` for byte-plane chunks of format 2,
//! `concurrency × (16 pieces + 3 blocks)` for other remote chunks, and `concurrency × 256 KiB`
//! for raw chunks on a local directory; a compressed chunk on a local directory is read whole
//! first.

mod into_process;
mod ranged;
mod read;
mod steps;
mod write;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::header::{self, HeaderTensor};
use crate::local::{RootLink, write_file_durable};
use crate::save::Progress;
use crate::store::Store;
pub(crate) use write::{Layout, OutFile, file_range_copies};

pub use crate::local::check_fresh_dir;
pub use into_process::{
    IntoProcess, ReaderTargets, TARGETS_LINE_BYTES_MAX, TARGETS_MAX, Target, Targets,
    check_targets, parse_targets,
};
pub use read::VerifyReport;
pub use steps::{StepInfo, StepSummary};

/// The file a restore writes for its rank, in the destination directory.
pub const RESTORE_FILE: &str = "state.safetensors";
/// The trainer metadata a restore writes next to it (with `step`, `rank`, `world_size`).
pub const RESTORE_METADATA_FILE: &str = "metadata.json";

/// Tunables for reads.
#[derive(Clone)]
pub struct ReadOptions {
    /// Chunks fetched at once.
    pub concurrency: usize,
    pub progress: Option<Progress>,
    /// Told what is ready as the read goes ([`ReadEvent`]).
    pub events: Option<ReadEvents>,
    /// Whether the output files are fsynced before they are renamed into place (true by
    /// default). False for output that is read once and removed, which a crash may lose.
    pub sync: bool,
    /// With `events`, on a local directory: when every chunk a step needs is raw, none is
    /// copied. Each is read and checked where it lies, and a [`ReadEvent::Source`] names the
    /// chunk's file for the reader to read the bytes from; the step's output files are not
    /// written (a [`ReadEvent::Header`] gives each one's header instead). Otherwise (a
    /// compressed chunk, a remote store) the step is written as usual.
    pub no_copy: bool,
    /// With `events`, for a step not read without copies: write the outputs into the
    /// reader's memory, where it says ([`IntoProcess`]), instead of into files. Each output's
    /// [`ReadEvent::Header`] (with `targets: true`) asks the reader for its targets; a reader
    /// that answers none, or that this process may not write into, gets the files.
    pub into_process: Option<IntoProcess>,
}

impl ReadOptions {
    /// These options without [`ReadOptions::no_copy`] and [`ReadOptions::into_process`], for
    /// a read that writes its files always (a pull, an export): only a restore may leave them
    /// unwritten.
    pub(crate) fn writing_files(&self) -> ReadOptions {
        ReadOptions {
            no_copy: false,
            into_process: None,
            ..self.clone()
        }
    }
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            concurrency: 8,
            progress: None,
            events: None,
            sync: true,
            no_copy: false,
            into_process: None,
        }
    }
}

/// What a read reports while it runs, for a reader that uses the output before the read ends
/// (`elastic-ckpt restore --events`, which `elastic_run.load_from` reads). A step's events
/// come in this order: `Step`, one `File` for each output, then `Ready`s, as chunks come in;
/// and `Failed` if the step's read fails. A step read without copies
/// ([`ReadOptions::no_copy`]) has a `Header` for each output instead of its `File`, and
/// `Source`s instead of `Ready`s. A step read into the reader's memory
/// ([`ReadOptions::into_process`]) has a `Header` (asking for targets) for each output, and
/// then either `Ready`s (the ranges are in the reader's memory) or, when it is written as
/// files after all, `File`s and `Ready`s. A restore that falls back then starts again with the
/// older step's `Step`. Only a read that ends without error has delivered the step: what
/// was ready of a failed step is to be dropped, whatever was read of it.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ReadEvent {
    /// A step's read begins. For a restore, `metadata` is the JSON that its
    /// `metadata.json` will hold.
    Step {
        step: u64,
        metadata: Option<serde_json::Value>,
    },
    /// Output `name` exists under its temporary name `path`, at its full length of `bytes`,
    /// with its length prefix and header written: it can be opened and its header read.
    File {
        step: u64,
        name: String,
        path: PathBuf,
        bytes: u64,
    },
    /// Byte ranges `[offset, length]` of output `name` are written, and every checksum over
    /// the chunks they came from was checked.
    Ready {
        step: u64,
        name: String,
        ranges: Vec<[u64; 2]>,
    },
    /// Output `name` is not written ([`ReadOptions::no_copy`]): it would be `bytes` long, and
    /// begin with the 8-byte little-endian length of `header` and then `header`, a
    /// safetensors JSON header. Its data comes in `Source` events, or, with `targets`
    /// ([`ReadOptions::into_process`]), the reader is to answer where in its memory each
    /// range goes, and its data comes in `Ready` events once there.
    Header {
        step: u64,
        name: String,
        bytes: u64,
        header: String,
        targets: bool,
    },
    /// Byte ranges of output `name` are the bytes of the file `path` (a chunk of a local
    /// directory: `bytes` long, device `dev`, inode `ino` and inode change time `ctime_ns`,
    /// in nanoseconds since the epoch, before and after it was checked) at
    /// `[offset in the output, length, offset in path]`: every checksum over them was checked
    /// there. A reader opens `path` without following a symlink and reads there only while
    /// it is still that file, unchanged.
    Source {
        step: u64,
        name: String,
        path: PathBuf,
        bytes: u64,
        dev: u64,
        ino: u64,
        ctime_ns: i64,
        ranges: Vec<[u64; 3]>,
    },
    /// The step's read failed: its temporary outputs are gone.
    Failed { step: u64, error: String },
}

/// Receives a read's [`ReadEvent`]s, from any of its threads.
pub type ReadEvents = Arc<dyn Fn(&ReadEvent) + Send + Sync>;

/// What a restore wrote.
#[derive(Debug, Clone, Serialize)]
pub struct RestoreReport {
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    /// `<dest>/state.safetensors`, unless `written` is false.
    pub path: PathBuf,
    /// False when a read without copies ([`ReadOptions::no_copy`]) wrote no state file (its
    /// bytes lie in the store's chunks, where its events named them), or a read into the
    /// reader's memory ([`ReadOptions::into_process`]) wrote them there.
    pub written: bool,
    /// `<dest>/metadata.json`: step, rank, world sizes and the trainer metadata.
    pub metadata_path: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
    /// Newer committed steps that were skipped because they did not verify.
    pub skipped_steps: Vec<u64>,
    pub metadata: serde_json::Value,
}

/// Which objects of a step a restore checks the presence of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    /// Those it reads (by reading them): a step asked for by number.
    Read,
    /// All of them: the newest step that restores, which every rank must agree on.
    Whole,
}

/// Rows `[lo, hi)` of dim 0 that `rank` of `world` gets of a tensor with `rows` rows: PyTorch's
/// `Shard(0)` rule (what DTensor and FSDP2 give each rank), chunks of `ceil(rows / world)` rows
/// in rank order, so `[min(rank * c, rows), min((rank + 1) * c, rows))`. The last ranks may get
/// fewer rows, or none. `world` must be at least 1.
pub fn rows_for_rank(rows: u64, rank: u32, world: u32) -> (u64, u64) {
    let chunk = u128::from(rows.div_ceil(u64::from(world)));
    let at = |r: u32| (chunk * u128::from(r)).min(u128::from(rows)) as u64;
    (at(rank), at(rank + 1))
}

impl Store {
    /// [`Store::pull`] of the newest committed step that pulls whole: a step whose manifest
    /// is invalid or one of whose objects is missing or fails its checksum is skipped (with a
    /// warning) for the previous one. Nothing of a skipped step is left under `dest` (files
    /// appear only once all of a step's bytes were read and checked). Returns the manifest
    /// pulled and the steps skipped, newest first.
    pub async fn pull_newest(
        &self,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<(Manifest, Vec<u64>)> {
        self.newest_committed_that("pull", cancel, |step| self.pull(step, dest, opts, cancel))
            .await
    }

    /// Writes every file of a step under `dest`, byte-identical to what was pushed.
    pub async fn pull(
        &self,
        step: u64,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<Manifest> {
        let m = self.read_manifest(step, cancel).await?;
        let mut layout = Layout::default();
        for (i, f) in m.files.iter().enumerate() {
            let mut prefix = (f.header.len() as u64).to_le_bytes().to_vec();
            prefix.extend_from_slice(f.header.as_bytes());
            let data_start = prefix.len() as u64;
            file_range_copies(f, i, 0, f.data_bytes, data_start, &mut layout.copies);
            layout.files.push(OutFile {
                rel: f.name.clone(),
                total_bytes: data_start + f.data_bytes,
                prefix,
            });
        }
        let opts = &opts.writing_files();
        self.materialize(&m, layout, None, dest, RootLink::Follow, opts, cancel)
            .await?;
        Ok(m)
    }

    /// Restores what `rank` of `world` needs from `step` into `dest/state.safetensors` (and
    /// `dest/metadata.json`): every replicated tensor whole, and rows [`rows_for_rank`] of every
    /// sharded tensor (possibly none), re-cut from however many shards it was saved as. Shards
    /// are declared again in the output's `__metadata__["elastic.shards"]`, so saving the
    /// restored file keeps them sharded.
    ///
    /// With `step == None`, takes the newest committed step that restores, and falls back to
    /// older ones (with a warning naming the step and the reason) when it is corrupt or
    /// incomplete.
    pub async fn restore(
        &self,
        step: Option<u64>,
        rank: u32,
        world: u32,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidInput(format!(
                "rank {rank} is not in a world of {world}"
            )));
        }
        if let Some(step) = step {
            return self
                .restore_step(step, rank, world, dest, opts, cancel)
                .await;
        }
        let (mut report, skipped) = self
            .newest_committed_that("restore", cancel, |step| async move {
                let m = self.read_manifest(step, cancel).await?;
                self.restore_manifest(&m, Presence::Whole, rank, world, dest, opts, cancel)
                    .await
            })
            .await?;
        report.skipped_steps = skipped;
        Ok(report)
    }

    async fn restore_step(
        &self,
        step: u64,
        rank: u32,
        world: u32,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport> {
        let m = self.read_manifest(step, cancel).await?;
        self.restore_manifest(&m, Presence::Read, rank, world, dest, opts, cancel)
            .await
    }

    /// [`Store::restore_step`] of the step manifest `m` describes, checking the presence of
    /// its objects as `presence` says.
    #[allow(clippy::too_many_arguments)]
    async fn restore_manifest(
        &self,
        m: &Manifest,
        presence: Presence,
        rank: u32,
        world: u32,
        dest: &Path,
        opts: &ReadOptions,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport> {
        let step = m.step;
        let mut out_tensors = Vec::new();
        let mut ops = Vec::new();
        let mut shards_md = serde_json::Map::new();
        let mut offset = 0u64;
        for t in &m.tensors {
            let (shape, pieces): (Vec<u64>, Vec<(u32, u64, u64)>) = if !t.sharded {
                let s = &t.shards[0];
                (
                    t.shape.clone(),
                    vec![(
                        s.file,
                        s.data_offsets[0],
                        s.data_offsets[1] - s.data_offsets[0],
                    )],
                )
            } else {
                let (lo, hi) = rows_for_rank(t.shape[0], rank, world);
                let mut row_shape = t.shape.clone();
                row_shape[0] = 1;
                let row_bytes = header::tensor_bytes(&t.name, &t.dtype, &row_shape)
                    .map_err(Error::InvalidInput)?;
                let mut pieces = Vec::new();
                for s in &t.shards {
                    let s_lo = s.dim0_offset;
                    let s_hi = s_lo + s.shape[0];
                    let (a, b) = (lo.max(s_lo), hi.min(s_hi));
                    if a < b {
                        pieces.push((
                            s.file,
                            s.data_offsets[0] + (a - s_lo) * row_bytes,
                            (b - a) * row_bytes,
                        ));
                    }
                }
                let mut shape = t.shape.clone();
                shape[0] = hi - lo;
                shards_md.insert(
                    t.name.clone(),
                    serde_json::json!({"global_shape": t.shape, "dim0_offset": lo}),
                );
                (shape, pieces)
            };
            let bytes: u64 = pieces.iter().map(|p| p.2).sum();
            out_tensors.push((
                HeaderTensor {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                    shape,
                    data_offsets: [offset, offset + bytes],
                },
                pieces,
            ));
            offset += bytes;
        }
        let mut md = BTreeMap::new();
        md.insert("elastic.step".to_string(), step.to_string());
        md.insert("elastic.rank".to_string(), rank.to_string());
        md.insert("elastic.world_size".to_string(), world.to_string());
        if !shards_md.is_empty() {
            md.insert(
                format::SHARDS_METADATA_KEY.to_string(),
                serde_json::Value::Object(shards_md).to_string(),
            );
        }
        let tensors: Vec<HeaderTensor> = out_tensors.iter().map(|(t, _)| t.clone()).collect();
        let prefix = header::write_header(&tensors, &md);
        let data_start = prefix.len() as u64;
        for (t, pieces) in &out_tensors {
            let mut at = data_start + t.data_offsets[0];
            for &(file, start, len) in pieces {
                file_range_copies(&m.files[file as usize], 0, start, len, at, &mut ops);
                at += len;
            }
        }
        if presence == Presence::Whole {
            // Every rank checks the whole step's presence, not only its own chunks, so that
            // ranks that need different chunks still agree on a step that lost an object. On
            // a remote store, where a HEAD is a request, the objects this rank reads are
            // checked by their read instead (a GET that finds no object, or one of another
            // length, fails the step as a HEAD would, before its bytes count); only the others
            // are checked, by a HEAD or, when there are several, one listing of the step's
            // data, which a rank that reads every chunk (a replicated step) skips. On a local
            // directory a HEAD is a stat: every object gets one, so that a lost or cut chunk is
            // found before anything of the step is read.
            let read: std::collections::BTreeSet<u32> = ops.iter().map(|op| op.object).collect();
            let all = self.has_local_root();
            self.check_objects_present_where(m, |i| all || !read.contains(&(i as u32)), cancel)
                .await?;
        }
        let layout = Layout {
            files: vec![OutFile {
                rel: RESTORE_FILE.to_string(),
                total_bytes: data_start + offset,
                prefix,
            }],
            copies: ops,
        };
        let meta = serde_json::json!({
            "step": step, "rank": rank, "world_size": world,
            "saved_world_size": m.world_size, "metadata": m.metadata,
        });
        let written = self
            .materialize(m, layout, Some(&meta), dest, RootLink::Follow, opts, cancel)
            .await?;
        let meta_path = dest.join(RESTORE_METADATA_FILE);
        let meta_bytes = serde_json::to_vec_pretty(&meta).expect("json");
        tokio::task::spawn_blocking(move || write_file_durable(&meta_path, &meta_bytes))
            .await
            .map_err(|e| Error::task_failed("write", e))??;
        tracing::info!(step, rank, world, bytes = offset, "restored");
        Ok(RestoreReport {
            step,
            rank,
            world_size: world,
            path: dest.join(RESTORE_FILE),
            metadata_path: dest.join(RESTORE_METADATA_FILE),
            written,
            tensors: out_tensors.len(),
            bytes: offset,
            skipped_steps: Vec::new(),
            metadata: m.metadata.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_for_rank_tiles_every_world_size() {
        for rows in [0u64, 1, 2, 5, 7, 37, 64, 1001] {
            for world in [1u32, 2, 3, 4, 8, 13] {
                let chunk = rows.div_ceil(u64::from(world));
                let mut next = 0;
                for r in 0..world {
                    let (lo, hi) = rows_for_rank(rows, r, world);
                    assert_eq!(lo, next, "rows {rows} world {world} rank {r}");
                    assert!(hi >= lo && hi - lo <= chunk);
                    next = hi;
                }
                assert_eq!(next, rows);
            }
        }
    }

    /// Local dim-0 sizes PyTorch's `Shard(0)` gives each rank (from
    /// `Shard.local_shard_size_and_offset` in torch 2.13): a restore hands every rank of an
    /// FSDP2 model exactly the rows of its own DTensor shards.
    #[test]
    fn rows_for_rank_gives_torchs_shard_sizes() {
        let table: &[(u64, &[u64])] = &[
            (0, &[0, 0]),
            (1, &[1, 0, 0]),
            (2, &[1, 1, 0, 0]),
            (5, &[3, 2]),
            (5, &[2, 2, 1]),
            (5, &[2, 2, 1, 0]),
            (5, &[1, 1, 1, 1, 1, 0, 0, 0]),
            (7, &[2, 2, 2, 1]),
            (9, &[3, 3, 3, 0]),
            (10, &[4, 4, 2]),
            (10, &[2, 2, 2, 2, 2, 0, 0, 0]),
            (29, &[8, 8, 8, 5]),
            (37, &[19, 18]),
            (37, &[13, 13, 11]),
            (37, &[10, 10, 10, 7]),
        ];
        for (rows, sizes) in table {
            let world = sizes.len() as u32;
            let got: Vec<u64> = (0..world)
                .map(|r| {
                    let (lo, hi) = rows_for_rank(*rows, r, world);
                    hi - lo
                })
                .collect();
            assert_eq!(&got, sizes, "rows {rows} over {world} ranks");
        }
    }

    #[test]
    fn rows_for_rank_does_not_overflow_at_the_largest_sizes() {
        assert_eq!(rows_for_rank(u64::MAX, u32::MAX - 1, u32::MAX).1, u64::MAX);
        assert_eq!(rows_for_rank(3, u32::MAX - 1, u32::MAX), (3, 3));
    }
}
