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
use crate::standby::{Standbys, fill_standbys, standbys_due_now, warm_start};
use crate::state::AgentState;
use crate::worker_env::{self, GenerationView, LauncherEnv, WorkerSpec};

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
mod tests;
