//! The node agent: turns the command line into a worker spec, follows the job's membership,
//! runs one worker group per generation through the supervisor, streams the workers'
//! snapshots to the checkpoint store, and drains on a handled signal (`--signals-to-handle`:
//! SIGTERM, SIGINT, ...) or a preemption notice.
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
//! # Recovery in place
//!
//! When every local worker watches for generations (the client's `InPlace` holds a `watch`
//! request on the socket), a new generation that includes this node is offered to the running
//! workers instead of stopping them (`group.rs`): they leave their process group for the new
//! one, say `switched`, and train on from memory; no restore, no new process. Once all have
//! switched, the node runs the new generation (events: `generation` with `in_place`). Workers
//! that do not switch within `IN_PLACE_SWITCH_MS` are stopped and started into it as before.
//! A worker whose collective failed says so (`collective_failed`): the agent asks etcd to
//! regroup the generation at once, and the leader re-forms it with the members that confirm
//! within the confirmation window, without waiting for a lost node's lease.
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
//! The first handled signal (SIGTERM, SIGINT, any of `--signals-to-handle`) or a preemption
//! notice starts a drain of `--preemption-grace`:
//! in etcd mode the node first announces it (peers ask their workers to stop too), then
//! `should_stop` turns true on the worker socket, workers agree on a step, save it and exit 0,
//! the agent commits what they staged, reports the commit and leaves (revoking its lease, so
//! the survivors re-form at once from that step: no step is lost). It leaves as soon as that
//! step is committed, when every local worker said its save was the last (`saved` with
//! `last`), without waiting for the workers' teardown (process group, interpreter exit).
//! Workers that never spoke the protocol (unmodified torchrun scripts) get SIGTERM at once
//! instead. At the end of the grace (less a kill window of up to 5 s) the group gets SIGTERM,
//! then SIGKILL. A second signal is forwarded to every worker's process group as is. A
//! notice's Azure event is approved once the node has left; an AWS rebalance recommendation
//! (`--rebalance-action save`) asks for a checkpoint at the next step instead of a drain.
//!
//! Exit codes: 0 when the workers finished (or drained) cleanly and every commit landed; the
//! failed worker's exit code (128 + signal when killed) when restarts ran out; 143 for a drain
//! that had to kill workers or lost a commit; 2 for usage errors; 1 otherwise.

mod after;
mod committer;
mod config;
pub mod decide;
mod dirs;
mod drain;
mod group;
mod membership;
mod rdzv_endpoint;
mod rdzv_host;
mod restore;
mod start;

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use checkpoint::CancellationToken;
use elastic::Generation;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

pub use committer::COMMIT_PIPELINE_CHECKPOINTS;
use committer::Committer;
pub use config::{
    ETCD_PASSWORD_ENV, ETCD_USERNAME_ENV, ETCDCTL_PASSWORD_ENV, ETCDCTL_USER_ENV, Mode,
    RDZV_CONF_CONNECT_KEYS, RDZV_CONF_IGNORED_KEYS, RDZV_CONF_KEYS, UsageError, etcd_connect,
    explain_etcd_error, is_standalone, rendezvous_config, scaling_config, split_endpoints,
    unknown_rdzv_conf_key, worker_argv,
};
use config::{default_node_id, resolve_nproc};
use dirs::{RunDir, Staging, remove_staged};
use drain::Drain;
use membership::{Membership, Next, leave, wait_generation};

use crate::cli::Cli;
use crate::events::{Event, Events};
use crate::notice;
use crate::pipeline::StepTracker;
use crate::pipeline::StoreSink;
use crate::state::{AgentState, Received};
use crate::supervisor::{Launcher, SupervisorConfig};
use crate::worker_env::{GenerationView, WorkerSpec};

/// SIGTERM to SIGKILL when the agent stops a worker group outside a drain, unless
/// `--shutdown-timeout` or `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` says (torchrun's default is 30 s;
/// here a fast recovery matters more).
pub const STOP_GRACE_MS: u64 = 5_000;
/// How long the agent waits for queued worker output to be written before it exits.
const OUTPUT_FLUSH_MS: u64 = 5_000;
/// How long pending commits may take after the workers are done, outside a drain.
const FLUSH_TIMEOUT_MS: u64 = 60_000;
/// Directory under staging where restored steps are laid out.
const RESTORE_DIR: &str = ".restore";
/// How long a node whose resume step no longer restores, while etcd records a newer commit,
/// waits for the generation that resumes from that commit before it gives up.
const SUPERSEDED_WAIT_MS: u64 = 10_000;

/// What restoring a generation's resume step ended in.
enum Resumed {
    /// Restored (or nothing to restore): run the generation.
    Run(Box<GenerationView>),
    /// The node leaves with this exit code (a signal came meanwhile).
    Exit(u8),
    /// The step is gone and a newer generation is frozen: go to it.
    Superseded,
}

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

/// The agent's phases: start, run generations until one ends the node, shut down.
async fn run_node(cli: Cli, mode: Mode, nproc: u32, node_id: String, run_id: String) -> Result<u8> {
    let (mut agent, services) = start::start(cli, mode, nproc, node_id, run_id).await?;
    let code = agent.run().await?;
    agent.node.events.emit(Event::Exit { code });
    services.stop(agent.committer).await;
    Ok(code)
}

