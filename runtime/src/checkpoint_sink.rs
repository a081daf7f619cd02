//! Where staged snapshots go: the [`CheckpointSink`] seam, the per-step bookkeeping that
//! decides when a step is complete on this node, and [`LocalDirSink`], which keeps committed
//! steps in a local directory (`file://` checkpoint URLs).
//!
//! The `checkpoint` crate plugs in as another [`CheckpointSink`]: `commit` streams the parts
//! to the object store and returns once the step's manifest is committed (across nodes), and
//! `latest` restores the newest committed step into staging, resharded, for the workers.
//!
//! # Local layout
//!
//! ```text
//! ROOT/step-<N>/rank-<R>/...     the files rank R wrote for step N, byte for byte
//! ROOT/step-<N>/manifest.json    written last: step, ranks, every file with its length
//! ROOT/.tmp-*                    a commit in progress (ignored; removed on the next commit)
//! ```
//!
//! A step directory appears by an atomic rename only after its files and manifest are fsynced,
//! so a crash at any instant leaves either no `step-N` or a complete one.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::agent_socket::StagedPart;
use crate::worker_env::ResumePoint;

/// Steps waiting for their remaining ranks. Older ones are dropped past this: a step whose
/// ranks never all report (a rank died mid-save) must not pin memory forever.
pub const PENDING_STEPS_MAX: usize = 8;
/// Committed steps kept by [`LocalDirSink`]; older ones are deleted after a commit.
pub const KEEP_STEPS_DEFAULT: usize = 3;
/// Most files one rank may stage for one step, and deepest nesting: bounds the copy.
const FILES_PER_PART_MAX: usize = 10_000;
const DEPTH_MAX: usize = 8;
const MANIFEST: &str = "manifest.json";
const MANIFEST_BYTES_MAX: u64 = 16 * 1024 * 1024;
const FORMAT_VERSION: u32 = 1;

/// Errors of a sink, each with the path it concerns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("checkpoint task was cancelled")]
    Cancelled,
}

impl SinkError {
    fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SinkError + 'a {
        move |source| SinkError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// A committed step: where workers resume from it, and how many bytes this node added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub resume: ResumePoint,
    pub bytes: u64,
}

/// Takes complete steps from this node and makes them durable; finds the step to resume from.
pub trait CheckpointSink: Send + Sync + 'static {
    /// Every rank of this node has staged its part of `step`. Returns once the step is
    /// committed and can be resumed from.
    fn commit(
        &self,
        step: u64,
        world_size: u32,
        parts: Vec<StagedPart>,
    ) -> impl Future<Output = Result<Committed, SinkError>> + Send;

    /// The newest committed step that verifies, laid out as `DIR/rank-*/` for workers to load.
    fn latest(&self) -> impl Future<Output = Result<Option<ResumePoint>, SinkError>> + Send;
}

/// Collects `saved` reports until every rank of this node has reported a step.
#[derive(Debug)]
pub struct StepTracker {
    epoch: u64,
    ranks: Range<u32>,
    pending: BTreeMap<u64, BTreeMap<u32, PathBuf>>,
}

impl StepTracker {
    pub fn new(ranks: Range<u32>) -> Self {
        StepTracker {
            epoch: 0,
            ranks,
            pending: BTreeMap::new(),
        }
    }

    /// A new worker group with (maybe) new ranks: half-reported steps of the old group can
    /// never complete, so they are forgotten.
    pub fn reset(&mut self, ranks: Range<u32>) {
        self.ranks = ranks;
        self.pending.clear();
    }

    /// Records a part received from worker group `epoch`. Parts of a newer group reset the
    /// tracker to that group's ranks; parts of an older group are stale and ignored.
    pub fn record_received(
        &mut self,
        epoch: u64,
        ranks: Range<u32>,
        part: StagedPart,
    ) -> Option<Vec<StagedPart>> {
        if epoch < self.epoch {
            tracing::warn!(
                epoch,
                step = part.step,
                "saved report from a stopped worker group ignored"
            );
            return None;
        }
        if epoch > self.epoch {
            self.epoch = epoch;
            self.reset(ranks);
        }
        self.record(part)
    }

