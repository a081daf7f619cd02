//! The Rust worker API with tch: `examples/tch_train.rs` under `elastic-run`, drained by
//! SIGTERM and resumed from the checkpoint store (without copies), ends bitwise equal to an
//! uninterrupted run; and its snapshot split agrees with the Python client's.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `target/<profile>`, from this test binary's path (`target/<profile>/deps/tests-*`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn run_tch(ck: &str, staging: &std::path::Path, steps: u64, sleep_ms: u64) -> Command {
    let t = target_dir();
    let bin = t.join("elastic-run");
    let example = t.join("examples/tch_train");
    assert!(
        bin.exists() && example.exists(),
        "build with `cargo test --workspace --all-features`"
    );
    let mut c = Command::new(bin);
    c.args([
        "--standalone",
        "--nproc-per-node",
        "1",
        "--checkpoint-interval",
        "10",
        "--no-python",
    ])
    .args(["--checkpoint-url", ck])
    .arg("--staging-dir")
    .arg(staging)
    .arg("--")
    .arg(example)
    .args([
        "--steps",
        &steps.to_string(),
        "--step-sleep-ms",
        &sleep_ms.to_string(),
    ])
    .env("ELASTIC_LOG", "warn")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

fn digest(out: &str) -> String {
    out.lines()
        .rev()
        .find_map(|l| l.split(" weights ").nth(1))
        .unwrap_or_else(|| panic!("no digest in:\n{out}"))
        .to_string()
}

fn finish(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn tch_worker_drains_and_resumes_bitwise_equal() {
    let _bin = crate::bin_in_use();
    let tmp = tempfile::tempdir().unwrap();
    let straight = finish(&mut run_tch(
        &format!("file://{}/a", tmp.path().display()),
        &tmp.path().join("sa"),
        60,
        0,
    ));
    let ck = format!("file://{}/b", tmp.path().display());
    let mut child = run_tch(&ck, &tmp.path().join("sb"), 60, 20)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for l in lines.by_ref() {
        let l = l.unwrap();
        seen.push_str(&l);
        seen.push('\n');
        if l.contains("step 15 loss") {
            break;
        }
        assert!(Instant::now() < deadline, "{seen}");
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    for l in lines {
        seen.push_str(&l.unwrap());
        seen.push('\n');
    }
    assert!(child.wait().unwrap().success(), "{seen}");
    let stopped: u64 = seen
        .lines()
        .find_map(|l| l.split("stopping at step ").nth(1))
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no drain in:\n{seen}"));
    assert!(stopped < 60, "{seen}");
    // Resumed without copies (`--restore-no-copy`): the agent checks the raw chunks where
    // they lie, and the Rust client reads the tensors from them.
    let resumed =
        finish(run_tch(&ck, &tmp.path().join("sb2"), 60, 0).env("ELASTIC_RESTORE_NO_COPY", "1"));
    assert!(
        resumed.contains(&format!("resumed from step {stopped} ")),
        "{resumed}"
    );
    let rank = tmp
        .path()
        .join(format!("sb2/.restore/step-{stopped}/rank-0"));
    assert!(
        rank.join("sources.json").is_file() && !rank.join("state.safetensors").exists(),
        "{}",
        rank.display()
    );
    assert_ne!(
        digest(&seen),
        digest(&straight),
        "the check must be able to fail"
    );
    assert_eq!(digest(&resumed), digest(&straight));
}

#[test]
fn rust_and_python_clients_split_a_snapshot_the_same_way() {
    let _bin = crate::bin_in_use();
    let sizes: std::collections::BTreeMap<String, u64> = (0..40u64)
        .map(|i| (format!("t{i:02}"), (i * 7919) % 1000 + 1))
        .collect();
    let rust = worker::assign_keys(&sizes, 3);
    let py = services::paths::python().unwrap();
    let json = serde_json::to_string(&sizes).unwrap();
    let out = Command::new(py)
        .args([
            "-c",
            "import json,sys; import elastic_run as er; print(json.dumps(er.assign_keys(json.loads(sys.argv[1]), 3), sort_keys=True))",
        ])
        .arg(&json)
        .env("PYTHONPATH", services::paths::repo_root().join("runtime/python"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let py: std::collections::BTreeMap<String, u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rust, py);
}
