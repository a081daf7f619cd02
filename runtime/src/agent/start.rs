//! Starting the agent: every check a user can fail comes before anything is created; then the
//! run and staging directories, the store, the worker socket, the metrics server, the notice
//! poller, the rendezvous this node serves (`--rdzv-backend c10d`, on the endpoint's host), and
//! the node's first membership.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use checkpoint::CancellationToken;
use tokio::sync::{mpsc, watch};

use super::committer::{CommitPoint, Committer};
use super::config::{
    Mode, c10d_config, free_port, rendezvous_config, scaling_config, usage, worker_argv,
};
use super::dirs::{RunDir, Staging};
use super::membership::{EtcdMember, Membership, fenced_metrics};
use super::{Agent, Node, RESTORE_DIR, STOP_GRACE_MS, Services};
use crate::agent_socket;
use crate::cli::Cli;
use crate::events::Events;
use crate::notice;
use crate::pipeline::StepTracker;
use crate::pipeline::{SinkOptions, StoreSink};
use crate::state::{AgentState, Received};
use crate::supervisor::{Launcher, SupervisorConfig};
use crate::worker_env::{GenerationView, WorkerSpec};

/// Checks the configuration, creates what the agent runs with, and joins the job.
pub(super) async fn start(
    cli: Cli,
    mode: Mode,
    nproc: u32,
    node_id: String,
    run_id: String,
) -> Result<(Agent, Services)> {
    // Everything a user can get wrong is checked before anything is created.
    let scaling_cfg = scaling_config(&cli, nproc);
    scaling_cfg.validate().map_err(|e| usage(e.to_string()))?;
    let argv = worker_argv(&cli)?;
    // torchrun's launcher flags: where workers' output goes, and how long they get to stop.
    let launcher = Arc::new(Launcher::from_cli(&cli, &run_id).map_err(usage)?);
    let env_grace = std::env::var(crate::supervisor::SHUTDOWN_TIMEOUT_ENV).ok();
    let stop_grace = crate::supervisor::stop_grace(
        cli.shutdown_timeout,
        env_grace.as_deref(),
        Duration::from_millis(STOP_GRACE_MS),
    )
    .map_err(usage)?;
    let rdzv_cfg = match mode {
        Mode::Etcd { .. } => Some(rendezvous_config(&cli, &node_id, nproc, &scaling_cfg)?),
        _ => None,
    };
    let c10d = match mode {
        Mode::Etcd { serve: true } => Some(c10d_config(&cli)?),
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
        read: checkpoint::ReadOptions {
            no_copy: cli.restore_no_copy,
            ..Default::default()
        },
        ..SinkOptions::default()
    };
    let sink = StoreSink::open(&url, staging.join(RESTORE_DIR), sink_opts)
        .map_err(|e| usage(format!("--checkpoint-url {url}: {e}")))?;
    if cli.restore_no_copy && sink.store().local_root().is_none() {
        tracing::warn!(
            url = %sink.url(),
            "--restore-no-copy reads only a file:// store where its chunks lie: restores from this store copy into staging"
        );
    }
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
    let standbys = if cli.warm_standby {
        match crate::standby::Plan::for_argv(&argv, &cli.python) {
            Ok(plan) => Some(Arc::new(crate::standby::Standbys::new(plan))),
            Err(why) => {
                tracing::warn!("--warm-standby is off for this command: {why}");
                None
            }
        }
    } else {
        None
    };
    let sup_cfg = SupervisorConfig {
        argv,
        monitor_interval: cli.monitor_interval,
        hang_timeout: cli.hang_timeout,
        startup_timeout: cli.startup_timeout,
        stop_grace,
        omp_num_threads_set: std::env::var_os("OMP_NUM_THREADS").is_some(),
        standbys,
    };

    // Signals first: a SIGTERM from here on drains instead of killing the agent.
    let signals = crate::signals::listen_to(&cli.signals_to_handle.numbers)?;

    let state = Arc::new(AgentState::new(staging.clone()));
    let listener = tokio::net::UnixListener::bind(&socket_path)
        .with_context(|| format!("bind the agent socket {}", socket_path.display()))?;
    let (parts_tx, parts_rx) = mpsc::channel::<Received>(nproc.max(1) as usize);
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
    let (notice_tx, notices) = mpsc::channel::<notice::Notice>(1);
    // Stops the agent's background tasks when it exits.
    let stop_tasks = CancellationToken::new();
    let poller = cli.preemption_notice.clone().map(|n| {
        let mut cfg = notice::Config::new(n, cli.monitor_interval.max(Duration::from_secs(1)));
        cfg.rebalance = cli.rebalance_action;
        cfg.azure_vm_name = cli.azure_vm_name.clone();
        tokio::spawn(notice::poll(
            cfg,
            state.clone(),
            notice_tx,
            stop_tasks.clone(),
        ))
    });

    let node = Node {
        mode,
        nproc,
        node_id: node_id.clone(),
        scaling: scaling_cfg,
        spec,
        sup_cfg,
        launcher,
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
    // c10d: the rendezvous answers at the endpoint before anyone joins it, served from here
    // when this is its host. Forked from this (the main) thread, so it dies with the agent.
    let rdzv_host = match (&c10d, &rdzv_cfg) {
        (Some(c), Some(cfg)) => {
            super::rdzv_host::prepare(c, &cfg.connect, &cfg.job_id, &run_dir, &cli.python, &events)
                .await?
        }
        _ => None,
    };
    let membership = match mode {
        Mode::Standalone | Mode::Static => {
            // Static with an endpoint: torchrun's master is the endpoint.
            let endpoint = match mode {
                Mode::Static => super::config::static_master(&cli)?,
                _ => None,
            };
            let master_port = match (mode, endpoint.as_ref(), cli.master_port) {
                (_, Some((_, p)), _) => *p,
                (_, None, Some(p)) => p,
                (Mode::Static, None, None) => crate::cli::MASTER_PORT_DEFAULT,
                _ => free_port().context("no free port for the master")?,
            };
            let (node_rank, node_count, master_addr) = match (mode, endpoint) {
                (Mode::Static, Some((host, _))) => (cli.node_rank, cli.nnodes.max, host),
                (Mode::Static, None) => (cli.node_rank, cli.nnodes.max, cli.master_addr.clone()),
                _ => (0, 1, "127.0.0.1".to_string()),
            };
            let world = nproc.saturating_mul(node_count);
            let s = node
                .scaling
                .decide(u64::from(world), None)
                .map_err(|e| usage(e.to_string()))?;
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
                heal_step: None,
            })
        }
        Mode::Etcd { .. } => {
            let cfg = rdzv_cfg.expect("etcd mode has a rendezvous config");
            let mut m = EtcdMember::join(cfg, &events).await?;
            state
                .metrics
                .has_lease
                .store(true, std::sync::atomic::Ordering::Relaxed);
            fenced_metrics(&state, false);
            m.bucket_latest = bucket_latest;
            if let Some(step) = bucket_latest {
                m.report(CommitPoint {
                    step,
                    generation: None,
                })
                .await;
            }
            Membership::Etcd(Box::new(m))
        }
    };

    let committer = Committer::start(&node, bucket_latest);
    let tracker = StepTracker::new(0..0);
    // An Azure event to approve once this node's drain is done.
    let approval: Option<notice::Approval> = None;
    let restarts: u32 = 0;
    let last_step_reached: Option<u64> = None;
    // Time-based checkpoints: ask for the step after the newest one reported.
    let checkpoint_timer = cli.checkpoint_every.map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });

    let agent = Agent {
        node,
        membership,
        committer,
        tracker,
        drain: None,
        approval,
        restarts,
        last_step_reached,
        last_group_healed: false,
        checkpoint_timer,
        signals,
        notices,
        parts: parts_rx,
        cancel: cancel_all,
    };
    let services = Services {
        shutdown: shutdown_tx,
        stop_tasks,
        server,
        metrics_server,
        poller,
        rdzv_host,
        run_dir,
        staging: staging_guard,
    };
    Ok((agent, services))
}
