//! The rendezvous configuration and its checks, done before anything touches etcd.

use super::{BELOW_MIN_TIMEOUT_MS_DEFAULT, Connect, LEASE_TTL_MS_DEFAULT, SETTLE_MS_DEFAULT};
use crate::core::{CoreConfig, JoinPolicy};
use crate::keys::{EPOCH_REFRESH_S, STATE_RETENTION_S};
use crate::record::validate_node_id;
use crate::scaling::ScalingConfig;
use crate::{Error, Result};

/// Everything [`Rendezvous::join`](super::Rendezvous::join) needs.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    pub connect: Connect,
    pub job_id: String,
    pub node_id: String,
    /// Host or address other nodes reach this node at (`MASTER_ADDR` when it is rank 0).
    pub addr: String,
    /// Worker processes on this node.
    pub nproc: u32,
    /// `MASTER_PORT` when this node is rank 0; `None` reserves a free port now.
    pub master_port: Option<u16>,
    pub min_nodes: u32,
    pub max_nodes: u32,
    pub settle_ms: u64,
    pub join_policy: JoinPolicy,
    pub below_min_timeout_ms: u64,
    /// How long a regroup request waits for members to confirm before those that did not are
    /// left out ([`crate::core::CoreConfig::confirm_window_ms`]).
    pub confirm_window_ms: u64,
    /// Lease TTL; etcd counts whole seconds, so it is rounded up to one.
    pub lease_ttl_ms: u64,
    /// How long before the TTL ends an unrenewed lease fences this node; `None`: TTL/4.
    pub fence_margin_ms: Option<u64>,
    pub scaling: ScalingConfig,
    /// How often the leader moves `ctl/epoch` to a fresh retention lease (see
    /// [`keys`](crate::keys)); [`EPOCH_REFRESH_S`] by default. Tests shorten it.
    pub epoch_refresh_ms: u64,
}

impl RendezvousConfig {
    /// A configuration with the defaults, for `min..=max` nodes.
    pub fn new(
        endpoints: impl IntoIterator<Item = impl Into<String>>,
        job_id: impl Into<String>,
        node_id: impl Into<String>,
        addr: impl Into<String>,
        min_nodes: u32,
        max_nodes: u32,
        scaling: ScalingConfig,
    ) -> Self {
        Self {
            connect: Connect::new(endpoints),
            job_id: job_id.into(),
            node_id: node_id.into(),
            addr: addr.into(),
            nproc: 1,
            master_port: None,
            min_nodes,
            max_nodes,
            settle_ms: SETTLE_MS_DEFAULT,
            join_policy: JoinPolicy::Immediate,
            below_min_timeout_ms: BELOW_MIN_TIMEOUT_MS_DEFAULT,
            confirm_window_ms: crate::core::CONFIRM_WINDOW_MS_DEFAULT,
            lease_ttl_ms: LEASE_TTL_MS_DEFAULT,
            fence_margin_ms: None,
            scaling,
            epoch_refresh_ms: EPOCH_REFRESH_S * 1000,
        }
    }

    pub(crate) fn core_config(&self) -> CoreConfig {
        CoreConfig {
            min_nodes: self.min_nodes,
            max_nodes: self.max_nodes,
            settle_ms: self.settle_ms,
            join_policy: self.join_policy,
            below_min_timeout_ms: self.below_min_timeout_ms,
            confirm_window_ms: self.confirm_window_ms,
        }
    }

    pub(super) fn lease_ttl_s(&self) -> i64 {
        self.lease_ttl_ms.div_ceil(1000).max(1) as i64
    }

    pub(super) fn fence_margin_ms(&self) -> u64 {
        self.fence_margin_ms.unwrap_or(self.lease_ttl_ms / 4)
    }

    /// Checks every field before anything touches etcd.
    pub fn validate(&self) -> Result<()> {
        validate_node_id(&self.job_id).map_err(|reason| Error::InvalidConfig {
            field: "job_id",
            reason,
        })?;
        validate_node_id(&self.node_id).map_err(|reason| Error::InvalidConfig {
            field: "node_id",
            reason,
        })?;
        if self.addr.is_empty() {
            return Err(Error::InvalidConfig {
                field: "addr",
                reason: "empty".into(),
            });
        }
        if self.nproc == 0 {
            return Err(Error::InvalidConfig {
                field: "nproc",
                reason: "must be at least 1".into(),
            });
        }
        if self.lease_ttl_ms < 1000 || !self.lease_ttl_ms.is_multiple_of(1000) {
            return Err(Error::InvalidConfig {
                field: "lease_ttl_ms",
                reason: format!(
                    "{} ms: etcd leases count whole seconds, at least 1000 ms",
                    self.lease_ttl_ms
                ),
            });
        }
        let margin = self.fence_margin_ms();
        if margin == 0 || margin * 3 > self.lease_ttl_ms * 2 {
            return Err(Error::InvalidConfig {
                field: "fence_margin_ms",
                reason: format!(
                    "{margin} ms must be above 0 and leave a third of the TTL for renewals"
                ),
            });
        }
        // The epoch must be moved to a fresh lease well before its retention ends.
        let retention_ms = STATE_RETENTION_S as u64 * 1000;
        if self.epoch_refresh_ms < 1000 || self.epoch_refresh_ms > retention_ms / 2 {
            return Err(Error::InvalidConfig {
                field: "epoch_refresh_ms",
                reason: format!(
                    "{} ms must be within 1000..={} (half the epoch retention)",
                    self.epoch_refresh_ms,
                    retention_ms / 2
                ),
            });
        }
        self.core_config().validate()?;
        self.scaling.validate()
    }
}
