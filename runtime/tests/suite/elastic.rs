//! End-to-end tests of elastic runs: several `elastic-run` agents (simulated nodes, distinct
//! node ids and staging dirs) on one real etcd, training `examples/ddp_train.py` with PyTorch
//! gloo, checkpointing to real S3 (moto) or `file://`.
//!
//! The agents' `--events-file` tells what happened (generations, commits, first steps); the
//! workers' output tells what they trained. These tests are heavy (up to 8 PyTorch processes),
//! so they run one at a time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::util::*;
use serde_json::Value;

/// One heavy test at a time: they share 2 cores in CI.
static SERIAL: Mutex<()> = Mutex::new(());

const TTL_MS: u64 = 2_000;
const SETTLE_MS: u64 = 500;

struct Job {
    _guard: std::sync::MutexGuard<'static, ()>,
    tmp: tempfile::TempDir,
    etcd: services::Etcd,
    _moto: Option<services::Moto>,
    url: String,
    env: Vec<(String, String)>,
    id: String,
}

struct Agent {
    node: String,
    child: Child,
    out: Receiver<String>,
    err: Receiver<String>,
    seen: String,
}

impl Job {
    fn new(store: &str) -> Job {
        let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let tmp = tempfile::tempdir().unwrap();
        let etcd = services::etcd().expect("etcd must start (run tests/services/setup.sh)");
        let (moto, url, env) = match store {
            "s3" => {
                let m = services::moto().expect("moto must start");
                m.create_bucket("ckpt").unwrap();
                let env = m.env();
                (Some(m), "s3://ckpt/job".to_string(), env)
            }
            _ => (
                None,
                format!("file://{}", tmp.path().join("bucket").display()),
                vec![],
            ),
        };
        Job {
            _guard: guard,
            tmp,
            etcd,
            _moto: moto,
            url,
            env,
            id: "e2e".into(),
        }
    }

    fn events_path(&self) -> PathBuf {
        self.tmp.path().join("events.jsonl")
    }

    /// An agent command for `node`: `nnodes` MIN:MAX, 2 workers, linear LR scaling from a base
    /// world of 6, checkpoints every 5 steps.
    fn command(&self, node: &str, nnodes: &str, staging: &str, train: &[&str]) -> Command {
        let mut c = agent(self.tmp.path());
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c.args([
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            &self.etcd.host_port(),
            "--rdzv-id",
            &self.id,
            "--node-id",
            node,
            "--local-addr",
            "127.0.0.1",
            "--rdzv-conf",
            &format!("lease_ttl_ms={TTL_MS},settle_ms={SETTLE_MS}"),
            "--checkpoint-url",
            &self.url,
            "--checkpoint-interval",
            "5",
            "--lr-scaling",
            "linear",
            "--base-world-size",
            "6",
            "--batch-size",
            "8",
            "--base-lr",
            "0.05",
            "--preemption-grace",
            "60s",
        ])
        .arg("--staging-dir")
        .arg(self.tmp.path().join(staging))
        .arg("--events-file")
        .arg(self.events_path())
        .arg("--")
        .arg(python())
        .arg(repo().join("examples/ddp_train.py"))
        .args(train);
        c
    }

    /// Starts `node` and waits until it joined, so nodes started one after another take
    /// ranks in that order.
    fn start(&self, node: &str, nnodes: &str, train: &[&str]) -> Agent {
        let a = self.start_cmd(
            node,
            self.command(node, nnodes, &format!("staging-{node}"), train),
        );
        self.wait_event("the node to join", LONG, |e| {
            is(e, "joined") && node_of(e) == node
        });
        a
    }

    fn start_cmd(&self, node: &str, mut c: Command) -> Agent {
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn elastic-run");
        let out = reader(child.stdout.take().unwrap());
        let err = reader(child.stderr.take().unwrap());
        Agent {
            node: node.into(),
            child,
            out,
            err,
            seen: String::new(),
        }
    }

    fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.events_path())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits until an event satisfies `pred`; returns it.
    fn wait_event(&self, what: &str, limit: Duration, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(e) = self.events().into_iter().find(|e| pred(e)) {
                return e;
            }
            assert!(
                Instant::now() < deadline,
                "no {what} within {limit:?}; events:\n{}\netcd: {}",
                self.events()
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("\n"),
                self.etcd.service.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn committed_steps(&self) -> Vec<u64> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let url = self.url.clone();
        let env = self.env.clone();
        rt.block_on(async move {
            let store =
                checkpoint::Store::open_with_options(&url, services::s3_store_options(&env))
                    .unwrap();
            store
                .committed_steps(&checkpoint::CancellationToken::new())
                .await
                .unwrap()
        })
    }
}

impl Agent {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn wait_line(&mut self, needle: &str, limit: Duration) {
        assert!(
            wait_for_line(&self.out, needle, limit, &mut self.seen),
            "{}: no line with {needle:?} within {limit:?}:\n{}\n{}",
            self.node,
            self.seen,
            drain(&self.err)
        );
    }

    /// Waits for exit; returns (status code, stdout, stderr).
    fn finish(mut self, limit: Duration) -> (i32, String, String) {
        let status = wait_limit(&mut self.child, limit);
        self.seen.push_str(&collect(self.out));
        let err = collect(self.err);
        (status.code().unwrap_or(-1), self.seen, err)
    }
}

fn drain(rx: &Receiver<String>) -> String {
    let mut s = String::new();
    while let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
        s.push_str(&l);
        s.push('\n');
    }
    s
}

fn node_of(e: &Value) -> &str {
    e["node"].as_str().unwrap_or("")
}

fn is(e: &Value, event: &str) -> bool {
    e["event"] == event
}

/// Worker PIDs: the agent's children.
fn children(pid: i32) -> Vec<i32> {
    services::child_pids(pid)
}

fn step_of(line_prefix: &str, out: &str) -> Option<u64> {
    out.lines()
        .rev()
        .filter_map(|l| l.split(line_prefix).nth(1))
        .find_map(|r| r.split_whitespace().next()?.parse().ok())
}

const LONG: Duration = Duration::from_secs(240);

#[test]
fn sigkill_of_one_agent_leaves_survivors_training_at_world_4_with_rescaled_lr() {
    let job = Job::new("s3");
    let train = ["--steps", "70", "--step-sleep", "0.1"];
    let mut a = job.start("a", "2:3", &train);
    let b = job.start("b", "2:3", &train);
    let c = job.start("c", "2:3", &train);
    let g1 = job.wait_event("generation at world 6", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6
    });
    let gen1 = g1["generation"].as_u64().unwrap();
    assert!(
        (g1["lr_scale"].as_f64().unwrap() - 1.0).abs() < 1e-9,
        "{g1}"
    );
    job.wait_event("a commit at step 10", LONG, |e| {
        is(e, "checkpoint_committed") && e["step"].as_u64() >= Some(10)
    });
    let workers_c = children(c.pid());
    assert_eq!(workers_c.len(), 2, "c runs two workers");
    let committed_before = *job.committed_steps().last().unwrap();
    let killed_at = events_now();
    signal(&c.child, libc::SIGKILL);
    let mut c = c;
    let _ = c.child.wait();
    // After the kill: a slow third agent can make the job form at world 4 first, and that
    // earlier generation is not the one this waits for.
    let g2 = job.wait_event("generation at world 4 after the kill", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 4
            && node_of(e) == "a"
            && e["generation"].as_u64() > Some(gen1)
    });
    assert_eq!(g2["members"], serde_json::json!(["a", "b"]), "{g2}");
    let scale = g2["lr_scale"].as_f64().unwrap();
    assert!((scale - 4.0 / 6.0).abs() < 1e-9, "LR scale {scale}");
    assert!(
        (g2["lr"].as_f64().unwrap() - 0.05 * 4.0 / 6.0).abs() < 1e-9,
        "{g2}"
    );
    let resume = g2["resume_step"].as_u64().expect("resumes from a commit");
    assert!(
        resume >= committed_before,
        "resume {resume} < committed {committed_before}"
    );
    // c's workers died with it (PR_SET_PDEATHSIG): no orphan trains on.
    std::thread::sleep(Duration::from_millis(500));
    for p in workers_c {
        assert!(!alive(p), "worker {p} of the killed agent is still alive");
    }
    let first = job.wait_event("first step of the new generation", LONG, |e| {
        is(e, "first_step") && e["generation"] == g2["generation"]
    });
    eprintln!(
        "recovery after SIGKILL: {} ms from the kill to the survivors' first step",
        first["ts_ms"].as_u64().unwrap() - killed_at
    );
    a.wait_line(&format!("resumed from step {resume} "), LONG);
    a.wait_line("world 4 accum 1", LONG);
    let (code_a, out_a, err_a) = a.finish(LONG);
    let (code_b, _, err_b) = b.finish(LONG);
    assert_eq!(code_a, 0, "{out_a}\n{err_a}");
    assert_eq!(code_b, 0, "{err_b}");
    assert!(out_a.contains("done step 70 "), "{out_a}");
    assert!(job.committed_steps().contains(&70));
}

