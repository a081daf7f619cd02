//! The agent's event log (`--events-file`): one JSON object per line, appended, for tools
//! that follow a run (the chaos harness, the benchmarks, the main job's summary).
//!
//! Every line has `ts_ms` (unix milliseconds), `node` (node id) and `event`, plus the event's
//! fields:
//!
//! | event | fields |
//! |---|---|
//! | `joined` | `addr` |
//! | `generation` | `generation`, `world_size`, `node_rank`, `rank_offset`, `members`, `lr_scale`, `lr`, `batch_size`, `global_batch`, `grad_accum_steps`, `resume_step`, `prev_last_step` (the highest step this node's workers reported before) |
//! | `workers_started` | `generation`, `restart_count` |
//! | `first_step` | `generation`, `step` (the first progress report of a worker group) |
//! | `checkpoint_committed` | `step`, `generation`, `bytes`, `by_this_node` |
//! | `checkpoint_skipped` | `step`, `generation`, `rank`, `reason` (a worker could not stage its snapshot: a full staging disk) |
//! | `staging_too_small` | `step`, `checkpoint_bytes`, `staging_bytes`, `needed_bytes` (at the first checkpoint, when staging cannot hold five of them) |
//! | `restore_fell_back` | `generation`, `skipped` (newer committed steps that did not verify), `step` (the one restored) |
//! | `drain_started` | `reason` (`signal`, `notice`, `peer`) |
//! | `worker_failed` | `generation`, `rank`, `exit_code` |
//! | `fenced` | `reason` |
//! | `exit` | `code` |
//!
//! Writing never fails the agent: an unwritable file is reported once and then ignored.
//! Each line is written with one `write` call on an `O_APPEND` file, so agents of several
//! nodes may share one file.

use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde_json::{Map, Value};

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

    /// Appends `event` with `fields` (a JSON object; other values are ignored).
    pub fn emit(&self, event: &str, fields: Value) {
        let mut guard = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let Some(f) = guard.as_mut() else { return };
        let mut obj = Map::new();
        obj.insert("ts_ms".into(), Value::from(now_unix_ms()));
        obj.insert("node".into(), Value::from(self.node.clone()));
        obj.insert("event".into(), Value::from(event));
        if let Value::Object(m) = fields {
            obj.extend(m);
        }
        let mut line = Value::Object(obj).to_string();
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
    use super::*;

    #[test]
    fn events_are_json_lines_with_node_and_time() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ev.jsonl");
        let ev = Events::open(Some(&path), "n1").unwrap();
        ev.emit(
            "generation",
            serde_json::json!({"generation": 3, "world_size": 4}),
        );
        ev.emit("exit", serde_json::json!({"code": 0}));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "generation");
        assert_eq!(lines[0]["node"], "n1");
        assert_eq!(lines[0]["world_size"], 4);
        assert!(lines[1]["ts_ms"].as_u64().unwrap() > 0);
        // No file: a no-op.
        Events::open(None, "n").unwrap().emit("exit", Value::Null);
    }
}
