//! `StoreSink` against real stores: `file://` and S3 (moto). Two sinks play two nodes of one
//! job (ranks 0-1 and 2-3 of a world of 4) and race to commit the same step; restores at other
//! world sizes must give every rank exactly the tensors the four ranks staged. Staging comes
//! from the real Python client (`elastic_run.save`), and the Python client loads what the
//! restore laid out. A service that does not start fails the test; nothing skips.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use checkpoint::{CancellationToken, Store};
use runtime::pipeline::{SinkError, SinkOptions, StepToCommit, StoreSink};
use runtime::state::StagedPart;
use runtime::worker_env::ResumePoint;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

/// The `elastic_run` package.
fn client_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The Python worker environment, with nothing of elastic-run's own leaking in.
fn python() -> Command {
    let mut c = Command::new(services::paths::python().expect("the test venv's python"));
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("ELASTIC_") || k.starts_with("PET_") {
            c.env_remove(&k);
        }
    }
    c.env("OMP_NUM_THREADS", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    c
}

fn run_python(mut c: Command, what: &str) -> String {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    stdout
}

/// The model every script builds: `seed` 0 is the trained one.
const MODEL_PY: &str = r#"
import os, sys
sys.path.insert(0, os.environ["CLIENT_DIR"])
import torch
import elastic_run as er

