//! Restores from a local directory stream each raw chunk from its file into the output in
//! blocks, checksummed on the way. What they write is bitwise what a memory store restores,
//! at any world size, with copies that start and end inside blocks; and a chunk that is
//! corrupt, truncated, extended, missing, a symlink or a FIFO fails the step with the object
//! named, leaves no output, and the restore falls back to the previous step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use checkpoint::restore::{RESTORE_FILE, rows_for_rank};
use checkpoint::{PartInput, PartSource, ReadOptions, SaveOptions, Store};
use safetensors::SafeTensors;

use crate::common::{self, T, cancel, rows, st_bytes, tensor};

/// Raw chunks of 1 MiB: four and a bit blocks each, so tensors and row ranges start and end
/// inside blocks and across chunk boundaries.
fn raw_chunks() -> SaveOptions {
    SaveOptions {
        chunk_bytes_max: 1024 * 1024 + 4096 + 12,
        compress: false,
        concurrency: 2,
        ..Default::default()
    }
}

/// Two sharded tensors of odd row sizes and a replicated one: about 3.1 MiB.
fn state() -> (Vec<T>, Vec<T>) {
    (
        vec![
            tensor("w", "F32", &[601, 1001], 1),
            tensor("emb", "BF16", &[333, 777], 2),
        ],
        vec![tensor("bias", "F32", &[70_001], 3)],
    )
}

/// Saves `state()` from 2 writers as FSDP would, and commits it as `step`.
async fn save(store: &Store, step: u64) {
    let (sharded, replicated) = state();
    common::save_rows(store, step, 2, &sharded, &replicated, &raw_chunks()).await;
}

async fn restore(store: &Store, step: Option<u64>, rank: u32, world: u32) -> (u64, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let r = store
        .restore(
            step,
            rank,
            world,
            dir.path(),
            &ReadOptions::default(),
            &cancel(),
        )
        .await
        .unwrap();
    (
        r.step,
        std::fs::read(dir.path().join(RESTORE_FILE)).unwrap(),
    )
}

