//! One worker group: start it through the supervisor, then serve it until it ends: signals
//! and notices start drains, staged parts go to the committer, etcd's view may stop it, the
//! lease may fence it. Whatever the workers staged before they exited is handed over after.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use elastic::Generation;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::committer::{BETWEEN_GENERATIONS_FLUSH_MS, Committer, give_up_step, tracker_complete};
use super::decide::{DrainOf, FINISH_GRACE_MS, StopWhy, must_stop};
use super::drain::start_drain;
use super::membership::{Membership, fenced_metrics, leave};
use super::{Agent, FLUSH_TIMEOUT_MS};
use crate::events::{DrainReason, Event};
use crate::notice;
use crate::pipeline::StepToCommit;
use crate::supervisor::{self, Command, Outcome};
use crate::worker_env::GenerationView;

/// How often the agent looks for the first step of a new worker group.
const FIRST_STEP_POLL_MS: u64 = 50;
/// How long a drained node waits for etcd to record its last step before it leaves early;
/// past it, it leaves once its workers exit, as without the early leave.
const EARLY_LEAVE_REPORT_MS: u64 = 2_000;

/// How long the agent's loop waits for etcd to take a regroup request.
const REGROUP_REQUEST_MS: u64 = 1_000;
/// How long the workers have to switch to a generation offered in place before the agent
/// restarts them into it instead (a worker that cannot leave its old process group).
const IN_PLACE_SWITCH_MS: u64 = 30_000;

/// How a worker group ended, and why the agent stopped it if it did.
pub(super) struct GroupEnd {
    pub(super) outcome: Outcome,
    pub(super) stop_why: Option<StopWhy>,
    /// The generation the group ended in (a later one than it started in when its workers
    /// switched in place).
    pub(super) view: GenerationView,
    pub(super) generation: Option<Arc<Generation>>,
}

/// A generation offered to the running workers in place, until they all switched.
struct Switch {
    view: GenerationView,
    generation: Arc<Generation>,
    offered: Instant,
}