/// Everything a worker group needs that stays the same for the agent's life.
struct Node {
    mode: Mode,
    nproc: u32,
    node_id: String,
    scaling: elastic::ScalingConfig,
    spec: WorkerSpec,
    sup_cfg: SupervisorConfig,
    /// Where the workers' output goes (`--redirects`, `--tee`, `--log-dir`, ...).
    launcher: Arc<Launcher>,
    state: Arc<AgentState>,
    sink: Arc<StoreSink>,
    events: Arc<Events>,
    grace: Duration,
    max_restarts: u32,
    /// Whether staging's size was held against the first complete checkpoint yet.
    staging_checked: std::sync::atomic::AtomicBool,
}

/// The agent while it runs: the node, its membership, the commit pipeline, what it hears
/// (signals, notices, staged parts), and what carries from one worker group to the next.
struct Agent {
    node: Node,
    membership: Membership,
    committer: Committer,
    tracker: StepTracker,
    drain: Option<Drain>,
    /// An Azure event to approve once this node's drain is done.
    approval: Option<notice::Approval>,
    /// Failures counted against `--max-restarts`.
    restarts: u32,
    /// The highest step this node's workers reported, over all groups so far.
    last_step_reached: Option<u64>,
    /// This node's last worker group started without a restore, to heal from its peers.
    last_group_healed: bool,
    /// Time-based checkpoints: ask for the step after the newest one reported.
    checkpoint_timer: Option<tokio::time::Interval>,
    signals: mpsc::Receiver<i32>,
    notices: mpsc::Receiver<notice::Notice>,
    parts: mpsc::Receiver<Received>,
    cancel: CancellationToken,
}

/// What the agent serves while it runs, stopped after the last generation.
struct Services {
    shutdown: watch::Sender<bool>,
    /// Cancels the notice poller (a GCP wait may hang for a minute).
    stop_tasks: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    metrics_server: Option<tokio::task::JoinHandle<()>>,
    poller: Option<tokio::task::JoinHandle<()>>,
    /// The etcd this agent serves (`--rdzv-backend c10d`); before `run_dir`, which holds its
    /// data, so that it goes first when dropped too.
    rdzv_host: Option<rdzv_host::RdzvHost>,
    run_dir: RunDir,
    staging: Staging,
}

impl Services {
    /// Lets the committer finish, stops the servers, writes the workers' last output, and
    /// removes the run and staging directories.
    async fn stop(self, committer: Committer) {
        let _ = committer
            .finish(Duration::from_millis(OUTPUT_FLUSH_MS))
            .await;
        let _ = self.shutdown.send(true);
        let _ = self.server.await;
        crate::output::flush(Duration::from_millis(OUTPUT_FLUSH_MS)).await;
        if let Some(m) = self.metrics_server {
            let _ = m.await;
        }
        self.stop_tasks.cancel();
        if let Some(p) = self.poller {
            let _ = tokio::time::timeout(Duration::from_millis(OUTPUT_FLUSH_MS), p).await;
        }
        if let Some(h) = self.rdzv_host {
            h.stop().await;
        }
        drop(self.run_dir);
        drop(self.staging);
    }
}

impl Agent {
    /// One generation after another: wait for it, restore its resume step, run its worker
    /// group, decide what the ending means. Returns the exit code.
    async fn run(&mut self) -> Result<u8> {
        loop {
            let (view, generation) = match self.next_generation().await? {
                Next::Run(v, g) => (*v, g),
                Next::Exit(code) => return Ok(code),
            };
            let span = tracing::info_span!("generation", generation = view.generation);
            let flow = async {
                let view = match self.resume(view, generation.as_deref()).await? {
                    Resumed::Run(v) => *v,
                    Resumed::Exit(code) => return Ok(ControlFlow::Break(code)),
                    Resumed::Superseded => return Ok(ControlFlow::Continue(())),
                };
                emit_generation(
                    &self.node,
                    &view,
                    generation.as_deref(),
                    self.last_step_reached,
                    false,
                );
                let ended = self.run_group(&view, generation.as_ref()).await?;
                // The generation the group ended in: a later one when it switched in place.
                let (view, generation) = (ended.view.clone(), ended.generation.clone());
                self.after_group(ended, &view, generation.as_ref()).await
            }
            .instrument(span)
            .await?;
            if let ControlFlow::Break(code) = flow {
                return Ok(code);
            }
        }
    }

    /// The generation to run next: the fixed one, or the next that etcd freezes with this
    /// node in it.
    async fn next_generation(&mut self) -> Result<Next> {
        match &mut self.membership {
            Membership::Fixed(v) => {
                let mut v = v.clone();
                v.resume = None;
                Ok(Next::Run(Box::new(v), None))
            }
            Membership::Etcd(m) => {
                wait_generation(
                    &self.node,
                    m,
                    &mut self.signals,
                    &mut self.notices,
                    &self.committer,
                )
                .await
            }
        }
    }

