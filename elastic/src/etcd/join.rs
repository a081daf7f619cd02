//! Joining a job: registration under a fresh lease (waiting out an old registration of the
//! same node id), the `MASTER_PORT` reservation, and the start of the lease keeper and the
//! driver behind the returned [`Handle`].

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::state::clear_stale_state;
use super::{Handle, RendezvousConfig, Snapshot, commit, driver, lease, ops};
use crate::keys::Keys;
use crate::record::{self, MemberRecord};
use crate::{Error, Result};

/// How long past one lease TTL `join` keeps waiting for an old registration of its node id.
const REGISTER_GRACE_MS: u64 = 1_000;
const REGISTER_RETRY_PAUSE_MS: u64 = 200;

/// Entry point.
pub struct Rendezvous;

impl Rendezvous {
    /// Registers this node under its own lease and starts the background tasks (lease renewal,
    /// watch, leadership). Returns once the node is registered. When the node id is still
    /// registered (by this node's previous, fenced handle, or by a live duplicate), it waits up
    /// to one lease TTL and a second for that registration to end, then fails with
    /// [`Error::DuplicateNode`].
    pub async fn join(cfg: RendezvousConfig) -> Result<Handle> {
        cfg.validate()?;
        let client = cfg.connect.client(cfg.lease_ttl_ms / 3).await?;
        Self::join_with_client(cfg, client).await
    }

    /// [`Rendezvous::join`] over an existing connection (`cfg.connect` is then not used to
    /// connect). Lets many simulated members in one process share a few connections.
    pub async fn join_with_client(cfg: RendezvousConfig, mut client: Client) -> Result<Handle> {
        cfg.validate()?;
        let span = tracing::info_span!(
            "rendezvous",
            job = %cfg.job_id,
            node = %cfg.node_id,
            generation = tracing::field::Empty
        );
        async move {
            let keys = Keys::new(&cfg.job_id);
            let timeout_ms = cfg.connect.request_timeout_ms;
            clear_stale_state(&mut client, &keys, &cfg.job_id, timeout_ms).await?;

            let (master_port, spare_master_port) = match cfg.master_port {
                Some(p) => (p, None),
                None => {
                    let (p, spare) = reserve_ports()?;
                    (p, Some(spare))
                }
            };
            let member_key = keys.member(&cfg.node_id);
            // A registration left by this node's previous, fenced handle lives until its lease
            // runs out (etcd even renews leases once when it restarts). Keep trying for one TTL
            // and a bit; only a registration that outlives that belongs to a live duplicate.
            let give_up_at =
                Instant::now() + Duration::from_millis(cfg.lease_ttl_ms + REGISTER_GRACE_MS);
            let (lease_id, granted_at) = loop {
                let granted_at = Instant::now();
                let lease = ops::bounded(
                    "lease grant",
                    &member_key,
                    timeout_ms,
                    client.lease_grant(cfg.lease_ttl_s(), None),
                )
                .await?;
                let lease_id = lease.id();
                let member = MemberRecord {
                    version: record::RECORD_VERSION,
                    node_id: cfg.node_id.clone(),
                    addr: cfg.addr.clone(),
                    nproc: cfg.nproc,
                    master_port,
                    joined_unix_ms: ops::now_unix_ms(),
                    spare_master_port,
                };
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        member_key.clone(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then([TxnOp::put(
                        member_key.clone(),
                        record::encode(&member),
                        Some(PutOptions::new().with_lease(lease_id)),
                    )]);
                let registered =
                    ops::bounded("register", &member_key, timeout_ms, client.txn(txn)).await;
                if matches!(&registered, Ok(r) if r.succeeded()) {
                    break (lease_id, granted_at);
                }
                let _ = ops::bounded(
                    "lease revoke",
                    &member_key,
                    timeout_ms,
                    client.lease_revoke(lease_id),
                )
                .await;
                registered?;
                if Instant::now() >= give_up_at {
                    return Err(Error::DuplicateNode {
                        job: cfg.job_id.clone(),
                        node: cfg.node_id.clone(),
                    });
                }
                tracing::info!("node id still registered; waiting for the old lease to end");
                tokio::time::sleep(Duration::from_millis(REGISTER_RETRY_PAUSE_MS)).await;
            };
            tracing::info!(lease = format!("{lease_id:x}"), master_port, "registered");

            let cancel = CancellationToken::new();
            let (fenced_tx, fenced_rx) = watch::channel(None);
            let (snapshot_tx, snapshot_rx) = watch::channel(Snapshot::default());
            let keeper = lease::Keeper {
                client: client.clone(),
                lease_id,
                ttl_ms: cfg.lease_ttl_ms,
                fence_margin_ms: cfg.fence_margin_ms(),
                fenced_tx,
                cancel: cancel.clone(),
            };
            let keeper_task = tokio::spawn(keeper.run(granted_at).in_current_span());
            let compacted_watches = Arc::new(AtomicU64::new(0));
            let known_commit = Arc::new(AtomicU64::new(0));
            let driver = driver::Driver {
                client: client.clone(),
                keys: keys.clone(),
                cfg: cfg.clone(),
                lease_id,
                view: Default::default(),
                snapshot_tx,
                cancel: cancel.clone(),
                request_timeout_ms: timeout_ms,
                compacted_watches: compacted_watches.clone(),
                epoch_lease: None,
                leading_since: None,
                known_commit: known_commit.clone(),
                confirmed_regroup: None,
                leader_silent_since: None,
                drained: Default::default(),
                regroup_since: None,
                excluded: Default::default(),
            };
            let driver_task = tokio::spawn(driver.run().in_current_span());
            let span = tracing::Span::current();
            let reporter = Arc::new(commit::Reporter {
                client: client.clone(),
                keys: keys.clone(),
                cfg: cfg.clone(),
                fenced_rx: fenced_rx.clone(),
                span: span.clone(),
            });
            let (newest_commit_tx, newest_commit_rx) = watch::channel((0u64, None));
            let reporter_task = tokio::spawn(
                commit::report_in_background(reporter.clone(), newest_commit_rx, cancel.clone())
                    .in_current_span(),
            );
            Ok(Handle {
                client,
                keys,
                cfg,
                lease_id,
                snapshot_rx,
                fenced_rx,
                cancel,
                last_returned: None,
                compacted_watches,
                known_commit,
                reporter,
                newest_commit_tx,
                tasks: vec![keeper_task, driver_task, reporter_task],
                span,
            })
        }
        .instrument(span)
        .await
    }
}

/// Picks two distinct free TCP ports for `MASTER_PORT` (the reserved one and its spare). The
/// listeners are closed again so the workers can bind them; another process could take one in
/// between (the same race torchrun accepts).
fn reserve_ports() -> Result<(u16, u16)> {
    let bad = |e: std::io::Error| Error::InvalidConfig {
        field: "master_port",
        reason: format!("no free port to reserve: {e}"),
    };
    // Both listeners are open at once, so the kernel cannot hand out the same port twice.
    let a = std::net::TcpListener::bind(("0.0.0.0", 0)).map_err(bad)?;
    let b = std::net::TcpListener::bind(("0.0.0.0", 0)).map_err(bad)?;
    let a = a.local_addr().map_err(bad)?.port();
    let b = b.local_addr().map_err(bad)?.port();
    Ok((a, b))
}
