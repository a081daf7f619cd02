//! The per-handle task: keeps a view of the job from a watch, campaigns for leadership, and,
//! while leading, feeds the decision core and carries out its decisions.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::ops::{self, bounded};
use super::{RendezvousConfig, Snapshot};
use crate::core::{self, CommitInfo, Decision, MemberState, Observed, Tracker};
use crate::keys::{Keys, STATE_RETENTION_S};
use crate::record::{
    self, CommitRecord, EpochRecord, Generation, JobState, LeaderRecord, MemberRecord, Outcome,
    RankedMember, RestartRecord, WaitingRecord,
};
use crate::{Error, Result};

/// Pause bounds between re-sync attempts while etcd is unreachable.
const RESYNC_PAUSE_MIN_MS: u64 = 50;
const RESYNC_PAUSE_MAX_MS: u64 = 1_000;
/// Members a view holds at most; registrations beyond are ignored (and logged).
pub(crate) const MEMBERS_MAX: usize = 100_000;

/// What this node knows about the job.
#[derive(Debug, Default, Clone)]
pub(crate) struct View {
    /// Only filled while leading (followers do not watch `members/`).
    pub members: BTreeMap<String, MemberRecord>,
    /// The etcd revision of each member's registration: the join order every node agrees on.
    pub member_revs: BTreeMap<String, i64>,
    pub draining: BTreeSet<String>,
    pub leader: Option<LeaderRecord>,
    /// The last generation seen, and the generation key's mod revision (0: key absent now).
    pub generation: Option<Arc<Generation>>,
    pub generation_mod_rev: i64,
    pub commit: Option<CommitRecord>,
    pub commit_mod_rev: i64,
    /// The revision at which the commit record was last written (kept across deletes).
    pub commit_rev: i64,
    pub state: Option<JobState>,
    pub waiting: Option<WaitingRecord>,
    /// Restart requests by requester (`ctl/restart/<node>`).
    pub restarts: BTreeMap<String, RestartRecord>,
    /// The highest generation number seen in `ctl/epoch` (kept across deletes and re-reads).
    pub epoch: u64,
    /// The lease `ctl/epoch` hangs on now; 0 when the key is absent.
    pub epoch_lease: i64,
}

impl View {
    /// Applies one key's value (`None`: deleted). Bad values are logged and skipped: a
    /// corrupt record must not take the agent down.
    pub fn apply(
        &mut self,
        keys: &Keys,
        key: &str,
        value: Option<&[u8]>,
        mod_rev: i64,
        lease: i64,
    ) {
        let Some(rel) = key.strip_prefix(keys.prefix()) else {
            return;
        };
        let result: Result<()> = (|| {
            match (rel, value) {
                (r, v) if r.starts_with("members/") => {
                    let id = &r["members/".len()..];
                    match v {
                        Some(v) => {
                            let m: MemberRecord = record::parse(key, v)?;
                            if m.node_id != id {
                                return Err(Error::BadValue {
                                    key: key.to_string(),
                                    reason: format!("record names node {}", m.node_id),
                                });
                            }
                            if self.members.len() < MEMBERS_MAX || self.members.contains_key(id) {
                                self.members.insert(id.to_string(), m);
                                self.member_revs.insert(id.to_string(), mod_rev);
                            } else {
                                tracing::warn!(key, "member ignored: over {MEMBERS_MAX} members");
                            }
                        }
                        None => {
                            self.members.remove(id);
                            self.member_revs.remove(id);
                        }
                    }
                }
                (r, v) if r.starts_with("ctl/drain/") => {
                    let id = &r["ctl/drain/".len()..];
                    if v.is_some() {
                        if self.draining.len() < MEMBERS_MAX {
                            self.draining.insert(id.to_string());
                        }
                    } else {
                        self.draining.remove(id);
                    }
                }
                ("ctl/leader", Some(v)) => self.leader = Some(record::parse(key, v)?),
                ("ctl/leader", None) => self.leader = None,
                ("ctl/generation", Some(v)) => {
                    self.generation = Some(Arc::new(record::parse(key, v)?));
                    self.generation_mod_rev = mod_rev;
                }
                // Deleted with the old leader's lease: keep the copy, the next leader re-writes it.
                ("ctl/generation", None) => self.generation_mod_rev = 0,
                ("ctl/commit", Some(v)) => {
                    self.commit = Some(record::parse(key, v)?);
                    self.commit_mod_rev = mod_rev;
                    self.commit_rev = mod_rev;
                }
                ("ctl/commit", None) => self.commit_mod_rev = 0,
                ("ctl/waiting", Some(v)) => self.waiting = Some(record::parse(key, v)?),
                ("ctl/waiting", None) => self.waiting = None,
                (r, v) if r.starts_with("ctl/restart/") => {
                    let id = &r["ctl/restart/".len()..];
                    match v {
                        Some(v) => {
                            let req: RestartRecord = record::parse(key, v)?;
                            if req.node_id != id {
                                return Err(Error::BadValue {
                                    key: key.to_string(),
                                    reason: format!("record names node {}", req.node_id),
                                });
                            }
                            if self.restarts.len() < MEMBERS_MAX || self.restarts.contains_key(id) {
                                self.restarts.insert(id.to_string(), req);
                            }
                        }
                        None => {
                            self.restarts.remove(id);
                        }
                    }
                }
                ("ctl/epoch", Some(v)) => {
                    let e: EpochRecord = record::parse(key, v)?;
                    self.epoch = self.epoch.max(e.number);
                    self.epoch_lease = lease;
                }
                ("ctl/epoch", None) => self.epoch_lease = 0,
                ("ctl/state", Some(v)) => self.state = Some(record::parse(key, v)?),
                ("ctl/state", None) => self.state = None,
                _ => tracing::debug!(key, "unknown key ignored"),
            }
            Ok(())
        })();
        if let Err(e) = result {
            tracing::warn!(error = %e, "ignoring bad etcd value");
        }
    }

