//! Processes: a PID that cannot be reused under a signal, an agent's workers, and what of a
//! run is still alive at its end.

use runtime::worker_env::RUN_ID_ENV;

/// A process, named by PID and start time, so a signal never reaches a reused PID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProcId {
    pid: i32,
    start_ticks: u64,
}

impl ProcId {
    pub(super) fn of(pid: i32) -> Option<ProcId> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 22 (starttime); fields after the command name start at field 3.
        let start_ticks = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(19)?
            .parse()
            .ok()?;
        Some(ProcId { pid, start_ticks })
    }

    pub(super) fn signal(self, sig: i32) -> bool {
        if ProcId::of(self.pid) != Some(self) {
            return false;
        }
        signal(self.pid, sig);
        true
    }
}

pub(super) fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this harness started (or its child).
    unsafe { libc::kill(pid, sig) };
}

/// The workers of the agent `pid`: its children running `script` (all its children when none
/// matches, for scripts that re-exec).
pub fn workers(pid: i32, script: &str) -> Vec<i32> {
    let all = children(pid);
    let named: Vec<i32> = all
        .iter()
        .copied()
        .filter(|c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .map(|b| b.split(|x| *x == 0).any(|a| a == script.as_bytes()))
                .unwrap_or(false)
        })
        .collect();
    if named.is_empty() { all } else { named }
}

/// Direct children of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    services::child_pids(pid)
}

/// Processes whose command line or environment names `job`, excluding zombies.
pub fn leftovers(job: &str) -> Vec<String> {
    let mut out = vec![];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    let needle_env = format!("{RUN_ID_ENV}={job}\0");
    for e in dir.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if p == std::process::id() {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .unwrap_or("");
        if state == "Z" || state.is_empty() {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
        let cmd_s = String::from_utf8_lossy(&cmd);
        let env_s = String::from_utf8_lossy(&env);
        if cmd_s.split('\0').any(|a| a == job) || env_s.contains(&needle_env) {
            out.push(format!("pid {p}: {}", cmd_s.replace('\0', " ").trim()));
        }
    }
    out
}
