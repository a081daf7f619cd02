//! A member's side of a regroup (see [`Handle::request_regroup`](super::Handle::request_regroup)):
//! every live member of the generation confirms it, and a leader that does not confirm within
//! the confirmation window is deposed.
//!
//! The leader is a member like the others: when it has not confirmed a regroup of its own
//! generation within the window, it is lost or stalled, and is left out as any member that
//! does not confirm is. Its lease is revoked, which removes the leader key and its member key
//! at once, so the survivors elect a new leader and re-form without waiting out its lease
//! TTL. A stalled leader that wakes finds its lease gone and fences itself, and a generation
//! it froze before can no longer be written (fencing by the leader key, as after an expiry).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::driver::Driver;
use super::ops::{self, bounded};
use crate::record::{Generation, LeaderRecord, RestartRecord};

/// Whether the regroup of `generation` waits on its leader's confirmation: someone asked for
/// it, the leader is another member of that generation, and the leader has not confirmed it.
pub(crate) fn waits_on_leader(
    generation: &Generation,
    leader: &LeaderRecord,
    regroups: &BTreeMap<String, RestartRecord>,
    me: &str,
) -> bool {
    let number = generation.number;
    let asked = regroups.values().any(|r| r.generation == number);
    let leader_confirmed = regroups
        .get(&leader.node_id)
        .is_some_and(|r| r.generation == number);
    asked
        && !leader_confirmed
        && leader.node_id != me
        && generation.member(&leader.node_id).is_some()
        && generation.member(me).is_some()
}

impl Driver {
    /// Confirms a regroup of the current generation that a member asked for (its workers saw
    /// a collective fail): this node is alive and reaches etcd, so it stays in the job. Once
    /// per generation once it worked; a node that cannot confirm in the window is left out, as
    /// a lost one is, and joins the next generation after its exclusion (a lease TTL).
    pub(super) async fn confirm_regroup(&mut self) {
        let Some(g) = self.view.generation.as_ref() else {
            return;
        };
        let number = g.number;
        if g.member(&self.cfg.node_id).is_none()
            || self.confirmed_regroup == Some(number)
            || !self.view.regroups.values().any(|r| r.generation == number)
        {
            return;
        }
        if self
            .view
            .regroups
            .get(&self.cfg.node_id)
            .is_some_and(|r| r.generation == number)
        {
            self.confirmed_regroup = Some(number);
            return;
        }
        let key = self.keys.regroup(&self.cfg.node_id);
        match ops::put_member_request(
            &mut self.client,
            &key,
            &self.cfg.node_id,
            self.lease_id,
            number,
            "confirmed",
            self.request_timeout_ms,
        )
        .await
        {
            Ok(()) => {
                self.confirmed_regroup = Some(number);
                tracing::info!(generation = number, "regroup confirmed");
            }
            // Tried again at the next change of the view; a node that cannot confirm in the
            // window is left out, as a lost one is.
            Err(e) => tracing::warn!(generation = number, error = %e, "cannot confirm the regroup"),
        }
    }

