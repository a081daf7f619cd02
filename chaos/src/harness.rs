//! Runs one scenario: starts etcd (and moto for S3 scenarios) on loopback, a fault proxy in
//! front of etcd for every node and one in front of the store, N `elastic-run` agents as
//! simulated nodes, injects the scheduled faults, waits for the job, then checks the
//! invariants and writes the report.
//!
//! With `network = "netns"` every node runs in a network namespace of its own (see
//! [`crate::netns`]) with a real address: its agent advertises that address, its workers talk
//! gloo over the bridge, and it reaches etcd, the store and its notice server through sockets the
//! harness opens inside its namespace. A partition then also takes its link down.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::invariants::{self, Fired, Outcome};
use crate::netns::{self, Network};
use crate::proxy::{Mode, Proxy};
use crate::report::{self, Report};
use crate::scenario::{self as sc, Fault, FaultKind, Scenario, StoreKind, schedule};

/// How long the job may take to reach its first training step.
const FIRST_STEP_TIMEOUT_MS: u64 = 180_000;
/// How long to wait for processes to go away at the end before calling them leftovers.
const LEFTOVER_GRACE_MS: u64 = 3_000;
const POLL_MS: u64 = 50;

/// Where the tools are.
#[derive(Debug, Clone)]
pub struct Tools {
    pub elastic_run: PathBuf,
    pub python: PathBuf,
    /// The default training script (a scenario's `example` overrides it).
    pub example: PathBuf,
    pub repo: PathBuf,
}

impl Tools {
    /// The repository's build and `.venv`: `$ELASTIC_RUN_BIN`, else `target/debug/elastic-run`.
    pub fn from_repo() -> Result<Tools> {
        Tools::resolve(None)
    }

    /// Like [`Tools::from_repo`], with the agent binary given (relative paths are taken from
    /// the current directory). Paths are checked by [`Tools::for_scenario`].
    pub fn resolve(elastic_run: Option<&Path>) -> Result<Tools> {
        let repo = services::paths::repo_root();
        let elastic_run = elastic_run
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("ELASTIC_RUN_BIN").map(PathBuf::from))
            .unwrap_or_else(|| repo.join("target/debug/elastic-run"));
        Ok(Tools {
            elastic_run,
            python: services::paths::python()?,
            example: repo.join("examples/ddp_train.py"),
            repo,
        })
    }

    /// The tools for scenario `s`: its `elastic_run` (relative to the repository) unless
    /// `explicit` (a command-line override) is set, and its `example`. Checks that they exist.
    pub fn for_scenario(&self, s: &Scenario, explicit: bool) -> Result<Tools> {
        let mut t = self.clone();
        if !explicit && let Some(bin) = &s.elastic_run {
            t.elastic_run = t.repo.join(bin);
        }
        if let Some(ex) = &s.example {
            t.example = t.repo.join(ex);
        }
        t.check()?;
        Ok(t)
    }

    fn check(&self) -> Result<()> {
        if !self.elastic_run.exists() {
            bail!(
                "{} not found: build it with `cargo build -p runtime --bin elastic-run` (or pass \
                 --elastic-run PATH, or set ELASTIC_RUN_BIN)",
                self.elastic_run.display()
            );
        }
        if !self.example.exists() {
            bail!("training script {} not found", self.example.display());
        }
        Ok(())
    }
}

struct Node {
    name: String,
    child: Option<Child>,
    etcd_proxy: Proxy,
    /// In a namespace: the node's way to the store (in front of the shared store proxy), cut
    /// during its partitions.
    store_fwd: Option<Proxy>,
    notice: Arc<AtomicBool>,
    notice_url: String,
    staging: PathBuf,
    /// A small tmpfs is mounted on `staging` (for `staging_full`).
    staging_mounted: bool,
    /// Killed on purpose: its exit code is not judged.
    removed: bool,
}

