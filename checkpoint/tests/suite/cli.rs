//! `elastic-ckpt` end to end: push to `file://`, `cp` to S3 (moto), pull from S3
//! byte-identical; `verify` exits non-zero naming the bad object; human and JSON output.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;

const BIN: &str = env!("CARGO_BIN_EXE_elastic-ckpt");

pub(crate) fn run(args: &[&str], env: &[(String, String)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap()
}

pub(crate) fn ok(args: &[&str], env: &[(String, String)]) -> String {
    let out = run(args, env);
    assert!(
        out.status.success(),
        "elastic-ckpt {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn write_set(dir: &Path) {
    for (name, bytes) in common::two_files() {
        let p = dir.join(&name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
}

#[test]
fn push_to_file_cp_to_s3_and_pull_from_s3_is_byte_identical() {
    let moto = services::moto().unwrap();
    moto.create_bucket("ckpt").unwrap();
    let env = moto.env();
    let input = tempfile::tempdir().unwrap();
    write_set(input.path());
    let bucket = tempfile::tempdir().unwrap();
    let file_url = format!("file://{}", bucket.path().display());
    let inp = input.path().to_str().unwrap();

    let out = ok(
        &[
            "push",
            inp,
            &file_url,
            "--step",
            "3",
            "--metadata",
            r#"{"epoch":1}"#,
        ],
        &[],
    );
    assert!(out.contains("committed step 3"), "{out}");
    let refused = run(&["push", inp, &file_url, "--step", "3"], &[]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("already exists"));

    ok(&["cp", &file_url, "s3://ckpt/job", "--step", "3"], &env);
    let ls = ok(&["ls", "s3://ckpt/job"], &env);
    assert!(ls.contains("committed") && ls.contains(" 3 "), "{ls}");
    let out = tempfile::tempdir().unwrap();
    ok(
        &["pull", "s3://ckpt/job", out.path().to_str().unwrap()],
        &env,
    );
    for (name, bytes) in common::two_files() {
        assert!(
            std::fs::read(out.path().join(&name)).unwrap() == bytes.as_ref(),
            "{name}"
        );
    }
    let show: serde_json::Value =
        serde_json::from_str(&ok(&["show", "s3://ckpt/job", "--json"], &env)).unwrap();
    assert_eq!(show["metadata"]["epoch"], 1);
    let human = ok(&["show", "s3://ckpt/job"], &env);
    assert!(
        human.contains("layer.0.weight") && human.contains("ratio"),
        "{human}"
    );
    // Credentials never show up in output.
    let all = format!("{ls}{human}");
    assert!(!all.contains("testing"), "{all}");
}

#[test]
fn verify_exits_non_zero_and_names_the_bad_object() {
    let input = tempfile::tempdir().unwrap();
    write_set(input.path());
    let bucket = tempfile::tempdir().unwrap();
    let url = format!("file://{}", bucket.path().display());
    ok(
        &["push", input.path().to_str().unwrap(), &url, "--step", "1"],
        &[],
    );
    let show: serde_json::Value =
        serde_json::from_str(&ok(&["show", &url, "--json"], &[])).unwrap();
    let key = show["objects"][0]["key"].as_str().unwrap().to_string();
    let path = bucket.path().join(&key);
    let mut data = std::fs::read(&path).unwrap();
    data[0] ^= 1;
    std::fs::write(&path, data).unwrap();
    let out = run(&["verify", &url, "--step", "1"], &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&key) && err.contains("crc32c"), "{err}");
    // Without --step, verify checks the newest committed step, not an older one that passes.
    ok(
        &["push", input.path().to_str().unwrap(), &url, "--step", "0"],
        &[],
    );
    let out = run(&["verify", &url], &[]);
    assert!(!out.status.success(), "verify of the newest step must fail");
    ok(&["verify", &url, "--step", "0"], &[]);
    let gc: serde_json::Value = serde_json::from_str(&ok(
        &["gc", &url, "--keep-last", "1", "--dry-run", "--json"],
        &[],
    ))
    .unwrap();
    assert_eq!(gc["items"][0]["reason"], "newest_verified", "{gc}");
    assert_eq!(gc["items"][1]["reason"], "not_verifying_newer", "{gc}");
}

/// Pushes steps 1, 2 and 3 of the two-file set to a fresh file:// store.
fn three_steps() -> (tempfile::TempDir, tempfile::TempDir, String) {
    let input = tempfile::tempdir().unwrap();
    write_set(input.path());
    let bucket = tempfile::tempdir().unwrap();
    let url = format!("file://{}", bucket.path().display());
    for step in ["1", "2", "3"] {
        ok(
            &["push", input.path().to_str().unwrap(), &url, "--step", step],
            &[],
        );
    }
    (input, bucket, url)
}

/// What `gc --json` decided: `(step, decision, reason)`.
fn gc_items(json: &str) -> Vec<(u64, String, String)> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["step"].as_u64().unwrap(),
                i["decision"].as_str().unwrap().to_string(),
                i["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn committed(url: &str) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(&ok(&["ls", url, "--json"], &[])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect()
}

/// Step 2 pulls byte-identical, by number and as the newest that reads back whole.
fn assert_step_2_pulls(url: &str) {
    for args in [&["--step", "2"][..], &[]] {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("pulled");
        let mut all = vec!["pull", url, dir.to_str().unwrap(), "--json"];
        all.extend_from_slice(args);
        let pulled: serde_json::Value = serde_json::from_str(&ok(&all, &[])).unwrap();
        assert_eq!(pulled["step"], 2, "{pulled}");
        for (name, bytes) in common::two_files() {
            assert!(
                std::fs::read(dir.join(&name)).unwrap() == bytes.as_ref(),
                "{name}"
            );
        }
    }
}

fn kept_2_and_3() -> Vec<(u64, String, String)> {
    vec![
        (
            1,
            "delete_committed".into(),
            "unchecked_outside_retention".into(),
        ),
        (2, "keep".into(), "newest_verified".into()),
        (3, "keep".into(), "not_verifying_newer".into()),
    ]
}

#[test]
fn gc_keep_last_1_keeps_step_2_when_the_newest_chunk_has_a_flipped_bit() {
    let (_input, bucket, url) = three_steps();
    let show: serde_json::Value =
        serde_json::from_str(&ok(&["show", &url, "--step", "3", "--json"], &[])).unwrap();
    let key = show["objects"][0]["key"].as_str().unwrap().to_string();
    let path = bucket.path().join(&key);
    let mut data = std::fs::read(&path).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x01;
    std::fs::write(&path, data).unwrap();

    // The default reads the steps it keeps in full.
    let plan = ok(
        &["gc", &url, "--keep-last", "1", "--dry-run", "--json"],
        &[],
    );
    assert_eq!(gc_items(&plan), kept_2_and_3(), "{plan}");
    // --fast cannot see a flipped bit (it says so in its help).
    let fast = ok(
        &[
            "gc",
            &url,
            "--keep-last",
            "1",
            "--fast",
            "--dry-run",
            "--json",
        ],
        &[],
    );
    assert_eq!(gc_items(&fast)[2].2, "newest_verified", "{fast}");
    assert_eq!(committed(&url), [1, 2, 3], "dry runs delete nothing");

    let human = ok(&["gc", &url, "--keep-last", "1", "--verify"], &[]);
    assert!(
        human.contains("step 3 does not verify") && human.contains(&key),
        "{human}"
    );
    assert!(human.contains("kept for inspection"), "{human}");
    assert_eq!(committed(&url), [2, 3]);
    assert_step_2_pulls(&url);
}

#[test]
fn gc_keep_last_1_keeps_step_2_when_the_newest_manifest_is_garbage() {
    let (_input, bucket, url) = three_steps();
    let manifest = bucket.path().join(checkpoint::format::manifest_key(3));
    std::fs::write(&manifest, "{bad").unwrap();
    // The cheap check sees a manifest that does not read.
    let out = ok(&["gc", &url, "--keep-last", "1", "--fast", "--json"], &[]);
    assert_eq!(gc_items(&out), kept_2_and_3(), "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["not_verifying"][0]["step"], 3, "{v}");
    assert_eq!(v["check"], "present", "{v}");
    // The default agrees, and deletes nothing more.
    let out = ok(&["gc", &url, "--keep-last", "1", "--json"], &[]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["objects_deleted"], 0, "{v}");
    assert_eq!(v["check"], "full", "{v}");
    assert_eq!(std::fs::read_to_string(&manifest).unwrap(), "{bad");
    assert_step_2_pulls(&url);
}

#[test]
fn gc_refuses_keep_last_0_and_conflicting_checks() {
    let (_input, _bucket, url) = three_steps();
    let out = run(&["gc", &url, "--keep-last", "0"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--keep-last") && err.contains("at least 1"),
        "{err}"
    );
    let out = run(&["gc", &url, "--keep-last", "1", "--keep-every", "0"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["gc", &url, "--keep-last", "1", "--fast", "--verify"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(committed(&url), [1, 2, 3]);
}
