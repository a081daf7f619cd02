//! The agent ↔ worker contract: the messages on the agent's Unix socket, the snapshot layout
//! workers stage for the agent and read back after a restore, and the limits the agent
//! enforces on both.
//!
//! The agent (the `runtime` crate: `agent_socket` serves the socket, `state` handles each
//! message) and the Rust client ([`crate::Worker`]) both use these definitions. The Python
//! client (`runtime/python/elastic_run`) repeats them; this crate's `tests/python_client.rs`
//! checks that what it sends and writes still parses here, and that its constants agree.
//!
//! # Messages
//!
//! Newline-delimited JSON on `$ELASTIC_AGENT_SOCKET`, UTF-8, one object per line, at most
//! [`MESSAGE_BYTES_MAX`] bytes per line including the newline. A worker connects (one
//! connection per process is enough, and it may stay open for the whole run), sends a
//! [`Request`] line and reads exactly one [`Reply`] line before sending the next request.
//! Every object has a `type`.
//!
//! Requests (worker → agent):
//!
//! | request | meaning | reply |
//! |---|---|---|
//! | `{"type":"progress","rank":R,"step":S}` | rank R finished step S (feeds the hang watchdog and metrics) | `ok` |
//! | `{"type":"saved","rank":R,"step":S,"dir":"D"}` | rank R finished writing its snapshot of step S into D, a directory under `$ELASTIC_STAGING_DIR` | `ok` once the agent took it over (held back while four earlier checkpoints are uncommitted), else `error` |
//! | `{"type":"query"}` | what should the workers do? | `state` |
//! | `{"type":"skipped","rank":R,"step":S,"reason":"..."}` | rank R could not write its snapshot of step S (its staging file system is full): the agent gives the step up in the store, so no node waits for the part | `ok` |
//! | `{"type":"peer_stop","rank":R,"step":S}` | the workers agreed to stop at step S because another node's agent asked, not this one (its clean exit is then no end of the job) | `ok` |
//! | `{"type":"watch","rank":R,"generation":G}` | rank R switches generations in place (recovery in place): tell it when the job runs a generation other than G. Every rank of the node must watch for the agent to switch in place | `generation`, at once when the agent offers another generation, else after at most [`WATCH_HOLD_MS`] (then with G again) |
//! | `{"type":"switched","rank":R,"generation":G}` | rank R (its rank in G) left its old process group for generation G's, and has no save of the old generation in flight | `ok` |
//! | `{"type":"collective_failed","rank":R,"generation":G,"reason":"..."}` | a collective of rank R failed in generation G (a peer may be gone): the agent asks etcd to regroup G now, without waiting for a lost peer's lease | `ok` |
//! | `{"type":"restore","rank":R,"step":S}` | rank R needs step S from the checkpoint store: its node joined a generation whose continuing members could give the state (`$ELASTIC_HEAL_STEP` is S), and they could not. The agent restores S (or the newest older step that verifies) for all its ranks once, as it would before starting the workers | `restored` once the restore ended (at most [`RESTORE_WAIT_MS`]), else `error` |
//!
//! Steps are at most [`STEP_MAX`]; ranks must be the agent's node's ranks of the current
//! generation.
//!
//! Replies (agent → worker):
//!
//! - `{"type":"ok"}`
//! - `{"type":"state","should_stop":B,"should_checkpoint_at":S|null,"generation":G}`:
//!   `should_stop` is set while the agent drains (SIGTERM, SIGINT, a preemption notice, or a
//!   new generation on its way); workers then save the step they agree on and exit 0.
//!   `should_checkpoint_at` asks for a snapshot at that step (or the first step past it).
//! - `{"type":"generation","generation":G,"rank_offset":O,"rank":R,"env":{...}}`: the generation
//!   the workers are to run, in place: their ranks start at O, the asking worker's is R, and `env`
//!   holds the environment variables that change with a generation (`WORLD_SIZE`,
//!   `MASTER_ADDR`, `MASTER_PORT`, `ELASTIC_GENERATION`, the scaling, ...), as a new worker of
//!   it would get them.
//! - `{"type":"restored","step":S,"dir":"D"}`: the step restored for a `restore` (S may be older
//!   than asked when the newer one does not verify), laid out in D as `$ELASTIC_RESUME_DIR` is.
//! - `{"type":"error","message":"..."}`: the request was refused (bad JSON, a rank that is not
//!   this node's, a directory outside staging, a step over [`STEP_MAX`], an oversized line).
//!   After an oversized line the agent closes the connection, since it cannot find the next
//!   message boundary.
//!
//! Unknown fields are ignored, so either side can add fields without breaking the other.
//!
//! # Staged snapshots
//!
//! One directory per rank and step, written under a temporary name and renamed into place:
//!
//! ```text
//! $ELASTIC_STAGING_DIR/step-<N>/rank-<R>/tensors.safetensors   this rank's share of the tensors
//! $ELASTIC_STAGING_DIR/step-<N>/rank-<R>/meta.json             StagedMeta
//! ```
//!
//! ([`step_dir_name`], [`rank_dir_name`], [`STAGED_TENSORS`], [`STAGED_META`], [`StagedMeta`].)
//!
//! # Restored steps
//!
//! What the agent restores from the checkpoint store for a new generation
//! (`$ELASTIC_RESUME_DIR`, laid out by the `checkpoint` crate's restore):
//!
//! ```text
//! $ELASTIC_RESUME_DIR/rank-<R>/state.safetensors   every tensor rank R needs
//! $ELASTIC_RESUME_DIR/rank-<R>/metadata.json       {"step", "rank", "world_size", ...,
//!                                                   "metadata": {"elastic": {...}, "state": {...}}}
//! ```
//!
//! An agent run with `--restore-no-copy` that resumes from a `file://` store whose chunks are
//! raw writes no `state.safetensors`: it checks each chunk where it lies and writes
//!
//! ```text
//! $ELASTIC_RESUME_DIR/rank-<R>/sources.json        {"version": 1, "store", "root", "step", "name",
//!                                                   "bytes", "header", "sources": [{"path",
//!                                                   "bytes", "dev", "ino", "ctime_ns",
//!                                                   "ranges": [[at, length, offset], ...]}]}
//! ```
//!
//! instead: the file `state.safetensors` would have been (`bytes` long, its safetensors header
//! `header`), and where each range of it lies in the store's chunk files (under `root`, the
//! store's directory), each as it was when checked (device, inode, length, inode change
//! time). A reader reads there only while a chunk is still that file, unchanged. (The file
//! lies in the agent's private staging directory, trusted as `state.safetensors` would be:
//! that a chunk lies under `root` is a consistency check, not a boundary.)
//!
//! ([`RESTORED_TENSORS`], [`RESTORED_SOURCES`], [`RESTORED_META`].) Metadata files on either
//! side are read up to [`METADATA_BYTES_MAX`] bytes.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Longest request or reply line, newline included.
pub const MESSAGE_BYTES_MAX: usize = 64 * 1024;

