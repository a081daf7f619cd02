//! The agent's end of the commit pipeline: complete steps from the tracker go into a bounded
//! queue ([`Committer`]) that one task commits in order through the sink; a step a worker
//! could not stage is given up in the store so that no node waits for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use checkpoint::CancellationToken;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use super::Node;
use super::dirs::remove_inside_staging;
use crate::events::{Event, Events};
use crate::pipeline::{StepToCommit, StepTracker, StoreSink};
use crate::state::{AgentState, Received, StagedPart};
use crate::worker_env::GenerationView;

/// Complete steps queued for the committer besides the one it is committing. With one more
/// complete step held by the agent loop and one step's parts in the socket channel (capacity:
/// this node's ranks), at most four checkpoints are staged and uncommitted; a worker saving a
/// fifth waits on its `saved` reply. That bounds both staging space and the work a crash can
/// lose while the store is slow.
pub(super) const COMMIT_QUEUE_MAX: usize = 1;
/// Snapshots of this node that may stand in staging at once: the four uncommitted ones above
/// (the one being committed, the queued ones, the one held by the agent loop, the one in the
/// socket channel) and the one being written. Staging smaller than that many checkpoints is
/// reported at the first one; when it fills, a worker skips its snapshot and the step is given
/// up.
pub(super) const STAGED_CHECKPOINTS_MAX: u64 = 1 + COMMIT_QUEUE_MAX as u64 + 1 + 1 + 1;
/// The commit pipeline's depth: how many checkpoint intervals a node's training may run ahead
/// of its newest commit (`STAGED_CHECKPOINTS_MAX`; a worker saving beyond it waits), so how
/// many a crash may lose while the store is slow. Exported for tools that bound lost work.
pub const COMMIT_PIPELINE_CHECKPOINTS: u64 = STAGED_CHECKPOINTS_MAX;
/// How long pending commits may take between two generations before they are cancelled (a
/// step a lost peer never uploaded cannot complete).
pub(super) const BETWEEN_GENERATIONS_FLUSH_MS: u64 = 3_000;
/// Bound on writing a given-up checkpoint's marker to the store.
pub(super) const GIVE_UP_DEADLINE_MS: u64 = 30_000;

/// A committed step and the generation whose workers saved it (`None`: a step found in the
/// bucket at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CommitPoint {
    pub(super) step: u64,
    pub(super) generation: Option<u64>,
}

/// The committer's side of the agent: a queue and the newest committed step.
pub(super) struct Committer {
    pub(super) tx: mpsc::Sender<(StepToCommit, CancellationToken)>,
    /// Steps queued or in flight.
    pub(super) pending: watch::Receiver<usize>,
    pub(super) pending_tx: Arc<watch::Sender<usize>>,
    /// Cancels the commits of the current era (between two generations).
    pub(super) era: CancellationToken,
    /// The first generation of the current era, and the token of the era
    /// [`Committer::retire_era`] ended: a step of an older generation queued after the switch
    /// (held by the agent loop while the queue was full) belongs to that era, not this one.
    retired: Option<(u64, CancellationToken)>,
    pub(super) committed: watch::Receiver<Option<CommitPoint>>,
    pub(super) task: tokio::task::JoinHandle<bool>,
}

impl Committer {
    pub(super) fn start(node: &Node, latest: Option<u64>) -> Self {
        let (tx, rx) = mpsc::channel(COMMIT_QUEUE_MAX);
        let (pending_tx, pending) = watch::channel(0usize);
        let pending_tx = Arc::new(pending_tx);
        let (committed_tx, committed) = watch::channel(latest.map(|step| CommitPoint {
            step,
            generation: None,
        }));
        let task = tokio::spawn(
            commit_loop(
                node.sink.clone(),
                rx,
                node.state.clone(),
                node.spec.staging_dir.clone(),
                node.events.clone(),
                committed_tx,
                pending_tx.clone(),
            )
            .in_current_span(),
        );
        Committer {
            tx,
            pending,
            pending_tx,
            era: CancellationToken::new(),
            retired: None,
            committed,
            task,
        }
    }

    /// The token that cancels `step`'s commit: its generation's era.
    fn token_for(&self, step: &StepToCommit) -> CancellationToken {
        match &self.retired {
            Some((since, old)) if step.generation < *since => old.clone(),
            _ => self.era.clone(),
        }
    }

