//! The node agent: turns the command line into a worker spec, follows the job's membership,
//! runs one worker group per generation through the supervisor, streams the workers'
//! snapshots to the checkpoint store, and drains on SIGTERM, SIGINT or a preemption notice.
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
//! The first SIGTERM or SIGINT (or a preemption notice) starts a drain of `--preemption-grace`:
//! in etcd mode the node first announces it (peers ask their workers to stop too), then
//! `should_stop` turns true on the worker socket, workers agree on a step, save it and exit 0,
//! the agent commits what they staged, reports the commit and leaves (revoking its lease, so
//! the survivors re-form at once from that step: no step is lost). Workers that never spoke the
//! protocol (unmodified torchrun scripts) get SIGTERM at once instead. At the end of the grace
//! (less a kill window of up to 5 s) the group gets SIGTERM, then SIGKILL. A second signal is
//! forwarded to every worker's process group as is. A notice's Azure event is approved once the
//! node has left; an AWS rebalance recommendation (`--rebalance-action save`) asks for a
//! checkpoint at the next step instead of a drain.
//!
//! Exit codes: 0 when the workers finished (or drained) cleanly and every commit landed; the
//! failed worker's exit code (128 + signal when killed) when restarts ran out; 143 for a drain
//! that had to kill workers or lost a commit; 2 for usage errors; 1 otherwise.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use checkpoint::CancellationToken;
use elastic::{Generation, Handle, Rendezvous, RendezvousConfig, Snapshot};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::agent_socket::{self, AgentState, Received, StagedPart};
use crate::checkpoint_sink::StepTracker;
use crate::cli::{Cli, IndivisibleBatch, NProc, RdzvBackend};
use crate::events::Events;
use crate::notice;
use crate::scaling::{self, ScalingConfig};
use crate::store_sink::{SinkOptions, StepToCommit, StoreSink};
use crate::supervisor::{self, Command, Outcome, SupervisorConfig};
use crate::worker_env::{GenerationView, WorkerSpec};

/// SIGTERM to SIGKILL when the agent stops a worker group outside a drain.
pub const STOP_GRACE_MS: u64 = 5_000;
/// Part of `--preemption-grace` kept back for SIGTERM → SIGKILL at the end of a drain.
const DRAIN_KILL_WINDOW_MAX_MS: u64 = 5_000;
/// Complete steps queued for the committer besides the one it is committing. With one more
/// complete step held by the agent loop and one step's parts in the socket channel (capacity:
/// this node's ranks), at most four checkpoints are staged and uncommitted; a worker saving a
/// fifth waits on its `saved` reply. That bounds both staging space and the work a crash can
/// lose while the store is slow.
const COMMIT_QUEUE_MAX: usize = 1;
/// Snapshots of this node that may stand in staging at once: the four uncommitted ones above
/// and the one being written. Staging smaller than that many checkpoints is reported at the
/// first one; when it fills, a worker skips its snapshot and the step is given up.
const STAGED_CHECKPOINTS_MAX: u64 = 5;
/// How long the agent waits for queued worker output to be written before it exits.
const OUTPUT_FLUSH_MS: u64 = 5_000;
/// How long pending commits may take after the workers are done, outside a drain.
const FLUSH_TIMEOUT_MS: u64 = 60_000;
/// How long pending commits may take between two generations before they are cancelled (a
/// step a lost peer never uploaded cannot complete).
const BETWEEN_GENERATIONS_FLUSH_MS: u64 = 3_000;
/// Added to lease TTL + settle while a node whose workers failed waits for a membership change.
const FAILURE_SETTLE_EXTRA_MS: u64 = 1_000;
/// Pause between attempts to join again after a fence, and how long it keeps trying.
const REJOIN_PAUSE_MS: u64 = 1_000;
const REJOIN_DEADLINE_MS: u64 = 30 * 60_000;
/// How often the agent looks for the first step of a new worker group.
const FIRST_STEP_POLL_MS: u64 = 50;
/// Directory under staging where restored steps are laid out.
const RESTORE_DIR: &str = ".restore";
/// Bound on writing a given-up checkpoint's marker to the store.
const GIVE_UP_DEADLINE_MS: u64 = 30_000;
/// Attempts at restoring a generation's resume step before the agent gives up.
const RESTORE_ATTEMPTS_MAX: u32 = 6;
/// Pause after the first failed restore; doubles per attempt up to the max (31 s in all).
const RESTORE_BACKOFF_INITIAL_MS: u64 = 1_000;
const RESTORE_BACKOFF_MAX_MS: u64 = 8_000;

/// Whether a failed restore may succeed when tried again: local I/O (a full staging disk)
/// and store trouble may pass; a bad request or a cancellation does not. A step that does
/// not verify never reaches here: the sink falls back to an older one.
fn restore_is_retryable(e: &crate::store_sink::SinkError) -> bool {
    use crate::store_sink::SinkError as E;
    match e {
        E::Cancelled { .. } | E::InvalidInput(_) => false,
        E::Restore { source, .. } => !source.is_integrity(),
        _ => true,
    }
}

/// A configuration the user must change: reported like a bad flag (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// How this node learns its generations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Standalone,
    Static,
    Etcd,
}

impl Mode {
    pub fn of(cli: &Cli) -> Result<Mode> {
        if is_standalone(cli) {
            return Ok(Mode::Standalone);
        }
        match cli.rdzv_backend {
            RdzvBackend::Static => {
                if cli.nnodes.min != cli.nnodes.max {
                    return Err(usage(format!(
                        "--nnodes {}:{} needs an elastic backend: add --rdzv-backend etcd-v3 \
                         --rdzv-endpoint HOST:PORT (static rendezvous takes a fixed --nnodes N)",
                        cli.nnodes.min, cli.nnodes.max
                    )));
                }
                if cli.node_rank >= cli.nnodes.max {
                    return Err(usage(format!(
                        "--node-rank {} is not below --nnodes {}",
                        cli.node_rank, cli.nnodes.max
                    )));
                }
                Ok(Mode::Static)
            }
            RdzvBackend::EtcdV3 => {
                if cli.rdzv_endpoint.trim().is_empty() {
                    return Err(usage(
                        "--rdzv-backend etcd-v3 needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]",
                    ));
                }
                Ok(Mode::Etcd)
            }
        }
    }
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

/// The job's scaling configuration from the command line.
pub fn scaling_config(cli: &Cli, nproc: u32) -> ScalingConfig {
    ScalingConfig {
        policy: cli.lr_scaling,
        base_world_size: cli
            .base_world_size
            .unwrap_or(nproc.saturating_mul(cli.nnodes.max)),
        batch_size: cli.batch_size,
        global_batch: cli.global_batch,
        base_lr: cli.base_lr,
        warmup_steps: cli.warmup_steps,
        on_indivisible: match cli.indivisible_batch {
            IndivisibleBatch::Nearest => elastic::OnIndivisible::Nearest,
            IndivisibleBatch::Refuse => elastic::OnIndivisible::Refuse,
        },
    }
}

/// Reads `--rdzv-conf` into the rendezvous configuration. Keys: `lease_ttl_ms`, `settle_ms`,
/// `join_policy` (`immediate`, `after_commit`, `waiting:K`), `below_min_timeout_ms`,
/// `fence_margin_ms`, `request_timeout_ms`; torchrun's `join_timeout` and `timeout` (seconds:
/// how long the job may stay below `min`) and `last_call_timeout` (seconds: the settle
/// window) are honoured too, and its `read_timeout`, `keep_alive_interval`,
/// `keep_alive_max_attempt`, `is_host` are accepted and ignored. How to reach etcd (`protocol`,
/// `cacert`, `cert`, `key`, and the user from the environment) is [`etcd_connect`]'s.
pub fn rendezvous_config(
    cli: &Cli,
    node_id: &str,
    nproc: u32,
    scaling: &ScalingConfig,
) -> Result<RendezvousConfig> {
    let policy = scaling.to_policy().map_err(|e| usage(e.to_string()))?;
    let endpoints = split_endpoints(&cli.rdzv_endpoint);
    let addr = cli.local_addr.clone().unwrap_or_else(default_local_addr);
    let mut cfg = RendezvousConfig::new(
        endpoints,
        cli.rdzv_id.clone(),
        node_id.to_string(),
        addr,
        cli.nnodes.min,
        cli.nnodes.max,
        policy,
    );
    cfg.nproc = nproc;
    cfg.master_port = cli.master_port;
    cfg.connect = etcd_connect(&cli.rdzv_endpoint, &cli.rdzv_conf)?;
    for (k, v) in &cli.rdzv_conf.0 {
        let ms = |v: &str| -> Result<u64> {
            v.parse::<u64>()
                .map_err(|_| usage(format!("--rdzv-conf {k}={v}: not a number of milliseconds")))
        };
        let secs = |v: &str| -> Result<u64> {
            v.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0 && *s < 1e9)
                .map(|s| (s * 1000.0) as u64)
                .ok_or_else(|| usage(format!("--rdzv-conf {k}={v}: not a number of seconds")))
        };
        match k.as_str() {
            "lease_ttl_ms" => cfg.lease_ttl_ms = ms(v)?,
            "settle_ms" => cfg.settle_ms = ms(v)?,
            "last_call_timeout" => cfg.settle_ms = secs(v)?,
            "below_min_timeout_ms" => cfg.below_min_timeout_ms = ms(v)?,
            "join_timeout" | "timeout" => cfg.below_min_timeout_ms = secs(v)?,
            "fence_margin_ms" => cfg.fence_margin_ms = Some(ms(v)?),
            k if RDZV_CONF_CONNECT_KEYS.contains(&k) => {}
            "join_policy" => {
                cfg.join_policy = match v.as_str() {
                    "immediate" => elastic::JoinPolicy::Immediate,
                    "after_commit" | "after-commit" => elastic::JoinPolicy::AfterCommit,
                    w => match w.strip_prefix("waiting:").map(str::parse::<u32>) {
                        Some(Ok(k)) if k >= 1 => elastic::JoinPolicy::Waiting(k),
                        _ => {
                            return Err(usage(format!(
                                "--rdzv-conf join_policy={v}: use immediate, after_commit or \
                                 waiting:K (K >= 1)"
                            )));
                        }
                    },
                }
            }
            k if RDZV_CONF_IGNORED_KEYS.contains(&k) => {}
            other => return Err(unknown_rdzv_conf_key(other)),
        }
    }
    cfg.validate()
        .map_err(|e| usage(format!("--rdzv-conf / --nnodes: {e}")))?;
    Ok(cfg)
}

/// `--rdzv-conf` keys that say how to reach etcd (torchrun's etcd backend's names, and the
/// request bound), read by [`etcd_connect`].
pub const RDZV_CONF_CONNECT_KEYS: &[&str] =
    &["protocol", "cacert", "cert", "key", "request_timeout_ms"];
/// Every `--rdzv-conf` key the agent reads.
pub const RDZV_CONF_KEYS: &[&str] = &[
    "lease_ttl_ms",
    "settle_ms",
    "join_policy",
    "below_min_timeout_ms",
    "fence_margin_ms",
    "request_timeout_ms",
    "join_timeout",
    "timeout",
    "last_call_timeout",
    "protocol",
    "cacert",
    "cert",
    "key",
];
/// torchrun's `--rdzv-conf` keys that are accepted and ignored.
pub const RDZV_CONF_IGNORED_KEYS: &[&str] = &[
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "is_host",
];

