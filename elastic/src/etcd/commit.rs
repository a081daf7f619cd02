//! Recording checkpoint commits in `ctl/commit`: the report itself ([`Reporter::report`]) and
//! the background task that records the newest commit without holding up its caller (third
//! background task of a handle).
//!
//! An agent's loop must never wait on etcd to go on training: while etcd is unreachable from
//! this node (a partition, a blackhole) a report takes up to its whole budget, and a loop that
//! awaited it would hold the workers' next checkpoint, their signals and the fence behind it.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Txn, TxnOp};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::RendezvousConfig;
use super::ops;
use crate::keys::Keys;
use crate::record::{self, CommitRecord, LeaderRecord};
use crate::{Error, Result};

/// How long past one lease TTL a report keeps trying through a leader change (the commit key
/// hangs on the leader's lease) or concurrent writers.
const COMMIT_GRACE_MS: u64 = 2_000;
const COMMIT_RETRY_PAUSE_MS: u64 = 100;
/// The background task's pause after a failed report, and how many reports of one step it
/// makes at most.
const RETRY_PAUSE_MS: u64 = 1_000;
const RETRIES_MAX: u32 = 10;

/// What a report needs of the handle, shared with the background task.
pub(super) struct Reporter {
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) cfg: RendezvousConfig,
    pub(super) fenced_rx: watch::Receiver<Option<String>>,
    pub(super) span: tracing::Span,
}

impl Reporter {
    pub(super) fn fenced_error(&self, reason: String) -> Error {
        Error::Fenced {
            job: self.cfg.job_id.clone(),
            node: self.cfg.node_id.clone(),
            reason,
        }
    }

    /// Records `step`, saved by the workers of `generation` (when known), in `ctl/commit`
    /// unless a newer step is recorded already. Gives up after one lease TTL plus
    /// [`COMMIT_GRACE_MS`], or at once when this node is fenced.
    pub(super) async fn report(&self, step: u64, generation: Option<u64>) -> Result<()> {
        let mut client = self.client.clone();
        let timeout_ms = self.cfg.connect.request_timeout_ms;
        let commit_key = self.keys.commit();
        let budget_ms = self.cfg.lease_ttl_ms + COMMIT_GRACE_MS;
        let give_up_at = Instant::now() + Duration::from_millis(budget_ms);
        while Instant::now() < give_up_at {
            if let Some(reason) = self.fenced_rx.borrow().clone() {
                return Err(self.fenced_error(reason));
            }
            let txn = Txn::new().and_then([
                TxnOp::get(self.keys.leader(), None),
                TxnOp::get(commit_key.clone(), None),
            ]);
            let resp =
                ops::bounded("read commit", &commit_key, timeout_ms, client.txn(txn)).await?;
            let mut leader: Option<LeaderRecord> = None;
            let mut current: Option<(CommitRecord, i64)> = None;
            for (i, op) in resp.op_responses().into_iter().enumerate() {
                if let etcd_client::TxnOpResponse::Get(g) = op
                    && let Some(kv) = g.kvs().first()
                {
                    if i == 0 {
                        leader = Some(record::parse(&self.keys.leader(), kv.value())?);
                    } else {
                        current =
                            Some((record::parse(&commit_key, kv.value())?, kv.mod_revision()));
                    }
                }
            }
            if let Some((c, _)) = &current
                && c.step >= step
            {
                return Ok(());
            }
            if let Some(leader) = leader {
                let record = CommitRecord {
                    version: record::RECORD_VERSION,
                    step,
                    committed_unix_ms: ops::now_unix_ms(),
                    node_id: self.cfg.node_id.clone(),
                    generation,
                };
                let prev = current.as_ref().map_or(0, |(_, rev)| *rev);
                if ops::write_commit(&mut client, &self.keys, &leader, prev, &record, timeout_ms)
                    .await?
                {
                    tracing::info!(parent: &self.span, step, "commit recorded");
                    return Ok(());
                }
            }
            // No leader right now (takeover) or a concurrent writer: read again.
            tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_PAUSE_MS)).await;
        }
        Err(Error::Timeout {
            op: "report_commit",
            after_ms: budget_ms,
        })
    }
}

/// The background task: records the newest step put into `newest` (the step plus one; 0 for
/// none; with the generation that saved it), one report at a time. Steps that arrive while a report is on its way are folded
/// into the next report, so a slow etcd costs reports, never a queue. A report that fails is
/// logged and tried again [`RETRY_PAUSE_MS`] later, at most [`RETRIES_MAX`] times per step
/// (a newer step starts again); meanwhile the node's rendezvous knows the step already, and a
/// generation this node freezes records it.
pub(super) async fn report_in_background(
    reporter: Arc<Reporter>,
    mut newest: watch::Receiver<(u64, Option<u64>)>,
    cancel: CancellationToken,
) {
    let mut recorded = 0u64;
    let mut failed: Option<(u64, u32)> = None;
    loop {
        let retry = matches!(failed, Some((_, n)) if n < RETRIES_MAX);
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = newest.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)), if retry => {}
        }
        let (want, generation) = *newest.borrow_and_update();
        if want <= recorded {
            continue;
        }
        let step = want - 1;
        tokio::select! {
            _ = cancel.cancelled() => return,
            r = reporter.report(step, generation) => match r {
                Ok(()) => {
                    recorded = want;
                    failed = None;
                }
                Err(e @ Error::Fenced { .. }) => {
                    tracing::warn!(parent: &reporter.span, step, error = %e, "cannot record the commit in etcd: fenced");
                    return;
                }
                Err(e) => {
                    let attempts = match failed {
                        Some((s, n)) if s == want => n + 1,
                        _ => 1,
                    };
                    failed = Some((want, attempts));
                    tracing::warn!(parent: &reporter.span, step, attempts, error = %e, "cannot record the commit in etcd");
                }
            },
        }
    }
}
