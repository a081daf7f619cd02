//! The etcd v3 adapter: registers this node, keeps its lease, elects a leader, and lets the
//! leader drive the [`core`](crate::core) by fenced transactions. The key layout is in
//! [`keys`](crate::keys).
//!
//! - `lease.rs`: lease renewal, and fencing before the TTL ends.
//! - `driver.rs`: the per-handle task (watch, campaign, leader decisions).
//! - `ops.rs`: single fenced etcd operations ([`campaign`], [`write_generation`]).
//!
//! # Timing
//!
//! - A member renews its lease every TTL/3. When no renewal was acknowledged for
//!   `TTL - fence_margin` (default margin TTL/4), [`Handle::fenced`] resolves: the member
//!   learns it is out *before* etcd expires the lease and peers act on it.
//! - A SIGKILLed member is gone when etcd expires its lease (TTL, plus up to ~0.5 s of etcd's
//!   expiry sweep); the leader re-forms after the settle window. A graceful [`Handle::leave`]
//!   revokes the lease, so peers see it within milliseconds.
//! - The leader key hangs on the leader's lease; when it dies, the others campaign at once,
//!   so a new leader is in place within one TTL of the old leader's last renewal.
//! - etcd restarts shorter than `TTL - fence_margin` are ridden out (leases survive a restart);
//!   longer outages fence every member, as lost leases. Generation numbers keep growing
//!   across such a total loss (`ctl/epoch`, see [`keys`](crate::keys)).
//! - [`Handle::request_restart`] is one put; the leader freezes the restart generation as soon
//!   as its watch delivers it (no settle window), so every member sees the new generation a
//!   few etcd round trips later (1-20 ms on loopback in `tests/etcd.rs`).
//! - A watch that falls behind an etcd compaction (etcd cancels it with the compact revision)
//!   re-reads the job and watches again from there; [`Handle::watch_compactions_total`]
//!   counts it.

mod driver;
mod lease;
mod ops;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, PutOptions,
    TlsOptions, Txn, TxnOp,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use ops::{campaign, write_generation};

use crate::core::{CoreConfig, JoinPolicy};
use crate::keys::{EPOCH_REFRESH_S, Keys, STATE_RETENTION_S};
use crate::record::{
    self, CommitRecord, Generation, JobState, LeaderRecord, MemberRecord, Outcome, WaitingRecord,
    validate_node_id,
};
use crate::scaling::ScalingConfig;
use crate::{Error, Result};

/// Default lease TTL.
pub const LEASE_TTL_MS_DEFAULT: u64 = 10_000;
/// Default settle window.
pub const SETTLE_MS_DEFAULT: u64 = 1_000;
/// Default time the job may stay below `min` nodes.
pub const BELOW_MIN_TIMEOUT_MS_DEFAULT: u64 = 600_000;
/// Bound on any single etcd request (besides the lease logic, which has its own deadline).
pub const REQUEST_TIMEOUT_MS_DEFAULT: u64 = 5_000;
/// How long past one lease TTL `report_commit` keeps trying through a leader change (the
/// commit key hangs on the leader's lease) or concurrent writers.
const COMMIT_GRACE_MS: u64 = 2_000;
const COMMIT_RETRY_PAUSE_MS: u64 = 100;
/// How long past one lease TTL `join` keeps waiting for an old registration of its node id.
const REGISTER_GRACE_MS: u64 = 1_000;
const REGISTER_RETRY_PAUSE_MS: u64 = 200;

/// User and password for etcd's auth.
#[derive(Clone)]
pub struct Auth {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// TLS to etcd (PEM bytes). Endpoints must then be `https://`.
#[derive(Clone, Default)]
pub struct Tls {
    /// CA that signed etcd's server certificate; the system roots are not used.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key, for clusters that require client auth.
    pub client_cert_pem: Option<Vec<u8>>,
    pub client_key_pem: Option<Vec<u8>>,
    /// Server name to verify, when it differs from the endpoint host.
    pub domain: Option<String>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_cert", &self.client_cert_pem.is_some())
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct Connect {
    /// `http://host:port` or `https://host:port`; a bare `host:port` gets `http://`.
    pub endpoints: Vec<String>,
    pub auth: Option<Auth>,
    pub tls: Option<Tls>,
    pub request_timeout_ms: u64,
}

impl Connect {
    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            auth: None,
            tls: None,
            request_timeout_ms: REQUEST_TIMEOUT_MS_DEFAULT,
        }
    }