/// The usage error for an `--rdzv-conf` key nobody reads.
pub fn unknown_rdzv_conf_key(key: &str) -> anyhow::Error {
    usage(format!(
        "--rdzv-conf: unknown key `{key}` (known: {})",
        RDZV_CONF_KEYS.join(", ")
    ))
}

/// etcd's user name and password (for a cluster with auth on); both or neither.
pub const ETCD_USERNAME_ENV: &str = "ELASTIC_ETCD_USERNAME";
pub const ETCD_PASSWORD_ENV: &str = "ELASTIC_ETCD_PASSWORD";
/// etcdctl's spelling, read when the two above are unset: `user:password`, or `user` with the
/// password in [`ETCDCTL_PASSWORD_ENV`].
pub const ETCDCTL_USER_ENV: &str = "ETCDCTL_USER";
pub const ETCDCTL_PASSWORD_ENV: &str = "ETCDCTL_PASSWORD";
/// Largest PEM file read for `cacert`, `cert` or `key`.
const PEM_BYTES_MAX: u64 = 1 << 20;

/// How to reach etcd: the `--rdzv-endpoint` list and the `--rdzv-conf` keys torchrun's etcd
/// backend uses, `protocol` (`http`, `https`), `cacert` (the CA that signed etcd's server
/// certificate; needed for https, the system roots are not used), `cert` and `key` (this
/// node's client certificate, for `--client-cert-auth` clusters), plus `request_timeout_ms`.
/// `https://` endpoints, or any of the files, mean TLS too. The user and password come from
/// the environment only ([`ETCD_USERNAME_ENV`] and [`ETCD_PASSWORD_ENV`], else
/// [`ETCDCTL_USER_ENV`]), so they never sit on a command line, and are never printed.
/// Files are read here: a missing or malformed one is a usage error before anything starts.
pub fn etcd_connect(
    endpoints: &str,
    conf: &crate::cli::RdzvConf,
) -> Result<elastic::etcd::Connect> {
    etcd_connect_from(endpoints, conf, |k| std::env::var(k).ok())
}

fn etcd_connect_from(
    endpoints: &str,
    conf: &crate::cli::RdzvConf,
    env: impl Fn(&str) -> Option<String>,
) -> Result<elastic::etcd::Connect> {
    let endpoints = split_endpoints(endpoints);
    let mut connect = elastic::etcd::Connect::new(endpoints.iter().cloned());
    if let Some(v) = conf.get("request_timeout_ms") {
        connect.request_timeout_ms = v
            .parse::<u64>()
            .map_err(|_| {
                usage(format!(
                    "--rdzv-conf request_timeout_ms={v}: not a number of milliseconds"
                ))
            })?
            .max(1);
    }
    let https_endpoint = endpoints.iter().any(|e| e.starts_with("https://"));
    for e in &endpoints {
        if let Some((scheme, _)) = e.split_once("://")
            && scheme != "http"
            && scheme != "https"
        {
            return Err(usage(format!(
                "--rdzv-endpoint {e}: use HOST:PORT, http://HOST:PORT or https://HOST:PORT"
            )));
        }
    }
    let files = ["cacert", "cert", "key"].map(|k| conf.get(k).filter(|p| !p.is_empty()));
    let tls = match conf.get("protocol") {
        Some("https") => true,
        Some("http") => {
            if let Some(k) = ["cacert", "cert", "key"]
                .iter()
                .zip(&files)
                .find_map(|(k, f)| f.map(|_| *k))
            {
                return Err(usage(format!(
                    "--rdzv-conf {k} is for TLS, but protocol=http: use protocol=https"
                )));
            }
            if https_endpoint {
                return Err(usage(
                    "--rdzv-conf protocol=http, but --rdzv-endpoint names https:// endpoints",
                ));
            }
            false
        }
        Some(p) => {
            return Err(usage(format!(
                "--rdzv-conf protocol={p}: use http or https"
            )));
        }
        None => https_endpoint || files.iter().any(Option::is_some),
    };
    if tls {
        if let Some(e) = endpoints.iter().find(|e| e.starts_with("http://")) {
            return Err(usage(format!(
                "--rdzv-endpoint {e} is plain http, but TLS is configured (protocol=https, \
                 cacert, cert or key): use https:// or HOST:PORT"
            )));
        }
        let [ca, cert, key] = files;
        let Some(ca) = ca else {
            return Err(usage(
                "--rdzv-conf protocol=https needs cacert=PATH: the CA certificate that signed \
                 etcd's server certificate (the system roots are not used)",
            ));
        };
        if cert.is_some() != key.is_some() {
            return Err(usage(
                "--rdzv-conf cert=PATH and key=PATH (the client certificate and its private \
                 key) go together",
            ));
        }
        connect.tls = Some(elastic::etcd::Tls {
            ca_pem: Some(read_pem("cacert", ca)?),
            client_cert_pem: cert.map(|p| read_pem("cert", p)).transpose()?,
            client_key_pem: key.map(|p| read_pem("key", p)).transpose()?,
            domain: None,
        });
    }
    connect.auth = etcd_auth_from_env(&env)?;
    Ok(connect)
}

/// `e` from reaching etcd for `job`, with what it means in this node's settings when it is
/// about TLS, the user and password, or the user's permissions. Names the endpoints and the
/// user, never the password (etcd's own messages do not hold it either).
pub fn explain_etcd_error(
    e: elastic::Error,
    connect: &elastic::etcd::Connect,
    job: &str,
) -> anyhow::Error {
    let text = e.to_string();
    let at = connect.endpoints.join(",");
    let user = connect.auth.as_ref().map(|a| a.user.as_str());
    let client_cert = connect
        .tls
        .as_ref()
        .is_some_and(|t| t.client_cert_pem.is_some());
    let hint = if text.contains("invalid peer certificate") {
        Some(format!(
            "TLS: the server certificate of etcd at {at} does not verify against --rdzv-conf \
             cacert (it must be the CA that signed etcd's --cert-file, and name this host)"
        ))
    } else if text.contains("received fatal alert") && text.contains("Certificate") {
        Some(if client_cert {
            format!(
                "TLS: etcd at {at} refused this node's client certificate (--rdzv-conf \
                 cert/key): it must be signed by a CA etcd trusts (--trusted-ca-file)"
            )
        } else {
            format!(
                "TLS: etcd at {at} wants a client certificate: add --rdzv-conf \
                 cert=PATH,key=PATH"
            )
        })
    } else if text.contains("received fatal alert") || text.contains("tls handshake") {
        Some(format!("TLS: the handshake with etcd at {at} failed"))
    } else if text.contains("authentication failed") {
        Some(format!(
            "etcd at {at} refused user `{}`: wrong user name or password (from \
             {ETCD_USERNAME_ENV}/{ETCD_PASSWORD_ENV} or {ETCDCTL_USER_ENV})",
            user.unwrap_or("")
        ))
    } else if text.contains("user name is empty") {
        Some(format!(
            "etcd at {at} has authentication on: set {ETCD_USERNAME_ENV} and \
             {ETCD_PASSWORD_ENV} (or {ETCDCTL_USER_ENV}=user:password)"
        ))
    } else if text.contains("permission denied") {
        Some(format!(
            "etcd at {at}: user `{}` may not use job {job}'s keys: its role needs readwrite \
             on the prefix {} (etcdctl role grant-permission ROLE --prefix=true readwrite {})",
            user.unwrap_or(""),
            elastic::keys::Keys::new(job).prefix(),
            elastic::keys::Keys::new(job).prefix()
        ))
    } else if connect.tls.is_none() && (text.contains("broken pipe") || text.contains("reset")) {
        Some(format!(
            "etcd at {at} closed the connection: if it serves TLS, set --rdzv-conf \
             protocol=https,cacert=PATH"
        ))
    } else {
        None
    };
    match hint {
        Some(h) => anyhow::Error::new(e).context(h),
        None => anyhow::Error::new(e),
    }
}

/// Reads one PEM file named by `--rdzv-conf KEY=PATH`, bounded; its contents never appear in
/// errors.
fn read_pem(key: &str, path: &str) -> Result<Vec<u8>> {
    let bad = |why: String| usage(format!("--rdzv-conf {key}={path}: {why}"));
    let f = std::fs::File::open(path).map_err(|e| bad(format!("cannot open it: {e}")))?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, PEM_BYTES_MAX + 1), &mut bytes)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    if bytes.len() as u64 > PEM_BYTES_MAX {
        return Err(bad(format!("larger than {PEM_BYTES_MAX} bytes")));
    }
    if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        return Err(bad("not a PEM file (no -----BEGIN line)".into()));
    }
    Ok(bytes)
}

/// etcd's user and password from the environment (see [`etcd_connect`]).
fn etcd_auth_from_env(
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<elastic::etcd::Auth>> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    match (nonempty(ETCD_USERNAME_ENV), env(ETCD_PASSWORD_ENV)) {
        (Some(user), Some(password)) => {
            return Ok(Some(elastic::etcd::Auth { user, password }));
        }
        (Some(_), None) => {
            return Err(usage(format!(
                "{ETCD_USERNAME_ENV} is set but {ETCD_PASSWORD_ENV} is not"
            )));
        }
        (None, Some(_)) => {
            return Err(usage(format!(
                "{ETCD_PASSWORD_ENV} is set but {ETCD_USERNAME_ENV} is not"
            )));
        }
        (None, None) => {}
    }
    let Some(v) = nonempty(ETCDCTL_USER_ENV) else {
        return Ok(None);
    };
    let (user, password) = match v.split_once(':') {
        Some((u, p)) => (u.to_string(), p.to_string()),
        None => match env(ETCDCTL_PASSWORD_ENV) {
            Some(p) => (v.clone(), p),
            None => {
                return Err(usage(format!(
                    "{ETCDCTL_USER_ENV} names a user without a password: use user:password, \
                     or set {ETCDCTL_PASSWORD_ENV}"
                )));
            }
        },
    };
    if user.is_empty() {
        return Err(usage(format!("{ETCDCTL_USER_ENV} has an empty user name")));
    }
    Ok(Some(elastic::etcd::Auth { user, password }))
}

#[cfg(test)]
mod etcd_connect_tests {
    use super::*;
    use crate::cli::RdzvConf;