/// The chunk objects of `step` (`steps/<step>/data/<writer>/<n>.bin`), in name order.
fn chunk_files(root: &Path, step: u64) -> Vec<PathBuf> {
    let dir = root.join(format!("steps/{step:020}"));
    let mut out = Vec::new();
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                stack.push(e.path());
            } else if e.path().extension().is_some_and(|x| x == "bin") {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn a_local_restore_is_bitwise_a_memory_restore_at_every_world_size() {
    let root = tempfile::tempdir().unwrap();
    let local = Store::open(&format!("file://{}", root.path().display())).unwrap();
    let mem = Store::open("memory://").unwrap();
    save(&local, 7).await;
    save(&mem, 7).await;
    let m = local.read_manifest(7, &cancel()).await.unwrap();
    assert!(
        m.objects.len() >= 3
            && m.objects
                .iter()
                .all(|o| o.codec == checkpoint::codec::Codec::Raw),
        "raw chunks of about 1 MiB: {:?}",
        m.objects
            .iter()
            .map(|o| (o.stored_bytes, o.codec.clone()))
            .collect::<Vec<_>>()
    );
    // Every byte of the step is read once by a restore for a world of one (and counted).
    let before = local.read_stats();
    restore(&local, Some(7), 0, 1).await;
    let read = local.read_stats();
    let stored: u64 = m.objects.iter().map(|o| o.stored_bytes).sum();
    assert!(
        read.bytes - before.bytes >= stored
            && read.bytes - before.bytes < stored + 64 * 1024
            && read.gets - before.gets > m.objects.len() as u64,
        "{before:?} -> {read:?}, {stored} bytes stored in {} objects",
        m.objects.len()
    );
    let (sharded, replicated) = state();
    for world in [1u32, 2, 3, 5] {
        for rank in 0..world {
            let (step, got) = restore(&local, None, rank, world).await;
            assert_eq!(step, 7);
            assert_eq!(
                got,
                restore(&mem, None, rank, world).await.1,
                "rank {rank} of {world}"
            );
            let st = SafeTensors::deserialize(&got).unwrap();
            for t in &sharded {
                let (lo, hi) = rows_for_rank(t.shape[0] as u64, rank, world);
                assert_eq!(
                    st.tensor(&t.name).unwrap().data(),
                    &rows(t, lo as usize, hi as usize)[..],
                    "{} rows [{lo}, {hi}) on rank {rank} of {world}",
                    t.name
                );
            }
            for t in &replicated {
                assert_eq!(st.tensor(&t.name).unwrap().data(), &t.data[..]);
            }
        }
    }
}

/// Steps 1 and 2 saved; `spoil` then damages a chunk file of step 2. Restoring step 2 fails
/// naming that object with `want` in the message and leaves nothing in the target, and the
/// newest restore falls back to step 1, whose bytes are intact.
async fn spoiled(spoil: impl FnOnce(&Path), want: &str) {
    let root = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", root.path().display())).unwrap();
    save(&store, 1).await;
    save(&store, 2).await;
    let chunk = chunk_files(root.path(), 2).pop().unwrap();
    spoil(&chunk);
    let key = chunk
        .strip_prefix(root.path())
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
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
    assert!(err.is_integrity(), "{err}");
    let text = err.to_string();
    assert!(text.contains(&key) && text.contains(want), "{text}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "a failed restore leaves nothing"
    );
    let (step, got) = restore(&store, None, 0, 1).await;
    assert_eq!(step, 1);
    let mem = Store::open("memory://").unwrap();
    save(&mem, 1).await;
    assert_eq!(got, restore(&mem, None, 0, 1).await.1);
}

#[tokio::test]
async fn a_flipped_bit_in_the_last_block_of_a_local_chunk_falls_back() {
    spoiled(
        |p| {
            let mut b = std::fs::read(p).unwrap();
            let at = b.len() - 1;
            b[at] ^= 0x01;
            std::fs::write(p, b).unwrap();
        },
        "crc32c",
    )
    .await;
}

#[tokio::test]
async fn a_truncated_or_extended_local_chunk_falls_back() {
    spoiled(
        |p| {
            let b = std::fs::read(p).unwrap();
            std::fs::write(p, &b[..b.len() - 5]).unwrap();
        },
        "truncated or extended",
    )
    .await;
    spoiled(
        |p| {
            let mut b = std::fs::read(p).unwrap();
            b.push(0);
            std::fs::write(p, b).unwrap();
        },
        "truncated or extended",
    )
    .await;
}

#[tokio::test]
async fn a_missing_symlinked_or_fifo_local_chunk_falls_back_without_hanging() {
    spoiled(|p| std::fs::remove_file(p).unwrap(), "").await;
    spoiled(
        |p| {
            let real = p.with_extension("elsewhere");
            std::fs::rename(p, &real).unwrap();
            std::os::unix::fs::symlink(&real, p).unwrap();
        },
        "symlink",
    )
    .await;
    spoiled(
        |p| {
            std::fs::remove_file(p).unwrap();
            let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        },
        "not a regular file",
    )
    .await;
}

#[tokio::test]
async fn a_local_save_streams_into_private_directories_and_never_through_a_symlink() {
    use std::os::unix::fs::PermissionsExt;

    let root = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", root.path().display())).unwrap();
    save(&store, 4).await;
    let chunk = chunk_files(root.path(), 4).pop().unwrap();
    for dir in chunk.ancestors().skip(1) {
        if dir == root.path() {
            break;
        }
        let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }
    // A symlink planted where step 5's directory goes: the save refuses it, naming it, and
    // writes nothing where it points.
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(
        elsewhere.path(),
        root.path().join(format!("steps/{:020}", 5)),
    )
    .unwrap();
    let (sharded, _) = state();
    let input = PartInput {
        writer: "rank-0".into(),
        source: PartSource::Buffers(vec![(
            "rank-0.safetensors".into(),
            st_bytes(&sharded[..1], None).into(),
        )]),
        shards: BTreeMap::new(),
    };
    let err = store
        .save_part(5, input, &raw_chunks(), &cancel())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("symlink"), "{err}");
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}

