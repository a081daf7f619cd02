//! Faults a real service cannot be made to show on demand: transient errors (seeded), slow
//! calls past the deadline, cancellation.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use checkpoint::{Error, PartInput, PartSource, ReadOptions, Store, StoreOptions};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use rand::{RngExt, SeedableRng};

use crate::common::{self, cancel};

/// Fails a seeded fraction of puts and gets with a transient error, never the same call twice
/// in a row more than `streak_max` times.
#[derive(Debug)]
struct Unreliable {
    inner: InMemory,
    rng: std::sync::Mutex<rand::rngs::StdRng>,
    fail_probability: f64,
    failures: AtomicU32,
    gets: AtomicU32,
    /// Gets that asked for a byte range.
    ranged_gets: AtomicU32,
    /// The start of every ranged get.
    range_starts: std::sync::Mutex<Vec<u64>>,
    /// When set, the next get of this object has its body break off with a transient error
    /// after this many bytes.
    cut_next_get: std::sync::Mutex<Option<(Path, u64)>>,
}

impl fmt::Display for Unreliable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Unreliable")
    }
}

impl Unreliable {
    fn new(seed: u64) -> Self {
        Self::with_probability(seed, 0.3)
    }

    fn with_probability(seed: u64, fail_probability: f64) -> Self {
        Unreliable {
            inner: InMemory::new(),
            rng: std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            fail_probability,
            failures: AtomicU32::new(0),
            gets: AtomicU32::new(0),
            ranged_gets: AtomicU32::new(0),
            range_starts: Default::default(),
            cut_next_get: Default::default(),
        }
    }

    fn maybe_fail(&self) -> object_store::Result<()> {
        if self.rng.lock().unwrap().random_bool(self.fail_probability) {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return Err(object_store::Error::Generic {
                store: "Unreliable",
                source: "injected: connection reset".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl ObjectStore for Unreliable {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.maybe_fail()?;
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.maybe_fail()?;
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.gets.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = &options.range {
            self.ranged_gets.fetch_add(1, Ordering::Relaxed);
            if let object_store::GetRange::Bounded(r) = r {
                self.range_starts.lock().unwrap().push(r.start);
            }
        }
        self.maybe_fail()?;
        let head = options.head;
        let mut r = self.inner.get_opts(location, options).await?;
        let cut = {
            let mut c = self.cut_next_get.lock().unwrap();
            match &*c {
                Some((p, _)) if p == location && !head => c.take().map(|(_, n)| n),
                _ => None,
            }
        };
        if let Some(cut) = cut {
            // The body arrives in pieces of 64 KiB and breaks off after `cut` bytes, as a
            // connection reset in the middle of a response does (after the last byte too).
            let body_len = r.range.end - r.range.start;
            let body = match r.payload {
                object_store::GetResultPayload::Stream(s) => s,
                _ => unreachable!("an in-memory store streams"),
            };
            let pieces = body
                .map_ok(|b| {
                    futures::stream::iter(
                        (0..b.len())
                            .step_by(64 * 1024)
                            .map(move |i| Ok(b.slice(i..(i + 64 * 1024).min(b.len()))))
                            .collect::<Vec<_>>(),
                    )
                })
                .try_flatten();
            let mut sent = 0u64;
            let cut_off = pieces
                .scan(false, move |broken, piece| {
                    if *broken {
                        return futures::future::ready(None);
                    }
                    let piece = piece.and_then(|b: bytes::Bytes| {
                        if sent + b.len() as u64 > cut {
                            *broken = true;
                            return Err(object_store::Error::Generic {
                                store: "Unreliable",
                                source: "injected: connection reset in the body".into(),
                            });
                        }
                        sent += b.len() as u64;
                        Ok(b)
                    });
                    futures::future::ready(Some(piece))
                })
                .chain(futures::stream::iter((cut >= body_len).then(|| {
                    Err(object_store::Error::Generic {
                        store: "Unreliable",
                        source: "injected: connection reset after the body".into(),
                    })
                })))
                .boxed();
            r.payload = object_store::GetResultPayload::Stream(cut_off);
        }
        Ok(r)
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }
    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn fast_retries() -> StoreOptions {
    StoreOptions {
        attempts_max: 20,
        backoff_initial_ms: 1,
        backoff_max_ms: 5,
        ..Default::default()
    }
}

#[tokio::test]
async fn transient_store_errors_are_retried_until_save_and_pull_succeed() {
    for seed in 0..4 {
        let flaky = Arc::new(Unreliable::new(seed));
        let store = Store::from_object_store(flaky.clone(), "ck", "unreliable://ck")
            .with_options(fast_retries());
        let files = common::push_files(&store, 1).await;
        let dir = tempfile::tempdir().unwrap();
        store
            .pull(1, dir.path(), &ReadOptions::default(), &cancel())
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        common::assert_dir_has(dir.path(), &files);
        assert!(
            flaky.failures.load(Ordering::Relaxed) > 0,
            "seed {seed} injected nothing"
        );
    }
}

#[tokio::test]
async fn transient_errors_past_attempts_max_surface_with_the_key() {
    let flaky = Arc::new(Unreliable::new(1));
    let store =
        Store::from_object_store(flaky, "ck", "unreliable://ck").with_options(StoreOptions {
            attempts_max: 1,
            ..fast_retries()
        });
    let input = PartInput {
        writer: "w".into(),
        source: PartSource::Buffers(common::two_files()),
        shards: Default::default(),
    };
    let err = store
        .save_part(1, input, &common::small_chunks(), &cancel())
        .await
        .unwrap_err();
    assert!(!err.is_permanent(), "{err}");
    assert!(err.to_string().contains("unreliable://ck"), "{err}");
}

fn slow_puts() -> Store {
    let config = ThrottleConfig {
        wait_put_per_call: Duration::from_secs(3600),
        ..Default::default()
    };
    Store::from_object_store(
        Arc::new(ThrottledStore::new(InMemory::new(), config)),
        "ck",
        "slow://ck",
    )
}

fn input() -> PartInput {
    PartInput {
        writer: "w".into(),
        source: PartSource::Buffers(common::two_files()),
        shards: Default::default(),
    }
}

#[tokio::test]
async fn a_put_past_the_deadline_is_a_timeout() {
    let store = slow_puts().with_options(StoreOptions {
        deadline_ms: 200,
        ..Default::default()
    });
    let err = store
        .save_part(1, input(), &common::small_chunks(), &cancel())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                deadline_ms: 200,
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test]
async fn cancelling_a_save_stops_it_with_cancelled() {
    let store = slow_puts();
    let token = cancel();
    let t2 = token.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        t2.cancel();
    });
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        store.save_part(1, input(), &common::small_chunks(), &token),
    )
    .await
    .expect("cancellation ends the save promptly")
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled { .. }), "{err}");
}

