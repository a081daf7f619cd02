//! gc never deletes the newest step that verifies. With steps 1, 2 and 3 and `keep_last` 1, a
//! newest step with one flipped bit in a chunk, or whose manifest is the text `{bad`, is kept
//! for inspection and step 2 is kept as the newest step that verifies, restorable; step 1 goes.
//! On memory, file:// and S3 (moto). A store error while checking aborts gc before it deletes
//! anything.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use checkpoint::retention::{GcCheck, GcDecision, GcReason, GcReport};
use checkpoint::{Error, ReadOptions, RetentionPolicy, Store};
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use crate::common::{self, cancel};

use GcDecision::{DeleteCommitted, Keep};
use GcReason::{NewestVerified, NotVerifyingNewer, UncheckedOutsideRetention};

/// A checkpoint store and a raw handle on the same objects, to tamper with.
struct Backend {
    store: Store,
    raw: Arc<dyn ObjectStore>,
    prefix: String,
}

impl Backend {
    fn memory() -> Backend {
        let mem = Arc::new(InMemory::new());
        Backend {
            store: Store::from_object_store(mem.clone(), "ck", "memory://ck"),
            raw: mem,
            prefix: "ck".into(),
        }
    }

    fn file(root: &std::path::Path, case: &str) -> Backend {
        let dir = root.join(case);
        std::fs::create_dir_all(&dir).unwrap();
        Backend {
            store: Store::open(&format!("file://{}", dir.display())).unwrap(),
            raw: Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&dir).unwrap()),
            prefix: String::new(),
        }
    }

    fn s3(opts: &[(String, String)], case: &str) -> Backend {
        use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
        let mut b = AmazonS3Builder::new().with_bucket_name("ckpt");
        for (k, v) in opts {
            b = b.with_config(k.parse::<AmazonS3ConfigKey>().unwrap(), v.clone());
        }
        Backend {
            store: Store::open_with_options(&format!("s3://ckpt/{case}"), opts.to_vec()).unwrap(),
            raw: Arc::new(b.build().unwrap()),
            prefix: case.into(),
        }
    }

    fn path(&self, key: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(key)
        } else {
            ObjPath::from(format!("{}/{key}", self.prefix))
        }
    }

    async fn get(&self, key: &str) -> Vec<u8> {
        let r = self.raw.get(&self.path(key)).await.unwrap();
        r.bytes().await.unwrap().to_vec()
    }

    async fn put(&self, key: &str, data: Vec<u8>) {
        self.raw
            .put(&self.path(key), PutPayload::from(data))
            .await
            .unwrap();
    }
}

fn policy(keep_last: usize, check: GcCheck) -> RetentionPolicy {
    RetentionPolicy {
        keep_last,
        keep_every: None,
        leftover_age_ms_min: 0,
        check,
        pinned: None,
    }
}

fn decisions(r: &GcReport) -> Vec<(u64, GcDecision, GcReason)> {
    r.items
        .iter()
        .map(|i| (i.step, i.decision, i.reason))
        .collect()
}

async fn three_steps(store: &Store) -> Vec<(String, Bytes)> {
    let mut files = Vec::new();
    for step in 1..=3 {
        files = common::push_files(store, step).await;
    }
    files
}

