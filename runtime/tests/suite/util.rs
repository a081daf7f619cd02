#![allow(dead_code)] // Each test module uses a different subset.
//! Helpers for the agent's end-to-end tests: run `elastic-run` as a child, read its output
//! while it runs, and check processes by PID.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_elastic-run");

/// The worker Python: `$ELASTIC_VENV/bin/python`, else the repo's `.venv` (the same rule as
/// `services::paths::python`, which this crate does not depend on to keep its lint run its own).
pub fn python() -> PathBuf {
    let venv = std::env::var_os("ELASTIC_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv"));
    let p = venv.join("bin/python");
    assert!(
        p.exists(),
        "{} not found: run tests/services/setup.sh (or set ELASTIC_VENV)",
        p.display()
    );
    p
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The prefix of teed lines the suite reads workers' output by: `[rank N] ` (global rank).
pub const RANK_PREFIX_TEMPLATE: &str = "[rank ${rank}] ";

/// `elastic-run` with a private staging dir and a clean `PET_*`/`ELASTIC_*` environment.
/// Workers' output is teed (`PET_TEE=3`, logs under `tmp/logs`) with `[rank N] ` prefixes,
/// which the tests read it by; `console.rs` checks the default (inherited) streams itself.
pub fn agent(tmp: &Path) -> Command {
    let mut c = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("PET_") || k.starts_with("ELASTIC_") {
            c.env_remove(&k);
        }
    }
    c.env("ELASTIC_STAGING_DIR", tmp.join("staging"))
        .env("ELASTIC_LOG", "info")
        .env("PET_TEE", "3")
        .env("PET_LOG_DIR", tmp.join("logs"))
        .env(
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
            RANK_PREFIX_TEMPLATE,
        )
        .current_dir(tmp);
    c
}

/// Runs to completion with a time limit; returns status, stdout, stderr.
pub fn run(mut cmd: Command, limit: Duration) -> (ExitStatus, String, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn elastic-run");
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let status = wait_limit(&mut child, limit);
    (status, collect(out), collect(err))
}

pub fn reader<R: std::io::Read + Send + 'static>(r: R) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

pub fn collect(rx: mpsc::Receiver<String>) -> String {
    let mut s = String::new();
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
        s.push_str(&l);
        s.push('\n');
    }
    s
}

/// Waits for a line containing `needle`, keeping every line read in `seen`.
pub fn wait_for_line(
    rx: &mpsc::Receiver<String>,
    needle: &str,
    limit: Duration,
    seen: &mut String,
) -> bool {
    let deadline = Instant::now() + limit;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                seen.push_str(&l);
                seen.push('\n');
                if l.contains(needle) {
                    return true;
                }
            }
            Err(_) => return false,
        }
    }
    false
}

pub fn wait_limit(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("elastic-run did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, sig) };
}

/// Whether `pid` is a live (non-zombie) process.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the `)` that ends the command name.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | None)
        }
        Err(_) => false,
    }
}

/// The committed steps in a checkpoint store (a directory or URL; S3 settings come from the
/// environment).
pub fn committed_steps(url: &str) -> Vec<u64> {
    let url = if url.contains("://") {
        url.to_string()
    } else {
        format!("file://{url}")
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let store = checkpoint::Store::open(&url).unwrap();
        store
            .committed_steps(&checkpoint::CancellationToken::new())
            .await
            .unwrap()
    })
}
