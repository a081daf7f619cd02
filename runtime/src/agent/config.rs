//! The agent's configuration from the command line: the membership mode, the scaling and
//! rendezvous configurations, how to reach etcd (TLS, auth), the worker command line, and
//! the defaults (node id, address, `--nproc-per-node`). Everything a user can get wrong is a
//! [`UsageError`] (exit 2).

use anyhow::{Result, bail};
use elastic::RendezvousConfig;

use crate::cli::{Cli, NProc, RdzvBackend};

/// A configuration the user must change: reported like a bad flag (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub(super) fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// How this node learns its generations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Standalone,
    Static,
    /// Membership in etcd v3 at `--rdzv-endpoint`; with `serve`, this agent serves that etcd
    /// itself when the endpoint is on its host (`--rdzv-backend c10d`).
    Etcd {
        serve: bool,
    },
}

/// The backend a command line means: `--rdzv-backend` when given; else etcd v3 for an
/// endpoint with an elastic `--nnodes MIN:MAX` (the product), else static (torchrun's default).
pub fn backend_of(cli: &Cli) -> RdzvBackend {
    match cli.rdzv_backend {
        Some(b) => b,
        None if !cli.rdzv_endpoint.trim().is_empty() && cli.nnodes.min != cli.nnodes.max => {
            RdzvBackend::EtcdV3
        }
        None => RdzvBackend::Static,
    }
}