    fn conf(pairs: &[(&str, &str)]) -> RdzvConf {
        RdzvConf(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn err(r: Result<elastic::etcd::Connect>) -> String {
        let e = r.expect_err("should fail");
        assert!(e.downcast_ref::<UsageError>().is_some(), "{e:#}");
        format!("{e:#}")
    }

    #[test]
    fn torchrun_tls_keys_read_the_pem_files() {
        let dir = tempfile::tempdir().unwrap();
        let pem = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(
                &p,
                format!("-----BEGIN {body}-----\nAAAA\n-----END {body}-----\n"),
            )
            .unwrap();
            p.display().to_string()
        };
        let (ca, cert, key) = (
            pem("ca.pem", "CERTIFICATE"),
            pem("c.pem", "CERTIFICATE"),
            pem("c.key", "PRIVATE KEY"),
        );
        let none = env_of(&[]);
        let full = [
            ("protocol", "https"),
            ("cacert", ca.as_str()),
            ("cert", cert.as_str()),
            ("key", key.as_str()),
            ("request_timeout_ms", "1500"),
        ];
        let c = etcd_connect_from("h1:2379,h2:2379", &conf(&full), &none).unwrap();
        assert_eq!(c.endpoints, ["h1:2379", "h2:2379"]);
        assert_eq!(c.request_timeout_ms, 1500);
        let tls = c.tls.as_ref().expect("tls");
        assert!(
            tls.ca_pem
                .as_ref()
                .unwrap()
                .starts_with(b"-----BEGIN CERTIFICATE")
        );
        assert!(
            tls.client_key_pem
                .as_ref()
                .unwrap()
                .starts_with(b"-----BEGIN PRIVATE KEY")
        );
        assert!(c.auth.is_none());
        assert!(!format!("{c:?}").contains("AAAA"), "{c:?}");
        // The files alone, or an https:// endpoint, mean TLS too; plain http stays plain.
        let c = etcd_connect_from("h:1", &conf(&[("cacert", ca.as_str())]), &none).unwrap();
        assert!(c.tls.as_ref().unwrap().client_cert_pem.is_none());
        let c = etcd_connect_from("https://h:1", &conf(&[("cacert", &ca)]), &none).unwrap();
        assert!(c.tls.is_some());
        let c = etcd_connect_from("h:1", &conf(&[("protocol", "http")]), &none).unwrap();
        assert!(c.tls.is_none());

        for (ep, pairs, needle) in [
            ("h:1", &[("protocol", "https")][..], "needs cacert"),
            (
                "h:1",
                &[("protocol", "http"), ("cacert", &ca)],
                "protocol=http",
            ),
            ("https://h:1", &[("protocol", "http")], "https://"),
            ("http://h:1", &[("cacert", ca.as_str())], "plain http"),
            ("h:1", &[("protocol", "tls")], "protocol=tls"),
            ("h:1", &[("cacert", &ca), ("cert", &cert)], "go together"),
            (
                "h:1",
                &[("cacert", "/nonexistent/ca.pem")],
                "cacert=/nonexistent/ca.pem",
            ),
            (
                "h:1",
                &[("cacert", &ca), ("key", "/dev/null"), ("cert", &cert)],
                "not a PEM",
            ),
            ("ftp://h:1", &[], "--rdzv-endpoint ftp://h:1"),
            (
                "h:1",
                &[("request_timeout_ms", "soon")],
                "request_timeout_ms=soon",
            ),
        ] {
            let msg = err(etcd_connect_from(ep, &conf(pairs), &none));
            assert!(msg.contains(needle), "{pairs:?}: {msg}");
        }
    }

    #[test]
    fn user_and_password_come_from_the_environment_and_are_never_shown() {
        let auth = |vars: &[(&str, &str)]| {
            etcd_connect_from("h:1", &conf(&[]), env_of(vars)).map(|c| {
                let shown = format!("{c:?}");
                assert!(!shown.contains("pw-secret"), "{shown}");
                c.auth.map(|a| (a.user, a.password))
            })
        };
        let pair = |u: &str, p: &str| Some((u.to_string(), p.to_string()));
        assert_eq!(auth(&[]).unwrap(), None);
        assert_eq!(
            auth(&[
                (ETCD_USERNAME_ENV, "alice"),
                (ETCD_PASSWORD_ENV, "pw-secret")
            ])
            .unwrap(),
            pair("alice", "pw-secret")
        );
        assert_eq!(
            auth(&[(ETCDCTL_USER_ENV, "bob:pw-secret:with-colon")]).unwrap(),
            pair("bob", "pw-secret:with-colon")
        );
        assert_eq!(
            auth(&[
                (ETCDCTL_USER_ENV, "bob"),
                (ETCDCTL_PASSWORD_ENV, "pw-secret")
            ])
            .unwrap(),
            pair("bob", "pw-secret")
        );
        // elastic-run's own variables win over etcdctl's.
        assert_eq!(
            auth(&[
                (ETCD_USERNAME_ENV, "alice"),
                (ETCD_PASSWORD_ENV, "pw-secret"),
                (ETCDCTL_USER_ENV, "bob:other"),
            ])
            .unwrap(),
            pair("alice", "pw-secret")
        );
        for (vars, needle) in [
            (&[(ETCD_USERNAME_ENV, "alice")][..], ETCD_PASSWORD_ENV),
            (&[(ETCD_PASSWORD_ENV, "pw-secret")], ETCD_USERNAME_ENV),
            (&[(ETCDCTL_USER_ENV, "bob")], ETCDCTL_PASSWORD_ENV),
            (&[(ETCDCTL_USER_ENV, ":pw-secret")], "empty user name"),
        ] {
            let msg = err(etcd_connect_from("h:1", &conf(&[]), env_of(vars)));
            assert!(msg.contains(needle), "{vars:?}: {msg}");
            assert!(!msg.contains("pw-secret"), "{msg}");
        }
    }

    #[test]
    fn rendezvous_conf_still_refuses_unknown_keys_by_name() {
        let cli = |rdzv_conf: &str| {
            Cli::try_parse_from([
                "elastic-run",
                "--rdzv-backend",
                "etcd-v3",
                "--rdzv-endpoint",
                "h:2379",
                "--nnodes",
                "1:2",
                "--rdzv-conf",
                rdzv_conf,
                "x.py",
            ])
            .unwrap()
        };
        use clap::Parser;
        let c = cli("protocol=http,lease_ttl_ms=2000,request_timeout_ms=900");
        let cfg = rendezvous_config(&c, "n", 1, &scaling_config(&c, 1)).unwrap();
        assert_eq!(cfg.connect.request_timeout_ms, 900);
        assert_eq!(cfg.lease_ttl_ms, 2000);
        assert!(cfg.connect.tls.is_none());
        let c = cli("protocol=http,certfile=/x");
        let e = rendezvous_config(&c, "n", 1, &scaling_config(&c, 1)).unwrap_err();
        assert!(e.downcast_ref::<UsageError>().is_some());
        let msg = e.to_string();
        assert!(
            msg.contains("unknown key `certfile`") && msg.contains("cacert"),
            "{msg}"
        );
    }
}

/// Everything a worker group needs that stays the same for the agent's life.
struct Node {
    mode: Mode,
    nproc: u32,
    node_id: String,
    scaling: ScalingConfig,
    spec: WorkerSpec,
    sup_cfg: SupervisorConfig,
    state: Arc<AgentState>,
    sink: Arc<StoreSink>,
    events: Arc<Events>,
    grace: Duration,
    max_restarts: u32,
    /// Whether staging's size was held against the first complete checkpoint yet.
    staging_checked: std::sync::atomic::AtomicBool,
}

/// The job's membership as this node follows it.
enum Membership {
    /// Standalone or static: one view forever.
    Fixed(GenerationView),
    Etcd(Box<EtcdMember>),
}

struct EtcdMember {
    cfg: RendezvousConfig,
    /// `None` after a fence, until the node joined again.
    handle: Option<Handle>,
    snap: watch::Receiver<Snapshot>,
    /// The newest committed step read from the store at start: the resume step of a first
    /// generation that names none.
    bucket_latest: Option<u64>,
    /// The highest step reported to etcd.
    reported: Option<u64>,
    /// The highest step given to `report` (seen committed), recorded in etcd or not: told
    /// again to the handle of a rejoin.
    committed: Option<u64>,
}

impl EtcdMember {
    async fn join(cfg: RendezvousConfig, events: &Events) -> Result<Self> {
        let handle = Rendezvous::join(cfg.clone())
            .await
            .map_err(|e| explain_etcd_error(e, &cfg.connect, &cfg.job_id))
            .with_context(|| {
                format!(
                    "join job {} at {}",
                    cfg.job_id,
                    cfg.connect.endpoints.join(",")
                )
            })?;
        tracing::info!(addr = %cfg.addr, lease = handle.lease_id(), "joined the job");
        events.emit("joined", json!({"addr": cfg.addr}));
        let snap = handle.subscribe();
        Ok(EtcdMember {
            cfg,
            handle: Some(handle),
            snap,
            bucket_latest: None,
            reported: None,
            committed: None,
        })
    }

    /// Joins again after a fence, until it works or the deadline passes.
    async fn rejoin(&mut self, events: &Events) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(REJOIN_DEADLINE_MS);
        loop {
            match Rendezvous::join(self.cfg.clone()).await {
                Ok(h) => {
                    tracing::info!(lease = h.lease_id(), "joined the job again");
                    events.emit("joined", json!({"addr": self.cfg.addr, "rejoin": true}));
                    self.snap = h.subscribe();
                    if let Some(step) = self.committed {
                        h.note_commit(step);
                    }
                    self.handle = Some(h);
                    self.reported = None;
                    return Ok(());
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot join the job again yet; retrying");
                    tokio::time::sleep(Duration::from_millis(REJOIN_PAUSE_MS)).await;
                }
                Err(e) => return Err(e).context("join the job again after a fence"),
            }
        }
    }

    /// Reports `step` as committed, once, best-effort (the commit itself is durable already).
    /// A report that fails is still known to this node's rendezvous: should it lead the next
    /// generation, that generation records the commit and resumes from it.
    async fn report(&mut self, step: u64) {
        self.committed = self.committed.max(Some(step));
        if self.reported.is_some_and(|r| r >= step) {
            return;
        }
        if let Some(h) = &self.handle {
            match h.report_commit(step).await {
                Ok(()) => self.reported = Some(step),
                Err(e) => tracing::warn!(step, error = %e, "cannot record the commit in etcd"),
            }
        }
    }

    fn settle_for_failure(&self) -> Duration {
        Duration::from_millis(self.cfg.lease_ttl_ms + self.cfg.settle_ms + FAILURE_SETTLE_EXTRA_MS)
    }
}

/// What ended a wait for the next generation.
enum Next {
    Run(Box<GenerationView>, Option<Arc<Generation>>),
    Exit(u8),
}

/// Why a running group was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopWhy {
    NewGeneration,
    Fenced,
    Waiting,
    JobFailed,
}

/// A drain in progress.
#[derive(Debug, Clone, Copy)]
struct Drain {
    started: Instant,
    /// This node leaves (signal, notice), rather than a peer.
    local: bool,
}

/// The committer's side of the agent: a queue and the newest committed step.
struct Committer {
    tx: mpsc::Sender<(StepToCommit, CancellationToken)>,
    /// Steps queued or in flight.
    pending: watch::Receiver<usize>,
    pending_tx: Arc<watch::Sender<usize>>,
    /// Cancels the commits of the current era (between two generations).
    era: CancellationToken,
    committed: watch::Receiver<Option<u64>>,
    task: tokio::task::JoinHandle<bool>,
}

impl Committer {
    fn start(node: &Node, latest: Option<u64>) -> Self {
        let (tx, rx) = mpsc::channel(COMMIT_QUEUE_MAX);
        let (pending_tx, pending) = watch::channel(0usize);
        let pending_tx = Arc::new(pending_tx);
        let (committed_tx, committed) = watch::channel(latest);
        let task = tokio::spawn(
            commit_loop(
                node.sink.clone(),
                rx,
                node.state.clone(),
                node.spec.staging_dir.clone(),
                node.events.clone(),
                committed_tx,
                pending_tx.clone(),
            )
            .in_current_span(),
        );
        Committer {
            tx,
            pending,
            pending_tx,
            era: CancellationToken::new(),
            committed,
            task,
        }
    }

