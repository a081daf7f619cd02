//! Records stored in etcd, as versioned JSON. Parsing never panics: a bad value gives
//! [`Error::BadValue`] or [`Error::UnsupportedVersion`] naming the key.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::scaling::ScalingDecision;
use crate::{Error, Result};

/// The record format version this build writes and reads.
pub const RECORD_VERSION: u32 = 1;
/// Values larger than this are rejected before parsing.
pub const RECORD_BYTES_MAX: usize = 4 << 20;
/// Node ids are path segments in etcd keys: short, and no `/`.
pub const NODE_ID_BYTES_MAX: usize = 128;

/// One node in a generation, in rank order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankedMember {
    pub node_id: String,
    /// Host name or address other nodes reach it at.
    pub addr: String,
    pub nproc: u32,
    /// Global rank of this node's local rank 0 (the sum of `nproc` of the nodes before it).
    pub rank_offset: u32,
    /// It was a member of the generation this one replaced: its workers may hold the job's
    /// state in memory (recovery in place), so a member that is not continuing can heal from
    /// it instead of reading the checkpoint store.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub continuing: bool,
}

/// A frozen generation: who is in the job, in which order, and with what scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    pub version: u32,
    /// Starts at 1 and grows by one per generation. It keeps growing across a total loss
    /// (every member lease expired, e.g. an etcd outage longer than the TTL): the highest
    /// number frozen is kept in `ctl/epoch` ([`EpochRecord`]) under a retention lease, so the
    /// first generation after the loss takes the next number. Only when the job id was idle
    /// for longer than that retention ([`STATE_RETENTION_S`]) does it start at 1 again.
    ///
    /// [`STATE_RETENTION_S`]: crate::keys::STATE_RETENTION_S
    pub number: u64,
    /// Members in rank order (`GROUP_RANK` is the index).
    pub members: Vec<RankedMember>,
    /// Total processes (`WORLD_SIZE`).
    pub world_size: u32,
    /// Rank 0's node address and the port it reserved.
    pub master_addr: String,
    pub master_port: u16,
    pub scaling: ScalingDecision,
    /// The committed checkpoint step to resume from, if any.
    pub resume_step: Option<u64>,
    pub created_unix_ms: u64,
}

impl Generation {
    /// The member entry and group rank of `node_id`, if it is in this generation.
    pub fn member(&self, node_id: &str) -> Option<(usize, &RankedMember)> {
        self.members
            .iter()
            .enumerate()
            .find(|(_, m)| m.node_id == node_id)
    }

    /// Node ids in rank order.
    pub fn node_ids(&self) -> Vec<String> {
        self.members.iter().map(|m| m.node_id.clone()).collect()
    }

    /// Whether a member other than `node_id` continues from the generation before: its
    /// workers may hold the job's state for `node_id`'s to take.
    pub fn continues_besides(&self, node_id: &str) -> bool {
        self.members
            .iter()
            .any(|m| m.continuing && m.node_id != node_id)
    }

    /// Checks the invariants a reader relies on.
    pub fn validate(&self, key: &str) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::BadValue {
                key: key.to_string(),
                reason,
            })
        };
        if self.number == 0 {
            return bad("generation number 0".into());
        }
        if self.members.is_empty() {
            return bad("no members".into());
        }
        let mut seen = BTreeSet::new();
        let mut offset: u64 = 0;
        for m in &self.members {
            validate_node_id(&m.node_id).or_else(&bad)?;
            if !seen.insert(m.node_id.as_str()) {
                return bad(format!("node {} listed twice", m.node_id));
            }
            if m.nproc == 0 {
                return bad(format!("node {} has nproc 0", m.node_id));
            }
            if u64::from(m.rank_offset) != offset {
                return bad(format!(
                    "node {} has rank offset {}, expected {offset}",
                    m.node_id, m.rank_offset
                ));
            }
            offset += u64::from(m.nproc);
        }
        if u64::from(self.world_size) != offset {
            return bad(format!(
                "world size {} but members sum to {offset}",
                self.world_size
            ));
        }
        if self.master_addr != self.members[0].addr {
            return bad("master address is not rank 0's address".into());
        }
        Ok(())
    }
}

/// A member's registration, stored at `members/<node>` under the member's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub version: u32,
    pub node_id: String,
    pub addr: String,
    pub nproc: u32,
    /// A port this node reserved, used as `MASTER_PORT` when it is rank 0.
    pub master_port: u16,
    pub joined_unix_ms: u64,
    /// A second reserved port. When this node is rank 0 again right after a generation that
    /// used `master_port` on it, the next generation uses this one, so new workers never race
    /// the previous generation's TCPStore for its port. `None` when the port was configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare_master_port: Option<u16>,
}

/// The leader key's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    pub version: u32,
    pub node_id: String,
    /// The leader's member lease; the leader key and the generation are attached to it.
    pub lease_id: i64,
}

/// The newest committed checkpoint step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRecord {
    pub version: u32,
    pub step: u64,
    pub committed_unix_ms: u64,
    pub node_id: String,
    /// The generation whose workers saved the step; `None` when the reporter did not know
    /// it (a step found in the bucket at start, or one the leader records at a freeze).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
}

/// The leader's notice that the current generation is broken (members lost) and cannot be
/// re-formed yet because fewer than `min` nodes are left. Agents stop their workers and wait.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitingRecord {
    pub version: u32,
    /// The broken generation's number.
    pub generation: u64,
    pub reason: String,
    /// When the job fails unless enough nodes join.
    pub until_unix_ms: u64,
}

