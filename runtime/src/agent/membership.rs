//! The job's membership as this node follows it: one fixed view (standalone, static) or an
//! etcd member ([`EtcdMember`]) that joins, rejoins after a fence, reports commits, waits for
//! the next generation that includes this node, tells a worker failure from a membership
//! change, and leaves.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use elastic::{Generation, Handle, Rendezvous, RendezvousConfig, Snapshot};
use tokio::sync::{mpsc, watch};

use super::Node;
use super::committer::{CommitPoint, Committer};
use super::config::explain_etcd_error;
use crate::events::{DrainReason, Event, Events};
use crate::notice;
use crate::state::AgentState;
use crate::worker_env::GenerationView;

/// Added to lease TTL + settle while a node whose workers failed waits for a membership change.
const FAILURE_SETTLE_EXTRA_MS: u64 = 1_000;
/// Pause between attempts to join again after a fence, and how long it keeps trying.
const REJOIN_PAUSE_MS: u64 = 1_000;
const REJOIN_DEADLINE_MS: u64 = 30 * 60_000;
/// How long a rejoin waits for the store's newest committed step.
const REJOIN_BUCKET_READ_MS: u64 = 10_000;

/// The job's membership as this node follows it.
pub(super) enum Membership {
    /// Standalone or static: one view forever.
    Fixed(GenerationView),
    Etcd(Box<EtcdMember>),
}

pub(super) struct EtcdMember {
    pub(super) cfg: RendezvousConfig,
    /// `None` after a fence, until the node joined again.
    pub(super) handle: Option<Handle>,
    pub(super) snap: watch::Receiver<Snapshot>,
    /// The newest committed step read from the store at start: the resume step of a first
    /// generation that names none.
    pub(super) bucket_latest: Option<u64>,
    /// The highest step reported to etcd.
    pub(super) reported: Option<u64>,
    /// The highest step given to `report` (seen committed), recorded in etcd or not: told
    /// again to the handle of a rejoin.
    pub(super) committed: Option<u64>,
}

impl EtcdMember {
    pub(super) async fn join(cfg: RendezvousConfig, events: &Events) -> Result<Self> {
        let handle = Rendezvous::join(cfg.clone())
            .await
            .map_err(|e| explain_etcd_error(e, &cfg.connect, &cfg.job_id))
            .with_context(|| {
                format!(
                    "join job {} at {}",
                    cfg.job_id,
                    cfg.connect.endpoints.join(",")
                )
            })?;
        tracing::info!(addr = %cfg.addr, lease = handle.lease_id(), "joined the job");
        events.emit(Event::Joined {
            addr: cfg.addr.clone(),
            rejoin: false,
        });
        let snap = handle.subscribe();
        Ok(EtcdMember {
            cfg,
            handle: Some(handle),
            snap,
            bucket_latest: None,
            reported: None,
            committed: None,
        })
    }

    /// Joins again after a fence, until it works or the deadline passes. The store's newest
    /// committed step is read before each attempt: while this node was out, the others may
    /// have committed newer steps, retired the ones it knows of, and left, taking `ctl/commit`
    /// (held on their leader's lease) with them. Should this node lead the next generation alone, it resumes
    /// from the store's newest step, not from a step it saw before the fence.
    pub(super) async fn rejoin(&mut self, node: &Node) -> Result<()> {
        let events = &node.events;
        let deadline = Instant::now() + Duration::from_millis(REJOIN_DEADLINE_MS);
        loop {
            // Read before each attempt, so that it is fresh when the join succeeds.
            if let Some(step) = bucket_latest_bounded(node).await {
                self.committed = self.committed.max(Some(step));
                self.bucket_latest = self.bucket_latest.max(Some(step));
            }
            match Rendezvous::join(self.cfg.clone()).await {
                Ok(h) => {
                    tracing::info!(lease = h.lease_id(), "joined the job again");
                    events.emit(Event::Joined {
                        addr: self.cfg.addr.clone(),
                        rejoin: true,
                    });
                    self.snap = h.subscribe();
                    if let Some(step) = self.committed {
                        h.note_commit(step);
                    }
                    self.handle = Some(h);
                    self.reported = None;
                    return Ok(());
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot join the job again yet; retrying");
                    tokio::time::sleep(Duration::from_millis(REJOIN_PAUSE_MS)).await;
                }
                Err(e) => return Err(e).context("join the job again after a fence"),
            }
        }
    }

