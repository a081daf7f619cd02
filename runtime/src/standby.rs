//! Warm standby interpreters (`--warm-standby`): a restart of a script that does not switch in
//! place skips the interpreter start and `import torch`.
//!
//! - While a worker group trains, the agent keeps one standby per local rank: `python -u -c`
//!   with `runtime/python/elastic_run/_standby.py`, started as that rank's worker was (its
//!   environment, its own process group, `PR_SET_PDEATHSIG`), stdin a Unix socket to the agent,
//!   stdout and stderr /dev/null. It imports torch and waits. The agent also starts the missing
//!   ones before it restores a generation's resume step, so that they import while it restores.
//! - At the next start of the workers, a rank whose standby is alive and whose new
//!   environment differs from the standby's only in per-generation variables
//!   ([`per_generation`]: ranks, world, master, generation, restart count, error file, and
//!   `ELASTIC_*`) gets it: the agent sends the command line, the new environment and the
//!   worker's stdout and stderr (SCM_RIGHTS), and the standby runs the script as
//!   `python -u SCRIPT` would. Any other difference (`PYTHONPATH`, `OMP_NUM_THREADS`,
//!   `CUDA_VISIBLE_DEVICES`, `LD_*`...) and any failure to hand over means a fresh interpreter,
//!   as without the flag.
//! - Only Python command lines qualify: `[PYTHON [-u]] SCRIPT.py ARGS` and
//!   `[PYTHON [-u]] -m MODULE ARGS` (other interpreter flags mean a fresh interpreter). A
//!   standby is a whole interpreter with torch imported (a few hundred MB of host memory per
//!   local rank), which is why the flag is opt-in.
//! - Here too: when the supervisor fills the pool ([`fill_standbys`], [`standbys_due_now`]) and
//!   hands a worker to its standby ([`warm_start`]).

use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::logs::Dest;
use crate::output::Stream;
use crate::supervisor::{Launcher, SupervisorConfig, die_with_agent};
use crate::worker_env::{self, GenerationView, WorkerSpec};

/// The standby's program, run with `python -u -c`.
pub const STANDBY_SOURCE: &str = include_str!("../python/elastic_run/_standby.py");
/// Largest activation message (the standby's `MESSAGE_BYTES_MAX`).
pub const MESSAGE_BYTES_MAX: usize = 1 << 20;
/// Most standbys kept (one per local rank; `--nproc-per-node` is bounded the same way).
pub const STANDBYS_MAX: usize = 1024;

/// The variables a worker's environment may change between generations without making a
/// standby started with the old values unfit: none of them is read before the script runs.
pub fn per_generation(key: &str) -> bool {
    key.starts_with("ELASTIC_")
        || matches!(
            key,
            "RANK"
                | "WORLD_SIZE"
                | "GROUP_RANK"
                | "GROUP_WORLD_SIZE"
                | "ROLE_RANK"
                | "ROLE_WORLD_SIZE"
                | "MASTER_ADDR"
                | "MASTER_PORT"
                | "TORCHELASTIC_RESTART_COUNT"
                | "TORCHELASTIC_ERROR_FILE"
        )
}

/// How the worker command line runs under a standby: the interpreter and what follows `-u`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    python: String,
    /// `[SCRIPT, ARGS...]` or `["-m", MODULE, ARGS...]`.
    entry: Vec<String>,
}

impl Plan {
    /// The plan for `argv`, or why it cannot run under a standby: a Python interpreter
    /// (`agent_python`, the agent's `--python`, or `python`, `python3`, `python3.11` in any
    /// directory), then `-u` or nothing (the workers get `PYTHONUNBUFFERED=1` either way),
    /// then a script or `-m MODULE`.
    pub fn for_argv(argv: &[String], agent_python: &str) -> Result<Plan, String> {
        let shown = || argv.join(" ");
        let Some((python, rest)) = argv.split_first() else {
            return Err("empty command".into());
        };
        let name = std::path::Path::new(python)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let is_python = python == agent_python
            || name
                .strip_prefix("python")
                .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'));
        if !is_python {
            return Err(format!("`{}` does not start a Python interpreter", shown()));
        }
        let rest = match rest {
            [u, rest @ ..] if u == "-u" => rest,
            rest => rest,
        };
        let ok = match rest {
            [m, module, ..] if m == "-m" => !module.starts_with('-'),
            [script, ..] => !script.starts_with('-'),
            [] => false,
        };
        if !ok {
            return Err(format!(
                "`{}` is neither `PYTHON [-u] SCRIPT` nor `PYTHON [-u] -m MODULE`",
                shown()
            ));
        }
        Ok(Plan {
            python: python.clone(),
            entry: rest.to_vec(),
        })
    }
}

