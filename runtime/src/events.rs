//! The agent's event log (`--events-file`): one JSON object per line, appended, for tools
//! that follow a run (the chaos harness, the benchmarks, the main job's summary).
//!
//! Every line has `ts_ms` (unix milliseconds), `node` (node id) and `event`, plus the event's
//! fields:
//!
//! | event | fields |
//! |---|---|
//! | `rdzv_served` | `endpoint` (the c10d rendezvous, `HOST:PORT`), `listen` (the client URL its etcd listens on), `pid` (etcd's): this node serves the rendezvous |
//! | `joined` | `addr`, `rejoin` (`true`, only when the node joined again after a fence) |
//! | `generation` | `generation`, `world_size`, `node_rank`, `rank_offset`, `members`, `lr_scale`, `lr`, `batch_size`, `global_batch`, `grad_accum_steps`, `resume_step`, `prev_last_step` (the highest step this node's workers reported before), `frozen_unix_ms` (when the leader froze it; etcd membership only), `in_place` (true when the running workers switched to it without a restart; `resume_step` is then the highest step they had reported; absent otherwise), `restored_bytes` (what its restore of `resume_step` read from the checkpoint store; absent without a restore), `heal_step` (the step this node joined at without restoring it, from members that continue from memory; absent otherwise) |
//! | `workers_started` | `generation`, `restart_count` |
//! | `first_step` | `generation`, `step` (the first progress report of a worker group) |
//! | `checkpoint_committed` | `step`, `generation`, `bytes`, `by_this_node`, `store_ms` (this node's upload and commit time in the store) |
//! | `checkpoint_skipped` | `step`, `generation`, `rank`, `reason` (a worker could not stage its snapshot: a full staging disk) |
//! | `staging_too_small` | `step`, `checkpoint_bytes`, `staging_bytes`, `needed_bytes` (at the first checkpoint, when staging cannot hold five of them) |
//! | `restore_fell_back` | `generation`, `skipped` (newer committed steps that did not verify), `step` (the one restored) |
//! | `restored_on_demand` | `generation`, `step`, `bytes` (read from the checkpoint store; the node joined without a restore, no live peer held the step, and the agent restored it on its workers' request) |
//! | `drain_started` | `reason` (`signal`, `notice`, `peer`) |
//! | `worker_failed` | `generation`, `rank`, `exit_code` |
//! | `fenced` | `reason` |
//! | `left` | `step` (the newest commit it knew of), `workers_running` (`true` when a drained node left as soon as its last step was committed, before its workers finished exiting) |
//! | `exit` | `code` |
//!
//! [`Event`] is that table as a type: the agent writes an [`Event`], tools read a line back
//! as a [`Record`]. Optional values (`lr`, `batch_size`, `global_batch`, `resume_step`,
//! `prev_last_step`) are written as `null` when unknown; `frozen_unix_ms` is left out then. A
//! test holds the table and the type to each other.
//!
//! Writing never fails the agent: an unwritable file is reported once and then ignored.
//! Each line is written with one `write` call on an `O_APPEND` file, so agents of several
//! nodes may share one file.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Why a drain started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainReason {
    /// SIGTERM or SIGINT.
    Signal,
    /// A cloud preemption notice.
    Notice,
    /// A peer of the generation announced its drain.
    Peer,
}

