//! Drains: this node's (a signal or a preemption notice: the workers are told, then peers) or a
//! peer's. Workers that speak the protocol hear `should_stop` and save; the others get
//! SIGTERM at once; at the deadline the group is stopped.

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Node;
use super::decide::DrainOf;
use super::membership::Membership;
use crate::supervisor::Command;

/// Part of `--preemption-grace` kept back for SIGTERM → SIGKILL at the end of a drain.
const DRAIN_KILL_WINDOW_MAX_MS: u64 = 5_000;

/// A drain in progress.
#[derive(Debug, Clone, Copy)]
pub(super) struct Drain {
    pub(super) started: Instant,
    /// Whose drain: this node's (it leaves: a signal, a notice) or a peer's.
    pub(super) of: DrainOf,
}

/// Starts a drain: this node's (the workers are told first, then peers through etcd), or a peer's.
pub(super) async fn start_drain(
    node: &Node,
    membership: &Membership,
    cmds: &mpsc::Sender<Command>,
    of: DrainOf,
) -> Drain {
    let now = Instant::now();
    // The workers first: they agree on the step among themselves, peers' workers included,
    // so the save does not wait on etcd, which may be slow or unreachable from here.
    node.state.request_stop();
    if of == DrainOf::Local
        && let Membership::Etcd(m) = membership
        && let Some(h) = &m.handle
        && let Err(e) = h.request_drain().await
    {
        tracing::warn!(error = %e, "cannot announce the drain to peers");
    }
    node.state
        .metrics
        .drains_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let grace = node.grace;
    let kill_window = (grace / 4).min(Duration::from_millis(DRAIN_KILL_WINDOW_MAX_MS));
    // Workers that never spoke the protocol cannot hear `should_stop`: they get SIGTERM now,
    // as torchrun would forward it.
    let sigterm_now = !node.state.client_seen();
    let _ = cmds
        .send(Command::Drain {
            deadline: now + grace.saturating_sub(kill_window),
            sigterm_now,
        })
        .await;
    Drain { started: now, of }
}