    /// Queues a step without waiting (the agent loop must never block on a slow store), or
    /// gives it back when the queue is full: the loop holds it until a permit comes.
    fn try_submit(&self, step: StepToCommit) -> Result<(), StepToCommit> {
        // Counted before the send: the committer may finish it (and count it down) at once.
        self.pending_tx.send_modify(|n| *n += 1);
        let r = self.tx.try_send((step, self.era.clone()));
        if r.is_err() {
            self.pending_tx.send_modify(|n| *n = n.saturating_sub(1));
        }
        match r {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full((step, _))) => Err(step),
            Err(mpsc::error::TrySendError::Closed((step, _))) => {
                tracing::warn!(
                    step = step.step,
                    "checkpoint queue closed; this step is not committed"
                );
                Ok(())
            }
        }
    }

    /// Queues a step into the room `permit` holds.
    fn submit_with(
        &self,
        permit: mpsc::OwnedPermit<(StepToCommit, CancellationToken)>,
        step: StepToCommit,
    ) {
        self.pending_tx.send_modify(|n| *n += 1);
        permit.send((step, self.era.clone()));
    }

    /// Queues a step, waiting for room until `deadline` (after a worker group ended, when the
    /// loop has nothing else to serve); a step that still finds no room is dropped with a
    /// warning.
    async fn submit_until(&self, step: StepToCommit, deadline: Instant) {
        let s = step.step;
        self.pending_tx.send_modify(|n| *n += 1);
        let sent =
            tokio::time::timeout_at(deadline.into(), self.tx.send((step, self.era.clone()))).await;
        if !matches!(sent, Ok(Ok(()))) {
            self.pending_tx.send_modify(|n| *n = n.saturating_sub(1));
            tracing::warn!(
                step = s,
                "no room in the checkpoint queue before the deadline; this step is not committed"
            );
        }
    }

    /// Waits until nothing is pending, up to `limit`; then cancels what is left and starts a
    /// new era. Returns whether everything finished.
    async fn settle(&mut self, limit: Duration) -> bool {
        let mut pending = self.pending.clone();
        let done = tokio::time::timeout(limit, pending.wait_for(|n| *n == 0))
            .await
            .is_ok();
        if !done {
            tracing::warn!(
                limit_ms = limit.as_millis() as u64,
                "pending checkpoint commits did not finish in time; cancelling them"
            );
            self.era.cancel();
            self.era = CancellationToken::new();
            let _ = tokio::time::timeout(
                Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
                pending.wait_for(|n| *n == 0),
            )
            .await;
        }
        done
    }

    fn latest(&self) -> Option<u64> {
        *self.committed.borrow()
    }

    /// Closes the queue and waits for the committer, up to `limit`.
    async fn finish(self, limit: Duration) -> bool {
        drop(self.tx);
        let era = self.era.clone();
        match tokio::time::timeout(limit, self.task).await {
            Ok(Ok(ok)) => ok,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "checkpoint task failed");
                false
            }
            Err(_) => {
                era.cancel();
                tracing::error!(
                    limit_ms = limit.as_millis() as u64,
                    "checkpoint flush did not finish in time"
                );
                false
            }
        }
    }
}