/// Longest a `watch` is held before it is answered with an unchanged generation (the worker
/// then asks again): no request waits unbounded.
pub const WATCH_HOLD_MS: u64 = 10_000;

/// Longest a worker waits for the reply to a `restore` (the agent's restore of a large
/// checkpoint from a slow store, retries included).
pub const RESTORE_WAIT_MS: u64 = 3_600_000;

/// Largest step in a message (and in the checkpoint format, whose `STEP_MAX` is the same
/// number): the largest integer a JSON number (an IEEE double) holds exactly.
pub const STEP_MAX: u64 = (1 << 53) - 1;

/// The staged snapshot format (`meta.json` `format_version`).
pub const FORMAT_VERSION: u32 = 1;

/// A staged rank's tensor file.
pub const STAGED_TENSORS: &str = "tensors.safetensors";
/// A staged rank's metadata ([`StagedMeta`]).
pub const STAGED_META: &str = "meta.json";
/// A restored rank's tensor file (the `checkpoint` crate's `RESTORE_FILE`).
pub const RESTORED_TENSORS: &str = "state.safetensors";
/// Where a restored rank's tensor bytes lie in a `file://` store's chunks, in place of
/// [`RESTORED_TENSORS`] (an agent run with `--restore-no-copy`).
pub const RESTORED_SOURCES: &str = "sources.json";
/// The version of [`RESTORED_SOURCES`].
pub const RESTORED_SOURCES_VERSION: u32 = 1;
/// A restored rank's metadata (the `checkpoint` crate's `RESTORE_METADATA_FILE`).
pub const RESTORED_META: &str = "metadata.json";

