//! After a worker group ended: [`decide::after_group`] says what the ending means, and this
//! carries it out (commit what was staged, report it, leave, restart, or run on).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use elastic::Generation;

use super::committer::{BETWEEN_GENERATIONS_FLUSH_MS, flush};
use super::decide::{self, Action, AfterGroup, DrainOf, Ended, FailureSeen, Reason};
use super::group::GroupEnd;
use super::membership::{Membership, failure_counts, fenced_metrics, leave};
use super::{Agent, FLUSH_TIMEOUT_MS};
use crate::events::Event;
use crate::notice;
use crate::state::AgentState;
use crate::supervisor::{Outcome, WorkerFailure};
use crate::worker_env::GenerationView;

impl Agent {
    /// Decides and does what follows the end of `view`'s worker group. Breaks with the exit
    /// code when the node is done.
    pub(super) async fn after_group(
        &mut self,
        end: GroupEnd,
        view: &GenerationView,
        running_gen: Option<&Arc<Generation>>,
    ) -> Result<ControlFlow<u8>> {
        let GroupEnd {
            outcome, stop_why, ..
        } = end;
        let local_drain = self.drain.filter(|d| d.of == DrainOf::Local);
        if let Outcome::Failed(f) = &outcome {
            if local_drain.is_some() {
                tracing::warn!(
                    rank = f.rank,
                    exit_code = f.exit_code,
                    "a worker failed while draining"
                );
            } else {
                self.node.events.emit(Event::WorkerFailed {
                    generation: view.generation,
                    rank: f.rank,
                    exit_code: f.exit_code,
                });
            }
        }
        let mut input = AfterGroup {
            ended: match &outcome {
                Outcome::Succeeded => Ended::Succeeded,
                Outcome::Drained { clean } => Ended::Drained { clean: *clean },
                Outcome::Stopped => Ended::Stopped,
                Outcome::Failed(_) => Ended::Failed,
            },
            drain: self.drain.map(|d| d.of),
            peer_stop: self.node.state.peer_stop().is_some(),
            etcd: matches!(self.membership, Membership::Etcd(_)),
            stop_why,
            failure: FailureSeen::Unknown,
            restarts: self.restarts,
            max_restarts: self.node.max_restarts,
        };
        let mut d = decide::after_group(&input);
        if d.action == Action::WatchMembership
            && let (Membership::Etcd(m), Some(g)) = (&mut self.membership, running_gen)
        {
            input.failure = if failure_counts(m, g, &mut self.signals).await {
                FailureSeen::SameMembers
            } else {
                FailureSeen::MembershipChanged
            };
            d = decide::after_group(&input);
        }
        tracing::debug!(action = ?d.action, reason = ?d.reason, "after the worker group");
        let committer = &mut self.committer;
        match d.action {
            // A local drain ends the node however the workers ended: commit what they staged,
            // say so, leave.
            Action::Leave { clean } => {
                let started = local_drain.map(|d| d.started);
                let left = |limit: Duration| match started {
                    Some(t) => limit.saturating_sub(t.elapsed()),
                    None => limit,
                };
                let flushed = flush(committer, left(self.node.grace)).await;
                if let Membership::Etcd(m) = &mut self.membership
                    && let Some(point) = committer.latest_point()
                {
                    m.report(point).await;
                }
                let step = committer.latest();
                if let Membership::Etcd(m) = &self.membership
                    && m.is_member()
                {
                    self.node.events.emit(Event::Left {
                        step,
                        workers_running: false,
                    });
                }
                let _ = leave(&mut self.membership).await;
                // Committed (or out of grace) and gone from the job: the machine may go now.
                if let Some(a) = self.approval.take() {
                    notice::approve(&a, &self.node.state.metrics).await;
                }
                if clean && flushed {
                    tracing::info!(step, "drained: workers saved and exited");
                    return Ok(ControlFlow::Break(0));
                }
                tracing::error!(
                    workers_clean = clean,
                    checkpoints_flushed = flushed,
                    "drain incomplete"
                );
                Ok(ControlFlow::Break(128 + libc::SIGTERM as u8))
            }
            Action::Finish => {
                tracing::info!("workers finished");
                let flushed = flush(committer, Duration::from_millis(FLUSH_TIMEOUT_MS)).await;
                if let Membership::Etcd(m) = &mut self.membership {
                    if let Some(point) = committer.latest_point() {
                        m.report(point).await;
                    }
                    if let Some(h) = &m.handle
                        && let Err(e) = h.finish(true).await
                    {
                        tracing::warn!(error = %e, "cannot mark the job finished");
                    }
                }
                let _ = leave(&mut self.membership).await;
                Ok(ControlFlow::Break(if flushed { 0 } else { 1 }))
            }
            // A peer's drain: our workers saved the agreed step too; commit it and wait for
            // the generation without the peer. The workers may be the first to know (they
            // agree on stopping among themselves while etcd is unreachable).
            Action::NextAfterPeerDrain { clean } => {
                if d.reason == Reason::PeerStopUnheard {
                    tracing::warn!(
                        step = self.node.state.peer_stop(),
                        "workers stopped for a drain of another node that this one did not hear of; waiting for the next generation"
                    );
                }
                let _ = flush(committer, self.node.grace).await;
                if let Membership::Etcd(m) = &mut self.membership
                    && let Some(point) = committer.latest_point()
                {
                    m.report(point).await;
                }
                tracing::info!(
                    step = committer.latest(),
                    clean,
                    "peer drain done; waiting for the next generation"
                );
                self.drain = None;
                Ok(ControlFlow::Continue(()))
            }
            Action::Abort => {
                tracing::error!("workers drained without a drain");
                let _ = leave(&mut self.membership).await;
                Ok(ControlFlow::Break(1))
            }
            Action::Regroup { rejoin } => {
                self.drain = None;
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if rejoin && let Membership::Etcd(m) = &mut self.membership {
                    if let Some(h) = m.handle.take() {
                        drop(h);
                    }
                    m.rejoin(&self.node).await?;
                    fenced_metrics(&self.node.state, false);
                }
                Ok(ControlFlow::Continue(()))
            }
            Action::NextUncounted if d.reason == Reason::FailedDuringPeerDrain => {
                if let Outcome::Failed(f) = &outcome {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "a worker failed during a peer's drain"
                    );
                }
                let _ = flush(committer, self.node.grace).await;
                self.drain = None;
                Ok(ControlFlow::Continue(()))
            }
            // WatchMembership was answered above; etcd mode without a generation (never) is
            // taken as a membership change.
            Action::NextUncounted | Action::WatchMembership => {
                if let Outcome::Failed(f) = &outcome {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "worker failed with a membership change; not counted as a restart"
                    );
                }
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                Ok(ControlFlow::Continue(()))
            }
            Action::FailJob => {
                // `after_group` fails the job only for a failure (the sweep checks it).
                let f = failure(&outcome);
                tracing::error!(
                    rank = f.map(|f| f.rank),
                    exit_code = f.map(|f| f.exit_code),
                    restarts = self.restarts,
                    "job failed"
                );
                if let Some(f) = f {
                    // After the workers' last teed lines, then torchrun's root-cause summary.
                    crate::output::flush(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS)).await;
                    eprintln!("elastic-run: {f}");
                    let name = crate::supervisor::entrypoint_name(&self.node.sup_cfg.argv);
                    eprintln!("{}", f.summary(&name, &crate::supervisor::host_name()));
                }
                let _ = flush(
                    committer,
                    Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
                )
                .await;
                if let Membership::Etcd(m) = &mut self.membership
                    && let Some(h) = &m.handle
                    && let Err(e) = h.finish(false).await
                {
                    tracing::warn!(error = %e, "cannot mark the job failed");
                }
                let _ = leave(&mut self.membership).await;
                Ok(ControlFlow::Break(
                    f.and_then(|f| u8::try_from(f.exit_code).ok())
                        .filter(|c| *c != 0)
                        .unwrap_or(1),
                ))
            }
            Action::Restart => {
                self.restarts += 1;
                let why = failure(&outcome).map(|f| {
                    note_restart(&self.node.state, f, self.restarts, self.node.max_restarts);
                    f.to_string()
                });
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if let Membership::Etcd(m) = &mut self.membership
                    && let Some(h) = &m.handle
                    && let Err(e) = h
                        .request_restart(view.generation, why.as_deref().unwrap_or("restart"))
                        .await
                {
                    tracing::warn!(error = %e, "cannot request a restart generation");
                }
                Ok(ControlFlow::Continue(()))
            }
        }
    }
}

fn failure(outcome: &Outcome) -> Option<&WorkerFailure> {
    match outcome {
        Outcome::Failed(f) => Some(f),
        _ => None,
    }
}

/// Counts and logs a restart of the worker group after `failure` (restart number `restart`).
fn note_restart(state: &AgentState, failure: &WorkerFailure, restart: u32, max_restarts: u32) {
    state
        .metrics
        .worker_restarts_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(
        rank = failure.rank,
        exit_code = failure.exit_code,
        restart,
        max_restarts,
        "worker failed; restarting the group: {}",
        failure.message.lines().last().unwrap_or("")
    );
}