/// Step 2 pulls byte-identical, and restoring "the newest" lands on it, skipping step 3.
async fn assert_step_2_restores(store: &Store, files: &[(String, Bytes)]) {
    let dir = tempfile::tempdir().unwrap();
    store
        .pull(2, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    common::assert_dir_has(dir.path(), files);
    let dir = tempfile::tempdir().unwrap();
    let r = store
        .restore(None, 0, 1, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!((r.step, r.skipped_steps), (2, vec![3]));
}

async fn gc_keeps_the_step_before_a_newest_with_a_flipped_bit(b: &Backend) {
    let files = three_steps(&b.store).await;
    let key = b.store.read_manifest(3, &cancel()).await.unwrap().objects[0]
        .key
        .clone();
    let mut data = b.get(&key).await;
    let mid = data.len() / 2;
    data[mid] ^= 0x04;
    b.put(&key, data).await;

    // The cheap check cannot see a flipped bit: it would keep step 3 alone.
    let r = b
        .store
        .gc(&policy(1, GcCheck::Present), true, &cancel())
        .await
        .unwrap();
    assert_eq!(
        decisions(&r),
        [
            (1, DeleteCommitted, UncheckedOutsideRetention),
            (2, DeleteCommitted, UncheckedOutsideRetention),
            (3, Keep, NewestVerified),
        ]
    );
    assert_eq!(
        b.store.committed_steps(&cancel()).await.unwrap(),
        [1, 2, 3],
        "a dry run deletes nothing"
    );

    // The full check sees it, and keeps step 2.
    let r = b
        .store
        .gc(&policy(1, GcCheck::Full), false, &cancel())
        .await
        .unwrap();
    assert_eq!(
        decisions(&r),
        [
            (1, DeleteCommitted, UncheckedOutsideRetention),
            (2, Keep, NewestVerified),
            (3, Keep, NotVerifyingNewer),
        ]
    );
    assert_eq!(r.not_verifying.len(), 1);
    assert_eq!(r.not_verifying[0].step, 3);
    assert!(
        r.not_verifying[0].error.contains(&key),
        "{}",
        r.not_verifying[0].error
    );
    assert!(r.objects_deleted > 0);
    assert_eq!(b.store.steps(&cancel()).await.unwrap(), [2, 3]);
    assert_step_2_restores(&b.store, &files).await;
    // Again: nothing more goes.
    let r = b
        .store
        .gc(&policy(1, GcCheck::Full), false, &cancel())
        .await
        .unwrap();
    assert_eq!(r.objects_deleted, 0);
    assert_eq!(b.store.steps(&cancel()).await.unwrap(), [2, 3]);
}

async fn gc_keeps_the_step_before_a_newest_with_a_garbled_manifest(b: &Backend) {
    let files = three_steps(&b.store).await;
    b.put(&checkpoint::format::manifest_key(3), b"{bad".to_vec())
        .await;
    let want = [
        (1, DeleteCommitted, UncheckedOutsideRetention),
        (2, Keep, NewestVerified),
        (3, Keep, NotVerifyingNewer),
    ];
    let r = b
        .store
        .gc(&policy(1, GcCheck::Full), true, &cancel())
        .await
        .unwrap();
    assert_eq!(decisions(&r), want);
    // The cheap check is enough for a manifest that does not read.
    let r = b
        .store
        .gc(&policy(1, GcCheck::Present), false, &cancel())
        .await
        .unwrap();
    assert_eq!(decisions(&r), want);
    assert_eq!(r.not_verifying.len(), 1);
    assert!(
        r.not_verifying[0].error.contains("manifest"),
        "{}",
        r.not_verifying[0].error
    );
    assert_eq!(b.store.committed_steps(&cancel()).await.unwrap(), [2, 3]);
    assert_eq!(b.store.steps(&cancel()).await.unwrap(), [2, 3]);
    assert_step_2_restores(&b.store, &files).await;
    let latest = b.store.latest_committed(&cancel()).await.unwrap().unwrap();
    assert_eq!(latest.step, 2);
}

async fn gc_keeps_every_committed_step_when_none_verifies(b: &Backend) {
    for step in 1..=2 {
        common::push_files(&b.store, step).await;
        b.put(&checkpoint::format::manifest_key(step), b"{bad".to_vec())
            .await;
    }
    let r = b
        .store
        .gc(&policy(1, GcCheck::Present), false, &cancel())
        .await
        .unwrap();
    assert_eq!(
        decisions(&r),
        [(1, Keep, NotVerifyingNewer), (2, Keep, NotVerifyingNewer)]
    );
    assert_eq!(r.objects_deleted, 0);
    assert_eq!(b.store.committed_steps(&cancel()).await.unwrap(), [1, 2]);
}

async fn run_cases(make: impl Fn(&str) -> Backend) {
    gc_keeps_the_step_before_a_newest_with_a_flipped_bit(&make("flip")).await;
    gc_keeps_the_step_before_a_newest_with_a_garbled_manifest(&make("garbled")).await;
    gc_keeps_every_committed_step_when_none_verifies(&make("none")).await;
}

#[tokio::test]
async fn gc_keeps_the_newest_verifying_step_memory() {
    run_cases(|_| Backend::memory()).await;
}

#[tokio::test]
async fn gc_keeps_the_newest_verifying_step_file() {
    let root = tempfile::tempdir().unwrap();
    run_cases(|case| Backend::file(root.path(), case)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_newest_verifying_step_s3_moto() {
    let moto = services::moto().unwrap();
    moto.create_bucket("ckpt").unwrap();
    let opts = services::s3_store_options(&moto.env());
    run_cases(|case| Backend::s3(&opts, case)).await;
}

/// Denies every read of one key, once it is set, and every listing of a step's data that would
/// show it: a store error, not an integrity error. Its listings also leave out the `hidden`
/// key, as a listing that lags behind the writes would.
#[derive(Debug, Default)]
struct Denies {
    inner: InMemory,
    key: std::sync::Mutex<Option<ObjPath>>,
    hidden: std::sync::Mutex<Option<ObjPath>>,
}

impl fmt::Display for Denies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Denies")
    }
}

#[async_trait]
impl ObjectStore for Denies {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &ObjPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if self.key.lock().unwrap().as_ref() == Some(location) {
            return Err(object_store::Error::PermissionDenied {
                path: location.to_string(),
                source: "injected: access denied".into(),
            });
        }
        self.inner.get_opts(location, options).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjPath>> {
        self.inner.delete_stream(locations)
    }
    /// A listing of a step's data that would show the denied key is denied too (gc's listing
    /// of whole step directories is not, so that its check gets to run).
    fn list(
        &self,
        prefix: Option<&ObjPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let denied = self.key.lock().unwrap().clone();
        if let Some(key) = denied
            && let Some(p) = prefix
            && p.as_ref().contains("/data")
            && key.prefix_match(p).is_some()
        {
            let err = object_store::Error::PermissionDenied {
                path: key.to_string(),
                source: "injected: listing denied".into(),
            };
            return Box::pin(futures::stream::once(async move { Err(err) }));
        }
        let hidden = self.hidden.lock().unwrap().clone();
        Box::pin(self.inner.list(prefix).filter(move |m| {
            let shown = !matches!((m, &hidden), (Ok(m), Some(h)) if &m.location == h);
            std::future::ready(shown)
        }))
    }
    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// A chunk that a listing leaves out, as one that lags behind the writes would, gets a HEAD of
/// its own before its step counts as lost: the newest step stays the newest, and gc's cheap
/// check keeps it.
#[tokio::test]
async fn a_chunk_a_listing_leaves_out_is_asked_for_before_its_step_counts_as_lost() {
    let denies = Arc::new(Denies::default());
    let store = Store::from_object_store(denies.clone(), "ck", "memory://ck");
    three_steps(&store).await;
    let m = store.read_manifest(3, &cancel()).await.unwrap();
    assert!(m.objects.len() >= 2, "enough chunks to list");
    // What finding the newest step asks of the store, with the listing whole, then with a
    // chunk left out of it: one HEAD more, that chunk's.
    let mut asked = Vec::new();
    for hide in [false, true] {
        *denies.hidden.lock().unwrap() =
            hide.then(|| ObjPath::from(format!("ck/{}", m.objects[0].key)));
        let before = store.read_stats();
        let latest = store.latest_committed(&cancel()).await.unwrap().unwrap();
        let after = store.read_stats();
        assert_eq!(latest.step, 3, "hidden {hide}");
        asked.push((after.heads - before.heads, after.lists - before.lists));
    }
    assert_eq!(asked[0].1, 1, "one listing of the step's data");
    assert_eq!(asked[1], (asked[0].0 + 1, 1), "the hidden chunk's HEAD");
    let report = store
        .gc(&policy(1, GcCheck::Present), false, &cancel())
        .await
        .unwrap();
    assert!(report.not_verifying.is_empty(), "{report:?}");
    assert_eq!(store.committed_steps(&cancel()).await.unwrap(), [3]);
}

#[tokio::test]
async fn a_store_error_while_checking_aborts_gc_before_any_delete() {
    // The newest manifest (read first), a chunk of the newest step (the cheap check lists the
    // step's data, the full one reads the chunk), and the manifest of step 2 behind a garbled
    // step 3 (checked once 3 fails).
    for case in ["manifest", "chunk", "after_a_failed_step"] {
        let denies = Arc::new(Denies::default());
        let store = Store::from_object_store(denies.clone(), "ck", "memory://ck");
        three_steps(&store).await;
        let key = match case {
            "manifest" => checkpoint::format::manifest_key(3),
            "chunk" => store.read_manifest(3, &cancel()).await.unwrap().objects[0]
                .key
                .clone(),
            _ => {
                let key = checkpoint::format::manifest_key(3);
                denies
                    .inner
                    .put(
                        &ObjPath::from(format!("ck/{key}")),
                        PutPayload::from_static(b"{bad"),
                    )
                    .await
                    .unwrap();
                checkpoint::format::manifest_key(2)
            }
        };
        *denies.key.lock().unwrap() = Some(ObjPath::from(format!("ck/{key}")));
        for check in [GcCheck::Present, GcCheck::Full] {
            let err = store
                .gc(&policy(1, check), false, &cancel())
                .await
                .unwrap_err();
            assert!(!err.is_integrity(), "{case}: {err}");
            assert!(matches!(err, Error::Store { .. }), "{case}: {err}");
            assert!(err.to_string().contains("denied"), "{case}: {err}");
            if case == "chunk" {
                // Denied by the check itself, not before it.
                let by = match check {
                    GcCheck::Present => checkpoint::format::data_root(3),
                    GcCheck::Full => key.clone(),
                };
                assert!(err.to_string().contains(&by), "{check:?}: {err}");
            }
        }
        *denies.key.lock().unwrap() = None;
        assert_eq!(
            store.committed_steps(&cancel()).await.unwrap(),
            [1, 2, 3],
            "{case}: nothing deleted"
        );
        assert_eq!(store.steps(&cancel()).await.unwrap(), [1, 2, 3], "{case}");
    }
}