impl Mode {
    pub fn of(cli: &Cli) -> Result<Mode> {
        if is_standalone(cli) {
            return Ok(Mode::Standalone);
        }
        let backend = backend_of(cli);
        match backend {
            RdzvBackend::Static => {
                if cli.nnodes.min != cli.nnodes.max {
                    return Err(usage(format!(
                        "--nnodes {}:{} needs an elastic backend: add --rdzv-endpoint HOST:PORT \
                         of an etcd (--rdzv-backend etcd-v3, the default with an endpoint), or \
                         --rdzv-backend c10d (static rendezvous takes a fixed --nnodes N)",
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
            RdzvBackend::EtcdV3 | RdzvBackend::C10d => {
                if cli.rdzv_endpoint.trim().is_empty() {
                    return Err(usage(format!(
                        "--rdzv-backend {} needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]",
                        backend.as_str()
                    )));
                }
                Ok(Mode::Etcd {
                    serve: backend == RdzvBackend::C10d,
                })
            }
        }
    }
}

/// The job's scaling configuration from the command line ([`Cli::scaling_config`]).
pub fn scaling_config(cli: &Cli, nproc: u32) -> elastic::ScalingConfig {
    cli.scaling_config(nproc)
}

/// Reads `--rdzv-conf` into the rendezvous configuration. Keys: `lease_ttl_ms`, `settle_ms`,
/// `join_policy` (`immediate`, `after_commit`, `waiting:K`), `below_min_timeout_ms`,
/// `confirm_window_ms` (how long a regroup after a failed collective waits for members to
/// confirm), `fence_margin_ms`, `request_timeout_ms`; torchrun's `join_timeout` and `timeout` (seconds:
/// how long the job may stay below `min`) and `last_call_timeout` (seconds: the settle
/// window) are honoured too, and its `keep_alive_interval` and `keep_alive_max_attempt` are
/// accepted and ignored; `is_host` and `read_timeout` are c10d's ([`c10d_config`]). How to reach
/// etcd (`protocol`, `cacert`, `cert`, `key`, and the user from the environment) is
/// [`etcd_connect`]'s.
pub fn rendezvous_config(
    cli: &Cli,
    node_id: &str,
    nproc: u32,
    scaling: &elastic::ScalingConfig,
) -> Result<RendezvousConfig> {
    scaling.validate().map_err(|e| usage(e.to_string()))?;
    // c10d's one endpoint, with torchrun's default port when it has none.
    let endpoint_list = match backend_of(cli) {
        RdzvBackend::C10d => c10d_config(cli)?.endpoint.host_port(),
        _ => cli.rdzv_endpoint.clone(),
    };
    let endpoints = split_endpoints(&endpoint_list);
    let addr = cli.local_addr.clone().unwrap_or_else(default_local_addr);
    let mut cfg = RendezvousConfig::new(
        endpoints,
        cli.rdzv_id.clone(),
        node_id.to_string(),
        addr,
        cli.nnodes.min,
        cli.nnodes.max,
        scaling.clone(),
    );
    cfg.nproc = nproc;
    cfg.master_port = cli.master_port;
    cfg.connect = etcd_connect(&endpoint_list, &cli.rdzv_conf)?;
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
            "confirm_window_ms" => cfg.confirm_window_ms = ms(v)?,
            "join_timeout" | "timeout" => cfg.below_min_timeout_ms = secs(v)?,
            "fence_margin_ms" => cfg.fence_margin_ms = Some(ms(v)?),
            k if RDZV_CONF_CONNECT_KEYS.contains(&k) => {}
            // c10d's, read by `c10d_config`; checked with any backend.
            "is_host" => {
                parse_is_host(v)?;
            }
            "read_timeout" => {
                read_timeout_ms(v)?;
            }
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
    "confirm_window_ms",
    "fence_margin_ms",
    "request_timeout_ms",
    "join_timeout",
    "timeout",
    "last_call_timeout",
    "protocol",
    "cacert",
    "cert",
    "key",
    "is_host",
    "read_timeout",
];
/// torchrun's `--rdzv-conf` keys that are accepted and ignored.
pub const RDZV_CONF_IGNORED_KEYS: &[&str] = &["keep_alive_interval", "keep_alive_max_attempt"];

/// `--rdzv-backend c10d`'s settings: its one endpoint (`HOST[:PORT]`, torchrun's port 29400
/// when it has none), whether this node serves the rendezvous (`--rdzv-conf is_host`, torchrun's
/// booleans; else the endpoint's host decides), and how long a node waits for it to answer
/// (`read_timeout`, seconds; torchrun's default, 60). The served etcd speaks plain http, so
/// the TLS keys are refused: an etcd with TLS is a cluster of one's own (`etcd-v3`).
pub fn c10d_config(cli: &Cli) -> Result<super::rdzv_host::C10d> {
    let given = cli.rdzv_endpoint.trim();
    let endpoint = super::rdzv_host::Endpoint::parse(given).map_err(|e| {
        usage(format!(
            "--rdzv-endpoint {given} (--rdzv-backend c10d): {e}"
        ))
    })?;
    let conf = &cli.rdzv_conf;
    for k in ["protocol", "cacert", "cert", "key"] {
        match conf.get(k) {
            None | Some("") => {}
            Some("http") if k == "protocol" => {}
            Some(v) => {
                return Err(usage(format!(
                    "--rdzv-conf {k}={v}: --rdzv-backend c10d serves a plain-http etcd on the \
                     endpoint's node; for etcd with TLS, run an etcd cluster and use \
                     --rdzv-backend etcd-v3 --rdzv-endpoint HOST:PORT"
                )));
            }
        }
    }
    let is_host = conf.get("is_host").map(parse_is_host).transpose()?;
    let wait_ms = conf
        .get("read_timeout")
        .map(read_timeout_ms)
        .transpose()?
        .unwrap_or(super::rdzv_host::ENDPOINT_WAIT_MS_DEFAULT);
    Ok(super::rdzv_host::C10d {
        endpoint,
        is_host,
        wait_ms,
    })
}

/// `is_host`, spelt as torchrun reads a boolean.
fn parse_is_host(v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" => Ok(true),
        "0" | "false" | "f" | "no" | "n" => Ok(false),
        _ => Err(usage(format!(
            "--rdzv-conf is_host={v}: use true or false (or 1, 0, yes, no)"
        ))),
    }
}

/// `read_timeout`, seconds above 0, in milliseconds.
fn read_timeout_ms(v: &str) -> Result<u64> {
    v.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(|s| ((s * 1000.0) as u64).max(1))
        .ok_or_else(|| {
            usage(format!(
                "--rdzv-conf read_timeout={v}: not a number of seconds above 0"
            ))
        })
}

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

/// Under static rendezvous, `--rdzv-endpoint HOST:PORT` names the master (torchrun's rule);
/// `None` without an endpoint.
pub fn static_master(cli: &Cli) -> Result<Option<(String, u16)>> {
    let e = cli.rdzv_endpoint.trim();
    if e.is_empty() {
        return Ok(None);
    }
    let bad = || {
        usage(format!(
            "--rdzv-endpoint {e}: static rendezvous needs one HOST:PORT"
        ))
    };
    let (host, port) = e.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(',') {
        return Err(bad());
    }
    Ok(Some((host.to_string(), port)))
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
    Ok(if cli.run_path {
        py(&[])
    } else if cli.no_python && cli.module {
        bail!(UsageError(
            "--no-python and --module (-m) cannot be used together: --module runs CMD with the \
             Python interpreter"
                .into()
        ))
    } else if cli.no_python {
        cmd.clone()
    } else if cli.module {
        py(&["-m"])
    } else if first.ends_with(".py") {
        py(&[])
    } else {
        cmd.clone()
    })
}

pub(super) fn resolve_nproc(n: NProc) -> Result<u32> {
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

pub(super) fn default_node_id() -> String {
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "node".into());
    format!("{}-{}", host.trim(), std::process::id())
}

pub(super) fn free_port() -> std::io::Result<u16> {
    // The port is free now; the workers bind it moments later (torchrun does the same).
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

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
        // torchrun: --run-path wins over --no-python; --no-python with --module is refused.
        assert_eq!(
            argv(&["--run-path", "--no-python", "s.py"]),
            ["python3", "-u", "s.py"]
        );
        let e = worker_argv(&cli(&["--no-python", "--module", "x"])).unwrap_err();
        assert!(e.downcast_ref::<UsageError>().is_some());
        assert!(e.to_string().contains("--no-python") && e.to_string().contains("--module"));
    }

    #[test]
    fn an_endpoint_with_elastic_nnodes_means_etcd_and_c10d_serves_it() {
        let mode = |a: &[&str]| Mode::of(&cli(a)).map_err(|e| e.to_string());
        assert_eq!(
            mode(&["--nnodes", "2:8", "--rdzv-endpoint", "h:2379", "x.py"]),
            Ok(Mode::Etcd { serve: false })
        );
        assert_eq!(
            mode(&[
                "--nnodes=1:2",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=h:1",
                "x.py"
            ]),
            Ok(Mode::Etcd { serve: true })
        );
        assert_eq!(
            mode(&["--nnodes", "2", "--rdzv-endpoint", "h:29500", "x.py"]),
            Ok(Mode::Static)
        );
        let e = mode(&["--nnodes", "1:2", "x.py"]).unwrap_err();
        assert!(e.contains("--rdzv-endpoint") && e.contains("c10d"), "{e}");
        let e = mode(&["--nnodes", "1:2", "--rdzv-backend", "c10d", "x.py"]).unwrap_err();
        assert!(e.contains("c10d needs --rdzv-endpoint"), "{e}");
    }

    #[test]
    fn c10d_has_torchrun_port_is_host_and_read_timeout_and_refuses_tls() {
        let rdzv = |a: &[&str]| {
            let c = cli(a);
            rendezvous_config(&c, "n", 1, &scaling_config(&c, 1)).map_err(|e| {
                assert!(e.downcast_ref::<UsageError>().is_some(), "{e:#}");
                e.to_string()
            })
        };
        let c10d = |ep: &str, conf: &str| {
            let c = cli(&[
                "--nnodes=1:2",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint",
                ep,
                "--rdzv-conf",
                conf,
                "x.py",
            ]);
            c10d_config(&c).map_err(|e| e.to_string())
        };
        // The port defaults to torchrun's 29400 under c10d, and the clients dial that.
        let cfg = rdzv(&[
            "--nnodes=1:2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=h",
            "x.py",
        ]);
        assert_eq!(cfg.unwrap().connect.endpoints, ["h:29400"]);
        let c = c10d("h", "").unwrap();
        assert_eq!(
            (c.endpoint.host_port(), c.is_host),
            ("h:29400".into(), None)
        );
        assert_eq!(c.wait_ms, super::super::rdzv_host::ENDPOINT_WAIT_MS_DEFAULT);
        // etcd-v3 keeps the endpoints as given.
        let cfg = rdzv(&["--nnodes=1:2", "--rdzv-endpoint=h1,h2:5", "x.py"]).unwrap();
        assert_eq!(cfg.connect.endpoints, ["h1", "h2:5"]);
        for (v, want) in [
            ("true", true),
            ("1", true),
            ("Y", true),
            ("no", false),
            ("F", false),
        ] {
            let c = c10d("h:1", &format!("is_host={v}")).unwrap();
            assert_eq!(c.is_host, Some(want), "{v}");
        }
        assert_eq!(c10d("h:1", "read_timeout=2.5").unwrap().wait_ms, 2500);
        assert!(c10d("h:1", "protocol=http").is_ok());
        for (ep, conf, needle) in [
            ("h:1", "is_host=maybe", "is_host=maybe"),
            ("h:1", "read_timeout=0", "read_timeout=0"),
            ("h:1", "protocol=https", "etcd-v3"),
            ("h:1", "cacert=/ca.pem", "cacert=/ca.pem"),
            ("a:1,b:1", "", "one endpoint"),
            ("h:99999", "", "--rdzv-endpoint h:99999"),
        ] {
            let e = c10d(ep, conf).unwrap_err();
            assert!(e.contains(needle), "{ep} {conf}: {e}");
        }
        // The c10d keys are known to every backend, and checked there too.
        let e = rdzv(&[
            "--nnodes=1:2",
            "--rdzv-endpoint=h:1",
            "--rdzv-conf=is_host=2",
            "x.py",
        ])
        .unwrap_err();
        assert!(e.contains("is_host=2"), "{e}");
        assert!(
            rdzv(&[
                "--nnodes=1:2",
                "--rdzv-endpoint=h:1",
                "--rdzv-conf=is_host=1,read_timeout=3",
                "x.py"
            ])
            .is_ok()
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
}