#[tokio::test]
async fn a_rank_reads_only_the_chunks_that_hold_its_bytes() {
    use checkpoint::format::ShardSpec;
    use checkpoint::restore::rows_for_rank;
    let counting = Arc::new(Unreliable::with_probability(0, 0.0));
    let store = Store::from_object_store(counting.clone(), "ck", "counting://ck");
    let big = common::tensor("big", "F32", &[512, 64], 1);
    for rank in 0..4u32 {
        let (lo, hi) = rows_for_rank(512, rank, 4);
        let mine = common::T {
            shape: vec![(hi - lo) as usize, 64],
            data: common::rows(&big, lo as usize, hi as usize),
            ..big.clone()
        };
        let shards = [(
            "big".to_string(),
            ShardSpec {
                global_shape: vec![512, 64],
                dim0_offset: lo,
            },
        )]
        .into();
        let input = PartInput {
            writer: format!("rank-{rank}"),
            source: PartSource::Buffers(vec![(
                format!("rank-{rank}.safetensors"),
                common::st_bytes(&[mine], None).into(),
            )]),
            shards,
        };
        store
            .save_part(1, input, &common::small_chunks(), &cancel())
            .await
            .unwrap();
    }
    let writers = ["rank-0", "rank-1", "rank-2", "rank-3"];
    common::commit(&store, 1, &writers, 4).await;
    let m = store.read_manifest(1, &cancel()).await.unwrap();
    let before = counting.gets.load(Ordering::Relaxed);
    let dir = tempfile::tempdir().unwrap();
    store
        .restore(
            Some(1),
            1,
            2,
            dir.path(),
            &ReadOptions::default(),
            &cancel(),
        )
        .await
        .unwrap();
    let reads = counting.gets.load(Ordering::Relaxed) - before;
    // The manifest (a head, which object_store makes a get, and a get), then the chunks of old
    // ranks 2 and 3 only: new rank 1 of 2 holds rows 256..512.
    let needed = m
        .objects
        .iter()
        .filter(|o| o.key.contains("/rank-2-") || o.key.contains("/rank-3-"))
        .count();
    assert!(m.objects.len() >= 16, "{} objects", m.objects.len());
    assert_eq!(reads as usize, needed + 2, "of {} objects", m.objects.len());
}