#[test]
fn sigkill_of_one_node_leaves_the_survivors_switching_in_place_and_a_joiner_takes_their_state() {
    let job = Job::new("file");
    let train = [
        "--steps",
        "90",
        "--step-sleep",
        "0.1",
        "--in-place",
        "--digest-every-rank",
    ];
    let a = job.start("a", "2:3", &train);
    let b = job.start("b", "2:3", &train);
    let c = job.start("c", "2:3", &train);
    let g1 = job.wait_event("generation at world 6", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6
    });
    let gen1 = g1["generation"].as_u64().unwrap();
    job.wait_event("a commit at step 10", LONG, |e| {
        is(e, "checkpoint_committed") && e["step"].as_u64() >= Some(10)
    });
    let (workers_a, workers_b) = (children(a.pid()), children(b.pid()));
    assert_eq!((workers_a.len(), workers_b.len()), (2, 2));
    let killed_at = events_now();
    signal(&c.child, libc::SIGKILL);
    let mut c = c;
    let _ = c.child.wait();
    let g2 = job.wait_event("the survivors' generation at world 4", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 4
            && node_of(e) == "a"
            && e["generation"].as_u64() > Some(gen1)
    });
    assert_eq!(g2["in_place"], true, "the workers switched in place: {g2}");
    assert_eq!(g2["members"], serde_json::json!(["a", "b"]), "{g2}");
    let scale = g2["lr_scale"].as_f64().unwrap();
    assert!((scale - 4.0 / 6.0).abs() < 1e-9, "LR scale {scale}");
    let first = job.wait_event("first step of the new generation", LONG, |e| {
        is(e, "first_step") && e["generation"] == g2["generation"] && node_of(e) == "a"
    });
    eprintln!(
        "recovery in place after SIGKILL: {} ms from the kill to the survivors' first step",
        first["ts_ms"].as_u64().unwrap() - killed_at
    );
    // The same processes train on: nothing was restarted or restored.
    assert_eq!(children(a.pid()), workers_a);
    assert_eq!(children(b.pid()), workers_b);
    // A new node joins: a and b switch in place again; d's fresh workers start without a
    // restore and take the survivors' state from them over the new group.
    let d = job.start("d", "2:3", &train);
    let g3 = job.wait_event("the generation with the joiner", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6 && node_of(e) == "d"
    });
    let on_a = job.wait_event("a's switch to it", LONG, |e| {
        is(e, "generation") && node_of(e) == "a" && e["generation"] == g3["generation"]
    });
    assert_eq!(
        on_a["in_place"],
        true,
        "{on_a}\n{}\n{}",
        drain(&a.out),
        drain(&a.err)
    );
    assert_eq!(children(a.pid()), workers_a);
    let (code_a, out_a, err_a) = a.finish(LONG);
    let (code_b, out_b, err_b) = b.finish(LONG);
    let (code_d, out_d, err_d) = d.finish(LONG);
    // The survivors' failed collective asked for the regroup: the leader (a, started first)
    // re-formed without c once a and b confirmed, not when c's lease lapsed.
    assert!(
        err_a.contains("left out (did not confirm): c"),
        "no regroup without c on a:\n{err_a}"
    );
    assert_eq!(code_a, 0, "{out_a}\n{err_a}");
    assert_eq!(code_b, 0, "{err_b}");
    assert_eq!(code_d, 0, "{out_d}\n{err_d}");
    assert!(
        out_a.contains(&format!("switched to generation {}", g2["generation"])),
        "{out_a}"
    );
    assert!(out_a.contains("world 4 accum 1"), "{out_a}");
    assert!(out_a.contains("done step 90 "), "{out_a}");
    // d restored nothing: it joined at the newest commit, which the survivors hold in memory.
    assert_eq!(g3["resume_step"], Value::Null, "{g3}");
    assert_eq!(
        g3["restored_bytes"],
        Value::Null,
        "no bytes from the bucket: {g3}"
    );
    let joined_at = g3["heal_step"]
        .as_u64()
        .unwrap_or_else(|| panic!("the joiner heals from its peers: {g3}"));
    let switched_at: u64 = out_a
        .lines()
        .find_map(|l| {
            l.split(&format!(
                "switched to generation {} in place at step ",
                g3["generation"]
            ))
            .nth(1)?
            .split(' ')
            .next()?
            .parse()
            .ok()
        })
        .unwrap_or_else(|| panic!("a did not switch to the joiner's generation:\n{out_a}"));
    let healed: Vec<&str> = out_d
        .lines()
        .filter(|l| l.contains("took the state of step"))
        .collect();
    assert!(switched_at >= joined_at, "{switched_at} < {joined_at}");
    assert_eq!(
        healed.len(),
        2,
        "d's ranks took the survivors' state:\n{out_d}"
    );
    for l in &healed {
        assert!(
            l.contains(&format!("state of step {switched_at} ")) && l.contains("(it held step 0)"),
            "{l}"
        );
    }
    // Every rank ends with the same weights: the joiner's are the survivors'.
    let digests: std::collections::BTreeSet<&str> = [&out_a, &out_b, &out_d]
        .iter()
        .flat_map(|o| o.lines())
        .filter(|l| l.contains("] rank ") && l.contains(" done step 90 weights "))
        .filter_map(|l| l.rsplit(' ').next())
        .collect();
    let ranks = [&out_a, &out_b, &out_d]
        .iter()
        .flat_map(|o| o.lines())
        .filter(|l| l.contains(" done step 90 weights "))
        .filter(|l| l.contains("] rank "))
        .count();
    assert_eq!(
        ranks, 6,
        "every rank printed its digest:\n{out_a}\n{out_b}\n{out_d}"
    );
    assert_eq!(digests.len(), 1, "{digests:?}");
    for e in job.events() {
        assert!(
            !(is(&e, "workers_started")
                && node_of(&e) != "d"
                && e["generation"].as_u64() > Some(gen1)),
            "no worker group of a or b was started after the first: {e}"
        );
        assert!(!is(&e, "restore_fell_back"), "{e}");
        assert!(
            !is(&e, "restored_on_demand"),
            "nothing was read from the store: {e}"
        );
    }
    assert!(job.committed_steps().contains(&90));
}

