//! The Python client (`runtime/python/elastic_run`) against this crate's protocol: a stand-in
//! agent on a real Unix socket reads every line the client sends through its own public
//! functions (`report_progress`, `should_stop`, `save`, `async_save`, and `save` on a full
//! disk) and parses it as a [`Request`], more strictly than the agent does: the line must read
//! back to the very same JSON, so a field the protocol does not know (which the agent would
//! ignore) fails too. The replies are this crate's [`Reply`]s, which the client must accept.
//! The snapshots it stages must be the protocol's layout ([`StagedMeta`] in `meta.json`, the
//! file and directory names), and its copies of the protocol's constants must agree. The
//! client's own sample of every message kind (`python -m elastic_run --print-sample-messages`,
//! built by the same functions that build what it sends) must parse strictly too.
//!
//! The Python is the worker environment's (`$ELASTIC_VENV`, else the repository's `.venv`),
//! else `python3` on `PATH`. Without any, the test is skipped, except under `CI`, where it
//! fails.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;
use worker::protocol::{self, Reply, Request, StagedMeta};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The worker Python, or `None` (outside CI only) when there is none.
fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("ELASTIC_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv"));
    let p = venv.join("bin/python");
    if p.exists() {
        return Some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("python3"))
            .find(|p| p.is_file())
    });
    if on_path.is_some() {
        return on_path;
    }
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
    assert!(
        !ci,
        "no Python for the client test: neither {} nor python3 on PATH (run tests/services/setup.sh or set ELASTIC_VENV)",
        p.display()
    );
    eprintln!(
        "python_client: skipped, no Python ({} or python3 on PATH)",
        p.display()
    );
    None
}

/// Drives the client the way a training loop does, against `$ELASTIC_AGENT_SOCKET`; prints
/// one JSON object of what the calls returned and of the client's constants.
const DRIVE_PY: &str = r#"
import errno, json, os, struct, sys, warnings
sys.path.insert(0, os.environ["CLIENT_DIR"])
import elastic_run as er
# Internals are patched where they live (the package re-exports copies of them).
import elastic_run._distributed, elastic_run._save, elastic_run.protocol

try:
    import torch
