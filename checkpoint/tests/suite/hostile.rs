//! Hostile and unlucky input through `elastic-ckpt` and the library, as a user would meet it:
//! a corrupt newest step, a manifest that names an impossible layout, symlinks and FIFOs where
//! files belong, names made of terminal escapes, empty pushes, overflowing headers, oversized
//! manifests and out-of-range steps. Each case gets a clear error naming the thing, and no
//! committed step is lost or hidden.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use checkpoint::{CommitRequest, Error, PartInput, PartSource, Store, StoreOptions};

use crate::common::{self, cancel};

const BIN: &str = env!("CARGO_BIN_EXE_elastic-ckpt");
/// A command that should answer at once; past this it is hung.
const CLI_DEADLINE_MS: u64 = 30_000;

/// Runs `elastic-ckpt` with a deadline: a hang is a failure, not a stuck suite.
fn run(args: &[&str]) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > Duration::from_millis(CLI_DEADLINE_MS) {
            child.kill().unwrap();
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).ok();
            panic!("elastic-ckpt {args:?} hung for {CLI_DEADLINE_MS} ms: {err}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(args: &[&str]) -> (String, String) {
    let out = run(args);
    assert!(
        out.status.success(),
        "elastic-ckpt {args:?}: {}",
        text(&out.stderr)
    );
    (text(&out.stdout), text(&out.stderr))
}

fn fails(args: &[&str]) -> String {
    let out = run(args);
    assert!(!out.status.success(), "elastic-ckpt {args:?} succeeded");
    text(&out.stderr)
}

/// A bucket on `file://` with steps 1 and 2 pushed through the CLI; step `s` was pushed from
/// files whose tensors differ per step.
struct Bucket {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    url: String,
    inputs: Vec<Vec<(String, Bytes)>>,
}

fn files_for(step: u64) -> Vec<(String, Bytes)> {
    let mut files = common::two_files();
    // Make the steps' bytes differ, so a pull shows which one it got.
    files.push((
        "step.safetensors".into(),
        common::st_bytes(&[common::tensor("s", "F32", &[16], step)], None).into(),
    ));
    files
}

fn bucket() -> Bucket {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("bucket");
    let url = format!("file://{}", root.display());
    let mut inputs = Vec::new();
    for step in [1u64, 2] {
        let dir = tmp.path().join(format!("in-{step}"));
        let files = files_for(step);
        write_files(&dir, &files);
        ok(&[
            "push",
            dir.to_str().unwrap(),
            &url,
            "--step",
            &step.to_string(),
        ]);
        inputs.push(files);
    }
    Bucket {
        _tmp: tmp,
        root,
        url,
        inputs,
    }
}

fn write_files(dir: &Path, files: &[(String, Bytes)]) {
    for (name, bytes) in files {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes).unwrap();
    }
}

fn step_dir(b: &Bucket, step: u64) -> PathBuf {
    b.root.join(format!("steps/{step:020}"))
}

fn first_chunk(b: &Bucket, step: u64) -> PathBuf {
    let data = step_dir(b, step).join("data");
    let writer = std::fs::read_dir(&data).unwrap().next().unwrap().unwrap();
    writer.path().join("000000.bin")
}

fn fresh_dir() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("out");
    (t, d)
}