    /// Connects. `keepalive_ms` sets the HTTP/2 ping interval that detects a dead connection.
    pub async fn client(&self, keepalive_ms: u64) -> Result<Client> {
        if self.endpoints.is_empty() {
            return Err(Error::InvalidConfig {
                field: "endpoints",
                reason: "no etcd endpoint".into(),
            });
        }
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else if self.tls.is_some() {
                    format!("https://{e}")
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        let keepalive = Duration::from_millis(keepalive_ms.max(100));
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(self.request_timeout_ms))
            .with_keep_alive(keepalive, keepalive)
            .with_keep_alive_while_idle(true);
        if let Some(a) = &self.auth {
            opts = opts
                .with_user(a.user.clone(), a.password.clone())
                .with_auto_token_refresh(true);
        }
        if let Some(t) = &self.tls {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &t.ca_pem {
                tls = tls.ca_certificate(Certificate::from_pem(ca));
            }
            match (&t.client_cert_pem, &t.client_key_pem) {
                (Some(c), Some(k)) => tls = tls.identity(Identity::from_pem(c, k)),
                (None, None) => {}
                _ => {
                    return Err(Error::InvalidConfig {
                        field: "tls",
                        reason: "client certificate and key must be given together".into(),
                    });
                }
            }
            if let Some(d) = &t.domain {
                tls = tls.domain_name(d.clone());
            }
            opts = opts.with_tls(tls);
        }
        let key = endpoints.join(",");
        ops::bounded(
            "connect",
            &key,
            self.request_timeout_ms,
            Client::connect(endpoints.clone(), Some(opts)),
        )
        .await
    }
}

/// Everything [`Rendezvous::join`] needs.
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
        }
    }

    fn lease_ttl_s(&self) -> i64 {
        self.lease_ttl_ms.div_ceil(1000).max(1) as i64
    }

    fn fence_margin_ms(&self) -> u64 {
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

/// What a handle knows about the job right now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// The newest generation seen (it may not include this node).
    pub generation: Option<Arc<Generation>>,
    pub leader: Option<String>,
    pub latest_commit: Option<CommitRecord>,
    /// Nodes that announced they leave soon.
    pub draining: BTreeSet<String>,
    pub job_state: Option<JobState>,
    /// Set while the current generation is broken (members lost) and the job waits below
    /// `min` for replacements: stop the workers.
    pub waiting: Option<WaitingRecord>,
}

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
            };
            let driver_task = tokio::spawn(driver.run().in_current_span());
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
                tasks: vec![keeper_task, driver_task],
                span: tracing::Span::current(),
            })
        }
        .instrument(span)
        .await
    }
}

/// One node's membership in a job. Dropping it stops renewing the lease (peers see the node
/// leave after the TTL); call [`Handle::leave`] to leave at once.
pub struct Handle {
    client: Client,
    keys: Keys,
    cfg: RendezvousConfig,
    lease_id: i64,
    snapshot_rx: watch::Receiver<Snapshot>,
    fenced_rx: watch::Receiver<Option<String>>,
    cancel: CancellationToken,
    /// `(number, created_unix_ms)` of the generation last returned by `next_generation`.
    last_returned: Option<(u64, u64)>,
    compacted_watches: Arc<AtomicU64>,
    /// The newest step [`Handle::note_commit`] was given, plus one (0: none).
    known_commit: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
    span: tracing::Span,
}

impl Handle {
    /// This node's lease id.
    pub fn lease_id(&self) -> i64 {
        self.lease_id
    }

    pub fn node_id(&self) -> &str {
        &self.cfg.node_id
    }

