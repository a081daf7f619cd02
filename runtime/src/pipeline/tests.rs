//! The sink against a `memory://` store: staging checks, two nodes racing, restores, retention.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use checkpoint::restore::{RESTORE_FILE, RESTORE_METADATA_FILE};
use checkpoint::{CancellationToken, Store};
use tokio::time::Instant;

use super::commit::{check_parts, read_staged};
use super::sink::*;
use worker::protocol::{RESTORED_SOURCES, STAGED_META, STAGED_TENSORS};

use crate::state::StagedPart;
use crate::worker_env::ResumePoint;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::collections::HashMap;

#[test]
fn writer_ids_name_the_generation() {
    assert_eq!(writer_id(3, 7), "g3-rank-7");
}

#[test]
fn urls_in_messages_lose_credentials() {
    assert_eq!(
        shown_url("s3://key:secret@bucket/job?sig=x"),
        "s3://bucket/job"
    );
    assert_eq!(shown_url("memory://"), "memory://");
    assert_eq!(shown_url("/a/b"), "/a/b");
    let o = SinkOptions {
        store_config: vec![("aws_secret_access_key".into(), "hunter2".into())],
        ..Default::default()
    };
    let shown = format!("{o:?}");
    assert!(shown.contains("aws_secret_access_key") && !shown.contains("hunter2"));
}

fn part(dir: &Path, rank: u32, step: u64) -> StagedPart {
    StagedPart {
        rank,
        step,
        dir: dir.join(format!("rank-{rank}")),
    }
}

/// A staged part as the worker clients write it: one F32 tensor per rank.
fn stage(root: &Path, step: u64, rank: u32, world: u32, meta: serde_json::Value) {
    let d = root.join(format!("rank-{rank}"));
    std::fs::create_dir_all(&d).unwrap();
    let data: Vec<u8> = (0..4u32)
        .flat_map(|i| ((rank * 10 + i) as f32).to_le_bytes())
        .collect();
    let name = format!("model/w{rank}");
    let views = vec![(
        name.clone(),
        TensorView::new(Dtype::F32, vec![4], &data).unwrap(),
    )];
    safetensors::serialize_to_file(
        views,
        None::<HashMap<String, String>>,
        &d.join(STAGED_TENSORS),
    )
    .unwrap();
    let mut m = serde_json::json!({"format_version": 1, "step": step, "rank": rank,
        "world_size": world, "keys": [name]});
    if let Some(o) = meta.as_object() {
        for (k, v) in o {
            m[k] = v.clone();
        }
    }
    std::fs::write(d.join(STAGED_META), m.to_string()).unwrap();
}

fn fast() -> SinkOptions {
    SinkOptions {
        commit_wait_ms: 300,
        retry_pause_ms: 20,
        ..Default::default()
    }
}

#[test]
fn staged_meta_must_match_step_rank_and_format() {
    let tmp = tempfile::tempdir().unwrap();
    stage(
        tmp.path(),
        5,
        1,
        2,
        serde_json::json!({"state": {"extra": {"a": 1}}}),
    );
    let p = part(tmp.path(), 1, 5);
    assert_eq!(read_staged(5, 2, &p).unwrap()["extra"]["a"], 1);
    let e = read_staged(
        6,
        2,
        &StagedPart {
            step: 6,
            ..p.clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("step 6"), "{e}");
    let e = read_staged(5, 3, &p).unwrap_err();
    assert!(e.to_string().contains("world"), "{e}");
    stage(
        tmp.path(),
        5,
        1,
        2,
        serde_json::json!({"format_version": 9}),
    );
    let e = read_staged(5, 2, &p).unwrap_err();
    assert!(e.to_string().contains("format version Some(9)"), "{e}");
    std::fs::write(p.dir.join(STAGED_META), "not json").unwrap();
    assert!(
        read_staged(5, 2, &p)
            .unwrap_err()
            .to_string()
            .contains("not JSON")
    );
    std::fs::remove_file(p.dir.join(STAGED_TENSORS)).unwrap();
    assert!(
        read_staged(5, 2, &p)
            .unwrap_err()
            .to_string()
            .contains("missing")
    );
}

/// The trainer's JSON state reaches the manifest with every float bit for bit: LR scheduler
/// and GradScaler state are floats, and a resumed run must see the same ones.
#[test]
fn json_state_floats_pass_through_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    stage(tmp.path(), 5, 0, 1, serde_json::json!({}));
    let p = part(tmp.path(), 0, 5);
    // Shortest round-trip texts (Python's repr) of doubles across the whole exponent range.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut floats = Vec::new();
    while floats.len() < 2000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let f = f64::from_bits(x);
        if f.is_finite() {
            floats.push(f);
        }
    }
    floats.extend([
        0.1 + 0.2,
        5e-324,
        f64::MAX,
        0.000_999_999_999_999_999_8,
        -0.0,
    ]);
    let texts: Vec<String> = floats.iter().map(|f| format!("{f:?}")).collect();
    let meta = format!(
        r#"{{"format_version": 1, "step": 5, "rank": 0, "world_size": 1, "keys": ["model/w0"], "state": {{"lrs": [{}]}}}}"#,
        texts.join(", ")
    );
    std::fs::write(p.dir.join(STAGED_META), meta).unwrap();
    let state = read_staged(5, 1, &p).unwrap();
    let reread: serde_json::Value = serde_json::from_str(&state.to_string()).unwrap();
    let got = reread["lrs"].as_array().unwrap();
    assert_eq!(got.len(), floats.len());
    for (i, f) in floats.iter().enumerate() {
        assert_eq!(
            got[i].as_f64().unwrap().to_bits(),
            f.to_bits(),
            "{} came back as {}",
            texts[i],
            got[i]
        );
    }
}

