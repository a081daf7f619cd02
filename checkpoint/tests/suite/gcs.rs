//! `gs://` through fake-gcs-server. It serves GCS's JSON API only, and object_store writes
//! through the XML API, so the step is written elsewhere and seeded object by object; every
//! read path (ls, latest, verify, pull, restore, cp out) runs against `gs://`.

use std::sync::Arc;

use checkpoint::{ReadOptions, Store};
use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::common::{self, cancel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcs_reads_a_seeded_step_and_pulls_it_byte_identical() {
    let mem = Arc::new(InMemory::new());
    let src = Store::from_object_store(mem.clone(), "job", "memory://job");
    let files = common::push_files(&src, 7).await;

    let gcs = services::fake_gcs().unwrap();
    gcs.create_bucket("ckpt").unwrap();
    let all: Vec<object_store::ObjectMeta> = mem.list(None).try_collect().await.unwrap();
    for meta in all {
        let data = mem
            .get(&meta.location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        gcs.seed("ckpt", meta.location.as_ref(), &data).unwrap();
    }
    let store = Store::open_with_options(
        "gs://ckpt/job",
        [
            ("google_service_account_key", gcs.service_account_key()),
            ("allow_http", "true".to_string()),
        ],
    )
    .unwrap();
    assert_eq!(store.committed_steps(&cancel()).await.unwrap(), vec![7]);
    assert_eq!(
        store
            .latest_committed(&cancel())
            .await
            .unwrap()
            .unwrap()
            .step,
        7
    );
    assert!(
        store
            .verify(7, &ReadOptions::default(), &cancel())
            .await
            .unwrap()
            .bad
            .is_empty()
    );
    let dir = tempfile::tempdir().unwrap();
    store
        .pull(7, dir.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    common::assert_dir_has(dir.path(), &files);
    let out = tempfile::tempdir().unwrap();
    let r = store
        .restore(None, 0, 1, out.path(), &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    assert_eq!(r.step, 7);
}