/// Rewrites the object `key` of `counting`'s inner store with `edit`.
async fn edit_stored(counting: &Unreliable, key: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
    use object_store::ObjectStoreExt;
    let got = counting.inner.get(key).await.unwrap();
    let mut stored = got.bytes().await.unwrap().to_vec();
    edit(&mut stored);
    counting.inner.put(key, stored.into()).await.unwrap();
}

/// A chunk comes as one GET, whose body the decoder takes as it arrives (object_store's
/// `get_ranges` would merge ranges into one request anyway, and some stores read the whole object
/// for every range). A body that breaks off is resumed with a ranged GET from the byte where it
/// stopped, not fetched again; a truncated object is named.
#[tokio::test]
async fn a_remote_chunk_is_one_get_resumed_where_it_broke_off_and_truncation_is_named() {
    let counting = Arc::new(Unreliable::with_probability(0, 0.0));
    let store = Store::from_object_store(counting.clone(), "ck", "counting://ck");
    let files = common::incompressible_file(20 * 1024 * 1024 + 5, 5);
    let input = PartInput {
        writer: "big".into(),
        source: PartSource::Buffers(files.clone()),
        shards: Default::default(),
    };
    let opts = checkpoint::SaveOptions {
        chunk_bytes_max: 32 * 1024 * 1024,
        ..Default::default()
    };
    let part = store.save_part(1, input, &opts, &cancel()).await.unwrap();
    assert_eq!(part.objects.len(), 1);
    common::commit(&store, 1, &["big"], 1).await;

    let dir = tempfile::tempdir().unwrap();
    let (gets, ranged) = (
        counting.gets.load(Ordering::Relaxed),
        counting.ranged_gets.load(Ordering::Relaxed),
    );
    store
        .pull(1, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    // The manifest's HEAD (for its size limit) and GET, and one GET for the chunk.
    assert_eq!(counting.gets.load(Ordering::Relaxed) - gets, 3);
    assert_eq!(counting.ranged_gets.load(Ordering::Relaxed), ranged);
    common::assert_dir_has(dir.path(), &files);

    // Cut the chunk's body 5 MiB and a bit in: the read resumes from there, once.
    let cut = 5 * 1024 * 1024 + 3 * 64 * 1024;
    let key = Path::from(format!("ck/{}", part.objects[0].key));
    *counting.cut_next_get.lock().unwrap() = Some((key.clone(), cut));
    let stats = store.read_stats();
    let report = store
        .verify(1, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert!(report.bad.is_empty(), "{:?}", report.bad);
    assert_eq!(*counting.range_starts.lock().unwrap(), vec![cut]);
    let read = store.read_stats().bytes - stats.bytes;
    let manifest = read - part.objects[0].stored_bytes;
    assert!(
        manifest < 64 * 1024,
        "each byte read once: {read} bytes in all"
    );

    // Resumed in the middle of a restore too, bitwise.
    *counting.cut_next_get.lock().unwrap() = Some((key.clone(), 2 * 64 * 1024));
    let again = tempfile::tempdir().unwrap();
    store
        .pull(1, again.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    common::assert_dir_has(again.path(), &files);
    assert_eq!(
        *counting.range_starts.lock().unwrap(),
        vec![cut, 2 * 64 * 1024]
    );

    // Broken off after the last byte: nothing is left to ask for, and the read is complete.
    let gets = counting.gets.load(Ordering::Relaxed);
    *counting.cut_next_get.lock().unwrap() = Some((key.clone(), part.objects[0].stored_bytes));
    let report = store
        .verify(1, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert!(report.bad.is_empty(), "{:?}", report.bad);
    assert_eq!(counting.gets.load(Ordering::Relaxed) - gets, 3);
    assert_eq!(counting.range_starts.lock().unwrap().len(), 2);

    edit_stored(&counting, &key, |b| b.truncate(b.len() - 1)).await;
    let report = store
        .verify(1, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(report.bad.len(), 1, "{:?}", report.bad);
    assert_eq!(report.bad[0].0, part.objects[0].key);
    assert!(report.bad[0].1.contains("truncated"), "{}", report.bad[0].1);
}

/// Two writers' halves of the rows of `w` and `emb` (12 MB of F32 each) saved as step 1 in
/// chunks of 6 MiB, raw or compressed, through `counting`.
async fn two_writers_rows(
    counting: &Arc<Unreliable>,
    compress: bool,
    seed: u64,
) -> (Store, [common::T; 2], checkpoint::format::Manifest) {
    let store = Store::from_object_store(counting.clone(), "ck", "counting://ck");
    let w = common::tensor("w", "F32", &[3000, 1000], seed);
    let emb = common::tensor("emb", "F32", &[1500, 2000], seed + 1);
    let opts = checkpoint::SaveOptions {
        chunk_bytes_max: 6 * 1024 * 1024,
        compress,
        ..Default::default()
    };
    common::save_rows(&store, 1, 2, &[w.clone(), emb.clone()], &[], &opts).await;
    let m = store.read_manifest(1, &cancel()).await.unwrap();
    (store, [w, emb], m)
}

/// Step 1 restored for `rank` of 3, one chunk at a time (so the order of the ranged GETs is
/// the same in every restore): the bytes of the restored file.
async fn restore_rank_of_3(store: &Store, rank: u32) -> checkpoint::Result<Vec<u8>> {
    let one_at_a_time = ReadOptions {
        concurrency: 1,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let r = store
        .restore(Some(1), rank, 3, dir.path(), &one_at_a_time, &cancel())
        .await;
    r.map(|_| std::fs::read(dir.path().join(checkpoint::restore::RESTORE_FILE)).unwrap())
}

/// `got` holds bitwise the rows of `tensors` that `rank` of 3 needs.
fn check_rows_of_3(rank: u32, got: &[u8], tensors: [&common::T; 2]) {
    let st = safetensors::SafeTensors::deserialize(got).unwrap();
    for t in tensors {
        let (lo, hi) = checkpoint::restore::rows_for_rank(t.shape[0] as u64, rank, 3);
        assert_eq!(
            st.tensor(&t.name).unwrap().data(),
            &common::rows(t, lo as usize, hi as usize)[..],
            "{} rows [{lo}, {hi}) of rank {rank} of 3",
            t.name
        );
    }
}

/// The starts of the ranged GETs of rank 1's restore, clean and then with the first GET of
/// `key` cut a block and a half in (both restores checked bitwise), and the first index at
/// which they differ.
async fn starts_clean_and_cut(
    counting: &Unreliable,
    store: &Store,
    key: &Path,
    tensors: [&common::T; 2],
) -> (Vec<u64>, Vec<u64>, usize) {
    use checkpoint::format::CHECK_BLOCK_BYTES;
    counting.range_starts.lock().unwrap().clear();
    check_rows_of_3(1, &restore_rank_of_3(store, 1).await.unwrap(), tensors);
    let clean = std::mem::take(&mut *counting.range_starts.lock().unwrap());
    *counting.cut_next_get.lock().unwrap() = Some((key.clone(), 3 * CHECK_BLOCK_BYTES / 2));
    check_rows_of_3(1, &restore_rank_of_3(store, 1).await.unwrap(), tensors);
    let cut = counting.range_starts.lock().unwrap().clone();
    let i = (0..clean.len().min(cut.len()))
        .find(|&i| clean[i] != cut[i])
        .unwrap_or(clean.len());
    (clean, cut, i)
}

/// Flips a bit near the end of `key`, in a block rank 1 reads: rank 1's restore fails as an
/// integrity error naming the object (`object_key`) and the block. Returns the error's text.
async fn flipped_bit_fails_rank_1(
    counting: &Unreliable,
    store: &Store,
    key: &Path,
    object_key: &str,
) -> String {
    edit_stored(counting, key, |b| {
        let at = b.len() - 10;
        b[at] ^= 0x10;
    })
    .await;
    let err = restore_rank_of_3(store, 1).await.unwrap_err();
    assert!(err.is_integrity(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(object_key) && text.contains("block"),
        "{text}"
    );
    text
}

/// A rank that needs part of a raw chunk (row-sharded state re-cut for another world size)
/// reads only the 256 KiB blocks that hold it, as one ranged GET per run of blocks. A body that
/// breaks off is resumed from the first block not yet checked, never before it; what lands is
/// bitwise the rows the rank needs; and a flipped bit in a block the rank reads fails the step
/// with the block named.
#[tokio::test]
async fn a_partly_needed_chunk_is_read_in_checked_blocks_resumed_at_a_block() {
    use checkpoint::format::CHECK_BLOCK_BYTES;

    let counting = Arc::new(Unreliable::with_probability(0, 0.0));
    let (store, [w, emb], m) = two_writers_rows(&counting, false, 1).await;
    assert!(m.objects.iter().all(|o| !o.block_crc32c.is_empty()));
    let restore = |rank: u32| restore_rank_of_3(&store, rank);
    let check = |rank: u32, got: &[u8]| check_rows_of_3(rank, got, [&w, &emb]);
    let needed = (w.data.len() + emb.data.len()) as u64 / 3;
    for rank in 0..3 {
        let before = store.read_stats().bytes;
        let got = restore(rank).await.unwrap();
        check(rank, &got);
        let read = store.read_stats().bytes - before;
        // Each tensor's rows lie in at most two writers' files: at most one block more at
        // each end of each of those ranges, and the manifest.
        assert!(
            read <= needed + 8 * CHECK_BLOCK_BYTES + 64 * 1024,
            "rank {rank} read {read} bytes for {needed} needed"
        );
    }

    // Rank 1 needs writer 0's rows from 1000 of `w` and on: its first ranged GET of that
    // chunk breaks off a block and a half in, and the read resumes from the end of the first block,
    // which was checked and written: one GET more than without the cut, starting a block
    // after the one cut.
    let first = m
        .objects
        .iter()
        .find(|o| o.key.contains("/rank-0-"))
        .unwrap();
    let key = Path::from(format!("ck/{}", first.key));
    let (clean, cut, i) = starts_clean_and_cut(&counting, &store, &key, [&w, &emb]).await;
    assert!(
        clean.iter().all(|s| s % CHECK_BLOCK_BYTES == 0),
        "ranged GETs start at blocks: {clean:?}"
    );
    assert!(
        i > 0
            && cut.len() == clean.len() + 1
            && cut[i] == cut[i - 1] + CHECK_BLOCK_BYTES
            && cut[i + 1..] == clean[i..],
        "one GET resumed a block after the cut one's start: {clean:?} then {cut:?}"
    );
    let text = flipped_bit_fails_rank_1(&counting, &store, &key, &first.key).await;
    assert!(text.contains("crc32c"), "{text}");
}

/// The same for compressed chunks (`zstd-blocks`, what a remote store gets by default): a rank
/// that needs part of a chunk reads only the stored bytes of the blocks that hold it, decodes
/// each block alone and checks it before a byte of it goes out. A body that breaks off resumes
/// at the stored start of the first block not yet checked; a flipped bit in a block the rank
/// reads fails the step with the block named.
#[tokio::test]
async fn a_partly_needed_compressed_chunk_is_read_in_decoded_checked_blocks() {
    use checkpoint::codec::Codec;
    use checkpoint::format::CHECK_BLOCK_BYTES;

    let counting = Arc::new(Unreliable::with_probability(0, 0.0));
    let (store, [w, emb], m) = two_writers_rows(&counting, true, 3).await;
    assert!(
        m.objects
            .iter()
            .all(|o| matches!(o.codec, Codec::ZstdBlocks { .. })
                && o.block_crc32c.len() as u64 == o.raw_bytes.div_ceil(CHECK_BLOCK_BYTES)),
        "every chunk compressed in blocks"
    );
    let stored_total: u64 = m.objects.iter().map(|o| o.stored_bytes).sum();
    let restore = |rank: u32| restore_rank_of_3(&store, rank);
    let check = |rank: u32, got: &[u8]| check_rows_of_3(rank, got, [&w, &emb]);
    for rank in 0..3 {
        let before = store.read_stats().bytes;
        check(rank, &restore(rank).await.unwrap());
        let read = store.read_stats().bytes - before;
        // A third of the stored bytes, and at most a block more at each end of each range
        // (a stored block is never larger than its decoded bytes and a small header).
        assert!(
            read <= stored_total / 3 + 8 * (CHECK_BLOCK_BYTES + 64) + 64 * 1024,
            "rank {rank} read {read} of {stored_total} stored bytes"
        );
    }

    // Ranged GETs start where blocks are stored; a cut one resumes at a later block's start.
    let first = m
        .objects
        .iter()
        .find(|o| o.key.contains("/rank-0-"))
        .unwrap();
    let starts: Vec<u64> = first
        .codec
        .stored_blocks(first.raw_bytes)
        .unwrap()
        .iter()
        .map(|r| r.0)
        .collect();
    let key = Path::from(format!("ck/{}", first.key));
    let (clean, cut, i) = starts_clean_and_cut(&counting, &store, &key, [&w, &emb]).await;
    assert!(
        i > 0
            && cut.len() == clean.len() + 1
            && cut[i] > cut[i - 1]
            && starts.contains(&cut[i])
            && cut[i + 1..] == clean[i..],
        "the cut GET resumed at a later block's stored start: {clean:?} then {cut:?}"
    );
    flipped_bit_fails_rank_1(&counting, &store, &key, &first.key).await;
}