/// A tiny HTTP server answering GCP's `instance/preempted`: `FALSE` until `flag` is set. It
/// serves on `listener` when given (one opened in a node's namespace), else on loopback.
async fn notice_server(
    flag: Arc<AtomicBool>,
    listener: Option<std::net::TcpListener>,
) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = match listener {
        Some(l) => tokio::net::TcpListener::from_std(l)?,
        None => tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?,
    };
    let url = format!(
        "gcp=http://{}/computeMetadata/v1/instance/preempted",
        l.local_addr()?
    );
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let flag = flag.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
                let body = if flag.load(Ordering::SeqCst) {
                    "TRUE"
                } else {
                    "FALSE"
                };
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    Ok(url)
}

/// A process, named by PID and start time, so a signal never reaches a reused PID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcId {
    pid: i32,
    start_ticks: u64,
}

impl ProcId {
    fn of(pid: i32) -> Option<ProcId> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 22 (starttime); fields after the command name start at field 3.
        let start_ticks = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(19)?
            .parse()
            .ok()?;
        Some(ProcId { pid, start_ticks })
    }

    fn signal(self, sig: i32) -> bool {
        if ProcId::of(self.pid) != Some(self) {
            return false;
        }
        signal(self.pid, sig);
        true
    }
}

/// Unmounts the staging tmpfs mounts of a run when dropped (also on early errors).
#[derive(Default)]
struct Mounts(Vec<PathBuf>);