/// One event, as the module's table lists them (`event` is the variant's name in snake case).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// This node serves the job's rendezvous (`--rdzv-backend c10d`): an etcd it started.
    RdzvServed {
        endpoint: String,
        listen: String,
        pid: u32,
    },
    /// The node joined the job (again, after a fence, with `rejoin`).
    Joined {
        addr: String,
        /// Written only when `true`.
        #[serde(default, skip_serializing_if = "is_false")]
        rejoin: bool,
    },
    /// A generation this node runs in, as it runs it (after its restore).
    Generation {
        generation: u64,
        world_size: u32,
        node_rank: u32,
        rank_offset: u32,
        members: Vec<String>,
        lr_scale: f64,
        lr: Option<f64>,
        batch_size: Option<u64>,
        global_batch: Option<u64>,
        grad_accum_steps: u64,
        resume_step: Option<u64>,
        /// Bytes this node's restore of `resume_step` read from the checkpoint store (0 when it
        /// reused local bytes; absent when nothing was restored).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        restored_bytes: Option<u64>,
        /// The step this node joined at without restoring it: the generation's continuing
        /// members hold it, and the workers take it from them (`restored_on_demand` follows
        /// when they could not).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        heal_step: Option<u64>,
        /// The highest step this node's workers reported before this generation.
        prev_last_step: Option<u64>,
        /// When the leader froze the generation (its record's creation time); absent in
        /// fixed membership.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        frozen_unix_ms: Option<u64>,
        /// The running workers switched to it in place (no restart, no restore).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        in_place: bool,
    },
    WorkersStarted {
        generation: u64,
        restart_count: u32,
    },
    /// The first progress report of a worker group.
    FirstStep {
        generation: u64,
        step: u64,
    },
    CheckpointCommitted {
        step: u64,
        generation: u64,
        bytes: u64,
        by_this_node: bool,
        /// This node's time in the store for the step: its upload, then the commit (the
        /// manifest, or finding a peer's). Time queued behind earlier commits is not counted.
        #[serde(default)]
        store_ms: u64,
    },
    /// A worker could not stage its snapshot (a full staging disk): the step is given up.
    CheckpointSkipped {
        step: u64,
        generation: u64,
        rank: u32,
        reason: String,
    },
    /// At the first checkpoint: staging cannot hold the commit pipeline's checkpoints.
    StagingTooSmall {
        step: u64,
        checkpoint_bytes: u64,
        staging_bytes: u64,
        needed_bytes: u64,
    },
    /// Newer committed steps did not verify (`skipped`); `step` was restored instead.
    RestoreFellBack {
        generation: u64,
        skipped: Vec<u64>,
        step: u64,
    },
    /// The workers of a node that joined without a restore found no live peer holding the
    /// step, and the agent restored `step` from the store on their request.
    RestoredOnDemand {
        generation: u64,
        step: u64,
        /// Bytes it read from the checkpoint store.
        bytes: u64,
    },
    DrainStarted {
        reason: DrainReason,
    },
    WorkerFailed {
        generation: u64,
        rank: u32,
        exit_code: i32,
    },
    Fenced {
        reason: String,
    },
    /// The node left the job (its lease revoked): peers re-form without it.
    Left {
        step: Option<u64>,
        workers_running: bool,
    },
    Exit {
        code: u8,
    },
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Event {
    /// The `event` value of its line.
    pub fn name(&self) -> &'static str {
        match self {
            Event::RdzvServed { .. } => "rdzv_served",
            Event::Joined { .. } => "joined",
            Event::Generation { .. } => "generation",
            Event::WorkersStarted { .. } => "workers_started",
            Event::FirstStep { .. } => "first_step",
            Event::CheckpointCommitted { .. } => "checkpoint_committed",
            Event::CheckpointSkipped { .. } => "checkpoint_skipped",
            Event::StagingTooSmall { .. } => "staging_too_small",
            Event::RestoreFellBack { .. } => "restore_fell_back",
            Event::RestoredOnDemand { .. } => "restored_on_demand",
            Event::DrainStarted { .. } => "drain_started",
            Event::WorkerFailed { .. } => "worker_failed",
            Event::Fenced { .. } => "fenced",
            Event::Left { .. } => "left",
            Event::Exit { .. } => "exit",
        }
    }
}

/// One line of the log: when, which node, what.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub ts_ms: u64,
    pub node: String,
    #[serde(flatten)]
    pub event: Event,
}

impl Record {
    /// Reads one line (without its newline).
    pub fn parse(line: &str) -> serde_json::Result<Record> {
        serde_json::from_str(line)
    }
}

/// Where events go; a no-op without `--events-file`.
#[derive(Debug, Default)]
pub struct Events {
    node: String,
    file: Mutex<Option<std::fs::File>>,
}

