//! The node agent: turns the command line into a worker spec, follows the job's membership,
//! runs one worker group per generation through the supervisor, streams the workers'
//! snapshots to the checkpoint store, and drains on SIGTERM, SIGINT or a preemption notice.
//!
//! # Membership
//!
//! - **Standalone** (`--standalone`, or one node without `--rdzv-endpoint`): one node, world =
//!   nproc, a local master; generation 0 forever.
//! - **Static** (`--rdzv-backend static --nnodes N --node-rank R --master-addr A`): a fixed
//!   set of nodes, torchrun's static rendezvous. Failures restart the local group only.
//! - **etcd v3** (`--rdzv-backend etcd-v3 --rdzv-endpoint H:P --nnodes MIN:MAX`): the
//!   `elastic` crate registers this node and delivers generations; on every new one the agent
//!   stops its workers and starts them with the new ranks, scaling and resume step. It stops
//!   them at once when a newer generation appears that it is not in, when the job is below
//!   `min`, or when its own lease is about to lapse (fenced) — it does not wait for a blocked
//!   collective to time out. After a fence it joins again.
//!
//! # Checkpoints
//!
//! Workers stage snapshots (`saved`); once every local rank staged a step, the committer
//! uploads this node's parts through [`StoreSink`] and commits the step when every rank of the
//! generation is durable, across nodes (each agent races to commit; one manifest wins). In etcd
//! mode the newest committed step is reported to etcd, and each generation names the step all
//! nodes resume from; the agent restores it (resharded for the new world, reusing local bytes)
//! before it starts the workers.
//!
//! # Failures
//!
//! A failed or hung worker group counts against `--max-restarts` unless the failure came with
//! a membership change (a peer died: its collective partners fail too). In etcd mode the node
//! waits one lease TTL plus the settle window for such a change before it counts the failure and
//! asks the leader for a restart generation; all nodes then restart together. Past
//! `--max-restarts` the job fails, for every node.
//!
//! # Signals and drains
//!
//! The first SIGTERM or SIGINT (or a preemption notice) starts a drain of `--preemption-grace`:
//! in etcd mode the node first announces it (peers ask their workers to stop too), then
//! `should_stop` turns true on the worker socket, workers agree on a step, save it and exit 0,
//! the agent commits what they staged, reports the commit and leaves (revoking its lease, so
//! the survivors re-form at once from that step: no step is lost). Workers that never spoke the
//! protocol (unmodified torchrun scripts) get SIGTERM at once instead. At the end of the grace
//! (less a kill window of up to 5 s) the group gets SIGTERM, then SIGKILL. A second signal is
//! forwarded to every worker's process group as is. A notice's Azure event is approved once the
//! node has left; an AWS rebalance recommendation (`--rebalance-action save`) asks for a
//! checkpoint at the next step instead of a drain.
//!
//! Exit codes: 0 when the workers finished (or drained) cleanly and every commit landed; the
//! failed worker's exit code (128 + signal when killed) when restarts ran out; 143 for a drain
//! that had to kill workers or lost a commit; 2 for usage errors; 1 otherwise.

mod config;
mod decide;
mod dirs;
mod drain;
mod membership;
mod pipeline;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use checkpoint::CancellationToken;
use elastic::Generation;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

pub use config::{
    ETCD_PASSWORD_ENV, ETCD_USERNAME_ENV, ETCDCTL_PASSWORD_ENV, ETCDCTL_USER_ENV, Mode,
    RDZV_CONF_CONNECT_KEYS, RDZV_CONF_IGNORED_KEYS, RDZV_CONF_KEYS, UsageError, etcd_connect,
    explain_etcd_error, is_standalone, rendezvous_config, scaling_config, split_endpoints,
    unknown_rdzv_conf_key, worker_argv,
};
use config::{default_node_id, free_port, resolve_nproc, usage};
use decide::{StopWhy, must_stop, restore_is_retryable};
use dirs::{RunDir, Staging, remove_staged};
use drain::{Drain, start_drain};
use membership::{
    EtcdMember, Membership, Next, failure_counts, fenced_metrics, leave, wait_generation,
};
use pipeline::{BETWEEN_GENERATIONS_FLUSH_MS, Committer, flush, tracker_complete};

