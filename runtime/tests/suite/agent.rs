//! End-to-end tests of the `elastic-run` binary in standalone mode, with real worker processes
//! and real PyTorch gloo.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::util::*;

fn env_dumps(dir: &std::path::Path, n: u32) -> Vec<BTreeMap<String, String>> {
    (0..n)
        .map(|r| {
            let text =
                std::fs::read_to_string(dir.join(format!("env-{r}.json"))).expect("env dump");
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

const DUMP_ENV: &str = "import json, os; json.dump(dict(os.environ), open('env-' + os.environ['RANK'] + '.json', 'w'))";

#[test]
fn workers_get_the_full_torchrun_and_elastic_environment() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.env_remove("OMP_NUM_THREADS").args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--rdzv-id",
        "job7",
        "--role",
        "trainer",
        "--max-restarts",
        "3",
        "--lr-scaling",
        "linear",
        "--base-world-size",
        "1",
        "--batch-size",
        "8",
        "--base-lr",
        "0.1",
        "--warmup-steps",
        "5",
        "--checkpoint-interval",
        "7",
        "--node-id",
        "nodeA",
        "--master-port",
        "29577",
        "--",
    ]);
    c.arg(python()).args(["-c", DUMP_ENV]);
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert!(status.success(), "{out}\n{err}");
    let envs = env_dumps(tmp.path(), 2);
    for (r, env) in envs.iter().enumerate() {
        let r = r.to_string();
        let expect = [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", &r),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_RANK", &r),
            ("ROLE_NAME", "trainer"),
            ("ROLE_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29577"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "job7"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            ("OMP_NUM_THREADS", "1"),
            ("ELASTIC_GENERATION", "0"),
            ("ELASTIC_LR_SCALE", "2"),
            ("ELASTIC_LR", "0.2"),
            ("ELASTIC_BATCH_SIZE", "8"),
            ("ELASTIC_GLOBAL_BATCH", "16"),
            ("ELASTIC_GRAD_ACCUM_STEPS", "1"),
            ("ELASTIC_WARMUP_STEPS", "5"),
            ("ELASTIC_CHECKPOINT_INTERVAL", "7"),
            ("ELASTIC_NODE_ID", "nodeA"),
        ];
        for (k, v) in expect {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "rank {r} {k}");
        }
        for k in [
            "TORCHELASTIC_ERROR_FILE",
            "ELASTIC_STAGING_DIR",
            "ELASTIC_AGENT_SOCKET",
        ] {
            assert!(
                env.get(k).is_some_and(|v| v.starts_with('/')),
                "rank {r} {k}: {:?}",
                env.get(k)
            );
        }
        assert!(
            !env.contains_key("ELASTIC_RESUME_STEP"),
            "nothing committed yet"
        );
    }
    assert_ne!(
        envs[0]["TORCHELASTIC_ERROR_FILE"],
        envs[1]["TORCHELASTIC_ERROR_FILE"]
    );
}

#[test]
fn pet_variables_configure_the_agent_like_kubeflow_sets_them() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.env("PET_NPROC_PER_NODE", "3")
        .env("PET_NNODES", "1")
        .env("PET_RDZV_ID", "kubeflow-job")
        .env("PET_MAX_RESTARTS", "4")
        .env("PET_MASTER_PORT", "29588")
        .env("OMP_NUM_THREADS", "5")
        .arg("--")
        .arg(python())
        .args(["-c", DUMP_ENV]);
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert!(status.success(), "{out}\n{err}");
    for env in env_dumps(tmp.path(), 3) {
        assert_eq!(env["WORLD_SIZE"], "3");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "kubeflow-job");
        assert_eq!(env["TORCHELASTIC_MAX_RESTARTS"], "4");
        assert_eq!(env["MASTER_PORT"], "29588");
        assert_eq!(
            env["OMP_NUM_THREADS"], "5",
            "a user's OMP_NUM_THREADS is kept"
        );
    }
}