    /// Records one part; returns all parts of its step, in rank order, once the step is complete.
    pub fn record(&mut self, part: StagedPart) -> Option<Vec<StagedPart>> {
        if !self.ranks.contains(&part.rank) {
            tracing::warn!(
                rank = part.rank,
                step = part.step,
                "saved report from a foreign rank ignored"
            );
            return None;
        }
        let step = part.step;
        self.pending
            .entry(step)
            .or_default()
            .insert(part.rank, part.dir);
        let expected = self.ranks.len();
        if self.pending.get(&step).map(|m| m.len()) == Some(expected) {
            let parts = self.pending.remove(&step).unwrap_or_default();
            return Some(
                parts
                    .into_iter()
                    .map(|(rank, dir)| StagedPart { rank, step, dir })
                    .collect(),
            );
        }
        while self.pending.len() > PENDING_STEPS_MAX {
            if let Some((old, got)) = self.pending.pop_first() {
                tracing::warn!(step = old, ranks = got.len(), "incomplete step dropped");
            }
        }
        None
    }
}

/// The manifest of a locally committed step.
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format_version: u32,
    step: u64,
    world_size: u32,
    ranks: Vec<u32>,
    /// Paths relative to the step directory, with their lengths.
    files: BTreeMap<String, u64>,
}

/// Keeps committed steps under a local directory.
#[derive(Debug, Clone)]
pub struct LocalDirSink {
    root: PathBuf,
    keep_steps: usize,
}

impl LocalDirSink {
    /// A sink under `root`. The directory is created by the first commit, so a job that never
    /// checkpoints leaves nothing behind; an existing `root` must be a directory.
    pub fn new(root: PathBuf, keep_steps: usize) -> Result<Self, SinkError> {
        if root.exists() && !root.is_dir() {
            return Err(SinkError::Invalid {
                path: root,
                reason: "not a directory".into(),
            });
        }
        Ok(LocalDirSink {
            root,
            keep_steps: keep_steps.max(1),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn commit_blocking(
        &self,
        step: u64,
        world_size: u32,
        parts: &[StagedPart],
    ) -> Result<Committed, SinkError> {
        let target = self.root.join(format!("step-{step}"));
        if target.exists() {
            if verify(&target).is_ok() {
                // The same step saved again (after a restart): it is already committed.
                return Ok(Committed {
                    resume: ResumePoint { step, dir: target },
                    bytes: 0,
                });
            }
            // A directory that does not verify was never a committed step of ours.
            fs::remove_dir_all(&target).map_err(SinkError::io("remove", &target))?;
        }
        fs::create_dir_all(&self.root).map_err(SinkError::io("create", &self.root))?;
        self.remove_stale_tmp();
        let tmp = self
            .root
            .join(format!(".tmp-step-{step}-{}", std::process::id()));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(SinkError::io("remove", &tmp))?;
        }
        fs::create_dir(&tmp).map_err(SinkError::io("create", &tmp))?;
        let mut bytes = 0;
        let result = (|| {
            let mut files = BTreeMap::new();
            let mut ranks = Vec::with_capacity(parts.len());
            for part in parts {
                if part.step != step {
                    return Err(SinkError::Invalid {
                        path: part.dir.clone(),
                        reason: format!("part of step {} handed to step {step}", part.step),
                    });
                }
                let rel = PathBuf::from(format!("rank-{}", part.rank));
                let mut count = 0;
                copy_tree(&part.dir, &tmp, &rel, 0, &mut count, &mut files)?;
                ranks.push(part.rank);
            }
            bytes = files.values().sum::<u64>();
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                step,
                world_size,
                ranks,
                files,
            };
            let json = serde_json::to_vec_pretty(&manifest).map_err(|e| SinkError::Invalid {
                path: tmp.clone(),
                reason: e.to_string(),
            })?;
            write_synced(&tmp.join(MANIFEST), &json)?;
            sync_dir(&tmp)?;
            fs::rename(&tmp, &target).map_err(SinkError::io("rename", &tmp))?;
            sync_dir(&self.root)
        })();
        if let Err(e) = result {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        // Verify after writing: what resume will read must be what we meant to write.
        verify(&target)?;
        self.retain();
        Ok(Committed {
            resume: ResumePoint { step, dir: target },
            bytes,
        })
    }

    fn steps_newest_first(&self) -> Result<Vec<(u64, PathBuf)>, SinkError> {
        let mut steps = Vec::new();
        if !self.root.exists() {
            return Ok(steps);
        }
        for entry in fs::read_dir(&self.root).map_err(SinkError::io("list", &self.root))? {
            let entry = entry.map_err(SinkError::io("list", &self.root))?;
            let name = entry.file_name();
            if let Some(n) = name
                .to_str()
                .and_then(|n| n.strip_prefix("step-"))
                .and_then(|n| n.parse::<u64>().ok())
            {
                steps.push((n, entry.path()));
            }
        }
        steps.sort_by_key(|s| std::cmp::Reverse(s.0));
        Ok(steps)
    }

    fn latest_blocking(&self) -> Result<Option<ResumePoint>, SinkError> {
        for (step, dir) in self.steps_newest_first()? {
            match verify(&dir) {
                Ok(m) if m.step == step => return Ok(Some(ResumePoint { step, dir })),
                Ok(m) => {
                    tracing::warn!(dir = %dir.display(), manifest_step = m.step, "step dir and manifest disagree; skipped")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "checkpoint does not verify; trying an older one")
                }
            }
        }
        Ok(None)
    }

    fn retain(&self) {
        let Ok(steps) = self.steps_newest_first() else {
            return;
        };
        let mut kept = 0;
        for (step, dir) in steps {
            if verify(&dir).is_ok() && kept < self.keep_steps {
                kept += 1;
                continue;
            }
            if kept >= self.keep_steps
                && let Err(e) = fs::remove_dir_all(&dir)
            {
                tracing::warn!(step, error = %e, "could not remove an old checkpoint");
            }
        }
    }

    fn remove_stale_tmp(&self) {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return;
        };
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-step-") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

impl CheckpointSink for LocalDirSink {
    async fn commit(
        &self,
        step: u64,
        world_size: u32,
        parts: Vec<StagedPart>,
    ) -> Result<Committed, SinkError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.commit_blocking(step, world_size, &parts))
            .await
            .map_err(|_| SinkError::Cancelled)?
    }