impl Mounts {
    /// Mounts a `size_mb` tmpfs on `dir`. Needs root; `Err` says why it did not happen.
    fn tmpfs(&mut self, dir: &Path, size_mb: u64) -> std::result::Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: cannot mount a tmpfs".into());
        }
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size_mb}m,mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount tmpfs on {}: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        self.0.push(dir.to_path_buf());
        Ok(())
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for dir in self.0.drain(..).rev() {
            // Lazy: a process still holding a file there must not keep the mount forever.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The file that fills a full staging filesystem.
const FILL_FILE: &str = ".elastic-chaos-fill";
/// Bytes written per call while filling.
const FILL_CHUNK_BYTES: usize = 1 << 20;

/// Fills the filesystem of `dir` (a tmpfs of `size_mb`) with one file; returns its bytes.
fn fill(dir: &Path, size_mb: u64) -> std::io::Result<u64> {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join(FILL_FILE))?;
    let chunk = vec![0u8; FILL_CHUNK_BYTES];
    let mut written = 0u64;
    // Bounded: one more chunk than the filesystem can hold; then the rest below a chunk in
    // ever smaller writes, down to a block.
    let mut len = FILL_CHUNK_BYTES;
    for _ in 0..(size_mb + 64) {
        match f.write(&chunk[..len]) {
            Ok(n) if n > 0 => written += n as u64,
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                len /= 2;
                if len < 4096 {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Everything one run needs, shared by the fault injector.
struct Run<'a> {
    s: &'a Scenario,
    tools: &'a Tools,
    out: PathBuf,
    job: String,
    url: String,
    env: Vec<(String, String)>,
    etcd: Arc<Mutex<services::Etcd>>,
    store_proxy: Option<Proxy>,
    /// The nodes' namespaces (`network = "netns"`).
    net: Option<Network>,
    nodes: Vec<Node>,
    /// Nodes whose staging gets a small tmpfs (those a `staging_full` fault names).
    small_staging: Vec<usize>,
    mounts: Mounts,
    /// Threads that restarted a service: each lives (and so keeps its service alive) until
    /// its sender here is dropped with the run.
    keepers: Vec<std::sync::mpsc::Sender<()>>,
}

impl Run<'_> {
    async fn start_node(&mut self, index: usize) -> Result<()> {
        let name = format!("node{index}");
        let etcd_addr = {
            let e = self.etcd.lock().expect("etcd lock");
            e.service.addr()
        };
        let notice = Arc::new(AtomicBool::new(false));
        // Without namespaces every node is 127.0.0.1 and reaches the store proxy directly.
        let mut local_addr = "127.0.0.1".to_string();
        let mut node_env: Vec<(String, String)> = vec![];
        let mut store_fwd = None;
        let mut enter = None;
        let (etcd_proxy, notice_url) = match self.net.as_mut() {
            None => (
                Proxy::start(etcd_addr).await?,
                notice_server(notice.clone(), None).await?,
            ),
            Some(net) => {
                let ns = net.node(index)?;
                local_addr = ns.addr.to_string();
                let listen = |what: &str| {
                    ns.listen_loopback()
                        .with_context(|| format!("{what} socket in namespace {}", ns.name))
                };
                let etcd_proxy = Proxy::start_on(listen("etcd")?, etcd_addr)?;
                let notice_url = notice_server(notice.clone(), Some(listen("notice")?)).await?;
                if let Some(p) = &self.store_proxy {
                    let fwd = Proxy::start_on(listen("store")?, p.addr)?;
                    node_env.push(("AWS_ENDPOINT".into(), format!("http://{}", fwd.addr)));
                    store_fwd = Some(fwd);
                }
                // gloo would pick the address the host name resolves to, which is not in
                // the namespace (and falls back to loopback, unreachable from the peers).
                node_env.push(("GLOO_SOCKET_IFNAME".into(), netns::NODE_IF.into()));
                enter = Some(index);
                (etcd_proxy, notice_url)
            }
        };
        let s = self.s;
        let logs = self.out.join("logs");
        std::fs::create_dir_all(&logs)?;
        let staging = self.out.join(format!("staging/{name}"));
        std::fs::create_dir_all(&staging)?;
        let mut staging_mounted = false;
        if self.small_staging.contains(&index) {
            match self.mounts.tmpfs(&staging, s.staging_mb) {
                Ok(()) => staging_mounted = true,
                Err(e) => tracing::warn!(node = %name, "{e}; staging_full falls back to chmod"),
            }
        }
        let mut rdzv_conf = format!("lease_ttl_ms={},settle_ms={}", s.lease_ttl_ms, s.settle_ms);
        if let Some(t) = s.below_min_timeout_ms {
            rdzv_conf.push_str(&format!(",below_min_timeout_ms={t}"));
        }
        let mut c = Command::new(&self.tools.elastic_run);
        c.args([
            "--nnodes",
            &format!("{}:{}", s.min_nodes, s.max_nodes),
            "--nproc-per-node",
            &s.nproc_per_node.to_string(),
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            &etcd_proxy.addr.to_string(),
            "--rdzv-id",
            &self.job,
            "--node-id",
            &name,
            "--local-addr",
            &local_addr,
            "--rdzv-conf",
            &rdzv_conf,
            "--checkpoint-url",
            &self.url,
            "--checkpoint-interval",
            &s.checkpoint_interval.to_string(),
            "--lr-scaling",
            &s.lr_scaling,
            "--base-world-size",
            &s.base_world().to_string(),
            "--batch-size",
            &s.batch_size.to_string(),
            "--base-lr",
            &s.base_lr.to_string(),
            "--preemption-grace",
            &format!("{}s", s.preemption_grace_s),
            "--hang-timeout",
            &format!("{}s", s.hang_timeout_s),
            "--preemption-notice",
            &notice_url,
            "--max-restarts",
            "3",
            "--metrics-addr",
            "127.0.0.1:0",
        ]);
        if let Some(g) = s.global_batch {
            c.args(["--global-batch", &g.to_string()]);
        }
        c.arg("--staging-dir")
            .arg(&staging)
            .arg("--events-file")
            .arg(self.out.join("events.jsonl"))
            .arg("--")
            .arg(&self.tools.python)
            .arg(&self.tools.example)
            .args([
                "--steps",
                &s.steps.to_string(),
                "--step-sleep",
                &s.step_sleep_s.to_string(),
            ])
            .args(&s.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(node_env.iter().map(|(k, v)| (k, v)))
            .env("ELASTIC_LOG", "info")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(logs.join(format!("{name}.out")))?)
            .stderr(std::fs::File::create(logs.join(format!("{name}.err")))?);
        if let (Some(i), Some(net)) = (enter, self.net.as_ref())
            && let Some(ns) = net.get(i)
        {
            ns.enter_on_spawn(&mut c);
        }
        let child = c
            .spawn()
            .with_context(|| format!("start {}", self.tools.elastic_run.display()))?;
        tracing::info!(node = %name, pid = child.id(), addr = %local_addr, "agent started");
        let node = Node {
            name,
            child: Some(child),
            etcd_proxy,
            store_fwd,
            notice,
            notice_url,
            staging,
            staging_mounted,
            removed: false,
        };
        if index < self.nodes.len() {
            self.nodes[index] = node;
        } else {
            self.nodes.push(node);
        }
        Ok(())
    }

    fn events(&self) -> Vec<Value> {
        read_events(&self.out.join("events.jsonl"))
    }

    /// Injects `f`; `Ok(Some(why))` when it could not be (it is then reported, not judged).
    async fn inject(&mut self, f: &Fault) -> Result<Option<String>> {
        tracing::warn!(kind = ?f.kind, node = f.node, "injecting fault");
        let dur = Duration::from_millis(f.duration_ms);
        match f.kind {
            FaultKind::Join => {
                let idx = self.nodes.len();
                self.start_node(idx).await?;
                return Ok(None);
            }
            FaultKind::EtcdRestart => {
                let etcd = self.etcd.clone();
                etcd.lock().expect("etcd lock").kill();
                // On a thread of its own that lives until the run ends: services die with the
                // thread that started them (PR_SET_PDEATHSIG), and neither blocking-pool
                // threads nor a worker thread given up by `block_in_place` are sure to last.
                let (keep_tx, keep_rx) = std::sync::mpsc::channel::<()>();
                self.keepers.push(keep_tx);
                std::thread::spawn(move || {
                    std::thread::sleep(dur);
                    let r = etcd.lock().expect("etcd lock").restart();
                    if r.is_err() {
                        tracing::error!("etcd did not come back: {r:?}");
                    }
                    // Returns when the run drops its end.
                    let _ = keep_rx.recv();
                });
                return Ok(None);
            }
            FaultKind::StoreOutage | FaultKind::StoreSlow | FaultKind::StoreErrors => {
                let Some(p) = &self.store_proxy else {
                    return Ok(Some("store faults need store = \"s3\"".into()));
                };
                let mode = match f.kind {
                    FaultKind::StoreOutage => Mode::Down,
                    FaultKind::StoreSlow => Mode::Slow {
                        delay_ms: f.delay_ms,
                    },
                    _ => Mode::Http503,
                };
                p.fault_for(mode, dur);
                return Ok(None);
            }
            _ => {}
        }
        let Some(n) = self.nodes.get_mut(f.node) else {
            return Ok(Some(format!(
                "no node {} (the run has {})",
                f.node,
                self.nodes.len()
            )));
        };
        let Some(agent) = n.child.as_mut() else {
            return Ok(Some(format!("{} has no agent", n.name)));
        };
        if !matches!(agent.try_wait(), Ok(None)) {
            return Ok(Some(format!("{}'s agent has already exited", n.name)));
        }
        let pid = agent.id() as i32;
        match f.kind {
            FaultKind::SigkillAgent => {
                n.removed = true;
                signal(pid, libc::SIGKILL);
            }
            FaultKind::SigtermAgent => {
                n.removed = true;
                signal(pid, libc::SIGTERM);
            }
            FaultKind::Notice => {
                n.removed = true;
                n.notice.store(true, Ordering::SeqCst);
                tracing::info!(url = %n.notice_url, "notice served");
            }
            FaultKind::SigkillWorker | FaultKind::SigstopWorker => {
                let script = self.tools.example.to_string_lossy().into_owned();
                let Some(w) = workers(pid, &script).first().and_then(|p| ProcId::of(*p)) else {
                    return Ok(Some(format!("{} has no worker running", n.name)));
                };
                if f.kind == FaultKind::SigkillWorker {
                    w.signal(libc::SIGKILL);
                } else {
                    w.signal(libc::SIGSTOP);
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        // The agent's hang watchdog has probably killed it meanwhile.
                        w.signal(libc::SIGCONT);
                    });
                }
            }
            FaultKind::Partition | FaultKind::Blackhole => {
                let mode = if f.kind == FaultKind::Partition {
                    Mode::Down
                } else {
                    Mode::Blackhole
                };
                n.etcd_proxy.fault_for(mode, dur);
                if let Some(fwd) = &n.store_fwd {
                    fwd.fault_for(mode, dur);
                }
                if let Some(link) = self.net.as_ref().and_then(|net| net.link_switch(f.node)) {
                    // Packets to and from the peers are dropped: their collectives with this
                    // node stall until the agents re-form without it.
                    link.set(false)?;
                    tracing::info!(node = %n.name, "link down");
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let r = tokio::task::spawn_blocking(move || link.set(true)).await;
                        if !matches!(r, Ok(Ok(()))) {
                            tracing::error!("link did not come back up: {r:?}");
                        }
                    });
                }
            }
            FaultKind::StagingFull => {
                let dir = n.staging.clone();
                if n.staging_mounted {
                    let size_mb = self.s.staging_mb;
                    let d = dir.clone();
                    let bytes = tokio::task::spawn_blocking(move || fill(&d, size_mb))
                        .await
                        .context("fill task")?
                        .with_context(|| format!("fill {}", dir.display()))?;
                    tracing::info!(node = %n.name, bytes, "staging filesystem full");
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let _ = std::fs::remove_file(dir.join(FILL_FILE));
                    });
                } else {
                    // SAFETY: geteuid has no preconditions.
                    if unsafe { libc::geteuid() } == 0 {
                        return Ok(Some(
                            "no tmpfs could be mounted, and a read-only directory does not stop \
                             root"
                                .into(),
                        ));
                    }
                    // Not root: a read-only staging directory stands in for a full one (new
                    // step directories cannot be created; writes into existing ones still
                    // succeed).
                    tracing::warn!(node = %n.name, "staging_full simulated with a read-only directory");
                    set_mode(&dir, 0o555)?;
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let _ = set_mode(&dir, 0o755);
                    });
                }
            }
            _ => unreachable!("handled above"),
        }
        Ok(None)
    }

    fn all_exited(&mut self) -> bool {
        self.nodes.iter_mut().all(|n| match n.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(Some(_))),
            None => true,
        })
    }
}