#[test]
fn bad_flags_and_values_exit_2_with_a_message() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--nproc-per-node", "many", "x.py"], "nproc-per-node"),
        (&["--bogus", "x.py"], "--bogus"),
        (
            &["--nnodes", "1:2", "--rdzv-backend", "c10d", "x.py"],
            "c10d needs --rdzv-endpoint",
        ),
        (&["--rdzv-backend", "zookeeper", "x.py"], "zookeeper"),
        (&["--preemption-grace", "soon", "x.py"], "preemption-grace"),
        (&["--lr-scaling", "fixed", "x.py"], "batch-size"),
        (
            &["--nnodes", "2:4", "--rdzv-backend", "static", "x.py"],
            "needs an elastic backend",
        ),
        (
            &["--nnodes", "2:4", "--rdzv-backend", "etcd-v3", "x.py"],
            "--rdzv-endpoint",
        ),
        (
            &[
                "--nnodes",
                "2:4",
                "--rdzv-backend",
                "etcd-v3",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "lease_ttl_ms=1500",
                "x.py",
            ],
            "lease_ttl_ms",
        ),
        (
            &[
                "--nnodes",
                "2:4",
                "--rdzv-backend",
                "etcd-v3",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "bogus_key=1",
                "x.py",
            ],
            "unknown key `bogus_key`",
        ),
        (&["--checkpoint-url", "ftp://x/y", "x.py"], "unknown scheme"),
    ];
    for (args, needle) in cases {
        let mut c = agent(tmp.path());
        c.args(*args);
        let (status, out, err) = run(c, Duration::from_secs(20));
        assert_eq!(status.code(), Some(2), "{args:?}: {out}\n{err}");
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}: {err}"
        );
    }
    let mut c = agent(tmp.path());
    c.env("PET_NPROC_PER_NODE", "zero").arg("x.py");
    let (status, _, err) = run(c, Duration::from_secs(20));
    assert_eq!(status.code(), Some(2), "{err}");
}

/// The S3 endpoint, region and keys given only through `--checkpoint-store-option` (no
/// `AWS_*` in the environment): the worker's step lands in moto. Bad options fail at start-up.
#[test]
fn checkpoint_store_options_from_the_command_line_reach_s3() {
    let tmp = tempfile::tempdir().unwrap();
    let moto = services::moto().expect("moto must start (run tests/services/setup.sh)");
    moto.create_bucket("ckpt").unwrap();
    let clean = |c: &mut std::process::Command| {
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("AWS_") {
                c.env_remove(&k);
            }
        }
    };
    let mut c = agent(tmp.path());
    clean(&mut c);
    c.args(["--standalone", "--nproc-per-node", "1"])
        .args(["--checkpoint-url", "s3://ckpt/flags"])
        .args(["--checkpoint-store-option", &format!("aws_endpoint={}", moto.endpoint())])
        .args(["--checkpoint-store-option", "aws_allow_http=true,aws_region=us-east-1"])
        .args(["--checkpoint-store-option", "aws_access_key_id=testing"])
        .args(["--checkpoint-store-option", "aws_secret_access_key=s3cr3t-v4lue"])
        .arg("--")
        .arg(python())
        .args([
            "-c",
            "import torch, elastic_run as er; er.save(4, extra={'w': torch.ones(3)}); print('saved 4')",
        ]);
    let (status, out, err) = run(c, Duration::from_secs(120));
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("saved 4"), "{out}");
    assert!(
        !format!("{out}{err}").contains("s3cr3t-v4lue"),
        "{out}\n{err}"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let steps = rt.block_on(async {
        let store = checkpoint::Store::open_with_options(
            "s3://ckpt/flags",
            services::s3_store_options(&moto.env()),
        )
        .unwrap();
        store
            .committed_steps(&checkpoint::CancellationToken::new())
            .await
            .unwrap()
    });
    assert_eq!(steps, [4], "{err}");

    // A key no backend knows, one of another backend, and any for a local directory: exit 2
    // naming the key, before a worker starts.
    for (url, opt, needle) in [
        ("s3://ckpt/flags", "aws_regoin=x", "`aws_regoin`"),
        (
            "s3://ckpt/flags",
            "azure_storage_account_name=x",
            "`azure_storage_account_name`",
        ),
        (
            "file:///tmp/elastic-unused",
            "aws_region=x",
            "take no options",
        ),
    ] {
        let mut c = agent(tmp.path());
        clean(&mut c);
        c.args([
            "--standalone",
            "--checkpoint-url",
            url,
            "--checkpoint-store-option",
            opt,
        ])
        .args(["--no-python", "--", "sh", "-c", "echo worker ran"]);
        let (status, out, err) = run(c, Duration::from_secs(30));
        assert_eq!(status.code(), Some(2), "{opt}: {out}\n{err}");
        assert!(err.contains(needle), "{opt}: {err}");
        assert!(!out.contains("worker ran"), "{out}");
    }
}