/// Largest metadata file read: a staged `meta.json` (by the agent) or a restored
/// `metadata.json` (by the workers). Writers keep under it.
pub const METADATA_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// The directory of step `step`'s snapshot, in the staging dir: `step-<N>`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

/// The directory of rank `rank`'s part, in a staged step or a restore: `rank-<R>`.
pub fn rank_dir_name(rank: u32) -> String {
    format!("rank-{rank}")
}

/// A worker's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    /// Rank `rank` finished step `step`.
    Progress { rank: u32, step: u64 },
    /// Rank `rank` finished writing its snapshot of `step` into `dir` (under staging).
    /// `last`: the ranks agreed to stop (a drain) and this is the rank's last save, so the
    /// agent may leave the job once the step is committed, without waiting for the worker to
    /// exit (absent means `false`).
    Saved {
        rank: u32,
        step: u64,
        dir: String,
        #[serde(default)]
        last: bool,
    },
    /// What should the workers do? Answered by [`Reply::State`].
    Query {},
    /// Rank `rank` could not write its snapshot of `step` (its staging disk is full).
    Skipped {
        rank: u32,
        step: u64,
        reason: String,
    },
    /// The workers agreed to stop at `step` because another node's agent asked (a peer's
    /// drain), not this one: their clean exit does not mean the job is done.
    PeerStop { rank: u32, step: u64 },
    /// Rank `rank` switches generations in place: answered with [`Reply::Generation`] once
    /// the agent offers a generation other than `generation` (or after [`WATCH_HOLD_MS`]).
    Watch { rank: u32, generation: u64 },
    /// Rank `rank` (its rank in `generation`) switched to `generation` in place: its saves
    /// from now on belong to it.
    Switched { rank: u32, generation: u64 },
    /// A collective of rank `rank` failed in `generation`: the agent asks for a regroup.
    CollectiveFailed {
        rank: u32,
        generation: u64,
        reason: String,
    },
    /// Rank `rank` needs step `step` restored from the checkpoint store (its node joined
    /// without a restore, and no peer held the step): answered by [`Reply::Restored`].
    Restore { rank: u32, step: u64 },
}

impl Request {
    /// Every request's `type`, in declaration order.
    pub const KINDS: [&'static str; 9] = [
        "progress",
        "saved",
        "query",
        "skipped",
        "peer_stop",
        "watch",
        "switched",
        "collective_failed",
        "restore",
    ];

    /// This request's `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            Request::Progress { .. } => "progress",
            Request::Saved { .. } => "saved",
            Request::Query {} => "query",
            Request::Skipped { .. } => "skipped",
            Request::PeerStop { .. } => "peer_stop",
            Request::Watch { .. } => "watch",
            Request::Switched { .. } => "switched",
            Request::CollectiveFailed { .. } => "collective_failed",
            Request::Restore { .. } => "restore",
        }
    }
}

/// The agent's reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Ok,
    State {
        should_stop: bool,
        should_checkpoint_at: Option<u64>,
        generation: u64,
    },
    /// The generation to run in place (see the module docs).
    Generation {
        generation: u64,
        rank_offset: u32,
        /// The asking worker's rank in `generation`.
        rank: u32,
        env: std::collections::BTreeMap<String, String>,
    },
    /// The step restored for a [`Request::Restore`], laid out in `dir` as
    /// `$ELASTIC_RESUME_DIR` is.
    Restored {
        step: u64,
        dir: String,
    },
    Error {
        message: String,
    },
}

