//! Worker supervision: start one group of `nproc` workers, watch it, stop it.
//!
//! - Each worker runs in its own process group and gets `PR_SET_PDEATHSIG=SIGKILL`, so an
//!   agent killed with SIGKILL takes its workers with it. The death signal fires when the
//!   *thread* that forked exits, so workers must be spawned from a thread that lives as long as
//!   the agent: the binary runs a current-thread tokio runtime on its main thread for this.
//! - Stopping a group is SIGTERM to every worker's process group, `stop_grace`, then SIGKILL to
//!   every group (which also reaches grandchildren such as data-loader workers), and every
//!   worker is reaped.
//! - A worker failure ends the group ([`Outcome::Failed`]); a hang (no `progress` message for
//!   `hang_timeout`) is a failure too. Whether it restarts, with which generation and which
//!   `TORCHELASTIC_RESTART_COUNT`, is the agent's decision (`agent::decide`), as is every
//!   new generation: the supervisor runs one group of one generation.
//! - The agent drives a running group through [`Command`]s: stop it, forward a signal, or
//!   drain it (wait for the workers to save and exit until a deadline).

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::output::{self, Stream, Tail};
use crate::state::AgentState;
use crate::worker_env::{self, GenerationView, WorkerSpec};

/// Longest error file read from a worker.
const ERROR_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// How long to wait for SIGKILLed workers to be reaped and their output drained.
const REAP_AFTER_KILL_MS: u64 = 5_000;
/// How long to wait for output pumps after the workers are gone (a grandchild outside the
/// process group could hold a pipe open forever).
const PUMP_DRAIN_MS: u64 = 1_000;

/// How the supervisor runs the workers.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The worker command line, program first.
    pub argv: Vec<String>,
    /// How often the drain deadline and the hang watchdog are checked.
    pub monitor_interval: Duration,
    pub hang_timeout: Option<Duration>,
    /// Before a group's first progress report, the hang watchdog waits this long instead.
    pub startup_timeout: Duration,
    /// SIGTERM to SIGKILL when stopping a group.
    pub stop_grace: Duration,
    /// Whether the agent's own environment sets `OMP_NUM_THREADS`.
    pub omp_num_threads_set: bool,
}

/// What the agent (or the membership layer) asks of a running supervisor.
#[derive(Debug, Clone)]
pub enum Command {
    /// The workers were asked to stop through the socket: wait for them to exit until
    /// `deadline`, then stop them. With `sigterm_now`, SIGTERM them at once (workers that do not
    /// speak the protocol).
    Drain {
        deadline: Instant,
        sigterm_now: bool,
    },
    /// Forward a signal to every worker's process group.
    Signal(i32),
    /// Stop the workers and return.
    Stop,
}

/// Why a worker group ended for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited 0.
    Succeeded,
    /// A drain ended; `clean` when every worker exited 0 before the deadline.
    Drained { clean: bool },
    /// A worker failed or the group hung.
    Failed(WorkerFailure),
    /// [`Command::Stop`], or the command channel closed.
    Stopped,
}

/// The failure that ended a job: which worker, its exit code and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    pub rank: u32,
    pub local_rank: u32,
    /// The worker's exit code, 128 + signal for a signal, 1 for a hang or a spawn failure.
    pub exit_code: i32,
    /// From `TORCHELASTIC_ERROR_FILE` when the worker wrote one, else its last stderr lines.
    pub message: String,
    pub restarts: u32,
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "worker rank {} (local rank {}) failed with exit code {} after {} restart(s)",
            self.rank, self.local_rank, self.exit_code, self.restarts
        )?;
        if !self.message.is_empty() {
            write!(f, ":\n{}", self.message)?;
        }
        Ok(())
    }
}