impl Agent {
    /// Runs one worker group of `view` to its end.
    pub(super) async fn run_group(
        &mut self,
        view: &GenerationView,
        running_gen: Option<&Arc<Generation>>,
    ) -> Result<GroupEnd> {
        let mut view = view.clone();
        let mut running_gen = running_gen.cloned();
        let Agent {
            node,
            membership,
            committer,
            tracker,
            drain,
            approval,
            restarts,
            last_step_reached,
            checkpoint_timer,
            signals,
            notices,
            parts: parts_rx,
            ..
        } = self;
        let state = &node.state;
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let mut sup = tokio::spawn(
            supervisor::run(
                node.sup_cfg.clone(),
                node.spec.clone(),
                view.clone(),
                *restarts,
                node.launcher.clone(),
                state.clone(),
                cmd_rx,
            )
            .in_current_span(),
        );
        node.events.emit(Event::WorkersStarted {
            generation: view.generation,
            restart_count: *restarts,
        });
        let mut first_step_seen = false;
        let mut early_leave_tried = false;
        let mut first_step_poll = tokio::time::interval(Duration::from_millis(FIRST_STEP_POLL_MS));
        let mut stop_why: Option<StopWhy> = None;
        let mut committed_rx = committer.committed.clone();
        let mut snap_rx = match &*membership {
            Membership::Etcd(m) => Some(m.snap.clone()),
            Membership::Fixed(_) => None,
        };
        if let Some(rx) = snap_rx.as_mut() {
            rx.mark_changed();
        }
        // A complete step waiting for room in the commit queue.
        let mut held: Option<StepToCommit> = None;
        let mut switching: Option<Switch> = None;
        // A peer's drain that the workers save with and then switch past in place (logged once).
        let mut peer_drain_in_place = false;
        let mut in_place_rx = state.in_place_changes();
        // Armed when another node marked the job finished: the workers are stopped when it
        // fires, unless they ended first.
        let mut finish_stop: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        let outcome = loop {
            tokio::select! {
                out = &mut sup => break out.context("supervisor task")?,
                Some(sig) = signals.recv() => {
                    if drain.is_none_or(|d| d.of != DrainOf::Local) {
                        tracing::warn!(signal = sig, "signal received; draining");
                        node.events.emit(Event::DrainStarted { reason: DrainReason::Signal });
                        *drain = Some(start_drain(node, membership, &cmd_tx, DrainOf::Local).await);
                    } else {
                        tracing::warn!(signal = sig, "second signal; forwarding it to the workers");
                        let _ = cmd_tx.send(Command::Signal(sig)).await;
                    }
                }
                Some(n) = notices.recv() => match n {
                    notice::Notice::Preempt { why, approval: a } => {
                        *approval = a.or(approval.take());
                        if drain.is_none_or(|d| d.of != DrainOf::Local) {
                            tracing::warn!(notice = %why, "preemption notice; draining");
                            node.events.emit(Event::DrainStarted { reason: DrainReason::Notice });
                            *drain = Some(start_drain(node, membership, &cmd_tx, DrainOf::Local).await);
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
                    if let Some(step) = tracker_complete(node, &view, tracker, r) {
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
                        node.events.emit(Event::FirstStep { generation: view.generation, step });
                    }
                }
                Ok(()) = committed_rx.changed(), if matches!(*membership, Membership::Etcd(_)) => {
                    let latest = committer.latest_point();
                    // A drained node is done once its workers' last step is committed: it
                    // leaves now, and peers re-form from that step while its workers exit.
                    // Tried once, and bounded: this loop must stay responsive (a second signal,
                    // the fence); when etcd is slow the drain ends as it would have.
                    if let (Membership::Etcd(m), Some(point), Some(last)) =
                        (&mut *membership, latest, state.last_saved_step())
                        && !early_leave_tried
                        && drain.is_some_and(|d| d.of == DrainOf::Local)
                        && m.is_member()
                        && point.step >= last
                    {
                        early_leave_tried = true;
                        let report = Duration::from_millis(EARLY_LEAVE_REPORT_MS);
                        if tokio::time::timeout(report, m.report_for_leave(point)).await == Ok(true) {
                            // Nothing the workers save from now on is this node's to commit.
                            state.refuse_saves(format!("this node left the job after its drained step {} was committed", point.step));
                            tracing::info!(step = point.step, "drained step committed; leaving the job while the workers exit");
                            node.events.emit(Event::Left { step: Some(point.step), workers_running: true });
                            leave(membership).await;
                            if let Some(a) = approval.take() {
                                notice::approve(&a, &node.state.metrics).await;
                            }
                            continue;
                        }
                        tracing::warn!(step = point.step, "cannot record the drained step in etcd in time; leaving once the workers exit");
                    }
                    // Never awaited here: with etcd unreachable a report takes up to its whole
                    // budget, and this loop must go on taking parts, signals and the fence.
                    if let (Membership::Etcd(m), Some(point)) = (&mut *membership, latest) {
                        m.report_soon(point);
                    }
                }
                Ok(()) = in_place_rx.changed() => {
                    if let Some((g, why)) = state.take_collective_failure()
                        && let (Membership::Etcd(m), Some(run)) = (&*membership, running_gen.as_ref())
                        && run.number == g
                        && drain.is_none()
                        && stop_why.is_none()
                        && let Some(h) = m.handle.as_ref()
                    {
                        // The lost peer's lease may run for seconds more: the members that
                        // confirm in the window re-form without it.
                        tracing::warn!(generation = g, reason = %why, "a worker's collective failed; asking to regroup now");
                        match tokio::time::timeout(Duration::from_millis(REGROUP_REQUEST_MS), h.request_regroup(g, &why)).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => tracing::warn!(error = %e, "cannot ask to regroup; the lease decides"),
                            Err(_) => tracing::warn!(timeout_ms = REGROUP_REQUEST_MS, "asking to regroup timed out; the lease decides"),
                        }
                    }
                    if let Some(sw) = switching.take_if(|sw| sw.done(state)) {
                        (view, running_gen) = complete_switch(node, membership, committer, running_gen.as_deref(), sw, last_step_reached);
                        peer_drain_in_place = false;
                        // The next step reported is the new generation's first, and what etcd
                        // showed meanwhile is judged against the new generation.
                        first_step_seen = false;
                        if let Some(rx) = snap_rx.as_mut() {
                            rx.mark_changed();
                        }
                    }
                }
                () = async {
                    let sw = switching.as_ref().expect("guarded");
                    tokio::time::sleep_until((sw.offered + Duration::from_millis(IN_PLACE_SWITCH_MS)).into()).await
                }, if switching.is_some() && stop_why.is_none() && drain.is_none() => {
                    let sw = switching.take().expect("guarded");
                    state.withdraw_offer();
                    tracing::warn!(generation = sw.view.generation, "the workers did not switch to the new generation in place in time; restarting them into it");
                    stop_why = Some(StopWhy::NewGeneration);
                    let _ = cmd_tx.send(Command::Stop).await;
                }
                () = async { finish_stop.as_mut().expect("guarded").await }, if finish_stop.is_some() && stop_why.is_none() => {
                    finish_stop = None;
                    if switching.take().is_some() {
                        state.withdraw_offer();
                    }
                    tracing::warn!(grace_ms = FINISH_GRACE_MS, "the job is finished and the workers did not end; stopping them");
                    stop_why = Some(StopWhy::JobFinished);
                    let _ = cmd_tx.send(Command::Stop).await;
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
                        if why == StopWhy::JobFinished {
                            if finish_stop.is_none() {
                                tracing::info!(grace_ms = FINISH_GRACE_MS, "another node finished the job; the workers stop unless they end within the grace");
                                finish_stop = Some(Box::pin(tokio::time::sleep(Duration::from_millis(FINISH_GRACE_MS))));
                            }
                            continue;
                        }
                        if why == StopWhy::NewGeneration
                            && let Some(newest) = snap.generation.as_ref()
                        {
                            if switching.as_ref().is_some_and(|sw| sw.view.generation == newest.number) {
                                // Offered already; the workers are switching.
                                continue;
                            }
                            if let Some(sw) = switching.take_if(|sw| sw.done(state)) {
                                // The workers finished the switch already: the node runs that
                                // generation, then judges this view against it.
                                (view, running_gen) = complete_switch(node, membership, committer, running_gen.as_deref(), sw, last_step_reached);
                                peer_drain_in_place = false;
                                first_step_seen = false;
                                if let Some(rx) = snap_rx.as_mut() {
                                    rx.mark_changed();
                                }
                                continue;
                            }
                            if let Some(sw) = offer_in_place(node, newest, switching.is_some()) {
                                tracing::info!(generation = sw.view.generation, world_size = sw.view.world_size, "offering the new generation to the running workers in place");
                                switching = Some(sw);
                                continue;
                            }
                        }
                        if switching.take().is_some() {
                            state.withdraw_offer();
                        }
                        tracing::warn!(?why, "stopping the workers");
                        stop_why = Some(why);
                        let _ = cmd_tx.send(Command::Stop).await;
                    } else if drain.is_none() {
                        let peer_draining = snap.draining.iter().any(|n| *n != node.node_id && g.member(n).is_some());
                        if peer_draining && state.workers_switch_in_place() {
                            // The workers hear the drain from the peer's workers (`should_stop`),
                            // save the same step and wait for the generation without that peer,
                            // which is offered to them in place: nothing to stop here.
                            if !peer_drain_in_place {
                                peer_drain_in_place = true;
                                tracing::info!(draining = ?snap.draining, "a peer is draining; the workers save with it and switch in place");
                            }
                        } else if peer_draining {
                            tracing::warn!(draining = ?snap.draining, "a peer is draining; saving and stopping with it");
                            node.events.emit(Event::DrainStarted { reason: DrainReason::Peer });
                            *drain = Some(start_drain(node, membership, &cmd_tx, DrainOf::Peer).await);
                        }
                    }
                }
                e = async {
                    match &*membership {
                        Membership::Etcd(m) if m.handle.is_some() => {
                            m.handle.as_ref().expect("checked").fenced().await
                        }
                        _ => std::future::pending().await,
                    }
                }, if stop_why.is_none() => {
                    tracing::error!(error = %e, "fenced: stopping the workers before peers re-form the job");
                    node.events.emit(Event::Fenced { reason: e.to_string() });
                    fenced_metrics(&node.state, true);
                    stop_why = Some(StopWhy::Fenced);
                    let _ = cmd_tx.send(Command::Stop).await;
                }
            }
        };
        drop(cmd_tx);
        *last_step_reached = state.last_step().or(*last_step_reached);
        // Parts reported just before the workers exited are already queued: hand them over,
        // waiting for queue room as long as this ending allows. A drain's last checkpoint is
        // the one that matters most, and it needs every node's part: a peer of the draining
        // node waits as long as the draining node does (the grace), not the short wait
        // between generations, or a slow store behind its queue loses the drained step.
        let handover_limit = match (&*drain, &outcome) {
            (Some(d), _) => node.grace.saturating_sub(d.started.elapsed()),
            (_, Outcome::Succeeded) => Duration::from_millis(FLUSH_TIMEOUT_MS),
            _ => Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
        };
        let handover_deadline = Instant::now() + handover_limit;
        let mut pending: Vec<StepToCommit> = held.take().into_iter().collect();
        while let Ok(r) = parts_rx.try_recv() {
            pending.extend(tracker_complete(node, &view, tracker, r));
        }
        for step in pending {
            if let Err(dropped) = committer.submit_until(step, handover_deadline).await {
                // Peers would wait for this node's parts until their commit deadline,
                // holding their queues (and a drained step behind them): say in the store
                // that they never come.
                for p in &dropped.parts {
                    give_up_step(
                        node,
                        dropped.generation,
                        p.rank,
                        dropped.step,
                        "no room in the checkpoint queue before the deadline".into(),
                    );
                }
            }
        }
        if switching.is_some() {
            state.withdraw_offer();
        }
        Ok(GroupEnd {
            outcome,
            stop_why,
            view,
            generation: running_gen,
        })
    }
}

