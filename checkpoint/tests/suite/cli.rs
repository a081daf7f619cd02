//! `elastic-ckpt` end to end: push to `file://`, `cp` to S3 (moto), pull from S3
//! byte-identical; `verify` exits non-zero naming the bad object; human and JSON output.

use std::path::Path;
use std::process::{Command, Output};

use crate::common;

const BIN: &str = env!("CARGO_BIN_EXE_elastic-ckpt");

fn run(args: &[&str], env: &[(String, String)]) -> Output {
    Command::new(BIN)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap()
}

fn ok(args: &[&str], env: &[(String, String)]) -> String {
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
    let gc = ok(
        &["gc", &url, "--keep-last", "1", "--dry-run", "--json"],
        &[],
    );
    assert!(gc.contains("newest committed"), "{gc}");
}