    /// Queues a step without waiting (the agent loop must never block on a slow store), or
    /// gives it back when the queue is full: the loop holds it until a permit comes.
    pub(super) fn try_submit(&self, step: StepToCommit) -> Result<(), StepToCommit> {
        // Counted before the send: the committer may finish it (and count it down) at once.
        self.pending_tx.send_modify(|n| *n += 1);
        let token = self.token_for(&step);
        let r = self.tx.try_send((step, token));
        if r.is_err() {
            self.pending_tx.send_modify(|n| *n = n.saturating_sub(1));
        }
        match r {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full((step, _))) => Err(step),
            Err(mpsc::error::TrySendError::Closed((step, _))) => {
                tracing::warn!(
                    step = step.step,
                    "checkpoint queue closed; this step is not committed"
                );
                Ok(())
            }
        }
    }

    /// Queues a step into the room `permit` holds.
    pub(super) fn submit_with(
        &self,
        permit: mpsc::OwnedPermit<(StepToCommit, CancellationToken)>,
        step: StepToCommit,
    ) {
        self.pending_tx.send_modify(|n| *n += 1);
        let token = self.token_for(&step);
        permit.send((step, token));
    }

    /// Queues a step, waiting for room until `deadline` (after a worker group ended, when the
    /// loop has nothing else to serve); a step that still finds no room is dropped with a
    /// warning and given back, for the caller to give up in the store.
    pub(super) async fn submit_until(
        &self,
        step: StepToCommit,
        deadline: Instant,
    ) -> Result<(), StepToCommit> {
        let s = step.step;
        let token = self.token_for(&step);
        self.pending_tx.send_modify(|n| *n += 1);
        let permit = tokio::time::timeout_at(deadline.into(), self.tx.reserve()).await;
        match permit {
            Ok(Ok(permit)) => {
                permit.send((step, token));
                Ok(())
            }
            Ok(Err(_)) => {
                // The committer is gone (the agent is ending): nothing can commit it.
                self.pending_tx.send_modify(|n| *n = n.saturating_sub(1));
                tracing::warn!(
                    step = s,
                    "checkpoint queue closed; this step is not committed"
                );
                Ok(())
            }
            Err(_) => {
                self.pending_tx.send_modify(|n| *n = n.saturating_sub(1));
                tracing::warn!(
                    step = s,
                    "no room in the checkpoint queue before the deadline; this step is not committed"
                );
                Err(step)
            }
        }
    }

    /// Waits until nothing is pending, up to `limit`; then cancels what is left and starts a
    /// new era. Returns whether everything finished.
    pub(super) async fn settle(&mut self, limit: Duration) -> bool {
        let mut pending = self.pending.clone();
        let done = tokio::time::timeout(limit, pending.wait_for(|n| *n == 0))
            .await
            .is_ok();
        if !done {
            tracing::warn!(
                limit_ms = limit.as_millis() as u64,
                "pending checkpoint commits did not finish in time; cancelling them"
            );
            self.era.cancel();
            self.era = CancellationToken::new();
            let _ = tokio::time::timeout(
                Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
                pending.wait_for(|n| *n == 0),
            )
            .await;
        }
        done
    }

    /// Starts a new era at `generation`, and cancels the steps of the old one still pending
    /// after `limit`, in the background (the caller goes on at once). A step of an older
    /// generation queued later joins the old era: cancelled at once once `limit` has passed.
    pub(super) fn retire_era(&mut self, generation: u64, limit: Duration) {
        let old = std::mem::replace(&mut self.era, CancellationToken::new());
        self.retired = Some((generation, old.clone()));
        let mut pending = self.pending.clone();
        tokio::spawn(
            async move {
                if tokio::time::timeout(limit, pending.wait_for(|n| *n == 0))
                    .await
                    .is_err()
                {
                    tracing::warn!(
                        limit_ms = limit.as_millis() as u64,
                        "checkpoint commits of the previous generation did not finish in time; cancelling them"
                    );
                }
                old.cancel();
            }
            .in_current_span(),
        );
    }

    pub(super) fn latest(&self) -> Option<u64> {
        self.committed.borrow().map(|c| c.step)
    }

    /// [`Committer::latest`], with the generation that saved it.
    pub(super) fn latest_point(&self) -> Option<CommitPoint> {
        *self.committed.borrow()
    }

    /// Closes the queue and waits for the committer, up to `limit`.
    pub(super) async fn finish(self, limit: Duration) -> bool {
        drop(self.tx);
        let era = self.era.clone();
        match tokio::time::timeout(limit, self.task).await {
            Ok(Ok(ok)) => ok,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "checkpoint task failed");
                false
            }
            Err(_) => {
                era.cancel();
                tracing::error!(
                    limit_ms = limit.as_millis() as u64,
                    "checkpoint flush did not finish in time"
                );
                false
            }
        }
    }
}

