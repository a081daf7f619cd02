//! Bad input: every case gets a clear error naming the thing, and nothing committed is lost.

use std::sync::Arc;

use bytes::Bytes;
use checkpoint::{Error, PartInput, PartSource, ReadOptions, Store};
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutPayload};
use serde_json::Value;

use crate::common::{self, cancel};

const PREFIX: &str = "ck";

/// A store over a memory backend the test can tamper with, holding committed steps 1 and 2.
async fn two_steps() -> (Arc<InMemory>, Store) {
    let mem = Arc::new(InMemory::new());
    let store = Store::from_object_store(mem.clone(), PREFIX, "memory://ck");
    common::push_files(&store, 1).await;
    common::push_files(&store, 2).await;
    (mem, store)
}

fn p(key: &str) -> ObjPath {
    ObjPath::from(format!("{PREFIX}/{key}"))
}

async fn get_raw(mem: &InMemory, key: &str) -> Vec<u8> {
    mem.get(&p(key))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec()
}

async fn put_raw(mem: &InMemory, key: &str, data: Vec<u8>) {
    mem.put(&p(key), PutPayload::from(data)).await.unwrap();
}

async fn first_object_key(store: &Store, step: u64) -> String {
    store.read_manifest(step, &cancel()).await.unwrap().objects[0]
        .key
        .clone()
}

