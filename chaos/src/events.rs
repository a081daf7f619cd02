//! The agents' event log (`--events-file`, one file shared by every node of a run), read back
//! as the runtime's own [`Record`]s, and the views of it the checks and the report use.
//!
//! A line that is no record is never skipped silently: it is listed in
//! [`EventLog::unreadable`] with its file and line number, and fails the run's
//! `event_log_readable` check. The one exception is a line cut short by an agent killed while
//! it wrote (the harness SIGKILLs agents on purpose): the file's last line when it lacks its
//! newline, or the start of a line that another agent's record continues. Such a fragment is
//! listed in [`EventLog::truncated`] and tolerated; a record after it on the same line is kept.

use std::path::Path;

pub use runtime::events::{DrainReason, Event, Record};

/// Longest piece of a bad line quoted in a message.
const EXCERPT_CHARS_MAX: usize = 200;
/// How every record line starts (the runtime writes `ts_ms` first).
const RECORD_START: &str = "{\"ts_ms\":";

/// What a read of the log found.
#[derive(Debug, Clone, Default)]
pub struct EventLog {
    pub records: Vec<Record>,
    /// `FILE line N: ERROR: EXCERPT` for each complete line that is no record (or why the
    /// file could not be read).
    pub unreadable: Vec<String>,
    /// `FILE line N: ...` for each fragment an agent killed while writing left behind.
    pub truncated: Vec<String>,
}

/// Reads the log at `path`; a file not written yet is an empty log.
pub fn read_events(path: &Path) -> EventLog {
    match std::fs::read(path) {
        Ok(bytes) => parse(
            &String::from_utf8_lossy(&bytes),
            &path.display().to_string(),
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => EventLog::default(),
        Err(e) => EventLog {
            unreadable: vec![format!("{}: cannot read: {e}", path.display())],
            ..EventLog::default()
        },
    }
}

/// Parses the text of a log; `origin` names it in messages.
pub fn parse(text: &str, origin: &str) -> EventLog {
    let mut log = EventLog::default();
    let mut lines = text.split('\n').enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let n = i + 1;
        // After the last newline: empty, or a line still being written (or never finished).
        let last = lines.peek().is_none();
        if line.trim().is_empty() {
            continue;
        }
        match Record::parse(line) {
            Ok(r) => log.records.push(r),
            Err(_) if last => log
                .truncated
                .push(format!("{origin} line {n} (no newline): {}", excerpt(line))),
            Err(e) => match torn(line) {
                Some((fragment, r)) => {
                    log.truncated.push(format!(
                        "{origin} line {n} (a cut-off record before another): {}",
                        excerpt(fragment)
                    ));
                    log.records.push(r);
                }
                None => log
                    .unreadable
                    .push(format!("{origin} line {n}: {e}: {}", excerpt(line))),
            },
        }
    }
    log
}

/// A line that is a cut-off record followed by a whole one (an agent killed in the middle of
/// its write, then another agent's line): the fragment and the record.
fn torn(line: &str) -> Option<(&str, Record)> {
    let at = line.rfind(RECORD_START).filter(|at| *at > 0)?;
    let (fragment, rest) = line.split_at(at);
    if !fragment.starts_with(RECORD_START) {
        return None;
    }
    Record::parse(rest).ok().map(|r| (fragment, r))
}

fn excerpt(line: &str) -> String {
    let mut s: String = line.chars().take(EXCERPT_CHARS_MAX).collect();
    if s.len() < line.len() {
        s.push_str("...");
    }
    s
}

/// A `generation` record, with the fields the checks and the report read.
#[derive(Debug, Clone, Copy)]
pub struct GenerationSeen<'a> {
    pub record: &'a Record,
    pub generation: u64,
    pub world_size: u32,
    pub lr_scale: f64,
    pub lr: Option<f64>,
    pub global_batch: Option<u64>,
    pub grad_accum_steps: u64,
    /// The step this node's workers resumed from: the record's `resume_step`, or, for a node
    /// that joined without a restore (`heal_step`) and whose workers then had it restored on
    /// their request, the step restored (`restored_on_demand`).
    pub resume_step: Option<u64>,
    /// The step the node joined at without restoring it; its workers took the state from
    /// peers (at that step or later) when no restore on request follows.
    pub heal_step: Option<u64>,
    pub prev_last_step: Option<u64>,
    pub frozen_unix_ms: Option<u64>,
}