def make(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for _ in range(3):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    return m, o
"#;

/// Every rank of a `world` saves `step` through the real client into `staging`.
fn stage_with_python(staging: &Path, step: u64, world: u32) -> PathBuf {
    let script = format!(
        r#"{MODEL_PY}
model, opt = make(0)
for r in range({world}):
    os.environ["RANK"] = str(r)
    os.environ["WORLD_SIZE"] = "{world}"
    er.save({step}, model=model, optimizer=opt, extra={{"data_pos": 1234, "rng": torch.arange(5)}})
"#
    );
    let mut c = python();
    c.env("CLIENT_DIR", client_dir())
        .env("ELASTIC_STAGING_DIR", staging)
        .args(["-c", &script]);
    run_python(c, "staging with elastic_run.save");
    staging.join(format!("step-{step}"))
}

/// A tensor: dtype, shape, bytes.
type Tensor = (Dtype, Vec<usize>, Vec<u8>);

fn read_tensors(path: &Path) -> BTreeMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// The union of what every rank of a staged step holds; no tensor twice.
fn staged_union(step_dir: &Path, world: u32) -> BTreeMap<String, Tensor> {
    let mut all = BTreeMap::new();
    for r in 0..world {
        for (n, t) in read_tensors(&step_dir.join(format!("rank-{r}/tensors.safetensors"))) {
            assert!(all.insert(n.clone(), t).is_none(), "{n} staged twice");
        }
    }
    assert!(!all.is_empty());
    all
}

fn parts(step_dir: &Path, step: u64, ranks: std::ops::Range<u32>) -> Vec<StagedPart> {
    ranks
        .map(|rank| StagedPart {
            rank,
            step,
            dir: step_dir.join(format!("rank-{rank}")),
        })
        .collect()
}

fn to_commit(step_dir: &Path, step: u64, ranks: std::ops::Range<u32>, node: &str) -> StepToCommit {
    StepToCommit {
        step,
        generation: 1,
        world_size: 4,
        parts: parts(step_dir, step, ranks),
        agent_metadata: json!({"node": node, "generation": 1, "world_size": 4}),
    }
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

/// Where a test's checkpoints go: a URL and the backend options to reach it.
struct Backend {
    url: String,
    config: Vec<(String, String)>,
    _moto: Option<services::Moto>,
}

fn file_backend(tmp: &Path) -> Backend {
    Backend {
        url: format!("file://{}", tmp.join("bucket").display()),
        config: vec![],
        _moto: None,
    }
}

fn s3_backend() -> Backend {
    let moto = services::moto().expect("moto must start (run tests/services/setup.sh)");
    moto.create_bucket("ckpt").unwrap();
    let config = moto
        .env()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    Backend {
        url: "s3://ckpt/job".into(),
        config,
        _moto: Some(moto),
    }
}

impl Backend {
    fn options(&self) -> SinkOptions {
        SinkOptions {
            commit_wait_ms: 60_000,
            retry_pause_ms: 50,
            store_config: self.config.clone(),
            ..Default::default()
        }
    }

    fn sink(&self, restore_root: PathBuf) -> StoreSink {
        StoreSink::open(&self.url, restore_root, self.options()).unwrap()
    }

    fn store(&self) -> Store {
        Store::open_with_options(&self.url, self.config.clone()).unwrap()
    }
}

/// The conformance case: two nodes race, one commits, any world restores the union.
fn two_nodes_commit_once_and_restore_the_union(backend: &Backend, tmp: &Path) -> [PathBuf; 2] {
    let staged = stage_with_python(&tmp.join("staging"), 10, 4);
    let union = staged_union(&staged, 4);
    let state = read_json(&staged.join("rank-0/meta.json"))["state"].clone();
    assert_eq!(state["extra"]["data_pos"], 1234);
    let a = backend.sink(tmp.join("node-a/restore"));
    let b = backend.sink(tmp.join("node-b/restore"));
    let c = CancellationToken::new();
    rt().block_on(async {
        let (ra, rb) = tokio::join!(
            a.commit(to_commit(&staged, 10, 0..2, "a"), &c),
            b.commit(to_commit(&staged, 10, 2..4, "b"), &c)
        );
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert!(
            ra.by_this_node != rb.by_this_node,
            "exactly one node writes the manifest: {ra:?} {rb:?}"
        );
        assert!(ra.bytes > 0 && rb.bytes > 0, "{ra:?} {rb:?}");
        assert_eq!((ra.step, rb.step), (10, 10));

        let store = backend.store();
        assert_eq!(store.committed_steps(&c).await.unwrap(), vec![10]);
        let m = store.read_manifest(10, &c).await.unwrap();
        let mut writers: Vec<&str> = m.parts.iter().map(|p| p.writer.as_str()).collect();
        writers.sort_unstable();
        assert_eq!(
            writers,
            ["g1-rank-0", "g1-rank-1", "g1-rank-2", "g1-rank-3"]
        );
        let winner = if ra.by_this_node { "a" } else { "b" };
        assert_eq!(m.metadata["elastic"]["node"], winner);
        assert_eq!(m.metadata["state"], state);
        assert_eq!(a.latest_step(&c).await.unwrap(), Some(10));
        assert_eq!(b.latest_step(&c).await.unwrap(), Some(10));

        // World 2 on node a, world 3 on node b: every rank gets every (replicated) tensor.
        let pa = a.restore(10, 0..2, 2, &c).await.unwrap();
        let pb = b.restore(10, 1..3, 3, &c).await.unwrap();
        assert_eq!(pa.dir, tmp.join("node-a/restore/step-10"));
        for (p, ranks, world) in [(&pa, 0..2u32, 2u32), (&pb, 1..3, 3)] {
            assert_eq!(p.step, 10);
            for r in ranks {
                let d = p.dir.join(format!("rank-{r}"));
                assert_eq!(read_tensors(&d.join("state.safetensors")), union, "{d:?}");
                let md = read_json(&d.join("metadata.json"));
                assert_eq!(md["step"], 10);
                assert_eq!(
                    (md["rank"].as_u64(), md["world_size"].as_u64()),
                    (Some(r.into()), Some(world.into()))
                );
                assert_eq!(md["metadata"]["state"], state);
            }
        }
        [pa.dir, staged]
    })
}

#[test]
fn two_nodes_commit_a_step_once_on_file_and_any_world_restores_it() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let [restored, staged] = two_nodes_commit_once_and_restore_the_union(&backend, tmp.path());

    // The Python client loads the restored layout: the same model, optimizer and extra state
    // as loading the staged snapshot directly.
    let script = format!(
        r#"{MODEL_PY}
a, ao = make(1)
step, extra = er.load(model=a, optimizer=ao)
b, bo = make(2)
step_b, _ = er.load(model=b, optimizer=bo, resume_dir=os.environ["STAGED"])
ref, _ = make(0)
assert step == step_b == 10, (step, step_b)
for (k, v), w, r in zip(a.state_dict().items(), b.state_dict().values(), ref.state_dict().values()):
    assert torch.equal(v, w) and torch.equal(v, r), k
sa, sb = ao.state_dict()["state"], bo.state_dict()["state"]
assert sa.keys() == sb.keys() and sa
for i in sa:
    for k in sa[i]:
        x, y = sa[i][k], sb[i][k]
        assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), (i, k)
assert extra["data_pos"] == 1234 and torch.equal(extra["rng"], torch.arange(5)), extra
print("loaded", step)
"#
    );
    let mut c = python();
    c.env("CLIENT_DIR", client_dir())
        .env("ELASTIC_RESUME_DIR", &restored)
        .env("ELASTIC_RESUME_STEP", "10")
        .env("STAGED", &staged)
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .args(["-c", &script]);
    let out = run_python(c, "elastic_run.load of the restored step");
    assert!(out.contains("loaded 10"), "{out}");
}