#[test]
fn unmodified_torchrun_script_runs_with_two_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let script = repo().join("examples/torchrun_plain.py");
    let mut c = agent(tmp.path());
    // torchrun style: a *.py command runs under the Python interpreter.
    c.args(["--standalone", "--nproc-per-node", "2", "--python"])
        .arg(python())
        .arg(&script);
    let (status, out, err) = run(c, Duration::from_secs(120));
    assert!(status.success(), "{out}\n{err}");
    assert!(
        out.contains("[rank 0] rank 0/2 local_rank 0 all_reduce 3"),
        "{out}"
    );
    assert!(
        out.contains("[rank 1] rank 1/2 local_rank 1 all_reduce 3"),
        "{out}"
    );
}

#[test]
fn crashing_worker_is_restarted_up_to_max_restarts_then_fails_the_job_with_its_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.args(["--nproc-per-node", "2", "--max-restarts", "2", "--"]).args([
        "sh",
        "-c",
        "echo attempt $TORCHELASTIC_RESTART_COUNT rank $RANK; \
         if [ $RANK = 1 ]; then echo \"fatal: disk on fire (attempt $TORCHELASTIC_RESTART_COUNT)\" >&2; exit 5; fi; sleep 30",
    ]);
    let t0 = std::time::Instant::now();
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(5), "{out}\n{err}");
    for a in 0..3 {
        assert!(
            out.contains(&format!("[rank 1] attempt {a} rank 1")),
            "{out}"
        );
    }
    assert!(!out.contains("attempt 3"), "{out}");
    assert!(
        err.contains("worker rank 1 (local rank 1) failed with exit code 5 after 2 restart(s)"),
        "{err}"
    );
    assert!(err.contains("fatal: disk on fire (attempt 2)"), "{err}");
    // Rank 0's `sleep 30` was stopped, not waited for.
    assert!(t0.elapsed() < Duration::from_secs(25));
}

#[test]
fn recorded_python_exception_is_reported_from_the_error_file() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.args(["--nproc-per-node", "1", "--"]).arg(python()).args([
        "-c",
        "from torch.distributed.elastic.multiprocessing.errors import record\n\
         @record\n\
         def main():\n    raise ValueError('bad shard 17')\n\
         main()",
    ]);
    let (status, out, err) = run(c, Duration::from_secs(120));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    let report = err
        .split("failed with exit code 1")
        .nth(1)
        .unwrap_or_else(|| panic!("{err}"));
    assert!(report.contains("ValueError: bad shard 17"), "{err}");
}