/// Row-sharded state re-cut from 2 ranks to 3 on a local directory: each rank reads the 256 KiB
/// blocks that hold its rows, not whole chunks. A step written by format 1 (no block
/// checksums) still restores, bitwise, reading its chunks whole.
#[tokio::test]
async fn resharding_reads_the_blocks_of_the_rows_and_format_1_reads_whole_chunks() {
    use checkpoint::format::CHECK_BLOCK_BYTES;

    let root = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", root.path().display())).unwrap();
    let w = tensor("w", "F32", &[3000, 1000], 1);
    let emb = tensor("emb", "BF16", &[1500, 4000], 2);
    let opts = SaveOptions {
        chunk_bytes_max: 8 * 1024 * 1024,
        compress: false,
        concurrency: 2,
        ..Default::default()
    };
    let sharded = &[w, emb];
    common::save_rows(&store, 3, 2, sharded, &[], &opts).await;
    let stored: u64 = sharded.iter().map(|t| t.data.len() as u64).sum();
    let needed = stored / 3;
    let restore_all = |store: Store| async move {
        let mut read = Vec::new();
        for rank in 0..3 {
            let before = store.read_stats().bytes;
            let (_, got) = restore(&store, Some(3), rank, 3).await;
            read.push(store.read_stats().bytes - before);
            let st = SafeTensors::deserialize(&got).unwrap();
            for t in sharded {
                let (lo, hi) = rows_for_rank(t.shape[0] as u64, rank, 3);
                assert_eq!(
                    st.tensor(&t.name).unwrap().data(),
                    &rows(t, lo as usize, hi as usize)[..],
                    "{} rows [{lo}, {hi}) on rank {rank} of 3",
                    t.name
                );
            }
        }
        read
    };
    for (rank, read) in restore_all(store.clone()).await.into_iter().enumerate() {
        assert!(
            read >= needed && read <= needed + 8 * CHECK_BLOCK_BYTES,
            "rank {rank} read {read} bytes for {needed} needed"
        );
    }

    let manifest = root.path().join("steps/00000000000000000003/manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["format_version"], 3);
    m["format_version"] = 1.into();
    for o in m["objects"].as_array_mut().unwrap() {
        o.as_object_mut().unwrap().remove("block_crc32c").unwrap();
    }
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let whole =
        restore_all(Store::open(&format!("file://{}", root.path().display())).unwrap()).await;
    // Whole chunks: a chunk that holds rows of two new ranks is read by both.
    let whole: u64 = whole.iter().sum();
    assert!(
        whole >= stored * 3 / 2,
        "{whole} bytes read for {stored} stored"
    );
}

/// What a restore without copies said, put together as a reader outside it would: the state
/// file from its `header` event and the bytes its `source` events name, each read from the
/// chunk file there once that file is checked to be the one the event names.
struct Pointed {
    report: checkpoint::RestoreReport,
    log: Vec<String>,
    /// Step -> the state file as its events give it, and how often each byte was given.
    files: BTreeMap<u64, (Vec<u8>, Vec<u8>)>,
    /// Step -> `(chunk file, offset there, length)` of each range a `source` event named.
    sources: BTreeMap<u64, Vec<(PathBuf, u64, u64)>>,
}

async fn restore_without_copies(
    store: &Store,
    root: Option<&Path>,
    step: Option<u64>,
    rank: u32,
    world: u32,
) -> (Pointed, tempfile::TempDir) {
    use checkpoint::ReadEvent;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::sync::{Arc, Mutex};

    let seen = Arc::new(Mutex::new((
        Vec::<String>::new(),
        BTreeMap::new(),
        BTreeMap::<u64, Vec<_>>::new(),
    )));
    let root = root.map(Path::to_path_buf);
    let events: checkpoint::ReadEvents = {
        let seen = seen.clone();
        Arc::new(move |ev: &ReadEvent| {
            let mut guard = seen.lock().unwrap();
            let (log, files, sources) = &mut *guard;
            let line = match ev {
                ReadEvent::Step { step, .. } => format!("step {step}"),
                ReadEvent::Header {
                    step,
                    name,
                    bytes,
                    header,
                    targets,
                } => {
                    assert_eq!(name, RESTORE_FILE);
                    assert!(!targets, "no targets are asked for without into_process");
                    let mut f = (header.len() as u64).to_le_bytes().to_vec();
                    f.extend_from_slice(header.as_bytes());
                    let given = vec![1; f.len()];
                    f.resize(*bytes as usize, 0);
                    let mut count = given;
                    count.resize(*bytes as usize, 0);
                    files.insert(*step, (f, count));
                    format!("header {step}")
                }
                ReadEvent::Source {
                    step,
                    name,
                    path,
                    bytes,
                    dev,
                    ino,
                    ctime_ns,
                    ranges,
                } => {
                    assert_eq!(name, RESTORE_FILE);
                    assert!(
                        path.starts_with(root.as_ref().expect("a local store")),
                        "{}",
                        path.display()
                    );
                    let src = std::fs::File::open(path).unwrap();
                    let st = src.metadata().unwrap();
                    let ctime = st.ctime() * 1_000_000_000 + st.ctime_nsec();
                    assert_eq!(
                        (st.dev(), st.ino(), st.len(), ctime),
                        (*dev, *ino, *bytes, *ctime_ns)
                    );
                    let (f, count) = files.get_mut(step).unwrap();
                    for &[at, len, from] in ranges {
                        let (a, b) = (at as usize, (at + len) as usize);
                        src.read_exact_at(&mut f[a..b], from).unwrap();
                        count[a..b].iter_mut().for_each(|c| *c += 1);
                        sources
                            .entry(*step)
                            .or_default()
                            .push((path.clone(), from, len));
                    }
                    format!("source {step}")
                }
                ReadEvent::File { step, .. } => format!("file {step}"),
                ReadEvent::Ready { step, .. } => format!("ready {step}"),
                ReadEvent::Failed { step, .. } => format!("failed {step}"),
            };
            if log.last() != Some(&line) {
                log.push(line);
            }
        })
    };
    let opts = ReadOptions {
        concurrency: 1,
        events: Some(events),
        no_copy: true,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let report = store
        .restore(step, rank, world, dir.path(), &opts, &cancel())
        .await
        .unwrap();
    let (log, files, sources) = std::mem::take(&mut *seen.lock().unwrap());
    (
        Pointed {
            report,
            log,
            files,
            sources,
        },
        dir,
    )
}

/// A restore without copies from a local directory of raw chunks writes no state file: its
/// events give the header and, chunk by chunk once each is checked, where its bytes lie in
/// the store. Put together, that is bitwise the file a restore writes, at every world size,
/// each byte given once; resharding checks only the blocks of the rows. From a memory store,
/// or from compressed chunks, the file is written as without it.
#[tokio::test]
async fn a_restore_without_copies_names_the_checked_chunks_that_hold_the_state() {
    use checkpoint::format::CHECK_BLOCK_BYTES;

    let root = tempfile::tempdir().unwrap();
    let local = Store::open(&format!("file://{}", root.path().display())).unwrap();
    save(&local, 7).await;
    let m = local.read_manifest(7, &cancel()).await.unwrap();
    let stored: u64 = m.objects.iter().map(|o| o.stored_bytes).sum();
    for world in [1u32, 2, 3] {
        for rank in 0..world {
            let before = local.read_stats().bytes;
            let (p, dir) =
                restore_without_copies(&local, Some(root.path()), None, rank, world).await;
            let read = local.read_stats().bytes - before;
            assert_eq!(
                p.log,
                ["step 7", "header 7", "source 7"],
                "rank {rank} of {world}"
            );
            assert!(!p.report.written);
            assert_eq!(
                std::fs::read_dir(dir.path())
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect::<Vec<_>>(),
                ["metadata.json"]
            );
            let (got, count) = &p.files[&7];
            assert!(count.iter().all(|&c| c == 1), "every byte given once");
            assert_eq!(got, &restore(&local, Some(7), rank, world).await.1);
            assert!(
                read >= p.report.bytes,
                "rank {rank} of {world}: {read} bytes checked for {}",
                p.report.bytes
            );
            if world == 3 {
                assert!(
                    read < stored / 2 + 8 * CHECK_BLOCK_BYTES,
                    "rank {rank} of 3 checked {read} of {stored} bytes"
                );
            }
        }
    }

    // A pull writes its files even when asked for no copies.
    let pointing = ReadOptions {
        events: Some(std::sync::Arc::new(|_: &checkpoint::ReadEvent| {})),
        no_copy: true,
        ..Default::default()
    };
    let pulled = tempfile::tempdir().unwrap();
    local
        .pull(7, pulled.path(), &pointing, &cancel())
        .await
        .unwrap();
    for f in &m.files {
        let len = std::fs::metadata(pulled.path().join(&f.name))
            .unwrap()
            .len();
        assert_eq!(len, 8 + f.header.len() as u64 + f.data_bytes, "{}", f.name);
    }

    let mem = Store::open("memory://").unwrap();
    save(&mem, 7).await;
    let (p, dir) = restore_without_copies(&mem, None, None, 0, 1).await;
    assert_eq!(p.log, ["step 7", "file 7", "ready 7"]);
    assert!(p.report.written && dir.path().join(RESTORE_FILE).is_file());

    let zroot = tempfile::tempdir().unwrap();
    let zstd = Store::open(&format!("file://{}", zroot.path().display())).unwrap();
    let (sharded, replicated) = state();
    let compressed = SaveOptions {
        compress: true,
        ..raw_chunks()
    };
    common::save_rows(&zstd, 7, 2, &sharded, &replicated, &compressed).await;
    let (p, dir) = restore_without_copies(&zstd, Some(zroot.path()), None, 0, 1).await;
    assert_eq!(p.log, ["step 7", "file 7", "ready 7"]);
    assert_eq!(
        std::fs::read(dir.path().join(RESTORE_FILE)).unwrap(),
        restore(&local, Some(7), 0, 1).await.1
    );
}

/// Steps 1 and 2 of [`save`] in a new local directory, and step 2's manifest.
async fn two_steps() -> (tempfile::TempDir, Store, checkpoint::format::Manifest) {
    let root = tempfile::tempdir().unwrap();
    let store = Store::open(&format!("file://{}", root.path().display())).unwrap();
    save(&store, 1).await;
    save(&store, 2).await;
    let m = store.read_manifest(2, &cancel()).await.unwrap();
    (root, store, m)
}

/// Flips a byte in block `block` (of [`CHECK_BLOCK_BYTES`]) of the file at `path`.
fn flip_in_block(path: &Path, block: u64) {
    use checkpoint::format::CHECK_BLOCK_BYTES;
    let mut b = std::fs::read(path).unwrap();
    let (at, n) = ((block * CHECK_BLOCK_BYTES) as usize, b.len());
    b[at + (CHECK_BLOCK_BYTES as usize / 2).min(n - at - 1)] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

/// Rank `rank` of `world` of `store` (whose step 2 is made corrupt), restored without copies,
/// falls back to step 1, given bitwise and each byte once. Returns the restore's events.
async fn falls_back_to_step_1(store: &Store, root: &Path, rank: u32, world: u32) -> Vec<String> {
    let (p, _dir) = restore_without_copies(store, Some(root), None, rank, world).await;
    assert_eq!((p.report.step, p.report.skipped_steps), (1, vec![2]));
    let (got, count) = &p.files[&1];
    assert!(count.iter().all(|&c| c == 1));
    assert_eq!(got, &restore(store, Some(1), rank, world).await.1);
    p.log
}

/// A restore without copies falls back as a restore does: step 2's last chunk has a flipped
/// bit, so its first chunks are named as sources before it fails, and then step 1 is given
/// whole, bitwise the file a restore of step 1 writes.
#[tokio::test]
async fn a_restore_without_copies_falls_back_past_a_corrupt_chunk() {
    let (root, store, m) = two_steps().await;
    flip_in_block(&root.path().join(&m.objects.last().unwrap().key), 0);
    assert_eq!(
        falls_back_to_step_1(&store, root.path(), 0, 1).await,
        [
            "step 2", "header 2", "source 2", "failed 2", "step 1", "header 1", "source 1"
        ]
    );
}

/// A resharding restore without copies checks the blocks it names, and only those: rank 1
/// of 3 needs some blocks of step 2's chunks. A flipped byte in a block it does not need
/// leaves step 2 whole for it; one in the last block it needs (beside the bytes it needs,
/// not in them) makes it fall back to step 1.
#[tokio::test]
async fn a_restore_without_copies_checks_the_blocks_it_needs_and_only_those() {
    use checkpoint::format::CHECK_BLOCK_BYTES;
    use std::collections::BTreeSet;

    let (root, store, m) = two_steps().await;
    let (p, _dir) = restore_without_copies(&store, Some(root.path()), Some(2), 1, 3).await;
    let needed: BTreeSet<(PathBuf, u64)> = p.sources[&2]
        .iter()
        .flat_map(|(path, from, len)| {
            (from / CHECK_BLOCK_BYTES..=(from + len - 1) / CHECK_BLOCK_BYTES)
                .map(move |b| (path.clone(), b))
        })
        .collect();
    let unneeded = m
        .objects
        .iter()
        .flat_map(|o| {
            let path = root.path().join(&o.key);
            (0..o.stored_bytes.div_ceil(CHECK_BLOCK_BYTES)).map(move |b| (path.clone(), b))
        })
        .find(|pb| !needed.contains(pb))
        .expect("rank 1 of 3 does not need every block");

    flip_in_block(&unneeded.0, unneeded.1);
    let (p, _dir) = restore_without_copies(&store, Some(root.path()), None, 1, 3).await;
    assert_eq!(p.log, ["step 2", "header 2", "source 2"]);
    assert_eq!(p.files[&2].0, restore(&store, Some(2), 1, 3).await.1);

    let (path, block) = needed.last().unwrap();
    flip_in_block(path, *block);
    let log = falls_back_to_step_1(&store, root.path(), 1, 3).await;
    assert_eq!(&log[..2], ["step 2", "header 2"]);
    assert!(log.contains(&"failed 2".to_string()), "{log:?}");
}