#[test]
fn requests_with_foreign_or_repeated_ranks_are_refused() {
    let p = |rank, step| StagedPart {
        rank,
        step,
        dir: "/x".into(),
    };
    assert!(check_parts(1, 2, &[p(0, 1), p(1, 1)]).is_ok());
    for (world, parts, want) in [
        (2, vec![], "no staged parts"),
        (0, vec![p(0, 1)], "world size is 0"),
        (2, vec![p(2, 1)], "outside a world of 2"),
        (2, vec![p(0, 1), p(0, 1)], "staged twice"),
        (2, vec![p(0, 2)], "of step 2"),
        (1, vec![p(0, 1), p(1, 1)], "2 parts for a world of 1"),
    ] {
        let e = check_parts(1, world, &parts).unwrap_err().to_string();
        assert!(e.contains(want), "{e} lacks {want}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_race_and_exactly_one_commits_on_a_shared_memory_store() {
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("staging/step-7");
    for r in 0..4 {
        let state = serde_json::json!({"state": {"extra": {"pos": 7}}});
        stage(&staging, 7, r, 4, state);
    }
    let store = Store::open("memory://").unwrap();
    let opts = SinkOptions {
        commit_wait_ms: 30_000,
        ..fast()
    };
    let a = StoreSink::with_store(store.clone(), tmp.path().join("ra"), opts.clone());
    let b = StoreSink::with_store(store.clone(), tmp.path().join("rb"), opts);
    let req = |ranks: Range<u32>, node: &str| StepToCommit {
        step: 7,
        generation: 2,
        world_size: 4,
        parts: ranks.map(|r| part(&staging, r, 7)).collect(),
        agent_metadata: serde_json::json!({"node": node}),
    };
    let c = CancellationToken::new();
    let (ra, rb) = tokio::join!(a.commit(req(0..2, "a"), &c), b.commit(req(2..4, "b"), &c));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra.by_this_node ^ rb.by_this_node, "{ra:?} {rb:?}");
    assert!(ra.bytes > 0 && rb.bytes > 0);
    let m = store.read_manifest(7, &c).await.unwrap();
    assert_eq!(m.metadata["state"]["extra"]["pos"], 7);
    let node = if ra.by_this_node { "a" } else { "b" };
    assert_eq!(m.metadata["elastic"]["node"], node);
    assert_eq!(m.parts.len(), 4);
    assert_eq!(a.latest_step(&c).await.unwrap(), Some(7));
    // A late commit of the same step uploads nothing.
    let late = a.commit(req(0..2, "a"), &c).await.unwrap();
    assert_eq!((late.bytes, late.by_this_node), (0, false));

    // Dense: one read from the store, links for the rest, each with its own metadata.
    let p = a.restore(7, 0..3, 3, &c).await.unwrap();
    assert!(p.bytes_from_store > 0, "{p:?}");
    assert_eq!(p.dir, tmp.path().join("ra/step-7"));
    let md = |r: u32| -> serde_json::Value {
        let path = p.dir.join(format!("rank-{r}/{RESTORE_METADATA_FILE}"));
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    };
    for r in 0..3 {
        let m = md(r);
        assert_eq!(
            (m["rank"].as_u64(), m["world_size"].as_u64()),
            (Some(r.into()), Some(3))
        );
        assert_eq!(m["metadata"]["state"]["extra"]["pos"], 7);
    }
    // An empty store and the same restore root: only local bytes can serve these.
    let empty = StoreSink::with_store(
        Store::open("memory://").unwrap(),
        tmp.path().join("ra"),
        fast(),
    );
    let local = ResumePoint {
        bytes_from_store: 0,
        ..p.clone()
    };
    assert_eq!(empty.restore(7, 1..2, 2, &c).await.unwrap(), local);
    assert_eq!(md(1)["world_size"], 2);
    assert_eq!(empty.restore(7, 0..4, 4, &c).await.unwrap(), local);
    assert_eq!(
        (md(3)["rank"].as_u64(), md(3)["world_size"].as_u64()),
        (Some(3), Some(4))
    );
    let e = empty.restore(8, 0..1, 1, &c).await.unwrap_err();
    assert!(matches!(e, SinkError::Restore { step: 8, .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restored_and_linked_weights_are_private_to_this_user() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("s/step-4");
    stage(&staging, 4, 0, 1, serde_json::json!({}));
    let sink = StoreSink::with_store(
        Store::open("memory://").unwrap(),
        tmp.path().join("r"),
        fast(),
    );
    let c = CancellationToken::new();
    let s = StepToCommit {
        step: 4,
        generation: 1,
        world_size: 1,
        parts: vec![part(&staging, 0, 4)],
        agent_metadata: serde_json::json!({}),
    };
    sink.commit(s, &c).await.unwrap();
    // A restore root laid out before restores were private is made private too.
    std::fs::create_dir(tmp.path().join("r")).unwrap();
    std::fs::set_permissions(tmp.path().join("r"), std::fs::Permissions::from_mode(0o755)).unwrap();
    // Dense: rank 0 from the store, rank 1 linked to it, each with rewritten metadata.
    let p = sink.restore(4, 0..2, 2, &c).await.unwrap();
    assert!(p.dir.join("rank-1").join(RESTORE_FILE).is_file());
    let mut seen = (0, 0);
    let mut todo = vec![tmp.path().join("r")];
    while let Some(d) = todo.pop() {
        let m = std::fs::symlink_metadata(&d).unwrap();
        let mode = m.permissions().mode() & 0o7777;
        if m.is_dir() {
            assert_eq!(mode, 0o700, "{}", d.display());
            seen.0 += 1;
            todo.extend(std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()));
        } else {
            assert_eq!(mode, 0o600, "{}", d.display());
            seen.1 += 1;
        }
    }
    // r, step-4, rank-0, rank-1; the marker and both ranks' tensors and metadata.
    assert!(seen.0 >= 4 && seen.1 >= 5, "{seen:?}");
}

#[tokio::test]
async fn a_lone_node_times_out_naming_the_missing_writers() {
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("s");
    stage(&staging, 3, 0, 2, serde_json::json!({}));
    let store = Store::open("memory://").unwrap();
    let sink = StoreSink::with_store(store, tmp.path().join("r"), fast());
    let s = StepToCommit {
        step: 3,
        generation: 5,
        world_size: 2,
        parts: vec![part(&staging, 0, 3)],
        agent_metadata: serde_json::json!({}),
    };
    let t = Instant::now();
    let e = sink
        .commit(s.clone(), &CancellationToken::new())
        .await
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SinkError::Incomplete { step: 3, .. }), "{msg}");
    assert!(
        msg.contains("g5-rank-1") && !msg.contains("g5-rank-0"),
        "{msg}"
    );
    assert!(t.elapsed() >= Duration::from_millis(300), "gave up early");

    let c = CancellationToken::new();
    let opts = SinkOptions {
        commit_wait_ms: 3_600_000,
        ..fast()
    };
    let slow = StoreSink::with_store(
        Store::open("memory://").unwrap(),
        tmp.path().join("r2"),
        opts,
    );
    let c2 = c.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        c2.cancel();
    });
    let e = slow.commit(s.clone(), &c).await.unwrap_err();
    assert!(e.is_cancelled(), "{e}");
    assert!(slow.commit(s, &c).await.unwrap_err().is_cancelled());
    assert!(slow.latest_step(&c).await.unwrap_err().is_cancelled());
    assert!(
        slow.restore(3, 0..1, 1, &c)
            .await
            .unwrap_err()
            .is_cancelled()
    );
}

