//! The ground the rest stands on: each real service answers the calls elastic-run makes of it.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_client::{Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions};
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions as OsPutOptions,
    PutPayload,
};

const WAIT_MS: u64 = 5_000;

#[tokio::test]
async fn etcd_lease_watch_and_txn_work() {
    let etcd = services::etcd().expect("etcd starts");
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();

    // A watch on the prefix sees the put and, after the lease is revoked, the delete.
    let mut stream = client
        .watch("/job/", Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();
    let lease = client.lease_grant(1, None).await.unwrap().id();
    client
        .put(
            "/job/members/a",
            "a",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();

    // Create-only transaction: the first wins, the second sees the key exists.
    let create = |v: &'static str| {
        Txn::new()
            .when([Compare::create_revision("/job/leader", CompareOp::Equal, 0)])
            .and_then([TxnOp::put("/job/leader", v, None)])
    };
    assert!(client.txn(create("first")).await.unwrap().succeeded());
    assert!(!client.txn(create("second")).await.unwrap().succeeded());
    let got = client.get("/job/leader", None).await.unwrap();
    assert_eq!(got.kvs()[0].value(), b"first");

    let (mut keeper, mut responses) = client.lease_keep_alive(lease).await.unwrap();
    keeper.keep_alive().await.unwrap();
    let ka = tokio::time::timeout(Duration::from_millis(WAIT_MS), responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(ka.id(), lease);
    assert!(ka.ttl() >= 1);

    client.lease_revoke(lease).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let resp = tokio::time::timeout(Duration::from_millis(WAIT_MS), stream.message())
            .await
            .expect("watch event within the wait")
            .unwrap()
            .unwrap();
        for e in resp.events() {
            let key = e.kv().unwrap().key_str().unwrap().to_string();
            if key.starts_with("/job/members/") {
                seen.push((e.event_type(), key));
            }
        }
    }
    assert_eq!(seen[0], (EventType::Put, "/job/members/a".to_string()));
    assert_eq!(seen[1], (EventType::Delete, "/job/members/a".to_string()));
}

#[tokio::test]
async fn etcd_lease_expires_without_keepalive() {
    let etcd = services::etcd().expect("etcd starts");
    let mut client = Client::connect([etcd.endpoint()], None).await.unwrap();
    let lease = client.lease_grant(1, None).await.unwrap().id();
    client
        .put("/k", "v", Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    let start = std::time::Instant::now();
    loop {
        if client.get("/k", None).await.unwrap().kvs().is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A 1 s TTL expires after at least ~1 s (fast election timing honours it).
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
}

/// The operations every checkpoint backend needs, checked against one store.
async fn store_conformance(store: Arc<dyn ObjectStore>, multipart_part_bytes: usize) {
    let path = Path::from("ckpt/a/object.bin");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();

    // put, get, ranged get
    store
        .put(&path, PutPayload::from(data.clone()))
        .await
        .unwrap();
    let got = store.get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got.as_ref(), &data[..]);
    let ranged = store
        .get_opts(
            &path,
            GetOptions::default().with_range(Some(GetRange::Bounded(1000..1500))),
        )
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(ranged.as_ref(), &data[1000..1500]);

    // multipart: two full parts and a short tail
    let big_path = Path::from("ckpt/a/big.bin");
    let big: Vec<u8> = (0..multipart_part_bytes * 2 + 12_345)
        .map(|i| (i % 253) as u8)
        .collect();
    let mut upload = store.put_multipart(&big_path).await.unwrap();
    for part in big.chunks(multipart_part_bytes) {
        upload
            .put_part(PutPayload::from(Bytes::copy_from_slice(part)))
            .await
            .unwrap();
    }
    upload.complete().await.unwrap();
    let got = store.get(&big_path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got.len(), big.len());
    assert!(got.as_ref() == &big[..], "multipart content differs");

    // create-only put: the second one is refused and the first content stays
    let manifest = Path::from("ckpt/a/manifest.json");
    let create = OsPutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };
    store
        .put_opts(&manifest, PutPayload::from_static(b"first"), create.clone())
        .await
        .unwrap();
    let second = store
        .put_opts(&manifest, PutPayload::from_static(b"second"), create)
        .await;
    assert!(
        matches!(second, Err(object_store::Error::AlreadyExists { .. })),
        "{second:?}"
    );
    let got = store.get(&manifest).await.unwrap().bytes().await.unwrap();
    assert_eq!(got.as_ref(), b"first");
}

#[tokio::test]
async fn local_filesystem_store_supports_checkpoint_operations() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    store_conformance(Arc::new(store), 1 << 20).await;
}

