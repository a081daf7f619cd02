//! The leader's side of the driver: after an election it restores the keys that hung on the
//! previous leader's lease; then, for every change, it feeds the view to the decision core and
//! carries out the decision: freeze a generation (fenced, with its epoch and any commit etcd
//! missed), announce that the job waits below `min`, or fail the job.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::driver::{Driver, Exit};
use super::ops;
use crate::core::{self, CommitInfo, Decision, MemberState, Observed, Tracker};
use crate::record::{
    self, CommitRecord, Generation, LeaderRecord, MemberRecord, Outcome, RankedMember,
    WaitingRecord,
};
use crate::{Error, Result};

/// How long after its TTL a dead member's key may still be seen: etcd revokes expired leases on
/// its own schedule (with a 2 s TTL, keys went 2.1-2.3 s after the last renewal), and the
/// deletion reaches the leader's watch after that. A member left out of a regroup stays out for
/// its lease TTL plus this, so a dead one is not admitted back while its key lingers (that made a
/// generation with it, which could not form and was replaced one regroup later).
const LEASE_EXPIRY_LAG_MS: u64 = 1000;

impl Driver {
    /// A step this node saw committed that `ctl/commit` does not record yet (its report to
    /// etcd failed, or has not happened yet).
    fn unrecorded_commit(&self) -> Option<u64> {
        let known = self.known_commit.load(Ordering::Acquire).checked_sub(1)?;
        match &self.view.commit {
            Some(c) if c.step >= known => None,
            _ => Some(known),
        }
    }

    /// After winning an election: put back the generation and commit that hung on the previous
    /// leader's lease, from this node's copy, so readers and fencing continue.
    pub(super) async fn restore_leader_keys(&mut self) -> Result<()> {
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

    /// Notes the current generation's members seen draining (on every member, so that a
    /// leader elected after the drained one left knows it too).
    pub(super) fn note_drained(&mut self) {
        let current_number = self.view.generation.as_ref().map_or(0, |g| g.number);
        if self.drained.0 != current_number {
            self.drained = (current_number, Default::default());
        }
        if let Some(g) = &self.view.generation {
            for id in g.node_ids() {
                if self.view.draining.contains(&id) {
                    self.drained.1.insert(id);
                }
            }
        }
    }

    pub(super) async fn lead(
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
        let excluded = self.excluded_input(now_ms);
        let timing = tracker.observe(now_ms, &observed, &excluded, core_cfg.min_nodes);
        let current_number = self.view.generation.as_ref().map_or(0, |g| g.number);
        let input = core::Input {
            now_ms,
            members: observed,
            current: self.view.generation.as_ref().map(|g| g.node_ids()),
            last_commit: self.view.commit.as_ref().map(|c| CommitInfo {
                step: c.step,
                at: self.view.commit_rev as u64,
                generation: c.generation,
            }),
            current_resume_step: self.view.generation.as_ref().and_then(|g| g.resume_step),
            timing,
            current_number,
            restart_requested_for: self
                .view
                .restarts
                .values()
                .map(|r| r.generation)
                .filter(|g| *g <= current_number)
                .max(),
            regroup: self.regroup_input(current_number, now_ms),
            excluded,
            drained: self.drained.1.iter().cloned().collect(),
        };
        let decision = core::decide(&core_cfg, &input);
        tracing::debug!(?decision, "decision");
        if let (Decision::Keep { .. }, Some(until_ms)) = (
            &decision,
            self.excluded.values().map(|(_, until)| *until).min(),
        ) {
            // Decide again when an exclusion ends: a live node left out may then come back.
            let at = Instant::now() + Duration::from_millis(until_ms.saturating_sub(now_ms));
            *next_decision_at = Some(next_decision_at.map_or(at, |n| n.min(at)));
        }
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
                    generation: None,
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
                        if let core::Reason::CollectiveFailed { left_out, .. } = &reason {
                            // A node left out may be dead with its lease still running: not
                            // admitted back with the same registration until that lease has
                            // lapsed.
                            let until = now_ms + self.cfg.lease_ttl_ms + LEASE_EXPIRY_LAG_MS;
                            for id in left_out {
                                if let Some(rev) = self.view.member_revs.get(id) {
                                    self.excluded.insert(id.clone(), (*rev, until));
                                }
                            }
                        }
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
                super::state::write_state(
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

    /// The generation of `ids`, resuming from `unrecorded_commit` when given, else from the
    /// newest commit etcd records.
    fn build_generation(
        &self,
        ids: &[String],
        now_ms: u64,
        unrecorded_commit: Option<u64>,
    ) -> Result<Generation> {
        let previous = self.view.generation.as_deref();
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
                continuing: previous.is_some_and(|g| g.member(id).is_some()),
            });
            offset = offset
                .checked_add(m.nproc)
                .ok_or_else(|| Error::InvalidConfig {
                    field: "nproc",
                    reason: "world size overflows u32".into(),
                })?;
        }
        let rank0 = &self.view.members[&ids[0]];
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

impl Driver {
    /// The regroup of the current generation asked for, if any: who asked or confirmed, and
    /// since when this leader sees it.
    fn regroup_input(&mut self, current_number: u64, now_ms: u64) -> Option<core::Regroup> {
        let confirmed: Vec<String> = self
            .view
            .regroups
            .values()
            .filter(|r| current_number > 0 && r.generation == current_number)
            .map(|r| r.node_id.clone())
            .collect();
        if confirmed.is_empty() {
            self.regroup_since = None;
            return None;
        }
        let since_ms = match self.regroup_since {
            Some((g, t)) if g == current_number => t,
            _ => {
                self.regroup_since = Some((current_number, now_ms));
                now_ms
            }
        };
        Some(core::Regroup {
            generation: current_number,
            since_ms,
            confirmed,
        })
    }

    /// Members left out of a regroup that are still registered as they were, within a lease
    /// TTL of it.
    fn excluded_input(&mut self, now_ms: u64) -> Vec<String> {
        let revs = &self.view.member_revs;
        self.excluded
            .retain(|id, (rev, until)| now_ms < *until && revs.get(id) == Some(rev));
        self.excluded.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let scaling = crate::scaling::decision_for_tests();
        let prev = |addr: &str, port: u16| Generation {
            version: record::RECORD_VERSION,
            number: 1,
            members: vec![RankedMember {
                node_id: "x".into(),
                addr: addr.into(),
                nproc: 1,
                rank_offset: 0,
                continuing: false,
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
}