impl Drop for Run<'_> {
    /// An early error must not leave agents behind: kill and reap whatever still runs (their
    /// workers die with them, by `PR_SET_PDEATHSIG`).
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(c) = n.child.as_mut()
                && matches!(c.try_wait(), Ok(None))
            {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn set_mode(dir: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", dir.display()))
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this harness started (or its child).
    unsafe { libc::kill(pid, sig) };
}

/// The workers of the agent `pid`: its children running `script` (all its children when none
/// matches, for scripts that re-exec).
pub fn workers(pid: i32, script: &str) -> Vec<i32> {
    let all = children(pid);
    let named: Vec<i32> = all
        .iter()
        .copied()
        .filter(|c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .map(|b| b.split(|x| *x == 0).any(|a| a == script.as_bytes()))
                .unwrap_or(false)
        })
        .collect();
    if named.is_empty() { all } else { named }
}

/// Direct children of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    services::child_pids(pid)
}

/// Processes whose command line or environment names `job`, excluding zombies.
pub fn leftovers(job: &str) -> Vec<String> {
    let mut out = vec![];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    let needle_env = format!("TORCHELASTIC_RUN_ID={job}\0");
    for e in dir.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if p == std::process::id() {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .unwrap_or("");
        if state == "Z" || state.is_empty() {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
        let env = std::fs::read(format!("/proc/{p}/environ")).unwrap_or_default();
        let cmd_s = String::from_utf8_lossy(&cmd);
        let env_s = String::from_utf8_lossy(&env);
        if cmd_s.split('\0').any(|a| a == job) || env_s.contains(&needle_env) {
            out.push(format!("pid {p}: {}", cmd_s.replace('\0', " ").trim()));
        }
    }
    out
}

pub fn read_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The last line an agent printed to say why it failed (`elastic-run: ...`).
fn failure_message(err_log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(err_log).ok()?;
    text.lines()
        .rev()
        .find(|l| l.starts_with("elastic-run: "))
        .map(|l| l.chars().take(500).collect())
}

/// Rank 0's final line over every node's output: `(step, digest)` of the highest `done step`.
fn final_line(logs: &Path) -> (Option<u64>, Option<String>) {
    let mut best: Option<(u64, String)> = None;
    for e in std::fs::read_dir(logs).into_iter().flatten().flatten() {
        if !e.file_name().to_string_lossy().ends_with(".out") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        for l in text.lines() {
            let Some(rest) = l.split("] done step ").nth(1) else {
                continue;
            };
            let step = rest.split_whitespace().next().and_then(|s| s.parse().ok());
            let digest = rest.split(" weights ").nth(1).map(|s| s.trim().to_string());
            if let (Some(st), Some(d)) = (step, digest)
                && best.as_ref().is_none_or(|b| st >= b.0)
            {
                best = Some((st, d));
            }
        }
    }
    match best {
        Some((s, d)) => (Some(s), Some(d)),
        None => (None, None),
    }
}

/// `object_store` options for the store URL, from the agents' environment.
fn store_options(env: &[(String, String)]) -> Vec<(String, String)> {
    services::s3_store_options(env)
}

/// Verifies and restores every committed step.
async fn check_store(
    url: &str,
    opts: Vec<(String, String)>,
    tmp: &Path,
) -> (Vec<u64>, Vec<(u64, String)>) {
    let cancel = checkpoint::CancellationToken::new();
    let store = match checkpoint::Store::open_with_options(url, opts) {
        Ok(s) => s,
        Err(e) => return (vec![], vec![(0, format!("open {url}: {e}"))]),
    };
    let committed = match store.committed_steps(&cancel).await {
        Ok(c) => c,
        Err(e) => return (vec![], vec![(0, format!("list: {e}"))]),
    };
    let mut bad = vec![];
    for step in &committed {
        match store.verify(*step, &Default::default(), &cancel).await {
            Ok(r) if r.bad.is_empty() => {}
            Ok(r) => bad.push((*step, format!("{:?}", r.bad))),
            Err(e) => bad.push((*step, e.to_string())),
        }
    }
    for step in &committed {
        let dest = tmp.join(format!("restore-check/step-{step}"));
        match store
            .restore(Some(*step), 0, 1, &dest, &Default::default(), &cancel)
            .await
        {
            // The newest step, restored whole, is kept for comparing weights.
            Ok(_) if Some(step) == committed.last() => {
                let _ = std::fs::remove_dir_all(tmp.join(FINAL_STATE_DIR));
                let _ = std::fs::rename(&dest, tmp.join(FINAL_STATE_DIR));
            }
            Ok(_) => {}
            Err(e) => bad.push((*step, format!("restore: {e}"))),
        }
    }
    let _ = std::fs::remove_dir_all(tmp.join("restore-check"));
    (committed, bad)
}

/// Where a run keeps its newest committed step, restored for one rank of a world of one.
pub const FINAL_STATE_DIR: &str = "final-state";

/// Runs `s` with `seed` into `out` (wiped first); returns the report (also written there).
/// With `compare_reference`, a fault-free run of the same scenario goes first, into
/// `out/reference`.
pub async fn run(s: &Scenario, seed: u64, tools: &Tools, out: &Path) -> Result<Report> {
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("clear {} (a staging tmpfs still mounted?)", out.display()))?;
    }
    std::fs::create_dir_all(out)?;
    // What ran, seed included: `elastic-chaos run OUT/scenario.toml` replays it.
    let mut replay = s.clone();
    replay.seed = Some(seed);
    std::fs::write(
        out.join("scenario.toml"),
        toml::to_string(&replay).context("scenario as TOML")?,
    )?;
    let reference = if s.compare_reference {
        let mut clean = s.clone();
        clean.faults.clear();
        clean.random = None;
        clean.compare_reference = false;
        let r = Box::pin(run_once(&clean, seed, tools, &out.join("reference"), None)).await?;
        if !r.passed {
            bail!(
                "the fault-free reference run failed: see {}",
                out.join("reference").display()
            );
        }
        Some(Reference {
            digest: r.outcome.digest,
            state: out.join("reference").join(FINAL_STATE_DIR),
        })
    } else {
        None
    };
    run_once(s, seed, tools, out, reference).await
}