#[tokio::test]
async fn s3_store_supports_checkpoint_operations() {
    let moto = services::moto().expect("moto starts");
    moto.create_bucket("ckpt").unwrap();
    let store = AmazonS3Builder::new()
        .with_bucket_name("ckpt")
        .with_endpoint(moto.endpoint())
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id("testing")
        .with_secret_access_key("testing")
        .build()
        .unwrap();
    // S3 requires 5 MiB parts but the last.
    store_conformance(Arc::new(store), 5 << 20).await;
}

#[tokio::test]
async fn azure_store_supports_checkpoint_operations() {
    let azurite = services::azurite().expect("azurite starts");
    azurite.create_container("ckpt").unwrap();
    let mut builder = MicrosoftAzureBuilder::new().with_container_name("ckpt");
    for (k, v) in azurite.env() {
        builder = builder.with_config(k.to_lowercase().parse().unwrap(), v);
    }
    store_conformance(Arc::new(builder.build().unwrap()), 1 << 20).await;
}

#[tokio::test]
async fn gcs_store_reads_seeded_objects() {
    let gcs = services::fake_gcs().expect("fake-gcs-server starts");
    gcs.create_bucket("ckpt").unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 241) as u8).collect();
    gcs.seed("ckpt", "steps/1/chunk.bin", &data).unwrap();
    gcs.seed("ckpt", "steps/1/manifest.json", b"{}").unwrap();
    let store = GoogleCloudStorageBuilder::new()
        .with_bucket_name("ckpt")
        .with_service_account_key(gcs.service_account_key())
        .with_client_options(object_store::ClientOptions::new().with_allow_http(true))
        .build()
        .unwrap();
    let path = Path::from("steps/1/chunk.bin");
    let got = store.get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got.as_ref(), &data[..]);
    let head = store.head(&path).await.unwrap();
    assert_eq!(head.size, data.len() as u64);
    let ranged = store
        .get_opts(
            &path,
            GetOptions::default().with_range(Some(GetRange::Bounded(100..200))),
        )
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(ranged.as_ref(), &data[100..200]);
    use futures::TryStreamExt;
    let mut listed: Vec<String> = store
        .list(Some(&Path::from("steps/1")))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    listed.sort();
    assert_eq!(listed, ["steps/1/chunk.bin", "steps/1/manifest.json"]);
}

#[test]
fn gloo_all_reduce_runs_across_two_processes() {
    let python = services::paths::python().expect("worker environment installed");
    let port = services::free_port().unwrap();
    let script = r#"
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} sum={t.item()}")
dist.destroy_process_group()
"#;
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&python)
                .args(["-c", script])
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("OMP_NUM_THREADS", "1")
                .output_async()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(&format!("rank={rank} sum=3.0")), "{stdout}");
    }
}

/// Spawns with piped output, so that two ranks run at once.
trait OutputAsync {
    fn output_async(&mut self) -> std::process::Child;
}

impl OutputAsync for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }
}

#[cfg(feature = "tch")]
#[test]
fn tch_tensor_saved_as_safetensors_is_read_by_python() {
    use tch::{Device, Kind, Tensor, nn};
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vs.safetensors");
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let mut w = root.var("weight", &[2, 3], nn::Init::Const(0.0));
    tch::no_grad(|| {
        w.copy_(&Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]));
    });
    vs.save(&file).unwrap();
    let python = services::paths::python().unwrap();
    let out = Command::new(python)
        .args([
            "-c",
            "import sys; from safetensors.torch import load_file; t = load_file(sys.argv[1])['weight']; print(t.shape, t.flatten().tolist())",
        ])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("torch.Size([2, 3]) [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"),
        "{stdout}"
    );
}
