//! The simulated nodes: each one's agent, its etcd proxy (and, in a namespace, its way to
//! the store), and the notice server its agent polls.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};

use super::Tools;
use super::mounts::Mounts;
use crate::events::{EventLog, read_events};
use crate::netns::{self, Network};
use crate::proxy::Proxy;
use crate::scenario::Scenario;

/// The agents' shared event log, in the run's directory.
pub(super) const EVENTS_FILE: &str = "events.jsonl";

pub(super) struct Node {
    pub(super) name: String,
    pub(super) child: Option<Child>,
    pub(super) etcd_proxy: Proxy,
    /// In a namespace: the node's way to the store (in front of the shared store proxy), cut
    /// during its partitions.
    pub(super) store_fwd: Option<Proxy>,
    pub(super) notice: Arc<AtomicBool>,
    pub(super) notice_url: String,
    pub(super) staging: PathBuf,
    /// A small tmpfs is mounted on `staging` (for `staging_full`).
    pub(super) staging_mounted: bool,
    /// Killed on purpose: its exit code is not judged.
    pub(super) removed: bool,
}

/// A tiny HTTP server answering GCP's `instance/preempted`: `FALSE` until `flag` is set. As
/// GCP's does, it holds a `wait_for_change=true` request until the value changes (or
/// `timeout_sec` passes), so the agent hears of a preemption as it happens rather than at its
/// next poll. It serves on `listener` when given (one opened in a node's namespace), else on
/// loopback.
/// How long the notice server holds a `wait_for_change` request without `timeout_sec`, at most,
/// and how often it looks at the flag meanwhile.
const NOTICE_WAIT_S_DEFAULT: u64 = 60;
const NOTICE_WAIT_S_MAX: u64 = 300;
const NOTICE_WAIT_POLL_MS: u64 = 10;

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
                let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(0);
                let line = String::from_utf8_lossy(&buf[..n]);
                let line = line.lines().next().unwrap_or("");
                if line.contains("wait_for_change=true") {
                    let timeout_s = line
                        .split(['?', '&', ' '])
                        .find_map(|kv| kv.strip_prefix("timeout_sec="))
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(NOTICE_WAIT_S_DEFAULT)
                        .min(NOTICE_WAIT_S_MAX);
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s);
                    // The value only ever turns from FALSE to TRUE.
                    while !flag.load(Ordering::SeqCst) && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(NOTICE_WAIT_POLL_MS)).await;
                    }
                }
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

/// Everything one run needs, shared by the fault injector.
pub(super) struct Run<'a> {
    pub(super) s: &'a Scenario,
    pub(super) tools: &'a Tools,
    pub(super) out: PathBuf,
    pub(super) job: String,
    pub(super) url: String,
    pub(super) env: Vec<(String, String)>,
    pub(super) etcd: Arc<Mutex<services::Etcd>>,
    pub(super) store_proxy: Option<Proxy>,
    /// The nodes' namespaces (`network = "netns"`).
    pub(super) net: Option<Network>,
    pub(super) nodes: Vec<Node>,
    /// Nodes whose staging gets a small tmpfs (those a `staging_full` fault names).
    pub(super) small_staging: Vec<usize>,
    pub(super) mounts: Mounts,
    /// Threads that restarted a service: each lives (and so keeps its service alive) until
    /// its sender here is dropped with the run.
    pub(super) keepers: Vec<std::sync::mpsc::Sender<()>>,
}

impl Run<'_> {
    pub(super) async fn start_node(&mut self, index: usize) -> Result<()> {
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
        c.args(&s.agent_args)
            .arg("--staging-dir")
            .arg(&staging)
            .arg("--events-file")
            .arg(self.out.join(EVENTS_FILE))
            // Workers' lines are read back by rank (`end_state.rs`): teed, prefixed, and kept.
            .args(["--tee", "3", "--log-dir"])
            .arg(logs.join(format!("{name}.workers")))
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
            .env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank ${rank}] ")
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

    /// The event log so far.
    pub(super) fn events(&self) -> EventLog {
        read_events(&self.out.join(EVENTS_FILE))
    }

    pub(super) fn all_exited(&mut self) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(url: &str, query: &str) -> (String, Duration) {
        let addr = url
            .trim_start_matches("gcp=http://")
            .split('/')
            .next()
            .unwrap()
            .to_string();
        let t = std::time::Instant::now();
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "GET /computeMetadata/v1/instance/preempted{query} HTTP/1.1\r\nHost: x\r\nMetadata-Flavor: Google\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        (
            out.rsplit("\r\n\r\n").next().unwrap().to_string(),
            t.elapsed(),
        )
    }

    /// The harness's notice server holds a `wait_for_change` request until the preemption,
    /// as GCP's does, so a notice reaches the agent as it is served.
    #[tokio::test]
    async fn the_notice_server_answers_a_waiting_request_when_the_notice_is_served() {
        let flag = Arc::new(AtomicBool::new(false));
        let url = notice_server(flag.clone(), None).await.unwrap();
        let (body, took) = get(&url, "").await;
        assert_eq!(body, "FALSE");
        assert!(took < Duration::from_secs(10), "not held: {took:?}");
        let (body, took) = get(&url, "?wait_for_change=true&timeout_sec=1").await;
        assert_eq!(body, "FALSE");
        assert!(
            took >= Duration::from_millis(900),
            "held until the timeout: {took:?}"
        );
        let waiting = tokio::spawn({
            let url = url.clone();
            async move { get(&url, "?wait_for_change=true&timeout_sec=30").await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let served = std::time::Instant::now();
        flag.store(true, Ordering::SeqCst);
        let (body, _) = waiting.await.unwrap();
        assert_eq!(body, "TRUE");
        // Well before the request's 30 s: it was answered because the notice was served.
        assert!(
            served.elapsed() < Duration::from_secs(10),
            "answered as the notice was served: {:?}",
            served.elapsed()
        );
    }
}