fn events_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[test]
fn sigterm_of_one_node_leaves_the_survivors_switching_in_place_from_the_drained_step() {
    let job = Job::new("file");
    let train = ["--steps", "60", "--step-sleep", "0.1", "--in-place"];
    let mut a = job.start("a", "2:3", &train);
    let b = job.start("b", "2:3", &train);
    let c = job.start("c", "2:3", &train);
    let g1 = job.wait_event("generation at world 6", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6
    });
    a.wait_line("[rank 0] step 8 ", LONG);
    let (workers_a, workers_b) = (children(a.pid()), children(b.pid()));
    assert_eq!((workers_a.len(), workers_b.len()), (2, 2));
    signal(&c.child, libc::SIGTERM);
    let (code_c, _out_c, err_c) = c.finish(LONG);
    assert_eq!(code_c, 0, "the preempted agent drains cleanly:\n{err_c}");
    let left = job
        .events()
        .into_iter()
        .find(|e| is(e, "left") && node_of(e) == "c")
        .unwrap_or_else(|| panic!("c did not leave after its drained step:\n{err_c}"));
    let stopped = left["step"].as_u64().expect("c's drained step");
    let g2 = job.wait_event("the survivors' generation at world 4", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 4
            && node_of(e) == "a"
            && e["generation"].as_u64() > g1["generation"].as_u64()
    });
    assert_eq!(g2["in_place"], true, "the workers switched in place: {g2}");
    let first = job.wait_event("first step of the new generation", LONG, |e| {
        is(e, "first_step") && e["generation"] == g2["generation"] && node_of(e) == "a"
    });
    let committed = job
        .events()
        .iter()
        .filter(|e| is(e, "checkpoint_committed") && e["step"].as_u64() == Some(stopped))
        .map(|e| e["ts_ms"].as_u64().unwrap())
        .min()
        .unwrap_or_else(|| panic!("the drained step {stopped} was not committed:\n{err_c}"));
    eprintln!(
        "recovery in place after SIGTERM: {} ms from the drained step's commit to the survivors' first step",
        first["ts_ms"].as_u64().unwrap().saturating_sub(committed)
    );
    // The same processes train on, from the drained step: nothing restarted, nothing lost.
    assert_eq!(children(a.pid()), workers_a);
    assert_eq!(children(b.pid()), workers_b);
    let (code_a, out_a, err_a) = a.finish(LONG);
    let (code_b, _, err_b) = b.finish(LONG);
    assert_eq!(code_a, 0, "{out_a}\n{err_a}");
    assert_eq!(code_b, 0, "{err_b}");
    assert!(
        out_a.contains(&format!(
            "switched to generation {} in place at step {stopped} ",
            g2["generation"]
        )),
        "the survivors go on from the drained step {stopped}:\n{out_a}"
    );
    assert!(!out_a.contains("stopping at step"), "{out_a}");
    assert!(out_a.contains("world 4 accum 1"), "{out_a}");
    assert!(out_a.contains("done step 60 "), "{out_a}");
    for e in job.events() {
        assert!(
            !(is(&e, "workers_started") && e["generation"].as_u64() > g1["generation"].as_u64()),
            "no worker group was started after the first: {e}"
        );
    }
    assert!(job.committed_steps().contains(&60));
}

#[test]
fn sigterm_of_one_agent_commits_its_emergency_checkpoint_and_no_step_is_lost() {
    let job = Job::new("s3");
    let train = ["--steps", "100000", "--step-sleep", "0.1"];
    let mut a = job.start("a", "2:3", &train);
    let b = job.start("b", "2:3", &train);
    // c's workers take 10 s to exit after their last save (a slow teardown): its agent leaves
    // the job as soon as that save is committed, without waiting for them.
    let train_c = [&train[..], &["--exit-linger", "10"]].concat();
    let c = job.start("c", "2:3", &train_c);
    let g1 = job.wait_event("generation at world 6", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6
    });
    a.wait_line("[rank 0] step 8 ", LONG);
    let termed_at = events_now();
    signal(&c.child, libc::SIGTERM);
    // Every rank stops at the same step and saves it; rank 0 (on a) says which.
    a.wait_line("stopping at step", LONG);
    let stopped = step_of("stopping at step ", &a.seen).unwrap();
    // The one after the drain (a slow third agent can make an earlier one at world 4).
    let g2 = job.wait_event("generation at world 4 after the drain", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 4
            && node_of(e) == "a"
            && e["generation"].as_u64() > g1["generation"].as_u64()
    });
    assert_eq!(
        g2["resume_step"].as_u64(),
        Some(stopped),
        "zero lost steps: the new generation resumes from the drained step"
    );
    let (code_c, _out_c, err_c) = c.finish(LONG);
    assert_eq!(code_c, 0, "the preempted agent drains cleanly:\n{err_c}");
    let events = job.events();
    // From the events, not a listing: while c's workers linger, a and b train on and
    // retention may already have retired the drained step.
    assert!(
        events
            .iter()
            .any(|e| is(e, "checkpoint_committed") && e["step"].as_u64() == Some(stopped)),
        "the drained step {stopped} was committed:\n{err_c}"
    );
    let of_c = |name: &str| {
        events
            .iter()
            .find(|e| is(e, name) && node_of(e) == "c")
            .unwrap_or_else(|| panic!("no {name} event of c:\n{err_c}"))
    };
    let left = of_c("left");
    assert_eq!(left["step"].as_u64(), Some(stopped), "{left}");
    assert_eq!(
        left["workers_running"], true,
        "c left before its workers exited: {left}"
    );
    let committed = events
        .iter()
        .filter(|e| is(e, "checkpoint_committed") && e["step"].as_u64() == Some(stopped))
        .map(|e| e["ts_ms"].as_u64().unwrap())
        .min()
        .unwrap();
    let (left_ms, exit_ms) = (
        left["ts_ms"].as_u64().unwrap(),
        of_c("exit")["ts_ms"].as_u64().unwrap(),
    );
    let g2_ms = g2["frozen_unix_ms"].as_u64().unwrap();
    assert!(
        committed <= left_ms && committed <= g2_ms,
        "the survivors' generation never comes before the drained step's commit: committed \
         {committed}, c left {left_ms}, generation frozen {g2_ms}"
    );
    assert!(
        g2_ms < exit_ms,
        "the survivors re-formed while c's workers were still exiting: frozen {g2_ms}, c's exit \
         {exit_ms}"
    );
    let first = job.wait_event("first step of the new generation", LONG, |e| {
        is(e, "first_step") && e["generation"] == g2["generation"]
    });
    eprintln!(
        "recovery after SIGTERM: {} ms from the signal to the survivors' first step",
        first["ts_ms"].as_u64().unwrap() - termed_at
    );
    a.wait_line(&format!("resumed from step {stopped} "), LONG);
    a.wait_line(&format!("[rank 0] step {} ", stopped + 1), LONG);
    assert!(
        !a.seen.contains(&format!("[rank 0] step {stopped} loss"))
            || a.seen
                .matches(&format!("[rank 0] step {stopped} loss"))
                .count()
                == 1,
        "step {stopped} trained twice"
    );
    // Stop the survivors too: each drains, the job ends cleanly.
    signal(&a.child, libc::SIGTERM);
    signal(&b.child, libc::SIGTERM);
    let (code_a, out_a, err_a) = a.finish(LONG);
    let (code_b, _, err_b) = b.finish(LONG);
    assert_eq!(code_a, 0, "{out_a}\n{err_a}");
    assert_eq!(code_b, 0, "{err_b}");
}

#[test]
fn a_fourth_agent_joins_and_the_job_scales_up() {
    let job = Job::new("file");
    let train = ["--steps", "60", "--step-sleep", "0.1"];
    // Members are ranked by join time: start each after the one before has joined, so the
    // order asserted below is the order they joined in, not a race between three processes.
    let a = job.start("a", "2:4", &train);
    job.wait_event("a to join", LONG, |e| is(e, "joined") && node_of(e) == "a");
    let b = job.start("b", "2:4", &train);
    job.wait_event("b to join", LONG, |e| is(e, "joined") && node_of(e) == "b");
    let c = job.start("c", "2:4", &train);
    job.wait_event("generation at world 6", LONG, |e| {
        is(e, "generation") && e["world_size"] == 6
    });
    job.wait_event("a commit", LONG, |e| is(e, "checkpoint_committed"));
    let d = job.start("d", "2:4", &train);
    let g = job.wait_event("generation at world 8", LONG, |e| {
        is(e, "generation") && e["world_size"] == 8 && node_of(e) == "d"
    });
    assert_eq!(g["members"], serde_json::json!(["a", "b", "c", "d"]));
    assert!(
        (g["lr_scale"].as_f64().unwrap() - 8.0 / 6.0).abs() < 1e-9,
        "{g}"
    );
    assert_eq!(g["rank_offset"], 6);
    // d joined a, b and c, which continue; their workers restart (this script does not switch
    // in place) and restore the step, so d's workers have their agent restore it on load.
    assert_eq!(g["resume_step"], Value::Null, "{g}");
    let joined_at = g["heal_step"].as_u64().unwrap_or_else(|| panic!("{g}"));
    let restored = job.wait_event("d's restore on its workers' request", LONG, |e| {
        is(e, "restored_on_demand") && node_of(e) == "d"
    });
    assert_eq!(restored["step"].as_u64(), Some(joined_at), "{restored}");
    assert!(restored["bytes"].as_u64() > Some(0), "{restored}");
    for ag in [a, b, c, d] {
        let node = ag.node.clone();
        let (code, out, err) = ag.finish(LONG);
        assert_eq!(code, 0, "{node}:\n{out}\n{err}");
    }
    let done: Vec<Value> = job.events().into_iter().filter(|e| is(e, "exit")).collect();
    assert_eq!(done.len(), 4, "{done:?}");
}