    async fn latest(&self) -> Result<Option<ResumePoint>, SinkError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.latest_blocking())
            .await
            .map_err(|_| SinkError::Cancelled)?
    }
}

/// Copies regular files and directories from `src` into `dst_root/rel`, fsyncing each file.
/// Symlinks and special files are refused: a worker must not make the agent copy `/etc`.
fn copy_tree(
    src: &Path,
    dst_root: &Path,
    rel: &Path,
    depth: usize,
    count: &mut usize,
    files: &mut BTreeMap<String, u64>,
) -> Result<(), SinkError> {
    if depth > DEPTH_MAX {
        return Err(SinkError::Invalid {
            path: src.to_path_buf(),
            reason: "nested too deep".into(),
        });
    }
    let dst = dst_root.join(rel);
    fs::create_dir_all(&dst).map_err(SinkError::io("create", &dst))?;
    for entry in fs::read_dir(src).map_err(SinkError::io("list", src))? {
        let entry = entry.map_err(SinkError::io("list", src))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(SinkError::io("stat", &path))?;
        let child_rel = rel.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&path, dst_root, &child_rel, depth + 1, count, files)?;
        } else if kind.is_file() {
            *count += 1;
            if *count > FILES_PER_PART_MAX {
                return Err(SinkError::Invalid {
                    path: src.to_path_buf(),
                    reason: "too many files".into(),
                });
            }
            let to = dst_root.join(&child_rel);
            let len = fs::copy(&path, &to).map_err(SinkError::io("copy", &path))?;
            fs::File::open(&to)
                .and_then(|f| f.sync_all())
                .map_err(SinkError::io("fsync", &to))?;
            files.insert(child_rel.to_string_lossy().into_owned(), len);
        } else {
            return Err(SinkError::Invalid {
                path,
                reason: "only regular files and directories can be checkpointed".into(),
            });
        }
    }
    sync_dir(&dst)
}