/// Retention after each commit: the newest `keep_steps`, every multiple of `keep_every`,
/// and always the step just committed, even when it is older than the newest.
#[tokio::test]
async fn retention_keeps_keep_steps_milestones_and_the_step_just_committed() {
    async fn commit_step(sink: &StoreSink, root: &Path, step: u64) -> Committed {
        let staging = root.join(format!("staging/step-{step}"));
        stage(&staging, step, 0, 1, serde_json::json!({}));
        let s = StepToCommit {
            step,
            generation: 1,
            world_size: 1,
            parts: vec![part(&staging, 0, step)],
            agent_metadata: serde_json::json!({}),
        };
        sink.commit(s, &CancellationToken::new()).await.unwrap()
    }
    let tmp = tempfile::tempdir().unwrap();
    let c = CancellationToken::new();
    let commit = |sink, step| commit_step(sink, tmp.path(), step);
    let store = Store::open("memory://").unwrap();
    let opts = SinkOptions {
        keep_steps: 2,
        keep_every: Some(4),
        ..fast()
    };
    let sink = StoreSink::with_store(store.clone(), tmp.path().join("r"), opts);
    for step in 1..=6 {
        assert!(commit(&sink, step).await.by_this_node);
    }
    assert_eq!(store.committed_steps(&c).await.unwrap(), [4, 5, 6]);

    let store = Store::open("memory://").unwrap();
    let opts = SinkOptions {
        keep_steps: 1,
        ..fast()
    };
    let sink = StoreSink::with_store(store.clone(), tmp.path().join("r2"), opts);
    commit(&sink, 10).await;
    // Older than the newest (as after a restore fell back past step 10): still kept.
    commit(&sink, 5).await;
    assert_eq!(store.committed_steps(&c).await.unwrap(), [5, 10]);
    commit(&sink, 6).await;
    assert_eq!(store.committed_steps(&c).await.unwrap(), [6, 10]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_without_copies_is_reused_only_while_its_chunks_hold_and_the_flag_is_on() {
    let tmp = tempfile::tempdir().unwrap();
    let staging = tmp.path().join("s/step-4");
    stage(&staging, 4, 0, 1, serde_json::json!({}));
    let url = format!("file://{}", tmp.path().join("store").display());
    let root = tmp.path().join("r");
    let no_copy = |on: bool| {
        let mut o = fast();
        o.read.no_copy = on;
        StoreSink::open(&url, root.clone(), o).unwrap()
    };
    let c = CancellationToken::new();
    let sink = no_copy(true);
    sink.commit(
        StepToCommit {
            step: 4,
            generation: 1,
            world_size: 1,
            parts: vec![part(&staging, 0, 4)],
            agent_metadata: serde_json::json!({}),
        },
        &c,
    )
    .await
    .unwrap();
    let files = |p: &ResumePoint, r: u32| {
        let d = p.dir.join(format!("rank-{r}"));
        (
            d.join(RESTORED_SOURCES).is_file(),
            d.join(RESTORE_FILE).is_file(),
        )
    };
    // Dense: rank 0 checked where it lies, rank 1 linked to its sources.
    let p = sink.restore(4, 0..2, 2, &c).await.unwrap();
    assert_eq!((files(&p, 0), files(&p, 1)), ((true, false), (true, false)));
    assert!(p.bytes_from_store > 0);
    // Kept as it is while its chunks are as checked: nothing read again.
    let again = sink.restore(4, 0..2, 2, &c).await.unwrap();
    assert_eq!(again.bytes_from_store, 0);
    // A chunk rewritten in place (its change time moves): checked again.
    let doc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(p.dir.join("rank-0").join(RESTORED_SOURCES)).unwrap(),
    )
    .unwrap();
    let chunk = doc["sources"][0]["path"].as_str().unwrap().to_string();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&chunk, std::fs::read(&chunk).unwrap()).unwrap();
    let after = sink.restore(4, 0..2, 2, &c).await.unwrap();
    assert!(after.bytes_from_store > 0);
    assert_eq!(files(&after, 0), (true, false));
    // Without the flag, a kept restore without copies is not reused: the file is written.
    let p = no_copy(false).restore(4, 0..2, 2, &c).await.unwrap();
    assert!(p.bytes_from_store > 0);
    assert_eq!((files(&p, 0), files(&p, 1)), ((false, true), (false, true)));
}