    /// What this node knows now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_rx.borrow().clone()
    }

    /// A receiver that changes whenever the snapshot does.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.snapshot_rx.clone()
    }

    /// How many times this handle's watch fell behind an etcd compaction (and re-read the job
    /// instead). For metrics (`..._total`) and tests.
    pub fn watch_compactions_total(&self) -> u64 {
        self.compacted_watches.load(Ordering::Relaxed)
    }

    /// Whether this node leads now.
    pub fn is_leader(&self) -> bool {
        self.snapshot_rx.borrow().leader.as_deref() == Some(self.cfg.node_id.as_str())
    }

    /// Resolves with the next generation that includes this node (one not returned before).
    /// Fails with [`Error::Fenced`], [`Error::JobFinished`] or [`Error::JobFailed`].
    /// Cancel-safe.
    ///
    /// A generation without this node (a spare beyond `max`, or a node that drained) is not
    /// returned; an agent that must stop its workers on *any* new generation watches
    /// [`Handle::subscribe`] as well.
    pub async fn next_generation(&mut self) -> Result<Generation> {
        let mut rx = self.snapshot_rx.clone();
        let mut fenced = self.fenced_rx.clone();
        loop {
            if let Some(reason) = fenced.borrow().clone() {
                return Err(self.fenced_error(reason));
            }
            {
                let s = rx.borrow_and_update();
                if let Some(st) = &s.job_state {
                    return Err(job_state_error(&self.cfg.job_id, st));
                }
                if let Some(g) = &s.generation {
                    let id = (g.number, g.created_unix_ms);
                    if self.last_returned != Some(id) && g.member(&self.cfg.node_id).is_some() {
                        self.last_returned = Some(id);
                        let g = Generation::clone(g);
                        self.span.record("generation", g.number);
                        tracing::info!(parent: &self.span, world_size = g.world_size, rank_offset = g.member(&self.cfg.node_id).map(|(_, m)| m.rank_offset), "joined generation");
                        return Ok(g);
                    }
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() {
                    if let Some(reason) = fenced.borrow().clone() {
                        return Err(self.fenced_error(reason));
                    }
                    return Err(Error::Cancelled { op: "next_generation" });
                },
                _ = fenced.changed() => {}
            }
        }
    }

    /// Resolves when this node's lease is lost or could not be renewed in time; the error
    /// says why. Resolves before the TTL ends, so the agent can stop its workers before peers
    /// re-form the job. Cancel-safe; use it in `select!`.
    pub async fn fenced(&self) -> Error {
        let mut rx = self.fenced_rx.clone();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return self.fenced_error(reason);
            }
            if rx.changed().await.is_err() {
                // The keeper ended without fencing: the handle was closed.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether the node is fenced now.
    pub fn is_fenced(&self) -> bool {
        self.fenced_rx.borrow().is_some()
    }

    fn fenced_error(&self, reason: String) -> Error {
        Error::Fenced {
            job: self.cfg.job_id.clone(),
            node: self.cfg.node_id.clone(),
            reason,
        }
    }

    /// Tells this node's rendezvous that `step` is committed in the store, without asking
    /// etcd. Should this node freeze the next generation before etcd records the commit (the
    /// report failed while etcd was down, or is still on its way), that generation records it
    /// and resumes from it. Give only steps seen committed in the job's store.
    pub fn note_commit(&self, step: u64) {
        self.known_commit
            .fetch_max(step.saturating_add(1), Ordering::AcqRel);
    }

    /// Records `step` as the newest committed checkpoint step, unless a newer one is already
    /// recorded. Used for `AfterCommit` admission and for the next generation's resume step.
    /// Notes it first ([`Handle::note_commit`]), so a report that fails is not forgotten.
    pub async fn report_commit(&self, step: u64) -> Result<()> {
        self.note_commit(step);
        let mut client = self.client.clone();
        let timeout_ms = self.cfg.connect.request_timeout_ms;
        let commit_key = self.keys.commit();
        let budget_ms = self.cfg.lease_ttl_ms + COMMIT_GRACE_MS;
        let give_up_at = Instant::now() + Duration::from_millis(budget_ms);
        while Instant::now() < give_up_at {
            if let Some(reason) = self.fenced_rx.borrow().clone() {
                return Err(self.fenced_error(reason));
            }
            let txn = Txn::new().and_then([
                TxnOp::get(self.keys.leader(), None),
                TxnOp::get(commit_key.clone(), None),
            ]);
            let resp =
                ops::bounded("read commit", &commit_key, timeout_ms, client.txn(txn)).await?;
            let mut leader: Option<LeaderRecord> = None;
            let mut current: Option<(CommitRecord, i64)> = None;
            for (i, op) in resp.op_responses().into_iter().enumerate() {
                if let etcd_client::TxnOpResponse::Get(g) = op
                    && let Some(kv) = g.kvs().first()
                {
                    if i == 0 {
                        leader = Some(record::parse(&self.keys.leader(), kv.value())?);
                    } else {
                        current =
                            Some((record::parse(&commit_key, kv.value())?, kv.mod_revision()));
                    }
                }
            }
            if let Some((c, _)) = &current
                && c.step >= step
            {
                return Ok(());
            }
            if let Some(leader) = leader {
                let record = CommitRecord {
                    version: record::RECORD_VERSION,
                    step,
                    committed_unix_ms: ops::now_unix_ms(),
                    node_id: self.cfg.node_id.clone(),
                };
                let prev = current.as_ref().map_or(0, |(_, rev)| *rev);
                if ops::write_commit(&mut client, &self.keys, &leader, prev, &record, timeout_ms)
                    .await?
                {
                    tracing::info!(parent: &self.span, step, "commit recorded");
                    return Ok(());
                }
            }
            // No leader right now (takeover) or a concurrent writer: read again.
            tokio::time::sleep(Duration::from_millis(COMMIT_RETRY_PAUSE_MS)).await;
        }
        Err(Error::Timeout {
            op: "report_commit",
            after_ms: budget_ms,
        })
    }

    /// Announces that this node leaves soon (preemption). Peers see it at once in
    /// [`Snapshot::draining`]; the leader keeps the generation until the node is gone.
    pub async fn request_drain(&self) -> Result<()> {
        let key = self.keys.drain(&self.cfg.node_id);
        let mut client = self.client.clone();
        ops::bounded(
            "drain",
            &key,
            self.cfg.connect.request_timeout_ms,
            client.put(
                key.clone(),
                Vec::new(),
                Some(PutOptions::new().with_lease(self.lease_id)),
            ),
        )
        .await?;
        tracing::info!(parent: &self.span, "drain announced");
        Ok(())
    }

    /// Asks for the whole job to restart in a new generation, because this node's workers
    /// failed in `generation` (the number of the generation they ran). Every node then gets a
    /// new generation with the same members in the same order (draining ones left out, waiting
    /// ones admitted up to `max`), the newest commit as resume step and, where rank 0 reserved
    /// a spare, a master port other than the previous generation's.
    ///
    /// The leader acts at once (no settle window) on a request naming the current generation.
    /// A request naming an older one is ignored: that generation was already restarted or
    /// re-formed. So several nodes asking for the same generation give one new generation.
    ///
    /// The request is a small record at `ctl/restart/<node>` under this node's lease: it goes
    /// with the node. `reason` is kept to [`REASON_BYTES_MAX`](record::REASON_BYTES_MAX) bytes.
    /// Returns once etcd stored it; watch [`Handle::next_generation`] for the outcome.
    pub async fn request_restart(&self, generation: u64, reason: &str) -> Result<()> {
        if let Some(why) = self.fenced_rx.borrow().clone() {
            return Err(self.fenced_error(why));
        }
        let key = self.keys.restart(&self.cfg.node_id);
        if generation == 0 {
            return Err(Error::InvalidConfig {
                field: "generation",
                reason: "generation numbers start at 1".into(),
            });
        }
        let mut end = reason.len().min(record::REASON_BYTES_MAX);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let rec = record::RestartRecord {
            version: record::RECORD_VERSION,
            generation,
            node_id: self.cfg.node_id.clone(),
            reason: reason[..end].to_string(),
            requested_unix_ms: ops::now_unix_ms(),
        };
        let mut client = self.client.clone();
        ops::bounded(
            "restart request",
            &key,
            self.cfg.connect.request_timeout_ms,
            client.put(
                key.clone(),
                record::encode(&rec),
                Some(PutOptions::new().with_lease(self.lease_id)),
            ),
        )
        .await?;
        tracing::info!(parent: &self.span, generation, reason = rec.reason, "restart requested");
        Ok(())
    }

    /// Marks the job finished (every agent's `next_generation` then fails with
    /// [`Error::JobFinished`]). The state key outlives the job for a day, for `status`.
    pub async fn finish(&self, success: bool) -> Result<()> {
        let mut client = self.client.clone();
        let (outcome, reason) = if success {
            (Outcome::Succeeded, "finished")
        } else {
            (Outcome::Failed, "finished with failure")
        };
        write_state(
            &mut client,
            &self.keys,
            outcome,
            reason,
            None,
            self.cfg.connect.request_timeout_ms,
        )
        .await
    }

    /// Leaves at once: stops the background tasks and revokes the lease, which deletes this
    /// node's keys in one etcd revision so peers see it within milliseconds.
    pub async fn leave(mut self) -> Result<()> {
        self.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        if self.is_fenced() {
            // The lease is gone or going, and the keeper already tried to revoke it.
            return Ok(());
        }
        let mut client = self.client.clone();
        ops::bounded(
            "lease revoke",
            &self.keys.member(&self.cfg.node_id),
            self.cfg.connect.request_timeout_ms,
            client.lease_revoke(self.lease_id),
        )
        .await?;
        tracing::info!(parent: &self.span, "left");
        Ok(())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn job_state_error(job: &str, st: &JobState) -> Error {
    match st.outcome {
        Outcome::Succeeded => Error::JobFinished {
            job: job.to_string(),
            success: true,
        },
        Outcome::Failed => Error::JobFailed {
            job: job.to_string(),
            reason: st.reason.clone(),
        },
    }
}

/// Writes `ctl/state` under a fresh retention lease. With `leader_lease`, only while that lease
/// still holds the leader key.
pub(crate) async fn write_state(
    client: &mut Client,
    keys: &Keys,
    outcome: Outcome,
    reason: &str,
    leader_lease: Option<i64>,
    timeout_ms: u64,
) -> Result<()> {
    let key = keys.state();
    let retention = ops::bounded(
        "lease grant",
        &key,
        timeout_ms,
        client.lease_grant(STATE_RETENTION_S, None),
    )
    .await?;
    let state = JobState {
        version: record::RECORD_VERSION,
        outcome,
        reason: reason.to_string(),
        at_unix_ms: ops::now_unix_ms(),
    };
    // The first outcome written stands: a later `finish` (every agent may call it) is a no-op.
    let mut when = vec![Compare::create_revision(key.clone(), CompareOp::Equal, 0)];
    if let Some(l) = leader_lease {
        when.push(Compare::lease(keys.leader(), CompareOp::Equal, l));
    }
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(
            key.clone(),
            record::encode(&state),
            Some(PutOptions::new().with_lease(retention.id())),
        )])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = ops::bounded("write state", &key, timeout_ms, client.txn(txn)).await;
    let written = matches!(&resp, Ok(r) if r.succeeded());
    if !written {
        // Do not leave an empty day-long lease behind.
        let _ = ops::bounded(
            "lease revoke",
            &key,
            timeout_ms,
            client.lease_revoke(retention.id()),
        )
        .await;
    }
    let resp = resp?;
    if written {
        return Ok(());
    }
    let already = resp
        .op_responses()
        .into_iter()
        .any(|op| matches!(op, etcd_client::TxnOpResponse::Get(g) if !g.kvs().is_empty()));
    if already {
        return Ok(());
    }
    Err(Error::NotLeader {
        job: keys.prefix().to_string(),
        node: String::new(),
        key,
    })
}

/// A new run of a job id whose previous run finished: drop the old outcome, but only when no
/// leader is alive (a live job that is finishing keeps it).
async fn clear_stale_state(
    client: &mut Client,
    keys: &Keys,
    job: &str,
    timeout_ms: u64,
) -> Result<()> {
    let key = keys.state();
    let txn = Txn::new()
        .when([Compare::create_revision(keys.leader(), CompareOp::Equal, 0)])
        .and_then([TxnOp::delete(key.clone(), None)])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = ops::bounded("clear state", &key, timeout_ms, client.txn(txn)).await?;
    if !resp.succeeded() {
        for op in resp.op_responses() {
            if let etcd_client::TxnOpResponse::Get(g) = op
                && let Some(kv) = g.kvs().first()
            {
                let st: JobState = record::parse(&key, kv.value())?;
                return Err(job_state_error(job, &st));
            }
        }
    }
    Ok(())
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

/// A job as `elastic-run status` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub members: Vec<MemberRecord>,
    pub draining: BTreeSet<String>,
    pub leader: Option<String>,
    pub generation: Option<Generation>,
    pub latest_commit: Option<CommitRecord>,
    pub job_state: Option<JobState>,
    pub waiting: Option<WaitingRecord>,
}

/// Reads a job's members, generation, newest commit and outcome, without joining.
pub async fn status(connect: &Connect, job_id: &str) -> Result<Status> {
    validate_node_id(job_id).map_err(|reason| Error::InvalidConfig {
        field: "job_id",
        reason,
    })?;
    let keys = Keys::new(job_id);
    let mut client = connect.client(REQUEST_TIMEOUT_MS_DEFAULT).await?;
    let resp = ops::bounded(
        "get",
        keys.prefix(),
        connect.request_timeout_ms,
        client.get(keys.prefix(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let mut view = driver::View::default();
    for kv in resp.kvs() {
        let key = kv.key_str().map_err(|e| Error::BadValue {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            reason: e.to_string(),
        })?;
        // Parse strictly here: status reports a bad value instead of skipping it.
        if key == keys.generation() {
            let _: Generation = record::parse(key, kv.value())?;
        }
        view.apply(&keys, key, Some(kv.value()), kv.mod_revision(), kv.lease());
    }
    Ok(Status {
        members: view.members.into_values().collect(),
        draining: view.draining,
        leader: view.leader.map(|l| l.node_id),
        generation: view.generation.map(|g| Generation::clone(&g)),
        latest_commit: view.commit,
        job_state: view.state,
        waiting: view.waiting,
    })
}
