//! The node agent: turns the command line into a worker spec and a generation, runs the
//! supervisor, the worker socket and the checkpoint hand-off, and drains on SIGTERM, SIGINT or
//! a preemption notice.
//!
//! # Signals and drains
//!
//! The first SIGTERM or SIGINT (or a preemption notice) starts a drain of `--preemption-grace`:
//! `should_stop` turns true on the worker socket, workers that speak the protocol agree on a
//! step, save it and exit 0, and the agent commits what they staged before it leaves. Workers
//! that never spoke the protocol (unmodified torchrun scripts) get SIGTERM at once instead.
//! At the end of the grace (less a kill window of up to 5 s) the group gets SIGTERM, then
//! SIGKILL. A second signal is forwarded to every worker's process group as is.
//!
//! Exit codes: 0 when the workers finished (or drained) cleanly and every commit landed; the
//! failed worker's exit code (128 + signal when killed) when restarts ran out; 143 for a drain
//! that had to kill workers or lost a commit; 2 for usage errors; 1 otherwise.
//!
//! # Membership
//!
//! Only standalone runs (one node, no rendezvous service) have a membership source today:
//! generation 0 with world = nproc and a local master. Elastic runs replace
//! [`standalone_generation`] with the generations the `elastic` crate publishes, feeding each
//! new one to the supervisor as [`Command::NewGeneration`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::agent_socket::{self, AgentState, Received};
use crate::checkpoint_sink::{CheckpointSink, KEEP_STEPS_DEFAULT, LocalDirSink, StepTracker};
use crate::cli::{CheckpointUrl, Cli, NProc, RdzvBackend};
use crate::notice;
use crate::scaling::{self, ScalingConfig};
use crate::supervisor::{self, Command, Outcome, SupervisorConfig};
use crate::worker_env::{GenerationView, WorkerSpec};

/// SIGTERM to SIGKILL when the agent stops a worker group outside a drain.
pub const STOP_GRACE_MS: u64 = 5_000;
/// Part of `--preemption-grace` kept back for SIGTERM → SIGKILL at the end of a drain.
const DRAIN_KILL_WINDOW_MAX_MS: u64 = 5_000;
/// Saved parts queued between the socket and the agent loop.
const PARTS_QUEUE_MAX: usize = 64;
/// Complete steps queued for the sink; a full queue makes workers wait on `saved`.
const COMMIT_QUEUE_MAX: usize = 4;
/// How long the agent waits for queued worker output to be written before it exits.
const OUTPUT_FLUSH_MS: u64 = 5_000;
/// How long pending commits may take after the workers are done, outside a drain.
const FLUSH_TIMEOUT_MS: u64 = 60_000;

/// A configuration the user must change: reported like a bad flag (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Runs the agent to completion and returns the process exit code.
pub async fn run(cli: Cli) -> Result<u8> {
    if !is_standalone(&cli) {
        let what = match cli.rdzv_backend {
            RdzvBackend::EtcdV3 => "etcd-v3 rendezvous",
            RdzvBackend::Static => "multi-node static rendezvous",
        };
        return Err(UsageError(format!(
            "{what} (--nnodes {}:{}) is not supported by this build yet; run one node with \
             --standalone (or --nnodes 1 without --rdzv-endpoint)",
            cli.nnodes.min, cli.nnodes.max
        ))
        .into());
    }
    let nproc = resolve_nproc(cli.nproc_per_node)?;
    let node_id = cli.node_id.clone().unwrap_or_else(default_node_id);
    let run_id = cli.rdzv_id.clone();
    let job = tracing::info_span!("job", run_id = %run_id, node = %node_id);
    run_node(cli, nproc, node_id, run_id).instrument(job).await
}

