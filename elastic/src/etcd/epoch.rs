//! The leader's upkeep of `ctl/epoch`, the highest generation number ever frozen: it hangs on
//! a retention lease of its own (see [`keys`](crate::keys)), which the leader moves to a fresh
//! one every `epoch_refresh_ms` and after each write, revoking the one before.

use std::time::Duration;

use tokio::time::Instant;

use super::driver::Driver;
use super::ops::{self, bounded};
use crate::Result;
use crate::keys::STATE_RETENTION_S;

impl Driver {
    /// When this leader moves `ctl/epoch` to a fresh retention lease next.
    pub(super) fn epoch_refresh_at(&mut self) -> Instant {
        let every = Duration::from_millis(self.cfg.epoch_refresh_ms);
        match self.epoch_lease {
            Some((_, granted_at)) => granted_at + every,
            None => *self.leading_since.get_or_insert_with(Instant::now) + every,
        }
    }

    /// The retention lease for the next `ctl/epoch` write: this leader's own while it is
    /// younger than the refresh period (no extra round trip on the restart path), else a fresh
    /// one.
    pub(super) async fn epoch_lease_for_write(&mut self) -> Result<i64> {
        let every = Duration::from_millis(self.cfg.epoch_refresh_ms);
        if let Some((id, granted_at)) = self.epoch_lease
            && granted_at.elapsed() < every
        {
            return Ok(id);
        }
        let granted_at = Instant::now();
        let lease = bounded(
            "lease grant",
            &self.keys.epoch(),
            self.request_timeout_ms,
            self.client.lease_grant(STATE_RETENTION_S, None),
        )
        .await?;
        self.epoch_lease = Some((lease.id(), granted_at));
        Ok(lease.id())
    }

    /// After `ctl/epoch` was written with `number` under `lease`: revokes the lease it hung on
    /// before (nothing else is attached to it), so leases do not pile up across leaders.
    pub(super) fn epoch_written(&mut self, number: u64, lease: i64) {
        let before = self.view.epoch_lease;
        self.view.epoch = self.view.epoch.max(number);
        self.view.epoch_lease = lease;
        if before != 0 && before != lease && before != self.lease_id {
            let mut client = self.client.clone();
            let timeout_ms = self.request_timeout_ms;
            let key = self.keys.epoch();
            tokio::spawn(async move {
                if let Err(e) = bounded(
                    "lease revoke",
                    &key,
                    timeout_ms,
                    client.lease_revoke(before),
                )
                .await
                {
                    // It expires with its retention anyway.
                    tracing::debug!(error = %e, "old epoch lease not revoked");
                }
            });
        }
    }

    /// Moves `ctl/epoch` to a fresh retention lease, so that it outlives the job by a full
    /// retention however long the job runs. Returns whether this node still leads.
    pub(super) async fn refresh_epoch(&mut self) -> Result<bool> {
        let number = self
            .view
            .epoch
            .max(self.view.generation.as_ref().map_or(0, |g| g.number));
        if number == 0 {
            // No generation yet: nothing to keep.
            self.leading_since = Some(Instant::now());
            self.epoch_lease = None;
            return Ok(true);
        }
        self.epoch_lease = None;
        let lease = self.epoch_lease_for_write().await?;
        let leads = ops::write_epoch(
            &mut self.client,
            &self.keys,
            self.lease_id,
            number,
            lease,
            self.request_timeout_ms,
        )
        .await
        .inspect_err(|_| self.epoch_lease = None)?;
        if leads {
            tracing::debug!(number, lease, "epoch moved to a fresh retention lease");
            self.epoch_written(number, lease);
        }
        Ok(leads)
    }
}
