//! Interop with real workers: PyTorch writes sharded safetensors (shards declared in
//! `__metadata__["elastic.shards"]`), the files are saved from disk as 4 writers, restored for
//! 3 ranks, and PyTorch loads the restored files and checks them against the global tensors.

use std::process::Command;

use checkpoint::restore::RESTORE_FILE;
use checkpoint::{CommitRequest, PartInput, PartSource, ReadOptions, SaveOptions, Store};

use crate::common::cancel;

const WRITE: &str = r#"
import json, sys, torch
from safetensors.torch import save_file
out, world = sys.argv[1], 4
torch.manual_seed(0)
w = torch.randn(10, 6) * 0.02
e = (torch.randn(9, 4) * 0.02).to(torch.bfloat16)
bias = torch.randn(6)
for r in range(world):
    shards, tensors = {}, {}
    for name, t in (("w", w), ("e", e)):
        lo, hi = t.shape[0] * r // world, t.shape[0] * (r + 1) // world
        tensors[name] = t[lo:hi].contiguous()
        shards[name] = {"global_shape": list(t.shape), "dim0_offset": lo}
    if r == 1:
        tensors["bias"] = bias
    save_file(tensors, f"{out}/rank-{r}.safetensors", metadata={"elastic.shards": json.dumps(shards)})
torch.save({"w": w, "e": e, "bias": bias}, f"{out}/global.pt")
"#;

const CHECK: &str = r#"
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
src, world = sys.argv[1], int(sys.argv[2])
g = torch.load(f"{src}/global.pt")
for r in range(world):
    path = f"{sys.argv[3]}/{r}/state.safetensors"
    got = load_file(path)
    with safe_open(path, "pt") as f:
        shards = json.loads(f.metadata()["elastic.shards"])
    assert torch.equal(got["bias"], g["bias"]), "bias"
    for name in ("w", "e"):
        # The restore cuts as torch's Shard(0) does, whatever rows the writers held.
        n = g[name].shape[0]
        c = -(-n // world)
        lo, hi = min(r * c, n), min((r + 1) * c, n)
        assert torch.equal(got[name], g[name][lo:hi]), (name, r)
        assert shards[name]["dim0_offset"] == lo
print("ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pytorch_written_shards_restore_resharded_and_load_in_pytorch() {
    let python = services::paths::python().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new(&python)
        .args(["-c", WRITE, dir.path().to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success(), "writing with PyTorch failed");

    let bucket = tempfile::tempdir().unwrap();
    let store = Store::open(bucket.path().to_str().unwrap()).unwrap();
    for r in 0..4 {
        let name = format!("rank-{r}.safetensors");
        let input = PartInput {
            writer: format!("rank-{r}"),
            source: PartSource::Files(vec![(name.clone(), dir.path().join(&name))]),
            shards: Default::default(),
        };
        store
            .save_part(9, input, &SaveOptions::default(), &cancel())
            .await
            .unwrap();
    }
    let req = CommitRequest {
        world_size: 4,
        writers: (0..4).map(|r| format!("rank-{r}")).collect(),
        metadata: serde_json::json!({}),
    };
    store.commit(9, req, &cancel()).await.unwrap();

    let out = tempfile::tempdir().unwrap();
    for r in 0..3 {
        let dest = out.path().join(r.to_string());
        store
            .restore(Some(9), r, 3, &dest, &ReadOptions::default(), &cancel())
            .await
            .unwrap();
        assert!(dest.join(RESTORE_FILE).exists());
    }
    let check = Command::new(&python)
        .args([
            "-c",
            CHECK,
            dir.path().to_str().unwrap(),
            "3",
            out.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "PyTorch check failed: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