async fn run_node(cli: Cli, nproc: u32, node_id: String, run_id: String) -> Result<u8> {
    // Everything a user can get wrong is checked before anything is created.
    let scaling_cfg = ScalingConfig {
        policy: cli.lr_scaling,
        base_world_size: cli.base_world_size.unwrap_or(nproc),
        batch_size: cli.batch_size,
        global_batch: cli.global_batch,
        base_lr: cli.base_lr,
        warmup_steps: cli.warmup_steps,
    };
    let master_port = match cli.master_port {
        Some(p) => p,
        None => free_port().context("no free port for the master")?,
    };
    let mut view = standalone_generation(&scaling_cfg, nproc, master_port, None)?;
    let argv = worker_argv(&cli)?;

    let run_dir = RunDir::create()?;
    // Removes a default staging dir when the agent returns, on every path.
    let staging_guard = Staging::prepare(cli.staging_dir.as_deref(), &run_id, &node_id)?;
    let CheckpointUrl::File(ck_root) = &cli.checkpoint_url;
    let ck_root = std::path::absolute(ck_root).context("checkpoint directory")?;
    let sink = LocalDirSink::new(ck_root.clone(), KEEP_STEPS_DEFAULT)?;
    let resume = sink.latest().await?;
    if let Some(r) = &resume {
        tracing::info!(step = r.step, dir = %r.dir.display(), "resuming from committed step");
    }
    view.resume = resume.clone();
    let staging = &staging_guard.path;
    let socket_path = run_dir.path.join("agent.sock");
    let spec = WorkerSpec {
        nproc,
        role: cli.role.clone(),
        run_id: run_id.clone(),
        node_id: node_id.clone(),
        max_restarts: cli.max_restarts,
        checkpoint_interval: cli.checkpoint_interval,
        staging_dir: staging.clone(),
        agent_socket: socket_path.clone(),
        run_dir: run_dir.path.clone(),
    };
    let sup_cfg = SupervisorConfig {
        argv,
        max_restarts: cli.max_restarts,
        monitor_interval: cli.monitor_interval,
        hang_timeout: cli.hang_timeout,
        stop_grace: Duration::from_millis(STOP_GRACE_MS),
        omp_num_threads_set: std::env::var_os("OMP_NUM_THREADS").is_some(),
    };

    // Signals first: a SIGTERM from here on drains instead of killing the agent.
    let mut signals = crate::signals::listen()?;

    let state = Arc::new(AgentState::new(staging.clone()));
    if let Some(r) = resume {
        state.set_resume(r);
    }
    let listener = tokio::net::UnixListener::bind(&socket_path)
        .with_context(|| format!("bind the agent socket {}", socket_path.display()))?;
    let (parts_tx, mut parts_rx) = mpsc::channel::<Received>(PARTS_QUEUE_MAX);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let server = tokio::spawn(agent_socket::serve(
        listener,
        state.clone(),
        parts_tx,
        shutdown_rx,
    ));

    let metrics_server = match cli.metrics_addr {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-addr {addr}"))?;
            tracing::info!(addr = %l.local_addr()?, "serving metrics at /metrics");
            Some(tokio::spawn(crate::metrics::serve(
                l,
                state.clone(),
                shutdown_tx.subscribe(),
            )))
        }
        None => None,
    };

    let (commit_tx, commit_rx) = mpsc::channel(COMMIT_QUEUE_MAX);
    let committer = tokio::spawn(
        commit_loop(sink, commit_rx, state.clone(), staging.clone()).in_current_span(),
    );

    let (notice_tx, mut notices) = mpsc::channel::<String>(1);
    let _poller = cli.preemption_notice.clone().map(|n| {
        tokio::spawn(notice::poll(
            n,
            cli.monitor_interval.max(Duration::from_secs(1)),
            notice_tx,
        ))
    });

    let (cmd_tx, cmd_rx) = mpsc::channel(16);
    let mut sup =
        tokio::spawn(supervisor::run(sup_cfg, spec, view, state.clone(), cmd_rx).in_current_span());

    // Time-based checkpoints: ask for the step after the newest one reported.
    let mut checkpoint_timer = cli.checkpoint_every.map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut tracker = StepTracker::new(0..0);
    let mut drain_started: Option<Instant> = None;
    let grace = cli.preemption_grace;
    let outcome = loop {
        tokio::select! {
            out = &mut sup => break out.context("supervisor task")?,
            Some(sig) = signals.recv() => {
                if drain_started.is_none() {
                    tracing::warn!(signal = sig, "signal received; draining");
                    drain_started = Some(start_drain(&state, &cmd_tx, grace).await);
                } else {
                    tracing::warn!(signal = sig, "second signal; forwarding it to the workers");
                    let _ = cmd_tx.send(Command::Signal(sig)).await;
                }
            }
            Some(why) = notices.recv() => {
                if drain_started.is_none() {
                    tracing::warn!(notice = %why, "preemption notice; draining");
                    drain_started = Some(start_drain(&state, &cmd_tx, grace).await);
                }
            }
            // Only while the commit queue has room, so handing over never blocks this loop
            // (signals must stay responsive); otherwise parts wait in their channel and, once
            // that is full, workers wait for their `saved` reply.
            Some(r) = parts_rx.recv(), if commit_tx.capacity() > 0 => hand_over(&mut tracker, r, &commit_tx).await,
            _ = async { checkpoint_timer.as_mut().expect("guarded").tick().await }, if checkpoint_timer.is_some() => {
                if let Some(step) = state.last_step() {
                    tracing::info!(at_step = step + 1, "time-based checkpoint requested");
                    state.request_checkpoint_at(step + 1);
                }
            }
        }
    };
    let flush_limit = match drain_started {
        Some(t0) => grace.saturating_sub(t0.elapsed()),
        None => Duration::from_millis(FLUSH_TIMEOUT_MS),
    };
    let flush = async {
        // Parts reported just before the workers exited are already queued: hand them over.
        while let Ok(r) = parts_rx.try_recv() {
            hand_over(&mut tracker, r, &commit_tx).await;
        }
        drop(commit_tx);
        committer.await
    };
    let flushed = match tokio::time::timeout(flush_limit, flush).await {
        Ok(Ok(ok)) => ok,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "checkpoint task failed");
            false
        }
        Err(_) => {
            tracing::error!(
                limit_ms = flush_limit.as_millis() as u64,
                "checkpoint flush did not finish in time"
            );
            false
        }
    };
    let _ = shutdown_tx.send(true);
    let _ = server.await;
    crate::output::flush(Duration::from_millis(OUTPUT_FLUSH_MS)).await;
    if let Some(m) = metrics_server {
        let _ = m.await;
    }
    drop(run_dir);

    Ok(match outcome {
        Outcome::Succeeded => {
            tracing::info!("workers finished");
            if flushed { 0 } else { 1 }
        }
        Outcome::Drained { clean: true } if flushed => {
            tracing::info!(
                step = state.resume().map(|r| r.step),
                "drained: workers saved and exited"
            );
            0
        }
        Outcome::Drained { clean } => {
            tracing::error!(
                workers_clean = clean,
                checkpoints_flushed = flushed,
                "drain incomplete"
            );
            128 + libc::SIGTERM as u8
        }
        Outcome::Failed(f) => {
            tracing::error!(rank = f.rank, exit_code = f.exit_code, "job failed");
            eprintln!("elastic-run: {f}");
            u8::try_from(f.exit_code)
                .ok()
                .filter(|c| *c != 0)
                .unwrap_or(1)
        }
        Outcome::Stopped => 1,
    })
}

