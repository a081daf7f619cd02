//! What an agent holds while it is in the job: the [`Handle`] (generations, fencing, commits,
//! drain and restart requests, finish and leave) and the [`Snapshot`] its driver publishes.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use etcd_client::{Client, PutOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::RendezvousConfig;
use super::commit::Reporter;
use super::ops;
use super::state::{job_state_error, write_state};
use crate::keys::Keys;
use crate::record::{CommitRecord, Generation, JobState, Outcome, WaitingRecord};
use crate::{Error, Result};

/// What a handle knows about the job right now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The newest generation seen (it may not include this node).
    pub generation: Option<Arc<Generation>>,
    pub leader: Option<String>,
    pub latest_commit: Option<CommitRecord>,
    /// Nodes that announced they leave soon.
    pub draining: BTreeSet<String>,
    pub job_state: Option<JobState>,
    /// Set while the current generation is broken (members lost) and the job waits below
    /// `min` for replacements: stop the workers.
    pub waiting: Option<WaitingRecord>,
}

/// One node's membership in a job. Dropping it stops renewing the lease (peers see the node
/// leave after the TTL); call [`Handle::leave`] to leave at once.
pub struct Handle {
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) cfg: RendezvousConfig,
    pub(super) lease_id: i64,
    pub(super) snapshot_rx: watch::Receiver<Snapshot>,
    pub(super) fenced_rx: watch::Receiver<Option<String>>,
    pub(super) cancel: CancellationToken,
    /// `(number, created_unix_ms)` of the generation last returned by `next_generation`.
    pub(super) last_returned: Option<(u64, u64)>,
    pub(super) compacted_watches: Arc<AtomicU64>,
    /// The newest step [`Handle::note_commit`] was given, plus one (0: none).
    pub(super) known_commit: Arc<AtomicU64>,
    pub(super) reporter: Arc<Reporter>,
    /// Feeds the background reporter: the newest step given to `record_commit`, plus one,
    /// and the generation that saved it.
    pub(super) newest_commit_tx: watch::Sender<(u64, Option<u64>)>,
    pub(super) tasks: Vec<JoinHandle<()>>,
    pub(super) span: tracing::Span,
}