except ImportError:
    torch = None
    # Without torch the client cannot write tensors; an empty tensor file does for the messages.
    def _empty_safetensors(path, tensors, metadata):
        h = json.dumps({"__metadata__": metadata}, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        fd = er._save._open_private(path)
        try:
            er._save._write_all(fd, struct.pack("<Q", len(h)) + h)
        finally:
            os.close(fd)
    er._save._write_safetensors = _empty_safetensors

def extra(step):
    e = {"data_pos": step, "note": "step %d" % step}
    if torch is not None:
        e["rng"] = torch.arange(3)
    return e

out = {"torch": torch is not None}
er.report_progress(1, force=True)
out["stop_2"] = er.should_stop(2)
out["checkpoint_3"] = er.should_checkpoint(3)
real = er._distributed._all_reduce_max
er._distributed._all_reduce_max = lambda v: [1, v[1]]  # another node's agent asked for the stop
out["stop_4"] = er.should_stop(4)
er._distributed._all_reduce_max = real
out["saved_5"] = er.save(5, extra=extra(5))
real = er._save._write_snapshot_inner
def full(snap, conn):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
er._save._write_snapshot_inner = full
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    out["saved_6"] = er.save(6, extra=extra(6))
out["warnings_6"] = [str(w.message) for w in seen]
er._save._write_snapshot_inner = real
out["saved_7"] = er.async_save(7, extra=extra(7)).wait()
try:
    er.report_progress(9, force=True)
    out["error_9"] = None
except er.AgentError as e:
    out["error_9"] = str(e)
# Recovery in place: the watch thread hears the agent offer generation 8, then the switch to it
# is announced.
offers = er._inplace._Offers(7, 0)
offer = offers.take(60)
offers.stopped = True
out["offer"] = None if offer is None else [offer[0], offer[1], offer[2], offer[3]]
er._connection._agent_conn().request(er.protocol._msg_switched(0, offer[0]))
# A failed collective is reported once per generation (the agent asks etcd to regroup).
ip = er._inplace.InPlace.__new__(er._inplace.InPlace)
ip.reported_for, ip.failed = None, RuntimeError("Connection reset by peer")
os.environ["ELASTIC_GENERATION"] = "8"
ip._report_failure()
ip._report_failure()
# A node that joined without a restore, whose peers did not hold the step: the agent restores it.
out["restored"] = list(er._connection.restore(12))
out["resume_env"] = [os.environ.get("ELASTIC_RESUME_STEP"), os.environ.get("ELASTIC_RESUME_DIR")]
out["constants"] = {
    "FORMAT_VERSION": er.protocol.FORMAT_VERSION,
    "MESSAGE_BYTES_MAX": er.protocol.MESSAGE_BYTES_MAX,
    "STEP_MAX": er.protocol.STEP_MAX,
    "METADATA_BYTES_MAX": er.protocol.METADATA_BYTES_MAX,
    "STAGED_TENSORS": er.protocol._TENSORS,
    "STAGED_META": er.protocol._META,
    "RESTORED_TENSORS": er.protocol._RESTORED,
    "RESTORED_META": er.protocol._RESTORED_META,
    "RESTORE_WAIT_S": er.protocol.RESTORE_WAIT_S,
}
print(json.dumps(out))
"#;

/// The step the stand-in agent asks a checkpoint at, and the one whose progress it refuses.
const CHECKPOINT_AT: u64 = 3;
const REFUSED_STEP: u64 = 9;

/// `line` (newline stripped) as a [`Request`] that serializes back to the same JSON, within
/// the protocol's limits.
fn parse_strictly(line: &str) -> Result<Request, String> {
    if line.len() + 1 > protocol::MESSAGE_BYTES_MAX {
        return Err(format!("a line of {} bytes", line.len() + 1));
    }
    let sent: Value = serde_json::from_str(line).map_err(|e| format!("{line}: not JSON: {e}"))?;
    let req: Request =
        serde_json::from_value(sent.clone()).map_err(|e| format!("{line}: not a request: {e}"))?;
    let back = serde_json::to_value(&req).map_err(|e| e.to_string())?;
    if back != sent {
        return Err(format!(
            "{line}: fields or values the protocol does not have (it reads {back})"
        ));
    }
    if let Request::Progress { step, .. }
    | Request::Saved { step, .. }
    | Request::Skipped { step, .. }
    | Request::PeerStop { step, .. } = &req
        && *step > protocol::STEP_MAX
    {
        return Err(format!("{line}: step over {}", protocol::STEP_MAX));
    }
    Ok(req)
}

fn reply_to(req: &Request) -> Reply {
    match req {
        Request::Query {} => Reply::State {
            should_stop: false,
            should_checkpoint_at: Some(CHECKPOINT_AT),
            generation: 7,
        },
        Request::Progress { step, .. } if *step == REFUSED_STEP => Reply::Error {
            message: format!("refused: step {step}"),
        },
        Request::Watch { generation, .. } if *generation != 8 => Reply::Generation {
            generation: 8,
            rank_offset: 0,
            rank: 0,
            env: [("WORLD_SIZE".to_string(), "1".to_string())].into(),
        },
        // The step asked for did not verify: the newest older one.
        Request::Restore { step, .. } => Reply::Restored {
            step: step - 1,
            dir: format!("/r/step-{}", step - 1),
        },
        // Nothing newer: the agent would hold it; the client asks again.
        Request::Watch { generation, rank } => Reply::Generation {
            generation: *generation,
            rank_offset: 0,
            rank: *rank,
            env: Default::default(),
        },
        _ => Reply::Ok,
    }
}

/// One connection of the stand-in agent: every line parsed (or why not) goes to `seen`, then
/// its reply back to the client.
fn serve_connection(stream: UnixStream, seen: mpsc::Sender<Result<Request, String>>) {
    let mut out = stream.try_clone().unwrap();
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        let parsed = parse_strictly(&line);
        let reply = match &parsed {
            Ok(req) => reply_to(req),
            Err(why) => Reply::Error {
                message: why.clone(),
            },
        };
        let _ = seen.send(parsed);
        let mut bytes = serde_json::to_vec(&reply).unwrap();
        bytes.push(b'\n');
        if out.write_all(&bytes).is_err() {
            return;
        }
    }
}

/// A staged part the client wrote: the protocol's files, its `meta.json` a [`StagedMeta`]
/// exactly. Returns the metadata.
fn read_staged(dir: &Path) -> StagedMeta {
    let tensors = dir.join(protocol::STAGED_TENSORS);
    assert!(tensors.is_file(), "{}", tensors.display());
    let path = dir.join(protocol::STAGED_META);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(bytes.len() as u64 <= protocol::METADATA_BYTES_MAX);
    let raw: Value = serde_json::from_slice(&bytes).unwrap();
    let meta: StagedMeta = serde_json::from_value(raw.clone())
        .unwrap_or_else(|e| panic!("{}: {e}: {raw}", path.display()));
    assert_eq!(
        serde_json::to_value(&meta).unwrap(),
        raw,
        "{}: fields the protocol does not have",
        path.display()
    );
    meta
}