fn verify(dir: &Path) -> Result<Manifest, SinkError> {
    let path = dir.join(MANIFEST);
    let meta = fs::metadata(&path).map_err(SinkError::io("stat", &path))?;
    if meta.len() > MANIFEST_BYTES_MAX {
        return Err(SinkError::Invalid {
            path,
            reason: "manifest too large".into(),
        });
    }
    let bytes = fs::read(&path).map_err(SinkError::io("read", &path))?;
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| SinkError::Invalid {
        path: path.clone(),
        reason: format!("bad manifest: {e}"),
    })?;
    if m.format_version != FORMAT_VERSION {
        return Err(SinkError::Invalid {
            path,
            reason: format!("unknown format version {}", m.format_version),
        });
    }
    let uniq: BTreeSet<_> = m.ranks.iter().collect();
    if m.ranks.is_empty() || uniq.len() != m.ranks.len() {
        return Err(SinkError::Invalid {
            path,
            reason: "manifest ranks empty or repeated".into(),
        });
    }
    for (rel, len) in &m.files {
        let rel_path = Path::new(rel);
        if rel_path
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(SinkError::Invalid {
                path,
                reason: format!("file name {rel:?} leaves the step"),
            });
        }
        let f = dir.join(rel_path);
        let got = fs::metadata(&f).map_err(SinkError::io("stat", &f))?.len();
        if got != *len {
            return Err(SinkError::Invalid {
                path: f,
                reason: format!("length {got}, manifest says {len}"),
            });
        }
    }
    Ok(m)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), SinkError> {
    let mut f = fs::File::create(path).map_err(SinkError::io("create", path))?;
    f.write_all(bytes).map_err(SinkError::io("write", path))?;
    f.sync_all().map_err(SinkError::io("fsync", path))
}

