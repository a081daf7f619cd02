//! The job as one node sees it: the keys under `/elastic-run/<job>/`, parsed, from a full read
//! and then from watch events. Bad values are logged and skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use etcd_client::KeyValue;

use crate::keys::Keys;
use crate::record::{
    self, CommitRecord, EpochRecord, Generation, JobState, LeaderRecord, MemberRecord,
    RestartRecord, WaitingRecord,
};
use crate::{Error, Result};

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
    /// Regroup requests and confirmations by member (`ctl/regroup/<node>`).
    pub regroups: BTreeMap<String, RestartRecord>,
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
                    apply_request(&mut self.restarts, key, &r["ctl/restart/".len()..], v)?;
                }
                (r, v) if r.starts_with("ctl/regroup/") => {
                    apply_request(&mut self.regroups, key, &r["ctl/regroup/".len()..], v)?;
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
    pub(super) fn reset_from(&mut self, keys: &Keys, kvs: &[KeyValue], with_members: bool) {
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

/// A request key of one member (`ctl/restart/<node>`, `ctl/regroup/<node>`) put or deleted: the
/// record must name the node of its key; at most [`MEMBERS_MAX`] are kept.
fn apply_request(
    map: &mut BTreeMap<String, RestartRecord>,
    key: &str,
    id: &str,
    v: Option<&[u8]>,
) -> Result<()> {
    match v {
        Some(v) => {
            let req: RestartRecord = record::parse(key, v)?;
            if req.node_id != id {
                return Err(Error::BadValue {
                    key: key.to_string(),
                    reason: format!("record names node {}", req.node_id),
                });
            }
            if map.len() < MEMBERS_MAX || map.contains_key(id) {
                map.insert(id.to_string(), req);
            }
        }
        None => {
            map.remove(id);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RankedMember;

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
                continuing: false,
            }],
            world_size: 1,
            master_addr: "h".into(),
            master_port: 1,
            scaling: crate::scaling::decision_for_tests(),
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