/// A member's request to restart generation `generation` (its workers failed), stored at
/// `ctl/restart/<node>` under the requester's lease. The leader acts on it while that
/// generation is current, which makes it act once however many nodes ask.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartRecord {
    pub version: u32,
    pub generation: u64,
    pub node_id: String,
    /// Why, for logs and `status`; at most [`REASON_BYTES_MAX`] bytes.
    pub reason: String,
    pub requested_unix_ms: u64,
}

/// How long a restart request's reason may be.
pub const REASON_BYTES_MAX: usize = 1024;

/// The highest generation number frozen in this job, at `ctl/epoch` under a retention lease:
/// what keeps generation numbers growing across a total loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub version: u32,
    pub number: u64,
}

/// A finished or failed job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobState {
    pub version: u32,
    pub outcome: Outcome,
    pub reason: String,
    pub at_unix_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
}

/// Records with a `version` field.
pub trait Versioned {
    fn version(&self) -> u32;
    /// Record-specific checks after parsing.
    fn check(&self, _key: &str) -> Result<()> {
        Ok(())
    }
}

macro_rules! versioned {
    ($($t:ty),*) => {$(impl Versioned for $t { fn version(&self) -> u32 { self.version } })*};
}
versioned!(
    LeaderRecord,
    CommitRecord,
    JobState,
    WaitingRecord,
    EpochRecord
);

impl Versioned for RestartRecord {
    fn version(&self) -> u32 {
        self.version
    }
    fn check(&self, key: &str) -> Result<()> {
        let bad = |reason: String| Error::BadValue {
            key: key.to_string(),
            reason,
        };
        validate_node_id(&self.node_id).map_err(bad)?;
        if self.generation == 0 {
            return Err(bad("restart of generation 0".into()));
        }
        if self.reason.len() > REASON_BYTES_MAX {
            return Err(bad(format!(
                "reason of {} bytes, over {REASON_BYTES_MAX}",
                self.reason.len()
            )));
        }
        Ok(())
    }
}

impl Versioned for Generation {
    fn version(&self) -> u32 {
        self.version
    }
    fn check(&self, key: &str) -> Result<()> {
        self.validate(key)
    }
}

impl Versioned for MemberRecord {
    fn version(&self) -> u32 {
        self.version
    }
    fn check(&self, key: &str) -> Result<()> {
        validate_node_id(&self.node_id).map_err(|reason| Error::BadValue {
            key: key.to_string(),
            reason,
        })?;
        if self.nproc == 0 {
            return Err(Error::BadValue {
                key: key.to_string(),
                reason: "nproc 0".into(),
            });
        }
        Ok(())
    }
}

/// Parses and checks a record read from `key`.
pub fn parse<T: DeserializeOwned + Versioned>(key: &str, value: &[u8]) -> Result<T> {
    if value.len() > RECORD_BYTES_MAX {
        return Err(Error::BadValue {
            key: key.to_string(),
            reason: format!("{} bytes, over {RECORD_BYTES_MAX}", value.len()),
        });
    }
    // Parse once (the common case); only on failure read the version alone, so that an unknown
    // version is reported as such rather than as a parse error.
    #[derive(Deserialize)]
    struct Probe {
        version: u32,
    }
    let record: T = match serde_json::from_slice(value) {
        Ok(r) => r,
        Err(e) => {
            return Err(match serde_json::from_slice::<Probe>(value) {
                Ok(p) if p.version != RECORD_VERSION => Error::UnsupportedVersion {
                    key: key.to_string(),
                    found: p.version,
                    supported: RECORD_VERSION,
                },
                Ok(_) => Error::BadValue {
                    key: key.to_string(),
                    reason: e.to_string(),
                },
                Err(pe) => Error::BadValue {
                    key: key.to_string(),
                    reason: format!("not a versioned JSON record: {pe}"),
                },
            });
        }
    };
    if record.version() != RECORD_VERSION {
        return Err(Error::UnsupportedVersion {
            key: key.to_string(),
            found: record.version(),
            supported: RECORD_VERSION,
        });
    }
    record.check(key)?;
    Ok(record)
}

/// Runs `value` through the parser of every record kind and returns how many accepted it.
/// For the fuzz target (`elastic/fuzz`) and the must-not-panic test: a new record kind is
/// added here, so both cover it.
#[doc(hidden)]
pub fn parse_every_kind(key: &str, value: &[u8]) -> usize {
    [
        parse::<Generation>(key, value).is_ok(),
        parse::<MemberRecord>(key, value).is_ok(),
        parse::<LeaderRecord>(key, value).is_ok(),
        parse::<CommitRecord>(key, value).is_ok(),
        parse::<WaitingRecord>(key, value).is_ok(),
        parse::<JobState>(key, value).is_ok(),
        parse::<RestartRecord>(key, value).is_ok(),
        parse::<EpochRecord>(key, value).is_ok(),
    ]
    .into_iter()
    .filter(|ok| *ok)
    .count()
}

/// Serializes a record for etcd.
pub fn encode<T: Serialize>(record: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail (no maps with non-string keys).
    serde_json::to_vec(record).expect("records serialize")
}

/// Checks a node id: non-empty, at most [`NODE_ID_BYTES_MAX`] bytes, printable ASCII, no `/`.
pub fn validate_node_id(id: &str) -> std::result::Result<(), String> {
    if id.is_empty() || id.len() > NODE_ID_BYTES_MAX {
        return Err(format!(
            "node id {id:?} must be 1..={NODE_ID_BYTES_MAX} bytes"
        ));
    }
    if !id
        .bytes()
        .all(|c| c.is_ascii_graphic() && c != b'/' && c != b'\\')
    {
        return Err(format!(
            "node id {id:?} must be printable ASCII without '/' or '\\'"
        ));
    }
    Ok(())
}