#[test]
fn two_nodes_commit_a_step_once_on_s3() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = s3_backend();
    two_nodes_commit_once_and_restore_the_union(&backend, tmp.path());
}

/// A staged part as the worker clients write it, from Rust: `tensors` plus `meta.json`.
fn stage_rust(
    step_dir: &Path,
    step: u64,
    rank: u32,
    world: u32,
    tensors: &[(String, Tensor)],
    shards: Option<Value>,
) {
    let d = step_dir.join(format!("rank-{rank}"));
    std::fs::create_dir_all(&d).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (dt, shape, data))| {
            (
                n.clone(),
                TensorView::new(*dt, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let info = shards
        .map(|s| std::collections::HashMap::from([("elastic.shards".to_string(), s.to_string())]));
    safetensors::serialize_to_file(views, info, &d.join("tensors.safetensors")).unwrap();
    let keys: Vec<&String> = tensors.iter().map(|(n, _)| n).collect();
    let meta = json!({"format_version": 1, "step": step, "rank": rank, "world_size": world,
        "keys": keys, "state": {"extra": {"pos": step}}});
    std::fs::write(d.join("meta.json"), meta.to_string()).unwrap();
}

fn f32s(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Replicated tensors only: `w<r>` of 4 floats per rank.
fn stage_dense(step_dir: &Path, step: u64) {
    for r in 0..4u32 {
        let t = (
            Dtype::F32,
            vec![4],
            f32s((0..4).map(|i| (r * 10 + i) as f32)),
        );
        stage_rust(step_dir, step, r, 4, &[(format!("model/w{r}"), t)], None);
    }
}

fn commit_both(a: &StoreSink, b: &StoreSink, step_dir: &Path, step: u64, c: &CancellationToken) {
    rt().block_on(async {
        let (ra, rb) = tokio::join!(
            a.commit(to_commit(step_dir, step, 0..2, "a"), c),
            b.commit(to_commit(step_dir, step, 2..4, "b"), c)
        );
        assert!(ra.unwrap().by_this_node != rb.unwrap().by_this_node);
    });
}

#[test]
fn a_lone_node_cannot_commit_and_names_the_missing_writers() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let staged = tmp.path().join("staging/step-4");
    stage_dense(&staged, 4);
    let opts = SinkOptions {
        commit_wait_ms: 500,
        retry_pause_ms: 50,
        ..Default::default()
    };
    let sink = StoreSink::open(&backend.url, tmp.path().join("restore"), opts.clone()).unwrap();
    let c = CancellationToken::new();
    rt().block_on(async {
        let t = Instant::now();
        let e = sink
            .commit(to_commit(&staged, 4, 0..2, "a"), &c)
            .await
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, SinkError::Incomplete { step: 4, .. }), "{msg}");
        for want in ["step 4", "g1-rank-2", "g1-rank-3", "bucket", "500 ms"] {
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
        }
        assert!(!msg.contains("g1-rank-0"), "{msg}");
        assert!(t.elapsed() >= Duration::from_millis(500));
        assert_eq!(sink.latest_step(&c).await.unwrap(), None);

        // Waiting for ever, the commit still ends at once when cancelled.
        let patient = StoreSink::open(
            &backend.url,
            tmp.path().join("restore"),
            SinkOptions {
                commit_wait_ms: 3_600_000,
                ..opts
            },
        )
        .unwrap();
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            c2.cancel();
        });
        let t = Instant::now();
        let e = patient
            .commit(to_commit(&staged, 4, 0..2, "a"), &cancel)
            .await
            .unwrap_err();
        assert!(e.is_cancelled(), "{e}");
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(e.to_string().contains("step 4"), "{e}");
    });
    // The other node arrives late: now the step commits, and the early node's parts count.
    let other = StoreSink::open(&backend.url, tmp.path().join("r2"), backend.options()).unwrap();
    let done = rt()
        .block_on(other.commit(to_commit(&staged, 4, 2..4, "b"), &c))
        .unwrap();
    assert!(done.by_this_node);
}