pub(super) async fn flush(committer: &mut Committer, limit: Duration) -> bool {
    committer.settle(limit).await
}

/// Records a saved part; returns the step once every local rank has staged it.
pub(super) fn tracker_complete(
    node: &Node,
    view: &GenerationView,
    tracker: &mut StepTracker,
    r: Received,
) -> Option<StepToCommit> {
    let world = r.world_size;
    let generation = r.generation;
    if let Some(why) = r.skipped {
        give_up_step(node, generation, r.part.rank, r.part.step, why);
        return None;
    }
    let parts = tracker.record_received(r.epoch, r.ranks, r.part)?;
    let step = parts[0].step;
    tracing::info!(step, ranks = parts.len(), "step staged by every local rank");
    if !node
        .staging_checked
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        check_staging_room(node, step, &parts);
    }
    let s = &view.scaling;
    let agent_metadata = json!({
        "generation": generation,
        "world_size": world,
        "node": node.node_id,
        "mode": format!("{:?}", node.mode).to_lowercase(),
        "scaling": {
            "lr_scale": s.lr_scale,
            "lr": s.lr,
            "batch_size": s.per_worker_batch,
            "global_batch": s.global_batch,
            "grad_accum_steps": s.grad_accum_steps,
        },
    });
    Some(StepToCommit {
        step,
        generation,
        world_size: world,
        parts,
        agent_metadata,
    })
}

/// Says so, with the sizes, when the staging file system cannot hold
/// [`STAGED_CHECKPOINTS_MAX`] checkpoints the size of this first one (Docker's default
/// `/dev/shm` is 64 MiB): checkpoints are then skipped whenever it fills.
pub(super) fn check_staging_room(node: &Node, step: u64, parts: &[crate::state::StagedPart]) {
    let bytes: u64 = parts
        .iter()
        .flat_map(|p| std::fs::read_dir(&p.dir).into_iter().flatten().flatten())
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    let Some(fs_bytes) = fs_size_bytes(&node.spec.staging_dir) else {
        return;
    };
    let needed = bytes.saturating_mul(STAGED_CHECKPOINTS_MAX);
    if needed > fs_bytes {
        tracing::warn!(
            step,
            checkpoint_bytes = bytes,
            staging_bytes = fs_bytes,
            needed_bytes = needed,
            staging = %node.spec.staging_dir.display(),
            "the staging file system holds fewer than {STAGED_CHECKPOINTS_MAX} checkpoints of this node \
             ({bytes} bytes each, {fs_bytes} in all): when it fills, workers skip their snapshot \
             and that checkpoint is given up; give --staging-dir a larger file system \
             (or docker --shm-size) to keep every checkpoint"
        );
        node.events.emit(Event::StagingTooSmall {
            step,
            checkpoint_bytes: bytes,
            staging_bytes: fs_bytes,
            needed_bytes: needed,
        });
    }
}

/// The size of the file system holding `dir`.
pub(super) fn fs_size_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value for statvfs to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a writable buffer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_blocks as u64).saturating_mul(st.f_frsize as u64))
}

/// A local rank could not stage its part of `step` (a full staging disk): the step can never
/// commit, so say so in the store, where every node's committer sees it at its next try and
/// stops waiting for the part instead of holding the commit queue until its deadline.
pub(super) fn give_up_step(node: &Node, generation: u64, rank: u32, step: u64, why: String) {
    tracing::warn!(step, rank, reason = %why, "a worker skipped its snapshot; giving the checkpoint up");
    node.state
        .metrics
        .checkpoint_failures_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    node.events.emit(Event::CheckpointSkipped {
        step,
        generation,
        rank,
        reason: why.clone(),
    });
    let store = node.sink.store().clone();
    let writer = crate::pipeline::writer_id(generation, rank);
    tokio::spawn(
        async move {
            let cancel = CancellationToken::new();
            let deadline = Duration::from_millis(GIVE_UP_DEADLINE_MS);
            match tokio::time::timeout(deadline, store.abandon_part(step, &writer, &why, &cancel))
                .await
            {
                Ok(Ok(())) => tracing::info!(step, %writer, "checkpoint given up in the store"),
                Ok(Err(e)) => tracing::warn!(step, %writer, error = %e, "could not mark the checkpoint as given up (peers wait for its part until their commit deadline)"),
                Err(_) => tracing::warn!(step, %writer, "marking the checkpoint as given up timed out"),
            }
        }
        .in_current_span(),
    );
}

