//! Crash safety: `elastic-ckpt push` killed with SIGKILL at seeded random moments never leaves
//! a partial step visible, the next push of the step succeeds, and gc removes the leftovers.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};

use crate::common;

const BIN: &str = env!("CARGO_BIN_EXE_elastic-ckpt");
/// Kill runs per test; each is replayable from its seed (printed on failure).
const RUNS: u64 = 20;

fn ckpt(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = ckpt(args);
    assert!(
        out.status.success(),
        "elastic-ckpt {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn write_inputs(dir: &Path) {
    std::fs::create_dir_all(dir.join("opt")).unwrap();
    for (i, name) in ["a.safetensors", "b.safetensors", "opt/c.safetensors"]
        .iter()
        .enumerate()
    {
        let t = common::tensor("w", "F32", &[512, 1024], i as u64);
        let u = common::tensor("u", "BF16", &[700, 33], i as u64 + 10);
        std::fs::write(dir.join(name), common::st_bytes(&[t, u], None)).unwrap();
    }
}

#[test]
fn sigkilled_push_never_shows_a_partial_step_and_the_next_push_succeeds() {
    let input = tempfile::tempdir().unwrap();
    write_inputs(input.path());
    let inp = input.path().to_str().unwrap();

    // How long an uninterrupted push takes, to spread the kills over it.
    let base = tempfile::tempdir().unwrap();
    let url = format!("file://{}", base.path().display());
    let t0 = Instant::now();
    ok(&[
        "push",
        inp,
        &url,
        "--step",
        "1",
        "--chunk-mib",
        "1",
        "--concurrency",
        "2",
    ]);
    let full = t0.elapsed();

    for seed in 0..RUNS {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bucket = tempfile::tempdir().unwrap();
        let url = format!("file://{}", bucket.path().display());
        let delay = full.mul_f64(rng.random_range(0.0..1.2));
        let mut child = Command::new(BIN)
            .args([
                "push",
                inp,
                &url,
                "--step",
                "5",
                "--chunk-mib",
                "1",
                "--concurrency",
                "2",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let ls: serde_json::Value =
            serde_json::from_str(&ok(&["ls", &url, "--all", "--json"])).unwrap();
        let committed = ls
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["committed"] == true);
        for s in ls.as_array().unwrap() {
            assert!(
                s["committed"] == false || s["manifest"].is_object(),
                "seed {seed} delay {delay:?}: a committed step does not read: {s}"
            );
        }
        eprintln!("seed {seed}: SIGKILL after {delay:?} of {full:?}, step committed: {committed}");
        if !committed {
            ok(&["push", inp, &url, "--step", "5", "--chunk-mib", "1"]);
        }
        ok(&["verify", &url, "--step", "5"]);
        let out = tempfile::tempdir().unwrap();
        ok(&["pull", &url, out.path().to_str().unwrap()]);
        for name in ["a.safetensors", "b.safetensors", "opt/c.safetensors"] {
            assert!(
                std::fs::read(input.path().join(name)).unwrap()
                    == std::fs::read(out.path().join(name)).unwrap(),
                "seed {seed}: {name} differs"
            );
        }
        // gc removes the killed attempt's leftovers, keeps the committed step.
        ok(&["gc", &url, "--keep-last", "1", "--leftover-age-secs", "0"]);
        let m: serde_json::Value = serde_json::from_str(&ok(&["show", &url, "--json"])).unwrap();
        let parts: Vec<String> = m["parts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                format!(
                    "{}-{}",
                    p["writer"].as_str().unwrap(),
                    p["attempt"].as_str().unwrap()
                )
            })
            .collect();
        let data = bucket.path().join("steps/00000000000000000005/data");
        for e in std::fs::read_dir(&data).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(
                parts.contains(&name),
                "seed {seed}: leftover attempt {name} survived gc"
            );
        }
        let v = ok(&["verify", &url]);
        assert!(v.contains("verified"), "{v}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A writer killed in its very first put leaves only `object_store`'s staged upload (a `#`
/// name no listing shows) in its attempt directory; gc removes that directory too.
#[test]
fn gc_removes_an_attempt_that_left_only_a_staged_upload() {
    let input = tempfile::tempdir().unwrap();
    write_inputs(input.path());
    let bucket = tempfile::tempdir().unwrap();
    let url = format!("file://{}", bucket.path().display());
    ok(&["push", input.path().to_str().unwrap(), &url, "--step", "5"]);
    let dead = bucket
        .path()
        .join("steps/00000000000000000005/data/push-00000000000000000000000000000dead");
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join("00000.chunk#1"), b"half a chunk").unwrap();
    ok(&["gc", &url, "--keep-last", "1", "--leftover-age-secs", "0"]);
    assert!(!dead.exists(), "{} survived gc", dead.display());
    let v = ok(&["verify", &url]);
    assert!(v.contains("verified"), "{v}");
}