#[test]
fn pull_falls_back_past_a_newest_step_with_a_flipped_bit_and_names_the_object() {
    let b = bucket();
    let chunk = first_chunk(&b, 2);
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&chunk, bytes).unwrap();
    let key = chunk
        .strip_prefix(&b.root)
        .unwrap()
        .to_string_lossy()
        .into_owned();

    let (_t, out) = fresh_dir();
    let (stdout, stderr) = ok(&["pull", &b.url, out.to_str().unwrap()]);
    assert!(stdout.contains("pulled step 1"), "{stdout}");
    assert!(
        stderr.contains(&key) && stderr.contains("crc32c"),
        "{stderr}"
    );
    common::assert_dir_has(&out, &b.inputs[0]);

    // Asked for by number, the bad step is an error naming the object, and leaves nothing.
    let (_t, out) = fresh_dir();
    let err = fails(&["pull", &b.url, out.to_str().unwrap(), "--step", "2"]);
    assert!(err.contains(&key), "{err}");
    let left: Vec<_> = std::fs::read_dir(&out)
        .map(|r| r.flatten().collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn pull_falls_back_past_a_manifest_whose_files_cannot_be_laid_out() {
    let b = bucket();
    let m = step_dir(&b, 2).join("manifest.json");
    let text = std::fs::read_to_string(&m).unwrap();
    // One file where another needs a directory: no directory can hold both.
    let forged = text.replace(
        "\"optim/state.safetensors\"",
        "\"model.safetensors/inner.safetensors\"",
    );
    assert_ne!(forged, text);
    std::fs::write(&m, forged).unwrap();

    let (_t, out) = fresh_dir();
    let (stdout, stderr) = ok(&["pull", &b.url, out.to_str().unwrap()]);
    assert!(stdout.contains("pulled step 1"), "{stdout}");
    assert!(stderr.contains("model.safetensors"), "{stderr}");
    common::assert_dir_has(&out, &b.inputs[0]);
    let (ls, _) = ok(&["ls", &b.url]);
    assert!(ls.contains("committed but invalid"), "{ls}");
}

#[test]
fn pull_refuses_a_non_empty_target_and_never_writes_through_a_symlink_in_it() {
    let b = bucket();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(out.join("old.txt"), b"mine").unwrap();

    let err = fails(&["pull", &b.url, out.to_str().unwrap()]);
    assert!(
        err.contains("not empty") && err.contains("--force"),
        "{err}"
    );

    // With --force, other files stay and the step's files are laid out...
    ok(&["pull", &b.url, out.to_str().unwrap(), "--force"]);
    common::assert_dir_has(&out, &b.inputs[1]);
    assert_eq!(std::fs::read(out.join("old.txt")).unwrap(), b"mine");

    // ...but never through a symlink planted where the step needs a directory.
    std::fs::remove_dir_all(out.join("optim")).unwrap();
    std::os::unix::fs::symlink(&outside, out.join("optim")).unwrap();
    let err = fails(&["pull", &b.url, out.to_str().unwrap(), "--force"]);
    assert!(err.contains("symlink") && err.contains("optim"), "{err}");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}

#[test]
fn a_fifo_where_a_manifest_belongs_neither_hangs_ls_nor_pull() {
    let b = bucket();
    let m = step_dir(&b, 2).join("manifest.json");
    std::fs::remove_file(&m).unwrap();
    let c = std::ffi::CString::new(m.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);

    let (ls, _) = ok(&["ls", &b.url]);
    assert!(ls.contains("not a regular file"), "{ls}");
    let (_t, out) = fresh_dir();
    let (stdout, _) = ok(&["pull", &b.url, out.to_str().unwrap()]);
    assert!(stdout.contains("pulled step 1"), "{stdout}");
    let err = fails(&["verify", &b.url, "--step", "2"]);
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn names_with_control_characters_are_refused_and_never_reach_the_terminal_raw() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let input = tmp.path().join("in");
    let evil = "w\u{1b}[2J\u{1b}]0;owned\u{7}";
    write_files(
        &input,
        &[(
            "model.safetensors".into(),
            common::st_bytes(&[common::tensor(evil, "F32", &[4], 1)], None).into(),
        )],
    );
    let out = run(&["push", input.to_str().unwrap(), &url, "--step", "1"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("control character"), "{err}");
    assert!(!out.stderr.contains(&0x1b), "raw escape printed: {err:?}");

    // A forged manifest carrying the same name: rejected, and shown escaped.
    let b = bucket();
    let m = step_dir(&b, 2).join("manifest.json");
    let text_m = std::fs::read_to_string(&m).unwrap();
    let forged = text_m.replace("\"embed\"", "\"embed\\u001b[2J\"");
    assert_ne!(forged, text_m);
    std::fs::write(&m, forged).unwrap();
    for args in [
        vec!["show", b.url.as_str(), "--step", "2"],
        vec!["ls", b.url.as_str()],
    ] {
        let out = run(&args);
        assert!(
            !out.stdout.contains(&0x1b) && !out.stderr.contains(&0x1b),
            "{args:?} printed a raw escape: {:?} {:?}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
}

#[test]
fn an_empty_or_symlinked_push_is_refused_and_commits_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("notes.txt"), b"no tensors here").unwrap();
    let err = fails(&["push", empty.to_str().unwrap(), &url, "--step", "1"]);
    assert!(err.contains("no *.safetensors"), "{err}");

    let real = tmp.path().join("real");
    write_files(&real, &common::two_files());
    let links = tmp.path().join("links");
    std::fs::create_dir_all(&links).unwrap();
    std::os::unix::fs::symlink(
        real.join("model.safetensors"),
        links.join("model.safetensors"),
    )
    .unwrap();
    let err = fails(&["push", links.to_str().unwrap(), &url, "--step", "1"]);
    assert!(err.contains("symlink"), "{err}");

    let (ls, _) = ok(&["ls", &url, "--all"]);
    assert!(!ls.contains("committed"), "{ls}");
    // The step number is still free.
    ok(&["push", real.to_str().unwrap(), &url, "--step", "1"]);
}

#[test]
fn steps_past_the_largest_are_refused_by_number() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("bucket").display());
    let input = tmp.path().join("in");
    write_files(&input, &common::two_files());
    let too_big = (checkpoint::format::STEP_MAX + 1).to_string();
    let err = fails(&["push", input.to_str().unwrap(), &url, "--step", &too_big]);
    assert!(err.contains(&too_big), "{err}");
    let max = checkpoint::format::STEP_MAX.to_string();
    ok(&["push", input.to_str().unwrap(), &url, "--step", &max]);
    let (_t, out) = fresh_dir();
    let (stdout, _) = ok(&["pull", &url, out.to_str().unwrap()]);
    assert!(stdout.contains(&max), "{stdout}");
}