async fn run_node(cli: Cli, mode: Mode, nproc: u32, node_id: String, run_id: String) -> Result<u8> {
    // Everything a user can get wrong is checked before anything is created.
    let scaling_cfg = scaling_config(&cli, nproc);
    scaling_cfg.to_policy().map_err(|e| usage(e.to_string()))?;
    let argv = worker_argv(&cli)?;
    let rdzv_cfg = match mode {
        Mode::Etcd => Some(rendezvous_config(&cli, &node_id, nproc, &scaling_cfg)?),
        _ => None,
    };
    let url = cli
        .checkpoint_url
        .resolved()
        .context("resolve --checkpoint-url")?;
    let store_config = cli.store_options();
    crate::cli::check_store_options(&url, &store_config)
        .map_err(|e| usage(format!("--checkpoint-store-option: {e}")))?;
    let events = Arc::new(
        Events::open(cli.events_file.as_deref(), &node_id)
            .with_context(|| format!("open --events-file {:?}", cli.events_file))?,
    );

    let run_dir = RunDir::create()?;
    // Removes a default staging dir when the agent returns, on every path.
    let staging_guard = Staging::prepare(cli.staging_dir.as_deref(), &run_id, &node_id)?;
    let staging = staging_guard.path.clone();
    let sink_opts = SinkOptions {
        compression: cli.checkpoint_compress,
        store_config,
        keep_steps: cli.checkpoint_keep_last,
        keep_every: cli.checkpoint_keep_every,
        ..SinkOptions::default()
    };
    let sink = StoreSink::open(&url, staging.join(RESTORE_DIR), sink_opts)
        .map_err(|e| usage(format!("--checkpoint-url {url}: {e}")))?;
    let sink = Arc::new(sink);
    let socket_path = run_dir.path.join("agent.sock");
    let spec = WorkerSpec {
        nproc,
        role: cli.role.clone(),
        run_id: run_id.clone(),
        node_id: node_id.clone(),
        max_restarts: cli.max_restarts,
        checkpoint_interval: cli.checkpoint_interval,
        staging_dir: staging.clone(),
        agent_socket: socket_path.clone(),
        run_dir: run_dir.path.clone(),
    };
    let sup_cfg = SupervisorConfig {
        argv,
        // The agent restarts groups itself (it must restore, and in etcd mode re-form).
        max_restarts: 0,
        monitor_interval: cli.monitor_interval,
        hang_timeout: cli.hang_timeout,
        startup_timeout: cli.startup_timeout,
        stop_grace: Duration::from_millis(STOP_GRACE_MS),
        omp_num_threads_set: std::env::var_os("OMP_NUM_THREADS").is_some(),
        first_restart: 0,
    };

    // Signals first: a SIGTERM from here on drains instead of killing the agent.
    let mut signals = crate::signals::listen()?;

    let state = Arc::new(AgentState::new(staging.clone()));
    let listener = tokio::net::UnixListener::bind(&socket_path)
        .with_context(|| format!("bind the agent socket {}", socket_path.display()))?;
    let (parts_tx, mut parts_rx) = mpsc::channel::<Received>(nproc.max(1) as usize);
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let server = tokio::spawn(agent_socket::serve(
        listener,
        state.clone(),
        parts_tx,
        shutdown_rx,
    ));
    let metrics_server = match cli.metrics_addr {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-addr {addr}"))?;
            tracing::info!(addr = %l.local_addr()?, "serving metrics at /metrics");
            Some(tokio::spawn(crate::metrics::serve(
                l,
                state.clone(),
                shutdown_tx.subscribe(),
            )))
        }
        None => None,
    };
    let (notice_tx, mut notices) = mpsc::channel::<notice::Notice>(1);
    let _poller = cli.preemption_notice.clone().map(|n| {
        let mut cfg = notice::Config::new(n, cli.monitor_interval.max(Duration::from_secs(1)));
        cfg.rebalance = cli.rebalance_action;
        cfg.azure_vm_name = cli.azure_vm_name.clone();
        tokio::spawn(notice::poll(cfg, state.clone(), notice_tx))
    });

    let node = Node {
        mode,
        nproc,
        node_id: node_id.clone(),
        scaling: scaling_cfg,
        spec,
        sup_cfg,
        state: state.clone(),
        sink: sink.clone(),
        events: events.clone(),
        grace: cli.preemption_grace,
        max_restarts: cli.max_restarts,
        staging_checked: std::sync::atomic::AtomicBool::new(false),
    };

    let cancel_all = CancellationToken::new();
    let bucket_latest = sink
        .latest_step(&cancel_all)
        .await
        .with_context(|| format!("read the newest committed step at {}", sink.url()))?;
    if let Some(step) = bucket_latest {
        tracing::info!(step, url = %sink.url(), "newest committed step in the checkpoint store");
    }
    let mut membership = match mode {
        Mode::Standalone | Mode::Static => {
            let master_port = match (mode, cli.master_port) {
                (_, Some(p)) => p,
                (Mode::Static, None) => crate::cli::MASTER_PORT_DEFAULT,
                _ => free_port().context("no free port for the master")?,
            };
            let (node_rank, node_count, master_addr) = match mode {
                Mode::Static => (cli.node_rank, cli.nnodes.max, cli.master_addr.clone()),
                _ => (0, 1, "127.0.0.1".to_string()),
            };
            let world = nproc.saturating_mul(node_count);
            let s =
                scaling::decide(&node.scaling, world, None).map_err(|e| usage(e.to_string()))?;
            Membership::Fixed(GenerationView {
                generation: 0,
                world_size: world,
                node_rank,
                node_count,
                rank_offset: node_rank * nproc,
                master_addr,
                master_port,
                scaling: s,
                resume: None,
            })
        }
        Mode::Etcd => {
            let cfg = rdzv_cfg.expect("etcd mode has a rendezvous config");
            let mut m = EtcdMember::join(cfg, &events).await?;
            state
                .metrics
                .has_lease
                .store(true, std::sync::atomic::Ordering::Relaxed);
            fenced_metrics(&state, false);
            m.bucket_latest = bucket_latest;
            if let Some(step) = bucket_latest {
                m.report(step).await;
            }
            Membership::Etcd(Box::new(m))
        }
    };

    let mut committer = Committer::start(&node, bucket_latest);
    let mut tracker = StepTracker::new(0..0);
    let mut drain: Option<Drain> = None;
    // An Azure event to approve once this node's drain is done.
    let mut approval: Option<notice::Approval> = None;
    let mut restarts: u32 = 0;
    let mut last_step_reached: Option<u64> = None;
    // Time-based checkpoints: ask for the step after the newest one reported.
    let mut checkpoint_timer = cli.checkpoint_every.map(|every| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });

    let code: u8 = 'job: loop {
        // ---- A: the generation to run next -------------------------------------------------
        let (mut view, running_gen) = match &mut membership {
            Membership::Fixed(v) => {
                let mut v = v.clone();
                v.resume = None;
                (v, None)
            }
            Membership::Etcd(m) => {
                match wait_generation(&node, m, &mut signals, &mut notices, &committer).await? {
                    Next::Run(v, g) => (*v, g),
                    Next::Exit(code) => break 'job code,
                }
            }
        };
        // ---- B: restore the step this generation resumes from -------------------------------
        let resume_step = match &membership {
            Membership::Fixed(_) => committer.latest(),
            Membership::Etcd(m) => running_gen
                .as_ref()
                .and_then(|g| g.resume_step)
                .or(m.bucket_latest),
        };
        remove_staged(&node.spec.staging_dir);
        if let Some(step) = resume_step {
            let ranks = view.rank_offset..view.rank_offset + nproc;
            let t0 = Instant::now();
            // A failure that says nothing about the step (a full staging disk, the store
            // briefly away) is retried with a bounded backoff; one that does was already
            // answered inside by falling back to an older step.
            let mut attempt = 1u32;
            let mut backoff_ms = RESTORE_BACKOFF_INITIAL_MS;
            let point = loop {
                let r = tokio::select! {
                    r = node.sink.restore_or_older(step, ranks.clone(), view.world_size, &cancel_all) => r,
                    Some(sig) = signals.recv() => {
                        tracing::warn!(signal = sig, "signal while restoring; leaving");
                        break 'job leave(&mut membership).await;
                    }
                };
                match r {
                    Ok((point, skipped)) => {
                        if !skipped.is_empty() {
                            node.events.emit(
                                "restore_fell_back",
                                json!({"generation": view.generation, "skipped": skipped, "step": point.step}),
                            );
                        }
                        break point;
                    }
                    Err(e) if restore_is_retryable(&e) && attempt < RESTORE_ATTEMPTS_MAX => {
                        tracing::warn!(step, attempt, backoff_ms, error = %e, "restore failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_millis(backoff_ms)) => {}
                            Some(sig) = signals.recv() => {
                                tracing::warn!(signal = sig, "signal while restoring; leaving");
                                break 'job leave(&mut membership).await;
                            }
                        }
                        attempt += 1;
                        backoff_ms = (backoff_ms * 2).min(RESTORE_BACKOFF_MAX_MS);
                    }
                    Err(e) => {
                        return Err(e).with_context(|| {
                            format!(
                                "restore step {step} from {} ({attempt} attempts)",
                                node.sink.url()
                            )
                        });
                    }
                }
            };
            tracing::info!(step, dir = %point.dir.display(), ms = t0.elapsed().as_millis() as u64, "restored");
            view.resume = Some(point);
        }
        let gen_key = view.generation;
        state
            .metrics
            .generations_total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        emit_generation(&node, &view, running_gen.as_deref(), last_step_reached);

        // ---- C: run one worker group ---------------------------------------------------------
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let mut sup_cfg = node.sup_cfg.clone();
        sup_cfg.first_restart = restarts;
        let mut sup = tokio::spawn(
            supervisor::run(
                sup_cfg,
                node.spec.clone(),
                view.clone(),
                state.clone(),
                cmd_rx,
            )
            .in_current_span(),
        );
        node.events.emit(
            "workers_started",
            json!({"generation": view.generation, "restart_count": restarts}),
        );
        let mut first_step_seen = false;
        let mut first_step_poll = tokio::time::interval(Duration::from_millis(FIRST_STEP_POLL_MS));
        let mut stop_why: Option<StopWhy> = None;
        let mut committed_rx = committer.committed.clone();
        let mut snap_rx = match &membership {
            Membership::Etcd(m) => Some(m.snap.clone()),
            Membership::Fixed(_) => None,
        };
        if let Some(rx) = snap_rx.as_mut() {
            rx.mark_changed();
        }
        // A complete step waiting for room in the commit queue.
        let mut held: Option<StepToCommit> = None;
        let outcome = loop {
            tokio::select! {
                out = &mut sup => break out.context("supervisor task")?,
                Some(sig) = signals.recv() => {
                    if drain.is_none_or(|d| !d.local) {
                        tracing::warn!(signal = sig, "signal received; draining");
                        node.events.emit("drain_started", json!({"reason": "signal"}));
                        drain = Some(start_drain(&node, &membership, &cmd_tx, true).await);
                    } else {
                        tracing::warn!(signal = sig, "second signal; forwarding it to the workers");
                        let _ = cmd_tx.send(Command::Signal(sig)).await;
                    }
                }
                Some(n) = notices.recv() => match n {
                    notice::Notice::Preempt { why, approval: a } => {
                        approval = a.or(approval.take());
                        if drain.is_none_or(|d| !d.local) {
                            tracing::warn!(notice = %why, "preemption notice; draining");
                            node.events.emit("drain_started", json!({"reason": "notice"}));
                            drain = Some(start_drain(&node, &membership, &cmd_tx, true).await);
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
                    if let Some(step) = tracker_complete(&node, &view, &mut tracker, r) {
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
                        node.events.emit("first_step", json!({"generation": view.generation, "step": step}));
                    }
                }
                Ok(()) = committed_rx.changed(), if matches!(membership, Membership::Etcd(_)) => {
                    let latest = committer.latest();
                    if let (Membership::Etcd(m), Some(step)) = (&mut membership, latest) {
                        m.report(step).await;
                    }
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
                        tracing::warn!(?why, "stopping the workers");
                        stop_why = Some(why);
                        let _ = cmd_tx.send(Command::Stop).await;
                    } else if drain.is_none() {
                        let peer_draining = snap.draining.iter().any(|n| *n != node.node_id && g.member(n).is_some());
                        if peer_draining {
                            tracing::warn!(draining = ?snap.draining, "a peer is draining; saving and stopping with it");
                            node.events.emit("drain_started", json!({"reason": "peer"}));
                            drain = Some(start_drain(&node, &membership, &cmd_tx, false).await);
                        }
                    }
                }
                e = async {
                    match &membership {
                        Membership::Etcd(m) if m.handle.is_some() => {
                            m.handle.as_ref().expect("checked").fenced().await
                        }
                        _ => std::future::pending().await,
                    }
                }, if stop_why.is_none() => {
                    tracing::error!(error = %e, "fenced: stopping the workers before peers re-form the job");
                    node.events.emit("fenced", json!({"reason": e.to_string()}));
                    fenced_metrics(&node.state, true);
                    stop_why = Some(StopWhy::Fenced);
                    let _ = cmd_tx.send(Command::Stop).await;
                }
            }
        };
        drop(cmd_tx);
        last_step_reached = state.last_step().or(last_step_reached);
        // Parts reported just before the workers exited are already queued: hand them over,
        // waiting for queue room as long as this ending allows (a drain's last checkpoint is
        // the one that matters most).
        let handover_limit = match (&drain, &outcome) {
            (Some(d), _) if d.local => node.grace.saturating_sub(d.started.elapsed()),
            (_, Outcome::Succeeded) => Duration::from_millis(FLUSH_TIMEOUT_MS),
            _ => Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
        };
        let handover_deadline = Instant::now() + handover_limit;
        if let Some(step) = held.take() {
            committer.submit_until(step, handover_deadline).await;
        }
        while let Ok(r) = parts_rx.try_recv() {
            if let Some(step) = tracker_complete(&node, &view, &mut tracker, r) {
                committer.submit_until(step, handover_deadline).await;
            }
        }

        // ---- D: what now -----------------------------------------------------------------------
        // A local drain ends the node however the workers ended: commit what they staged, say
        // so, leave.
        if let Some(d) = drain.filter(|d| d.local) {
            let clean = matches!(
                outcome,
                Outcome::Succeeded | Outcome::Drained { clean: true }
            );
            if let Outcome::Failed(f) = &outcome {
                tracing::warn!(
                    rank = f.rank,
                    exit_code = f.exit_code,
                    "a worker failed while draining"
                );
            }
            let flushed = flush(
                &mut committer,
                node.grace.saturating_sub(d.started.elapsed()),
            )
            .await;
            if let Membership::Etcd(m) = &mut membership
                && let Some(step) = committer.latest()
            {
                m.report(step).await;
            }
            let step = committer.latest();
            let _ = leave(&mut membership).await;
            // Committed (or out of grace) and gone from the job: the machine may go now.
            if let Some(a) = approval.take() {
                notice::approve(&a, &state.metrics).await;
            }
            if clean && flushed {
                tracing::info!(step, "drained: workers saved and exited");
                break 'job 0;
            }
            tracing::error!(
                workers_clean = clean,
                checkpoints_flushed = flushed,
                "drain incomplete"
            );
            break 'job 128 + libc::SIGTERM as u8;
        }
        match outcome {
            Outcome::Succeeded
                if drain.is_none()
                    && (state.peer_stop().is_none()
                        || matches!(membership, Membership::Fixed(_))) =>
            {
                tracing::info!("workers finished");
                let flushed = flush(&mut committer, Duration::from_millis(FLUSH_TIMEOUT_MS)).await;
                if let Membership::Etcd(m) = &mut membership {
                    if let Some(step) = committer.latest() {
                        m.report(step).await;
                    }
                    if let Some(h) = &m.handle
                        && let Err(e) = h.finish(true).await
                    {
                        tracing::warn!(error = %e, "cannot mark the job finished");
                    }
                }
                let _ = leave(&mut membership).await;
                break 'job if flushed { 0 } else { 1 };
            }
            Outcome::Succeeded | Outcome::Drained { .. }
                if drain.is_some() || state.peer_stop().is_some() =>
            {
                // A peer's drain: our workers saved the agreed step too; commit it and wait
                // for the generation without the peer. The workers may be the first to know
                // (they agree on stopping among themselves while etcd is unreachable).
                if drain.is_none() {
                    tracing::warn!(
                        step = state.peer_stop(),
                        "workers stopped for a drain of another node that this one did not hear of; waiting for the next generation"
                    );
                }
                let clean = matches!(
                    outcome,
                    Outcome::Succeeded | Outcome::Drained { clean: true }
                );
                let _ = flush(&mut committer, node.grace).await;
                if let Membership::Etcd(m) = &mut membership
                    && let Some(step) = committer.latest()
                {
                    m.report(step).await;
                }
                tracing::info!(
                    step = committer.latest(),
                    clean,
                    "peer drain done; waiting for the next generation"
                );
                drain = None;
                continue 'job;
            }
            Outcome::Succeeded | Outcome::Drained { .. } => {
                tracing::error!("workers drained without a drain");
                let _ = leave(&mut membership).await;
                break 'job 1;
            }
            Outcome::Stopped => {
                drain = None;
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if stop_why == Some(StopWhy::Fenced)
                    && let Membership::Etcd(m) = &mut membership
                {
                    if let Some(h) = m.handle.take() {
                        drop(h);
                    }
                    m.rejoin(&node.events).await?;
                    fenced_metrics(&node.state, false);
                }
                continue 'job;
            }
            Outcome::Failed(f) => {
                node.events.emit(
                    "worker_failed",
                    json!({"generation": view.generation, "rank": f.rank, "exit_code": f.exit_code}),
                );
                if drain.is_some() {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "a worker failed during a peer's drain"
                    );
                    let _ = flush(&mut committer, node.grace).await;
                    drain = None;
                    continue 'job;
                }
                let counted = match &mut membership {
                    Membership::Fixed(_) => true,
                    Membership::Etcd(m) => {
                        let g = running_gen.clone().expect("etcd generations");
                        failure_counts(m, &g, &mut signals).await
                    }
                };
                if !counted {
                    tracing::warn!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        "worker failed with a membership change; not counted as a restart"
                    );
                    committer
                        .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                        .await;
                    continue 'job;
                }
                if restarts >= node.max_restarts {
                    tracing::error!(
                        rank = f.rank,
                        exit_code = f.exit_code,
                        restarts,
                        "job failed"
                    );
                    eprintln!("elastic-run: {f}");
                    let _ = flush(
                        &mut committer,
                        Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS),
                    )
                    .await;
                    if let Membership::Etcd(m) = &mut membership
                        && let Some(h) = &m.handle
                        && let Err(e) = h.finish(false).await
                    {
                        tracing::warn!(error = %e, "cannot mark the job failed");
                    }
                    let _ = leave(&mut membership).await;
                    break 'job u8::try_from(f.exit_code)
                        .ok()
                        .filter(|c| *c != 0)
                        .unwrap_or(1);
                }
                restarts += 1;
                supervisor::note_restart(&state, &f, restarts, node.max_restarts);
                committer
                    .settle(Duration::from_millis(BETWEEN_GENERATIONS_FLUSH_MS))
                    .await;
                if let Membership::Etcd(m) = &mut membership
                    && let Some(h) = &m.handle
                    && let Err(e) = h.request_restart(gen_key, &f.to_string()).await
                {
                    tracing::warn!(error = %e, "cannot request a restart generation");
                }
                continue 'job;
            }
        }
    };

    node.events.emit("exit", json!({"code": code}));
    let _ = committer
        .finish(Duration::from_millis(OUTPUT_FLUSH_MS))
        .await;
    let _ = shutdown_tx.send(true);
    let _ = server.await;
    crate::output::flush(Duration::from_millis(OUTPUT_FLUSH_MS)).await;
    if let Some(m) = metrics_server {
        let _ = m.await;
    }
    drop(run_dir);
    drop(staging_guard);
    Ok(code)
}