impl Switch {
    /// Whether every local worker switched to this generation.
    fn done(&self, state: &crate::state::AgentState) -> bool {
        state.generation() == self.view.generation
    }
}

/// Every local worker left its old process group for `sw`'s: the node runs that generation
/// from now on (etcd's handle, the events, the metrics). Returns its view and record.
fn complete_switch(
    node: &super::Node,
    membership: &mut Membership,
    committer: &mut Committer,
    old: Option<&Generation>,
    sw: Switch,
    last_step_reached: &mut Option<u64>,
) -> (GenerationView, Option<Arc<Generation>>) {
    if let Membership::Etcd(m) = membership
        && let Some(h) = m.handle.as_mut()
    {
        h.mark_joined(&sw.generation);
    }
    // A step of the old generation waits for every rank's part: one a lost member never
    // uploaded cannot complete, and would hold the commits behind it until its deadline.
    // As between generations of the restart path, what is still pending a short while after
    // the switch is cancelled (in the background: the workers train on meanwhile).
    if let Some(old) = old
        && old
            .members
            .iter()
            .any(|m| sw.generation.member(&m.node_id).is_none())
    {
        committer.retire_era(
            sw.view.generation,
            Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
        );
    }
    let reached = node.state.step_before_switch();
    *last_step_reached = reached.or(*last_step_reached);
    let mut view = sw.view;
    view.resume = None;
    view.heal_step = None;
    // The workers hold the state now: a step they joined at is theirs, not the store's.
    node.state.set_on_demand_restore(None);
    tracing::info!(
        generation = view.generation,
        world_size = view.world_size,
        ms = sw.offered.elapsed().as_millis() as u64,
        "the workers switched to the new generation in place"
    );
    let mut shown = view.clone();
    shown.resume = reached.map(|step| crate::worker_env::ResumePoint {
        step,
        dir: Default::default(),
        bytes_from_store: 0,
    });
    super::emit_generation(node, &shown, Some(&sw.generation), *last_step_reached, true);
    node.state
        .metrics
        .generations_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (view, Some(sw.generation))
}

/// Offers `newest` to the running workers in place when they can take it: this node is in it
/// and every local worker watches for generations (`reoffer`: they did when the offer it
/// replaces was made). `None`: the workers are restarted into it instead.
fn offer_in_place(node: &super::Node, newest: &Generation, reoffer: bool) -> Option<Switch> {
    let state = &node.state;
    if !reoffer && !state.workers_switch_in_place() {
        if state.watching_any() {
            tracing::info!(
                generation = newest.number,
                "not every local worker watches for generations; restarting them instead"
            );
        }
        return None;
    }
    let view = match super::membership::generation_view(node, newest) {
        Ok(v) => v,
        Err(e) => {
            tracing::info!(error = %e, "not switching in place");
            return None;
        }
    };
    state.offer_in_place(crate::state::InPlaceOffer {
        generation: view.generation,
        world_size: view.world_size,
        ranks: view.rank_offset..view.rank_offset + node.nproc,
        env: crate::worker_env::generation_env(&view),
    });
    Some(Switch {
        view,
        generation: Arc::new(newest.clone()),
        offered: Instant::now(),
    })
}