    /// Reports `step` as committed, once, best-effort (the commit itself is durable already).
    /// A report that fails is still known to this node's rendezvous: should it lead the next
    /// generation, that generation records the commit and resumes from it.
    pub(super) async fn report(&mut self, point: CommitPoint) {
        let step = point.step;
        self.committed = self.committed.max(Some(step));
        if self.reported.is_some_and(|r| r >= step) {
            return;
        }
        if let Some(h) = &self.handle {
            match h.report_commit(step, point.generation).await {
                Ok(()) => self.reported = Some(step),
                Err(e) => tracing::warn!(step, error = %e, "cannot record the commit in etcd"),
            }
        }
    }

    /// A draining node whose workers' last step is `point`, committed: reports it, and says
    /// whether etcd recorded it, so that the node may leave at once and peers re-form from that
    /// step without waiting for this node's workers to finish exiting.
    pub(super) async fn report_for_leave(&mut self, point: CommitPoint) -> bool {
        self.report(point).await;
        self.handle.is_some() && self.reported.is_some_and(|r| r >= point.step)
    }

    /// Whether this node is still a member of the job (it has not left, and is not fenced
    /// out waiting to join again).
    pub(super) fn is_member(&self) -> bool {
        self.handle.is_some()
    }

    /// As [`EtcdMember::report`], without waiting: the handle's background task records the
    /// step in etcd. For loops that must stay responsive (signals, fences, the next part)
    /// while etcd is slow or unreachable from this node.
    pub(super) fn report_soon(&mut self, point: CommitPoint) {
        let step = point.step;
        self.committed = self.committed.max(Some(step));
        if self.reported.is_some_and(|r| r >= step) {
            return;
        }
        if let Some(h) = &self.handle {
            h.record_commit(step, point.generation);
        }
    }