/// The `generation` records, in log order.
pub fn generations(events: &[Record]) -> impl Iterator<Item = GenerationSeen<'_>> {
    events.iter().filter_map(|record| match &record.event {
        Event::Generation {
            generation,
            world_size,
            lr_scale,
            lr,
            global_batch,
            grad_accum_steps,
            resume_step,
            heal_step,
            prev_last_step,
            frozen_unix_ms,
            ..
        } => Some(GenerationSeen {
            record,
            generation: *generation,
            world_size: *world_size,
            lr_scale: *lr_scale,
            lr: *lr,
            global_batch: *global_batch,
            grad_accum_steps: *grad_accum_steps,
            resume_step: resume_step.or_else(|| {
                heal_step.and_then(|_| restored_on_demand(events, &record.node, *generation))
            }),
            heal_step: *heal_step,
            prev_last_step: *prev_last_step,
            frozen_unix_ms: *frozen_unix_ms,
        }),
        _ => None,
    })
}

/// The step `node`'s agent restored on its workers' request in `generation`, if it did.
fn restored_on_demand(events: &[Record], node: &str, generation: u64) -> Option<u64> {
    events.iter().find_map(|r| match r.event {
        Event::RestoredOnDemand {
            generation: g,
            step,
            ..
        } if g == generation && r.node == node => Some(step),
        _ => None,
    })
}

/// The `first_step` records, in log order: the record, its generation and step.
pub fn first_steps(events: &[Record]) -> impl Iterator<Item = (&Record, u64, u64)> {
    events.iter().filter_map(|r| match r.event {
        Event::FirstStep { generation, step } => Some((r, generation, step)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(ts: u64, node: &str, event: Event) -> String {
        serde_json::to_string(&Record {
            ts_ms: ts,
            node: node.into(),
            event,
        })
        .unwrap()
    }

    #[test]
    fn records_are_read_and_bad_lines_are_named_by_file_and_line() {
        let a = line(1, "node0", Event::Exit { code: 0 });
        let b = line(
            2,
            "node1",
            Event::FirstStep {
                generation: 1,
                step: 3,
            },
        );
        let text = format!(
            "{a}\n\n{{\"ts_ms\":3,\"node\":\"x\",\"event\":\"nonsense\"}}\nnot json\n{b}\n"
        );
        let log = parse(&text, "ev.jsonl");
        assert_eq!(log.records.len(), 2);
        assert_eq!(log.records[1].node, "node1");
        assert_eq!(log.unreadable.len(), 2, "{:?}", log.unreadable);
        assert!(
            log.unreadable[0].starts_with("ev.jsonl line 3: "),
            "{:?}",
            log.unreadable
        );
        assert!(
            log.unreadable[0].contains("nonsense"),
            "{:?}",
            log.unreadable
        );
        assert!(
            log.unreadable[1].starts_with("ev.jsonl line 4: "),
            "{:?}",
            log.unreadable
        );
        assert!(log.truncated.is_empty());
    }

    #[test]
    fn a_killed_agents_cut_off_line_is_tolerated_and_listed() {
        let a = line(1, "node0", Event::Exit { code: 0 });
        let b = line(
            2,
            "node1",
            Event::Fenced {
                reason: "lease".into(),
            },
        );
        // The last line without its newline.
        let log = parse(&format!("{a}\n{}", &b[..b.len() / 2]), "ev.jsonl");
        assert_eq!((log.records.len(), log.unreadable.len()), (1, 0));
        assert_eq!(log.truncated.len(), 1);
        assert!(log.truncated[0].starts_with("ev.jsonl line 2 (no newline)"));
        // A fragment another agent's record continues on the same line: the record is kept.
        let log = parse(&format!("{}{a}\n{b}\n", &b[..b.len() / 2]), "ev.jsonl");
        assert_eq!(log.records.len(), 2, "{log:?}");
        assert_eq!(log.records[0].event, Event::Exit { code: 0 });
        assert!(log.unreadable.is_empty(), "{:?}", log.unreadable);
        assert!(log.truncated[0].starts_with("ev.jsonl line 1 (a cut-off record"));
        // Garbage before a record is no cut-off record.
        let log = parse(&format!("junk{a}\n"), "ev.jsonl");
        assert_eq!((log.records.len(), log.unreadable.len()), (0, 1));
    }

    #[test]
    fn a_missing_file_is_an_empty_log_and_an_unreadable_one_is_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let log = read_events(&tmp.path().join("none.jsonl"));
        assert!(log.records.is_empty() && log.unreadable.is_empty());
        // A directory cannot be read as a file.
        let log = read_events(tmp.path());
        assert_eq!(log.unreadable.len(), 1, "{log:?}");
        // Bytes that are not UTF-8 spoil their line only.
        let p = tmp.path().join("ev.jsonl");
        let a = line(1, "node0", Event::Exit { code: 0 });
        let mut bytes = b"\xff\xfe\n".to_vec();
        bytes.extend_from_slice(format!("{a}\n").as_bytes());
        std::fs::write(&p, bytes).unwrap();
        let log = read_events(&p);
        assert_eq!((log.records.len(), log.unreadable.len()), (1, 1));
        assert!(log.unreadable[0].contains("ev.jsonl line 1"));
    }
}