/// One standby interpreter, waiting.
#[derive(Debug)]
pub struct Standby {
    child: tokio::process::Child,
    sock: UnixStream,
    env: Vec<(String, String)>,
    started: Instant,
}

/// Why a standby was not used for a rank.
#[derive(Debug, PartialEq, Eq)]
pub enum Unfit {
    /// None was ready (the first group, or it is still being replaced).
    None,
    /// It exited.
    Exited,
    /// The new environment differs in a variable read before the script runs.
    Env(String),
}

/// The agent's standbys, one slot per local rank.
#[derive(Debug)]
pub struct Standbys {
    plan: Plan,
    slots: Mutex<Vec<Option<Standby>>>,
}

impl Standbys {
    pub fn new(plan: Plan) -> Standbys {
        Standbys {
            plan,
            slots: Mutex::new(Vec::new()),
        }
    }

    /// Starts a standby for each local rank below `nproc` that has none, with the environment
    /// `env_of(local_rank)` (that rank's worker's). A standby that cannot start is logged and
    /// left out: the rank starts cold.
    pub fn fill(&self, nproc: u32, env_of: impl Fn(u32) -> Option<Vec<(String, String)>>) -> usize {
        let n = (nproc as usize).min(STANDBYS_MAX);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.len() < n {
            slots.resize_with(n, || None);
        }
        let mut started = 0;
        for (i, slot) in slots.iter_mut().enumerate().take(n) {
            if let Some(s) = slot.as_mut()
                && matches!(s.child.try_wait(), Ok(None))
            {
                continue;
            }
            *slot = None;
            let Some(env) = env_of(i as u32) else {
                continue;
            };
            match spawn(&self.plan.python, env) {
                Ok(s) => {
                    tracing::debug!(local_rank = i, pid = s.child.id(), "warm standby started");
                    *slot = Some(s);
                    started += 1;
                }
                Err(e) => {
                    tracing::warn!(local_rank = i, error = %e, "cannot start a warm standby; the rank will start cold")
                }
            }
        }
        started
    }

    /// The standby of `local_rank`, if it is alive and fit for `env`; it leaves the pool.
    pub fn take(&self, local_rank: u32, env: &[(String, String)]) -> Result<Standby, Unfit> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mut s) = slots.get_mut(local_rank as usize).and_then(Option::take) else {
            return Err(Unfit::None);
        };
        if !matches!(s.child.try_wait(), Ok(None)) {
            return Err(Unfit::Exited);
        }
        if let Some(key) = startup_difference(&s.env, env) {
            // Dropping it kills it (kill_on_drop); a fresh one is started for the new values.
            return Err(Unfit::Env(key));
        }
        Ok(s)
    }

    /// How many standbys wait now (alive or not yet seen to exit).
    pub fn waiting(&self) -> usize {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.iter().filter(|s| s.is_some()).count()
    }

    /// The plan every standby runs.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
}

