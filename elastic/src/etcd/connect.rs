//! How to reach etcd: endpoints, user and password, TLS, and the request bound.

use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::REQUEST_TIMEOUT_MS_DEFAULT;
use super::ops;
use crate::{Error, Result};

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