/// Runs one worker group of `view` until it succeeds, fails, drains or is stopped;
/// `restart_count` is its `TORCHELASTIC_RESTART_COUNT`.
pub async fn run(
    cfg: SupervisorConfig,
    spec: WorkerSpec,
    view: GenerationView,
    restart_count: u32,
    state: Arc<AgentState>,
    mut commands: mpsc::Receiver<Command>,
) -> Outcome {
    let restarts = restart_count;
    let mut drain_deadline: Option<Instant> = None;
    let span = tracing::info_span!("group", restarts);
    let (end, group) = match run_group(
        &cfg,
        &spec,
        &view,
        restarts,
        &state,
        &mut commands,
        &mut drain_deadline,
    )
    .instrument(span)
    .await
    {
        Ok(r) => r,
        Err(failure) => return Outcome::Failed(failure),
    };
    match end {
        GroupEnd::AllSucceeded if drain_deadline.is_some() => Outcome::Drained { clean: true },
        GroupEnd::AllSucceeded => Outcome::Succeeded,
        GroupEnd::Stop => Outcome::Stopped,
        GroupEnd::DrainTimedOut => {
            tracing::warn!("drain deadline passed; workers were stopped");
            Outcome::Drained { clean: false }
        }
        GroupEnd::Failed { local_rank, status } if drain_deadline.is_some() => {
            let f = group.failure(local_rank, status, &view, restarts);
            tracing::warn!(
                rank = f.rank,
                exit_code = f.exit_code,
                "a worker failed while draining: {}",
                f.message.lines().last().unwrap_or("")
            );
            Outcome::Drained { clean: false }
        }
        GroupEnd::Failed { local_rank, status } => {
            Outcome::Failed(group.failure(local_rank, status, &view, restarts))
        }
        GroupEnd::Hung(limit) => Outcome::Failed(WorkerFailure {
            rank: view.rank_offset,
            local_rank: 0,
            exit_code: 1,
            message: format!(
                "no worker reported progress for {limit:?}; the group was killed as hung"
            ),
            restarts,
        }),
    }
}