#[test]
fn a_second_restore_of_a_dense_step_reuses_local_bytes_at_any_world() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let staged = tmp.path().join("staging/step-6");
    stage_dense(&staged, 6);
    let union = staged_union(&staged, 4);
    let root = tmp.path().join("restore");
    let a = backend.sink(root.clone());
    let b = backend.sink(tmp.path().join("rb"));
    let c = CancellationToken::new();
    commit_both(&a, &b, &staged, 6, &c);
    // An older restore is removed by a newer one.
    std::fs::create_dir_all(root.join("step-2/rank-0")).unwrap();

    let first = rt().block_on(a.restore(6, 0..2, 2, &c)).unwrap();
    assert!(!root.join("step-2").exists(), "older restored step kept");
    let ino = |r: u32| {
        std::fs::metadata(first.dir.join(format!("rank-{r}/state.safetensors")))
            .unwrap()
            .ino()
    };
    assert_eq!(
        ino(0),
        ino(1),
        "the second local rank links the first one's bytes"
    );

    // The store loses everything: only local bytes can serve what follows.
    std::fs::remove_dir_all(tmp.path().join("bucket")).unwrap();
    assert!(first.bytes_from_store > 0, "{first:?}");
    let local = ResumePoint {
        bytes_from_store: 0,
        ..first.clone()
    };
    let again = rt().block_on(a.restore(6, 0..2, 2, &c)).unwrap();
    assert_eq!(again, local, "nothing read from the store");
    // Another generation, another world and other ranks: still the same local bytes.
    let wider = rt().block_on(a.restore(6, 1..4, 4, &c)).unwrap();
    assert_eq!(wider, local);
    for r in 0..4u32 {
        let d = first.dir.join(format!("rank-{r}"));
        assert_eq!(read_tensors(&d.join("state.safetensors")), union);
        let md = read_json(&d.join("metadata.json"));
        if r >= 1 {
            assert_eq!(
                (md["rank"].as_u64(), md["world_size"].as_u64()),
                (Some(r.into()), Some(4))
            );
        }
        assert_eq!(md["metadata"]["state"]["extra"]["pos"], 6);
    }
    assert_eq!(ino(0), ino(3));
    // Another job's store with a step of the same number: the local bytes are not its.
    let other_tmp = tempfile::tempdir().unwrap();
    let other = file_backend(other_tmp.path());
    let e = rt()
        .block_on(
            StoreSink::open(&other.url, root.clone(), other.options())
                .unwrap()
                .restore(6, 0..2, 2, &c),
        )
        .unwrap_err();
    assert!(matches!(e, SinkError::Restore { step: 6, .. }), "{e}");
    // Proof that the store is really gone: a step not restored before fails, naming it.
    let e = rt().block_on(a.restore(7, 0..1, 1, &c)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SinkError::Restore { step: 7, .. }), "{msg}");
    assert!(msg.contains("step 7") && msg.contains("bucket"), "{msg}");
}

/// Flips one bit in the first chunk object of `step` under a `file://` bucket.
fn flip_a_bit(bucket: &Path, step: u64) -> PathBuf {
    let data = bucket.join(format!("steps/{step:020}/data"));
    let writer = std::fs::read_dir(&data)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let chunk = writer.join("000000.bin");
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&chunk, bytes).unwrap();
    chunk
}

#[test]
fn restore_falls_back_when_the_newest_chunk_fails_its_checksum() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let a = backend.sink(tmp.path().join("ra"));
    let b = backend.sink(tmp.path().join("rb"));
    let c = CancellationToken::new();
    for step in [2, 4] {
        let staged = tmp.path().join(format!("staging/step-{step}"));
        stage_dense(&staged, step);
        commit_both(&a, &b, &staged, step, &c);
    }
    let union = staged_union(&tmp.path().join("staging/step-2"), 4);
    flip_a_bit(&tmp.path().join("bucket"), 4);
    // The cheap check (sizes) cannot see a bit flip: step 4 still looks newest.
    assert_eq!(rt().block_on(a.latest_step(&c)).unwrap(), Some(4));
    let fresh = backend.sink(tmp.path().join("rc"));
    let e = rt().block_on(fresh.restore(4, 0..2, 2, &c)).unwrap_err();
    assert!(e.to_string().contains("crc32c"), "{e}");
    let (point, skipped) = rt()
        .block_on(fresh.restore_or_older(4, 0..2, 2, &c))
        .unwrap();
    assert_eq!((point.step, skipped), (2, vec![4]));
    for r in 0..2u32 {
        let d = point.dir.join(format!("rank-{r}"));
        assert_eq!(read_tensors(&d.join("state.safetensors")), union);
        assert_eq!(
            read_json(&d.join("metadata.json"))["metadata"]["state"]["extra"]["pos"],
            2
        );
    }
    // An error that says nothing about the data is not a reason to fall back.
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    let e = rt()
        .block_on(
            backend
                .sink(tmp.path().join("rd"))
                .restore_or_older(4, 0..1, 1, &cancelled),
        )
        .unwrap_err();
    assert!(e.is_cancelled(), "{e}");
}

