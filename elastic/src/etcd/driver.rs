//! The per-handle task: keeps a [`View`] of the job from a read and a watch, publishes it as
//! the handle's [`Snapshot`], campaigns when there is no leader, and re-syncs on a leadership
//! change, a compaction or a lost watch. While leading it hands each change to
//! [`Driver::lead`] (`leader.rs`); the `ctl/epoch` upkeep is in `epoch.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::ops::{self, bounded};
use super::view::View;
use super::{RendezvousConfig, Snapshot};
use crate::core::Tracker;
use crate::keys::Keys;
use crate::{Error, Result};

/// Pause bounds between re-sync attempts while etcd is unreachable.
const RESYNC_PAUSE_MIN_MS: u64 = 50;
const RESYNC_PAUSE_MAX_MS: u64 = 1_000;

pub(crate) struct Driver {
    pub client: Client,
    pub keys: Keys,
    pub cfg: RendezvousConfig,
    pub lease_id: i64,
    pub view: View,
    pub snapshot_tx: watch::Sender<Snapshot>,
    pub cancel: CancellationToken,
    pub request_timeout_ms: u64,
    /// Watches that ended because etcd compacted the revisions they still had to deliver.
    pub compacted_watches: Arc<AtomicU64>,
    /// The retention lease this leader keeps `ctl/epoch` on, and when it was granted.
    pub epoch_lease: Option<(i64, Instant)>,
    /// Since when this node leads (kept across re-syncs, cleared when it stops leading).
    pub leading_since: Option<Instant>,
    /// The newest step this node's agent saw committed in the store, plus one (0: none);
    /// see [`super::Handle::note_commit`].
    pub known_commit: Arc<AtomicU64>,
    /// The generation whose regroup this node confirmed last.
    pub confirmed_regroup: Option<u64>,
    /// Not leading: the generation whose regroup waits on the leader's confirmation, the
    /// leader's lease, and since when (`now_unix_ms`); see `regroup.rs`.
    pub leader_silent_since: Option<(u64, i64, u64)>,
    /// Leading: the generation a regroup was first seen for, and when (`now_unix_ms`).
    pub regroup_since: Option<(u64, u64)>,
    /// Leading: members left out of a regroup, with the registration revision they had and
    /// until when (`now_unix_ms`) they are not admitted back with it.
    pub excluded: std::collections::BTreeMap<String, (i64, u64)>,
    /// The generation, and its members this node saw draining (they leave once their drained
    /// step is committed: the leader re-forms the survivors without a settle window).
    pub drained: (u64, std::collections::BTreeSet<String>),
}

pub(super) enum Exit {
    Resync,
    Stop,
}