#[test]
fn sigkill_of_the_agent_leaves_no_worker_alive() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.args(["--nproc-per-node", "2", "--"]).args([
        "sh",
        "-c",
        "echo $$ > pid-$RANK.tmp && mv pid-$RANK.tmp pid-$RANK; exec sleep 120",
    ]);
    let mut child = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid_files: Vec<_> = (0..2)
        .map(|r| tmp.path().join(format!("pid-{r}")))
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !pid_files.iter().all(|p| p.exists()) {
        assert!(
            std::time::Instant::now() < deadline,
            "workers did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids: Vec<i32> = pid_files
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap().trim().parse().unwrap())
        .collect();
    assert!(
        pids.iter().all(|p| alive(*p)),
        "workers should run before the kill"
    );
    signal(&child, libc::SIGKILL);
    child.wait().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            std::time::Instant::now() < deadline,
            "workers {pids:?} outlived a SIGKILLed agent"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_the_example_which_saves_its_step_and_exits_0_then_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let script = repo().join("examples/ddp_train.py");
    let mut c = agent(tmp.path());
    c.args([
        "--standalone",
        "--nproc-per-node",
        "2",
        "--preemption-grace",
        "60s",
        "--checkpoint-url",
    ])
    .arg(&ck)
    .arg("--")
    .arg(python())
    .arg(&script)
    .args(["--steps", "100000", "--step-sleep", "0.02"]);
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let mut seen = String::new();
    assert!(
        wait_for_line(
            &out,
            "[rank 0] step 5 ",
            Duration::from_secs(120),
            &mut seen
        ),
        "{seen}"
    );
    signal(&child, libc::SIGTERM);
    let status = wait_limit(&mut child, Duration::from_secs(60));
    seen.push_str(&collect(out));
    let err = collect(err);
    assert!(status.success(), "{status:?}\n{seen}\n{err}");
    let stop_line = seen
        .lines()
        .find(|l| l.contains("stopping at step"))
        .unwrap_or_else(|| panic!("{seen}"));
    let step: u64 = stop_line
        .split("stopping at step ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(step >= 5, "{stop_line}");
    assert!(
        committed_steps(ck.to_str().unwrap()).contains(&step),
        "drained step {step} was not committed: {err}"
    );

    // A new run (one worker now) resumes from the drained step: no step lost.
    let mut c = agent(tmp.path());
    c.args(["--standalone", "--nproc-per-node", "1", "--checkpoint-url"])
        .arg(&ck)
        .arg("--")
        .arg(python())
        .arg(&script)
        .args(["--steps", &(step + 2).to_string()]);
    let (status, out, err) = run(c, Duration::from_secs(120));
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains(&format!("resumed from step {step} ")), "{out}");
    assert!(
        out.contains(&format!("[rank 0] step {} ", step + 1)),
        "{out}"
    );
    assert!(
        !out.contains(&format!("[rank 0] step {step} ")),
        "step {step} trained twice: {out}"
    );
}

#[test]
fn sigterm_is_forwarded_at_once_to_workers_that_do_not_speak_the_protocol_and_json_logs_work() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.args([
        "--json",
        "--nproc-per-node",
        "2",
        "--preemption-grace",
        "120s",
        "--",
    ])
    .args([
        "sh",
        "-c",
        "trap 'echo got TERM; exit 0' TERM; echo ready; sleep 100 & wait",
    ]);
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let mut seen = String::new();
    assert!(
        wait_for_line(&out, "[rank 1] ready", Duration::from_secs(20), &mut seen),
        "{seen}"
    );
    if !seen.contains("[rank 0] ready") {
        assert!(
            wait_for_line(&out, "[rank 0] ready", Duration::from_secs(20), &mut seen),
            "{seen}"
        );
    }
    let t0 = std::time::Instant::now();
    signal(&child, libc::SIGTERM);
    let status = wait_limit(&mut child, Duration::from_secs(30));
    seen.push_str(&collect(out));
    let err = collect(err);
    // Well inside the 120 s grace: the workers got SIGTERM at once, not at the deadline.
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(status.success(), "{status:?}\n{seen}\n{err}");
    assert!(
        seen.contains("[rank 0] got TERM") && seen.contains("[rank 1] got TERM"),
        "{seen}"
    );
    let logs: Vec<serde_json::Value> = err
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(!logs.is_empty(), "{err}");
    assert!(
        logs.iter()
            .any(|l| l["span"]["name"] == "generation" && l["spans"][0]["name"] == "job"),
        "{err}"
    );
}