#[test]
fn a_step_a_rank_gave_up_ends_every_nodes_commit_wait_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let staged = tmp.path().join("staging/step-9");
    stage_dense(&staged, 9);
    let opts = SinkOptions {
        commit_wait_ms: 120_000,
        retry_pause_ms: 50,
        ..Default::default()
    };
    let a = StoreSink::open(&backend.url, tmp.path().join("ra"), opts).unwrap();
    let c = CancellationToken::new();
    rt().block_on(async {
        // Node b's rank 3 could not stage step 9 (its staging disk is full) and says so.
        let store = backend.store();
        let t = Instant::now();
        let gave_up = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            store
                .abandon_part(9, "g1-rank-3", "staging full", &c)
                .await
                .unwrap();
        };
        let (r, ()) = tokio::join!(a.commit(to_commit(&staged, 9, 0..2, "a"), &c), gave_up);
        let e = r.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, SinkError::Commit { source, .. } if matches!(**source, checkpoint::Error::Abandoned { .. })),
            "{msg}"
        );
        assert!(msg.contains("g1-rank-3") && msg.contains("staging full"), "{msg}");
        // Well before the 120 s commit deadline: the marker, not the clock, ended the wait.
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
        assert_eq!(a.latest_step(&c).await.unwrap(), None);
    });
}

#[test]
fn sharded_steps_are_reused_only_for_the_same_world() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = file_backend(tmp.path());
    let staged = tmp.path().join("staging/step-8");
    // A [8, 2] tensor sharded 2 rows per rank, and one replicated tensor.
    let rows = |lo: u32, hi: u32| f32s((lo * 2..hi * 2).map(|v| v as f32));
    for r in 0..4u32 {
        let shard = (Dtype::F32, vec![2, 2], rows(2 * r, 2 * r + 2));
        let mut tensors = vec![("model/emb".to_string(), shard)];
        if r == 0 {
            tensors.push((
                "model/bias".into(),
                (Dtype::F32, vec![3], f32s([1.0, 2.0, 3.0])),
            ));
        }
        let shards = json!({"model/emb": {"global_shape": [8, 2], "dim0_offset": 2 * r}});
        stage_rust(&staged, 8, r, 4, &tensors, Some(shards));
    }
    let root = tmp.path().join("restore");
    let a = backend.sink(root.clone());
    let b = backend.sink(tmp.path().join("rb"));
    let c = CancellationToken::new();
    commit_both(&a, &b, &staged, 8, &c);

    let p = rt().block_on(a.restore(8, 0..2, 2, &c)).unwrap();
    for r in 0..2u32 {
        let t = read_tensors(&p.dir.join(format!("rank-{r}/state.safetensors")));
        assert_eq!(
            t["model/emb"],
            (Dtype::F32, vec![4, 2], rows(4 * r, 4 * r + 4))
        );
        assert_eq!(t["model/bias"].2, f32s([1.0, 2.0, 3.0]));
    }
    std::fs::remove_dir_all(tmp.path().join("bucket")).unwrap();
    // Same world: reused. Another world needs other rows, which only the store has.
    let reused = rt().block_on(a.restore(8, 0..2, 2, &c)).unwrap();
    assert_eq!(
        (&reused.dir, reused.step, reused.bytes_from_store),
        (&p.dir, p.step, 0)
    );
    let e = rt().block_on(a.restore(8, 0..3, 3, &c)).unwrap_err();
    assert!(matches!(e, SinkError::Restore { step: 8, .. }), "{e}");
    // The failed attempt discarded the rows cut for world 2: they must not pass for world 3.
    assert!(!p.dir.join("rank-0/state.safetensors").exists());
}