/// Standalone when asked, or when one node runs with no rendezvous endpoint (torchrun's rule).
pub fn is_standalone(cli: &Cli) -> bool {
    cli.standalone || (cli.nnodes.max == 1 && cli.rdzv_endpoint.is_empty())
}

/// Generation 0 of a one-node job: world = nproc, master on this host.
pub fn standalone_generation(
    cfg: &ScalingConfig,
    nproc: u32,
    master_port: u16,
    resume: Option<crate::worker_env::ResumePoint>,
) -> Result<GenerationView> {
    let scaling = scaling::decide(cfg, nproc).map_err(|e| UsageError(e.to_string()))?;
    Ok(GenerationView {
        generation: 0,
        world_size: nproc,
        node_rank: 0,
        node_count: 1,
        rank_offset: 0,
        master_addr: "127.0.0.1".into(),
        master_port,
        scaling,
        resume,
    })
}

async fn start_drain(state: &AgentState, cmds: &mpsc::Sender<Command>, grace: Duration) -> Instant {
    let now = Instant::now();
    state.request_stop();
    state
        .metrics
        .drains_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let kill_window = (grace / 4).min(Duration::from_millis(DRAIN_KILL_WINDOW_MAX_MS));
    // Workers that never spoke the protocol cannot hear `should_stop`: they get SIGTERM now,
    // as torchrun would forward it.
    let sigterm_now = !state.client_seen();
    let _ = cmds
        .send(Command::Drain {
            deadline: now + grace.saturating_sub(kill_window),
            sigterm_now,
        })
        .await;
    now
}

