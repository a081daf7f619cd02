//! The restore side of the sink.
//!
//! # Restoring
//!
//! ```text
//! <restore_root>/step-<N>/rank-<R>/state.safetensors   what rank R needs (DDP: every tensor),
//!                                                      or, restored without copies,
//! <restore_root>/step-<N>/rank-<R>/sources.json        where its bytes lie in the store's
//!                                                      chunks (`sources`)
//! <restore_root>/step-<N>/rank-<R>/metadata.json       the checkpoint crate's restore metadata:
//!                                                      step, rank, world_size, saved_world_size,
//!                                                      metadata {"elastic", "state"}
//! <restore_root>/step-<N>/restored.json                which ranks are complete (written after each)
//! ```
//!
//! Local bytes come first. A step without sharded tensors gives every rank the same bytes: it
//! is read from the store once per node and hard-linked for the other ranks (each gets its own
//! `metadata.json` with its rank and world size), and reused as it is by later generations at
//! any world size. Steps with sharded tensors are restored per rank and reused only for the
//! same world size. A rank directory appears by rename of a finished temporary one, and
//! `restored.json` lists only finished ranks, so a crash never leaves a half restore that
//! looks complete. Only the step restored last is kept (restores live in `/dev/shm`, memory).

use std::collections::BTreeSet;
use std::ops::Range;
use std::path::Path;

use checkpoint::CancellationToken;
use checkpoint::restore::{RESTORE_FILE, RESTORE_METADATA_FILE};
use tokio::time::Instant;
use tracing::Instrument;

use crate::worker_env::ResumePoint;
use worker::protocol::RESTORED_SOURCES;

use super::sink::*;
use super::sources::rank_tensors_present;