/// A staged rank's `meta.json`, as the worker clients write it. The agent reads it leniently
/// (`world_size` and `state` may be absent); `format_version` must be [`FORMAT_VERSION`].
///
/// Fields are in name order, the order the Rust client wrote them in before this type (a
/// `serde_json::json!` object), so its files stay byte for byte the same.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagedMeta {
    pub format_version: u32,
    /// The tensors in this rank's [`STAGED_TENSORS`], sorted.
    pub keys: Vec<String>,
    pub rank: u32,
    /// The trainer's (replicated) JSON state: every rank records it, so any node's agent can
    /// commit the step.
    pub state: Value,
    pub step: u64,
    pub world_size: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_and_replies_have_the_documented_json() {
        let cases = [
            (
                Request::Progress { rank: 1, step: 9 },
                json!({"type":"progress","rank":1,"step":9}),
            ),
            (
                Request::Saved {
                    rank: 0,
                    step: 5,
                    dir: "/s/step-5/rank-0".into(),
                    last: true,
                },
                json!({"type":"saved","rank":0,"step":5,"dir":"/s/step-5/rank-0","last":true}),
            ),
            (Request::Query {}, json!({"type":"query"})),
            (
                Request::Skipped {
                    rank: 2,
                    step: 8,
                    reason: "full".into(),
                },
                json!({"type":"skipped","rank":2,"step":8,"reason":"full"}),
            ),
            (
                Request::PeerStop { rank: 3, step: 7 },
                json!({"type":"peer_stop","rank":3,"step":7}),
            ),
            (
                Request::Watch {
                    rank: 1,
                    generation: 4,
                },
                json!({"type":"watch","rank":1,"generation":4}),
            ),
            (
                Request::Switched {
                    rank: 0,
                    generation: 5,
                },
                json!({"type":"switched","rank":0,"generation":5}),
            ),
            (
                Request::CollectiveFailed {
                    rank: 1,
                    generation: 5,
                    reason: "reset".into(),
                },
                json!({"type":"collective_failed","rank":1,"generation":5,"reason":"reset"}),
            ),
            (
                Request::Restore { rank: 2, step: 40 },
                json!({"type":"restore","rank":2,"step":40}),
            ),
        ];
        for (req, want) in &cases {
            assert_eq!(&serde_json::to_value(req).unwrap(), want);
            assert_eq!(
                &serde_json::from_value::<Request>(want.clone()).unwrap(),
                req
            );
            assert_eq!(want["type"], req.kind());
        }
        let kinds: Vec<&str> = cases.iter().map(|(r, _)| r.kind()).collect();
        assert_eq!(kinds, Request::KINDS);
        for (reply, want) in [
            (Reply::Ok, json!({"type":"ok"})),
            (
                Reply::State {
                    should_stop: true,
                    should_checkpoint_at: None,
                    generation: 3,
                },
                json!({"type":"state","should_stop":true,"should_checkpoint_at":null,"generation":3}),
            ),
            (
                Reply::Generation {
                    generation: 5,
                    rank_offset: 2,
                    rank: 3,
                    env: [("WORLD_SIZE".to_string(), "4".to_string())].into(),
                },
                json!({"type":"generation","generation":5,"rank_offset":2,"rank":3,"env":{"WORLD_SIZE":"4"}}),
            ),
            (
                Reply::Restored {
                    step: 30,
                    dir: "/s/.restore/step-30".into(),
                },
                json!({"type":"restored","step":30,"dir":"/s/.restore/step-30"}),
            ),
            (
                Reply::Error {
                    message: "no".into(),
                },
                json!({"type":"error","message":"no"}),
            ),
        ] {
            assert_eq!(serde_json::to_value(&reply).unwrap(), want);
            assert_eq!(serde_json::from_value::<Reply>(want).unwrap(), reply);
        }
    }

    #[test]
    fn unknown_fields_are_ignored_and_unknown_types_refused() {
        let r: Request =
            serde_json::from_str(r#"{"type":"query","extra":1}"#).expect("extra fields pass");
        assert_eq!(r, Request::Query {});
        for bad in [
            r#"{"type":"launch"}"#,
            r#"{"type":"progress","rank":-1,"step":1}"#,
            r#"{"type":"progress","rank":1}"#,
            r#"{"rank":1,"step":1}"#,
            "[]",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn staged_meta_writes_its_fields_in_name_order() {
        let m = StagedMeta {
            format_version: FORMAT_VERSION,
            keys: vec!["a".into(), "b".into()],
            rank: 1,
            state: json!({"z": 1, "a": [2]}),
            step: 40,
            world_size: 2,
        };
        let text = serde_json::to_string(&m).unwrap();
        // The bytes a `json!` object of the same fields gives.
        let as_map = json!({
            "format_version": 1, "step": 40, "rank": 1, "world_size": 2,
            "keys": ["a", "b"], "state": {"z": 1, "a": [2]},
        });
        assert_eq!(text, as_map.to_string());
        assert_eq!(serde_json::from_str::<StagedMeta>(&text).unwrap(), m);
        assert_eq!(
            format!("{}/{}", step_dir_name(40), rank_dir_name(1)),
            "step-40/rank-1"
        );
    }
}