use crate::agent_socket;
use crate::checkpoint_sink::StepTracker;
use crate::cli::Cli;
use crate::events::Events;
use crate::notice;
use crate::scaling::{self, ScalingConfig};
use crate::state::{AgentState, Received};
use crate::store_sink::{SinkOptions, StepToCommit, StoreSink};
use crate::supervisor::{self, Command, Outcome, SupervisorConfig};
use crate::worker_env::{GenerationView, WorkerSpec};

/// SIGTERM to SIGKILL when the agent stops a worker group outside a drain.
pub const STOP_GRACE_MS: u64 = 5_000;
/// How long the agent waits for queued worker output to be written before it exits.
const OUTPUT_FLUSH_MS: u64 = 5_000;
/// How long pending commits may take after the workers are done, outside a drain.
const FLUSH_TIMEOUT_MS: u64 = 60_000;
/// How often the agent looks for the first step of a new worker group.
const FIRST_STEP_POLL_MS: u64 = 50;
/// Directory under staging where restored steps are laid out.
const RESTORE_DIR: &str = ".restore";
/// Attempts at restoring a generation's resume step before the agent gives up.
const RESTORE_ATTEMPTS_MAX: u32 = 6;
/// Pause after the first failed restore; doubles per attempt up to the max (31 s in all).
const RESTORE_BACKOFF_INITIAL_MS: u64 = 1_000;
const RESTORE_BACKOFF_MAX_MS: u64 = 8_000;

/// Runs the agent to completion and returns the process exit code.
pub async fn run(cli: Cli) -> Result<u8> {
    let mode = Mode::of(&cli)?;
    let nproc = resolve_nproc(cli.nproc_per_node)?;
    let node_id = cli.node_id.clone().unwrap_or_else(default_node_id);
    let run_id = cli.rdzv_id.clone();
    let job = tracing::info_span!("job", run_id = %run_id, node = %node_id);
    run_node(cli, mode, nproc, node_id, run_id)
        .instrument(job)
        .await
}

/// Everything a worker group needs that stays the same for the agent's life.
struct Node {
    pub(super) mode: Mode,
    pub(super) nproc: u32,
    pub(super) node_id: String,
    pub(super) scaling: ScalingConfig,
    pub(super) spec: WorkerSpec,
    pub(super) sup_cfg: SupervisorConfig,
    pub(super) state: Arc<AgentState>,
    pub(super) sink: Arc<StoreSink>,
    pub(super) events: Arc<Events>,
    pub(super) grace: Duration,
    pub(super) max_restarts: u32,
    /// Whether staging's size was held against the first complete checkpoint yet.
    pub(super) staging_checked: std::sync::atomic::AtomicBool,
}

