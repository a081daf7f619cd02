//! Shared helpers and the conformance suite: plain async functions, each run against every
//! backend (memory, file, S3 via moto, Azure via Azurite).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use bytes::Bytes;
use checkpoint::format::ShardSpec;
use checkpoint::restore::{RESTORE_FILE, rows_for_rank};
use checkpoint::{
    CancellationToken, CommitOutcome, CommitRequest, PartInput, PartSource, ReadOptions,
    RetentionPolicy, SaveOptions, Store,
};
use rand::{RngExt, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

pub fn cancel() -> CancellationToken {
    CancellationToken::new()
}

/// Small chunks, so even test-sized tensors span several chunks.
pub fn small_chunks() -> SaveOptions {
    SaveOptions {
        chunk_bytes_max: 4096,
        concurrency: 3,
        ..Default::default()
    }
}

fn dtype(name: &str) -> Dtype {
    match name {
        "F32" => Dtype::F32,
        "BF16" => Dtype::BF16,
        "F16" => Dtype::F16,
        "F64" => Dtype::F64,
        "I64" => Dtype::I64,
        "U8" => Dtype::U8,
        other => panic!("test dtype {other}"),
    }
}

/// A tensor for tests: name, dtype, shape, bytes.
#[derive(Clone, Debug)]
pub struct T {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

pub fn elem(dtype: &str) -> usize {
    checkpoint::header::dtype_size_bytes(dtype).unwrap() as usize
}

/// Weight-like random bytes (small floats, so planes compress).
pub fn tensor(name: &str, dt: &'static str, shape: &[usize], seed: u64) -> T {
    let n: usize = shape.iter().product();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut data = Vec::with_capacity(n * elem(dt));
    for _ in 0..n {
        let x: f32 = (rng.random::<f32>() - 0.5) * 0.04;
        match dt {
            "F32" => data.extend_from_slice(&x.to_le_bytes()),
            "BF16" | "F16" => data.extend_from_slice(&x.to_bits().to_le_bytes()[2..]),
            "F64" => data.extend_from_slice(&f64::from(x).to_le_bytes()),
            "I64" => data.extend_from_slice(&rng.random::<i64>().to_le_bytes()),
            _ => data.push(rng.random()),
        }
    }
    T {
        name: name.into(),
        dtype: dt,
        shape: shape.to_vec(),
        data,
    }
}

/// A safetensors file, serialized by the safetensors crate itself.
pub fn st_bytes(tensors: &[T], metadata: Option<BTreeMap<String, String>>) -> Vec<u8> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(dtype(t.dtype), t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    let md = metadata.map(|m| m.into_iter().collect());
    safetensors::tensor::serialize(views, md).unwrap()
}

/// Rows `[lo, hi)` of a tensor's bytes along dim 0.
pub fn rows(t: &T, lo: usize, hi: usize) -> Vec<u8> {
    let row: usize = t.shape[1..].iter().product::<usize>() * elem(t.dtype);
    t.data[lo * row..hi * row].to_vec()
}

pub fn two_files() -> Vec<(String, Bytes)> {
    let a = st_bytes(
        &[
            tensor("layer.0.weight", "F32", &[64, 33], 1),
            tensor("layer.0.bias", "BF16", &[7], 2),
            tensor("embed", "BF16", &[100, 16], 3),
        ],
        Some(BTreeMap::from([("format".to_string(), "pt".to_string())])),
    );
    let b = st_bytes(
        &[
            tensor("opt.step", "I64", &[], 4),
            tensor("opt.m", "F64", &[9, 3], 5),
        ],
        None,
    );
    vec![
        ("model.safetensors".into(), a.into()),
        ("optim/state.safetensors".into(), b.into()),
    ]
}

pub async fn save_buffers(store: &Store, step: u64, writer: &str, files: Vec<(String, Bytes)>) {
    let input = PartInput {
        writer: writer.into(),
        source: PartSource::Buffers(files),
        shards: BTreeMap::new(),
    };
    store
        .save_part(step, input, &small_chunks(), &cancel())
        .await
        .unwrap();
}

pub async fn commit(store: &Store, step: u64, writers: &[&str], world: u32) -> CommitOutcome {
    let req = CommitRequest {
        world_size: world,
        writers: writers.iter().map(|w| w.to_string()).collect(),
        metadata: serde_json::json!({"lr_scale": 1.5, "loader": {"epoch": 2, "index": step}}),
    };
    store.commit(step, req, &cancel()).await.unwrap()
}

/// Pushes the two-file set as `step` with one writer.
pub async fn push_files(store: &Store, step: u64) -> Vec<(String, Bytes)> {
    let files = two_files();
    save_buffers(store, step, "push", files.clone()).await;
    assert!(matches!(
        commit(store, step, &["push"], 1).await,
        CommitOutcome::Committed(_)
    ));
    files
}

pub fn assert_dir_has(dir: &Path, files: &[(String, Bytes)]) {
    for (name, bytes) in files {
        let got = std::fs::read(dir.join(name)).unwrap();
        assert!(got == bytes.as_ref(), "{name} differs after pull");
    }
}

// ---------------------------------------------------------------------------------------
// The suite.

pub async fn pull_is_byte_identical_to_push(store: &Store) {
    let files = push_files(store, 10).await;
    let dir = tempfile::tempdir().unwrap();
    store
        .pull(10, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_dir_has(dir.path(), &files);
    let report = store
        .verify(10, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert!(report.bad.is_empty(), "{:?}", report.bad);
    assert!(
        report.objects_checked > 2,
        "small chunks give several objects"
    );
    let latest = store.latest_committed(&cancel()).await.unwrap().unwrap();
    assert_eq!(latest.step, 10);
    assert_eq!(latest.metadata["loader"]["epoch"], 2);
}

/// The global state the resharding tests save: three sharded tensors and three replicated
/// ones. `head` has 2 rows, so that the last ranks of a world of 4 or 8 hold none of it (as
/// FSDP2's do): empty shards are saved and restored as `[0, 3]` tensors.
pub fn global_state() -> (Vec<T>, Vec<T>) {
    let sharded = vec![
        tensor("w", "F32", &[37, 5], 11),
        tensor("emb", "BF16", &[64, 8], 12),
        tensor("head", "F32", &[2, 3], 16),
    ];
    let replicated = vec![
        tensor("bias", "F32", &[5], 13),
        tensor("step", "I64", &[], 14),
        tensor("norm", "F16", &[300], 15),
    ];
    (sharded, replicated)
}

/// Saves the global state from `world` writers as FSDP would; see [`save_rows`].
pub async fn save_sharded(store: &Store, step: u64, world: u32) {
    let (sharded, replicated) = global_state();
    save_rows(store, step, world, &sharded, &replicated, &small_chunks()).await;
}

/// Saves `sharded` and `replicated` from `world` writers as FSDP would, and commits the step:
/// each writer holds its rows of the sharded tensors, and the replicated tensors are split
/// between writers (round robin: any split that writes each once will do; the workers split
/// by bytes).
pub async fn save_rows(
    store: &Store,
    step: u64,
    world: u32,
    sharded: &[T],
    replicated: &[T],
    opts: &SaveOptions,
) {
    for rank in 0..world {
        let mut mine = Vec::new();
        let mut shards = BTreeMap::new();
        for t in sharded {
            let (lo, hi) = rows_for_rank(t.shape[0] as u64, rank, world);
            let mut shape = t.shape.clone();
            shape[0] = (hi - lo) as usize;
            mine.push(T {
                name: t.name.clone(),
                dtype: t.dtype,
                shape,
                data: rows(t, lo as usize, hi as usize),
            });
            shards.insert(
                t.name.clone(),
                ShardSpec {
                    global_shape: t.shape.iter().map(|d| *d as u64).collect(),
                    dim0_offset: lo,
                },
            );
        }
        for (i, t) in replicated.iter().enumerate() {
            if i as u32 % world == rank {
                mine.push(t.clone());
            }
        }
        let input = PartInput {
            writer: format!("rank-{rank}"),
            source: PartSource::Buffers(vec![(
                format!("rank-{rank}.safetensors"),
                st_bytes(&mine, None).into(),
            )]),
            shards,
        };
        store.save_part(step, input, opts, &cancel()).await.unwrap();
    }
    let writers: Vec<String> = (0..world).map(|r| format!("rank-{r}")).collect();
    let writers: Vec<&str> = writers.iter().map(String::as_str).collect();
    commit(store, step, &writers, world).await;
}

pub async fn restore_reshards_from_4_to_2_3_and_8(store: &Store) {
    save_sharded(store, 20, 4).await;
    let (sharded, replicated) = global_state();
    for world in [2u32, 3, 8, 4, 1] {
        let mut rebuilt: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for rank in 0..world {
            let dir = tempfile::tempdir().unwrap();
            let r = store
                .restore(
                    None,
                    rank,
                    world,
                    dir.path(),
                    &ReadOptions::default(),
                    &cancel(),
                )
                .await
                .unwrap();
            assert_eq!((r.step, r.rank, r.world_size), (20, rank, world));
            let bytes = std::fs::read(dir.path().join(RESTORE_FILE)).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for t in &replicated {
                let v = st.tensor(&t.name).unwrap();
                assert_eq!(
                    v.data(),
                    &t.data[..],
                    "replicated {} on rank {rank}",
                    t.name
                );
                assert_eq!(v.shape(), &t.shape[..]);
            }
            for t in &sharded {
                let v = st.tensor(&t.name).unwrap();
                let (lo, hi) = rows_for_rank(t.shape[0] as u64, rank, world);
                assert_eq!(v.shape()[0], (hi - lo) as usize);
                assert_eq!(v.data(), &rows(t, lo as usize, hi as usize)[..]);
                rebuilt
                    .entry(t.name.clone())
                    .or_default()
                    .extend_from_slice(v.data());
            }
            let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
            let md = md.metadata().clone().unwrap();
            assert!(md["elastic.shards"].contains("\"w\""));
            let meta: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.path().join("metadata.json")).unwrap())
                    .unwrap();
            assert_eq!(meta["metadata"]["lr_scale"], 1.5);
            assert_eq!(meta["saved_world_size"], 4);
        }
        for t in &sharded {
            assert_eq!(
                rebuilt[&t.name], t.data,
                "{} rebuilt from W={world}",
                t.name
            );
        }
    }
}

pub async fn of_two_concurrent_committers_exactly_one_wins(store: &Store) {
    save_buffers(store, 30, "rank-0", two_files()[..1].to_vec()).await;
    save_buffers(store, 30, "rank-1", two_files()[1..].to_vec()).await;
    let (a, b) = tokio::join!(
        commit(store, 30, &["rank-0", "rank-1"], 2),
        commit(store, 30, &["rank-0", "rank-1"], 2)
    );
    let won = [&a, &b]
        .iter()
        .filter(|o| matches!(o, CommitOutcome::Committed(_)))
        .count();
    assert_eq!(won, 1, "exactly one committer writes the manifest");
    let stored = store.read_manifest(30, &cancel()).await.unwrap();
    let winner = if matches!(a, CommitOutcome::Committed(_)) {
        &a
    } else {
        &b
    };
    assert_eq!(&stored, winner.manifest());
    assert_eq!(stored.parts.len(), 2);
    // A late committer sees the step as already committed.
    assert!(matches!(
        commit(store, 30, &["rank-0", "rank-1"], 2).await,
        CommitOutcome::AlreadyCommitted(_)
    ));
}

pub async fn commit_refuses_while_a_writer_is_missing(store: &Store) {
    save_buffers(store, 35, "rank-0", two_files()).await;
    let req = CommitRequest {
        world_size: 2,
        writers: vec!["rank-0".into(), "rank-1".into()],
        metadata: serde_json::Value::Null,
    };
    let err = store.commit(35, req, &cancel()).await.unwrap_err();
    assert!(err.to_string().contains("rank-1"), "{err}");
    assert!(
        store
            .committed_steps(&cancel())
            .await
            .unwrap()
            .iter()
            .all(|s| *s != 35),
        "no manifest without every part"
    );
}

pub async fn retention_keeps_last_k_and_every_nth_and_removes_leftovers(store: &Store) {
    for step in 1..=6 {
        save_buffers(store, step, "push", two_files()[1..].to_vec()).await;
        commit(store, step, &["push"], 1).await;
    }
    // A crashed save: data and part record but no manifest.
    save_buffers(store, 7, "push", two_files()[1..].to_vec()).await;
    // A dead attempt inside a committed step.
    save_buffers(store, 6, "push", two_files()[1..].to_vec()).await;
    let policy = RetentionPolicy {
        keep_last: 2,
        keep_every: Some(3),
        leftover_age_ms_min: 0,
        check: checkpoint::retention::GcCheck::Full,
        pinned: None,
    };
    let before = store.list_steps(&cancel()).await.unwrap();
    assert_eq!(before.len(), 7);
    store.gc(&policy, false, &cancel()).await.unwrap();
    assert_eq!(
        store.committed_steps(&cancel()).await.unwrap(),
        vec![3, 5, 6]
    );
    assert_eq!(store.steps(&cancel()).await.unwrap(), vec![3, 5, 6]);
    for step in [3, 5, 6] {
        let r = store
            .verify(step, &ReadOptions::default(), &cancel())
            .await
            .unwrap();
        assert!(r.bad.is_empty());
    }
    // Nothing but the committed attempt is left in step 6.
    let m = store.read_manifest(6, &cancel()).await.unwrap();
    let again = store.gc(&policy, false, &cancel()).await.unwrap();
    assert_eq!(again.objects_deleted, 0);
    assert_eq!(m.parts.len(), 1);
    // A recent leftover is kept (it may be a save in progress).
    save_buffers(store, 9, "push", two_files()[1..].to_vec()).await;
    let policy = RetentionPolicy {
        leftover_age_ms_min: 3_600_000,
        ..policy
    };
    store.gc(&policy, false, &cancel()).await.unwrap();
    assert!(store.steps(&cancel()).await.unwrap().contains(&9));
}

pub async fn cp_copies_a_step_that_pulls_byte_identical(src: &Store, dst: &Store) {
    let files = push_files(src, 40).await;
    src.copy_step(dst, 40, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    // Copying again is a no-op, not an error.
    src.copy_step(dst, 40, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    dst.pull(40, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_dir_has(dir.path(), &files);
    assert!(
        dst.verify(40, &ReadOptions::default(), &cancel())
            .await
            .unwrap()
            .bad
            .is_empty()
    );
}

/// `big.safetensors` holding one U8 tensor of `len` seeded random bytes: incompressible, so
/// its stored chunk is as large as its data.
pub fn incompressible_file(len: usize, seed: u64) -> Vec<(String, Bytes)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
    let t = T {
        name: "blob".into(),
        dtype: "U8",
        shape: vec![data.len()],
        data,
    };
    vec![(
        "big.safetensors".to_string(),
        Bytes::from(st_bytes(&[t], None)),
    )]
}

/// Row-sharded state in raw chunks of 1 MiB, re-cut from 2 ranks to 3: each rank reads only
/// the checked blocks of the chunks that hold its rows (ranged GETs pinned to the version
/// first read, on a remote store), and gets its rows bitwise.
pub async fn restore_reads_only_the_blocks_of_its_rows(store: &Store) {
    use checkpoint::format::CHECK_BLOCK_BYTES;

    let w = tensor("w", "F32", &[600, 1000], 21);
    let opts = SaveOptions {
        chunk_bytes_max: 1024 * 1024,
        compress: false,
        ..Default::default()
    };
    save_rows(store, 30, 2, std::slice::from_ref(&w), &[], &opts).await;
    for rank in 0..3 {
        let before = store.read_stats().bytes;
        let dir = tempfile::tempdir().unwrap();
        store
            .restore(
                Some(30),
                rank,
                3,
                dir.path(),
                &ReadOptions::default(),
                &cancel(),
            )
            .await
            .unwrap();
        let read = store.read_stats().bytes - before;
        let bytes = std::fs::read(dir.path().join(RESTORE_FILE)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (lo, hi) = rows_for_rank(600, rank, 3);
        assert_eq!(
            st.tensor("w").unwrap().data(),
            &rows(&w, lo as usize, hi as usize)[..],
            "rows [{lo}, {hi}) of rank {rank} of 3"
        );
        let needed = (hi - lo) * 4000;
        assert!(
            read <= needed + 4 * CHECK_BLOCK_BYTES + 64 * 1024,
            "rank {rank} read {read} bytes for {needed} needed"
        );
    }
}

pub async fn large_chunks_use_multipart_and_ranged_reads(store: &Store) {
    // The stored object stays over the 8 MiB ranged-read size.
    let files = incompressible_file(9 * 1024 * 1024 + 3, 99);
    let store = store.clone().with_options(checkpoint::StoreOptions {
        multipart_threshold_bytes: 1024 * 1024,
        multipart_part_bytes: 5 * 1024 * 1024,
        ..Default::default()
    });
    let input = PartInput {
        writer: "big".into(),
        source: PartSource::Buffers(files.clone()),
        shards: BTreeMap::new(),
    };
    let opts = SaveOptions {
        chunk_bytes_max: 16 * 1024 * 1024,
        ..Default::default()
    };
    let part = store.save_part(50, input, &opts, &cancel()).await.unwrap();
    assert_eq!(part.objects.len(), 1);
    assert!(part.objects[0].stored_bytes > 9 * 1024 * 1024);
    commit(&store, 50, &["big"], 1).await;
    let dir = tempfile::tempdir().unwrap();
    store
        .pull(50, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_dir_has(dir.path(), &files);
}

/// The manifest metadata the agent writes for a state whose entries map names to tensors:
/// `entries` is `[(entry, [(name, tensor)])]`.
pub fn state_metadata(entries: &[(&str, Vec<(&str, &str)>)]) -> serde_json::Value {
    let entries: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|(entry, names)| {
            let value: serde_json::Map<String, serde_json::Value> = names
                .iter()
                .map(|(n, t)| (n.to_string(), serde_json::json!({"$t": t})))
                .collect();
            (
                entry.to_string(),
                serde_json::json!({"stateful": true, "value": value}),
            )
        })
        .collect();
    serde_json::json!({
        "elastic": {"node": 0},
        "state": {"format": "elastic_run.state/1", "entries": entries},
    })
}

/// Saves `w` (sharded along dim 0 at `cuts`) and `b` from one writer per shard, each part a
/// safetensors file declaring its shard in `__metadata__["elastic.shards"]`, and commits it as
/// `step` with the state skeleton naming them `w` and `b` of the entry `model`.
pub async fn save_sharded_state(store: &Store, step: u64, w: &T, b: &T, cuts: &[usize]) {
    let writers = cuts.len() - 1;
    for r in 0..writers {
        let (lo, hi) = (cuts[r], cuts[r + 1]);
        let mut shape = w.shape.clone();
        shape[0] = hi - lo;
        let mut mine = vec![T {
            name: "state/model/w".into(),
            dtype: w.dtype,
            shape,
            data: rows(w, lo, hi),
        }];
        if r == 1 {
            mine.push(T {
                name: "state/model/b".into(),
                ..b.clone()
            });
        }
        let spec = ShardSpec {
            global_shape: w.shape.iter().map(|d| *d as u64).collect(),
            dim0_offset: lo as u64,
        };
        let md = BTreeMap::from([(
            "elastic.shards".to_string(),
            serde_json::json!({"state/model/w": spec}).to_string(),
        )]);
        let input = PartInput {
            writer: format!("rank-{r}"),
            source: PartSource::Buffers(vec![(
                format!("rank-{r}/tensors.safetensors"),
                st_bytes(&mine, Some(md)).into(),
            )]),
            shards: BTreeMap::new(),
        };
        store
            .save_part(step, input, &small_chunks(), &cancel())
            .await
            .unwrap();
    }
    let req = CommitRequest {
        world_size: writers as u32,
        writers: (0..writers).map(|r| format!("rank-{r}")).collect(),
        metadata: state_metadata(&[(
            "model",
            vec![("w", "state/model/w"), ("b", "state/model/b")],
        )]),
    };
    store.commit(step, req, &cancel()).await.unwrap();
}

pub async fn export_writes_a_sharded_tensor_whole_in_hugging_face_shards(store: &Store) {
    let w = tensor("w", "F32", &[37, 50], 1);
    let b = tensor("b", "BF16", &[50], 2);
    save_sharded_state(store, 3, &w, &b, &[0, 11, 12, 37]).await;
    let m = store.read_manifest(3, &cancel()).await.unwrap();
    assert!(m.tensors.iter().any(|t| t.sharded && t.shards.len() == 3));
    assert!(m.objects.len() > 2, "small chunks: the shards span chunks");

    // Whole, in one file.
    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("hf");
    let report = store
        .export(
            None,
            "model",
            &dest,
            checkpoint::export::SHARD_BYTES_MAX_DEFAULT,
            &ReadOptions::default(),
            &cancel(),
        )
        .await
        .unwrap();
    assert_eq!((report.step, report.tensors), (3, 2));
    assert_eq!(report.bytes, (w.data.len() + b.data.len()) as u64);
    let bytes = std::fs::read(dest.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let got = st.tensor("w").unwrap();
    assert_eq!(got.shape(), &[37, 50]);
    assert!(got.data() == &w.data[..], "w assembled whole in row order");
    assert!(st.tensor("b").unwrap().data() == &b.data[..]);
    let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
    let md = md.metadata().clone().unwrap();
    assert_eq!(md["format"], "pt");
    assert_eq!(md["elastic.step"], "3");
    assert!(!md.contains_key("elastic.shards"), "the export is whole");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dest.join("model.safetensors")), 0o600);
    assert_eq!(mode(&dest), 0o700);

    // With the shard size at w's bytes, b (first by name) fills one file and w needs another.
    let dest = out.path().join("hf-shards");
    let report = store
        .export(
            Some(3),
            "model",
            &dest,
            w.data.len() as u64,
            &ReadOptions::default(),
            &cancel(),
        )
        .await
        .unwrap();
    assert_eq!(
        report.index.as_deref(),
        Some("model.safetensors.index.json")
    );
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dest.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(
        index,
        serde_json::json!({
            "metadata": {"total_size": w.data.len() + b.data.len()},
            "weight_map": {
                "b": "model-00001-of-00002.safetensors",
                "w": "model-00002-of-00002.safetensors",
            },
        })
    );
    let bytes = std::fs::read(dest.join("model-00002-of-00002.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names(), ["w"]);
    assert!(st.tensor("w").unwrap().data() == &w.data[..]);
}

/// Runs every case, each on a fresh store from `make(case_name)`.
pub async fn run_suite(make: impl Fn(&str) -> Store, other: impl Fn(&str) -> Store) {
    pull_is_byte_identical_to_push(&make("pull")).await;
    restore_reshards_from_4_to_2_3_and_8(&make("reshard")).await;
    restore_reads_only_the_blocks_of_its_rows(&make("reshard-blocks")).await;
    of_two_concurrent_committers_exactly_one_wins(&make("race")).await;
    commit_refuses_while_a_writer_is_missing(&make("missing")).await;
    retention_keeps_last_k_and_every_nth_and_removes_leftovers(&make("gc")).await;
    large_chunks_use_multipart_and_ranged_reads(&make("big")).await;
    export_writes_a_sharded_tensor_whole_in_hugging_face_shards(&make("export")).await;
    cp_copies_a_step_that_pulls_byte_identical(&make("cp-src"), &other("cp-dst")).await;
    cp_copies_a_step_that_pulls_byte_identical(&other("cp-src2"), &make("cp-dst2")).await;
}