/// Waits for the next generation that includes this node (etcd mode).
async fn wait_generation(
    node: &Node,
    m: &mut EtcdMember,
    signals: &mut mpsc::Receiver<i32>,
    notices: &mut mpsc::Receiver<notice::Notice>,
    committer: &Committer,
) -> Result<Next> {
    loop {
        if m.handle.is_none() {
            m.rejoin(&node.events).await?;
            fenced_metrics(&node.state, false);
        }
        let mut committed = committer.committed.clone();
        let h = m.handle.as_mut().expect("joined");
        let r = tokio::select! {
            r = h.next_generation() => r,
            Some(sig) = signals.recv() => {
                tracing::warn!(signal = sig, "signal while no workers run; leaving");
                node.events.emit("drain_started", json!({"reason": "signal"}));
                return Ok(Next::Exit(leave_etcd(m).await));
            }
            Some(n) = notices.recv() => {
                let notice::Notice::Preempt { why, approval } = n else {
                    // A rebalance recommendation: nothing runs, so nothing to checkpoint.
                    continue;
                };
                tracing::warn!(notice = %why, "preemption notice while no workers run; leaving");
                node.events.emit("drain_started", json!({"reason": "notice"}));
                let code = leave_etcd(m).await;
                if let Some(a) = approval {
                    notice::approve(&a, &node.state.metrics).await;
                }
                return Ok(Next::Exit(code));
            }
            Ok(()) = committed.changed() => {
                if let Some(step) = *committed.borrow() {
                    m.report(step).await;
                }
                continue;
            }
        };
        match r {
            Ok(g) => {
                let view = generation_view(node, &g)?;
                return Ok(Next::Run(Box::new(view), Some(Arc::new(g))));
            }
            Err(elastic::Error::JobFinished { success, .. }) => {
                tracing::info!(success, "the job is over");
                let _ = leave_etcd(m).await;
                return Ok(Next::Exit(if success { 0 } else { 1 }));
            }
            Err(elastic::Error::JobFailed { reason, .. }) => {
                tracing::error!(%reason, "the job failed");
                eprintln!("elastic-run: job failed: {reason}");
                let _ = leave_etcd(m).await;
                return Ok(Next::Exit(1));
            }
            Err(e @ elastic::Error::Fenced { .. }) => {
                tracing::error!(error = %e, "fenced while waiting; joining again");
                node.events.emit("fenced", json!({"reason": e.to_string()}));
                fenced_metrics(&node.state, true);
                m.handle = None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "waiting for a generation failed; retrying");
                tokio::time::sleep(Duration::from_millis(REJOIN_PAUSE_MS)).await;
            }
        }
    }
}

/// This node's view of an etcd generation.
fn generation_view(node: &Node, g: &Generation) -> Result<GenerationView> {
    let Some((rank, me)) = g.member(&node.node_id) else {
        bail!("generation {} does not include this node", g.number);
    };
    if me.nproc != node.nproc {
        bail!(
            "generation {} lists {} workers for this node, it runs {}",
            g.number,
            me.nproc,
            node.nproc
        );
    }
    Ok(GenerationView {
        generation: g.number,
        world_size: g.world_size,
        node_rank: rank as u32,
        node_count: g.members.len() as u32,
        rank_offset: me.rank_offset,
        master_addr: g.master_addr.clone(),
        master_port: g.master_port,
        scaling: scaling::from_decision(&g.scaling, &node.scaling),
        resume: None,
    })
}

/// `prev_last_step`: the highest step this node's workers reported before this generation
/// (what a fault cost is that minus the resume step).
fn emit_generation(
    node: &Node,
    view: &GenerationView,
    g: Option<&Generation>,
    prev_last_step: Option<u64>,
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
    node.events.emit(
        "generation",
        json!({
            "generation": view.generation,
            "world_size": view.world_size,
            "node_rank": view.node_rank,
            "rank_offset": view.rank_offset,
            "members": members,
            "lr_scale": s.lr_scale,
            "lr": s.lr,
            "batch_size": s.batch_size,
            "global_batch": s.global_batch,
            "grad_accum_steps": s.grad_accum_steps,
            "resume_step": view.resume.as_ref().map(|r| r.step),
            "prev_last_step": prev_last_step,
        }),
    );
}

/// Whether the running generation `g` must stop now, given what etcd shows.
fn must_stop(snap: &Snapshot, g: &Generation) -> Option<StopWhy> {
    if let Some(newest) = &snap.generation
        && (newest.number, newest.created_unix_ms) != (g.number, g.created_unix_ms)
        && newest.created_unix_ms >= g.created_unix_ms
    {
        return Some(StopWhy::NewGeneration);
    }
    if snap
        .waiting
        .as_ref()
        .is_some_and(|w| w.generation == g.number)
    {
        return Some(StopWhy::Waiting);
    }
    if snap
        .job_state
        .as_ref()
        .is_some_and(|s| s.outcome == elastic::record::Outcome::Failed)
    {
        return Some(StopWhy::JobFailed);
    }
    None
}

/// After a worker failure in etcd mode: waits for a membership change. Returns whether the
/// failure counts as a restart (no change, or a restart generation with the same members).
async fn failure_counts(
    m: &mut EtcdMember,
    g: &Generation,
    signals: &mut mpsc::Receiver<i32>,
) -> bool {
    let limit = m.settle_for_failure();
    let mut rx = m.snap.clone();
    let same = |snap: &Snapshot| -> Option<bool> {
        let newest = snap.generation.as_ref()?;
        if newest.number == g.number && newest.created_unix_ms == g.created_unix_ms {
            return None;
        }
        let a: BTreeSet<String> = newest.node_ids().into_iter().collect();
        let b: BTreeSet<String> = g.node_ids().into_iter().collect();
        Some(a == b)
    };
    let wait = async {
        loop {
            if let Some(s) = same(&rx.borrow_and_update()) {
                return s;
            }
            if rx.changed().await.is_err() {
                return true;
            }
        }
    };
    tokio::select! {
        s = tokio::time::timeout(limit, wait) => s.unwrap_or(true),
        // A signal now: let the next wait handle it (it leaves); count nothing.
        Some(_) = signals.recv() => false,
    }
}

/// Records a lost lease (`fenced`) or a live one.
fn fenced_metrics(state: &AgentState, fenced: bool) {
    use std::sync::atomic::Ordering::Relaxed;
    state
        .metrics
        .lease_healthy
        .store(u64::from(!fenced), Relaxed);
    if fenced {
        state.metrics.fences_total.fetch_add(1, Relaxed);
    }
}

/// Starts a drain: `local` when this node leaves (announced to peers first), else a peer's.
async fn start_drain(
    node: &Node,
    membership: &Membership,
    cmds: &mpsc::Sender<Command>,
    local: bool,
) -> Drain {
    let now = Instant::now();
    if local
        && let Membership::Etcd(m) = membership
        && let Some(h) = &m.handle
        && let Err(e) = h.request_drain().await
    {
        tracing::warn!(error = %e, "cannot announce the drain to peers");
    }
    node.state.request_stop();
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
    Drain {
        started: now,
        local,
    }
}

async fn flush(committer: &mut Committer, limit: Duration) -> bool {
    committer.settle(limit).await
}

/// Leaves the job at once (revoking the lease) in etcd mode; returns exit code 0.
async fn leave(membership: &mut Membership) -> u8 {
    match membership {
        Membership::Etcd(m) => leave_etcd(m).await,
        Membership::Fixed(_) => 0,
    }
}

async fn leave_etcd(m: &mut EtcdMember) -> u8 {
    if let Some(h) = m.handle.take()
        && let Err(e) = h.leave().await
    {
        tracing::warn!(error = %e, "leaving the job failed; peers see it after the lease TTL");
    }
    0
}

/// Records a saved part; returns the step once every local rank has staged it.
fn tracker_complete(
    node: &Node,
    view: &GenerationView,
    tracker: &mut StepTracker,
    r: Received,
) -> Option<StepToCommit> {
    let world = r.world_size;
    let generation = r.generation;
    if let Some(why) = r.skipped {
        give_up_step(node, generation, r.part.rank, r.part.step, why);
        return None;
    }
    let parts = tracker.record_received(r.epoch, r.ranks, r.part)?;
    let step = parts[0].step;
    tracing::info!(step, ranks = parts.len(), "step staged by every local rank");
    if !node
        .staging_checked
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        check_staging_room(node, step, &parts);
    }
    let s = &view.scaling;
    let agent_metadata = json!({
        "generation": generation,
        "world_size": world,
        "node": node.node_id,
        "mode": format!("{:?}", node.mode).to_lowercase(),
        "scaling": {
            "lr_scale": s.lr_scale,
            "lr": s.lr,
            "batch_size": s.batch_size,
            "global_batch": s.global_batch,
            "grad_accum_steps": s.grad_accum_steps,
        },
    });
    Some(StepToCommit {
        step,
        generation,
        world_size: world,
        parts,
        agent_metadata,
    })
}

/// Says so, with the sizes, when the staging file system cannot hold
/// [`STAGED_CHECKPOINTS_MAX`] checkpoints the size of this first one (Docker's default
/// `/dev/shm` is 64 MiB): checkpoints are then skipped whenever it fills.
fn check_staging_room(node: &Node, step: u64, parts: &[crate::agent_socket::StagedPart]) {
    let bytes: u64 = parts
        .iter()
        .flat_map(|p| std::fs::read_dir(&p.dir).into_iter().flatten().flatten())
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum();
    let Some(fs_bytes) = fs_size_bytes(&node.spec.staging_dir) else {
        return;
    };
    let needed = bytes.saturating_mul(STAGED_CHECKPOINTS_MAX);
    if needed > fs_bytes {
        tracing::warn!(
            step,
            checkpoint_bytes = bytes,
            staging_bytes = fs_bytes,
            needed_bytes = needed,
            staging = %node.spec.staging_dir.display(),
            "the staging file system holds fewer than {STAGED_CHECKPOINTS_MAX} checkpoints of this node \
             ({bytes} bytes each, {fs_bytes} in all): when it fills, workers skip their snapshot \
             and that checkpoint is given up; give --staging-dir a larger file system \
             (or docker --shm-size) to keep every checkpoint"
        );
        node.events.emit(
            "staging_too_small",
            json!({"step": step, "checkpoint_bytes": bytes, "staging_bytes": fs_bytes, "needed_bytes": needed}),
        );
    }
}

/// The size of the file system holding `dir`.
fn fs_size_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value for statvfs to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid NUL-terminated path and a writable buffer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_blocks as u64).saturating_mul(st.f_frsize as u64))
}