/// What the fault-free reference run left to compare against.
struct Reference {
    digest: Option<String>,
    /// Its newest committed step, restored whole.
    state: PathBuf,
}

async fn run_once(
    s: &Scenario,
    seed: u64,
    tools: &Tools,
    out: &Path,
    reference: Option<Reference>,
) -> Result<Report> {
    let started = Instant::now();
    std::fs::create_dir_all(out)?;
    let out = std::fs::canonicalize(out)?;
    let job = format!("chaos-{}-{seed}-{}", sanitize(&s.name), std::process::id());
    let faults = schedule(s, seed);
    tracing::info!(scenario = %s.name, seed, faults = faults.len(), "run starts");
    std::fs::write(
        out.join("schedule.json"),
        serde_json::to_vec_pretty(&faults)?,
    )?;

    // On this worker thread, not the blocking pool: services die with the thread that started
    // them (PR_SET_PDEATHSIG), and blocking-pool threads exit when idle.
    let etcd = tokio::task::block_in_place(services::etcd)?;
    let mut moto = None;
    let (url, env, store_proxy) = match s.store {
        StoreKind::File => (format!("file://{}/bucket", out.display()), vec![], None),
        StoreKind::S3 => {
            let m = tokio::task::block_in_place(services::moto)?;
            m.create_bucket("chaos")?;
            let proxy = Proxy::start(m.service.addr()).await?;
            let mut env = m.env();
            for (k, v) in env.iter_mut() {
                if k == "AWS_ENDPOINT" {
                    *v = format!("http://{}", proxy.addr);
                }
            }
            moto = Some(m);
            (format!("s3://chaos/{job}"), env, Some(proxy))
        }
    };
    let net = match s.network {
        sc::Network::Loopback => None,
        sc::Network::Netns => Some(
            tokio::task::block_in_place(Network::create)
                .with_context(|| format!("scenario {}: network = \"netns\"", s.name))?,
        ),
    };
    let mut small_staging: Vec<usize> = faults
        .iter()
        .filter(|f| f.kind == FaultKind::StagingFull)
        .map(|f| f.node)
        .collect();
    small_staging.dedup();
    let mut run = Run {
        s,
        tools,
        out: out.clone(),
        job: job.clone(),
        url: url.clone(),
        env: env.clone(),
        etcd: Arc::new(Mutex::new(etcd)),
        store_proxy,
        net,
        nodes: vec![],
        small_staging,
        mounts: Mounts::default(),
        keepers: Vec::new(),
    };
    // The store watcher talks to the store directly (never through the fault proxy).
    let direct_opts = match &moto {
        Some(m) => {
            let mut direct = env.clone();
            for (k, v) in direct.iter_mut() {
                if k == "AWS_ENDPOINT" {
                    *v = m.endpoint();
                }
            }
            store_options(&direct)
        }
        None => vec![],
    };
    let watch_stop = checkpoint::CancellationToken::new();
    let watcher = tokio::spawn(crate::watch::watch(
        checkpoint::Store::open_with_options(&url, direct_opts.clone())
            .with_context(|| format!("open {url}"))?,
        Instant::now(),
        watch_stop.clone(),
    ));
    // Stops the watcher however this function ends.
    let _watch_guard = watch_stop.clone().drop_guard();
    // Nodes start one after another, so ranks follow node order.
    for i in 0..s.nodes {
        run.start_node(i).await?;
        let name = format!("node{i}");
        let deadline = Instant::now() + Duration::from_millis(FIRST_STEP_TIMEOUT_MS);
        while !run
            .events()
            .iter()
            .any(|e| e["event"] == "joined" && e["node"] == name.as_str())
        {
            if Instant::now() > deadline || run.all_exited() {
                bail!("{name} did not join: see {}", out.join("logs").display());
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }
    // Faults count from the first training step.
    let deadline = Instant::now() + Duration::from_millis(FIRST_STEP_TIMEOUT_MS);
    while !run.events().iter().any(|e| e["event"] == "first_step") {
        if Instant::now() > deadline {
            bail!(
                "no training step within {FIRST_STEP_TIMEOUT_MS} ms: see {}",
                out.join("logs").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let t0 = Instant::now();
    let end = started + Duration::from_secs_f64(s.deadline_s);
    let mut fired = Vec::new();
    let mut pending: std::collections::VecDeque<Fault> = faults.into();
    let mut timed_out = false;
    loop {
        if let Some(f) = pending.front()
            && t0.elapsed() >= Duration::from_millis(f.at_ms)
        {
            let f = pending.pop_front().expect("front");
            let at_unix_ms = unix_ms();
            let skipped = run.inject(&f).await?;
            if let Some(why) = &skipped {
                tracing::warn!(kind = ?f.kind, node = f.node, "fault skipped: {why}");
            }
            fired.push(Fired {
                at_unix_ms,
                fault: f,
                skipped,
            });
            continue;
        }
        if run.all_exited() {
            break;
        }
        if Instant::now() > end {
            timed_out = true;
            tracing::error!("deadline passed; killing the agents");
            for n in &mut run.nodes {
                if let Some(c) = n.child.as_mut() {
                    let _ = c.kill();
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let run_end_unix_ms = unix_ms();
    let mut exits = Vec::new();
    let mut failure_messages = Vec::new();
    for n in &mut run.nodes {
        let code = n
            .child
            .as_mut()
            .and_then(|c| c.wait().ok())
            .and_then(|s| s.code());
        exits.push((n.name.clone(), if n.removed { None } else { code }));
        if let Some(m) = failure_message(&out.join(format!("logs/{}.err", n.name))) {
            failure_messages.push((n.name.clone(), m));
        }
    }
    // Leftovers: every process of this job should be gone.
    let mut left = leftovers(&job);
    let grace = Instant::now() + Duration::from_millis(LEFTOVER_GRACE_MS);
    while !left.is_empty() && Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = leftovers(&job);
    }
    watch_stop.cancel();
    let live = watcher.await.unwrap_or_default();
    let (committed, bad_steps) = check_store(&url, direct_opts, &out).await;
    let (done_step, digest) = final_line(&out.join("logs"));
    let (reference_digest, weights) = match reference {
        Some(r) => {
            let diff = crate::weights::compare(&out.join(FINAL_STATE_DIR), &r.state)
                .map_err(|e| format!("{e:#}"));
            (r.digest, Some(diff))
        }
        None => (None, None),
    };
    let outcome = Outcome {
        done_step,
        digest,
        weights,
        exits,
        timed_out,
        committed,
        bad_steps,
        leftovers: left,
        reference_digest,
        live,
        failure_messages,
    };
    let events = run.events();
    let checks = invariants::check(s, &events, &fired, &outcome);
    let passed = checks.iter().all(|c| c.ok);
    let mut generations: BTreeMap<u64, Value> = BTreeMap::new();
    for e in events.iter().filter(|e| e["event"] == "generation") {
        if let Some(g) = e["generation"].as_u64() {
            generations.entry(g).or_insert_with(|| e.clone());
        }
    }
    let report = Report {
        scenario: s.name.clone(),
        seed,
        job,
        wall_ms: started.elapsed().as_millis() as u64,
        faults: invariants::effects(&events, &fired),
        generations: generations.into_values().collect(),
        checks,
        outcome,
        passed,
    };
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(
        out.join("timeline.svg"),
        report::timeline_svg(
            &format!("{} (seed {seed})", s.name),
            &events,
            &fired,
            Some(run_end_unix_ms),
        ),
    )?;
    drop(run);
    drop(moto);
    Ok(report)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}