fn sync_dir(dir: &Path) -> Result<(), SinkError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(SinkError::io("fsync", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(root: &Path, step: u64, rank: u32, files: &[(&str, &[u8])]) -> StagedPart {
        let dir = root.join(format!("step-{step}/rank-{rank}"));
        for (name, data) in files {
            let p = dir.join(name);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, data).unwrap();
        }
        StagedPart { rank, step, dir }
    }

    #[test]
    fn tracker_completes_a_step_when_every_local_rank_reported() {
        let mut t = StepTracker::new(4..6);
        let p = |rank, step| StagedPart {
            rank,
            step,
            dir: format!("/s/{step}/{rank}").into(),
        };
        assert!(t.record(p(4, 10)).is_none());
        assert!(t.record(p(4, 20)).is_none());
        assert!(
            t.record(p(9, 10)).is_none(),
            "foreign rank must not complete a step"
        );
        let done = t.record(p(5, 10)).unwrap();
        assert_eq!(done.iter().map(|p| p.rank).collect::<Vec<_>>(), vec![4, 5]);
        assert!(done.iter().all(|p| p.step == 10));
        // Reset forgets the half-reported step 20.
        t.reset(0..2);
        assert!(t.record(p(0, 20)).is_none());
        assert!(t.record(p(1, 20)).is_some());
    }

    #[test]
    fn tracker_forgets_parts_of_an_older_worker_group() {
        let mut t = StepTracker::new(0..0);
        let p = |rank| StagedPart {
            rank,
            step: 10,
            dir: "/s".into(),
        };
        assert!(t.record_received(1, 0..2, p(0)).is_none());
        // The group restarted (epoch 2) before rank 1 saved: rank 0's old part is gone.
        assert!(t.record_received(2, 0..2, p(1)).is_none());
        // A late report from epoch 1 is ignored.
        assert!(t.record_received(1, 0..2, p(0)).is_none());
        assert_eq!(t.record_received(2, 0..2, p(0)).unwrap().len(), 2);
    }

    #[test]
    fn tracker_bounds_incomplete_steps() {
        let mut t = StepTracker::new(0..2);
        for step in 0..100 {
            t.record(StagedPart {
                rank: 0,
                step,
                dir: "/x".into(),
            });
        }
        assert!(t.pending.len() <= PENDING_STEPS_MAX);
        assert!(
            t.record(StagedPart {
                rank: 1,
                step: 99,
                dir: "/x".into()
            })
            .is_some()
        );
    }

    #[tokio::test]
    async fn local_sink_commits_copies_and_resumes_from_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        let sink = LocalDirSink::new(tmp.path().join("ck"), 2).unwrap();
        assert_eq!(sink.latest().await.unwrap(), None);
        assert!(
            !sink.root().exists(),
            "created before anything was committed"
        );
        for step in [10, 20, 30] {
            let parts = vec![
                stage(
                    &staging,
                    step,
                    0,
                    &[("model.safetensors", b"abc"), ("meta.json", b"{}")],
                ),
                stage(&staging, step, 1, &[("sub/optim.safetensors", &[7u8; 100])]),
            ];
            let done = sink.commit(step, 2, parts).await.unwrap();
            assert_eq!(done.bytes, 3 + 2 + 100);
            let rp = done.resume;
            assert_eq!(rp.step, step);
            assert_eq!(
                fs::read(rp.dir.join("rank-1/sub/optim.safetensors")).unwrap(),
                vec![7u8; 100]
            );
        }
        let latest = sink.latest().await.unwrap().unwrap();
        assert_eq!(latest.step, 30);
        assert_eq!(
            fs::read(latest.dir.join("rank-0/model.safetensors")).unwrap(),
            b"abc"
        );
        // keep_steps = 2: step 10 is gone.
        assert!(!sink.root().join("step-10").exists());
        assert!(sink.root().join("step-20").exists());
        // Committing the same step again is a no-op success.
        let again = sink
            .commit(30, 2, vec![stage(&staging, 30, 0, &[("x", b"y")])])
            .await
            .unwrap();
        assert_eq!((again.resume.step, again.bytes), (30, 0));
        assert_eq!(
            fs::read(latest.dir.join("rank-0/model.safetensors")).unwrap(),
            b"abc"
        );
    }

    #[tokio::test]
    async fn resume_falls_back_when_newest_step_is_truncated_or_lacks_a_manifest() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        let sink = LocalDirSink::new(tmp.path().join("ck"), 5).unwrap();
        sink.commit(1, 1, vec![stage(&staging, 1, 0, &[("a", b"1234")])])
            .await
            .unwrap();
        sink.commit(2, 1, vec![stage(&staging, 2, 0, &[("a", b"1234")])])
            .await
            .unwrap();
        // Truncate a file of step 2; and a step 3 with no manifest (a crash mid-copy by some
        // other writer).
        fs::write(sink.root().join("step-2/rank-0/a"), b"12").unwrap();
        fs::create_dir_all(sink.root().join("step-3/rank-0")).unwrap();
        let latest = sink.latest().await.unwrap().unwrap();
        assert_eq!(latest.step, 1);
    }

    #[tokio::test]
    async fn symlinks_in_a_staged_part_are_refused_and_leave_nothing_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        let part = stage(&staging, 5, 0, &[("a", b"1")]);
        std::os::unix::fs::symlink("/etc/passwd", part.dir.join("passwd")).unwrap();
        let sink = LocalDirSink::new(tmp.path().join("ck"), 3).unwrap();
        let err = sink.commit(5, 1, vec![part]).await.unwrap_err();
        assert!(matches!(err, SinkError::Invalid { .. }), "{err}");
        assert_eq!(sink.latest().await.unwrap(), None);
        assert_eq!(fs::read_dir(sink.root()).unwrap().count(), 0);
    }

    #[test]
    fn forged_manifest_paths_do_not_verify() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("step-1");
        fs::create_dir_all(&dir).unwrap();
        let m = serde_json::json!({"format_version":1,"step":1,"world_size":1,"ranks":[0],"files":{"../../etc/passwd":0}});
        fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
        assert!(verify(&dir).is_err());
        let m =
            serde_json::json!({"format_version":99,"step":1,"world_size":1,"ranks":[0],"files":{}});
        fs::write(dir.join(MANIFEST), m.to_string()).unwrap();
        assert!(verify(&dir).is_err());
    }
}