/// Commits complete steps in order; returns whether every commit succeeded.
pub(super) async fn commit_loop(
    sink: Arc<StoreSink>,
    mut steps: mpsc::Receiver<(StepToCommit, CancellationToken)>,
    state: Arc<AgentState>,
    staging: PathBuf,
    events: Arc<Events>,
    committed: watch::Sender<Option<CommitPoint>>,
    pending: Arc<watch::Sender<usize>>,
) -> bool {
    let mut ok = true;
    while let Some((s, cancel)) = steps.recv().await {
        let (step, generation) = (s.step, s.generation);
        let staged: Vec<StagedPart> = s.parts.clone();
        let t0 = Instant::now();
        let result = if cancel.is_cancelled() {
            None
        } else {
            Some(sink.commit(s, &cancel).await)
        };
        match result {
            Some(Ok(done)) => {
                tracing::info!(
                    step,
                    bytes = done.bytes,
                    by_this_node = done.by_this_node,
                    ms = t0.elapsed().as_millis() as u64,
                    "checkpoint committed"
                );
                state.metrics.committed(step, done.bytes, t0.elapsed());
                events.emit(Event::CheckpointCommitted {
                    step,
                    generation,
                    bytes: done.bytes,
                    by_this_node: done.by_this_node,
                    store_ms: done.upload_ms + done.commit_ms,
                });
                committed.send_modify(|c| {
                    if c.is_none_or(|c| c.step < step) {
                        *c = Some(CommitPoint {
                            step,
                            generation: Some(generation),
                        });
                    }
                });
            }
            Some(Err(e)) => {
                ok = false;
                state
                    .metrics
                    .checkpoint_failures_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match &e {
                    crate::pipeline::SinkError::Commit { source, .. }
                        if matches!(**source, checkpoint::Error::Abandoned { .. }) =>
                    {
                        tracing::warn!(step, error = %e, "checkpoint given up: a rank could not stage it");
                    }
                    crate::pipeline::SinkError::Commit { source, .. }
                        if matches!(**source, checkpoint::Error::Rejected { .. }) =>
                    {
                        tracing::error!(step, error = %e, "checkpoint commit failed");
                        // Retrying cannot help: tell the workers at their next save.
                        state.refuse_next_save(format!("checkpoint not committed: {source}"));
                    }
                    _ => tracing::error!(step, error = %e, "checkpoint commit failed"),
                }
            }
            None => tracing::warn!(step, "checkpoint commit cancelled"),
        }
        // The staged copy is no longer needed either way: committed, or given up.
        // Only a real directory inside staging: never one reached through a symlink.
        if let Some(p) = staged.first().and_then(|p| p.dir.parent()) {
            remove_inside_staging(&staging, p);
        }
        pending.send_modify(|n| *n = n.saturating_sub(1));
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, generation: u64) -> StepToCommit {
        StepToCommit {
            step,
            generation,
            world_size: 1,
            parts: Vec::new(),
            agent_metadata: serde_json::Value::Null,
        }
    }

    /// A committer whose queue the test reads itself.
    fn committer() -> (Committer, mpsc::Receiver<(StepToCommit, CancellationToken)>) {
        let (tx, rx) = mpsc::channel(4);
        let (pending_tx, pending) = watch::channel(0usize);
        let (_, committed) = watch::channel(None);
        let c = Committer {
            tx,
            pending,
            pending_tx: Arc::new(pending_tx),
            era: CancellationToken::new(),
            retired: None,
            committed,
            task: tokio::spawn(async { true }),
        };
        (c, rx)
    }

    /// A step of the generation that lost a member, held by the agent loop until after the
    /// switch (the queue was full), joins its own era: cancelled with it, not left to wait for
    /// the lost member's part until the commit deadline while the new generation's steps queue
    /// behind it.
    #[tokio::test]
    async fn a_step_of_a_retired_generation_queued_after_the_switch_is_cancelled_with_its_era() {
        let (mut c, mut rx) = committer();
        c.retire_era(2, Duration::from_millis(20));
        c.try_submit(step(40, 1)).unwrap();
        c.try_submit(step(45, 2)).unwrap();
        let (s40, old) = rx.recv().await.unwrap();
        let (s45, new) = rx.recv().await.unwrap();
        assert_eq!((s40.step, s45.step), (40, 45));
        tokio::time::timeout(Duration::from_secs(5), old.cancelled())
            .await
            .expect("the retired generation's step is cancelled after the limit");
        assert!(!new.is_cancelled(), "the new generation's step is not");
        // Queued once the old era is cancelled: cancelled at once.
        c.try_submit(step(41, 1)).unwrap();
        let (_, late) = rx.recv().await.unwrap();
        assert!(late.is_cancelled());
    }
}