    /// Whether a generation newer than `generation` is frozen, or comes within `wait_ms`
    /// while etcd records a commit newer than `step` (the leader re-forms a generation whose
    /// resume step the previous generation's pipeline overtook). Used when `step` no longer
    /// restores: retention removed it after those newer commits.
    pub(super) async fn superseded(&self, generation: u64, step: u64, wait_ms: u64) -> bool {
        let Some(h) = &self.handle else { return false };
        let mut rx = h.subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
        loop {
            {
                let snap = rx.borrow_and_update();
                if snap
                    .generation
                    .as_ref()
                    .is_some_and(|g| g.number > generation)
                {
                    return true;
                }
                if snap.latest_commit.as_ref().is_none_or(|c| c.step <= step) {
                    return false;
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    pub(super) fn settle_for_failure(&self) -> Duration {
        Duration::from_millis(self.cfg.lease_ttl_ms + self.cfg.settle_ms + FAILURE_SETTLE_EXTRA_MS)
    }
}

/// What ended a wait for the next generation.
pub(super) enum Next {
    Run(Box<GenerationView>, Option<Arc<Generation>>),
    Exit(u8),
}

/// The store's newest committed step, read within [`REJOIN_BUCKET_READ_MS`]; `None` (with a
/// warning) when the store cannot say in time: the rejoin goes on with the steps this node
/// knows of.
async fn bucket_latest_bounded(node: &Node) -> Option<u64> {
    let cancel = checkpoint::CancellationToken::new();
    let read = tokio::time::timeout(
        Duration::from_millis(REJOIN_BUCKET_READ_MS),
        node.sink.latest_step(&cancel),
    )
    .await;
    cancel.cancel();
    match read {
        Ok(Ok(step)) => {
            if let Some(step) = step {
                tracing::debug!(step, url = %node.sink.url(), "newest committed step in the checkpoint store");
            }
            step
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot read the newest committed step before joining again");
            None
        }
        Err(_) => {
            tracing::warn!(
                timeout_ms = REJOIN_BUCKET_READ_MS,
                "the newest committed step was not read in time before joining again"
            );
            None
        }
    }
}

/// Waits for the next generation that includes this node (etcd mode).
pub(super) async fn wait_generation(
    node: &Node,
    m: &mut EtcdMember,
    signals: &mut mpsc::Receiver<i32>,
    notices: &mut mpsc::Receiver<notice::Notice>,
    committer: &Committer,
) -> Result<Next> {
    loop {
        if m.handle.is_none() {
            m.rejoin(node).await?;
            fenced_metrics(&node.state, false);
        }
        let mut committed = committer.committed.clone();
        let h = m.handle.as_mut().expect("joined");
        let r = tokio::select! {
            r = h.next_generation() => r,
            Some(sig) = signals.recv() => {
                tracing::warn!(signal = sig, "signal while no workers run; leaving");
                node.events.emit(Event::DrainStarted { reason: DrainReason::Signal });
                return Ok(Next::Exit(leave_etcd(m).await));
            }
            Some(n) = notices.recv() => {
                let notice::Notice::Preempt { why, approval } = n else {
                    // A rebalance recommendation: nothing runs, so nothing to checkpoint.
                    continue;
                };
                tracing::warn!(notice = %why, "preemption notice while no workers run; leaving");
                node.events.emit(Event::DrainStarted { reason: DrainReason::Notice });
                let code = leave_etcd(m).await;
                if let Some(a) = approval {
                    notice::approve(&a, &node.state.metrics).await;
                }
                return Ok(Next::Exit(code));
            }
            Ok(()) = committed.changed() => {
                if let Some(point) = *committed.borrow() {
                    m.report_soon(point);
                }
                continue;
            }
        };
        match r {
            Ok(g) => {
                let view = generation_view(node, &g)?;
                return Ok(Next::Run(Box::new(view), Some(Arc::new(g))));
            }
            Err(elastic::Error::JobFinished { success, .. }) => {
                tracing::info!(success, "the job is over");
                let _ = leave_etcd(m).await;
                return Ok(Next::Exit(if success { 0 } else { 1 }));
            }
            Err(elastic::Error::JobFailed { reason, .. }) => {
                tracing::error!(%reason, "the job failed");
                eprintln!("elastic-run: job failed: {reason}");
                let _ = leave_etcd(m).await;
                return Ok(Next::Exit(1));
            }
            Err(e @ elastic::Error::Fenced { .. }) => {
                tracing::error!(error = %e, "fenced while waiting; joining again");
                node.events.emit(Event::Fenced {
                    reason: e.to_string(),
                });
                fenced_metrics(&node.state, true);
                m.handle = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "waiting for a generation failed; retrying");
                tokio::time::sleep(Duration::from_millis(REJOIN_PAUSE_MS)).await;
            }
        }
    }
}

/// This node's view of an etcd generation.
pub(super) fn generation_view(node: &Node, g: &Generation) -> Result<GenerationView> {
    let Some((rank, me)) = g.member(&node.node_id) else {
        bail!("generation {} does not include this node", g.number);
    };
    if me.nproc != node.nproc {
        bail!(
            "generation {} lists {} workers for this node, it runs {}",
            g.number,
            me.nproc,
            node.nproc
        );
    }
    Ok(GenerationView {
        generation: g.number,
        world_size: g.world_size,
        node_rank: rank as u32,
        node_count: g.members.len() as u32,
        rank_offset: me.rank_offset,
        master_addr: g.master_addr.clone(),
        master_port: g.master_port,
        scaling: g.scaling.clone(),
        resume: None,
        heal_step: None,
    })
}

/// After a worker failure in etcd mode: waits for a membership change. Returns whether the
/// failure counts as a restart (no change, or a restart generation with the same members).
pub(super) async fn failure_counts(
    m: &mut EtcdMember,
    g: &Generation,
    signals: &mut mpsc::Receiver<i32>,
) -> bool {
    let limit = m.settle_for_failure();
    let mut rx = m.snap.clone();
    let same = |snap: &Snapshot| -> Option<bool> {
        let newest = snap.generation.as_ref()?;
        // Ordered by number, as `must_stop` does: leaders' clocks may be skewed.
        if newest.number <= g.number {
            return None;
        }
        let a: BTreeSet<String> = newest.node_ids().into_iter().collect();
        let b: BTreeSet<String> = g.node_ids().into_iter().collect();
        Some(a == b)
    };
    let wait = async {
        loop {
            if let Some(s) = same(&rx.borrow_and_update()) {
                return s;
            }
            if rx.changed().await.is_err() {
                return true;
            }
        }
    };
    tokio::select! {
        s = tokio::time::timeout(limit, wait) => s.unwrap_or(true),
        // A signal now: let the next wait handle it (it leaves); count nothing.
        Some(_) = signals.recv() => false,
    }
}

/// Records a lost lease (`fenced`) or a live one.
pub(super) fn fenced_metrics(state: &AgentState, fenced: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    state
        .metrics
        .lease_healthy
        .store(u64::from(!fenced), Relaxed);
    if fenced {
        state.metrics.fences_total.fetch_add(1, Relaxed);
    }
}

/// Leaves the job at once (revoking the lease) in etcd mode; returns exit code 0.
pub(super) async fn leave(membership: &mut Membership) -> u8 {
    match membership {
        Membership::Etcd(m) => leave_etcd(m).await,
        Membership::Fixed(_) => 0,
    }
}

async fn leave_etcd(m: &mut EtcdMember) -> u8 {
    if let Some(h) = m.handle.take()
        && let Err(e) = h.leave().await
    {
        tracing::warn!(error = %e, "leaving the job failed; peers see it after the lease TTL");
    }
    0
}