#[test]
fn what_the_python_client_sends_and_stages_parses_as_the_protocol() {
    let Some(python) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("staging");
    let socket = tmp.path().join("agent.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let (tx, rx) = mpsc::channel();
    // Blocks in accept until the test process ends; connections get a thread each.
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let tx = tx.clone();
            std::thread::spawn(move || serve_connection(stream, tx));
        }
    });

    let mut c = Command::new(&python);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("ELASTIC_") || k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") {
            c.env_remove(&k);
        }
    }
    for k in ["MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"] {
        c.env_remove(k);
    }
    c.env("RANK", "0")
        .env("LOCAL_RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCAL_WORLD_SIZE", "1")
        .env("ELASTIC_STAGING_DIR", &staging)
        .env("ELASTIC_AGENT_SOCKET", &socket)
        .env("CLIENT_DIR", repo().join("runtime/python"))
        .env("OMP_NUM_THREADS", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .args(["-c", DRIVE_PY])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", python.display()));
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait_with_output());
    });
    let started = Instant::now();
    let out = done_rx
        .recv_timeout(Duration::from_secs(300))
        .unwrap_or_else(|_| panic!("the client did not finish in {:?}", started.elapsed()))
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the client failed:\n{stdout}\n{stderr}"
    );
    let got: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{e}: the client printed:\n{stdout}\n{stderr}"));

    // Every reply came after its line was recorded, and the client waited for each reply.
    let seen: Vec<Request> = rx
        .try_iter()
        .map(|r| r.unwrap_or_else(|why| panic!("the client sent {why}")))
        .collect();
    let dir = |step: u64| {
        staging
            .join(protocol::step_dir_name(step))
            .join(protocol::rank_dir_name(0))
            .to_string_lossy()
            .into_owned()
    };
    let reason = match seen.get(5) {
        Some(Request::Skipped { reason, .. }) => reason.clone(),
        other => panic!("no skipped request where expected: {other:?} in {seen:?}"),
    };
    assert!(reason.contains("is full"), "{reason}");
    // The watch thread asks on its own connection, as often as it is answered: once for the
    // offer, then for as long as it runs.
    let watches: Vec<&Request> = seen
        .iter()
        .filter(|r| matches!(r, Request::Watch { .. }))
        .collect();
    assert_eq!(
        watches.first(),
        Some(&&Request::Watch {
            rank: 0,
            generation: 7
        }),
        "{seen:?}"
    );
    let kinds_seen: Vec<&str> = seen.iter().map(Request::kind).collect();
    let seen: Vec<Request> = seen
        .iter()
        .filter(|r| !matches!(r, Request::Watch { .. }))
        .cloned()
        .collect();
    assert_eq!(
        seen,
        [
            Request::Progress { rank: 0, step: 1 },
            Request::Query {},
            Request::Query {},
            Request::PeerStop { rank: 0, step: 4 },
            Request::Saved {
                rank: 0,
                step: 5,
                dir: dir(5),
                // After the ranks agreed to stop at step 4: the save of a drain.
                last: true,
            },
            Request::Skipped {
                rank: 0,
                step: 6,
                reason,
            },
            Request::Saved {
                rank: 0,
                step: 7,
                dir: dir(7),
                // After the ranks agreed to stop at step 4: the save of a drain.
                last: true,
            },
            Request::Progress {
                rank: 0,
                step: REFUSED_STEP,
            },
            Request::Switched {
                rank: 0,
                generation: 8,
            },
            Request::CollectiveFailed {
                rank: 0,
                generation: 8,
                reason: "Connection reset by peer".into(),
            },
            Request::Restore { rank: 0, step: 12 },
        ]
    );
    assert_eq!(got["restored"], serde_json::json!([11, "/r/step-11"]));
    assert_eq!(got["resume_env"], serde_json::json!(["11", "/r/step-11"]));
    assert_eq!(
        got["offer"],
        serde_json::json!([8, 0, 0, {"WORLD_SIZE": "1"}]),
        "{got}"
    );
    let mut kinds: Vec<&str> = kinds_seen;
    kinds.sort_unstable();
    kinds.dedup();
    let mut all = Request::KINDS.to_vec();
    all.sort_unstable();
    assert_eq!(kinds, all, "every request kind is exercised");

    // What the client made of the replies.
    assert_eq!(got["stop_2"], false, "{got}");
    assert_eq!(got["checkpoint_3"], true, "the requested checkpoint: {got}");
    assert_eq!(got["stop_4"], true, "{got}");
    assert_eq!(got["saved_5"], dir(5));
    assert_eq!(got["saved_6"], Value::Null, "the full disk skips the step");
    assert_eq!(
        got["warnings_6"].as_array().map(Vec::len),
        Some(1),
        "one warning (the skip), none for telling the agent: {got}"
    );
    assert_eq!(got["saved_7"], dir(7));
    assert_eq!(got["error_9"], format!("refused: step {REFUSED_STEP}"));

    // The staged layout.
    let with_torch = got["torch"] == true;
    for step in [5, 7] {
        let d = PathBuf::from(dir(step));
        let meta = read_staged(&d);
        let keys: Vec<String> = if with_torch {
            vec!["extra/rng".into()]
        } else {
            vec![]
        };
        assert_eq!(
            meta,
            StagedMeta {
                format_version: protocol::FORMAT_VERSION,
                keys,
                rank: 0,
                state: serde_json::json!({"extra": {"data_pos": step, "note": format!("step {step}")}}),
                step,
                world_size: 1,
            }
        );
    }
    assert!(
        !staging
            .join(protocol::step_dir_name(6))
            .join(protocol::rank_dir_name(0))
            .exists()
    );

    // The client's copies of the protocol's constants.
    let c = &got["constants"];
    assert_eq!(c["FORMAT_VERSION"], protocol::FORMAT_VERSION, "{c}");
    assert_eq!(c["MESSAGE_BYTES_MAX"], protocol::MESSAGE_BYTES_MAX, "{c}");
    assert_eq!(c["STEP_MAX"], protocol::STEP_MAX, "{c}");
    assert_eq!(c["METADATA_BYTES_MAX"], protocol::METADATA_BYTES_MAX, "{c}");
    assert_eq!(c["STAGED_TENSORS"], protocol::STAGED_TENSORS, "{c}");
    assert_eq!(c["STAGED_META"], protocol::STAGED_META, "{c}");
    assert_eq!(c["RESTORED_TENSORS"], protocol::RESTORED_TENSORS, "{c}");
    assert_eq!(c["RESTORED_META"], protocol::RESTORED_META, "{c}");
    assert_eq!(
        c["RESTORE_WAIT_S"].as_f64().map(|s| (s * 1000.0) as u64),
        Some(protocol::RESTORE_WAIT_MS),
        "{c}"
    );
}