/// Starts one worker group and watches it until it ends; the group is stopped and reaped
/// before this returns.
async fn run_group(
    cfg: &SupervisorConfig,
    spec: &WorkerSpec,
    view: &GenerationView,
    restarts: u32,
    state: &AgentState,
    commands: &mut mpsc::Receiver<Command>,
    drain_deadline: &mut Option<Instant>,
) -> Result<(GroupEnd, WorkerGroup), WorkerFailure> {
    let ranks = view.rank_offset..view.rank_offset + spec.nproc;
    state.begin_group(view.generation, view.world_size, ranks);
    tracing::info!(
        world_size = view.world_size,
        rank_offset = view.rank_offset,
        master = %format!("{}:{}", view.master_addr, view.master_port),
        resume_step = view.resume.as_ref().map(|r| r.step),
        lr_scale = view.scaling.lr_scale,
        "starting workers"
    );
    let mut group = WorkerGroup::start(cfg, spec, view, restarts)?;
    state
        .metrics
        .worker_groups_started_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    let mut tick = tokio::time::interval(cfg.monitor_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = loop {
        tokio::select! {
            exit = group.exits.recv() => {
                let Some((local_rank, status)) = exit else { break GroupEnd::AllSucceeded };
                group.exited[local_rank as usize] = Some(status);
                if !status.success() {
                    break GroupEnd::Failed { local_rank, status };
                }
                if group.exited.iter().all(Option::is_some) {
                    break GroupEnd::AllSucceeded;
                }
            }
            cmd = commands.recv() => match cmd {
                None | Some(Command::Stop) => break GroupEnd::Stop,
                Some(Command::Signal(sig)) => group.signal(sig),
                Some(Command::Drain { deadline, sigterm_now }) => {
                    tracing::info!(sigterm_now, grace_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64, "draining workers");
                    *drain_deadline = Some(deadline);
                    if sigterm_now {
                        group.signal(libc::SIGTERM);
                    }
                }
            },
            _ = tick.tick() => {
                let now = Instant::now();
                if drain_deadline.is_some_and(|d| now >= d) {
                    break GroupEnd::DrainTimedOut;
                }
                if let (Some(limit), None) = (cfg.hang_timeout, *drain_deadline) {
                    // Start-up (imports, rendezvous, restore) gets its own allowance.
                    let (last, limit) = match state.last_progress() {
                        Some(p) => (p.max(started), limit),
                        None => (started, cfg.startup_timeout.max(limit)),
                    };
                    if now.duration_since(last) > limit {
                        break GroupEnd::Hung(limit);
                    }
                }
            }
        }
    };
    group.stop(cfg.stop_grace).await;
    Ok((end, group))
}

enum GroupEnd {
    AllSucceeded,
    Failed { local_rank: u32, status: ExitStatus },
    Hung(Duration),
    DrainTimedOut,
    Stop,
}

struct WorkerGroup {
    /// Worker PIDs, which are also their process-group ids.
    pids: Vec<i32>,
    exited: Vec<Option<ExitStatus>>,
    exits: mpsc::Receiver<(u32, ExitStatus)>,
    tails: Vec<Tail>,
    error_files: Vec<std::path::PathBuf>,
    tasks: Vec<JoinHandle<()>>,
}

impl WorkerGroup {
    fn start(
        cfg: &SupervisorConfig,
        spec: &WorkerSpec,
        view: &GenerationView,
        restarts: u32,
    ) -> Result<Self, WorkerFailure> {
        let nproc = spec.nproc as usize;
        let (tx, exits) = mpsc::channel(nproc.max(1));
        let mut group = WorkerGroup {
            pids: Vec::with_capacity(nproc),
            exited: Vec::with_capacity(nproc),
            exits,
            tails: Vec::with_capacity(nproc),
            error_files: Vec::with_capacity(nproc),
            tasks: Vec::with_capacity(3 * nproc),
        };
        for local_rank in 0..spec.nproc {
            let spawn_failure = |message: String| WorkerFailure {
                rank: view.rank_offset + local_rank,
                local_rank,
                exit_code: 1,
                message,
                restarts,
            };
            let env =
                worker_env::worker_env(spec, view, local_rank, restarts, cfg.omp_num_threads_set)
                    .map_err(|e| spawn_failure(e.to_string()))?;
            let error_file =
                worker_env::error_file(&spec.run_dir, view.generation, restarts, local_rank);
            if let Some(dir) = error_file.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| spawn_failure(format!("create {}: {e}", dir.display())))?;
            }
            let _ = std::fs::remove_file(&error_file);
            let mut child = match spawn_worker(&cfg.argv, &env) {
                Ok(c) => c,
                Err(e) => {
                    let msg = format!("cannot start `{}`: {e}", cfg.argv.join(" "));
                    // Workers already started must not keep running without their peers.
                    let mut partial = group;
                    tokio::spawn(async move { partial.stop(Duration::ZERO).await });
                    return Err(spawn_failure(msg));
                }
            };
            let rank = view.rank_offset + local_rank;
            let pid = child.id().map(|p| p as i32).unwrap_or(0);
            let tail = Tail::default();
            if let Some(out) = child.stdout.take() {
                group
                    .tasks
                    .push(tokio::spawn(output::pump(out, rank, Stream::Stdout, None)));
            }
            if let Some(err) = child.stderr.take() {
                group.tasks.push(tokio::spawn(output::pump(
                    err,
                    rank,
                    Stream::Stderr,
                    Some(tail.clone()),
                )));
            }
            let tx = tx.clone();
            group.tasks.push(tokio::spawn(async move {
                let status = match child.wait().await {
                    Ok(s) => s,
                    // wait() only fails if the child was already reaped; report it as killed.
                    Err(_) => ExitStatus::from_raw(libc::SIGKILL),
                };
                let _ = tx.send((local_rank, status)).await;
            }));
            tracing::debug!(rank, local_rank, pid, "worker started");
            group.pids.push(pid);
            group.exited.push(None);
            group.tails.push(tail);
            group.error_files.push(error_file);
        }
        Ok(group)
    }

    /// Sends `sig` to the process group of every worker that has not been seen to exit.
    fn signal(&self, sig: i32) {
        for (pid, exited) in self.pids.iter().zip(&self.exited) {
            if exited.is_none() && *pid > 0 {
                // SAFETY: kill(2) on a process group we created; the leader has not been
                // reported reaped, so the id still names our group.
                unsafe { libc::kill(-*pid, sig) };
            }
        }
    }

    /// SIGTERM, `grace`, SIGKILL; reaps every worker and drains their output.
    async fn stop(&mut self, grace: Duration) {
        if self.exited.iter().any(Option::is_none) {
            self.signal(libc::SIGTERM);
            self.wait_all(grace).await;
        }
        // SIGKILL every group, exited leaders included: their children (data loaders, shells'
        // children) may still be running in the group.
        for pid in &self.pids {
            if *pid > 0 {
                // SAFETY: as in `signal`; a group whose members are all gone gets ESRCH.
                unsafe { libc::kill(-*pid, libc::SIGKILL) };
            }
        }
        self.wait_all(Duration::from_millis(REAP_AFTER_KILL_MS))
            .await;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(PUMP_DRAIN_MS);
        for task in self.tasks.drain(..) {
            let abort = task.abort_handle();
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                abort.abort();
            }
        }
    }

    async fn wait_all(&mut self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.exited.iter().any(Option::is_none) {
            match tokio::time::timeout_at(deadline, self.exits.recv()).await {
                Ok(Some((i, status))) => self.exited[i as usize] = Some(status),
                Ok(None) | Err(_) => return,
            }
        }
    }

    fn failure(
        &self,
        local_rank: u32,
        status: ExitStatus,
        view: &GenerationView,
        restarts: u32,
    ) -> WorkerFailure {
        let i = local_rank as usize;
        let message = read_error_file(&self.error_files[i])
            .unwrap_or_else(|| self.tails[i].lines().join("\n"));
        WorkerFailure {
            rank: view.rank_offset + local_rank,
            local_rank,
            exit_code: exit_code(status),
            message,
            restarts,
        }
    }
}