/// A local rank could not stage its part of `step` (a full staging disk): the step can never
/// commit, so say so in the store, where every node's committer sees it at its next try and
/// stops waiting for the part instead of holding the commit queue until its deadline.
fn give_up_step(node: &Node, generation: u64, rank: u32, step: u64, why: String) {
    tracing::warn!(step, rank, reason = %why, "a worker skipped its snapshot; giving the checkpoint up");
    node.state
        .metrics
        .checkpoint_failures_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    node.events.emit(
        "checkpoint_skipped",
        json!({"step": step, "generation": generation, "rank": rank, "reason": why}),
    );
    let store = node.sink.store().clone();
    let writer = crate::store_sink::writer_id(generation, rank);
    tokio::spawn(
        async move {
            let cancel = CancellationToken::new();
            let deadline = Duration::from_millis(GIVE_UP_DEADLINE_MS);
            match tokio::time::timeout(deadline, store.abandon_part(step, &writer, &why, &cancel))
                .await
            {
                Ok(Ok(())) => tracing::info!(step, %writer, "checkpoint given up in the store"),
                Ok(Err(e)) => tracing::warn!(step, %writer, error = %e, "could not mark the checkpoint as given up (peers wait for its part until their commit deadline)"),
                Err(_) => tracing::warn!(step, %writer, "marking the checkpoint as given up timed out"),
            }
        }
        .in_current_span(),
    );
}

/// Commits complete steps in order; returns whether every commit succeeded.
async fn commit_loop(
    sink: Arc<StoreSink>,
    mut steps: mpsc::Receiver<(StepToCommit, CancellationToken)>,
    state: Arc<AgentState>,
    staging: PathBuf,
    events: Arc<Events>,
    committed: watch::Sender<Option<u64>>,
    pending: Arc<watch::Sender<usize>>,
) -> bool {
    let mut ok = true;
    while let Some((s, cancel)) = steps.recv().await {
        let (step, generation) = (s.step, s.generation);
        let staged: Vec<StagedPart> = s.parts.clone();
        let t0 = Instant::now();
        let result = if cancel.is_cancelled() {
            None
        } else {
            Some(sink.commit(s, &cancel).await)
        };
        match result {
            Some(Ok(done)) => {
                tracing::info!(
                    step,
                    bytes = done.bytes,
                    by_this_node = done.by_this_node,
                    ms = t0.elapsed().as_millis() as u64,
                    "checkpoint committed"
                );
                state.metrics.committed(step, done.bytes, t0.elapsed());
                events.emit(
                    "checkpoint_committed",
                    json!({"step": step, "generation": generation, "bytes": done.bytes, "by_this_node": done.by_this_node}),
                );
                committed.send_modify(|c| {
                    if c.is_none_or(|c| c < step) {
                        *c = Some(step);
                    }
                });
            }
            Some(Err(e)) => {
                ok = false;
                state
                    .metrics
                    .checkpoint_failures_total
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match &e {
                    crate::store_sink::SinkError::Commit { source, .. }
                        if matches!(**source, checkpoint::Error::Abandoned { .. }) =>
                    {
                        tracing::warn!(step, error = %e, "checkpoint given up: a rank could not stage it");
                    }
                    crate::store_sink::SinkError::Commit { source, .. }
                        if matches!(**source, checkpoint::Error::Rejected { .. }) =>
                    {
                        tracing::error!(step, error = %e, "checkpoint commit failed");
                        // Retrying cannot help: tell the workers at their next save.
                        state.refuse_next_save(format!("checkpoint not committed: {source}"));
                    }
                    _ => tracing::error!(step, error = %e, "checkpoint commit failed"),
                }
            }
            None => tracing::warn!(step, "checkpoint commit cancelled"),
        }
        // The staged copy is no longer needed either way: committed, or given up.
        // Only a real directory inside staging: never one reached through a symlink.
        if let Some(p) = staged.first().and_then(|p| p.dir.parent()) {
            remove_inside_staging(&staging, p);
        }
        pending.send_modify(|n| *n = n.saturating_sub(1));
    }
    ok
}

/// Frees staging space between worker groups: every `step-N` left there was committed or
/// abandoned (the committer is idle when this runs).
fn remove_staged(staging: &Path) {
    let Ok(entries) = std::fs::read_dir(staging) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_str().is_some_and(|n| n.starts_with("step-")) {
            // A symlink named `step-N`, or another user's dir, is not the agent's to remove.
            remove_own_dir_all(&e.path());
        }
    }
}

/// Standalone when asked, or when one node runs with no rendezvous endpoint (torchrun's rule).
pub fn is_standalone(cli: &Cli) -> bool {
    cli.standalone || (cli.nnodes.max == 1 && cli.rdzv_endpoint.is_empty())
}

/// `--rdzv-endpoint`'s comma-separated list, blanks dropped.
pub fn split_endpoints(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(String::from)
        .collect()
}

/// This host's name when it resolves to an address, else the loopback address.
fn default_local_addr() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim();
    if !host.is_empty()
        && std::net::ToSocketAddrs::to_socket_addrs(&(host, 0))
            .is_ok_and(|mut a| a.next().is_some())
    {
        host.to_string()
    } else {
        "127.0.0.1".to_string()
    }
}

/// The worker command line, torchrun-style: a `*.py` script (or `--run-path`) runs under
/// `python -u`, `-m` runs a module, `--no-python` and any other program run as given.
pub fn worker_argv(cli: &Cli) -> Result<Vec<String>> {
    let cmd = &cli.cmd;
    let Some(first) = cmd.first() else {
        bail!(UsageError("no training command given".into()))
    };
    let py = |extra: &[&str]| -> Vec<String> {
        let mut v = vec![cli.python.clone(), "-u".to_string()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend(cmd.iter().cloned());
        v
    };
    Ok(if cli.no_python {
        cmd.clone()
    } else if cli.module {
        py(&["-m"])
    } else if cli.run_path || first.ends_with(".py") {
        py(&[])
    } else {
        cmd.clone()
    })
}

fn resolve_nproc(n: NProc) -> Result<u32> {
    let cpus = || {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1)
    };
    let gpus = visible_gpus();
    let n = match n {
        NProc::Count(n) => n,
        NProc::Cpu => cpus(),
        NProc::Auto if gpus > 0 => gpus,
        NProc::Auto => cpus(),
        NProc::Gpu if gpus > 0 => gpus,
        NProc::Gpu => bail!(UsageError("--nproc-per-node gpu: no GPU is visible".into())),
    };
    Ok(n.min(crate::cli::NPROC_PER_NODE_MAX))
}

/// GPUs the workers could use: `CUDA_VISIBLE_DEVICES` when set, else the NVIDIA driver's list.
fn visible_gpus() -> u32 {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .filter(|s| !s.trim().is_empty() && s.trim() != "-1")
            .count() as u32;
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|d| d.count() as u32)
        .unwrap_or(0)
}

fn default_node_id() -> String {
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "node".into());
    format!("{}-{}", host.trim(), std::process::id())
}

fn free_port() -> std::io::Result<u16> {
    // The port is free now; the workers bind it moments later (torchrun does the same).
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

/// The staging directory: `--staging-dir`, else `/dev/shm/elastic-run/<run>/<node>` (the
/// temp dir when there is no /dev/shm). Canonical, since `saved` directories are checked
/// against it. /dev/shm is world-writable, so every directory the agent makes there is
/// made without following symlinks, mode 0700, and checked to be a real directory of this
/// user; a symlink or another user's directory on the way is refused. On exit the agent
/// removes only the directories it created: what is left in its node dir was never
/// committed, and /dev/shm is memory. A `--staging-dir` is never removed.
struct Staging {
    path: PathBuf,
    /// The directories this agent created, outermost first.
    created: Vec<PathBuf>,
}

impl Staging {
    fn prepare(dir: Option<&Path>, run_id: &str, node_id: &str) -> Result<Self> {
        if let Some(d) = dir {
            return Self::given(d);
        }
        let root = Path::new(crate::cli::STAGING_ROOT_DEFAULT);
        let top = root.file_name().unwrap_or("elastic-run".as_ref());
        let base = match root.parent() {
            Some(shm) if shm.is_dir() => shm.to_path_buf(),
            _ => std::env::temp_dir(),
        };
        let name = |s: &str| match sanitize(s) {
            s if s.is_empty() => "_".to_string(),
            s => s,
        };
        Self::under(&base, [top, name(run_id).as_ref(), name(node_id).as_ref()])
    }

    /// A user-given `--staging-dir`: created 0700 when absent; refused when it is a symlink
    /// or another user's. Symlinks above it are the user's own choice and are resolved.
    fn given(d: &Path) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::symlink_metadata(d) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .with_context(|| format!("create staging dir {}", d.display()))?,
            Err(e) => {
                return Err(e).with_context(|| format!("staging dir {}", d.display()));
            }
            Ok(_) => {}
        }
        check_own_dir(d)?;
        let path =
            std::fs::canonicalize(d).with_context(|| format!("staging dir {}", d.display()))?;
        Ok(Staging {
            path,
            created: Vec::new(),
        })
    }

    /// `base/a/b/c`, each part made (0700) or found as a real directory of this user.
    /// `base` is the system's (/dev/shm or the temp dir) and is taken as it resolves.
    fn under(base: &Path, parts: [&std::ffi::OsStr; 3]) -> Result<Self> {
        let base = std::fs::canonicalize(base)
            .with_context(|| format!("staging base {}", base.display()))?;
        // Built as it goes, so that an error drops (and removes) what was made so far.
        let mut s = Staging {
            path: PathBuf::new(),
            created: Vec::new(),
        };
        let mut attempt = 0;
        'again: loop {
            attempt += 1;
            let mut dir = base.clone();
            for part in parts {
                dir.push(part);
                match make_own_dir(&dir) {
                    Ok(true) => s.created.push(dir.clone()),
                    Ok(false) => {}
                    // Another agent removed a parent it had made, between our steps.
                    Err(e)
                        if attempt < 5
                            && e.downcast_ref::<std::io::Error>()
                                .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
                    {
                        continue 'again;
                    }
                    Err(e) => return Err(e),
                }
            }
            s.path = dir;
            return Ok(s);
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Innermost first; the node dir goes with its contents, the shared ones above it
        // only once empty (remove_dir refuses non-empty ones, so other agents' dirs are safe).
        for d in self.created.iter().rev() {
            if *d == self.path {
                remove_own_dir_all(d);
            } else if std::fs::remove_dir(d).is_err() {
                break;
            }
        }
    }
}

/// Makes `dir` (mode 0700; its parent must already be checked), or finds it; either way it
/// must then be a real directory of this user. Returns whether it was made here. mkdir does
/// not follow a symlink in the last component, so a planted one is found, not followed.
fn make_own_dir(dir: &Path) -> Result<bool> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let made = match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context(format!("create staging dir {}", dir.display()))
            );
        }
    };
    check_own_dir(dir)?;
    if !made {
        // Ours already (an earlier agent of this user): keep it private.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod staging dir {}", dir.display()))?;
    }
    Ok(made)
}

/// `dir` must be a real directory (not a symlink) owned by this process's effective user.
fn check_own_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m =
        std::fs::symlink_metadata(dir).with_context(|| format!("staging dir {}", dir.display()))?;
    if m.file_type().is_symlink() {
        let to = std::fs::read_link(dir)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        bail!(
            "staging dir {} is a symlink{to}: refusing to follow it (another user may have planted it)",
            dir.display()
        );
    }
    if !m.is_dir() {
        bail!("staging dir {} is not a directory", dir.display());
    }
    let me = euid();
    if m.uid() != me {
        bail!(
            "staging dir {} is owned by uid {}, not by this user (uid {me}): refusing to use it",
            dir.display(),
            m.uid()
        );
    }
    Ok(())
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `p` is a real directory of this user (not a symlink to one).
fn is_own_real_dir(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == euid())
}

/// `remove_dir_all`, only when `p` itself is a real directory of this user (std's
/// remove_dir_all does not follow symlinks below it).
fn remove_own_dir_all(p: &Path) {
    if is_own_real_dir(p) {
        let _ = std::fs::remove_dir_all(p);
    }
}