#[test]
fn silent_workers_are_restarted_by_the_hang_watchdog_then_fail_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = agent(tmp.path());
    c.args([
        "--nproc-per-node",
        "2",
        "--hang-timeout",
        "1s",
        "--startup-timeout",
        "1s",
        "--max-restarts",
        "1",
        "--",
    ])
    .args([
        "sh",
        "-c",
        "echo start $TORCHELASTIC_RESTART_COUNT; sleep 60",
    ]);
    let t0 = std::time::Instant::now();
    let (status, out, err) = run(c, Duration::from_secs(60));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    assert!(
        out.contains("[rank 0] start 0") && out.contains("[rank 0] start 1"),
        "{out}"
    );
    assert!(err.contains("no worker reported progress"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}

fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// The longest a drain may take to start after a notice appears: AWS and Azure are polled
/// every second, GCP's wait returns at once; the rest is slack for a loaded machine.
const NOTICE_TO_DRAIN_MS_MAX: u64 = 4_000;

/// `elastic-run` training the example under `--preemption-notice NOTICE`, its output followed
/// while it runs.
struct Training {
    child: std::process::Child,
    out: std::sync::mpsc::Receiver<String>,
    err: std::sync::mpsc::Receiver<String>,
    seen_out: String,
    seen_err: String,
}

impl Training {
    fn start(tmp: &std::path::Path, notice: &str, nproc: &str, extra: &[&str]) -> Training {
        let mut c = agent(tmp);
        c.args(["--nproc-per-node", nproc, "--preemption-notice", notice])
            .args(extra)
            .arg("--checkpoint-url")
            .arg(tmp.join("ck"))
            .arg("--events-file")
            .arg(tmp.join("events.jsonl"))
            .arg("--")
            .arg(python())
            .arg(repo().join("examples/ddp_train.py"))
            .args(["--steps", "100000", "--step-sleep", "0.02"]);
        let mut child = c
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Training {
            out: reader(child.stdout.take().unwrap()),
            err: reader(child.stderr.take().unwrap()),
            child,
            seen_out: String::new(),
            seen_err: String::new(),
        }
    }

    fn wait_out(&mut self, needle: &str, limit: Duration) {
        if !wait_for_line(&self.out, needle, limit, &mut self.seen_out) {
            let _ = self.child.kill();
            panic!(
                "no {needle:?} on stdout within {limit:?}:\n{}\n{}",
                self.seen_out, self.seen_err
            );
        }
    }

    fn wait_err(&mut self, needle: &str, limit: Duration) {
        if !wait_for_line(&self.err, needle, limit, &mut self.seen_err) {
            let _ = self.child.kill();
            panic!(
                "no {needle:?} on stderr within {limit:?}:\n{}\n{}",
                self.seen_out, self.seen_err
            );
        }
    }

    /// How long after `appeared` the agent said it drains for the notice; asserts the bound.
    fn drain_lag(&mut self, appeared: std::time::Instant, cloud: &str) -> Duration {
        self.wait_err("preemption notice; draining", Duration::from_secs(30));
        let lag = appeared.elapsed();
        eprintln!(
            "{cloud}: drain started {} ms after the notice appeared",
            lag.as_millis()
        );
        assert!(
            lag < Duration::from_millis(NOTICE_TO_DRAIN_MS_MAX),
            "{cloud}: drain started {lag:?} after the notice:\n{}",
            self.seen_err
        );
        lag
    }

    /// Waits for a clean exit; returns the step the workers drained at (now committed).
    fn finish(mut self, tmp: &std::path::Path) -> (u64, String) {
        let status = wait_limit(&mut self.child, Duration::from_secs(60));
        self.seen_out.push_str(&collect(self.out));
        self.seen_err.push_str(&collect(self.err));
        let (out, err) = (self.seen_out, self.seen_err);
        assert!(status.success(), "{status:?}\n{out}\n{err}");
        let step: u64 = out
            .lines()
            .find_map(|l| l.split("stopping at step ").nth(1))
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no drained step:\n{out}\n{err}"));
        let ck = tmp.join("ck");
        assert!(
            committed_steps(ck.to_str().unwrap()).contains(&step),
            "step {step} not committed:\n{err}"
        );
        (step, err)
    }
}

/// The `--events-file` lines of one event.
fn events_of(tmp: &std::path::Path, event: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(tmp.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == event)
        .collect()
}

#[test]
fn gcp_preemption_drains_at_once_through_wait_for_change_and_metrics_report_the_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let gce = services::metadata::Gce::start().expect("local GCP metadata server");
    let metrics_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut t = Training::start(
        tmp.path(),
        &format!("gcp={}", gce.url()),
        "2",
        &[
            "--checkpoint-interval",
            "3",
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    t.wait_out("[rank 0] saved step 3", Duration::from_secs(120));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let m = scrape(&metrics_addr).unwrap_or_default();
        if m.lines()
            .any(|l| l.starts_with("elastic_checkpoint_committed_step "))
        {
            break m;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no commit in metrics: {m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(metrics.contains("elastic_world_size 2"), "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("elastic_checkpoint_bytes_total ") && !l.ends_with(" 0")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "elastic_preemption_notice_errors_total{kind=\"auth\"} 0"),
        "{metrics}"
    );
    assert!(gce.waits() >= 1, "the agent waits for the change");
    let appeared = gce.set_preempted(true);
    t.drain_lag(appeared, "gcp");
    t.finish(tmp.path());
    assert_eq!(gce.refused(), 0);
}

#[test]
fn aws_rebalance_saves_and_spot_interruption_drains_through_imdsv2() {
    let tmp = tempfile::tempdir().unwrap();
    let imds = services::metadata::Imds::start().expect("local AWS IMDS");
    let mut t = Training::start(tmp.path(), &format!("aws={}", imds.url()), "1", &[]);
    t.wait_out("[rank 0] step 3 ", Duration::from_secs(120));
    // `--rebalance-action save` (the default): a checkpoint now, and training goes on.
    imds.set_rebalance();
    t.wait_err(
        "rebalance recommendation; checkpointing now",
        Duration::from_secs(10),
    );
    t.wait_out("[rank 0] saved step", Duration::from_secs(10));
    let appeared = imds.set_instance_action("terminate");
    t.drain_lag(appeared, "aws");
    t.finish(tmp.path());
    assert!(imds.token_puts() >= 1);
    assert_eq!(
        (imds.tokenless_gets(), imds.unauthorized()),
        (0, 0),
        "every GET carried a valid IMDSv2 token"
    );
}

#[test]
fn azure_preempt_event_drains_and_is_approved_after_the_drained_step_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let az = services::metadata::Azure::start().expect("local Azure IMDS");
    let mut t = Training::start(
        tmp.path(),
        &format!("azure={}", az.url()),
        "1",
        &["--azure-vm-name", "vm-a"],
    );
    t.wait_out("[rank 0] step 3 ", Duration::from_secs(120));
    az.add_event("Preempt", &["vm-b"]);
    let (id, appeared) = az.add_event("Preempt", &["vm-a"]);
    t.drain_lag(appeared, "azure");
    let (step, err) = t.finish(tmp.path());
    let approvals = az.approvals();
    assert_eq!(approvals.len(), 1, "{approvals:?}\n{err}");
    assert_eq!(approvals[0].event_ids, vec![id]);
    let drain_ms = events_of(tmp.path(), "drain_started")
        .first()
        .and_then(|e| e["ts_ms"].as_u64())
        .unwrap_or_else(|| panic!("no drain_started event:\n{err}"));
    assert!(approvals[0].unix_ms >= drain_ms);
    let commit_ms = events_of(tmp.path(), "checkpoint_committed")
        .iter()
        .find(|e| e["step"] == step)
        .and_then(|e| e["ts_ms"].as_u64())
        .unwrap_or_else(|| panic!("no commit event for step {step}:\n{err}"));
    assert!(
        approvals[0].unix_ms >= commit_ms,
        "approved at {} ms, the drained step committed at {commit_ms} ms",
        approvals[0].unix_ms
    );
}

#[test]
fn checkpoint_every_duration_makes_workers_save_without_a_step_interval() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let mut c = agent(tmp.path());
    c.args([
        "--nproc-per-node",
        "2",
        "--checkpoint-every",
        "1s",
        "--checkpoint-url",
    ])
    .arg(&ck)
    .arg("--")
    .arg(python())
    .arg(repo().join("examples/ddp_train.py"))
    .args(["--steps", "400", "--step-sleep", "0.01"]);
    let (status, out, err) = run(c, Duration::from_secs(180));
    assert!(status.success(), "{out}\n{err}");
    let saved: Vec<u64> = out
        .lines()
        .filter_map(|l| l.strip_prefix("[rank 0] saved step "))
        .map(|s| s.trim().parse().unwrap())
        .collect();
    // The final step is always saved; a time-based save happened before it.
    assert!(saved.iter().any(|s| *s < 400), "{saved:?}\n{err}");
    assert_eq!(saved.last(), Some(&400));
    assert!(err.contains("time-based checkpoint requested"), "{err}");
}

fn digest(out: &str) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with("[rank 0] done step"))
        .unwrap_or_else(|| panic!("{out}"));
    line.rsplit(' ').next().unwrap().to_string()
}