async fn hand_over(
    tracker: &mut StepTracker,
    r: Received,
    commits: &mpsc::Sender<(u64, u32, Vec<crate::agent_socket::StagedPart>)>,
) {
    let world = r.world_size;
    if let Some(parts) = tracker.record_received(r.epoch, r.ranks, r.part) {
        let step = parts[0].step;
        tracing::info!(step, ranks = parts.len(), "step staged by every local rank");
        let _ = commits.send((step, world, parts)).await;
    }
}

/// Commits complete steps in order; returns whether every commit succeeded.
async fn commit_loop<S: CheckpointSink>(
    sink: S,
    mut steps: mpsc::Receiver<(u64, u32, Vec<crate::agent_socket::StagedPart>)>,
    state: Arc<AgentState>,
    staging: PathBuf,
) -> bool {
    let mut ok = true;
    while let Some((step, world, parts)) = steps.recv().await {
        let t0 = Instant::now();
        match sink.commit(step, world, parts).await {
            Ok(done) => {
                let point = done.resume;
                tracing::info!(step, dir = %point.dir.display(), bytes = done.bytes, ms = t0.elapsed().as_millis() as u64, "checkpoint committed");
                state.metrics.committed(step, done.bytes, t0.elapsed());
                state.set_resume(point);
                remove_staged_up_to(&staging, step);
            }
            Err(e) => {
                ok = false;
                state
                    .metrics
                    .checkpoint_failures_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::error!(step, error = %e, "checkpoint commit failed");
            }
        }
    }
    ok
}

/// Frees staging space: every `step-N` with N <= `step` is committed or superseded.
fn remove_staged_up_to(staging: &Path, step: u64) {
    let Ok(entries) = std::fs::read_dir(staging) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let n = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok());
        if n.is_some_and(|n| n <= step) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The worker command line, torchrun-style: a `*.py` script (or `--run-path`) runs under
/// `python -u`, `-m` runs a module, `--no-python` and any other program run as given.
pub fn worker_argv(cli: &Cli) -> Result<Vec<String>> {
    let cmd = &cli.cmd;
    let Some(first) = cmd.first() else {
        bail!(UsageError("no training command given".into()))
    };
    let py = |extra: &[&str]| -> Vec<String> {
        let mut v = vec![cli.python.clone(), "-u".to_string()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend(cmd.iter().cloned());
        v
    };
    Ok(if cli.no_python {
        cmd.clone()
    } else if cli.module {
        py(&["-m"])
    } else if cli.run_path || first.ends_with(".py") {
        py(&[])
    } else {
        cmd.clone()
    })
}

fn resolve_nproc(n: NProc) -> Result<u32> {
    let cpus = || {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1)
    };
    let gpus = visible_gpus();
    let n = match n {
        NProc::Count(n) => n,
        NProc::Cpu => cpus(),
        NProc::Auto if gpus > 0 => gpus,
        NProc::Auto => cpus(),
        NProc::Gpu if gpus > 0 => gpus,
        NProc::Gpu => bail!(UsageError("--nproc-per-node gpu: no GPU is visible".into())),
    };
    Ok(n.min(crate::cli::NPROC_PER_NODE_MAX))
}

/// GPUs the workers could use: `CUDA_VISIBLE_DEVICES` when set, else the NVIDIA driver's list.
fn visible_gpus() -> u32 {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .filter(|s| !s.trim().is_empty() && s.trim() != "-1")
            .count() as u32;
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|d| d.count() as u32)
        .unwrap_or(0)
}

fn default_node_id() -> String {
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "node".into());
    format!("{}-{}", host.trim(), std::process::id())
}

