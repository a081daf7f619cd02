//! Keeps a member's lease alive and fences the member *before* the TTL ends when it cannot.
//!
//! One renewal is in flight at a time. A renewal sent at `t` that the server acknowledges
//! proves the lease lives until at least `t + ttl`, so the fence deadline moves to
//! `t + ttl - fence_margin`. When that deadline passes without an acknowledged renewal (etcd
//! down, network cut, lease gone), the keeper publishes the fence reason and stops: the agent
//! must stop its workers, because peers will see the lease expire `fence_margin` later.

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout_at};
use tokio_util::sync::CancellationToken;

/// Shortest pause between renewal attempts after a failure.
const RETRY_PAUSE_MS: u64 = 50;

pub(crate) struct Keeper {
    pub client: Client,
    pub lease_id: i64,
    pub ttl_ms: u64,
    pub fence_margin_ms: u64,
    pub fenced_tx: watch::Sender<Option<String>>,
    pub cancel: CancellationToken,
}

impl Keeper {
    /// Runs until cancelled or fenced. `granted_at` is when the grant request was sent.
    pub async fn run(mut self, granted_at: Instant) {
        let ttl = Duration::from_millis(self.ttl_ms);
        let margin = Duration::from_millis(self.fence_margin_ms);
        let renew_every = ttl / 3;
        let retry_pause = Duration::from_millis(RETRY_PAUSE_MS).min(renew_every);
        let mut fence_at = granted_at + ttl - margin;
        let mut stream = None;
        let mut failures: u64 = 0;
        loop {
            if Instant::now() >= fence_at {
                self.fence(format!(
                    "lease {:x} not renewed within {} ms ({failures} failed attempts); it expires within {} ms",
                    self.lease_id,
                    (ttl - margin).as_millis(),
                    margin.as_millis()
                ));
                return;
            }
            let sent_at = Instant::now();
            let deadline = fence_at.min(sent_at + renew_every.max(retry_pause));
            let attempt = async {
                if stream.is_none() {
                    stream = Some(self.client.lease_keep_alive(self.lease_id).await?);
                }
                let (keeper, responses) = stream.as_mut().expect("set above");
                keeper.keep_alive().await?;
                responses.message().await
            };
            let outcome = tokio::select! {
                _ = self.cancel.cancelled() => return,
                r = timeout_at(deadline, attempt) => r,
            };
            match outcome {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                    fence_at = sent_at + ttl - margin;
                    failures = 0;
                    tracing::trace!(lease = self.lease_id, "lease renewed");
                    tokio::select! {
                        _ = self.cancel.cancelled() => return,
                        _ = sleep_until(sent_at + renew_every) => {}
                    }
                }
                Ok(Ok(Some(_))) => {
                    self.fence(format!("lease {:x} expired on the server", self.lease_id));
                    return;
                }
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(msg)))
                    if msg == "lease not found" =>
                {
                    // The server no longer knows the lease (it expired, or etcd lost its data).
                    self.fence(format!("lease {:x} not found on the server", self.lease_id));
                    return;
                }
                other => {
                    failures += 1;
                    let why = match other {
                        Ok(Ok(None)) => "keep-alive stream closed".to_string(),
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => "renewal timed out".to_string(),
                        Ok(Ok(Some(_))) => unreachable!("matched above"),
                    };
                    tracing::warn!(lease = self.lease_id, failures, %why, "lease renewal failed");
                    stream = None;
                    let pause_until = (Instant::now() + retry_pause).min(fence_at);
                    tokio::select! {
                        _ = self.cancel.cancelled() => return,
                        _ = sleep_until(pause_until) => {}
                    }
                }
            }
        }
    }

    fn fence(&self, reason: String) {
        tracing::error!(lease = self.lease_id, %reason, "fenced");
        self.fenced_tx.send_replace(Some(reason));
        self.cancel.cancel();
        // Best effort: if etcd is reachable after all, revoke so peers need not wait for the
        // TTL. Bounded by the fence margin, after which the lease is gone anyway.
        let mut client = self.client.clone();
        let (id, margin_ms) = (self.lease_id, self.fence_margin_ms);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_millis(margin_ms), client.lease_revoke(id))
                .await;
        });
    }
}
