//! The per-handle task: keeps a view of the job from a watch, campaigns for leadership, and,
//! while leading, feeds the decision core and carries out its decisions.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::ops::{self, bounded};
use super::{RendezvousConfig, Snapshot};
use crate::core::{self, CommitInfo, Decision, MemberState, Observed, Tracker};
use crate::keys::Keys;
use crate::record::{
    self, CommitRecord, Generation, JobState, LeaderRecord, MemberRecord, Outcome, RankedMember,
    WaitingRecord,
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
}

impl View {
    /// Applies one key's value (`None`: deleted). Bad values are logged and skipped: a
    /// corrupt record must not take the agent down.
    pub fn apply(&mut self, keys: &Keys, key: &str, value: Option<&[u8]>, mod_rev: i64) {
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
            ..View::default()
        };
        for kv in kvs {
            let Ok(key) = kv.key_str() else { continue };
            fresh.apply(keys, key, Some(kv.value()), kv.mod_revision());
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

    /// One read-then-watch session. Returns on a leadership change (to re-sync with the right
    /// watch range), on watch failure, or when the job ends.
    async fn session(&mut self) -> Result<Exit> {
        let leading = self.is_leader();
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
            tokio::select! {
                _ = self.cancel.cancelled() => return Ok(Exit::Stop),
                _ = async { sleep_until(wake.expect("guarded")).await }, if wake.is_some() => {
                    next_decision_at = None;
                    changed = true;
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
                        self.view.apply(&self.keys, key, value, kv.mod_revision());
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
        let input = core::Input {
            now_ms,
            members: observed,
            current: self.view.generation.as_ref().map(|g| g.node_ids()),
            last_commit: self.view.commit.as_ref().map(|c| CommitInfo {
                step: c.step,
                at: self.view.commit_rev as u64,
            }),
            timing,
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
                let generation = self.build_generation(&members, now_ms)?;
                match ops::write_generation(
                    &mut self.client,
                    &self.keys,
                    &self.cfg.node_id,
                    self.lease_id,
                    self.view.generation_mod_rev,
                    &generation,
                    self.request_timeout_ms,
                )
                .await
                {
                    Ok(rev) => {
                        tracing::info!(
                            generation = generation.number,
                            world_size = generation.world_size,
                            members = ?generation.node_ids(),
                            %reason,
                            "froze generation"
                        );
                        self.view.generation = Some(Arc::new(generation));
                        self.view.generation_mod_rev = rev;
                        self.publish();
                        Ok(None)
                    }
                    Err(Error::NotLeader { .. }) => {
                        tracing::warn!("generation write refused: deposed or raced; re-reading");
                        Ok(Some(Exit::Resync))
                    }
                    Err(e) => Err(e),
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

    fn build_generation(&self, ids: &[String], now_ms: u64) -> Result<Generation> {
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
        let previous_world = self
            .view
            .generation
            .as_ref()
            .map(|g| u64::from(g.world_size));
        let scaling = self.cfg.scaling.decide(u64::from(offset), previous_world)?;
        Ok(Generation {
            version: record::RECORD_VERSION,
            number: self.view.generation.as_ref().map_or(0, |g| g.number) + 1,
            members,
            world_size: offset,
            master_addr: rank0.addr.clone(),
            master_port: rank0.master_port,
            scaling,
            resume_step: self.view.commit.as_ref().map(|c| c.step),
            created_unix_ms: now_ms,
        })
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
        })
    }

    #[test]
    fn view_skips_bad_values_and_mismatched_member_ids() {
        let keys = Keys::new("j");
        let mut v = View::default();
        v.apply(&keys, &keys.member("a"), Some(&member("a")), 5);
        v.apply(&keys, &keys.member("b"), Some(&member("not-b")), 6);
        v.apply(&keys, &keys.member("c"), Some(b"\x00garbage"), 7);
        v.apply(&keys, &keys.leader(), Some(b"{\"version\":9}"), 8);
        v.apply(
            &keys,
            "/elastic-run/other-job/members/x",
            Some(&member("x")),
            9,
        );
        assert_eq!(v.members.keys().collect::<Vec<_>>(), ["a"]);
        assert!(v.leader.is_none());
        v.apply(&keys, &keys.member("a"), None, 10);
        assert!(v.members.is_empty());
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
        v.apply(&keys, &keys.generation(), Some(&record::encode(&g)), 42);
        assert_eq!(v.generation_mod_rev, 42);
        v.apply(&keys, &keys.generation(), None, 43);
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