    /// Not leading: deposes a leader that has not confirmed a regroup of the current
    /// generation within the confirmation window, counted from when this node saw the regroup
    /// asked for. Before then it sets `wake_at` to look again at the window's end.
    pub(super) async fn depose_silent_leader(&mut self, wake_at: &mut Option<Instant>) {
        let (Some(g), Some(leader)) = (self.view.generation.as_ref(), self.view.leader.as_ref())
        else {
            self.leader_silent_since = None;
            return;
        };
        if !waits_on_leader(g, leader, &self.view.regroups, &self.cfg.node_id) {
            self.leader_silent_since = None;
            return;
        }
        let (number, lease_id, leader_id) = (g.number, leader.lease_id, leader.node_id.clone());
        let now_ms = ops::now_unix_ms();
        let since_ms = match self.leader_silent_since {
            Some((n, id, t)) if n == number && id == lease_id => t,
            _ => {
                self.leader_silent_since = Some((number, lease_id, now_ms));
                now_ms
            }
        };
        let end_ms = since_ms.saturating_add(self.cfg.confirm_window_ms);
        if now_ms < end_ms {
            let at = Instant::now() + Duration::from_millis(end_ms - now_ms);
            *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
            return;
        }
        tracing::warn!(
            generation = number,
            leader = %leader_id,
            confirm_window_ms = self.cfg.confirm_window_ms,
            "the leader did not confirm the regroup within the window; revoking its lease"
        );
        let key = self.keys.leader();
        match bounded(
            "lease_revoke",
            &key,
            self.request_timeout_ms,
            self.client.lease_revoke(lease_id),
        )
        .await
        {
            Ok(_) => tracing::info!(generation = number, leader = %leader_id, "leader deposed"),
            // Another member revoked it first, or it expired: the same outcome.
            Err(e) if e.to_string().contains("lease not found") => {}
            // Looked at again at the next change of the view or wake-up.
            Err(e) => {
                tracing::warn!(generation = number, error = %e, "cannot revoke the leader's lease");
                let at = Instant::now() + Duration::from_millis(REVOKE_RETRY_MS);
                *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
            }
        }
    }
}

/// Pause before revoking a silent leader's lease again after a failed attempt.
const REVOKE_RETRY_MS: u64 = 200;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{self, RankedMember};

    fn generation(number: u64, members: &[&str]) -> Generation {
        let scaling = crate::scaling::decision_for_tests();
        Generation {
            version: record::RECORD_VERSION,
            number,
            members: members
                .iter()
                .enumerate()
                .map(|(i, m)| RankedMember {
                    node_id: (*m).into(),
                    addr: "h".into(),
                    nproc: 1,
                    rank_offset: i as u32,
                    continuing: false,
                })
                .collect(),
            world_size: members.len() as u32,
            master_addr: "h".into(),
            master_port: 1,
            scaling,
            resume_step: None,
            created_unix_ms: 1,
        }
    }

    fn leader(id: &str) -> LeaderRecord {
        LeaderRecord {
            version: record::RECORD_VERSION,
            node_id: id.into(),
            lease_id: 7,
        }
    }

    fn asked(entries: &[(&str, u64)]) -> BTreeMap<String, RestartRecord> {
        entries
            .iter()
            .map(|(n, g)| {
                (
                    n.to_string(),
                    RestartRecord {
                        version: record::RECORD_VERSION,
                        generation: *g,
                        node_id: n.to_string(),
                        reason: "collective failed".into(),
                        requested_unix_ms: 1,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn only_an_unconfirmed_leader_of_the_asked_generation_is_waited_on() {
        let g = generation(4, &["boss", "a", "b"]);
        let boss = leader("boss");
        assert!(waits_on_leader(&g, &boss, &asked(&[("a", 4)]), "b"));
        assert!(waits_on_leader(&g, &boss, &asked(&[("a", 4)]), "a"));
        // Nobody asked, or asked for an older generation.
        assert!(!waits_on_leader(&g, &boss, &asked(&[]), "b"));
        assert!(!waits_on_leader(&g, &boss, &asked(&[("a", 3)]), "b"));
        // The leader confirmed.
        assert!(!waits_on_leader(
            &g,
            &boss,
            &asked(&[("a", 4), ("boss", 4)]),
            "b"
        ));
        // The leader never deposes itself.
        assert!(!waits_on_leader(&g, &boss, &asked(&[("a", 4)]), "boss"));
        // A leader outside the generation does not confirm, and decides after the window.
        let outside = generation(4, &["a", "b"]);
        assert!(!waits_on_leader(&outside, &boss, &asked(&[("a", 4)]), "b"));
        // A node outside the generation (waiting to join) does not depose anyone.
        assert!(!waits_on_leader(&g, &boss, &asked(&[("a", 4)]), "joiner"));
    }
}