fn spawn_worker(
    argv: &[String],
    env: &[(String, String)],
) -> std::io::Result<tokio::process::Child> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command"))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let agent_pid = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe
    // functions (prctl, getppid, kill, getpid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The agent may have died between fork and prctl: then nobody will signal us.
            if libc::getppid() != agent_pid {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// The exit code to report: the worker's own, or 128 + the signal that killed it (the shell's
/// convention).
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// Reads the error a worker recorded through torch's `@record` (or any JSON in that shape):
/// `{"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}}`, or
/// `{"message": "..."}`.
pub fn read_error_file(path: &Path) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut bytes = Vec::new();
    f.take(ERROR_FILE_BYTES_MAX).read_to_end(&mut bytes).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let msg = v.get("message")?;
    if let Some(s) = msg.as_str() {
        return Some(s.to_string());
    }
    let text = msg
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or("")
        .to_string();
    let stack = msg
        .get("extraInfo")
        .and_then(|e| e.get("py_callstack"))
        .and_then(|s| s.as_str())
        .unwrap_or("");
    match (text.is_empty(), stack.is_empty()) {
        (true, true) => None,
        (false, true) => Some(text),
        (true, false) => Some(stack.trim_end().to_string()),
        (false, false) => Some(format!("{text}\n{}", stack.trim_end())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_file_in_torch_record_format_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message":{"message":"ValueError: boom","extraInfo":{"py_callstack":"Traceback...\nValueError: boom\n","timestamp":"1"}}}"#,
        )
        .unwrap();
        assert_eq!(
            read_error_file(&p).unwrap(),
            "ValueError: boom\nTraceback...\nValueError: boom"
        );
        std::fs::write(&p, r#"{"message":"plain"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap(), "plain");
        for bad in ["", "[]", "{\"message\":{}}", "{\"nope\":1}"] {
            std::fs::write(&p, bad).unwrap();
            assert_eq!(read_error_file(&p), None, "{bad}");
        }
        assert_eq!(read_error_file(&tmp.path().join("missing")), None);
    }

    #[test]
    fn signals_map_to_shell_exit_codes() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 128 + 9);
    }

    struct Fixture {
        dir: tempfile::TempDir,
        state: Arc<AgentState>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(AgentState::new(dir.path().to_path_buf()));
        Fixture { dir, state }
    }

    fn spec(f: &Fixture, nproc: u32, max_restarts: u32) -> WorkerSpec {
        WorkerSpec {
            nproc,
            role: "default".into(),
            run_id: "t".into(),
            node_id: "n".into(),
            max_restarts,
            checkpoint_interval: 0,
            staging_dir: f.dir.path().join("staging"),
            agent_socket: f.dir.path().join("sock"),
            run_dir: f.dir.path().join("run"),
        }
    }

    fn view(world: u32) -> GenerationView {
        GenerationView {
            generation: 0,
            world_size: world,
            node_rank: 0,
            node_count: 1,
            rank_offset: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            scaling: elastic::ScalingDecision::identity(),
            resume: None,
        }
    }

    fn cfg(script: &str) -> SupervisorConfig {
        SupervisorConfig {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            monitor_interval: Duration::from_millis(20),
            hang_timeout: None,
            startup_timeout: Duration::from_millis(300),
            stop_grace: Duration::from_secs(2),
            omp_num_threads_set: false,
        }
    }

    #[tokio::test]
    async fn group_of_successful_workers_succeeds() {
        let f = fixture();
        let (_tx, rx) = mpsc::channel(4);
        let out = run(
            cfg("exit 0"),
            spec(&f, 3, 0),
            view(3),
            0,
            f.state.clone(),
            rx,
        )
        .await;
        assert_eq!(out, Outcome::Succeeded);
    }

    #[tokio::test]
    async fn a_failing_worker_ends_the_group_with_its_code_stderr_and_restart_count() {
        let f = fixture();
        let marker = f.dir.path().join("attempts");
        // Rank 1 fails at once and records the restart count it was given; rank 0 sleeps.
        let script = format!(
            "if [ \"$LOCAL_RANK\" = 1 ]; then echo \"$TORCHELASTIC_RESTART_COUNT\" >> {m}; echo \"bad thing on $RANK\" >&2; exit 7; fi; sleep 30",
            m = marker.display()
        );
        let (_tx, rx) = mpsc::channel(4);
        let t0 = Instant::now();
        let out = run(
            cfg(&script),
            spec(&f, 2, 2),
            view(2),
            2,
            f.state.clone(),
            rx,
        )
        .await;
        let Outcome::Failed(fail) = out else {
            panic!("{out:?}")
        };
        assert_eq!((fail.rank, fail.exit_code, fail.restarts), (1, 7, 2));
        assert!(fail.message.contains("bad thing on 1"), "{}", fail.message);
        // One group only: restarting is the agent's decision.
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), "2\n");
        // The sleeping rank 0 was stopped rather than waited for.
        assert!(t0.elapsed() < Duration::from_secs(20));
    }

    #[tokio::test]
    async fn error_file_beats_stderr_in_the_failure_report() {
        let f = fixture();
        let script = r#"echo noise >&2; printf '{"message":{"message":"RuntimeError: from file","extraInfo":{"py_callstack":"","timestamp":"0"}}}' > "$TORCHELASTIC_ERROR_FILE"; exit 3"#;
        let (_tx, rx) = mpsc::channel(4);
        let Outcome::Failed(fail) =
            run(cfg(script), spec(&f, 1, 0), view(1), 0, f.state.clone(), rx).await
        else {
            panic!()
        };
        assert_eq!(fail.exit_code, 3);
        assert_eq!(fail.message, "RuntimeError: from file");
    }

    #[tokio::test]
    async fn silent_group_is_killed_as_hung_and_counts_as_a_failure() {
        let f = fixture();
        let mut c = cfg("sleep 30");
        c.hang_timeout = Some(Duration::from_millis(300));
        let (_tx, rx) = mpsc::channel(4);
        let t0 = Instant::now();
        let Outcome::Failed(fail) = run(c, spec(&f, 2, 1), view(2), 1, f.state.clone(), rx).await
        else {
            panic!()
        };
        assert!(
            fail.message.contains("no worker reported progress"),
            "{}",
            fail.message
        );
        assert_eq!(fail.restarts, 1);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn drain_past_its_deadline_stops_workers_that_ignore_sigterm() {
        let f = fixture();
        let (tx, rx) = mpsc::channel(4);
        let mut c = cfg("trap '' TERM; sleep 30 & wait; sleep 30");
        c.stop_grace = Duration::from_millis(200);
        let sup = tokio::spawn(run(c, spec(&f, 2, 0), view(2), 0, f.state.clone(), rx));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t0 = Instant::now();
        tx.send(Command::Drain {
            deadline: Instant::now() + Duration::from_millis(300),
            sigterm_now: true,
        })
        .await
        .unwrap();
        assert_eq!(sup.await.unwrap(), Outcome::Drained { clean: false });
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn stop_reaps_grandchildren_in_the_worker_group() {
        let f = fixture();
        let pidfile = f.dir.path().join("grandchild");
        let script = format!("sleep 60 & echo $! > {}; wait", pidfile.display());
        let (tx, rx) = mpsc::channel(4);
        let sup = tokio::spawn(run(
            cfg(&script),
            spec(&f, 1, 0),
            view(1),
            0,
            f.state.clone(),
            rx,
        ));
        let deadline = Instant::now() + Duration::from_secs(5);
        while !pidfile.exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        tx.send(Command::Stop).await.unwrap();
        assert_eq!(sup.await.unwrap(), Outcome::Stopped);
        // The grandchild was SIGKILLed; as an orphan it is reaped by init (or is a zombie
        // briefly): either way it is no longer running.
        let gone = (0..100).any(|_| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let running = !stat.is_empty() && !stat.contains(") Z");
            if running {
                std::thread::sleep(Duration::from_millis(20));
            }
            !running
        });
        assert!(gone, "grandchild {pid} survived the stop");
    }
}