#[test]
fn resuming_at_the_same_world_size_gives_bitwise_equal_weights() {
    let tmp = tempfile::tempdir().unwrap();
    // (stdout, stderr) of the example trained to `steps` under one agent.
    let train_with = |ck: &std::path::Path, steps: u32, flags: &[&str]| {
        let mut c = agent(tmp.path());
        c.args(["--nproc-per-node", "2"])
            .args(flags)
            .arg("--checkpoint-url")
            .arg(ck)
            .arg("--")
            .arg(python())
            .arg(repo().join("examples/ddp_train.py"))
            .args(["--steps", &steps.to_string(), "--seed", "7"]);
        let (status, out, err) = run(c, Duration::from_secs(180));
        assert!(status.success(), "{out}\n{err}");
        (out, err)
    };
    let train = |ck: &std::path::Path, steps: u32| train_with(ck, steps, &[]).0;
    // The workers started in standbys that imported torch while the agent restored step 12
    // (`--warm-standby`): they read it whole all the same.
    let warm = |err: &str| err.matches("worker started from a warm standby").count();
    let straight = train(&tmp.path().join("a"), 30);
    let first = train(&tmp.path().join("b"), 12);
    let (resumed, err) = train_with(&tmp.path().join("b"), 30, &["--warm-standby"]);
    assert!(resumed.contains("resumed from step 12 "), "{resumed}");
    assert!(
        err.contains("warm standbys start while the resume step restores"),
        "{err}"
    );
    assert_eq!(warm(&err), 2, "{err}");
    assert_ne!(
        digest(&first),
        digest(&straight),
        "the check must be able to fail"
    );
    assert_eq!(digest(&resumed), digest(&straight));

    // A bit flips in the newest committed step: the agent warns, naming the object, resumes
    // from the step before, and the weights still come out bitwise equal. This time the
    // agent restores without copies (`--restore-no-copy`): it checks the raw chunks where they
    // lie, and the workers' `elastic_run.load` reads them there.
    let ck = tmp.path().join("c");
    let (first, _) = train_with(&ck, 12, &["--checkpoint-interval", "5"]);
    let steps = committed_steps(&format!("file://{}", ck.display()));
    assert!(steps.len() >= 2, "{steps:?}\n{first}");
    let (newest, before) = (steps[steps.len() - 1], steps[steps.len() - 2]);
    let data = ck.join(format!("steps/{newest:020}/data"));
    let writer = std::fs::read_dir(&data).unwrap().next().unwrap().unwrap();
    let chunk = writer.path().join("000000.bin");
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&chunk, bytes).unwrap();
    let (out, err) = train_with(&ck, 30, &["--warm-standby", "--restore-no-copy"]);
    assert!(
        out.contains(&format!("resumed from step {before} ")),
        "{out}"
    );
    assert!(err.contains("without_copies=1"), "{err}");
    let restored = tmp.path().join(format!("staging/.restore/step-{before}"));
    for r in 0..2 {
        let rank = restored.join(format!("rank-{r}"));
        assert!(
            rank.join("sources.json").is_file() && !rank.join("state.safetensors").exists(),
            "{}: {:?}",
            rank.display(),
            std::fs::read_dir(&rank)
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
    }
    assert_eq!(warm(&err), 2, "{err}");
    assert!(
        err.contains("000000.bin") && err.contains("falling back"),
        "{err}"
    );
    assert_eq!(digest(&out), digest(&straight));
}