/// The first variable read before the script runs (not [`per_generation`]) whose value differs
/// between `a` and `b`, or that only one sets.
pub fn startup_difference(a: &[(String, String)], b: &[(String, String)]) -> Option<String> {
    let startup = |env: &[(String, String)]| {
        env.iter()
            .filter(|(k, _)| !per_generation(k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<std::collections::BTreeMap<String, String>>()
    };
    let (a, b) = (startup(a), startup(b));
    a.iter()
        .find(|(k, v)| b.get(*k) != Some(*v))
        .map(|(k, _)| k.clone())
        .or_else(|| b.keys().find(|k| !a.contains_key(*k)).cloned())
}

/// With `--warm-standby`, how long after a group's start its standbys start when it reports
/// no step before (a script that never reports steps). Long enough that a large model's slow
/// start (building it, loading its state, a first step of many seconds) does not share its
/// cores with the standbys' imports: on 2 cores, standbys started 10 s into a 12 s first step
/// delayed it by 2-3 s (BENCHMARKS.md §3).
const STANDBY_FILL_AFTER_MS: u64 = 60_000;
/// Whether a group's standbys start now: once it reported a step (`progressed`), else once
/// it has run [`STANDBY_FILL_AFTER_MS`].
pub(crate) fn standbys_due_now(progressed: bool, running: Duration) -> bool {
    progressed || running >= Duration::from_millis(STANDBY_FILL_AFTER_MS)
}

/// Starts the missing standbys, each with the environment its rank's worker has now; returns
/// how many started.
pub(crate) fn fill_standbys(
    cfg: &SupervisorConfig,
    spec: &WorkerSpec,
    view: &GenerationView,
    restarts: u32,
    launcher: &Launcher,
) -> usize {
    let Some(pool) = cfg.standbys.as_deref() else {
        return 0;
    };
    let error_file = spec.run_dir.join("standby");
    let started = pool.fill(spec.nproc, |local_rank| {
        worker_env::worker_env(
            spec,
            view,
            local_rank,
            restarts,
            cfg.omp_num_threads_set,
            &launcher.env,
            &error_file,
        )
        .ok()
    });
    if started > 0 {
        tracing::info!(started, "warm standbys started for the next worker group");
    }
    started
}

/// A teed stream of a worker started from a standby: the pipe's read end and where it goes.
type Pump = (
    tokio::net::unix::pipe::Receiver,
    Arc<crate::logs::Tee>,
    Stream,
);

/// Starts `local_rank`'s worker from its warm standby, if it has a fit one: the child and the
/// pumps of its teed streams. `None`: start it cold (why is logged).
pub(crate) fn warm_start(
    pool: &Standbys,
    local_rank: u32,
    env: &[(String, String)],
    stdout: &Dest,
    stderr: &Dest,
) -> Option<(tokio::process::Child, Vec<Pump>)> {
    let s = match pool.take(local_rank, env) {
        Ok(s) => s,
        Err(Unfit::None) => return None,
        Err(Unfit::Exited) => {
            tracing::warn!(
                local_rank,
                "the warm standby had exited; starting the worker cold"
            );
            return None;
        }
        Err(Unfit::Env(key)) => {
            tracing::info!(local_rank, variable = %key, "the worker's environment changed since its warm standby started; starting it cold");
            return None;
        }
    };
    let mut pumps = Vec::new();
    let mut give = |dest: &Dest, fd: i32, stream: Stream| -> std::io::Result<OwnedFd> {
        match dest {
            Dest::Console => {
                // SAFETY: fd 1 or 2 stays open for the agent's life; the clone is owned here.
                unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()
            }
            Dest::Null => Ok(std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")?
                .into()),
            Dest::File(_, f) => Ok(f.try_clone()?.into()),
            Dest::Tee(t) => {
                let (read, write) = pipe()?;
                let read = tokio::net::unix::pipe::Receiver::from_owned_fd(read)?;
                pumps.push((read, t.clone(), stream));
                Ok(write)
            }
        }
    };
    let handed = give(stdout, 1, Stream::Stdout)
        .and_then(|out| Ok((out, give(stderr, 2, Stream::Stderr)?)))
        .and_then(|(out, err)| s.activate(pool.plan(), env, out, err));
    match handed {
        Ok((child, waited)) => {
            tracing::info!(
                local_rank,
                pid = child.id(),
                standby_age_ms = waited.as_millis() as u64,
                "worker started from a warm standby"
            );
            Some((child, pumps))
        }
        Err(e) => {
            tracing::warn!(local_rank, error = %e, "cannot hand the worker to its warm standby; starting it cold");
            None
        }
    }
}

fn spawn(python: &str, env: Vec<(String, String)>) -> std::io::Result<Standby> {
    let (agent_end, child_end) = UnixStream::pair()?;
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-u", "-c", STANDBY_SOURCE])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::from(OwnedFd::from(child_end)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: the hook runs between fork and exec and calls only async-signal-safe functions.
    unsafe { cmd.pre_exec(die_with_agent()) };
    let child = cmd.spawn()?;
    // The hand-over must never block the agent: a standby that does not read is unfit.
    agent_end.set_nonblocking(true)?;
    Ok(Standby {
        child,
        sock: agent_end,
        env,
        started: Instant::now(),
    })
}

impl Standby {
    /// Hands the worker over: the command line `entry` of `plan`, the environment `env` (and
    /// the standby's variables that `env` lacks unset), stdout and stderr. Returns the child,
    /// now the worker. On error the standby is killed (dropped).
    pub fn activate(
        self,
        plan: &Plan,
        env: &[(String, String)],
        stdout: OwnedFd,
        stderr: OwnedFd,
    ) -> std::io::Result<(tokio::process::Child, std::time::Duration)> {
        let unset: Vec<&str> = self
            .env
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !env.iter().any(|(n, _)| n == k))
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({
            "argv": plan.entry,
            "env": env.iter().cloned().collect::<std::collections::BTreeMap<String, String>>(),
            "unset": unset,
        }))
        .map_err(std::io::Error::other)?;
        if body.len() > MESSAGE_BYTES_MAX {
            return Err(std::io::Error::other(format!(
                "activation message of {} bytes (at most {MESSAGE_BYTES_MAX})",
                body.len()
            )));
        }
        let mut msg = (body.len() as u32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        let sent = send_with_fds(&self.sock, &msg, &[stdout.as_raw_fd(), stderr.as_raw_fd()])?;
        // The rest, if the first send took only part (nonblocking: a full buffer is an error).
        (&self.sock).write_all(&msg[sent..])?;
        drop((stdout, stderr));
        let waited = self.started.elapsed();
        let Standby { child, sock, .. } = self;
        drop(sock);
        Ok((child, waited))
    }
}

/// One `sendmsg` of `data` with `fds` attached (SCM_RIGHTS); returns the bytes sent.
fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[i32]) -> std::io::Result<usize> {
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points to `space` bytes, room for one cmsghdr holding `fds`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(cmsg), fd_bytes);
    }
    loop {
        // SAFETY: msg and everything it points to live across the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A pipe for a teed stream handed to a standby: the read end (nonblocking, for the agent's
/// pump) and the write end (blocking, for the worker).
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    let (r, w) = unsafe {
        use std::os::fd::FromRawFd;
        (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
    };
    // SAFETY: fcntl on a descriptor owned here.
    unsafe {
        let flags = libc::fcntl(r.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(r.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((r, w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standbys_start_at_the_first_step_or_a_minute_into_a_group_that_reports_none() {
        let s = Duration::from_secs;
        assert!(standbys_due_now(true, s(0)));
        // A first step of seconds (a large model) keeps its cores.
        assert!(!standbys_due_now(false, s(15)));
        assert!(!standbys_due_now(false, s(59)));
        assert!(standbys_due_now(false, s(60)));
    }

    fn env(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn only_command_lines_the_agent_builds_for_python_have_a_plan() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            Plan::for_argv(&argv(&["python3", "-u", "train.py", "--lr", "1"]), "/v/py")
                .unwrap()
                .entry,
            argv(&["train.py", "--lr", "1"])
        );
        assert_eq!(
            Plan::for_argv(&argv(&["/v/py", "-u", "-m", "pkg.train", "x"]), "/v/py")
                .unwrap()
                .entry,
            argv(&["-m", "pkg.train", "x"])
        );
        assert_eq!(
            Plan::for_argv(&argv(&["/venv/bin/python3.11", "t.py"]), "/v/py")
                .unwrap()
                .entry,
            argv(&["t.py"])
        );
        for bad in [
            &["./train.sh", "x"][..],
            &["pythonista", "t.py"],
            &["python3", "-u"],
            &["python3", "-u", "-m"],
            &["python3", "-u", "-X", "dev", "t.py"],
            &["python3", "-u", "-m", "-c"],
        ] {
            assert!(Plan::for_argv(&argv(bad), "/v/py").is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_standby_is_fit_unless_a_variable_read_before_the_script_differs() {
        let old = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "6"),
            ("MASTER_PORT", "100"),
            ("ELASTIC_GENERATION", "2"),
            ("ELASTIC_RESUME_DIR", "/s/10"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("OMP_NUM_THREADS", "1"),
            ("LOCAL_RANK", "1"),
        ]);
        let new = env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("MASTER_PORT", "200"),
            ("ELASTIC_GENERATION", "3"),
            ("ELASTIC_HEAL_STEP", "12"),
            ("TORCHELASTIC_RESTART_COUNT", "1"),
            ("OMP_NUM_THREADS", "1"),
            ("LOCAL_RANK", "1"),
        ]);
        assert_eq!(startup_difference(&old, &new), None);
        let mut other = new.clone();
        other[6].1 = "2".into();
        assert_eq!(
            startup_difference(&old, &other).as_deref(),
            Some("OMP_NUM_THREADS")
        );
        let mut more = new.clone();
        more.push(("CUDA_VISIBLE_DEVICES".into(), "1".into()));
        assert_eq!(
            startup_difference(&old, &more).as_deref(),
            Some("CUDA_VISIBLE_DEVICES")
        );
        assert_eq!(
            startup_difference(&more, &old).as_deref(),
            Some("CUDA_VISIBLE_DEVICES")
        );
    }
}