    /// Restores the step `view`'s generation resumes from (resharded for its world), falling
    /// back past steps that do not verify and retrying trouble that may pass. Ends with the
    /// exit code when a signal comes meanwhile (the node leaves), and moves on when the step
    /// is gone because a newer generation superseded this one.
    async fn resume(
        &mut self,
        mut view: GenerationView,
        generation: Option<&Generation>,
    ) -> Result<Resumed> {
        let node = &self.node;
        let resume_step = match &self.membership {
            Membership::Fixed(_) => self.committer.latest(),
            Membership::Etcd(m) => generation.and_then(|g| g.resume_step).or(m.bucket_latest),
        };
        remove_staged(&node.spec.staging_dir);
        let heal = match &self.membership {
            // Whether the workers of this node's last group switched in place (until the next
            // group begins, the state remembers who watched), or were to heal from peers (they
            // may have failed before they could watch).
            Membership::Etcd(_) => restore::heal_step(
                generation,
                &node.node_id,
                resume_step,
                node.state.watching_any() || self.last_group_healed,
            ),
            Membership::Fixed(_) => None,
        };
        let ranks = view.rank_offset..view.rank_offset + node.nproc;
        node.state.set_on_demand_restore(None);
        self.last_group_healed = heal.is_some();
        if let Some(step) = heal {
            // The members that continue from the generation before hold the state in memory:
            // the workers take it from them over the new group, and the store is read only
            // if they ask (no live rank holds the step).
            tracing::info!(
                step,
                "joining members that continue from memory; the workers take the state from them"
            );
            view.heal_step = Some(step);
            node.state
                .set_on_demand_restore(Some(Arc::new(restore::HealFromPeers {
                    step,
                    generation: view.generation,
                    ranks,
                    world_size: view.world_size,
                    sink: node.sink.clone(),
                    events: node.events.clone(),
                    state: Arc::downgrade(&node.state),
                    cancel: self.cancel.child_token(),
                    outcome: Default::default(),
                })));
        } else if let Some(step) = resume_step {
            // With --warm-standby, the workers' interpreters start and import while the step
            // restores: the group's first start after a restore is warm too.
            let started = crate::standby::fill_standbys(
                &node.sup_cfg,
                &node.spec,
                &view,
                self.restarts,
                &node.launcher,
            );
            if started > 0 {
                tracing::info!(
                    step,
                    started,
                    "warm standbys start while the resume step restores"
                );
            }
            let t0 = Instant::now();
            let r = tokio::select! {
                r = restore::restore_retrying(&node.sink, step, ranks, view.world_size, &self.cancel) => r,
                Some(sig) = self.signals.recv() => {
                    tracing::warn!(signal = sig, "signal while restoring; leaving");
                    return Ok(Resumed::Exit(leave(&mut self.membership).await));
                }
            };
            let point = match r {
                Ok((point, skipped)) => {
                    restore::note_restored(
                        &node.events,
                        Some(&node.state.metrics),
                        view.generation,
                        skipped,
                        &point,
                    );
                    point
                }
                Err((e, attempt)) => {
                    // Retention removed the step after newer commits of the previous
                    // generation; the leader re-forms this generation to resume from them.
                    if let Membership::Etcd(m) = &self.membership
                        && m.superseded(view.generation, step, SUPERSEDED_WAIT_MS)
                            .await
                    {
                        tracing::warn!(step, error = %e, "the resume step does not restore and a newer generation is frozen; moving to it");
                        return Ok(Resumed::Superseded);
                    }
                    return Err(e).with_context(|| {
                        format!(
                            "restore step {step} from {} ({attempt} attempts)",
                            node.sink.url()
                        )
                    });
                }
            };
            tracing::info!(step, dir = %point.dir.display(), bytes = point.bytes_from_store, ms = t0.elapsed().as_millis() as u64, "restored");
            view.resume = Some(point);
        }
        node.state
            .metrics
            .generations_total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Resumed::Run(Box::new(view)))
    }
}

/// `prev_last_step`: the highest step this node's workers reported before this generation
/// (what a fault cost is that minus the resume step).
fn emit_generation(
    node: &Node,
    view: &GenerationView,
    g: Option<&Generation>,
    prev_last_step: Option<u64>,
    in_place: bool,
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
    node.events.emit(Event::Generation {
        generation: view.generation,
        world_size: view.world_size,
        node_rank: view.node_rank,
        rank_offset: view.rank_offset,
        members,
        lr_scale: s.lr_scale,
        lr: s.lr,
        batch_size: s.per_worker_batch,
        global_batch: s.global_batch,
        grad_accum_steps: s.grad_accum_steps,
        resume_step: view.resume.as_ref().map(|r| r.step),
        // In place, `resume` is the step the workers reached: nothing was restored.
        restored_bytes: view
            .resume
            .as_ref()
            .filter(|_| !in_place)
            .map(|r| r.bytes_from_store),
        heal_step: view.heal_step,
        prev_last_step,
        frozen_unix_ms: g.map(|g| g.created_unix_ms),
        in_place,
    });
}