#[test]
fn a_symlink_planted_at_the_default_staging_path_is_refused_and_its_target_kept() {
    use std::os::unix::fs::DirBuilderExt;
    let tmp = tempfile::tempdir().unwrap();
    // The default staging dir is `<root>/<run id>/<node id>`: both given, so it is known.
    let run_id = format!(
        "symlink-e2e-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let root = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm/elastic-run")
    } else {
        std::env::temp_dir().join("elastic-run")
    };
    let job = root.join(&run_id);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&job)
        .unwrap();
    // Another user's directory, as far as the agent can tell: it must stay untouched.
    let victim = tmp.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("sentinel"), "not the agent's").unwrap();
    let link = job.join("n0");
    std::os::unix::fs::symlink(&victim, &link).unwrap();

    let mut c = agent(tmp.path());
    c.env_remove("ELASTIC_STAGING_DIR")
        .args([
            "--standalone",
            "--nproc-per-node",
            "1",
            "--rdzv-id",
            &run_id,
        ])
        .args(["--node-id", "n0", "--"])
        .arg(python())
        .args(["-c", "print('worker ran')"]);
    let (status, out, err) = run(c, Duration::from_secs(60));
    let sentinel = victim.join("sentinel").exists();
    let _ = std::fs::remove_file(&link);
    let _ = std::fs::remove_dir(&job);
    let _ = std::fs::remove_dir(&root);
    assert!(!status.success(), "{out}\n{err}");
    assert!(
        err.contains("is a symlink") && err.contains(&format!("{run_id}/n0")),
        "{err}"
    );
    assert!(!out.contains("worker ran"), "{out}");
    assert!(sentinel, "the symlink's target lost its files");
}

