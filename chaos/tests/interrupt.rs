//! `elastic-chaos` stopped by SIGTERM in the middle of a run: it exits 130 and no process of
//! the run (agent or worker) outlives it.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A run that would train for minutes, with no fault of its own.
const SCENARIO: &str = r#"
name = "interrupted"
seed = 1
nodes = 2
min_nodes = 1
max_nodes = 2
steps = 100000
step_sleep_s = 0.1
checkpoint_interval = 50
"#;

/// How long the run's workers may take to start on a loaded machine.
const WORKERS_STARTED_WAIT_S: u64 = 120;
/// How long the harness may take to stop its run after the signal.
const STOPPED_WAIT_S: u64 = 30;

fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = Instant::now() + limit;
    loop {
        if let Some(t) = f() {
            return Some(t);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_stops_the_run_and_leaves_no_process_of_it() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let tmp = tempfile::tempdir().unwrap();
    let scenario = tmp.path().join("interrupted.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let mut harness = Command::new(env!("CARGO_BIN_EXE_elastic-chaos"))
        .current_dir(&repo)
        .arg("run")
        .arg(&scenario)
        .arg("--out")
        .arg(tmp.path().join("out"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let job = format!("chaos-interrupted-1-{}", harness.id());
    // A worker of each agent: workers carry the job in their environment.
    let started = wait_for(Duration::from_secs(WORKERS_STARTED_WAIT_S), || {
        let procs = chaos::harness::leftovers(&job);
        let workers = procs
            .iter()
            .filter(|p| !p.contains("elastic-run") && p.contains("ddp_train.py"))
            .count();
        (workers >= 2).then_some(procs)
    });
    if started.is_none() {
        let _ = harness.kill();
        let out = harness.wait_with_output().unwrap();
        panic!(
            "the run's workers did not start in {WORKERS_STARTED_WAIT_S} s: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // SAFETY: kill(2) on the child this test started and has not reaped.
    unsafe { libc::kill(harness.id() as i32, libc::SIGTERM) };
    let exited = wait_for(Duration::from_secs(STOPPED_WAIT_S), || {
        harness.try_wait().unwrap()
    });
    if exited.is_none() {
        let _ = harness.kill();
    }
    let out = harness.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(130),
        "elastic-chaos after SIGTERM: {:?}\nstderr: {stderr}",
        out.status
    );
    assert!(stderr.contains("interrupted by SIGTERM"), "{stderr}");
    // Workers die with their agent by PDEATHSIG: give them a moment to be reaped.
    let left = wait_for(Duration::from_secs(10), || {
        let left = chaos::harness::leftovers(&job);
        left.is_empty().then_some(())
    });
    assert!(
        left.is_some(),
        "processes of {job} outlived elastic-chaos: {:?}",
        chaos::harness::leftovers(&job)
    );
}