impl Handle {
    /// This node's lease id.
    pub fn lease_id(&self) -> i64 {
        self.lease_id
    }

    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// What this node knows now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_rx.borrow().clone()
    }

    /// A receiver that changes whenever the snapshot does.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.snapshot_rx.clone()
    }

    /// How many times this handle's watch fell behind an etcd compaction (and re-read the job
    /// instead). For metrics (`..._total`) and tests.
    pub fn watch_compactions_total(&self) -> u64 {
        self.compacted_watches.load(Ordering::Relaxed)
    }

    /// Whether this node leads now.
    pub fn is_leader(&self) -> bool {
        self.snapshot_rx.borrow().leader.as_deref() == Some(self.cfg.node_id.as_str())
    }

    /// Resolves with the next generation that includes this node (one not returned before).
    /// Fails with [`Error::Fenced`], [`Error::JobFinished`] or [`Error::JobFailed`].
    /// Cancel-safe.
    ///
    /// A generation without this node (a spare beyond `max`, or a node that drained) is not
    /// returned; an agent that must stop its workers on *any* new generation watches
    /// [`Handle::subscribe`] as well.
    pub async fn next_generation(&mut self) -> Result<Generation> {
        let mut rx = self.snapshot_rx.clone();
        let mut fenced = self.fenced_rx.clone();
        loop {
            if let Some(reason) = fenced.borrow().clone() {
                return Err(self.fenced_error(reason));
            }
            {
                let s = rx.borrow_and_update();
                if let Some(st) = &s.job_state {
                    return Err(job_state_error(&self.cfg.job_id, st));
                }
                if let Some(g) = &s.generation {
                    let id = (g.number, g.created_unix_ms);
                    if self.last_returned != Some(id) && g.member(&self.cfg.node_id).is_some() {
                        self.last_returned = Some(id);
                        let g = Generation::clone(g);
                        self.span.record("generation", g.number);
                        tracing::info!(parent: &self.span, world_size = g.world_size, rank_offset = g.member(&self.cfg.node_id).map(|(_, m)| m.rank_offset), "joined generation");
                        return Ok(g);
                    }
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() {
                    if let Some(reason) = fenced.borrow().clone() {
                        return Err(self.fenced_error(reason));
                    }
                    return Err(Error::Cancelled { op: "next_generation" });
                },
                _ = fenced.changed() => {}
            }
        }
    }

    /// Records `g` as joined without [`Handle::next_generation`] (the agent's workers switched
    /// to it in place), so that `next_generation` does not return it again.
    pub fn mark_joined(&mut self, g: &Generation) {
        if g.member(&self.cfg.node_id).is_some() {
            self.last_returned = Some((g.number, g.created_unix_ms));
            self.span.record("generation", g.number);
        }
    }

    /// Resolves when this node's lease is lost or could not be renewed in time; the error
    /// says why. Resolves before the TTL ends, so the agent can stop its workers before peers
    /// re-form the job. Cancel-safe; use it in `select!`.
    pub async fn fenced(&self) -> Error {
        let mut rx = self.fenced_rx.clone();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return self.fenced_error(reason);
            }
            if rx.changed().await.is_err() {
                // The keeper ended without fencing: the handle was closed.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether the node is fenced now.
    pub fn is_fenced(&self) -> bool {
        self.fenced_rx.borrow().is_some()
    }

    fn fenced_error(&self, reason: String) -> Error {
        Error::Fenced {
            job: self.cfg.job_id.clone(),
            node: self.cfg.node_id.clone(),
            reason,
        }
    }

    /// Tells this node's rendezvous that `step` is committed in the store, without asking
    /// etcd. Should this node freeze the next generation before etcd records the commit (the
    /// report failed while etcd was down, or is still on its way), that generation records it
    /// and resumes from it. Give only steps seen committed in the job's store.
    pub fn note_commit(&self, step: u64) {
        self.known_commit
            .fetch_max(step.saturating_add(1), Ordering::AcqRel);
    }

    /// Records `step` as the newest committed checkpoint step, unless a newer one is already
    /// recorded. Used for `AfterCommit` admission and for the next generation's resume step.
    /// Notes it first ([`Handle::note_commit`]), so a report that fails is not forgotten.
    /// Waits for etcd (up to one lease TTL plus a grace); a loop that must not wait uses
    /// [`Handle::record_commit`]. `generation` is the generation whose workers saved the step,
    /// when known: the leader re-forms a generation frozen with an older resume step than a
    /// step its predecessor committed afterwards.
    pub async fn report_commit(&self, step: u64, generation: Option<u64>) -> Result<()> {
        self.note_commit(step);
        self.reporter.report(step, generation).await
    }

    /// Notes `step` ([`Handle::note_commit`]) and has the handle's background task record it
    /// (with `generation`, as in [`Handle::report_commit`]) in etcd, without waiting. Steps
    /// given while a report is on its way are folded into the next one: only the newest is
    /// recorded.
    pub fn record_commit(&self, step: u64, generation: Option<u64>) {
        self.note_commit(step);
        let want = step.saturating_add(1);
        self.newest_commit_tx.send_if_modified(|v| {
            let newer = want > v.0;
            if newer {
                *v = (want, generation);
            }
            newer
        });
    }

    /// Announces that this node leaves soon (preemption). Peers see it at once in
    /// [`Snapshot::draining`]; the leader keeps the generation until the node is gone.
    pub async fn request_drain(&self) -> Result<()> {
        let key = self.keys.drain(&self.cfg.node_id);
        let mut client = self.client.clone();
        ops::bounded(
            "drain",
            &key,
            self.cfg.connect.request_timeout_ms,
            client.put(
                key.clone(),
                Vec::new(),
                Some(PutOptions::new().with_lease(self.lease_id)),
            ),
        )
        .await?;
        tracing::info!(parent: &self.span, "drain announced");
        Ok(())
    }

    /// Asks for the whole job to restart in a new generation, because this node's workers
    /// failed in `generation` (the number of the generation they ran). Every node then gets a
    /// new generation with the same members in the same order (draining ones left out, waiting
    /// ones admitted up to `max`), the newest commit as resume step and, where rank 0 reserved
    /// a spare, a master port other than the previous generation's.
    ///
    /// The leader acts at once (no settle window) on a request naming the current generation.
    /// A request naming an older one is ignored: that generation was already restarted or
    /// re-formed. So several nodes asking for the same generation give one new generation.
    ///
    /// The request is a small record at `ctl/restart/<node>` under this node's lease: it goes
    /// with the node. `reason` is kept to [`REASON_BYTES_MAX`](crate::record::REASON_BYTES_MAX) bytes.
    /// Returns once etcd stored it; watch [`Handle::next_generation`] for the outcome.
    pub async fn request_restart(&self, generation: u64, reason: &str) -> Result<()> {
        let key = self.keys.restart(&self.cfg.node_id);
        self.member_request(&key, generation, reason).await?;
        tracing::info!(parent: &self.span, generation, reason, "restart requested");
        Ok(())
    }

    /// Asks the leader to regroup generation `generation` now: this node's workers saw a
    /// collective fail, so a peer may be gone. Every live member confirms (its rendezvous task
    /// does, on seeing the request); after the confirmation window the leader re-forms the job
    /// with the members that confirmed, without waiting for a lost node's lease to lapse.
    pub async fn request_regroup(&self, generation: u64, reason: &str) -> Result<()> {
        let key = self.keys.regroup(&self.cfg.node_id);
        self.member_request(&key, generation, reason).await?;
        tracing::info!(parent: &self.span, generation, reason, "regroup requested");
        Ok(())
    }

    async fn member_request(&self, key: &str, generation: u64, reason: &str) -> Result<()> {
        if let Some(why) = self.fenced_rx.borrow().clone() {
            return Err(self.fenced_error(why));
        }
        let mut client = self.client.clone();
        ops::put_member_request(
            &mut client,
            key,
            &self.cfg.node_id,
            self.lease_id,
            generation,
            reason,
            self.cfg.connect.request_timeout_ms,
        )
        .await
    }

    /// Marks the job finished (every agent's `next_generation` then fails with
    /// [`Error::JobFinished`]). The state key outlives the job for a day, for `status`.
    pub async fn finish(&self, success: bool) -> Result<()> {
        let mut client = self.client.clone();
        let (outcome, reason) = if success {
            (Outcome::Succeeded, "finished")
        } else {
            (Outcome::Failed, "finished with failure")
        };
        write_state(
            &mut client,
            &self.keys,
            outcome,
            reason,
            None,
            self.cfg.connect.request_timeout_ms,
        )
        .await
    }

    /// Leaves at once: stops the background tasks and revokes the lease, which deletes this
    /// node's keys in one etcd revision so peers see it within milliseconds.
    pub async fn leave(mut self) -> Result<()> {
        self.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        if self.is_fenced() {
            // The lease is gone or going, and the keeper already tried to revoke it.
            return Ok(());
        }
        let mut client = self.client.clone();
        ops::bounded(
            "lease revoke",
            &self.keys.member(&self.cfg.node_id),
            self.cfg.connect.request_timeout_ms,
            client.lease_revoke(self.lease_id),
        )
        .await?;
        tracing::info!(parent: &self.span, "left");
        Ok(())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