#[test]
fn fresh_agents_with_empty_staging_resume_from_the_s3_bucket() {
    let mut job = Job::new("s3");
    let train = ["--steps", "100000", "--step-sleep", "0.05"];
    let agents: Vec<Agent> = ["a", "b", "c"]
        .into_iter()
        .map(|n| job.start(n, "2:3", &train))
        .collect();
    job.wait_event("a commit at step 10", LONG, |e| {
        is(e, "checkpoint_committed") && e["step"].as_u64() >= Some(10)
    });
    // Every agent dies at once: nothing but the bucket is left.
    for mut ag in agents {
        signal(&ag.child, libc::SIGKILL);
        let _ = ag.child.wait();
    }
    let newest = *job.committed_steps().last().unwrap();
    std::fs::remove_dir_all(job.tmp.path().join("staging-a")).ok();
    // A new run id: the old one's leases need a TTL to expire, the bucket is what matters.
    job.id = "e2e-resumed".into();
    let steps = (newest + 6).to_string();
    let train2 = ["--steps", steps.as_str(), "--step-sleep", "0.05"];
    let mut x = job.start_cmd("x", job.command("x", "2:2", "fresh-x", &train2));
    job.wait_event("x to join", LONG, |e| is(e, "joined") && node_of(e) == "x");
    let y = job.start_cmd("y", job.command("y", "2:2", "fresh-y", &train2));
    let g = job.wait_event("generation of the fresh agents", LONG, |e| {
        is(e, "generation") && node_of(e) == "x"
    });
    assert_eq!(g["world_size"], 4);
    assert_eq!(g["resume_step"].as_u64(), Some(newest), "{g}");
    x.wait_line(&format!("resumed from step {newest} "), LONG);
    let (code_x, out_x, err_x) = x.finish(LONG);
    let (code_y, _, err_y) = y.finish(LONG);
    assert_eq!(code_x, 0, "{out_x}\n{err_x}");
    assert_eq!(code_y, 0, "{err_y}");
    assert!(out_x.contains(&format!("done step {steps} ")), "{out_x}");
}

fn digest(out: &str) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with("[rank 0] done step"))
        .unwrap_or_else(|| panic!("{out}"));
    line.rsplit(' ').next().unwrap().to_string()
}

/// Two agents train `steps` steps (from whatever the bucket holds); returns rank 0's output.
fn two_nodes(job: &Job, steps: u32, tag: &str) -> String {
    let started = events_now();
    let s = steps.to_string();
    let train = ["--steps", s.as_str(), "--seed", "3"];
    let mut c0 = job.command("p", "2:2", &format!("st-{tag}-p"), &train);
    let mut c1 = job.command("q", "2:2", &format!("st-{tag}-q"), &train);
    for c in [&mut c0, &mut c1] {
        c.env("ELASTIC_LR_SCALING", "none");
    }
    let p = job.start_cmd("p", c0);
    job.wait_event("p to join", LONG, |e| {
        is(e, "joined") && node_of(e) == "p" && e["ts_ms"].as_u64() >= Some(started)
    });
    let q = job.start_cmd("q", c1);
    let (code_p, out_p, err_p) = p.finish(LONG);
    let (code_q, _, err_q) = q.finish(LONG);
    assert_eq!(code_p, 0, "{out_p}\n{err_p}");
    assert_eq!(code_q, 0, "{err_q}");
    out_p
}

#[test]
fn restarting_at_the_same_world_size_gives_bitwise_equal_weights() {
    let mut job = Job::new("file");
    let straight = two_nodes(&job, 24, "s");
    job.url = format!("file://{}", job.tmp.path().join("bucket2").display());
    job.id = "e2e-2".into();
    let first = two_nodes(&job, 11, "f");
    job.id = "e2e-3".into();
    let resumed = two_nodes(&job, 24, "r");
    assert!(resumed.contains("resumed from step 11 "), "{resumed}");
    assert_ne!(
        digest(&first),
        digest(&straight),
        "the check must be able to fail"
    );
    assert_eq!(digest(&resumed), digest(&straight));
}

#[test]
fn an_unmodified_torchrun_script_runs_on_two_nodes() {
    let job = Job::new("file");
    let mk = |node: &str| {
        // The same agent flags, with the plain torchrun script as the training command.
        let c = job.command(node, "2:2", &format!("st-{node}"), &[]);
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let cut = args.iter().position(|a| a == "--").unwrap();
        let mut plain = agent(job.tmp.path());
        plain
            .args(&args[..=cut])
            .arg(python())
            .arg(repo().join("examples/torchrun_plain.py"));
        plain
    };
    let p = job.start_cmd("p", mk("p"));
    let q = job.start_cmd("q", mk("q"));
    let (code_p, out_p, err_p) = p.finish(LONG);
    let (code_q, out_q, err_q) = q.finish(LONG);
    assert_eq!(code_p, 0, "{out_p}\n{err_p}");
    assert_eq!(code_q, 0, "{out_q}\n{err_q}");
    let all = format!("{out_p}{out_q}");
    for r in 0..4 {
        assert!(
            all.contains(&format!("[rank {r}]")),
            "rank {r} missing:\n{all}"
        );
    }
}

