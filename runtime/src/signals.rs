//! SIGTERM and SIGINT as a channel. A signal-hook thread turns each delivery into a message, so
//! the agent decides what a signal means (drain first, forward the second) instead of dying.

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};
use tokio::sync::mpsc;

/// Signals queued before the agent loop reads them; more are dropped (they mean the same).
const QUEUE_MAX: usize = 8;

/// Starts listening; every SIGTERM or SIGINT from now on arrives on the returned channel.
pub fn listen() -> Result<mpsc::Receiver<i32>> {
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .context("install signal handlers")?;
    let (tx, rx) = mpsc::channel(QUEUE_MAX);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.try_send(sig).is_err() && tx.is_closed() {
                    return;
                }
            }
        })
        .context("start the signal thread")?;
    Ok(rx)
}