/// Mounts a tmpfs of `size` at `dir` (root only); unmounted when the guard drops.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_full_staging_file_system_skips_checkpoints_and_never_ends_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("shm");
    // Smaller than one snapshot of the model below: every checkpoint meets ENOSPC.
    let Some(_fs) = Tmpfs::mount(&staging, "128k") else {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root and must be able to mount a tmpfs"
        );
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    let ck = tmp.path().join("ck");
    let mut c = agent(tmp.path());
    c.env("ELASTIC_STAGING_DIR", &staging)
        .args(["--nproc-per-node", "2", "--checkpoint-interval", "5"])
        .arg("--checkpoint-url")
        .arg(&ck)
        .arg("--events-file")
        .arg(tmp.path().join("events.jsonl"))
        .arg("--")
        .arg(python())
        .arg(repo().join("examples/ddp_train.py"))
        .args(["--steps", "15", "--hidden", "256"]);
    let (status, out, err) = run(c, Duration::from_secs(180));
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("[rank 0] done step 15"), "{out}");
    assert!(
        err.contains("skipping the checkpoint of step 5") && err.contains("is full"),
        "{err}"
    );
    let skipped = events_of(tmp.path(), "checkpoint_skipped");
    assert!(
        skipped.iter().any(|e| e["step"] == 5) && skipped.iter().any(|e| e["step"] == 15),
        "{skipped:?}"
    );
    assert!(
        committed_steps(&format!("file://{}", ck.display())).is_empty(),
        "nothing fit, so nothing may be committed"
    );
}

/// The agent never links libtorch, whatever features the build turns on (tch support is the
/// `elastic-run-worker-tch` crate's, which only training programs use): a node without torch's
/// libraries must still start `elastic-run`.
#[test]
fn the_agent_binary_does_not_link_libtorch() {
    let out = std::process::Command::new("ldd")
        .arg(BIN)
        .output()
        .expect("run ldd");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ldd {BIN}: {text}");
    assert!(!text.contains("libtorch"), "{BIN} links libtorch:\n{text}");
    assert!(
        !text.contains("not found"),
        "{BIN} misses a library:\n{text}"
    );
}
