//! The handled signals (`--signals-to-handle`, torchrun's default `SIGTERM,SIGINT,SIGHUP,
//! SIGQUIT`) as a channel. A signal-hook thread turns each delivery into a message, so the
//! agent decides what a signal means (every handled signal drains, as SIGTERM does: SLURM's
//! SIGUSR1 pre-termination notice is one; the second is forwarded) instead of dying.

use anyhow::{Context, Result};
use tokio::sync::mpsc;

/// Signals queued before the agent loop reads them; more are dropped (they mean the same).
const QUEUE_MAX: usize = 8;

/// Starts listening to `numbers`, which `--signals-to-handle` limits to signals a process may
/// catch (signal-hook panics on SIGKILL or SIGSTOP).
pub fn listen_to(numbers: &[i32]) -> Result<mpsc::Receiver<i32>> {
    let mut signals = signal_hook::iterator::Signals::new(numbers)
        .with_context(|| format!("install signal handlers for {numbers:?}"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_listened_signal_arrives_on_the_channel() {
        // SIGUSR2 is not among the signals any other unit test raises.
        let mut rx = listen_to(&[libc::SIGUSR2]).unwrap();
        // SAFETY: raise(3) of a signal this process now handles.
        unsafe { libc::raise(libc::SIGUSR2) };
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv()).await;
        assert_eq!(got.unwrap(), Some(libc::SIGUSR2));
    }
}