    /// Replaces the view with a full read, keeping the last generation and commit when their
    /// keys are absent (they hang on the leader's lease).
    fn reset_from(&mut self, keys: &Keys, kvs: &[KeyValue], with_members: bool) {
        let mut fresh = View {
            generation: self.generation.clone(),
            commit: self.commit.clone(),
            commit_rev: self.commit_rev,
            epoch: self.epoch,
            ..View::default()
        };
        for kv in kvs {
            let Ok(key) = kv.key_str() else { continue };
            fresh.apply(keys, key, Some(kv.value()), kv.mod_revision(), kv.lease());
        }
        if !with_members {
            fresh.members.clear();
            fresh.member_revs.clear();
        }
        *self = fresh;
    }
}

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
}

enum Exit {
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

    /// A step this node saw committed that `ctl/commit` does not record yet (its report to
    /// etcd failed, or has not happened yet).
    fn unrecorded_commit(&self) -> Option<u64> {
        let known = self.known_commit.load(Ordering::Acquire).checked_sub(1)?;
        match &self.view.commit {
            Some(c) if c.step >= known => None,
            _ => Some(known),
        }
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

    fn publish(&self) {
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
        if !leading {
            return Ok(None);
        }
        self.lead(tracker, next_decision_at).await
    }

    /// After winning an election: put back the generation and commit that hung on the previous
    /// leader's lease, from this node's copy, so readers and fencing continue.
    async fn restore_leader_keys(&mut self) -> Result<()> {
        if let Some(g) = self.view.generation.clone()
            && self.view.generation_mod_rev == 0
        {
            match ops::write_generation(
                &mut self.client,
                &self.keys,
                &self.cfg.node_id,
                self.lease_id,
                0,
                &g,
                self.request_timeout_ms,
            )
            .await
            {
                Ok(rev) => self.view.generation_mod_rev = rev,
                Err(Error::NotLeader { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(c) = self.view.commit.clone()
            && self.view.commit_mod_rev == 0
        {
            let me = LeaderRecord {
                version: record::RECORD_VERSION,
                node_id: self.cfg.node_id.clone(),
                lease_id: self.lease_id,
            };
            ops::write_commit(
                &mut self.client,
                &self.keys,
                &me,
                0,
                &c,
                self.request_timeout_ms,
            )
            .await?;
        }
        Ok(())
    }

    async fn lead(
        &mut self,
        tracker: &mut Tracker,
        next_decision_at: &mut Option<Instant>,
    ) -> Result<Option<Exit>> {
        let now_ms = ops::now_unix_ms();
        let observed: Vec<Observed> = self
            .view
            .members
            .values()
            .map(|m| Observed {
                node_id: m.node_id.clone(),
                state: if self.view.draining.contains(&m.node_id) {
                    MemberState::Draining
                } else {
                    MemberState::Alive
                },
                joined_at: self
                    .view
                    .member_revs
                    .get(&m.node_id)
                    .map_or(0, |r| *r as u64),
            })
            .collect();
        let core_cfg = self.cfg.core_config();
        let timing = tracker.observe(now_ms, &observed, core_cfg.min_nodes);
        let current_number = self.view.generation.as_ref().map_or(0, |g| g.number);
        let input = core::Input {
            now_ms,
            members: observed,
            current: self.view.generation.as_ref().map(|g| g.node_ids()),
            last_commit: self.view.commit.as_ref().map(|c| CommitInfo {
                step: c.step,
                at: self.view.commit_rev as u64,
            }),
            timing,
            current_number,
            restart_requested_for: self
                .view
                .restarts
                .values()
                .map(|r| r.generation)
                .filter(|g| *g <= current_number)
                .max(),
        };
        let decision = core::decide(&core_cfg, &input);
        tracing::debug!(?decision, "decision");
        match decision {
            Decision::Keep { .. } => Ok(None),
            Decision::Wait { until_ms, reason } => {
                let in_ms = until_ms.saturating_sub(now_ms);
                *next_decision_at = Some(Instant::now() + Duration::from_millis(in_ms));
                self.announce_waiting(&reason, until_ms).await?;
                Ok(None)
            }
            Decision::Freeze { members, reason } => {
                // A commit this node saw but etcd did not record (etcd was down when the agent
                // reported it) is recorded with the generation, which resumes from it: a
                // survivor never redoes steps a drain saved.
                let commit = self.unrecorded_commit().map(|step| CommitRecord {
                    version: record::RECORD_VERSION,
                    step,
                    committed_unix_ms: now_ms,
                    node_id: self.cfg.node_id.clone(),
                });
                let generation =
                    self.build_generation(&members, now_ms, commit.as_ref().map(|c| c.step))?;
                let epoch_lease = self.epoch_lease_for_write().await?;
                match ops::write_generation_and_epoch(
                    &mut self.client,
                    &self.keys,
                    &self.cfg.node_id,
                    self.lease_id,
                    self.view.generation_mod_rev,
                    &generation,
                    Some(epoch_lease),
                    Some(self.view.commit_mod_rev),
                    commit.as_ref(),
                    self.request_timeout_ms,
                )
                .await
                {
                    Ok(rev) => {
                        let requested_by: Vec<&str> = match &reason {
                            core::Reason::RestartRequested { generation } => self
                                .view
                                .restarts
                                .values()
                                .filter(|r| r.generation == *generation)
                                .map(|r| r.node_id.as_str())
                                .collect(),
                            _ => Vec::new(),
                        };
                        tracing::info!(
                            generation = generation.number,
                            world_size = generation.world_size,
                            members = ?generation.node_ids(),
                            master_port = generation.master_port,
                            %reason,
                            ?requested_by,
                            "froze generation"
                        );
                        self.epoch_written(generation.number, epoch_lease);
                        if let Some(c) = commit {
                            tracing::info!(
                                step = c.step,
                                "recorded a commit etcd had missed with the generation"
                            );
                            self.view.commit = Some(c);
                            self.view.commit_mod_rev = rev;
                            self.view.commit_rev = rev;
                        }
                        self.view.generation = Some(Arc::new(generation));
                        self.view.generation_mod_rev = rev;
                        self.publish();
                        Ok(None)
                    }
                    Err(Error::NotLeader { .. }) => {
                        tracing::warn!(
                            "generation write refused: deposed, raced, or a newer commit was recorded; re-reading"
                        );
                        Ok(Some(Exit::Resync))
                    }
                    Err(e) => {
                        // The epoch lease may be what failed (gone from the server): take a
                        // fresh one next time.
                        self.epoch_lease = None;
                        Err(e)
                    }
                }
            }
            Decision::Fail { reason } => {
                tracing::error!(%reason, "failing the job");
                super::write_state(
                    &mut self.client,
                    &self.keys,
                    Outcome::Failed,
                    &reason.to_string(),
                    Some(self.lease_id),
                    self.request_timeout_ms,
                )
                .await?;
                Ok(None)
            }
        }
    }

    /// Below `min` with a generation whose members are gone: tell every agent, so they stop
    /// workers that would hang in collectives with the lost peers.
    async fn announce_waiting(&mut self, reason: &core::Reason, until_ms: u64) -> Result<()> {
        let core::Reason::BelowMin { .. } = reason else {
            return Ok(());
        };
        let Some(g) = self.view.generation.as_ref() else {
            return Ok(());
        };
        let broken = g
            .members
            .iter()
            .any(|m| !self.view.members.contains_key(&m.node_id));
        let notice = WaitingRecord {
            version: record::RECORD_VERSION,
            generation: g.number,
            reason: reason.to_string(),
            until_unix_ms: until_ms,
        };
        if !broken || self.view.waiting.as_ref() == Some(&notice) {
            return Ok(());
        }
        if ops::write_waiting(
            &mut self.client,
            &self.keys,
            self.lease_id,
            &notice,
            self.request_timeout_ms,
        )
        .await?
        {
            tracing::warn!(generation = g.number, %reason, "generation broken; waiting for nodes");
            self.view.waiting = Some(notice);
            self.publish();
        }
        Ok(())
    }

    /// When this leader moves `ctl/epoch` to a fresh retention lease next.
    fn epoch_refresh_at(&mut self) -> Instant {
        let every = Duration::from_millis(self.cfg.epoch_refresh_ms);
        match self.epoch_lease {
            Some((_, granted_at)) => granted_at + every,
            None => *self.leading_since.get_or_insert_with(Instant::now) + every,
        }
    }

    /// The retention lease for the next `ctl/epoch` write: this leader's own while it is
    /// younger than the refresh period (no extra round trip on the restart path), else a fresh
    /// one.
    async fn epoch_lease_for_write(&mut self) -> Result<i64> {
        let every = Duration::from_millis(self.cfg.epoch_refresh_ms);
        if let Some((id, granted_at)) = self.epoch_lease
            && granted_at.elapsed() < every
        {
            return Ok(id);
        }
        let granted_at = Instant::now();
        let lease = bounded(
            "lease grant",
            &self.keys.epoch(),
            self.request_timeout_ms,
            self.client.lease_grant(STATE_RETENTION_S, None),
        )
        .await?;
        self.epoch_lease = Some((lease.id(), granted_at));
        Ok(lease.id())
    }

    /// After `ctl/epoch` was written with `number` under `lease`: revokes the lease it hung on
    /// before (nothing else is attached to it), so leases do not pile up across leaders.
    fn epoch_written(&mut self, number: u64, lease: i64) {
        let before = self.view.epoch_lease;
        self.view.epoch = self.view.epoch.max(number);
        self.view.epoch_lease = lease;
        if before != 0 && before != lease && before != self.lease_id {
            let mut client = self.client.clone();
            let timeout_ms = self.request_timeout_ms;
            let key = self.keys.epoch();
            tokio::spawn(async move {
                if let Err(e) = bounded(
                    "lease revoke",
                    &key,
                    timeout_ms,
                    client.lease_revoke(before),
                )
                .await
                {
                    // It expires with its retention anyway.
                    tracing::debug!(error = %e, "old epoch lease not revoked");
                }
            });
        }
    }

    /// Moves `ctl/epoch` to a fresh retention lease, so that it outlives the job by a full
    /// retention however long the job runs. Returns whether this node still leads.
    async fn refresh_epoch(&mut self) -> Result<bool> {
        let number = self
            .view
            .epoch
            .max(self.view.generation.as_ref().map_or(0, |g| g.number));
        if number == 0 {
            // No generation yet: nothing to keep.
            self.leading_since = Some(Instant::now());
            self.epoch_lease = None;
            return Ok(true);
        }
        self.epoch_lease = None;
        let lease = self.epoch_lease_for_write().await?;
        let leads = ops::write_epoch(
            &mut self.client,
            &self.keys,
            self.lease_id,
            number,
            lease,
            self.request_timeout_ms,
        )
        .await
        .inspect_err(|_| self.epoch_lease = None)?;
        if leads {
            tracing::debug!(number, lease, "epoch moved to a fresh retention lease");
            self.epoch_written(number, lease);
        }
        Ok(leads)
    }

    /// The generation of `ids`, resuming from `unrecorded_commit` when given, else from the
    /// newest commit etcd records.
    fn build_generation(
        &self,
        ids: &[String],
        now_ms: u64,
        unrecorded_commit: Option<u64>,
    ) -> Result<Generation> {
        let mut members = Vec::with_capacity(ids.len());
        let mut offset: u32 = 0;
        for id in ids {
            let m = self.view.members.get(id).ok_or_else(|| Error::BadValue {
                key: self.keys.member(id),
                reason: "member chosen by the core is not in the view".into(),
            })?;
            members.push(RankedMember {
                node_id: id.clone(),
                addr: m.addr.clone(),
                nproc: m.nproc,
                rank_offset: offset,
            });
            offset = offset
                .checked_add(m.nproc)
                .ok_or_else(|| Error::InvalidConfig {
                    field: "nproc",
                    reason: "world size overflows u32".into(),
                })?;
        }
        let rank0 = &self.view.members[&ids[0]];
        let previous = self.view.generation.as_deref();
        let previous_world = previous.map(|g| u64::from(g.world_size));
        let scaling = self.cfg.scaling.decide(u64::from(offset), previous_world)?;
        // `ctl/epoch` holds the highest number ever frozen, even after a total loss.
        let number = previous.map_or(0, |g| g.number).max(self.view.epoch) + 1;
        Ok(Generation {
            version: record::RECORD_VERSION,
            number,
            members,
            world_size: offset,
            master_addr: rank0.addr.clone(),
            master_port: master_port(previous, rank0),
            scaling,
            resume_step: unrecorded_commit.or(self.view.commit.as_ref().map(|c| c.step)),
            created_unix_ms: now_ms,
        })
    }
}

/// `MASTER_PORT` for a generation whose rank 0 is `rank0`: its reserved port, or its spare
/// when the previous generation used the reserved one on the same host, so a new TCPStore
/// never has to bind the port the previous generation's store (maybe not yet gone) held.
fn master_port(previous: Option<&Generation>, rank0: &MemberRecord) -> u16 {
    match (previous, rank0.spare_master_port) {
        (Some(prev), Some(spare))
            if prev.master_addr == rank0.addr && prev.master_port == rank0.master_port =>
        {
            spare
        }
        _ => rank0.master_port,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str) -> Vec<u8> {
        record::encode(&MemberRecord {
            version: record::RECORD_VERSION,
            node_id: id.into(),
            addr: "h".into(),
            nproc: 1,
            master_port: 1,
            joined_unix_ms: 0,
            spare_master_port: None,
        })
    }

    #[test]
    fn view_skips_bad_values_and_mismatched_member_ids() {
        let keys = Keys::new("j");
        let mut v = View::default();
        v.apply(&keys, &keys.member("a"), Some(&member("a")), 5, 0);
        v.apply(&keys, &keys.member("b"), Some(&member("not-b")), 6, 0);
        v.apply(&keys, &keys.member("c"), Some(b"\x00garbage"), 7, 0);
        v.apply(&keys, &keys.leader(), Some(b"{\"version\":9}"), 8, 0);
        v.apply(
            &keys,
            "/elastic-run/other-job/members/x",
            Some(&member("x")),
            9,
            0,
        );
        assert_eq!(v.members.keys().collect::<Vec<_>>(), ["a"]);
        assert!(v.leader.is_none());
        v.apply(&keys, &keys.member("a"), None, 10, 0);
        assert!(v.members.is_empty());
    }

    fn restart(node: &str, generation: u64) -> Vec<u8> {
        record::encode(&RestartRecord {
            version: record::RECORD_VERSION,
            generation,
            node_id: node.into(),
            reason: "worker 3 exited with 1".into(),
            requested_unix_ms: 0,
        })
    }

    #[test]
    fn view_tracks_restart_requests_per_node_and_the_highest_epoch() {
        let keys = Keys::new("j");
        let mut v = View::default();
        v.apply(&keys, &keys.restart("a"), Some(&restart("a", 3)), 5, 0);
        v.apply(&keys, &keys.restart("b"), Some(&restart("b", 2)), 6, 0);
        // A record naming another node than its key is ignored.
        v.apply(&keys, &keys.restart("c"), Some(&restart("a", 9)), 7, 0);
        assert_eq!(
            v.restarts
                .iter()
                .map(|(k, r)| (k.as_str(), r.generation))
                .collect::<Vec<_>>(),
            [("a", 3), ("b", 2)]
        );
        v.apply(&keys, &keys.restart("a"), None, 8, 0);
        assert_eq!(v.restarts.keys().collect::<Vec<_>>(), ["b"]);

        let epoch = |n: u64| {
            record::encode(&EpochRecord {
                version: record::RECORD_VERSION,
                number: n,
            })
        };
        v.apply(&keys, &keys.epoch(), Some(&epoch(7)), 9, 77);
        assert_eq!((v.epoch, v.epoch_lease), (7, 77));
        v.apply(&keys, &keys.epoch(), None, 10, 0);
        assert_eq!(
            (v.epoch, v.epoch_lease),
            (7, 0),
            "the number survives the delete"
        );
        v.reset_from(&keys, &[], false);
        assert_eq!(v.epoch, 7, "and a re-read without the key");
    }

    #[test]
    fn master_port_alternates_with_the_spare_when_rank_0_stays() {
        let rank0 = MemberRecord {
            version: record::RECORD_VERSION,
            node_id: "a".into(),
            addr: "h".into(),
            nproc: 1,
            master_port: 100,
            joined_unix_ms: 0,
            spare_master_port: Some(200),
        };
        let scaling = crate::scaling::ScalingConfig {
            mode: crate::scaling::ScalingMode::None,
            per_worker_batch: 1,
            base_world_size: 1,
            base_lr: 1.0,
            global_batch: None,
            on_indivisible: crate::scaling::OnIndivisible::Nearest,
            warmup_steps: None,
        }
        .decide(1, None)
        .unwrap();
        let prev = |addr: &str, port: u16| Generation {
            version: record::RECORD_VERSION,
            number: 1,
            members: vec![RankedMember {
                node_id: "x".into(),
                addr: addr.into(),
                nproc: 1,
                rank_offset: 0,
            }],
            world_size: 1,
            master_addr: addr.into(),
            master_port: port,
            scaling: scaling.clone(),
            resume_step: None,
            created_unix_ms: 1,
        };
        assert_eq!(master_port(None, &rank0), 100);
        assert_eq!(master_port(Some(&prev("h", 100)), &rank0), 200);
        assert_eq!(master_port(Some(&prev("h", 200)), &rank0), 100);
        assert_eq!(master_port(Some(&prev("other", 100)), &rank0), 100);
        let fixed = MemberRecord {
            spare_master_port: None,
            ..rank0
        };
        assert_eq!(
            master_port(Some(&prev("h", 100)), &fixed),
            100,
            "a configured port is kept"
        );
    }

    #[test]
    fn view_keeps_the_generation_when_its_key_goes_with_the_leader_lease() {
        let keys = Keys::new("j");
        let g = Generation {
            version: record::RECORD_VERSION,
            number: 4,
            members: vec![RankedMember {
                node_id: "a".into(),
                addr: "h".into(),
                nproc: 1,
                rank_offset: 0,
            }],
            world_size: 1,
            master_addr: "h".into(),
            master_port: 1,
            scaling: crate::scaling::ScalingConfig {
                mode: crate::scaling::ScalingMode::None,
                per_worker_batch: 1,
                base_world_size: 1,
                base_lr: 1.0,
                global_batch: None,
                on_indivisible: crate::scaling::OnIndivisible::Nearest,
                warmup_steps: None,
            }
            .decide(1, None)
            .unwrap(),
            resume_step: Some(3),
            created_unix_ms: 1,
        };
        let mut v = View::default();
        v.apply(&keys, &keys.generation(), Some(&record::encode(&g)), 42, 0);
        assert_eq!(v.generation_mod_rev, 42);
        v.apply(&keys, &keys.generation(), None, 43, 0);
        assert_eq!(
            v.generation.as_deref(),
            Some(&g),
            "the copy survives the delete"
        );
        assert_eq!(v.generation_mod_rev, 0, "fencing must expect an absent key");
        // A re-read without the key keeps the copy too.
        v.reset_from(&keys, &[], false);
        assert_eq!(v.generation.as_deref(), Some(&g));
        assert_eq!(v.generation_mod_rev, 0);
    }
}