/// Removes `p`, a directory strictly inside `staging`, when every component from `staging`
/// down to it is a real directory of this user: nothing reached through a symlink goes.
fn remove_inside_staging(staging: &Path, p: &Path) {
    let Ok(rest) = p.strip_prefix(staging) else {
        return;
    };
    if rest.as_os_str().is_empty()
        || rest
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return;
    }
    let mut d = staging.to_path_buf();
    for c in rest.components() {
        d.push(c);
        if !is_own_real_dir(&d) {
            return;
        }
    }
    let _ = std::fs::remove_dir_all(p);
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_string()
}

/// The agent's private directory (socket, error files), removed when the agent exits.
struct RunDir {
    path: PathBuf,
}

impl RunDir {
    /// Prefix of run dirs in the temp dir; the PID follows.
    const PREFIX: &'static str = "elastic-run-";

    fn create() -> Result<Self> {
        Self::remove_stale();
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Short path: a Unix socket path must fit in 108 bytes.
        let path =
            std::env::temp_dir().join(format!("elastic-run-{}-{nanos:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("create {}", path.display()))?;
        Ok(RunDir { path })
    }
}

impl RunDir {
    /// Removes run dirs of agents that are gone (a SIGKILLed agent cannot clean up after
    /// itself). Dirs of live PIDs are kept, so a reused PID errs on the side of keeping.
    fn remove_stale() {
        Self::remove_stale_in(&std::env::temp_dir());
    }

    /// The temp dir is shared: only real directories (not symlinks) of this user go.
    fn remove_stale_in(tmp: &Path) {
        let Ok(entries) = std::fs::read_dir(tmp) else {
            return;
        };
        for e in entries.flatten().take(10_000) {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(Self::PREFIX))
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            let dir = e.path();
            if !Path::new(&format!("/proc/{pid}")).exists()
                && is_own_real_dir(&dir)
                && dir.join("agent.sock").exists()
            {
                remove_own_dir_all(&dir);
            }
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_full_disk_or_an_unreachable_store_is_retried_but_bad_data_and_cancels_are_not() {
        use crate::store_sink::SinkError as E;
        let full = E::Io {
            op: "write",
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&full));
        let restore = |source| E::Restore {
            step: 7,
            rank: 0,
            world: 2,
            url: "file:///b".into(),
            source: Box::new(source),
        };
        let enospc = checkpoint::Error::Io {
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&restore(enospc)));
        let corrupt = checkpoint::Error::Corrupt {
            store: "file:///b".into(),
            step: 7,
            key: "k".into(),
            reason: "crc32c".into(),
        };
        assert!(!restore_is_retryable(&restore(corrupt)));
        assert!(!restore_is_retryable(&E::Cancelled { op: "x".into() }));
        assert!(!restore_is_retryable(&E::InvalidInput("x".into())));
    }

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("elastic-run").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn scripts_run_under_python_and_programs_run_as_given() {
        let argv = |a: &[&str]| worker_argv(&cli(a)).unwrap();
        assert_eq!(
            argv(&["train.py", "--lr", "1"]),
            ["python3", "-u", "train.py", "--lr", "1"]
        );
        assert_eq!(argv(&["--", "python", "train.py"]), ["python", "train.py"]);
        assert_eq!(
            argv(&["-m", "pkg.train", "x"]),
            ["python3", "-u", "-m", "pkg.train", "x"]
        );
        assert_eq!(argv(&["--no-python", "train.py"]), ["train.py"]);
        assert_eq!(
            argv(&["--run-path", "--python", "/v/py", "script"]),
            ["/v/py", "-u", "script"]
        );
    }

    #[test]
    fn standalone_follows_torchrun_rules() {
        assert!(is_standalone(&cli(&["x.py"])));
        assert!(is_standalone(&cli(&["--nnodes", "1", "x.py"])));
        assert!(is_standalone(&cli(&[
            "--standalone",
            "--nnodes",
            "2",
            "x.py"
        ])));
        assert!(!is_standalone(&cli(&["--nnodes", "1:4", "x.py"])));
        assert!(!is_standalone(&cli(&[
            "--nnodes",
            "1",
            "--rdzv-endpoint",
            "h:1",
            "x.py"
        ])));
    }

    #[test]
    fn staged_steps_are_removed_between_groups() {
        let tmp = tempfile::tempdir().unwrap();
        for s in ["step-5", "step-10", "step-11", "other"] {
            std::fs::create_dir_all(tmp.path().join(s).join("rank-0")).unwrap();
        }
        remove_staged(tmp.path());
        let mut left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["other"]);
    }

    #[test]
    fn node_ids_become_safe_path_parts() {
        assert_eq!(sanitize("../a/b c"), "_a_b_c");
        assert_eq!(sanitize("node-1.x"), "node-1.x");
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    fn parts<'a>(a: &'a str, b: &'a str, c: &'a str) -> [&'a std::ffi::OsStr; 3] {
        [a.as_ref(), b.as_ref(), c.as_ref()]
    }

    /// A directory holding a sentinel file, standing for one that is not the agent's.
    fn victim(root: &Path) -> PathBuf {
        let v = root.join("victim");
        std::fs::create_dir(&v).unwrap();
        std::fs::write(v.join("sentinel"), "keep me").unwrap();
        v
    }

    fn other_user_dir(p: &Path) {
        std::fs::create_dir_all(p).unwrap();
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }

    #[test]
    fn default_staging_dirs_are_made_private_and_removed_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n0")).unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        assert_eq!(s.path, root.join("elastic-run/job/n0"));
        for d in ["elastic-run", "elastic-run/job", "elastic-run/job/n0"] {
            assert_eq!(mode(&root.join(d)), 0o700, "{d}");
        }
        std::fs::create_dir_all(s.path.join("step-3/rank-0")).unwrap();
        drop(s);
        assert!(!root.join("elastic-run").exists());
    }

    #[test]
    fn a_symlink_planted_in_default_staging_is_refused_and_its_target_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let v = victim(tmp.path());
        // At the node dir: the issue as found.
        std::fs::create_dir_all(tmp.path().join("elastic-run/job")).unwrap();
        let node = tmp.path().join("elastic-run/job/n0");
        std::os::unix::fs::symlink(&v, &node).unwrap();
        let r = Staging::under(tmp.path(), parts("elastic-run", "job", "n0"));
        let e = format!("{:#}", r.as_ref().map(|_| ()).unwrap_err());
        drop(r);
        assert!(
            e.contains("symlink") && e.contains("elastic-run/job/n0"),
            "{e}"
        );
        assert!(v.join("sentinel").exists());
        assert!(std::fs::symlink_metadata(&node).unwrap().is_symlink());
        // At the shared root: refused too, and nothing is made through it.
        let tmp2 = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&v, tmp2.path().join("elastic-run")).unwrap();
        let r = Staging::under(tmp2.path(), parts("elastic-run", "job", "n0"));
        let e = format!("{:#}", r.as_ref().map(|_| ()).unwrap_err());
        drop(r);
        assert!(e.contains("symlink") && e.contains("elastic-run"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&v).unwrap().collect();
        assert_eq!(left.len(), 1, "only the sentinel");
    }

    #[test]
    fn a_default_staging_parent_of_another_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        other_user_dir(&tmp.path().join("elastic-run"));
        let e = Staging::under(tmp.path(), parts("elastic-run", "job", "n0"))
            .map(|_| ())
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("elastic-run") && e.contains("owned by uid 65534"),
            "{e}"
        );
        assert!(!tmp.path().join("elastic-run/job").exists());
    }

    #[test]
    fn staging_dirs_the_agent_did_not_create_are_kept_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let node = tmp.path().join("elastic-run/job/n0");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("mine"), "x").unwrap();
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n0")).unwrap();
        // Found, not made: ours, so kept private.
        assert_eq!(mode(&node), 0o700);
        drop(s);
        assert!(node.join("mine").exists());
        // Only the node dir made here goes; the parents found here stay.
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n1")).unwrap();
        drop(s);
        assert!(!tmp.path().join("elastic-run/job/n1").exists());
        assert!(node.join("mine").exists());
    }

    #[test]
    fn a_given_staging_dir_must_be_a_real_dir_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let v = victim(tmp.path());
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&v, &link).unwrap();
        let e = format!("{:#}", Staging::given(&link).map(|_| ()).unwrap_err());
        assert!(e.contains("symlink") && e.contains("link"), "{e}");
        let theirs = tmp.path().join("theirs");
        other_user_dir(&theirs);
        let e = format!("{:#}", Staging::given(&theirs).map(|_| ()).unwrap_err());
        assert!(e.contains("owned by uid 65534"), "{e}");
        let fresh = tmp.path().join("a/fresh");
        let s = Staging::given(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        drop(s);
        assert!(fresh.is_dir(), "a --staging-dir is never removed");
        assert!(v.join("sentinel").exists());
    }

    #[test]
    fn staged_copies_are_removed_only_as_real_dirs_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        std::fs::create_dir(&staging).unwrap();
        let v = victim(tmp.path());
        std::fs::create_dir(v.join("step-9")).unwrap();
        std::os::unix::fs::symlink(&v, staging.join("step-8")).unwrap();
        std::os::unix::fs::symlink(&v, staging.join("via")).unwrap();
        std::fs::create_dir_all(staging.join("step-7/rank-0")).unwrap();
        other_user_dir(&staging.join("step-7"));
        std::fs::create_dir_all(staging.join("step-6/rank-0")).unwrap();
        // The committer's removal of a step dir: not through a symlink, not a symlink.
        remove_inside_staging(&staging, &staging.join("via/step-9"));
        assert!(v.join("step-9").is_dir());
        remove_inside_staging(&staging, &staging.join("step-8"));
        remove_inside_staging(&staging, &staging);
        remove_inside_staging(&staging, &staging.join("../staging/step-6"));
        assert!(staging.join("step-6").is_dir());
        assert!(std::fs::symlink_metadata(staging.join("step-8")).is_ok());
        remove_inside_staging(&staging, &staging.join("step-6"));
        assert!(!staging.join("step-6").exists());
        // Between groups.
        remove_staged(&staging);
        assert!(std::fs::symlink_metadata(staging.join("step-8")).is_ok());
        assert!(staging.join("step-7/rank-0").is_dir());
        assert!(v.join("sentinel").exists() && v.join("step-9").is_dir());
    }

    #[test]
    fn stale_run_dirs_of_other_users_and_symlinks_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        // PIDs above the kernel's maximum (2^22): never alive.
        let stale = |n: &str| tmp.path().join(format!("{}{n}", RunDir::PREFIX));
        let with_sock = |d: &Path| {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("agent.sock"), "").unwrap();
        };
        with_sock(&stale("999999991-a"));
        with_sock(&stale("999999992-b"));
        std::os::unix::fs::chown(stale("999999992-b"), Some(65534), Some(65534)).unwrap();
        let v = victim(tmp.path());
        std::fs::write(v.join("agent.sock"), "").unwrap();
        std::os::unix::fs::symlink(&v, stale("999999993-c")).unwrap();
        RunDir::remove_stale_in(tmp.path());
        assert!(!stale("999999991-a").exists(), "this user's stale dir goes");
        assert!(stale("999999992-b").join("agent.sock").exists());
        assert!(std::fs::symlink_metadata(stale("999999993-c")).is_ok());
        assert!(v.join("sentinel").exists());
    }
}