#[test]
fn the_strict_parse_refuses_what_the_agent_would_let_through() {
    assert_eq!(
        parse_strictly(r#"{"type":"progress","rank":0,"step":1}"#),
        Ok(Request::Progress { rank: 0, step: 1 })
    );
    for (line, why) in [
        (r#"{"type":"query","extra":1}"#, "an unknown field"),
        (
            r#"{"type":"progress","rank":0,"step":1,"steps":2}"#,
            "a misspelt field",
        ),
        (
            r#"{"type":"progress","rank":0,"step":9007199254740992}"#,
            "a step over STEP_MAX",
        ),
        (r#"{"type":"saved","rank":0,"step":1}"#, "no dir"),
    ] {
        assert!(parse_strictly(line).is_err(), "{why}: {line}");
    }
    let long = format!(
        r#"{{"type":"skipped","rank":0,"step":1,"reason":"{}"}}"#,
        "x".repeat(protocol::MESSAGE_BYTES_MAX)
    );
    assert!(parse_strictly(&long).is_err(), "an oversized line");
}

/// `python -m elastic_run --print-sample-messages` prints one message of every kind, built by
/// the client's own message builders: each parses strictly, and together they cover
/// [`Request::KINDS`], each once.
#[test]
fn the_client_sample_of_every_message_kind_parses_strictly() {
    let Some(python) = python() else { return };
    let out = Command::new(&python)
        .args(["-m", "elastic_run", "--print-sample-messages"])
        .env("PYTHONPATH", repo().join("runtime/python"))
        .stdin(Stdio::null())
        .output()
        .expect("run python -m elastic_run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut kinds: Vec<&str> = Vec::new();
    for line in text.lines() {
        let req = parse_strictly(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        kinds.push(req.kind());
    }
    let mut want = Request::KINDS.to_vec();
    want.sort_unstable();
    kinds.sort_unstable();
    assert_eq!(kinds, want, "{text}");
}