/// Restoring "the newest" lands on step 1, and says step 2 was skipped.
async fn assert_restore_falls_back_to_step_1(store: &Store) {
    let dir = tempfile::tempdir().unwrap();
    let r = store
        .restore(None, 0, 1, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(r.step, 1);
    assert_eq!(r.skipped_steps, vec![2]);
    let latest = store.latest_committed(&cancel()).await.unwrap().unwrap();
    assert!(latest.step <= 2);
    // Step 1 is intact.
    let v = store
        .verify(1, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert!(v.bad.is_empty());
}

#[tokio::test]
async fn restore_falls_back_when_newest_chunk_has_a_flipped_bit() {
    let (mem, store) = two_steps().await;
    let key = first_object_key(&store, 2).await;
    let mut data = get_raw(&mem, &key).await;
    let mid = data.len() / 2;
    data[mid] ^= 0x10;
    put_raw(&mem, &key, data).await;

    let report = store
        .verify(2, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(report.bad.len(), 1);
    assert_eq!(report.bad[0].0, key);
    assert!(report.bad[0].1.contains("crc32c"), "{}", report.bad[0].1);

    let dir = tempfile::tempdir().unwrap();
    let err = store
        .restore(
            Some(2),
            0,
            1,
            dir.path(),
            &ReadOptions::default(),
            &cancel(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Corrupt { key: k, step: 2, .. } if *k == key),
        "{err}"
    );
    let err = store
        .pull(2, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap_err();
    assert!(err.to_string().contains(&key), "{err}");
    assert!(
        files_under(dir.path()).is_empty(),
        "a failed pull leaves no partial files: {:?}",
        files_under(dir.path())
    );
    assert_restore_falls_back_to_step_1(&store).await;
}

#[tokio::test]
async fn truncated_object_is_reported_as_truncated() {
    let (mem, store) = two_steps().await;
    let key = first_object_key(&store, 2).await;
    let mut data = get_raw(&mem, &key).await;
    data.truncate(data.len() - 3);
    put_raw(&mem, &key, data).await;
    let report = store
        .verify(2, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(report.bad[0].0, key);
    assert!(report.bad[0].1.contains("truncated"), "{}", report.bad[0].1);
    assert_eq!(
        store
            .latest_committed(&cancel())
            .await
            .unwrap()
            .unwrap()
            .step,
        1
    );
    assert_restore_falls_back_to_step_1(&store).await;
}

#[tokio::test]
async fn missing_object_is_named_and_latest_falls_back() {
    let (mem, store) = two_steps().await;
    let key = first_object_key(&store, 2).await;
    mem.delete(&p(&key)).await.unwrap();
    let report = store
        .verify(2, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(report.bad.len(), 1);
    assert_eq!(report.bad[0].0, key);
    assert_eq!(
        store
            .latest_committed(&cancel())
            .await
            .unwrap()
            .unwrap()
            .step,
        1
    );
    assert_restore_falls_back_to_step_1(&store).await;
}

#[tokio::test]
async fn garbled_manifest_is_rejected_naming_it_and_ls_shows_it() {
    let (mem, store) = two_steps().await;
    let key = "steps/00000000000000000002/manifest.json";
    let mut data = get_raw(&mem, key).await;
    data.truncate(data.len() / 2);
    put_raw(&mem, key, data).await;
    let err = store.read_manifest(2, &cancel()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidManifest { .. }), "{err}");
    assert!(err.to_string().contains(key), "{err}");
    let steps = store.list_steps(&cancel()).await.unwrap();
    assert!(steps[1].manifest_error.is_some());
    assert_restore_falls_back_to_step_1(&store).await;
}

/// Rewrites step 2's manifest through `edit` and checks it is rejected with `want` in the
/// message, and that restore falls back to step 1.
async fn forged(edit: impl FnOnce(&mut Value), want: &str) {
    let (mem, store) = two_steps().await;
    let key = "steps/00000000000000000002/manifest.json";
    let mut m: Value = serde_json::from_slice(&get_raw(&mem, key).await).unwrap();
    edit(&mut m);
    put_raw(&mem, key, serde_json::to_vec(&m).unwrap()).await;
    let err = store.read_manifest(2, &cancel()).await.unwrap_err();
    assert!(
        err.to_string().contains(want),
        "{err} should mention {want:?}"
    );
    assert_restore_falls_back_to_step_1(&store).await;
}

#[tokio::test]
async fn unknown_format_version_is_rejected() {
    forged(|m| m["format_version"] = 4.into(), "format version 4").await;
}

#[tokio::test]
async fn forged_object_length_is_rejected() {
    forged(
        |m| {
            let o = &mut m["objects"][0];
            o["raw_bytes"] = (o["raw_bytes"].as_u64().unwrap() + 1).into();
            o["stored_bytes"] = (o["stored_bytes"].as_u64().unwrap() + 1).into();
            o["codec"] = serde_json::json!({"name": "zstd"});
            o.as_object_mut().unwrap().remove("block_crc32c");
        },
        "files use",
    )
    .await;
}

#[tokio::test]
async fn forged_compressed_chunk_block_checksums_are_rejected() {
    // A compressed chunk of format 3 without its block checksums, and one with a checksum
    // too many.
    forged(
        |m| {
            let o = m["objects"][0].as_object_mut().unwrap();
            assert_eq!(o["codec"]["name"], "zstd-blocks");
            o.remove("block_crc32c");
        },
        "without block checksums",
    )
    .await;
    forged(
        |m| {
            let crcs = m["objects"][0]["block_crc32c"].as_array_mut().unwrap();
            crcs.push(7.into());
        },
        "block checksums for",
    )
    .await;
}

#[tokio::test]
async fn forged_segment_past_its_object_is_rejected() {
    forged(
        |m| m["files"][0]["segments"][0]["offset"] = 1.into(),
        "out of bounds",
    )
    .await;
}

#[tokio::test]
async fn forged_overlapping_segments_are_rejected() {
    forged(
        |m| {
            // Point a segment at an object another segment of the same length already uses.
            let lens: Vec<(usize, usize, u64)> = m["files"]
                .as_array()
                .unwrap()
                .iter()
                .enumerate()
                .flat_map(|(fi, f)| {
                    f["segments"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .enumerate()
                        .map(move |(si, s)| (fi, si, s["len"].as_u64().unwrap()))
                        .collect::<Vec<_>>()
                })
                .collect();
            let (a, b) = lens
                .iter()
                .enumerate()
                .find_map(|(i, x)| lens[i + 1..].iter().find(|y| y.2 == x.2).map(|y| (*x, *y)))
                .expect("two segments of equal length");
            let obj = m["files"][a.0]["segments"][a.1]["object"].clone();
            m["files"][b.0]["segments"][b.1]["object"] = obj;
        },
        "overlapping",
    )
    .await;
}

#[tokio::test]
async fn forged_shape_disagreeing_with_byte_count_is_rejected() {
    forged(
        |m| {
            let t = m["tensors"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .find(|t| t["name"] == "embed")
                .unwrap();
            t["shape"][0] = 101.into();
            t["shards"][0]["shape"][0] = 101.into();
        },
        "needs",
    )
    .await;
}

#[tokio::test]
async fn forged_path_traversing_names_are_rejected() {
    forged(
        |m| m["files"][0]["name"] = "../../etc/cron.d/x".into(),
        "'..'",
    )
    .await;
    forged(|m| m["files"][0]["name"] = "/etc/passwd".into(), "absolute").await;
    forged(|m| m["tensors"][0]["name"] = "../evil".into(), "'..'").await;
}

#[tokio::test]
async fn forged_oversize_header_is_rejected() {
    forged(
        |m| {
            let big = format!("{{{}", " ".repeat(65 * 1024 * 1024));
            m["files"][0]["header"] = big.into();
        },
        "over the limit",
    )
    .await;
}

#[tokio::test]
async fn forged_checksum_fails_verify_naming_the_object() {
    let (mem, store) = two_steps().await;
    let key = "steps/00000000000000000002/manifest.json";
    let mut m: Value = serde_json::from_slice(&get_raw(&mem, key).await).unwrap();
    let obj = m["objects"][1]["key"].as_str().unwrap().to_string();
    assert_ne!(
        m["objects"][1]["codec"]["name"], "raw",
        "a compressed chunk"
    );
    // First its stored checksum alone: `verify` checks every checksum and names the object,
    // while a restore checks what it decoded against the decoded and block checksums, which
    // hold, and reads step 2. Then its decoded checksum too: both fail.
    for (field, restores_step_2) in [("stored_crc32c", true), ("raw_crc32c", false)] {
        let crc = m["objects"][1][field].as_u64().unwrap();
        m["objects"][1][field] = (crc ^ 1).into();
        put_raw(&mem, key, serde_json::to_vec(&m).unwrap()).await;
        let report = store
            .verify(2, &ReadOptions::default(), &cancel())
            .await
            .unwrap();
        assert_eq!(report.bad.len(), 1, "{field}");
        assert_eq!(report.bad[0].0, obj, "{field}");
        if restores_step_2 {
            let dir = tempfile::tempdir().unwrap();
            let r = store
                .restore(None, 0, 1, dir.path(), &ReadOptions::default(), &cancel())
                .await
                .unwrap();
            assert_eq!((r.step, r.skipped_steps.len()), (2, 0), "{field}");
        } else {
            assert_restore_falls_back_to_step_1(&store).await;
        }
    }
}

fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

async fn save_one(name: &str, file: Vec<u8>) -> Error {
    let store = Store::open("memory://").unwrap();
    let input = PartInput {
        writer: "w".into(),
        source: PartSource::Buffers(vec![(name.into(), Bytes::from(file))]),
        shards: Default::default(),
    };
    let err = store
        .save_part(1, input, &common::small_chunks(), &cancel())
        .await
        .unwrap_err();
    assert!(
        store.steps(&cancel()).await.unwrap().is_empty(),
        "nothing written"
    );
    err
}

fn raw_file(header: &str, data_bytes: usize) -> Vec<u8> {
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.extend(std::iter::repeat_n(0u8, data_bytes));
    f
}

#[tokio::test]
async fn save_rejects_path_traversing_tensor_and_file_names() {
    let f = common::st_bytes(&[common::tensor("../evil", "F32", &[2], 1)], None);
    let err = save_one("ok.safetensors", f).await;
    assert!(
        matches!(err, Error::InvalidName { ref name, .. } if name == "../evil"),
        "{err}"
    );
    let f = common::st_bytes(&[common::tensor("w", "F32", &[2], 1)], None);
    for bad in ["../x.safetensors", "/abs.safetensors", "a/\0.safetensors"] {
        let err = save_one(bad, f.clone()).await;
        assert!(matches!(err, Error::InvalidName { .. }), "{bad:?}: {err}");
    }
}

#[tokio::test]
async fn save_rejects_header_over_its_limit() {
    let mut f = (100u64 * 1024 * 1024).to_le_bytes().to_vec();
    f.extend_from_slice(b"{}");
    let err = save_one("big.safetensors", f).await;
    assert!(err.to_string().contains("over the limit"), "{err}");
    assert!(err.to_string().contains("big.safetensors"), "{err}");
}

#[tokio::test]
async fn save_rejects_shape_and_dtype_disagreeing_with_byte_count() {
    let h = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,15]}}"#;
    let err = save_one("f.safetensors", raw_file(h, 15)).await;
    assert!(err.to_string().contains("needs 16 bytes"), "{err}");
    let h = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    let err = save_one("f.safetensors", raw_file(h, 10)).await;
    assert!(
        err.to_string().contains("describes"),
        "truncated file: {err}"
    );
}

/// A stable-toolchain stand-in for the cargo-fuzz targets: seeded random mutations of a real
/// manifest and header must give errors, never panics (replay a failure from its seed).
#[tokio::test]
async fn mutated_manifests_and_headers_never_panic() {
    use rand::{RngExt, SeedableRng};
    let (mem, _store) = two_steps().await;
    let manifest = get_raw(&mem, "steps/00000000000000000002/manifest.json").await;
    let file = common::two_files()[0].1.clone();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header = file[8..8 + n].to_vec();
    for seed in 0..300u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (base, is_manifest) in [(&manifest, true), (&header, false)] {
            let mut m = base.clone();
            for _ in 0..rng.random_range(1..8) {
                let i = rng.random_range(0..m.len());
                match rng.random_range(0..4) {
                    0 => m[i] ^= 1 << rng.random_range(0..8),
                    1 => m[i] = b"0123456789{}[]\",:-"[rng.random_range(0..18)],
                    2 => {
                        m.remove(i);
                    }
                    _ => m.truncate(i),
                }
                if m.is_empty() {
                    break;
                }
            }
            let r = std::panic::catch_unwind(|| {
                if is_manifest {
                    let _ = checkpoint::Manifest::parse(&m, 2);
                } else {
                    let _ = checkpoint::header::parse_header(&m, "f");
                }
            });
            assert!(r.is_ok(), "seed {seed} panicked (manifest: {is_manifest})");
        }
    }
}

#[tokio::test]
async fn restore_rejects_a_rank_outside_the_world() {
    let (_mem, store) = two_steps().await;
    let dir = tempfile::tempdir().unwrap();
    for (rank, world) in [(4u32, 4u32), (0, 0)] {
        let err = store
            .restore(
                Some(1),
                rank,
                world,
                dir.path(),
                &ReadOptions::default(),
                &cancel(),
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("is not in a world"), "{err}");
    }
}

#[tokio::test]
async fn forged_block_checksums_are_rejected() {
    forged(
        |m| m["objects"][0]["block_crc32c"] = serde_json::json!([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        "block checksums",
    )
    .await;
}

/// What a restore's events say, as a reader outside the restore sees it at each event: the
/// bytes of each `Ready` range read from the temporary file it names, and whether that file
/// still exists when its step fails.
#[derive(Default)]
struct Seen {
    log: Vec<String>,
    /// Step -> (temporary path, the bytes read at Ready events, how often each byte was
    /// given as ready).
    files: std::collections::BTreeMap<u64, (std::path::PathBuf, Vec<u8>, Vec<u8>)>,
}

/// A restore that falls back past a step whose last chunk is corrupt tells, as it goes, what is
/// final: the bytes a reader takes at each `ready` event from the temporary file are the
/// restored file's, every data byte is given once, and the failed step's file is gone when its
/// `failed` event comes, before the older step begins.
#[tokio::test]
async fn a_restore_tells_what_is_final_as_it_goes_and_starts_over_on_a_fallback() {
    use checkpoint::ReadEvent;
    use std::os::unix::fs::FileExt;
    use std::sync::Mutex;

    let (mem, store) = two_steps().await;
    let m = store.read_manifest(2, &cancel()).await.unwrap();
    assert!(m.objects.len() >= 2, "the step needs several chunks");
    let key = m.objects.last().unwrap().key.clone();
    let mut data = get_raw(&mem, &key).await;
    let mid = data.len() / 2;
    data[mid] ^= 0x10;
    put_raw(&mem, &key, data).await;

    let seen = Arc::new(Mutex::new(Seen::default()));
    let events: checkpoint::ReadEvents = {
        let seen = seen.clone();
        Arc::new(move |ev: &ReadEvent| {
            let mut s = seen.lock().unwrap();
            match ev {
                ReadEvent::Step { step, metadata } => {
                    let md = metadata.as_ref().unwrap();
                    assert_eq!(md["step"], *step);
                    assert_eq!(md["metadata"]["lr_scale"], 1.5);
                    s.log.push(format!("step {step}"));
                }
                ReadEvent::File {
                    step,
                    name,
                    path,
                    bytes,
                } => {
                    assert_eq!(name, "state.safetensors");
                    assert_eq!(std::fs::metadata(path).unwrap().len(), *bytes);
                    let n = *bytes as usize;
                    s.files
                        .insert(*step, (path.clone(), vec![0; n], vec![0; n]));
                    s.log.push(format!("file {step}"));
                }
                ReadEvent::Ready { step, name, ranges } => {
                    assert_eq!(name, "state.safetensors");
                    let (path, shadow, count) = s.files.get_mut(step).unwrap();
                    let f = std::fs::File::open(&*path).unwrap();
                    for &[at, len] in ranges {
                        let (a, b) = (at as usize, (at + len) as usize);
                        f.read_exact_at(&mut shadow[a..b], at).unwrap();
                        count[a..b].iter_mut().for_each(|c| *c += 1);
                    }
                    if s.log.last().map(String::as_str) != Some(&format!("ready {step}")) {
                        s.log.push(format!("ready {step}"));
                    }
                }
                ReadEvent::Failed { step, error } => {
                    assert!(error.contains(&key), "{error}");
                    assert!(
                        !s.files[step].0.exists(),
                        "the failed step's file is still there"
                    );
                    s.log.push(format!("failed {step}"));
                }
                ReadEvent::Header { .. } | ReadEvent::Source { .. } => {
                    panic!("a memory store's restore copies: {ev:?}")
                }
            }
        })
    };
    let opts = ReadOptions {
        concurrency: 1,
        events: Some(events),
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let r = store
        .restore(None, 0, 1, dir.path(), &opts, &cancel())
        .await
        .unwrap();
    assert_eq!((r.step, r.skipped_steps), (1, vec![2]));
    let s = seen.lock().unwrap();
    // Chunks are read in order one at a time, so step 2's first chunks were ready before its
    // last one failed.
    assert_eq!(
        s.log,
        [
            "step 2", "file 2", "ready 2", "failed 2", "step 1", "file 1", "ready 1"
        ]
    );
    let restored = std::fs::read(&r.path).unwrap();
    let data_start = 8 + u64::from_le_bytes(restored[..8].try_into().unwrap()) as usize;
    let (_, shadow, count) = &s.files[&1];
    assert_eq!(shadow.len(), restored.len());
    assert!(count[..data_start].iter().all(|&c| c == 0));
    assert!(
        count[data_start..].iter().all(|&c| c == 1),
        "every data byte is ready once"
    );
    assert!(shadow[data_start..] == restored[data_start..]);
}

/// Every rank of a row-sharded step falls back when any one of its objects is lost or cut: the
/// ones a rank reads fail its read, and the others fail their check (one listing of the step's
/// data, on a store that is not a local directory), so ranks that read different chunks still
/// agree on the step. A rank asks nothing of the chunks it reads before it reads them.
#[tokio::test]
async fn every_rank_of_a_sharded_step_falls_back_when_any_of_its_objects_is_lost_or_cut() {
    let mem = Arc::new(InMemory::new());
    let store = Store::from_object_store(mem.clone(), PREFIX, "memory://ck");
    let w = common::tensor("w", "F32", &[37, 50], 1);
    let b = common::tensor("b", "BF16", &[50], 2);
    for step in [1, 2] {
        common::save_sharded_state(&store, step, &w, &b, &[0, 11, 12, 37]).await;
    }
    let keys: Vec<String> = store
        .read_manifest(2, &cancel())
        .await
        .unwrap()
        .objects
        .iter()
        .map(|o| o.key.clone())
        .collect();
    assert!(keys.len() > 3, "small chunks: the shards span chunks");
    for (key, cut) in keys.iter().flat_map(|k| [(k, false), (k, true)]) {
        let data = get_raw(&mem, key).await;
        if cut {
            put_raw(&mem, key, data[..data.len() - 1].to_vec()).await;
        } else {
            mem.delete(&p(key)).await.unwrap();
        }
        // Rank 1 of 3 checks the chunks it does not read by a listing, rank 2 of 3 by a HEAD
        // (counted below).
        for (rank, world) in [(0, 3), (1, 3), (2, 3), (1, 2)] {
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
            assert_eq!(
                (r.step, &r.skipped_steps[..]),
                (1, &[2][..]),
                "{key} lost (cut: {cut}), rank {rank} of {world}"
            );
        }
        put_raw(&mem, key, data).await;
    }
    // The objects a rank reads are checked by their read, not by a request first: beyond what
    // finding the newest step and reading its manifest take, a rank checks only the chunks it
    // does not read: by a HEAD when there is one, in one listing when there are more. Rank 0
    // of 1 reads every chunk. Rank 1 of 3 reads rows 13-25 and `b`: not the first writer's
    // one chunk (rows 0-11), nor the last writer's second (rows 12-37 take two chunks of 4 KiB,
    // and its first holds rows 12-31). Rank 2 of 3 reads rows 25-37 and `b`: all but the
    // first writer's chunk.
    let before = store.read_stats();
    store.committed_steps(&cancel()).await.unwrap();
    store.read_manifest(2, &cancel()).await.unwrap();
    let after = store.read_stats();
    let finding = (after.heads - before.heads, after.lists - before.lists);
    let mut asked = Vec::new();
    for (rank, world) in [(0, 1), (1, 3), (2, 3)] {
        let before = store.read_stats();
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
        assert_eq!((r.step, r.skipped_steps.len()), (2, 0));
        let after = store.read_stats();
        asked.push((
            after.heads - before.heads - finding.0,
            after.lists - before.lists - finding.1,
        ));
    }
    let objects = keys.len();
    assert_eq!(
        asked[0],
        (0, 0),
        "rank 0 of 1 reads every one of the {objects} chunks: (HEADs, listings)"
    );
    assert_eq!(
        asked[1],
        (0, 1),
        "rank 1 of 3 lists the chunks it does not read: (HEADs, listings)"
    );
    assert_eq!(
        asked[2],
        (1, 0),
        "rank 2 of 3 HEADs the one chunk it does not read: (HEADs, listings)"
    );
}