async fn run_node(cli: Cli, mode: Mode, nproc: u32, node_id: String, run_id: String) -> Result<u8> {
    // Everything a user can get wrong is checked before anything is created.
    let scaling_cfg = scaling_config(&cli, nproc);
    scaling_cfg.to_policy().map_err(|e| usage(e.to_string()))?;
    let argv = worker_argv(&cli)?;
    let rdzv_cfg = match mode {
        Mode::Etcd => Some(rendezvous_config(&cli, &node_id, nproc, &scaling_cfg)?),
        _ => None,
    };
    let url = cli
        .checkpoint_url
        .resolved()
        .context("resolve --checkpoint-url")?;
    let store_config = cli.store_options();
    crate::cli::check_store_options(&url, &store_config)
        .map_err(|e| usage(format!("--checkpoint-store-option: {e}")))?;
    let events = Arc::new(
        Events::open(cli.events_file.as_deref(), &node_id)
            .with_context(|| format!("open --events-file {:?}", cli.events_file))?,
    );

    let run_dir = RunDir::create()?;
    // Removes a default staging dir when the agent returns, on every path.
    let staging_guard = Staging::prepare(cli.staging_dir.as_deref(), &run_id, &node_id)?;
    let staging = staging_guard.path.clone();
    let sink_opts = SinkOptions {
        compression: cli.checkpoint_compress,
        store_config,
        keep_steps: cli.checkpoint_keep_last,
        keep_every: cli.checkpoint_keep_every,
        ..SinkOptions::default()
    };
    let sink = StoreSink::open(&url, staging.join(RESTORE_DIR), sink_opts)
        .map_err(|e| usage(format!("--checkpoint-url {url}: {e}")))?;
    let sink = Arc::new(sink);
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
        // The agent restarts groups itself (it must restore, and in etcd mode re-form).
        max_restarts: 0,
        monitor_interval: cli.monitor_interval,
        hang_timeout: cli.hang_timeout,
        startup_timeout: cli.startup_timeout,
        stop_grace: Duration::from_millis(STOP_GRACE_MS),
        omp_num_threads_set: std::env::var_os("OMP_NUM_THREADS").is_some(),
        first_restart: 0,
    };

    // Signals first: a SIGTERM from here on drains instead of killing the agent.
    let mut signals = crate::signals::listen()?;

    let state = Arc::new(AgentState::new(staging.clone()));
    let listener = tokio::net::UnixListener::bind(&socket_path)
        .with_context(|| format!("bind the agent socket {}", socket_path.display()))?;
    let (parts_tx, mut parts_rx) = mpsc::channel::<Received>(nproc.max(1) as usize);
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
    let (notice_tx, mut notices) = mpsc::channel::<notice::Notice>(1);
    let _poller = cli.preemption_notice.clone().map(|n| {
        let mut cfg = notice::Config::new(n, cli.monitor_interval.max(Duration::from_secs(1)));
        cfg.rebalance = cli.rebalance_action;
        cfg.azure_vm_name = cli.azure_vm_name.clone();
        tokio::spawn(notice::poll(cfg, state.clone(), notice_tx))
    });

    let node = Node {
        mode,
        nproc,
        node_id: node_id.clone(),
        scaling: scaling_cfg,
        spec,
        sup_cfg,
        state: state.clone(),
        sink: sink.clone(),
        events: events.clone(),
        grace: cli.preemption_grace,
        max_restarts: cli.max_restarts,
        staging_checked: std::sync::atomic::AtomicBool::new(false),
    };

    let cancel_all = CancellationToken::new();
    let bucket_latest = sink
        .latest_step(&cancel_all)
        .await
        .with_context(|| format!("read the newest committed step at {}", sink.url()))?;
    if let Some(step) = bucket_latest {
        tracing::info!(step, url = %sink.url(), "newest committed step in the checkpoint store");
    }
    let mut membership = match mode {
        Mode::Standalone | Mode::Static => {
            let master_port = match (mode, cli.master_port) {
                (_, Some(p)) => p,
                (Mode::Static, None) => crate::cli::MASTER_PORT_DEFAULT,
                _ => free_port().context("no free port for the master")?,
            };
            let (node_rank, node_count, master_addr) = match mode {
                Mode::Static => (cli.node_rank, cli.nnodes.max, cli.master_addr.clone()),
                _ => (0, 1, "127.0.0.1".to_string()),
            };
            let world = nproc.saturating_mul(node_count);
            let s =
                scaling::decide(&node.scaling, world, None).map_err(|e| usage(e.to_string()))?;
            Membership::Fixed(GenerationView {
                generation: 0,
                world_size: world,
                node_rank,
                node_count,
                rank_offset: node_rank * nproc,
                master_addr,
                master_port,
                scaling: s,
                resume: None,
            })
        }
        Mode::Etcd => {
            let cfg = rdzv_cfg.expect("etcd mode has a rendezvous config");
            let mut m = EtcdMember::join(cfg, &events).await?;
            state
                .metrics
                .has_lease
                .store(true, std::sync::atomic::Ordering::Relaxed);
            fenced_metrics(&state, false);
            m.bucket_latest = bucket_latest;
            if let Some(step) = bucket_latest {
                m.report(step).await;
            }
            Membership::Etcd(Box::new(m))
        }
    };

    let mut committer = Committer::start(&node, bucket_latest);
    let mut tracker = StepTracker::new(0..0);
    let mut drain: Option<Drain> = None;
    // An Azure event to approve once this node's drain is done.
    let mut approval: Option<notice::Approval> = None;
    let mut restarts: u32 = 0;
    let mut last_step_reached: Option<u64> = None;
    // Time-based checkpoints: ask for the step after the newest one reported.
    let mut checkpoint_timer = cli.checkpoint_every.map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });

    let code: u8 = 'job: loop {
        // ---- A: the generation to run next -------------------------------------------------
        let (mut view, running_gen) = match &mut membership {
            Membership::Fixed(v) => {
                let mut v = v.clone();
                v.resume = None;
                (v, None)
            }
            Membership::Etcd(m) => {
                match wait_generation(&node, m, &mut signals, &mut notices, &committer).await? {
                    Next::Run(v, g) => (*v, g),
                    Next::Exit(code) => break 'job code,
                }
            }
        };
        // ---- B: restore the step this generation resumes from -------------------------------
        let resume_step = match &membership {
            Membership::Fixed(_) => committer.latest(),
            Membership::Etcd(m) => running_gen
                .as_ref()
                .and_then(|g| g.resume_step)
                .or(m.bucket_latest),
        };
        remove_staged(&node.spec.staging_dir);
        if let Some(step) = resume_step {
            let ranks = view.rank_offset..view.rank_offset + nproc;
            let t0 = Instant::now();
            // A failure that says nothing about the step (a full staging disk, the store
            // briefly away) is retried with a bounded backoff; one that does was already
            // answered inside by falling back to an older step.
            let mut attempt = 1u32;
            let mut backoff_ms = RESTORE_BACKOFF_INITIAL_MS;
            let point = loop {
                let r = tokio::select! {
                    r = node.sink.restore_or_older(step, ranks.clone(), view.world_size, &cancel_all) => r,
                    Some(sig) = signals.recv() => {
                        tracing::warn!(signal = sig, "signal while restoring; leaving");
                        break 'job leave(&mut membership).await;
                    }
                };
                match r {
                    Ok((point, skipped)) => {
                        if !skipped.is_empty() {
                            node.events.emit(
                                "restore_fell_back",
                                json!({"generation": view.generation, "skipped": skipped, "step": point.step}),
                            );
                        }
                        break point;
                    }
                    Err(e) if restore_is_retryable(&e) && attempt < RESTORE_ATTEMPTS_MAX => {
                        tracing::warn!(step, attempt, backoff_ms, error = %e, "restore failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_millis(backoff_ms)) => {}
                            Some(sig) = signals.recv() => {
                                tracing::warn!(signal = sig, "signal while restoring; leaving");
                                break 'job leave(&mut membership).await;
                            }
                        }
                        attempt += 1;
                        backoff_ms = (backoff_ms * 2).min(RESTORE_BACKOFF_MAX_MS);
                    }
                    Err(e) => {
                        return Err(e).with_context(|| {
                            format!(
                                "restore step {step} from {} ({attempt} attempts)",
                                node.sink.url()
                            )
                        });
                    }
                }
            };
            tracing::info!(step, dir = %point.dir.display(), ms = t0.elapsed().as_millis() as u64, "restored");
            view.resume = Some(point);
        }
        let gen_key = view.generation;
        state
            .metrics
            .generations_total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        emit_generation(&node, &view, running_gen.as_deref(), last_step_reached);

        // ---- C: run one worker group ---------------------------------------------------------
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let mut sup_cfg = node.sup_cfg.clone();
        sup_cfg.first_restart = restarts;
        let mut sup = tokio::spawn(
            supervisor::run(
                sup_cfg,
                node.spec.clone(),
                view.clone(),
                state.clone(),
                cmd_rx,
            )
            .in_current_span(),
        );
        node.events.emit(
            "workers_started",
            json!({"generation": view.generation, "restart_count": restarts}),
        );
        let mut first_step_seen = false;
        let mut first_step_poll = tokio::time::interval(Duration::from_millis(FIRST_STEP_POLL_MS));
        let mut stop_why: Option<StopWhy> = None;
        let mut committed_rx = committer.committed.clone();
        let mut snap_rx = match &membership {
            Membership::Etcd(m) => Some(m.snap.clone()),
            Membership::Fixed(_) => None,
        };
        if let Some(rx) = snap_rx.as_mut() {
            rx.mark_changed();
        }
        // A complete step waiting for room in the commit queue.
        let mut held: Option<StepToCommit> = None;
        let outcome = loop {
            tokio::select! {
                out = &mut sup => break out.context("supervisor task")?,
                Some(sig) = signals.recv() => {
                    if drain.is_none_or(|d| !d.local) {
                        tracing::warn!(signal = sig, "signal received; draining");
                        node.events.emit("drain_started", json!({"reason": "signal"}));
                        drain = Some(start_drain(&node, &membership, &cmd_tx, true).await);
                    } else {
                        tracing::warn!(signal = sig, "second signal; forwarding it to the workers");
                        let _ = cmd_tx.send(Command::Signal(sig)).await;
                    }
                }
                Some(n) = notices.recv() => match n {
                    notice::Notice::Preempt { why, approval: a } => {
                        approval = a.or(approval.take());
                        if drain.is_none_or(|d| !d.local) {
                            tracing::warn!(notice = %why, "preemption notice; draining");
                            node.events.emit("drain_started", json!({"reason": "notice"}));
                            drain = Some(start_drain(&node, &membership, &cmd_tx, true).await);
                        }
                    }
                    notice::Notice::Rebalance { why } => match state.last_step() {
                        // As the checkpoint timer does: the step after the newest one reported.
                        Some(step) if drain.is_none() => {
                            tracing::warn!(notice = %why, at_step = step + 1, "rebalance recommendation; checkpointing now");
                            state.request_checkpoint_at(step + 1);
                        }
                        _ => tracing::warn!(notice = %why, "rebalance recommendation; no checkpoint asked (no step reported yet, or draining)"),
                    },
                },
                // Handing over never blocks this loop (signals must stay responsive): a step
                // that finds the commit queue full is held until room frees up, and no more
                // parts are taken meanwhile, so they wait in their channel and, once that is
                // full, workers wait for their `saved` reply.
                Some(r) = parts_rx.recv(), if held.is_none() => {
                    if let Some(step) = tracker_complete(&node, &view, &mut tracker, r) {
                        held = committer.try_submit(step).err();
                    }
                }
                Ok(permit) = committer.tx.clone().reserve_owned(), if held.is_some() => {
                    if let Some(step) = held.take() {
                        committer.submit_with(permit, step);
                    }
                }
                _ = async { checkpoint_timer.as_mut().expect("guarded").tick().await }, if checkpoint_timer.is_some() => {
                    if let Some(step) = state.last_step() {
                        tracing::info!(at_step = step + 1, "time-based checkpoint requested");
                        state.request_checkpoint_at(step + 1);
                    }
                }
                _ = first_step_poll.tick(), if !first_step_seen => {
                    if let Some(step) = state.last_step() {
                        first_step_seen = true;
                        tracing::info!(step, "first step of the generation");
                        node.events.emit("first_step", json!({"generation": view.generation, "step": step}));
                    }
                }
                Ok(()) = committed_rx.changed(), if matches!(membership, Membership::Etcd(_)) => {
                    let latest = committer.latest();
                    if let (Membership::Etcd(m), Some(step)) = (&mut membership, latest) {
                        m.report(step).await;
                    }
                }
                Ok(()) = async { snap_rx.as_mut().expect("guarded").changed().await }, if snap_rx.is_some() && stop_why.is_none() => {
                    let snap = snap_rx.as_mut().expect("guarded").borrow_and_update().clone();
                    let Some(g) = running_gen.as_ref() else { continue };
                    if drain.is_some() {
                        // The workers are saving the agreed step and exit on their own (or at
                        // the drain deadline): let them finish the save.
                        continue;
                    }
                    if let Some(why) = must_stop(&snap, g) {
                        tracing::warn!(?why, "stopping the workers");
                        stop_why = Some(why);
                        let _ = cmd_tx.send(Command::Stop).await;
                    } else if drain.is_none() {
                        let peer_draining = snap.draining.iter().any(|n| *n != node.node_id && g.member(n).is_some());
                        if peer_draining {
                            tracing::warn!(draining = ?snap.draining, "a peer is draining; saving and stopping with it");
                            node.events.emit("drain_started", json!({"reason": "peer"}));
                            drain = Some(start_drain(&node, &membership, &cmd_tx, false).await);
                        }
                    }
                }
                e = async {
                    match &membership {
                        Membership::Etcd(m) if m.handle.is_some() => {
                            m.handle.as_ref().expect("checked").fenced().await
                        }
                        _ => std::future::pending().await,
                    }
                }, if stop_why.is_none() => {
                    tracing::error!(error = %e, "fenced: stopping the workers before peers re-form the job");
                    node.events.emit("fenced", json!({"reason": e.to_string()}));
                    fenced_metrics(&node.state, true);
                    stop_why = Some(StopWhy::Fenced);
                    let _ = cmd_tx.send(Command::Stop).await;
                }
            }
        };
        drop(cmd_tx);
        last_step_reached = state.last_step().or(last_step_reached);
        // Parts reported just before the workers exited are already queued: hand them over,
        // waiting for queue room as long as this ending allows (a drain's last checkpoint is
        // the one that matters most).
        let handover_limit = match (&drain, &outcome) {
            (Some(d), _) if d.local => node.grace.saturating_sub(d.started.elapsed()),
            (_, Outcome::Succeeded) => Duration::from_millis(FLUSH_TIMEOUT_MS),
            _ => Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
        };
        let handover_deadline = Instant::now() + handover_limit;
        if let Some(step) = held.take() {
            committer.submit_until(step, handover_deadline).await;
        }
        while let Ok(r) = parts_rx.try_recv() {
            if let Some(step) = tracker_complete(&node, &view, &mut tracker, r) {
                committer.submit_until(step, handover_deadline).await;
            }
        }

        // ---- D: what now -----------------------------------------------------------------------
        // A local drain ends the node however the workers ended: commit what they staged, say
        // so, leave.
        if let Some(d) = drain.filter(|d| d.local) {
            let clean = matches!(
                outcome,
                Outcome::Succeeded | Outcome::Drained { clean: true }
            );
            if let Outcome::Failed(f) = &outcome {
                tracing::warn!(
                    rank = f.rank,
                    exit_code = f.exit_code,
                    "a worker failed while draining"
                );
            }
            let flushed = flush(
                &mut committer,
                node.grace.saturating_sub(d.started.elapsed()),
            )
            .await;
            if let Membership::Etcd(m) = &mut membership
                && let Some(step) = committer.latest()
            {
                m.report(step).await;
            }
            let step = committer.latest();
            let _ = leave(&mut membership).await;
            // Committed (or out of grace) and gone from the job: the machine may go now.
            if let Some(a) = approval.take() {
                notice::approve(&a, &state.metrics).await;
            }
            if clean && flushed {
                tracing::info!(step, "drained: workers saved and exited");
                break 'job 0;
            }
            tracing::error!(
                workers_clean = clean,
                checkpoints_flushed = flushed,
                "drain incomplete"
            );
            break 'job 128 + libc::SIGTERM as u8;
        }
        match outcome {
            Outcome::Succeeded
                if drain.is_none()
                    && (state.peer_stop().is_none()
                        || matches!(membership, Membership::Fixed(_))) =>
            {
                tracing::info!("workers finished");
                let flushed = flush(&mut committer, Duration::from_millis(FLUSH_TIMEOUT_MS)).await;
                if let Membership::Etcd(m) = &mut membership {
                    if let Some(step) = committer.latest() {
                        m.report(step).await;
                    }
                    if let Some(h) = &m.handle
                        && let Err(e) = h.finish(true).await
                    {
                        tracing::warn!(error = %e, "cannot mark the job finished");
                    }
                }
                let _ = leave(&mut membership).await;
                break 'job if flushed { 0 } else { 1 };
            }
            Outcome::Succeeded | Outcome::Drained { .. }
                if drain.is_some() || state.peer_stop().is_some() =>
            {
                // A peer's drain: our workers saved the agreed step too; commit it and wait
                // for the generation without the peer. The workers may be the first to know
                // (they agree on stopping among themselves while etcd is unreachable).
                if drain.is_none() {
                    tracing::warn!(
                        step = state.peer_stop(),
                        "workers stopped for a drain of another node that this one did not hear of; waiting for the next generation"
                    );
                }
                let clean = matches!(
                    outcome,
                    Outcome::Succeeded | Outcome::Drained { clean: true }
                );
                let _ = flush(&mut committer, node.grace).await;
                if let Membership::Etcd(m) = &mut membership
                    && let Some(step) = committer.latest()
                {
                    m.report(step).await;
                }
                tracing::info!(
                    step = committer.latest(),
                    clean,
                    "peer drain done; waiting for the next generation"
                );
                drain = None;
                continue 'job;
            }
            Outcome::Succeeded | Outcome::Drained { .. } => {
                tracing::error!("workers drained without a drain");
                let _ = leave(&mut membership).await;
                break 'job 1;
            }
            Outcome::Stopped => {
                drain = None;
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if stop_why == Some(StopWhy::Fenced)
                    && let Membership::Etcd(m) = &mut membership
                {
                    if let Some(h) = m.handle.take() {
                        drop(h);
                    }
                    m.rejoin(&node.events).await?;
                    fenced_metrics(&node.state, false);
                }
                continue 'job;
            }
            Outcome::Failed(f) => {
                node.events.emit(
                    "worker_failed",
                    json!({"generation": view.generation, "rank": f.rank, "exit_code": f.exit_code}),
                );
                if drain.is_some() {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "a worker failed during a peer's drain"
                    );
                    let _ = flush(&mut committer, node.grace).await;
                    drain = None;
                    continue 'job;
                }
                let counted = match &mut membership {
                    Membership::Fixed(_) => true,
                    Membership::Etcd(m) => {
                        let g = running_gen.clone().expect("etcd generations");
                        failure_counts(m, &g, &mut signals).await
                    }
                };
                if !counted {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "worker failed with a membership change; not counted as a restart"
                    );
                    committer
                        .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                        .await;
                    continue 'job;
                }
                if restarts >= node.max_restarts {
                    tracing::error!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        restarts,
                        "job failed"
                    );
                    eprintln!("elastic-run: {f}");
                    let _ = flush(
                        &mut committer,
                        Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
                    )
                    .await;
                    if let Membership::Etcd(m) = &mut membership
                        && let Some(h) = &m.handle
                        && let Err(e) = h.finish(false).await
                    {
                        tracing::warn!(error = %e, "cannot mark the job failed");
                    }
                    let _ = leave(&mut membership).await;
                    break 'job u8::try_from(f.exit_code)
                        .ok()
                        .filter(|c| *c != 0)
                        .unwrap_or(1);
                }
                restarts += 1;
                supervisor::note_restart(&state, &f, restarts, node.max_restarts);
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if let Membership::Etcd(m) = &mut membership
                    && let Some(h) = &m.handle
                    && let Err(e) = h.request_restart(gen_key, &f.to_string()).await
                {
                    tracing::warn!(error = %e, "cannot request a restart generation");
                }
                continue 'job;
            }
        }
    };

    node.events.emit("exit", json!({"code": code}));
    let _ = committer
        .finish(Duration::from_millis(OUTPUT_FLUSH_MS))
        .await;
    let _ = shutdown_tx.send(true);
    let _ = server.await;
    crate::output::flush(Duration::from_millis(OUTPUT_FLUSH_MS)).await;
    if let Some(m) = metrics_server {
        let _ = m.await;
    }
    drop(run_dir);
    drop(staging_guard);
    Ok(code)
}