fn free_port() -> std::io::Result<u16> {
    // The port is free now; the workers bind it moments later (torchrun does the same).
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

/// The staging directory: `--staging-dir`, else `/dev/shm/elastic-run/<run>/<node>` (the
/// temp dir when there is no /dev/shm). Canonical, since `saved` directories are checked
/// against it. A default one is removed when the agent exits: what is left in it was never
/// committed, and /dev/shm is memory.
struct Staging {
    path: PathBuf,
    owned: bool,
}

impl Staging {
    fn prepare(dir: Option<&Path>, run_id: &str, node_id: &str) -> Result<Self> {
        let (dir, owned) = match dir {
            Some(d) => (d.to_path_buf(), false),
            None => {
                let root = Path::new(crate::cli::STAGING_ROOT_DEFAULT);
                let base = if Path::new("/dev/shm").is_dir() {
                    root.to_path_buf()
                } else {
                    std::env::temp_dir().join("elastic-run")
                };
                (base.join(sanitize(run_id)).join(sanitize(node_id)), true)
            }
        };
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("create staging dir {}", dir.display()))?;
        let path = std::fs::canonicalize(&dir)
            .with_context(|| format!("staging dir {}", dir.display()))?;
        Ok(Staging { path, owned })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_dir_all(&self.path);
            // The per-run and root dirs above it go too once empty (remove_dir refuses
            // non-empty ones, so other agents' dirs are safe).
            let mut dir = self.path.parent();
            for _ in 0..2 {
                let Some(d) = dir else { break };
                if std::fs::remove_dir(d).is_err() {
                    break;
                }
                dir = d.parent();
            }
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_string()
}

/// The agent's private directory (socket, error files), removed when the agent exits.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    /// Prefix of run dirs in the temp dir; the PID follows.
    const PREFIX: &'static str = "elastic-run-";

    fn create() -> Result<Self> {
        Self::remove_stale();
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Short path: a Unix socket path must fit in 108 bytes.
        let path =
            std::env::temp_dir().join(format!("elastic-run-{}-{nanos:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("create {}", path.display()))?;
        Ok(RunDir { path })
    }
}

impl RunDir {
    /// Removes run dirs of agents that are gone (a SIGKILLed agent cannot clean up after
    /// itself). Dirs of live PIDs are kept, so a reused PID errs on the side of keeping.
    fn remove_stale() {
        let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
            return;
        };
        for e in entries.flatten().take(10_000) {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(Self::PREFIX))
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() && e.path().join("agent.sock").exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("elastic-run").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn scripts_run_under_python_and_programs_run_as_given() {
        let argv = |a: &[&str]| worker_argv(&cli(a)).unwrap();
        assert_eq!(
            argv(&["train.py", "--lr", "1"]),
            ["python3", "-u", "train.py", "--lr", "1"]
        );
        assert_eq!(argv(&["--", "python", "train.py"]), ["python", "train.py"]);
        assert_eq!(
            argv(&["-m", "pkg.train", "x"]),
            ["python3", "-u", "-m", "pkg.train", "x"]
        );
        assert_eq!(argv(&["--no-python", "train.py"]), ["train.py"]);
        assert_eq!(
            argv(&["--run-path", "--python", "/v/py", "script"]),
            ["/v/py", "-u", "script"]
        );
    }

    #[test]
    fn standalone_follows_torchrun_rules() {
        assert!(is_standalone(&cli(&["x.py"])));
        assert!(is_standalone(&cli(&["--nnodes", "1", "x.py"])));
        assert!(is_standalone(&cli(&[
            "--standalone",
            "--nnodes",
            "2",
            "x.py"
        ])));
        assert!(!is_standalone(&cli(&["--nnodes", "1:4", "x.py"])));
        assert!(!is_standalone(&cli(&[
            "--nnodes",
            "1",
            "--rdzv-endpoint",
            "h:1",
            "x.py"
        ])));
    }

    #[test]
    fn staged_steps_up_to_the_committed_one_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        for s in ["step-5", "step-10", "step-11", "other"] {
            std::fs::create_dir_all(tmp.path().join(s).join("rank-0")).unwrap();
        }
        remove_staged_up_to(tmp.path(), 10);
        let mut left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["other", "step-11"]);
    }

    #[test]
    fn node_ids_become_safe_path_parts() {
        assert_eq!(sanitize("../a/b c"), "_a_b_c");
        assert_eq!(sanitize("node-1.x"), "node-1.x");
    }
}