impl StoreSink {
    /// Restores `step` for this node's `ranks` of a `world_size` world into
    /// `restore_root/step-N/rank-R/` and returns `ResumePoint { step, dir: restore_root/step-N }`;
    /// see the module docs for what is reused.
    pub async fn restore(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<ResumePoint, SinkError> {
        let span = tracing::info_span!("restore", step, world = world_size);
        self.restore_inner(step, ranks, world_size, cancel)
            .instrument(span)
            .await
    }

    /// [`StoreSink::restore`] of `step`, or, when that step does not verify (a chunk fails
    /// its checksum, an object is missing or truncated, the manifest is invalid or names a
    /// file that cannot be laid out), of the newest older committed step that does. Each
    /// step skipped is logged with the bad object. Returns the point restored and the steps
    /// skipped, newest first. Any other error (the store unreachable, cancellation, local
    /// I/O such as a full disk) is returned as it is: it says nothing about the step.
    ///
    /// Every node of a generation falls back alike for a replicated (DDP) step, since each
    /// node reads all of its bytes. A sharded step read only in part by each node (its rows'
    /// 256 KiB blocks of raw chunks, or the compressed chunks that hold them) could in principle
    /// send nodes to different steps when the corruption lies in one node's rows.
    pub async fn restore_or_older(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<(ResumePoint, Vec<u64>), SinkError> {
        let integrity =
            |e: &SinkError| matches!(e, SinkError::Restore { source, .. } if source.is_integrity());
        let first = match self.restore(step, ranks.clone(), world_size, cancel).await {
            Ok(p) => return Ok((p, Vec::new())),
            Err(e) if integrity(&e) => e,
            Err(e) => return Err(e),
        };
        tracing::warn!(step, error = %first, "committed step does not restore; falling back to the previous committed step");
        let mut skipped = vec![step];
        let older = tokio::select! {
            r = self.store.committed_steps(cancel) => r,
            () = cancel.cancelled() => return Err(SinkError::Cancelled { op: format!("restore of step {step}") }),
        }
        .map_err(|source| SinkError::Read {
            url: self.url().to_string(),
            source: Box::new(source),
        })?;
        for s in older.into_iter().rev().filter(|s| *s < step) {
            match self.restore(s, ranks.clone(), world_size, cancel).await {
                Ok(p) => {
                    tracing::warn!(step = s, skipped = ?skipped, "resuming from an older committed step");
                    return Ok((p, skipped));
                }
                Err(e) if integrity(&e) => {
                    tracing::warn!(step = s, error = %e, "committed step does not restore either; falling back further");
                    skipped.push(s);
                }
                Err(e) => return Err(e),
            }
        }
        Err(first)
    }

    pub(super) async fn restore_inner(
        &self,
        step: u64,
        ranks: Range<u32>,
        world_size: u32,
        cancel: &CancellationToken,
    ) -> Result<ResumePoint, SinkError> {
        let cancelled = || SinkError::Cancelled {
            op: format!("restore of step {step}"),
        };
        if world_size == 0 || ranks.is_empty() || ranks.end > world_size {
            return Err(SinkError::InvalidInput(format!(
                "restore of step {step}: ranks {ranks:?} are not a non-empty part of a world of {world_size}"
            )));
        }
        if cancel.is_cancelled() {
            return Err(cancelled());
        }
        let t0 = Instant::now();
        let root = self.restore_root.clone();
        let dir = root.join(format!("step-{step}"));
        {
            let (root, dir) = (root.clone(), dir.clone());
            blocking(move || prepare_restore_dir(&root, &dir, step)).await?;
        }

        // What finished ranks can be kept.
        let marker = read_marker(&dir)
            .filter(|m| m.version == MARKER_VERSION && m.step == step && m.store == self.url());
        let (mut done, mut dense) = match marker {
            Some(m) if m.dense || m.world_size == world_size => {
                let present = m
                    .ranks
                    .iter()
                    .copied()
                    .filter(|r| rank_files_present(&dir, *r, self.opts.read.no_copy))
                    .collect::<BTreeSet<u32>>();
                (present, Some(m.dense))
            }
            other => {
                if other.is_some() || dir.join(RESTORED_MARKER).exists() {
                    // Sharded rows of another world, or bytes of another store (or an older
                    // marker): nothing is reusable. The marker goes first so a crash while
                    // removing never leaves it naming a lost rank.
                    remove_durably(&dir.join(RESTORED_MARKER), &dir)?;
                }
                let d = dir.clone();
                blocking(move || remove_rank_dirs(&d)).await?;
                (BTreeSet::new(), None)
            }
        };
        let want: Vec<u32> = ranks.clone().collect();
        let missing: Vec<u32> = want.iter().copied().filter(|r| !done.contains(r)).collect();
        let mut from_store = 0usize;
        // Ranks of those restored without copies (`sources.json` in place of the file).
        let mut without_copies = 0usize;
        let mut bytes = 0u64;

        // Only missing ranks of a sharded (or unknown) step, or a dense step with nothing
        // local to link from, need the store.
        let linkable = dense == Some(true) && !done.is_empty();
        if !missing.is_empty() && !linkable {
            let manifest = tokio::select! {
                r = self.store.read_manifest(step, cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            }
            .map_err(|source| self.restore_error(step, ranks.start, world_size, source, cancel))?;
            let is_dense = manifest.tensors.iter().all(|t| !t.sharded);
            if dense.is_some_and(|d| d != is_dense) {
                // The marker disagrees with the manifest: trust neither the local bytes.
                remove_durably(&dir.join(RESTORED_MARKER), &dir)?;
                let d = dir.clone();
                blocking(move || remove_rank_dirs(&d)).await?;
                done.clear();
            }
            dense = Some(is_dense);
            let todo: Vec<u32> = if is_dense && done.is_empty() {
                missing[..1].to_vec()
            } else if is_dense {
                vec![]
            } else {
                missing.clone()
            };
            for r in todo {
                let tmp = dir.join(format!("{TMP_PREFIX}rank-{r}"));
                {
                    let tmp = tmp.clone();
                    blocking(move || remove_if_exists(&tmp)).await?;
                }
                let report = tokio::select! {
                    res = self.restore_rank(step, r, world_size, &tmp, cancel) => res,
                    () = cancel.cancelled() => return Err(cancelled()),
                }?;
                if report.step != step || report.rank != r || report.world_size != world_size {
                    return Err(SinkError::Local {
                        path: tmp,
                        reason: format!(
                            "restore wrote step {} rank {} of {} instead of step {step} rank {r} of {world_size}",
                            report.step, report.rank, report.world_size
                        ),
                    });
                }
                bytes += report.bytes;
                from_store += 1;
                without_copies += usize::from(!report.written);
                let d = dir.clone();
                blocking(move || install_rank(&d, &tmp, r)).await?;
                done.insert(r);
                write_marker(
                    &dir,
                    &marker_of(self.url(), step, world_size, &done, is_dense),
                )?;
            }
        }

        // Dense steps: every other rank links the bytes already here, with its own metadata.
        let dense = dense.unwrap_or(false);
        if dense {
            let source_rank = *done.first().ok_or_else(|| SinkError::Local {
                path: dir.clone(),
                reason: format!("step {step}: no restored rank to link from"),
            })?;
            let (d, want, have) = (dir.clone(), want.clone(), done.clone());
            blocking(move || {
                for r in want {
                    if have.contains(&r) {
                        // Kept or just restored: only its rank and world may be stale.
                        write_rank_metadata(&d, r, world_size)?;
                    } else {
                        link_rank(&d, source_rank, r, world_size)?;
                    }
                }
                Ok(())
            })
            .await?;
            done.extend(ranks.clone());
        }
        // Assert after the writes: every wanted rank has its files.
        for r in &want {
            if !rank_files_present(&dir, *r, self.opts.read.no_copy) {
                return Err(SinkError::Local {
                    path: dir.join(format!("rank-{r}")),
                    reason: format!("step {step}: rank {r} is missing after the restore"),
                });
            }
        }
        write_marker(&dir, &marker_of(self.url(), step, world_size, &done, dense))?;
        tracing::info!(
            step,
            ranks = ?ranks,
            world = world_size,
            dense,
            from_store,
            without_copies,
            bytes,
            ms = t0.elapsed().as_millis() as u64,
            "step restored"
        );
        Ok(ResumePoint {
            step,
            dir,
            bytes_from_store: bytes,
        })
    }

    pub(super) fn restore_error(
        &self,
        step: u64,
        rank: u32,
        world: u32,
        source: checkpoint::Error,
        cancel: &CancellationToken,
    ) -> SinkError {
        if cancel.is_cancelled() {
            return SinkError::Cancelled {
                op: format!("restore of step {step}"),
            };
        }
        SinkError::Restore {
            step,
            rank,
            world,
            url: self.url().to_string(),
            source: Box::new(source),
        }
    }
}

pub(super) fn marker_of(
    store: &str,
    step: u64,
    world_size: u32,
    ranks: &BTreeSet<u32>,
    dense: bool,
) -> Restored {
    Restored {
        version: MARKER_VERSION,
        step,
        world_size,
        ranks: ranks.clone(),
        dense,
        store: store.to_string(),
    }
}

/// Creates `dir`, removes every other restored step and leftover temporaries (only the newest
/// restored step is kept: restores live in `/dev/shm`, memory).
pub(super) fn prepare_restore_dir(root: &Path, dir: &Path, step: u64) -> Result<(), SinkError> {
    create_private_dir_all(dir)?;
    // Found ones too (laid out before restores were private): weights are not for others.
    for d in [root, dir] {
        make_private(d)?;
    }
    let keep = format!("step-{step}");
    for e in std::fs::read_dir(root).map_err(io("read", root))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if (name.starts_with("step-") && name != keep) || name.starts_with(TMP_PREFIX) {
            match remove_if_exists(&e.path()) {
                Ok(()) => tracing::debug!(dir = %e.path().display(), "older restore removed"),
                Err(err) => tracing::warn!(error = %err, "removing an older restore failed"),
            }
        }
    }
    for e in std::fs::read_dir(dir).map_err(io("read", dir))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(TMP_PREFIX) || name.starts_with(&format!(".{RESTORED_MARKER}")) {
            remove_if_exists(&e.path())?;
        }
    }
    Ok(())
}

pub(super) fn remove_if_exists(p: &Path) -> Result<(), SinkError> {
    let r = match std::fs::symlink_metadata(p) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SinkError::Io {
            op: "remove",
            path: p.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

pub(super) fn remove_durably(p: &Path, dir: &Path) -> Result<(), SinkError> {
    remove_if_exists(p)?;
    sync_dir(dir)
}

pub(super) fn remove_rank_dirs(dir: &Path) -> Result<(), SinkError> {
    for e in std::fs::read_dir(dir).map_err(io("read", dir))?.flatten() {
        if e.file_name().to_string_lossy().starts_with("rank-") {
            remove_if_exists(&e.path())?;
        }
    }
    sync_dir(dir)
}

/// Whether `rank`'s restore in `dir` is whole: its metadata, and its tensors (with
/// `sources_ok`, where they lie in the store's chunks, still as checked, will do: a restore
/// without copies; without it, only the tensor file does).
pub(super) fn rank_files_present(dir: &Path, rank: u32, sources_ok: bool) -> bool {
    let d = dir.join(format!("rank-{rank}"));
    let tensors = if sources_ok {
        rank_tensors_present(&d)
    } else {
        d.join(RESTORE_FILE).is_file()
    };
    tensors && d.join(RESTORE_METADATA_FILE).is_file()
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), SinkError> {
    checkpoint::durable::fsync_dir(dir).map_err(|e| SinkError::Durable(Box::new(e)))
}

/// Temp file (0600), fsync, rename, fsync the directory: the checkpoint crate's durable
/// write, which also refuses a symlink where the file belongs.
pub(super) fn write_durable(path: &Path, bytes: &[u8]) -> Result<(), SinkError> {
    checkpoint::durable::write_file_durable(path, bytes)
        .map_err(|e| SinkError::Durable(Box::new(e)))
}

pub(super) fn read_marker(dir: &Path) -> Option<Restored> {
    let v = read_json_bounded(&dir.join(RESTORED_MARKER)).ok()?;
    serde_json::from_value(v).ok()
}

pub(super) fn write_marker(dir: &Path, r: &Restored) -> Result<(), SinkError> {
    let bytes = serde_json::to_vec(r).map_err(|e| SinkError::Local {
        path: dir.join(RESTORED_MARKER),
        reason: e.to_string(),
    })?;
    write_durable(&dir.join(RESTORED_MARKER), &bytes)
}

/// Moves a finished restore of `rank` (in `tmp`) to `dir/rank-<rank>`.
pub(super) fn install_rank(dir: &Path, tmp: &Path, rank: u32) -> Result<(), SinkError> {
    if !rank_tensors_present(tmp) || !tmp.join(RESTORE_METADATA_FILE).is_file() {
        return Err(SinkError::Local {
            path: tmp.to_path_buf(),
            reason: format!("the restore of rank {rank} left no {RESTORE_FILE}"),
        });
    }
    // Whatever wrote them, restored weights are for this user only.
    make_private_tree(tmp)?;
    sync_dir(tmp)?;
    let dest = dir.join(format!("rank-{rank}"));
    remove_if_exists(&dest)?;
    std::fs::rename(tmp, &dest).map_err(io("rename", tmp))?;
    sync_dir(dir)
}

/// Rewrites `rank-<at>/metadata.json` to say rank `rank` of `world_size` (a dense step's
/// files serve every rank; only this small file differs between them).
pub(super) fn write_rank_metadata(dir: &Path, rank: u32, world_size: u32) -> Result<(), SinkError> {
    let path = dir.join(format!("rank-{rank}")).join(RESTORE_METADATA_FILE);
    rewrite_metadata(&path, &path, rank, world_size)
}

pub(super) fn rewrite_metadata(
    from: &Path,
    to: &Path,
    rank: u32,
    world_size: u32,
) -> Result<(), SinkError> {
    let mut v = read_json_bounded(from).map_err(|reason| SinkError::Local {
        path: from.to_path_buf(),
        reason,
    })?;
    let Some(obj) = v.as_object_mut() else {
        return Err(SinkError::Local {
            path: from.to_path_buf(),
            reason: "not a JSON object".into(),
        });
    };
    if obj.get("rank").and_then(|r| r.as_u64()) == Some(u64::from(rank))
        && obj.get("world_size").and_then(|w| w.as_u64()) == Some(u64::from(world_size))
        && from == to
    {
        return Ok(());
    }
    obj.insert("rank".into(), rank.into());
    obj.insert("world_size".into(), world_size.into());
    let bytes = serde_json::to_vec_pretty(&v).map_err(|e| SinkError::Local {
        path: to.to_path_buf(),
        reason: e.to_string(),
    })?;
    write_durable(to, &bytes)
}

/// Makes `rank-<to>` hold `rank-<from>`'s tensors (hard link, a copy where links fail) and its
/// own metadata, built in a temporary directory and renamed into place.
pub(super) fn link_rank(dir: &Path, from: u32, to: u32, world_size: u32) -> Result<(), SinkError> {
    let src = dir.join(format!("rank-{from}"));
    let tmp = dir.join(format!("{TMP_PREFIX}rank-{to}"));
    remove_if_exists(&tmp)?;
    create_private_dir_all(&tmp)?;
    // The tensors, or where they lie in the store's chunks (a restore without copies).
    let name = if src.join(RESTORE_FILE).is_file() {
        RESTORE_FILE
    } else {
        RESTORED_SOURCES
    };
    let (a, b) = (src.join(name), tmp.join(name));
    if std::fs::hard_link(&a, &b).is_err() {
        std::fs::copy(&a, &b).map_err(io("copy", &a))?;
        std::fs::File::open(&b)
            .and_then(|f| f.sync_all())
            .map_err(io("fsync", &b))?;
    }
    rewrite_metadata(
        &src.join(RESTORE_METADATA_FILE),
        &tmp.join(RESTORE_METADATA_FILE),
        to,
        world_size,
    )?;
    install_rank(dir, &tmp, to)
}

/// `create_dir_all` with every directory it makes 0700.
pub(super) fn create_private_dir_all(dir: &Path) -> Result<(), SinkError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io("create", dir))
}

/// Sets a real directory to 0700 and a regular file to 0600; symlinks are left alone.
pub(super) fn make_private(p: &Path) -> Result<(), SinkError> {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::symlink_metadata(p).map_err(io("stat", p))?;
    let want = if m.is_dir() {
        0o700
    } else if m.is_file() {
        0o600
    } else {
        return Ok(());
    };
    if m.permissions().mode() & 0o7777 != want {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(want))
            .map_err(io("chmod", p))?;
    }
    Ok(())
}

/// [`make_private`] on `dir` and everything below it (symlinks not followed).
pub(super) fn make_private_tree(dir: &Path) -> Result<(), SinkError> {
    make_private(dir)?;
    if std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        for e in std::fs::read_dir(dir).map_err(io("read", dir))? {
            make_private_tree(&e.map_err(io("read", dir))?.path())?;
        }
    }
    Ok(())
}