/// `prev_last_step`: the highest step this node's workers reported before this generation
/// (what a fault cost is that minus the resume step).
fn emit_generation(
    node: &Node,
    view: &GenerationView,
    g: Option<&Generation>,
    prev_last_step: Option<u64>,
) {
    let s = &view.scaling;
    tracing::info!(
        generation = view.generation,
        world_size = view.world_size,
        node_rank = view.node_rank,
        lr_scale = s.lr_scale,
        grad_accum_steps = s.grad_accum_steps,
        resume_step = view.resume.as_ref().map(|r| r.step),
        "generation"
    );
    if !s.note.is_empty() {
        tracing::warn!(note = %s.note, "scaling adjusted");
    }
    let members = g
        .map(|g| g.node_ids())
        .unwrap_or_else(|| vec![node.node_id.clone()]);
    node.events.emit(
        "generation",
        json!({
            "generation": view.generation,
            "world_size": view.world_size,
            "node_rank": view.node_rank,
            "rank_offset": view.rank_offset,
            "members": members,
            "lr_scale": s.lr_scale,
            "lr": s.lr,
            "batch_size": s.batch_size,
            "global_batch": s.global_batch,
            "grad_accum_steps": s.grad_accum_steps,
            "resume_step": view.resume.as_ref().map(|r| r.step),
            "prev_last_step": prev_last_step,
        }),
    );
}