#[tokio::test]
async fn a_header_whose_offsets_overflow_is_refused_without_a_panic() {
    let header = format!(
        r#"{{"t":{{"dtype":"U8","shape":[{m}],"data_offsets":[0,{m}]}}}}"#,
        m = u64::MAX
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&[0u8; 8]);
    let store = Store::open("memory://").unwrap();
    let input = PartInput {
        writer: "w".into(),
        source: PartSource::Buffers(vec![("x.safetensors".into(), file.into())]),
        shards: Default::default(),
    };
    let e = store
        .save_part(1, input, &common::small_chunks(), &cancel())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidSafetensors { file, .. } if file == "x.safetensors"),
        "{e}"
    );
}

#[tokio::test]
async fn a_commit_whose_manifest_is_over_the_limit_is_refused_and_leaves_the_step_free() {
    let store = Store::open("memory://").unwrap();
    common::save_buffers(&store, 5, "w", common::two_files()).await;
    let limited = store.clone().with_options(StoreOptions {
        manifest_bytes_max: 2048,
        ..Default::default()
    });
    let req = || CommitRequest {
        world_size: 1,
        writers: vec!["w".into()],
        metadata: serde_json::json!({}),
    };
    let e = limited.commit(5, req(), &cancel()).await.unwrap_err();
    assert!(matches!(e, Error::Rejected { step: 5, .. }), "{e}");
    assert!(e.to_string().contains("2048"), "{e}");
    assert!(!e.is_integrity(), "a refusal is not bad stored data");
    assert!(store.committed_steps(&cancel()).await.unwrap().is_empty());
    // Nothing was written: the same parts commit under the reader's own limit.
    store.commit(5, req(), &cancel()).await.unwrap();
}

#[tokio::test]
async fn a_writer_that_gives_a_step_up_makes_commit_stop_waiting_and_nothing_is_committed() {
    let store = Store::open("memory://").unwrap();
    common::save_buffers(&store, 7, "g1-rank-0", common::two_files()).await;
    let req = CommitRequest {
        world_size: 2,
        writers: vec!["g1-rank-0".into(), "g1-rank-1".into()],
        metadata: serde_json::json!({}),
    };
    // Without the marker the missing part is only "not yet".
    let e = store.commit(7, req.clone(), &cancel()).await.unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e}");
    let long = "staging full ".repeat(200);
    store
        .abandon_part(7, "g1-rank-1", &long, &cancel())
        .await
        .unwrap();
    let e = store.commit(7, req, &cancel()).await.unwrap_err();
    match &e {
        Error::Abandoned {
            step: 7,
            writer,
            reason,
            ..
        } => {
            assert_eq!(writer, "g1-rank-1");
            assert!(
                reason.starts_with("staging full") && reason.len() <= 1024,
                "{reason}"
            );
        }
        other => panic!("{other}"),
    }
    assert!(store.committed_steps(&cancel()).await.unwrap().is_empty());
    // A marker of a writer nobody waits for changes nothing; hostile writer ids are refused.
    let e = store
        .abandon_part(7, "../escape", "x", &cancel())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidName { .. }), "{e}");
}