impl Driver {
    pub async fn run(mut self) {
        let mut pause_ms = RESYNC_PAUSE_MIN_MS;
        loop {
            if self.cancel.is_cancelled() {
                return;
            }
            let cancel = self.cancel.clone();
            let outcome = tokio::select! {
                _ = cancel.cancelled() => return,
                r = self.session() => r,
            };
            match outcome {
                Ok(Exit::Stop) => return,
                Ok(Exit::Resync) => pause_ms = RESYNC_PAUSE_MIN_MS,
                Err(e) => {
                    tracing::warn!(error = %e, pause_ms, "rendezvous watch lost; re-syncing");
                    tokio::select! {
                        _ = self.cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(pause_ms)) => {}
                    }
                    pause_ms = (pause_ms * 2).min(RESYNC_PAUSE_MAX_MS);
                }
            }
        }
    }

    fn is_leader(&self) -> bool {
        matches!(&self.view.leader, Some(l) if l.lease_id == self.lease_id)
    }

    /// One read-then-watch session. Returns on a leadership change (to re-sync with the right
    /// watch range), on watch failure, or when the job ends.
    async fn session(&mut self) -> Result<Exit> {
        let leading = self.is_leader();
        if leading {
            self.leading_since.get_or_insert_with(Instant::now);
        } else {
            // A lease granted for `ctl/epoch` but never attached expires with its retention.
            self.leading_since = None;
            self.epoch_lease = None;
        }
        let range = if leading {
            self.keys.prefix().to_string()
        } else {
            self.keys.ctl_prefix()
        };
        let resp = bounded(
            "get",
            &range,
            self.request_timeout_ms,
            self.client
                .get(range.clone(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        self.view.reset_from(&self.keys, resp.kvs(), leading);
        let mut stream = bounded(
            "watch",
            &range,
            self.request_timeout_ms,
            self.client.watch(
                range.clone(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision + 1),
                ),
            ),
        )
        .await?;
        let mut tracker = Tracker::new();
        let mut next_decision_at: Option<Instant> = None;
        let mut changed = true;
        loop {
            if changed {
                changed = false;
                self.publish();
                if let Some(exit) = self
                    .react(leading, &mut tracker, &mut next_decision_at)
                    .await?
                {
                    return Ok(exit);
                }
            }
            let wake = next_decision_at;
            let refresh_at = leading.then(|| self.epoch_refresh_at());
            tokio::select! {
                _ = self.cancel.cancelled() => return Ok(Exit::Stop),
                _ = async { sleep_until(wake.expect("guarded")).await }, if wake.is_some() => {
                    next_decision_at = None;
                    changed = true;
                }
                _ = async { sleep_until(refresh_at.expect("guarded")).await }, if refresh_at.is_some() => {
                    if !self.refresh_epoch().await? {
                        return Ok(Exit::Resync);
                    }
                }
                msg = stream.message() => {
                    let msg = msg.map_err(|e| Error::etcd("watch", range.clone(), e))?;
                    let Some(msg) = msg else {
                        // An error, so that a server that keeps ending streams gets the backoff.
                        let ended = etcd_client::Error::WatchError("watch stream ended".into());
                        return Err(Error::etcd("watch", range.clone(), ended));
                    };
                    if msg.canceled() {
                        if msg.compact_revision() > 0 {
                            // Events we missed were compacted away: a fresh read replaces them.
                            self.compacted_watches.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(compact_revision = msg.compact_revision(), "watch behind compaction; re-reading");
                            return Ok(Exit::Resync);
                        }
                        // Any other cancel (permissions, server shutdown): re-read with backoff.
                        let why = etcd_client::Error::WatchError(format!("watch cancelled: {}", msg.cancel_reason()));
                        return Err(Error::etcd("watch", range.clone(), why));
                    }
                    for ev in msg.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let Ok(key) = kv.key_str() else { continue };
                        let value = match ev.event_type() {
                            EventType::Put => Some(kv.value()),
                            EventType::Delete => None,
                        };
                        self.view.apply(&self.keys, key, value, kv.mod_revision(), kv.lease());
                        changed = true;
                    }
                }
            }
        }
    }

    pub(super) fn publish(&self) {
        let v = &self.view;
        let leader = v.leader.as_ref().map(|l| l.node_id.clone());
        let state = v.state.clone();
        let waiting = v.waiting.clone();
        self.snapshot_tx.send_if_modified(|s| {
            let same_gen = match (&s.generation, &v.generation) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            if same_gen
                && s.leader == leader
                && s.latest_commit == v.commit
                && s.draining == v.draining
                && s.job_state == state
                && s.waiting == waiting
            {
                return false;
            }
            s.generation = v.generation.clone();
            s.leader = leader.clone();
            s.latest_commit = v.commit.clone();
            s.draining = v.draining.clone();
            s.job_state = state.clone();
            s.waiting = waiting.clone();
            true
        });
    }

    /// Acts on the current view. `Some(exit)` ends the session.
    async fn react(
        &mut self,
        leading: bool,
        tracker: &mut Tracker,
        next_decision_at: &mut Option<Instant>,
    ) -> Result<Option<Exit>> {
        self.note_drained();
        if self.view.state.is_some() {
            return Ok(Some(Exit::Stop));
        }
        if self.view.leader.is_none() {
            let won = ops::campaign(
                &mut self.client,
                &self.keys,
                &self.cfg.node_id,
                self.lease_id,
                self.request_timeout_ms,
            )
            .await?;
            if won {
                tracing::info!("elected leader");
                self.restore_leader_keys().await?;
            }
            // Re-read either way: the new leader needs the members, a loser learns the winner.
            return Ok(Some(Exit::Resync));
        }
        if self.is_leader() != leading {
            return Ok(Some(Exit::Resync));
        }
        self.confirm_regroup().await;
        if !leading {
            self.depose_silent_leader(next_decision_at).await;
            return Ok(None);
        }
        self.lead(tracker, next_decision_at).await
    }
}