impl Events {
    pub fn open(path: Option<&Path>, node: &str) -> std::io::Result<Self> {
        let file = match path {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            ),
            None => None,
        };
        Ok(Events {
            node: node.to_string(),
            file: Mutex::new(file),
        })
    }

    /// Appends `event`, stamped with the time and this node.
    pub fn emit(&self, event: Event) {
        let mut guard = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let Some(f) = guard.as_mut() else { return };
        let record = Record {
            ts_ms: now_unix_ms(),
            node: self.node.clone(),
            event,
        };
        let mut line = match serde_json::to_string(&record) {
            Ok(l) => l,
            Err(e) => {
                // Not expected for these types; should it happen, the event is dropped, not the log.
                tracing::warn!(error = %e, event = record.event.name(), "cannot write an event as JSON");
                return;
            }
        };
        line.push('\n');
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "cannot write the events file; no more events are written");
            *guard = None;
        }
    }
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::{Value, json};

    use super::*;

    /// One of each variant, every optional value set.
    fn examples() -> Vec<Event> {
        vec![
            Event::RdzvServed {
                endpoint: "trainer-0:29400".into(),
                listen: "http://0.0.0.0:29400".into(),
                pid: 4242,
            },
            Event::Joined {
                addr: "10.0.0.1".into(),
                rejoin: true,
            },
            Event::Generation {
                generation: 3,
                world_size: 4,
                node_rank: 1,
                rank_offset: 2,
                members: vec!["a".into(), "b".into()],
                lr_scale: 0.5,
                lr: Some(0.025),
                batch_size: Some(8),
                global_batch: Some(32),
                grad_accum_steps: 1,
                resume_step: Some(10),
                restored_bytes: Some(4096),
                heal_step: Some(10),
                prev_last_step: Some(13),
                frozen_unix_ms: Some(1_796_000_000_000),
                in_place: true,
            },
            Event::WorkersStarted {
                generation: 3,
                restart_count: 1,
            },
            Event::FirstStep {
                generation: 3,
                step: 11,
            },
            Event::CheckpointCommitted {
                step: 20,
                generation: 3,
                bytes: 1 << 20,
                by_this_node: true,
                store_ms: 840,
            },
            Event::CheckpointSkipped {
                step: 30,
                generation: 3,
                rank: 1,
                reason: "ENOSPC".into(),
            },
            Event::StagingTooSmall {
                step: 10,
                checkpoint_bytes: 100,
                staging_bytes: 200,
                needed_bytes: 500,
            },
            Event::RestoreFellBack {
                generation: 4,
                skipped: vec![30, 20],
                step: 10,
            },
            Event::RestoredOnDemand {
                generation: 4,
                step: 30,
                bytes: 4096,
            },
            Event::DrainStarted {
                reason: DrainReason::Peer,
            },
            Event::WorkerFailed {
                generation: 3,
                rank: 2,
                exit_code: 137,
            },
            Event::Fenced {
                reason: "lease lost".into(),
            },
            Event::Left {
                step: Some(55),
                workers_running: true,
            },
            Event::Exit { code: 143 },
        ]
    }

    /// The module doc's table: event name and the field names outside parentheses.
    fn doc_table() -> Vec<(String, BTreeSet<String>)> {
        let backticked = |s: &str| -> Vec<String> {
            s.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect()
        };
        include_str!("events.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .filter_map(|l| l.strip_prefix("//! | `"))
            .map(|row| {
                let (name, fields) = row.split_once("` |").expect("a table row");
                let mut outside = String::new();
                let mut depth = 0usize;
                for c in fields.chars() {
                    match c {
                        '(' => depth += 1,
                        ')' => depth = depth.saturating_sub(1),
                        c if depth == 0 => outside.push(c),
                        _ => {}
                    }
                }
                (name.to_string(), backticked(&outside).into_iter().collect())
            })
            .collect()
    }

    /// The variants named in `pub enum Event`, in snake case.
    fn variants_in_source() -> Vec<String> {
        let src = include_str!("events.rs");
        let body = src
            .split_once("pub enum Event {")
            .expect("the enum")
            .1
            .split_once("\n}\n")
            .expect("its end")
            .0;
        body.lines()
            .filter_map(|l| l.strip_prefix("    "))
            .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
            .map(|l| {
                let ident: String = l.chars().take_while(|c| c.is_alphanumeric()).collect();
                let mut snake = String::new();
                for (i, c) in ident.chars().enumerate() {
                    if c.is_ascii_uppercase() {
                        if i > 0 {
                            snake.push('_');
                        }
                        snake.push(c.to_ascii_lowercase());
                    } else {
                        snake.push(c);
                    }
                }
                snake
            })
            .collect()
    }

    #[test]
    fn the_doc_table_lists_every_event_with_its_fields() {
        let table = doc_table();
        let names: Vec<&str> = table.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            variants_in_source(),
            "the table's rows are the variants"
        );
        let examples = examples();
        assert_eq!(
            examples.iter().map(Event::name).collect::<Vec<_>>(),
            names,
            "one example per variant"
        );
        for e in examples {
            let Value::Object(line) = serde_json::to_value(Record {
                ts_ms: 1,
                node: "n".into(),
                event: e.clone(),
            })
            .unwrap() else {
                panic!("not an object")
            };
            assert_eq!(line["event"], e.name());
            let fields: BTreeSet<String> = line
                .keys()
                .filter(|k| !matches!(k.as_str(), "ts_ms" | "node" | "event"))
                .cloned()
                .collect();
            let documented = &table.iter().find(|(n, _)| n == e.name()).unwrap().1;
            assert_eq!(&fields, documented, "fields of {}", e.name());
        }
    }

    #[test]
    fn records_read_back_what_was_written() {
        for e in examples() {
            let r = Record {
                ts_ms: 5,
                node: "n1".into(),
                event: e,
            };
            let line = serde_json::to_string(&r).unwrap();
            assert!(
                line.starts_with(r#"{"ts_ms":5,"node":"n1","event":""#),
                "{line}"
            );
            assert_eq!(Record::parse(&line).unwrap(), r);
        }
    }

    #[test]
    fn lines_keep_the_shapes_tools_read() {
        // As the untyped writer wrote them: `rejoin` only on a rejoin, unknown values as
        // null, the drain reason as a string.
        let joined = |rejoin| {
            serde_json::to_value(Event::Joined {
                addr: "a:1".into(),
                rejoin,
            })
            .unwrap()
        };
        assert_eq!(joined(false), json!({"event": "joined", "addr": "a:1"}));
        assert_eq!(
            joined(true),
            json!({"event": "joined", "addr": "a:1", "rejoin": true})
        );
        let g = serde_json::to_value(Event::Generation {
            generation: 0,
            world_size: 2,
            node_rank: 0,
            rank_offset: 0,
            members: vec!["n".into()],
            lr_scale: 1.0,
            lr: None,
            batch_size: None,
            global_batch: None,
            grad_accum_steps: 1,
            resume_step: None,
            restored_bytes: None,
            heal_step: None,
            prev_last_step: None,
            frozen_unix_ms: None,
            in_place: false,
        })
        .unwrap();
        for k in [
            "lr",
            "batch_size",
            "global_batch",
            "resume_step",
            "prev_last_step",
        ] {
            assert_eq!(g.get(k), Some(&Value::Null), "{k}");
        }
        // Only a node that joined without a restore says at which step.
        assert_eq!(g.get("heal_step"), None);
        assert_eq!(
            serde_json::to_value(Event::DrainStarted {
                reason: DrainReason::Signal
            })
            .unwrap(),
            json!({"event": "drain_started", "reason": "signal"})
        );
        // A line of the untyped writer (keys sorted, fields missing where it left them out).
        let old = r#"{"addr":"127.0.0.1","event":"joined","node":"node0","ts_ms":17}"#;
        assert_eq!(
            Record::parse(old).unwrap(),
            Record {
                ts_ms: 17,
                node: "node0".into(),
                event: Event::Joined {
                    addr: "127.0.0.1".into(),
                    rejoin: false
                }
            }
        );
        assert!(Record::parse(r#"{"ts_ms":1,"node":"n","event":"nonsense"}"#).is_err());
        assert!(Record::parse(r#"{"ts_ms":1,"node":"n","event":"exit"}"#).is_err());
    }

    #[test]
    fn events_are_json_lines_with_node_and_time() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ev.jsonl");
        let ev = Events::open(Some(&path), "n1").unwrap();
        ev.emit(Event::WorkersStarted {
            generation: 3,
            restart_count: 4,
        });
        ev.emit(Event::Exit { code: 0 });
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "workers_started");
        assert_eq!(lines[0]["node"], "n1");
        assert_eq!(lines[0]["restart_count"], 4);
        assert!(lines[1]["ts_ms"].as_u64().unwrap() > 0);
        let back: Vec<Record> = text.lines().map(|l| Record::parse(l).unwrap()).collect();
        assert_eq!(back[1].event, Event::Exit { code: 0 });
        // No file: a no-op.
        Events::open(None, "n")
            .unwrap()
            .emit(Event::Exit { code: 0 });
    }
}
