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
//! - Where each worker's stdout and stderr go is [`crate::logs`]'s (inherited by default);
//!   a failure carries what torchrun's root-cause summary shows ([`WorkerFailure::summary`]).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::failure::NOT_AVAILABLE;
pub use crate::failure::{
    ErrorRecord, NO_TRACEBACK, WorkerFailure, entrypoint_name, exit_code, host_name,
    read_error_file, read_error_record, signal_name,
};
use crate::logs::{Dest, Logs};
use crate::output::{self, Stream, Tail};
use crate::standby::{self, Standbys, Unfit};
use crate::state::AgentState;
use crate::worker_env::{self, GenerationView, LauncherEnv, WorkerSpec};

/// With `--warm-standby`, how long after a group's start its standbys start when it reports
/// no step before (a script that never reports steps). Long enough that a large model's slow
/// start (building it, loading its state, a first step of many seconds) does not share its
/// cores with the standbys' imports: on 2 cores, standbys started 10 s into a 12 s first step
/// delayed it by 2-3 s (BENCHMARKS.md §3).
const STANDBY_FILL_AFTER_MS: u64 = 60_000;
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
    /// `--warm-standby`: the interpreters waiting to become the next group's workers.
    pub standbys: Option<Arc<Standbys>>,
}

/// What torchrun's launcher flags add to every worker group, for the agent's life: where
/// the workers' output goes and the variables they get.
#[derive(Debug)]
pub struct Launcher {
    pub logs: Logs,
    pub env: LauncherEnv,
}