#[test]
fn status_shows_members_generation_and_commits() {
    let job = Job::new("file");
    let train = ["--steps", "100000", "--step-sleep", "0.05"];
    let a = job.start("a", "2:2", &train);
    let b = job.start("b", "2:2", &train);
    job.wait_event("a commit", LONG, |e| is(e, "checkpoint_committed"));
    // The event says the store has the step; etcd hears of it a moment later (the agent
    // reports it after the commit): wait on the view asserted, etcd's, with a deadline.
    let deadline = Instant::now() + Duration::from_secs(30);
    let v: Value = loop {
        let out = Command::new(BIN)
            .args([
                "status",
                "--rdzv-endpoint",
                &job.etcd.host_port(),
                "--rdzv-id",
                &job.id,
                "--checkpoint-url",
                &job.url,
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        if v["latest_commit"]["step"].as_u64().is_some() || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(v["members"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["generation"]["world_size"], 4, "{v}");
    assert!(v["latest_commit"]["step"].as_u64().is_some(), "{v}");
    // The commit names the generation that saved it (the leader re-forms a generation that
    // a newer commit of its predecessor overtook).
    assert_eq!(
        v["latest_commit"]["generation"], v["generation"]["number"],
        "{v}"
    );
    assert!(
        !v["checkpoints"]["steps"].as_array().unwrap().is_empty(),
        "{v}"
    );
    let text = Command::new(BIN)
        .args([
            "status",
            "--rdzv-endpoint",
            &job.etcd.host_port(),
            "--rdzv-id",
            &job.id,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    assert!(text.contains("world 4"), "{text}");
    assert!(text.contains(", generation 1)"), "{text}");
    for ag in [a, b] {
        signal(&ag.child, libc::SIGTERM);
        let (code, out, err) = ag.finish(LONG);
        assert_eq!(code, 0, "{out}\n{err}");
    }
}

#[test]
fn a_crashing_worker_restarts_every_node_from_the_newest_commit() {
    let job = Job::new("file");
    // Rank 3 (on q) crashes once at step 8: every node restarts from the newest commit, at
    // the same world size, its new workers started in the warm standbys (`--warm-standby`)
    // that each agent started once its first group trained.
    let with = |node: &str, restarts: &str| {
        let mut c = job.command(
            node,
            "2:2",
            &format!("st-{node}"),
            &[
                "--steps",
                "40",
                "--step-sleep",
                "0.05",
                "--crash-at",
                "8",
                "--crash-rank",
                "3",
                "--crash-restarts",
                restarts,
            ],
        );
        c.env("PET_MAX_RESTARTS", "1");
        c.env("ELASTIC_WARM_STANDBY", "1");
        c
    };
    let p = job.start_cmd("p", with("p", "1"));
    job.wait_event("p to join", LONG, |e| is(e, "joined") && node_of(e) == "p");
    let q = job.start_cmd("q", with("q", "1"));
    let (code_p, out_p, err_p) = p.finish(LONG);
    let (code_q, out_q, err_q) = q.finish(LONG);
    assert_eq!(code_p, 0, "{out_p}\n{err_p}");
    assert_eq!(code_q, 0, "{out_q}\n{err_q}");
    assert!(out_q.contains("crashing at step 8"), "{out_q}");
    assert!(out_p.contains("done step 40 "), "{out_p}");
    // Every worker of generation 2 ran in a standby, and its output reached the agent's
    // (rank 0's last line above came from one).
    for (node, err) in [("p", &err_p), ("q", &err_q)] {
        assert_eq!(
            err.matches("worker started from a warm standby").count(),
            2,
            "{node}: {err}"
        );
    }
    // Both nodes start generation 2's workers. q counts its failure as a restart; p counts one
    // only when its own workers failed on the lost peer before q's restart request reached
    // it, else it restarts for the new generation, uncounted (the decision core does not count
    // a failure that comes with a membership change), so p's count is 0 or 1 by the race.
    let started: Vec<Value> = job
        .events()
        .into_iter()
        .filter(|e| is(e, "workers_started") && e["generation"] == 2)
        .collect();
    let count = |node: &str| {
        started
            .iter()
            .filter(|e| node_of(e) == node)
            .map(|e| e["restart_count"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(count("q"), [1], "q restarts once, counted: {started:?}");
    assert!(
        count("p") == [0] || count("p") == [1],
        "p restarts once: {started:?}"
    );
    let g = job.wait_event("the restart generation", LONG, |e| {
        is(e, "generation") && e["generation"].as_u64() >= Some(2) && node_of(e) == "p"
    });
    assert_eq!(g["world_size"], 4, "{g}");
    assert_eq!(g["resume_step"], 5, "resumes from the newest commit: {g}");
}

#[test]
fn a_worker_crashing_past_max_restarts_fails_every_node_with_its_error() {
    let mut job = Job::new("file");
    job.id = "e2e-fail".into();
    let mk = |node: &str| {
        let mut c = job.command(
            node,
            "2:2",
            &format!("st-{node}"),
            &[
                "--steps",
                "40",
                "--crash-at",
                "3",
                "--crash-rank",
                "3",
                "--crash-restarts",
                "9",
            ],
        );
        c.env("PET_MAX_RESTARTS", "1");
        c
    };
    let p = job.start_cmd("p", mk("p"));
    job.wait_event("p to join", LONG, |e| is(e, "joined") && node_of(e) == "p");
    let q = job.start_cmd("q", mk("q"));
    let (code_p, _, err_p) = p.finish(LONG);
    let (code_q, _, err_q) = q.finish(LONG);
    assert_eq!(code_q, 3, "q fails with its worker's exit code:\n{err_q}");
    assert!(err_q.contains("exit code 3"), "{err_q}");
    assert_ne!(code_p, 0, "the job failed for p too:\n{err_p}");
}

// ---- etcd with TLS and auth ----

/// A quick agent of `job` on `endpoint`: one shell worker (no Python) that prints its rank
/// and stays `$HOLD_S` seconds, short timings, and `conf` appended to `--rdzv-conf`. None of
/// the caller's `ETCDCTL_*`.
fn shell_agent(
    tmp: &std::path::Path,
    endpoint: &str,
    job: &str,
    node: &str,
    nnodes: &str,
    conf: &str,
) -> Command {
    let mut c = agent(tmp);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("ETCDCTL_") {
            c.env_remove(&k);
        }
    }
    c.args([
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        job,
        "--node-id",
        node,
        "--local-addr",
        "127.0.0.1",
        "--rdzv-conf",
        &format!("lease_ttl_ms={TTL_MS},settle_ms=200,request_timeout_ms=5000{conf}"),
    ])
    .arg("--staging-dir")
    .arg(tmp.join(format!("staging-{job}-{node}")))
    .arg("--checkpoint-url")
    .arg(tmp.join("bucket"))
    .args([
        "--no-python",
        "--",
        "sh",
        "-c",
        "echo \"worker rank $RANK of $WORLD_SIZE\"; sleep \"${HOLD_S:-0}\"",
    ]);
    c
}

/// `elastic-run status --json` of `job` with `conf` as `--rdzv-conf` and `env`; returns the
/// exit code, stdout and stderr.
fn status_of(endpoint: &str, job: &str, conf: &str, env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("ETCDCTL_") || k.starts_with("ELASTIC_") || k.starts_with("PET_") {
            c.env_remove(&k);
        }
    }
    c.args([
        "status",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        job,
        "--json",
    ])
    .args(["--rdzv-conf", conf])
    .envs(env.iter().copied());
    let (status, out, err) = run(c, Duration::from_secs(60));
    (status.code().unwrap_or(-1), out, err)
}

#[test]
fn a_two_node_job_runs_on_etcd_with_client_certificates_and_a_foreign_certificate_is_refused() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let etcd = services::etcd_tls().expect("etcd with TLS must start");
    let ep = etcd.host_port();
    let t = &etcd.tls;
    let tls = |ca: &std::path::Path, cert: &std::path::Path, key: &std::path::Path| {
        format!(
            "protocol=https,cacert={},cert={},key={}",
            ca.display(),
            cert.display(),
            key.display()
        )
    };
    let good = tls(&t.ca, &t.client_cert, &t.client_key);
    let spawn = |node: &str| {
        let mut c = shell_agent(tmp.path(), &ep, "tlsjob", node, "2:2", &format!(",{good}"));
        // The first node done finishes the job: the other must have started its worker.
        c.env("HOLD_S", "1");
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = reader(child.stdout.take().unwrap());
        let err = reader(child.stderr.take().unwrap());
        (child, out, err)
    };
    let nodes = [spawn("p"), spawn("q")];
    let mut all = String::new();
    for (mut child, out, err) in nodes {
        let status = wait_limit(&mut child, Duration::from_secs(60));
        let (out, err) = (collect(out), collect(err));
        assert!(
            status.success(),
            "{status:?}\n{out}\n{err}\netcd: {}",
            etcd.service.log_tail()
        );
        all.push_str(&out);
    }
    for r in 0..2 {
        assert!(all.contains(&format!("worker rank {r} of 2")), "{all}");
    }
    // `status` reaches it with the same settings.
    let (code, out, err) = status_of(&ep, "tlsjob", &good, &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["job_state"]["outcome"], "succeeded", "{v}");

    // A client certificate from another CA: the agent fails at once, saying why and where.
    let other = services::TlsFiles::generate(&tmp.path().join("other-ca")).unwrap();
    let foreign = tls(&t.ca, &other.client_cert, &other.client_key);
    let c = shell_agent(
        tmp.path(),
        &ep,
        "tlsjob2",
        "p",
        "1:2",
        &format!(",{foreign}"),
    );
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    for needle in ["TLS", "client certificate", ep.as_str()] {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
    assert!(!out.contains("worker rank"), "{out}");
    // A CA that did not sign etcd's certificate: `status` says so.
    let wrong_ca = tls(&other.ca, &t.client_cert, &t.client_key);
    let (code, out, err) = status_of(&ep, "tlsjob", &wrong_ca, &[]);
    assert_eq!(code, 1, "{out}\n{err}");
    for needle in ["TLS", "server certificate", "cacert", ep.as_str()] {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
}

#[test]
fn with_etcd_auth_a_wrong_password_is_refused_unshown_and_a_user_reaches_only_its_job() {
    let _guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().unwrap();
    let etcd = services::etcd().expect("etcd must start");
    let ep = etcd.host_port();
    // alice's role reads and writes jobA's keys only (the elastic crate's layout).
    let prefix_a = elastic::keys::Keys::new("jobA").prefix().to_string();
    services::etcd_enable_auth(&etcd, "root-pw-1", &[("alice", "alice-pw-2", &prefix_a)]).unwrap();
    let secrets = ["root-pw-1", "alice-pw-2", "wrong-pw-3"];
    let no_secret = |what: &str, text: &str| {
        for s in secrets {
            assert!(!text.contains(s), "{what} shows a password: {text}");
        }
    };

    let mut c = shell_agent(tmp.path(), &ep, "jobA", "a", "1:2", "");
    c.env("ELASTIC_ETCD_USERNAME", "alice")
        .env("ELASTIC_ETCD_PASSWORD", "wrong-pw-3");
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    for needle in [
        "refused user `alice`",
        "wrong user name or password",
        ep.as_str(),
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
    no_secret("a refused agent", &format!("{out}{err}"));

    // etcdctl's form of the credentials works as well.
    let mut c = shell_agent(tmp.path(), &ep, "jobA", "a", "1:2", "");
    c.env("ETCDCTL_USER", "alice:alice-pw-2");
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{out}\n{err}");
    assert!(out.contains("worker rank 0 of 1"), "{out}");
    no_secret("the agent", &format!("{out}{err}"));

    // Another job's keys are out of alice's reach, for the agent and for `status`.
    let mut c = shell_agent(tmp.path(), &ep, "jobB", "a", "1:2", "");
    c.env("ETCDCTL_USER", "alice:alice-pw-2");
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    for needle in ["permission denied", "`alice`", "/elastic-run/jobB/"] {
        assert!(err.contains(needle), "stderr lacks {needle:?}: {err}");
    }
    assert!(!out.contains("worker rank"), "{out}");
    no_secret("the refused job", &format!("{out}{err}"));
    let alice = [
        ("ELASTIC_ETCD_USERNAME", "alice"),
        ("ELASTIC_ETCD_PASSWORD", "alice-pw-2"),
    ];
    let (code, out, err) = status_of(&ep, "jobB", "", &alice);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("permission denied"), "{err}");
    no_secret("status", &format!("{out}{err}"));
    let (code, out, err) = status_of(&ep, "jobA", "", &alice);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["job_state"]["outcome"], "succeeded", "{v}");
}

// ---- sharded (FSDP2) state ----

/// `job`'s agent command for `node` with one worker running `examples/fsdp_train.py` `train`,
/// and the job's other flags as they are.
fn fsdp_agent(job: &Job, node: &str, train: &[&str]) -> Command {
    let usual = job.command(node, "2:4", &format!("st-{node}"), train);
    let mut args: Vec<std::ffi::OsString> = usual.get_args().map(|a| a.to_owned()).collect();
    let nproc = args.iter().position(|a| a == "--nproc-per-node").unwrap();
    args[nproc + 1] = "1".into();
    let script = repo().join("examples/ddp_train.py");
    let at = args.iter().position(|a| *a == *script.as_os_str()).unwrap();
    args[at] = repo().join("examples/fsdp_train.py").into();
    let mut c = agent(job.tmp.path());
    c.envs(job.env.iter().map(|(k, v)| (k, v))).args(args);
    c
}

/// The digests rank 0 of `examples/fsdp_train.py --log-digests` printed, by (event, step):
/// every parameter and optimizer tensor, gathered whole, and the world that printed them.
fn fsdp_digests(out: &str) -> Vec<(String, u64, u64, Value)> {
    out.lines()
        .filter_map(|l| l.strip_prefix("[rank 0] digests "))
        .map(|j| {
            let v: Value = serde_json::from_str(j).unwrap_or_else(|e| panic!("{e}: {j}"));
            let event = v["event"].as_str().unwrap().to_string();
            let (step, world) = (v["step"].as_u64().unwrap(), v["world"].as_u64().unwrap());
            (event, step, world, v["tensors"].clone())
        })
        .collect()
}

/// Checks an FSDP2 run's exported model and EMA (argv: repo, bucket URL, model dir, EMA dir,
/// the digests `examples/fsdp_train.py` logged at the final save) through safetensors, DCP's
/// HuggingFaceStorageReader into a fresh model, and `elastic_run.load_from` of the bucket.
const FSDP_EXPORT_CHECK: &str = r#"
import json, os, sys
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from safetensors.torch import load_file
repo, url, model_dir, ema_dir, want = sys.argv[1:6]
sys.path[:0] = [os.path.join(repo, "examples"), os.path.join(repo, "runtime", "python")]
import elastic_run
from fsdp_train import make_model, tensor_digest
want = json.loads(want)

def check(got, key, how):
    expect = {k[len(key) + 1:]: v for k, v in want.items() if k.startswith(key + ".")}
    have = {k: tensor_digest(t) for k, t in got.items()}
    assert len(expect) == 6 and have == expect, (how, key, have, expect)

for d, key in ((model_dir, "model"), (ema_dir, "ema")):
    assert os.listdir(d) == ["model.safetensors"], os.listdir(d)
    check(load_file(os.path.join(d, "model.safetensors")), key, "safetensors")
    fresh = make_model()
    sd = fresh.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(d))
    fresh.load_state_dict(sd)
    check(fresh.state_dict(), key, "dcp")
model, ema = make_model(), make_model()
step = elastic_run.load_from(url, {"model": model, "ema": ema}, strict=False)
check(model.state_dict(), "model", "load_from")
check(ema.state_dict(), "ema", "load_from")
print(f"ok {step}")
"#;

#[test]
fn fsdp_loop_state_resumes_resharded_after_kill_and_preemption_and_exports_readably() {
    let started = Instant::now();
    let job = Job::new("file");
    let train = ["--steps", "100000", "--step-sleep", "0.05", "--log-digests"];
    let mut agents = Vec::new();
    for node in ["a", "b", "c", "d"] {
        agents.push(job.start_cmd(node, fsdp_agent(&job, node, &train)));
        // Ranks follow the order of joining: a holds rank 0, whose output this test reads.
        job.wait_event("the node to join", LONG, |e| {
            is(e, "joined") && node_of(e) == node
        });
    }
    let (mut d, c) = (agents.pop().unwrap(), agents.pop().unwrap());
    let (mut a, b) = (agents.remove(0), agents.remove(0));
    let g1 = job.wait_event("generation at world 4", LONG, |e| {
        is(e, "generation") && e["world_size"] == 4
    });
    job.wait_event("a commit at world 4", LONG, |e| {
        is(e, "checkpoint_committed") && e["generation"] == g1["generation"]
    });

    // kill -9 of d: a, b and c resume from the bucket at world 3 (the agents' restore cuts
    // every rank's new rows).
    signal(&d.child, libc::SIGKILL);
    let _ = d.child.wait();
    let g2 = job.wait_event("generation at world 3 after the kill", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 3
            && node_of(e) == "a"
            && e["generation"].as_u64() > g1["generation"].as_u64()
    });
    let resumed_3 = g2["resume_step"].as_u64().expect("resumes from a commit");
    a.wait_line(&format!("resumed from step {resumed_3} "), LONG);
    job.wait_event("a commit at world 3", LONG, |e| {
        is(e, "checkpoint_committed") && e["generation"] == g2["generation"]
    });

    // A preemption of c: every rank saves the step they stop at, and a and b resume from it
    // at world 2.
    signal(&c.child, libc::SIGTERM);
    a.wait_line("stopping at step", LONG);
    let stopped = step_of("stopping at step ", &a.seen).unwrap();
    let (code_c, _, err_c) = c.finish(LONG);
    assert_eq!(code_c, 0, "the preempted agent drains cleanly:\n{err_c}");
    let g3 = job.wait_event("generation at world 2 after the drain", LONG, |e| {
        is(e, "generation")
            && e["world_size"] == 2
            && node_of(e) == "a"
            && e["generation"].as_u64() > g2["generation"].as_u64()
    });
    assert_eq!(g3["resume_step"].as_u64(), Some(stopped), "{g3}");
    a.wait_line(&format!("resumed from step {stopped} "), LONG);
    // Once step N + 2 is printed, every worker has asked its agent about step N + 1: a worker
    // that never did would get SIGTERM at once from the drain below (as a plain script does).
    a.wait_line(&format!("[rank 0] step {} ", stopped + 2), LONG);

    // The job ends: a and b drain too.
    signal(&a.child, libc::SIGTERM);
    signal(&b.child, libc::SIGTERM);
    let (code_a, out_a, err_a) = a.finish(LONG);
    let (code_b, _, err_b) = b.finish(LONG);
    assert_eq!(code_a, 0, "{out_a}\n{err_a}");
    assert_eq!(code_b, 0, "{err_b}");

    // Each world loaded exactly what was saved at its resume step: every parameter and AdamW
    // moment (resharded from 4 to 3 ranks, then from 3 to 2) and step count, gathered whole.
    let logged = fsdp_digests(&out_a);
    let mut resumes = Vec::new();
    for (i, (event, step, world, tensors)) in logged.iter().enumerate() {
        if event != "loaded" {
            continue;
        }
        // The last save of that step before the load: a world that lost a node may have saved
        // the same step before, and that save was never committed.
        let (_, _, saved_world, saved) = logged[..i]
            .iter()
            .rev()
            .find(|(ev, s, ..)| ev == "saved" && s == step)
            .unwrap_or_else(|| panic!("no digests saved at step {step}:\n{out_a}"));
        // 6 parameters, each with AdamW's exp_avg, exp_avg_sq and step, and its EMA; the LR
        // schedule, the GradScaler and the sampler.
        assert_eq!(tensors.as_object().unwrap().len(), 33, "{tensors}");
        assert_eq!(tensors, saved, "step {step} saved at world {saved_world}");
        resumes.push((*step, *saved_world, *world));
    }
    assert_eq!(resumes, [(resumed_3, 4, 3), (stopped, 3, 2)], "{out_a}");

    // The final step exports to Hugging Face's layout, model and EMA, and what safetensors,
    // DCP's HuggingFaceStorageReader and elastic_run.load_from (from the bucket, outside any
    // job: every tensor whole) read back equals what the training processes saved, gathered.
    let (_, last, _, last_saved) = logged.iter().rev().find(|(ev, ..)| ev == "saved").unwrap();
    assert_eq!(committed_steps(&job.url).last(), Some(last), "{out_a}");
    let ckpt = Path::new(BIN).with_file_name("elastic-ckpt");
    assert!(ckpt.exists(), "{} not built", ckpt.display());
    let exports = tempfile::tempdir().unwrap();
    let (model_dir, ema_dir) = (exports.path().join("model"), exports.path().join("ema"));
    for (dir, key) in [(&model_dir, "model"), (&ema_dir, "ema")] {
        let mut c = Command::new(&ckpt);
        c.arg("export").arg(&job.url).arg(dir).args(["--key", key]);
        c.envs(job.env.iter().map(|(k, v)| (k, v)));
        let (status, out, err) = run(c, LONG);
        assert!(status.success(), "export --key {key}: {out}\n{err}");
        assert!(out.contains(&format!("of step {last}:")), "{out}");
    }
    let mut c = Command::new(python());
    c.args(["-c", FSDP_EXPORT_CHECK]).arg(repo()).arg(&job.url);
    c.arg(&model_dir).arg(&ema_dir).arg(last_saved.to_string());
    c.envs(job.env.iter().map(|(k, v)| (k, v)))
        .env("ELASTIC_CKPT", &ckpt);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(k);
    }
    let (status, out, err) = run(c, LONG);
    assert!(status.success(), "{out}\n{err}");
    assert_eq!(out.trim(), format!("ok {last}"), "{err}");
    eprintln!(
        "fsdp resharded resume 4 -> 3 -> 2 nodes, export: {} ms",
        started.elapsed().as_millis()
    );
}

// ---- the sample stream through a SIGKILL, a scale-up and a preemption ----

/// Checkpoint interval of the sample-stream test.
const STREAM_INTERVAL: u64 = 5;
/// Its data set: 100 samples, which no global batch of 12 divides, so batches straddle epochs.
const STREAM_SAMPLES: u64 = 100;
const STREAM_GLOBAL_BATCH: u64 = 12;

/// One line of `ddp_train.py --sample-log`: the sample ids one rank trained at one step.
#[derive(Debug, serde::Deserialize)]
struct Trained {
    generation: u64,
    step: u64,
    rank: u64,
    world: u64,
    accum: u64,
    batch: u64,
    ids: Vec<u64>,
}

/// Every line of the sample logs in `dir`. A worker killed mid-write leaves a partial last
/// line in its own file (as does one still writing): it is skipped; every other line parses.
fn sample_logs(dir: &std::path::Path) -> Vec<Trained> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let complete = text.rsplit_once('\n').map_or("", |(done, _)| done);
        for l in complete.lines() {
            let t =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", path.display()));
            out.push(t);
        }
    }
    out
}

/// Waits until `rank` of `generation` logged `step`.
fn wait_trained(dir: &std::path::Path, generation: u64, rank: u64, step: u64) {
    let deadline = Instant::now() + LONG;
    while !sample_logs(dir)
        .iter()
        .any(|t| t.generation == generation && t.rank == rank && t.step >= step)
    {
        assert!(
            Instant::now() < deadline,
            "rank {rank} of generation {generation} did not train step {step}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One generation's global batch at one step, as its ranks logged it, in stream order: rank
/// `r`'s micro-batch `a` is the slice at `(a * world + r) * batch`. `None` where no rank
/// logged the position (a rank killed before it logged the step).
fn global_batch(lines: &[&Trained]) -> Vec<Option<u64>> {
    let t = lines[0];
    let b = t.batch as usize;
    let mut out = vec![None; (t.batch * t.world * t.accum) as usize];
    let mut ranks = std::collections::BTreeSet::new();
    for l in lines {
        assert_eq!(
            (l.world, l.accum, l.batch),
            (t.world, t.accum, t.batch),
            "{l:?}"
        );
        assert_eq!(l.ids.len(), b * l.accum as usize, "{l:?}");
        assert!(ranks.insert(l.rank), "{l:?} logged twice");
        for (i, id) in l.ids.iter().enumerate() {
            let (a, k) = (i / b, i % b);
            out[(a * t.world as usize + l.rank as usize) * b + k] = Some(*id);
        }
    }
    out
}

/// The first `count` sample ids of the stream a fault-free run of `ddp_train.py --samples
/// STREAM_SAMPLES` (seed 0, its default) takes, from the worker library itself, outside any
/// job.
fn fault_free_stream(count: usize) -> Vec<u64> {
    let code = "import json, sys\n\
                from elastic_run import ElasticSampler\n\
                n, k = int(sys.argv[1]), int(sys.argv[2])\n\
                print(json.dumps(ElasticSampler(n, seed=0).ids(0, k)))";
    let out = Command::new(python())
        .args(["-c", code, &STREAM_SAMPLES.to_string(), &count.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `job.command` with one worker per node and `--lr-scaling fixed`: the global batch of 12 is
/// 2 x 3 workers x 2 micro-batches at world 3 and 2 x 2 x 3 at world 2, so every rescale cuts
/// the same stream into other slices per rank and per micro-batch (under linear scaling each
/// rank's share would stay the same size).
fn fixed_batch_command(job: &Job, node: &str, train: &[&str]) -> Command {
    let base = job.command(node, "2:3", &format!("staging-{node}"), train);
    let mut args: Vec<String> = base
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let cut = args.iter().position(|a| a == "--").unwrap();
    let interval = STREAM_INTERVAL.to_string();
    for (flag, value) in [
        ("--nproc-per-node", "1"),
        ("--lr-scaling", "fixed"),
        ("--batch-size", "2"),
        ("--checkpoint-interval", interval.as_str()),
    ] {
        let i = args[..cut].iter().position(|a| a == flag).unwrap();
        args[i + 1] = value.into();
    }
    let global = ["--global-batch".into(), STREAM_GLOBAL_BATCH.to_string()];
    args.splice(cut..cut, global);
    let mut c = agent(job.tmp.path());
    c.envs(job.env.iter().map(|(k, v)| (k, v))).args(args);
    c
}

fn generation_of(e: &Value) -> u64 {
    e["generation"].as_u64().unwrap()
}

#[test]
fn committed_steps_train_on_a_fault_free_runs_samples_through_a_kill_a_join_and_a_preemption() {
    let t0 = Instant::now();
    let job = Job::new("file");
    let logs = job.tmp.path().join("samples");
    let steps: u64 = 40;
    let (steps_arg, samples_arg) = (steps.to_string(), STREAM_SAMPLES.to_string());
    let train = [
        "--steps",
        steps_arg.as_str(),
        "--samples",
        samples_arg.as_str(),
        "--step-sleep",
        "0.05",
        "--sample-log",
        logs.to_str().unwrap(),
    ];
    let start = |node: &str| {
        let a = job.start_cmd(node, fixed_batch_command(&job, node, &train));
        job.wait_event("the node to join", LONG, |e| {
            is(e, "joined") && node_of(e) == node
        });
        a
    };
    let committed_in = |generation: u64, after: u64| {
        job.wait_event("a commit of the generation", LONG, |e| {
            is(e, "checkpoint_committed")
                && e["generation"] == generation
                && e["step"].as_u64() > Some(after)
        })["step"]
            .as_u64()
            .unwrap()
    };
    let a = start("a");
    let b = start("b");
    let mut c = start("c");
    let g1 = job.wait_event("generation at world 3", LONG, |e| {
        is(e, "generation") && e["world_size"] == 3 && node_of(e) == "a"
    });
    let gen1 = generation_of(&g1);
    // SIGKILL c once it trained two steps past a commit: the kill costs work.
    let c1 = committed_in(gen1, 0);
    let rank_c = job.wait_event("c's rank", LONG, |e| {
        is(e, "generation") && node_of(e) == "c" && e["generation"] == gen1
    })["rank_offset"]
        .as_u64()
        .unwrap();
    wait_trained(&logs, gen1, rank_c, c1 + 2);
    signal(&c.child, libc::SIGKILL);
    let _ = c.child.wait();
    let g2 = job.wait_event("generation at world 2 after the kill", LONG, |e| {
        is(e, "generation") && e["world_size"] == 2 && node_of(e) == "a" && generation_of(e) > gen1
    });
    assert_eq!(g2["members"], serde_json::json!(["a", "b"]), "{g2}");
    let gen2 = generation_of(&g2);
    // A fresh agent joins once this generation committed a step of its own.
    committed_in(gen2, g2["resume_step"].as_u64().unwrap_or(0));
    let d = start("d");
    let g3 = job.wait_event("generation at world 3 with d", LONG, |e| {
        is(e, "generation") && e["world_size"] == 3 && node_of(e) == "d"
    });
    assert_eq!(g3["members"], serde_json::json!(["a", "b", "d"]), "{g3}");
    let gen3 = generation_of(&g3);
    committed_in(gen3, g3["resume_step"].as_u64().unwrap_or(0));
    // Preemption: b drains and leaves.
    signal(&b.child, libc::SIGTERM);
    let (code_b, out_b, err_b) = b.finish(LONG);
    assert_eq!(code_b, 0, "b drains cleanly:\n{out_b}\n{err_b}");
    let g4 = job.wait_event("generation at world 2 after the drain", LONG, |e| {
        is(e, "generation") && e["world_size"] == 2 && node_of(e) == "a" && generation_of(e) > gen3
    });
    assert_eq!(g4["members"], serde_json::json!(["a", "d"]), "{g4}");
    let gen4 = generation_of(&g4);
    for ag in [a, d] {
        let node = ag.node.clone();
        let (code, out, err) = ag.finish(LONG);
        assert_eq!(code, 0, "{node}:\n{out}\n{err}");
    }

    // What every generation resumed from, by the agents' events (a node that joined members
    // continuing from memory names the step as `heal_step`, restored only on its workers' ask).
    let mut resume: std::collections::BTreeMap<u64, u64> = Default::default();
    for e in job.events().iter().filter(|e| is(e, "generation")) {
        let r = e["resume_step"]
            .as_u64()
            .or(e["heal_step"].as_u64())
            .unwrap_or(0);
        let old = resume.insert(generation_of(e), r);
        assert!(
            old.is_none_or(|o| o == r),
            "nodes disagree on the resume step: {e}"
        );
    }
    // Every execution of every step: step -> generation -> the ranks' lines.
    let lines = sample_logs(&logs);
    let mut runs: std::collections::BTreeMap<u64, std::collections::BTreeMap<u64, Vec<&Trained>>> =
        Default::default();
    for t in &lines {
        runs.entry(t.step)
            .or_default()
            .entry(t.generation)
            .or_default()
            .push(t);
    }
    assert!(
        runs.keys().copied().eq(1..=steps),
        "steps trained: {:?}",
        runs.keys().collect::<Vec<_>>()
    );
    // Each generation trains on from its resume step.
    for (g, r) in &resume {
        if let Some(first) = lines
            .iter()
            .filter(|t| t.generation == *g)
            .map(|t| t.step)
            .min()
        {
            assert_eq!(first, r + 1, "generation {g} resumed from step {r}");
        }
    }

    // The final lineage: each step as the newest generation that ran it trained it, whole.
    let mut stream = Vec::new();
    let mut accums = std::collections::BTreeSet::new();
    let mut redone: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut redone_whole = 0;
    for (step, by_gen) in &runs {
        let (&gen_new, newest) = by_gen.last_key_value().unwrap();
        let batch = global_batch(newest);
        assert_eq!(batch.len() as u64, STREAM_GLOBAL_BATCH);
        let batch: Vec<u64> = batch
            .into_iter()
            .map(|id| {
                id.unwrap_or_else(|| {
                    panic!("step {step}: a rank of generation {gen_new} did not log it")
                })
            })
            .collect();
        accums.insert((newest[0].world, newest[0].accum));
        if by_gen.len() > 1 {
            // Work lost to a fault, redone: once, after the resume step of the generation that
            // redid it, on the same samples (as far as the ranks of the lost run logged them).
            // The SIGKILL loses the steps since the newest commit; so does the scale-up (the
            // agents stop the workers when they admit the joiner and resume from the newest
            // commit); the preemption loses none.
            assert_eq!(
                by_gen.len(),
                2,
                "step {step} trained by generations {:?}",
                by_gen.keys()
            );
            let (&gen_old, older) = by_gen.first_key_value().unwrap();
            assert!(
                *step > resume[&gen_new],
                "step {step} of generation {gen_new}"
            );
            let lost = global_batch(older);
            assert_eq!(lost.len(), batch.len());
            for (pos, id) in lost.iter().enumerate() {
                assert!(
                    id.is_none_or(|id| id == batch[pos]),
                    "step {step}: generation {gen_old} trained {lost:?}, generation {gen_new} {batch:?}"
                );
            }
            *redone.entry(gen_new).or_default() += 1;
            redone_whole += u64::from(lost.iter().all(Option::is_some));
        }
        stream.extend(batch);
    }
    assert_eq!(
        accums.into_iter().collect::<Vec<_>>(),
        [(2, 3), (3, 2)],
        "the global batch was cut over 2 and over 3 workers"
    );
    assert!(
        redone_whole > 0,
        "no redone step was logged whole the first time"
    );
    // The lineage took the first K ids of a fault-free run's stream, in order (so the same
    // multiset): no sample skipped or repeated across the rescales. And, whatever the sampler
    // computes, each whole epoch of it is a permutation and the tail repeats no sample.
    assert_eq!(stream, fault_free_stream(stream.len()));
    assert!(
        stream.len() as u64 > 2 * STREAM_SAMPLES,
        "the run crosses epochs"
    );
    for epoch in stream.chunks(STREAM_SAMPLES as usize) {
        let mut ids = epoch.to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            epoch.len(),
            "a sample twice in one epoch: {epoch:?}"
        );
        assert!(ids.iter().all(|id| *id < STREAM_SAMPLES));
    }
    // The SIGKILL cost a redo, at most a checkpoint interval; the preemption none: the
    // generation after it resumed from the drained step, the last one b's generation trained,
    // which is committed.
    let after_kill = redone.get(&gen2).copied().unwrap_or(0);
    assert!(
        (1..=STREAM_INTERVAL).contains(&after_kill),
        "{after_kill} steps redone after the SIGKILL; by generation: {redone:?}"
    );
    assert_eq!(redone.get(&gen4), None, "the drain lost steps: {redone:?}");
    let drained = resume[&gen4];
    assert_eq!(
        lines
            .iter()
            .filter(|t| t.generation == gen3)
            .map(|t| t.step)
            .max(),
        Some(drained)
    );
    assert!(
        job.events()
            .iter()
            .any(|e| is(e, "checkpoint_committed") && e["step"] == drained),
        "the drained step {drained} was committed"
    );
    eprintln!(
        "sample stream: {} samples over {steps} steps; steps redone by generation {redone:?}; {:?}",
        stream.len(),
        t0.elapsed()
    );
}