impl Launcher {
    /// From the command line and the agent's environment
    /// (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`, `CUDA_VISIBLE_DEVICES`,
    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING`); a bad `--log-dir` is an error naming it.
    pub fn from_cli(cli: &crate::cli::Cli, run_id: &str) -> Result<Launcher, String> {
        let logs = Logs::new(crate::logs::LogsConfig {
            redirects: cli.redirects.clone(),
            tee: cli.tee.clone(),
            local_ranks_filter: cli.local_ranks_filter.clone(),
            duplicate_stdout_filters: cli.duplicate_stdout_filters.clone(),
            duplicate_stderr_filters: cli.duplicate_stderr_filters.clone(),
            prefix_template: std::env::var(crate::logs::LOG_LINE_PREFIX_TEMPLATE_ENV).ok(),
            role: cli.role.clone(),
            run_id: run_id.to_string(),
            log_dir: cli.log_dir.clone(),
        })?;
        Ok(Launcher {
            logs,
            env: LauncherEnv::from_process(&cli.signals_to_handle.names, cli.virtual_local_rank),
        })
    }

    /// Workers inherit the agent's streams and get torchrun's defaults (tests).
    pub fn inherit(role: &str) -> Launcher {
        Launcher {
            logs: Logs::inherit(role),
            env: LauncherEnv::default(),
        }
    }
}

/// torchrun's variable for the SIGTERM to SIGKILL grace, in seconds.
pub const SHUTDOWN_TIMEOUT_ENV: &str = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
/// Longest stop grace accepted from [`SHUTDOWN_TIMEOUT_ENV`], as for `--shutdown-timeout`.
const SHUTDOWN_TIMEOUT_S_MAX: u64 = 86_400;

/// The SIGTERM to SIGKILL grace when stopping workers: `--shutdown-timeout` (`flag_s`), else
/// `env_s` (the value of [`SHUTDOWN_TIMEOUT_ENV`]), else `default`. A bad variable is an error
/// naming it.
pub fn stop_grace(
    flag_s: Option<u64>,
    env_s: Option<&str>,
    default: Duration,
) -> Result<Duration, String> {
    if let Some(s) = flag_s {
        return Ok(Duration::from_secs(s));
    }
    match env_s.map(str::trim) {
        None | Some("") => Ok(default),
        Some(v) => match v.parse::<u64>() {
            Ok(s) if s <= SHUTDOWN_TIMEOUT_S_MAX => Ok(Duration::from_secs(s)),
            _ => Err(format!(
                "{SHUTDOWN_TIMEOUT_ENV}={v:?}: expected whole seconds, 0 to {SHUTDOWN_TIMEOUT_S_MAX}"
            )),
        },
    }
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

/// Runs one worker group of `view` until it succeeds, fails, drains or is stopped;
/// `restart_count` is its `TORCHELASTIC_RESTART_COUNT`.
pub async fn run(
    cfg: SupervisorConfig,
    spec: WorkerSpec,
    view: GenerationView,
    restart_count: u32,
    launcher: Arc<Launcher>,
    state: Arc<AgentState>,
    mut commands: mpsc::Receiver<Command>,
) -> Outcome {
    let restarts = restart_count;
    let span = tracing::info_span!("group", restarts);
    let (end, group, drain_deadline) = match run_group(
        &cfg,
        &spec,
        &view,
        restarts,
        &launcher,
        &state,
        &mut commands,
    )
    .instrument(span)
    .await
    {
        Ok(r) => r,
        Err(failure) => return Outcome::Failed(*failure),
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
        GroupEnd::Hung(limit) => Outcome::Failed(WorkerFailure::new(
            view.rank_offset,
            0,
            1,
            format!("no worker reported progress for {limit:?}; the group was killed as hung"),
            restarts,
        )),
    }
}

/// Starts one worker group and watches it until it ends; the group is stopped and reaped
/// before this returns, with the drain deadline if a drain began.
async fn run_group(
    cfg: &SupervisorConfig,
    spec: &WorkerSpec,
    view: &GenerationView,
    restarts: u32,
    launcher: &Launcher,
    state: &AgentState,
    commands: &mut mpsc::Receiver<Command>,
) -> Result<(GroupEnd, WorkerGroup, Option<Instant>), Box<WorkerFailure>> {
    let mut drain_deadline: Option<Instant> = None;
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
    let mut group = WorkerGroup::start(cfg, spec, view, restarts, launcher)?;
    state
        .metrics
        .worker_groups_started_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    state
        .metrics
        .warm_standby_starts_total
        .fetch_add(group.warm, std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    // The standbys for the next group start once this one trains (its first step), or after
    // a while when it reports none (standbys_due_now): not while its own interpreters start
    // on the same cores.
    let mut standbys_due = cfg.standbys.is_some();
    let mut tick = tokio::time::interval(cfg.monitor_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = loop {
        tokio::select! {
            exit = group.exits.recv() => {
                let Some((local_rank, status)) = exit else { break GroupEnd::AllSucceeded };
                group.exited(local_rank, status);
                if !status.success() {
                    // Others that failed by now are in the report too (torchrun's one poll);
                    // those the stop kills next are not.
                    while let Ok((i, s)) = group.exits.try_recv() {
                        group.exited(i, s);
                    }
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
                    drain_deadline = Some(deadline);
                    if sigterm_now {
                        group.signal(libc::SIGTERM);
                    }
                }
            },
            _ = tick.tick() => {
                let now = Instant::now();
                if standbys_due
                    && drain_deadline.is_none()
                    && standbys_due_now(state.last_progress().is_some(), now.duration_since(started))
                {
                    standbys_due = false;
                    fill_standbys(cfg, spec, view, restarts, launcher);
                }
                if drain_deadline.is_some_and(|d| now >= d) {
                    break GroupEnd::DrainTimedOut;
                }
                if let (Some(limit), None) = (cfg.hang_timeout, drain_deadline) {
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
    Ok((end, group, drain_deadline))
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
    /// When each worker was seen to fail, before the group was stopped.
    failed_at: Vec<Option<SystemTime>>,
    exits: mpsc::Receiver<(u32, ExitStatus)>,
    tails: Vec<StderrTail>,
    error_files: Vec<PathBuf>,
    tasks: Vec<JoinHandle<()>>,
    /// Workers started in a warm standby.
    warm: u64,
}

/// Where a worker's last stderr lines can be found for its failure report.
enum StderrTail {
    /// Through the agent (teed): kept as it passed.
    Kept(Tail),
    /// In its log file (redirected).
    File(PathBuf),
    /// On the console or /dev/null: not seen by the agent.
    None,
}

impl WorkerGroup {
    fn start(
        cfg: &SupervisorConfig,
        spec: &WorkerSpec,
        view: &GenerationView,
        restarts: u32,
        launcher: &Launcher,
    ) -> Result<Self, Box<WorkerFailure>> {
        let nproc = spec.nproc as usize;
        let (tx, exits) = mpsc::channel(nproc.max(1));
        let mut group = WorkerGroup {
            pids: Vec::with_capacity(nproc),
            exited: Vec::with_capacity(nproc),
            failed_at: Vec::with_capacity(nproc),
            exits,
            tails: Vec::with_capacity(nproc),
            error_files: Vec::with_capacity(nproc),
            tasks: Vec::with_capacity(3 * nproc),
            warm: 0,
        };
        let attempt = launcher
            .logs
            .attempt(spec.nproc, view.rank_offset)
            .map_err(|e| Box::new(WorkerFailure::new(view.rank_offset, 0, 1, e, restarts)))?;
        for (local_rank, logs) in (0..spec.nproc).zip(attempt.workers) {
            let spawn_failure = |message: String| {
                Box::new(WorkerFailure::new(
                    view.rank_offset + local_rank,
                    local_rank,
                    1,
                    message,
                    restarts,
                ))
            };
            let error_file = match logs.error_file {
                Some(f) => f,
                None => {
                    let f = worker_env::error_file(
                        &spec.run_dir,
                        view.generation,
                        restarts,
                        local_rank,
                    );
                    if let Some(dir) = f.parent() {
                        std::fs::create_dir_all(dir)
                            .map_err(|e| spawn_failure(format!("create {}: {e}", dir.display())))?;
                    }
                    let _ = std::fs::remove_file(&f);
                    f
                }
            };
            let env = worker_env::worker_env(
                spec,
                view,
                local_rank,
                restarts,
                cfg.omp_num_threads_set,
                &launcher.env,
                &error_file,
            )
            .map_err(|e| spawn_failure(e.to_string()))?;
            let tail = match &logs.stderr {
                Dest::Tee(_) => StderrTail::Kept(Tail::default()),
                Dest::File(p, _) => StderrTail::File(p.clone()),
                Dest::Console | Dest::Null => StderrTail::None,
            };
            let rank = view.rank_offset + local_rank;
            let kept = match &tail {
                StderrTail::Kept(t) => Some(t.clone()),
                _ => None,
            };
            let warm = cfg
                .standbys
                .as_deref()
                .and_then(|pool| warm_start(pool, local_rank, &env, &logs.stdout, &logs.stderr));
            let mut child = match warm {
                Some((child, pumps)) => {
                    group.warm += 1;
                    for (read, to, stream) in pumps {
                        let kept = (stream == Stream::Stderr).then(|| kept.clone()).flatten();
                        group
                            .tasks
                            .push(tokio::spawn(output::pump(read, to, stream, kept)));
                    }
                    child
                }
                None => {
                    let (stdout, out_tee) = stdio(logs.stdout);
                    let (stderr, err_tee) = stdio(logs.stderr);
                    let mut child = match spawn_worker(&cfg.argv, &env, stdout, stderr) {
                        Ok(c) => c,
                        Err(e) => {
                            let msg = format!("cannot start `{}`: {e}", cfg.argv.join(" "));
                            // Workers already started must not keep running without their peers.
                            let mut partial = group;
                            tokio::spawn(async move { partial.stop(Duration::ZERO).await });
                            return Err(spawn_failure(msg));
                        }
                    };
                    if let (Some(out), Some(to)) = (child.stdout.take(), out_tee) {
                        group
                            .tasks
                            .push(tokio::spawn(output::pump(out, to, Stream::Stdout, None)));
                    }
                    if let (Some(err), Some(to)) = (child.stderr.take(), err_tee) {
                        group
                            .tasks
                            .push(tokio::spawn(output::pump(err, to, Stream::Stderr, kept)));
                    }
                    child
                }
            };
            let pid = child.id().map(|p| p as i32).unwrap_or(0);
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
            group.failed_at.push(None);
            group.tails.push(tail);
            group.error_files.push(error_file);
        }
        Ok(group)
    }

    /// Notes that `local_rank` exited, and when, if it failed while the group ran.
    fn exited(&mut self, local_rank: u32, status: ExitStatus) {
        let i = local_rank as usize;
        self.exited[i] = Some(status);
        if !status.success() {
            self.failed_at[i] = Some(SystemTime::now());
        }
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

    /// The failure of `local_rank`, with the others seen failed before the group was stopped.
    fn failure(
        &self,
        local_rank: u32,
        status: ExitStatus,
        view: &GenerationView,
        restarts: u32,
    ) -> WorkerFailure {
        let mut root = self.one_failure(local_rank, status, view, restarts);
        for (i, (at, exited)) in self.failed_at.iter().zip(&self.exited).enumerate() {
            if i as u32 != local_rank
                && at.is_some()
                && let Some(s) = exited
            {
                root.others
                    .push(self.one_failure(i as u32, *s, view, restarts));
            }
        }
        root
    }

    fn one_failure(
        &self,
        local_rank: u32,
        status: ExitStatus,
        view: &GenerationView,
        restarts: u32,
    ) -> WorkerFailure {
        let i = local_rank as usize;
        let record = read_error_record(&self.error_files[i]);
        let pid = u32::try_from(self.pids[i]).ok().filter(|p| *p > 0);
        let signal = status.signal();
        let tail = match &self.tails[i] {
            StderrTail::Kept(t) => t.lines(),
            StderrTail::File(p) => Tail::of_file(p).lines(),
            StderrTail::None => Vec::new(),
        };
        let message = match (&record, signal) {
            (Some(r), _) => r.text(),
            (None, _) if !tail.is_empty() => tail.join("\n"),
            (None, Some(sig)) => format!(
                "Signal {sig} ({}) received by PID {}",
                signal_name(sig),
                pid.map_or(NOT_AVAILABLE.to_string(), |p| p.to_string())
            ),
            (None, None) => match self.tails[i] {
                StderrTail::None => "its stderr is above, on this console".to_string(),
                _ => "it wrote nothing to stderr".to_string(),
            },
        };
        let time = record
            .as_ref()
            .and_then(|r| r.timestamp)
            .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
            .or(self.failed_at[i])
            .unwrap_or_else(SystemTime::now);
        WorkerFailure {
            rank: view.rank_offset + local_rank,
            local_rank,
            exit_code: exit_code(status),
            signal,
            pid,
            time,
            error_file: record.as_ref().map(|_| self.error_files[i].clone()),
            traceback: record.map(|r| r.traceback),
            message,
            restarts,
            others: Vec::new(),
        }
    }
}

/// Whether a group's standbys start now: once it reported a step (`progressed`), else once
/// it has run [`STANDBY_FILL_AFTER_MS`].
fn standbys_due_now(progressed: bool, running: Duration) -> bool {
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
fn warm_start(
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
                let (read, write) = standby::pipe()?;
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

/// How a worker stream is given to the child, and the tee to pump it into when piped.
fn stdio(dest: Dest) -> (Stdio, Option<Arc<crate::logs::Tee>>) {
    match dest {
        Dest::Console => (Stdio::inherit(), None),
        Dest::Null => (Stdio::null(), None),
        Dest::File(_, f) => (Stdio::from(f), None),
        Dest::Tee(t) => (Stdio::piped(), Some(t)),
    }
}

fn spawn_worker(
    argv: &[String],
    env: &[(String, String)],
    stdout: Stdio,
    stderr: Stdio,
) -> std::io::Result<tokio::process::Child> {
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command"))?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: the hook runs between fork and exec and calls only async-signal-safe functions.
    unsafe { cmd.pre_exec(die_with_agent()) };
    cmd.spawn()
}

/// A `pre_exec` hook for a child of the agent (a worker, a served etcd): the child gets
/// `PR_SET_PDEATHSIG=SIGKILL`, so it dies with the agent even on SIGKILL, and kills itself if
/// the agent already died between fork and prctl. The death signal fires when the forking
/// *thread* exits, so the child must be spawned from the agent's main thread. The hook calls
/// only async-signal-safe functions (prctl, getppid, kill, getpid).
pub(crate) fn die_with_agent() -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
    let agent_pid = std::process::id() as libc::pid_t;
    move || {
        // SAFETY: prctl, getppid, kill and getpid are async-signal-safe and take no pointers.
        unsafe {
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
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            heal_step: None,
        }
    }

    fn inherit() -> Arc<Launcher> {
        Arc::new(Launcher::inherit("default"))
    }

    /// stderr teed through the agent into `DIR/logs`.
    fn teed(f: &Fixture) -> Arc<Launcher> {
        let logs = Logs::new(crate::logs::LogsConfig {
            tee: crate::cli::StdSpec::All(crate::cli::Std::ERR),
            role: "default".into(),
            run_id: "t".into(),
            log_dir: Some(f.dir.path().join("logs")),
            ..Default::default()
        })
        .unwrap();
        Arc::new(Launcher {
            logs,
            env: LauncherEnv::default(),
        })
    }

    fn cfg(script: &str) -> SupervisorConfig {
        SupervisorConfig {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            monitor_interval: Duration::from_millis(20),
            hang_timeout: None,
            startup_timeout: Duration::from_millis(300),
            stop_grace: Duration::from_secs(2),
            omp_num_threads_set: false,
            standbys: None,
        }
    }

    #[test]
    fn standbys_start_at_the_first_step_or_a_minute_into_a_group_that_reports_none() {
        let s = Duration::from_secs;
        assert!(standbys_due_now(true, s(0)));
        // A first step of seconds (a large model) keeps its cores.
        assert!(!standbys_due_now(false, s(15)));
        assert!(!standbys_due_now(false, s(59)));
        assert!(standbys_due_now(false, s(60)));
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
            inherit(),
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
            teed(&f),
            f.state.clone(),
            rx,
        )
        .await;
        let Outcome::Failed(fail) = out else {
            panic!("{out:?}")
        };
        assert_eq!((fail.rank, fail.exit_code, fail.restarts), (1, 7, 2));
        assert!(fail.message.contains("bad thing on 1"), "{}", fail.message);
        assert!(fail.pid.is_some() && fail.signal.is_none() && fail.error_file.is_none());
        // Rank 0 was stopped by the agent: not one of the failures.
        assert!(fail.others.is_empty(), "{:?}", fail.others);
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
        let Outcome::Failed(fail) = run(
            cfg(script),
            spec(&f, 1, 0),
            view(1),
            0,
            teed(&f),
            f.state.clone(),
            rx,
        )
        .await
        else {
            panic!()
        };
        assert_eq!(fail.exit_code, 3);
        assert_eq!(fail.message, "RuntimeError: from file");
        assert_eq!(fail.traceback.as_deref(), Some("RuntimeError: from file"));
        assert_eq!(fail.time, SystemTime::UNIX_EPOCH);
        let file = fail.error_file.unwrap();
        assert!(
            file.ends_with("attempt_0/0/error.json"),
            "{}",
            file.display()
        );
    }

    #[tokio::test]
    async fn an_inherited_stderr_is_not_in_the_report_and_a_signal_is() {
        let f = fixture();
        let (_tx, rx) = mpsc::channel(4);
        let Outcome::Failed(fail) = run(
            cfg("exit 4"),
            spec(&f, 1, 0),
            view(1),
            0,
            inherit(),
            f.state.clone(),
            rx,
        )
        .await
        else {
            panic!()
        };
        assert!(fail.message.contains("stderr is above"), "{}", fail.message);
        let (_tx, rx) = mpsc::channel(4);
        let Outcome::Failed(fail) = run(
            cfg("kill -9 $$"),
            spec(&f, 1, 0),
            view(1),
            0,
            inherit(),
            f.state.clone(),
            rx,
        )
        .await
        else {
            panic!()
        };
        assert_eq!((fail.exit_code, fail.signal), (128 + 9, Some(9)));
        let pid = fail.pid.unwrap();
        assert_eq!(
            fail.message,
            format!("Signal 9 (SIGKILL) received by PID {pid}")
        );
    }

    #[tokio::test]
    async fn a_redirected_stderr_goes_to_its_file_and_its_tail_to_the_report() {
        let f = fixture();
        let logs = Logs::new(crate::logs::LogsConfig {
            redirects: crate::cli::StdSpec::All(crate::cli::Std::ALL),
            role: "default".into(),
            run_id: "t".into(),
            log_dir: Some(f.dir.path().join("logs")),
            ..Default::default()
        })
        .unwrap();
        let launcher = Arc::new(Launcher {
            logs,
            env: LauncherEnv::default(),
        });
        let (_tx, rx) = mpsc::channel(4);
        let script = "echo out; echo 'worker said no' >&2; exit 2";
        let Outcome::Failed(fail) = run(
            cfg(script),
            spec(&f, 1, 0),
            view(1),
            0,
            launcher.clone(),
            f.state.clone(),
            rx,
        )
        .await
        else {
            panic!()
        };
        assert_eq!(fail.message, "worker said no");
        let dir = launcher.logs.run_dir().unwrap().join("attempt_0/0");
        assert_eq!(
            std::fs::read_to_string(dir.join("stdout.log")).unwrap(),
            "out\n"
        );
    }

    #[test]
    fn stop_grace_is_the_flag_else_the_variable_else_the_default() {
        let d = Duration::from_secs(5);
        assert_eq!(
            stop_grace(Some(7), Some("9"), d),
            Ok(Duration::from_secs(7))
        );
        assert_eq!(stop_grace(None, Some("9"), d), Ok(Duration::from_secs(9)));
        assert_eq!(stop_grace(None, None, d), Ok(d));
        assert_eq!(stop_grace(None, Some(""), d), Ok(d));
        for bad in ["x", "-1", "1.5", "100000"] {
            let e = stop_grace(None, Some(bad), d).unwrap_err();
            assert!(e.contains(SHUTDOWN_TIMEOUT_ENV), "{e}");
        }
    }

    #[tokio::test]
    async fn silent_group_is_killed_as_hung_and_counts_as_a_failure() {
        let f = fixture();
        let mut c = cfg("sleep 30");
        c.hang_timeout = Some(Duration::from_millis(300));
        let (_tx, rx) = mpsc::channel(4);
        let t0 = Instant::now();
        let Outcome::Failed(fail) = run(
            c,
            spec(&f, 2, 1),
            view(2),
            1,
            inherit(),
            f.state.clone(),
            rx,
        )
        .await
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
        let sup = tokio::spawn(run(
            c,
            spec(&f, 2, 0),
            view(2),
            0,
            inherit(),
            f.state.clone(),
            rx,
        ));
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
            inherit(),
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
