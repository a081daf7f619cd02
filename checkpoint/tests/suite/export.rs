//! `elastic-ckpt export` and `elastic-ckpt restore`: a PyTorch model's state saved the way the
//! worker client saves it exports as Hugging Face safetensors equal to its `state_dict()`
//! bit for bit (one file, or shards and an index that `torch.distributed.checkpoint` loads);
//! a corrupt newest step is skipped; bad targets, keys and sizes are refused; a 2 GiB model
//! exports in a few chunks of memory; and the `restore` command writes what `Store::restore`
//! writes. That a sharded tensor exports whole, from every kind of store, is a case of the
//! conformance suite (`common::export_writes_a_sharded_tensor_whole_in_hugging_face_shards`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use checkpoint::header::{self, HeaderTensor};
use checkpoint::restore::{RESTORE_FILE, RESTORE_METADATA_FILE};
use checkpoint::{ReadOptions, Store};
use safetensors::SafeTensors;

use crate::cli::{ok, run};
use crate::common::{self, T, cancel, st_bytes, tensor};

const BIN: &str = env!("CARGO_BIN_EXE_elastic-ckpt");

/// The model the export test saves: layers `layers.0`..`layers.11` (so names sort by number),
/// a bf16 head, and a buffer whose name needs percent-escaping in tensor names (`scale/x%`).
const NET: &str = r#"
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(12))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 4).to(torch.bfloat16)
        self.register_buffer("scale/x%", torch.arange(3, dtype=torch.int64))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x).to(torch.bfloat16))
"#;

/// Writes the PyTorch state the export test reads: a [`NET`] model, an EMA copy, an Adam
/// optimizer after one step, and a plain value; named and split between two ranks by the
/// worker client's own code, as staged `rank-<r>/tensors.safetensors` files. `layers.1.weight`
/// is saved sharded along dim 0 across both ranks (`elastic.shards` in each header). Also
/// writes the manifest metadata the agent would commit and the state_dicts to compare with.
const WRITE: &str = r#"
import copy, json, os, sys, torch
sys.path.insert(0, sys.argv[2])
from elastic_run import _save, _tree
from safetensors.torch import save_file

out = sys.argv[1]

torch.manual_seed(0)
model = Net()
ema = copy.deepcopy(model)
with torch.no_grad():
    for p in ema.parameters():
        p.mul_(0.5)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model(torch.randn(2, 16)).float().sum().backward()
opt.step()
state = {"model": model, "ema": ema, "optim": opt, "step": 3}
tensors, skeleton, _shards = _tree.encode(state)
big = "state/model/layers.1.weight"
rest = {k: v for k, v in tensors.items() if k != big}
owner = _save.assign_keys({k: v.numel() * v.element_size() for k, v in rest.items()}, 2)
w = tensors[big]
for r in range(2):
    mine = {k: v.detach().contiguous() for k, v in rest.items() if owner[k] == r}
    lo, hi = (0, 7) if r == 0 else (7, w.shape[0])
    mine[big] = w[lo:hi].detach().contiguous()
    shards = {big: {"global_shape": list(w.shape), "dim0_offset": lo}}
    os.makedirs(f"{out}/staged/rank-{r}")
    save_file(mine, f"{out}/staged/rank-{r}/tensors.safetensors",
              metadata={"elastic.shards": json.dumps(shards)})
with open(f"{out}/metadata.json", "w") as f:
    json.dump({"elastic": {"node": 0}, "state": skeleton}, f)
torch.save({"model": model.state_dict(), "ema": ema.state_dict()}, f"{out}/ref.pt")
"#;

/// Checks the exports against the saved state_dicts, bit for bit: the model and the EMA as one
/// file each, and the model in shards through the index and through
/// `torch.distributed.checkpoint`'s `HuggingFaceStorageReader` into a fresh model.
const CHECK: &str = r#"
import json, os, re, sys, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from safetensors import safe_open
from safetensors.torch import load_file
src, one, ema_dir, shards = sys.argv[1:5]
ref = torch.load(f"{src}/ref.pt")

def same(got, want, what):
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, g.shape)
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), (what, k)

for d, key in ((one, "model"), (ema_dir, "ema")):
    assert os.listdir(d) == ["model.safetensors"], os.listdir(d)
    same(load_file(f"{d}/model.safetensors"), ref[key], key)
    with safe_open(f"{d}/model.safetensors", "pt") as f:
        md = f.metadata()
    assert md["format"] == "pt" and md["elastic.step"] == "5" and md["elastic.key"] == key, md
assert not torch.equal(ref["ema"]["head.weight"], ref["model"]["head.weight"])

index = json.load(open(f"{shards}/model.safetensors.index.json"))
files = sorted(set(index["weight_map"].values()))
n = len(files)
assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
assert sorted(os.listdir(shards)) == sorted(files + ["model.safetensors.index.json"])
got = {}
for name in files:
    part = load_file(f"{shards}/{name}")
    assert all(index["weight_map"][k] == name for k in part), name
    got.update(part)
same(got, ref["model"], "shards")
total = sum(t.numel() * t.element_size() for t in ref["model"].values())
assert index["metadata"]["total_size"] == total, index["metadata"]

torch.manual_seed(1)
fresh = Net()
sd = fresh.state_dict()
assert not torch.equal(sd["layers.0.weight"], ref["model"]["layers.0.weight"])
dcp.load(sd, storage_reader=HuggingFaceStorageReader(shards))
fresh.load_state_dict(sd)
same(fresh.state_dict(), ref["model"], "dcp")
print("ok")
"#;

fn python(args: &[&str]) -> std::process::Output {
    let python = services::paths::python().unwrap();
    let out = Command::new(&python).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "python failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A fresh `file://` bucket (removed with the guard).
fn new_bucket() -> (tempfile::TempDir, String) {
    let bucket = tempfile::tempdir().unwrap();
    let url = format!("file://{}", bucket.path().display());
    (bucket, url)
}

/// `elastic-ckpt push DIR URL --step STEP --metadata METADATA EXTRA...`, which must succeed.
fn push(dir: &Path, url: &str, step: &str, metadata: &str, extra: &[&str]) {
    let dir = dir.to_str().unwrap();
    let mut args = vec!["push", dir, url, "--step", step, "--metadata", metadata];
    args.extend_from_slice(extra);
    ok(&args, &[]);
}

#[test]
fn export_of_a_torch_state_equals_its_state_dicts_bitwise_and_refuses_the_optimizer() {
    let t0 = Instant::now();
    let src = tempfile::tempdir().unwrap();
    let client = services::paths::repo_root().join("runtime/python");
    python(&[
        "-c",
        &format!("{NET}{WRITE}"),
        src.path().to_str().unwrap(),
        client.to_str().unwrap(),
    ]);
    let metadata = std::fs::read_to_string(src.path().join("metadata.json")).unwrap();

    let (_bucket, url) = new_bucket();
    push(
        &src.path().join("staged"),
        &url,
        "5",
        &metadata,
        &["--world-size", "2"],
    );
    let show: serde_json::Value =
        serde_json::from_str(&ok(&["show", &url, "--json"], &[])).unwrap();
    let sharded: Vec<&serde_json::Value> = show["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["sharded"] == true)
        .collect();
    assert_eq!(sharded.len(), 1, "one tensor is saved in two shards");
    assert_eq!(sharded[0]["name"], "state/model/layers.1.weight");
    // The buffer `scale/x%` is stored under its percent-escaped name, and exports as itself.
    assert!(
        show["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "state/model/scale%2Fx%25"),
        "{show}"
    );

    let out = tempfile::tempdir().unwrap();
    let one = out.path().join("one");
    let report: serde_json::Value =
        serde_json::from_str(&ok(&["export", &url, one.to_str().unwrap(), "--json"], &[])).unwrap();
    assert_eq!(report["step"], 5, "{report}");
    assert_eq!(report["key"], "model", "{report}");
    assert_eq!(report["files"][0]["name"], "model.safetensors", "{report}");
    // 12 layers of weight and bias, the norm's two, the head's two and the buffer.
    assert_eq!(report["tensors"], 29, "{report}");
    assert_eq!(report["skipped_steps"], serde_json::json!([]), "{report}");
    let ema = out.path().join("ema");
    let human = ok(
        &["export", &url, ema.to_str().unwrap(), "--key", "ema"],
        &[],
    );
    assert!(
        human.contains("exported \"ema\" of step 5: 29 tensors") && human.contains("1 file"),
        "{human}"
    );
    let shards = out.path().join("shards");
    let report: serde_json::Value = serde_json::from_str(&ok(
        &[
            "export",
            &url,
            shards.to_str().unwrap(),
            "--step",
            "5",
            "--max-shard-size",
            "2KB",
            "--json",
        ],
        &[],
    ))
    .unwrap();
    assert_eq!(report["index"], "model.safetensors.index.json", "{report}");
    let check = python(&[
        "-c",
        &format!("{NET}{CHECK}"),
        src.path().to_str().unwrap(),
        one.to_str().unwrap(),
        ema.to_str().unwrap(),
        shards.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&check.stdout).contains("ok"));

    // The optimizer's state is nested, not a module's flat map of tensors.
    let target = out.path().join("optim");
    let refused = run(
        &["export", &url, target.to_str().unwrap(), "--key", "optim"],
        &[],
    );
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("cannot export \"optim\"")
            && err.contains("state[\"optim\"][\"param_groups\"] holds a list")
            && err.contains("only a module-like entry"),
        "{err}"
    );
    assert!(!target.exists(), "nothing is left of a refused export");
    // An unknown key lists the entries the step holds.
    let refused = run(
        &["export", &url, target.to_str().unwrap(), "--key", "emma"],
        &[],
    );
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("no entry \"emma\"; its entries are \"ema\", \"model\", \"optim\", \"step\""),
        "{err}"
    );
    eprintln!("torch export test: {:.1} s", t0.elapsed().as_secs_f64());
}

/// A staged file of the state `model` with `n` F32 tensors of `rows` x 1024.
fn write_staged(dir: &Path, n: usize, rows: usize) -> String {
    let tensors: Vec<T> = (0..n)
        .map(|i| {
            tensor(
                &format!("state/model/layers.{i}.weight"),
                "F32",
                &[rows, 1024],
                i as u64,
            )
        })
        .collect();
    let p = dir.join("rank-0/tensors.safetensors");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, st_bytes(&tensors, None)).unwrap();
    let names: Vec<(String, String)> = (0..n)
        .map(|i| {
            (
                format!("layers.{i}.weight"),
                format!("state/model/layers.{i}.weight"),
            )
        })
        .collect();
    common::state_metadata(&[(
        "model",
        names
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect(),
    )])
    .to_string()
}

#[test]
fn export_falls_back_past_a_corrupt_newest_step_and_names_the_object() {
    let staged = tempfile::tempdir().unwrap();
    let metadata = write_staged(staged.path(), 4, 64);
    let (bucket, url) = new_bucket();
    for step in ["1", "2"] {
        push(staged.path(), &url, step, &metadata, &[]);
    }
    let show: serde_json::Value =
        serde_json::from_str(&ok(&["show", &url, "--step", "2", "--json"], &[])).unwrap();
    let key = show["objects"][0]["key"].as_str().unwrap().to_string();
    let path = bucket.path().join(&key);
    let mut data = std::fs::read(&path).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0x10;
    std::fs::write(&path, data).unwrap();

    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("newest");
    let r = run(&["export", &url, dest.to_str().unwrap(), "--json"], &[]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    assert_eq!(report["step"], 1, "{report}");
    assert_eq!(report["skipped_steps"], serde_json::json!([2]), "{report}");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains(&key) && err.contains("skipped committed step 2"),
        "{err}"
    );
    let names: Vec<_> = std::fs::read_dir(&dest)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["model.safetensors"],
        "no temp file of step 2 is left"
    );
    let bytes = std::fs::read(dest.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = tensor("layers.3.weight", "F32", &[64, 1024], 3);
    assert!(st.tensor("layers.3.weight").unwrap().data() == &want.data[..]);

    let asked = out.path().join("asked");
    let r = run(
        &["export", &url, asked.to_str().unwrap(), "--step", "2"],
        &[],
    );
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains(&key) && err.contains("step 2") && err.contains("crc32c"),
        "{err}"
    );
    assert!(
        !asked.exists(),
        "a failed export leaves no directory it made"
    );
}

#[test]
fn export_refuses_a_non_empty_or_symlinked_target_and_a_bad_shard_size() {
    let staged = tempfile::tempdir().unwrap();
    let metadata = write_staged(staged.path(), 2, 4);
    let (_bucket, url) = new_bucket();
    push(staged.path(), &url, "1", &metadata, &[]);
    let out = tempfile::tempdir().unwrap();

    let full = out.path().join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("model.safetensors"), b"mine").unwrap();
    let r = run(&["export", &url, full.to_str().unwrap()], &[]);
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("export target") && err.contains("is not empty"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(full.join("model.safetensors")).unwrap(),
        b"mine"
    );
    assert_eq!(std::fs::read_dir(&full).unwrap().count(), 1);

    let elsewhere = out.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let link = out.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    let r = run(&["export", &url, link.to_str().unwrap()], &[]);
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("is a symlink"), "{err}");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);

    let dest = out.path().join("dest");
    for bad in ["0", "garbage", "5 GB", "0MB", "-1", "1.5GB"] {
        // The `=` form, so a value that starts with "-" reaches the size parser.
        let flag = format!("--max-shard-size={bad}");
        let r = run(&["export", &url, dest.to_str().unwrap(), &flag], &[]);
        assert_eq!(r.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(err.contains("--max-shard-size"), "{bad}: {err}");
    }
    assert!(!dest.exists());
    // The same target takes the export once the flags are right.
    ok(
        &[
            "export",
            &url,
            dest.to_str().unwrap(),
            "--max-shard-size",
            "4KiB",
        ],
        &[],
    );
    assert!(dest.join("model.safetensors.index.json").exists());
}

/// The large model's bytes come in pieces of this size...
const PIECE_BYTES: usize = 8 << 20;

/// ...each one random block stamped with its tensor and its place in it, so every piece
/// differs (a piece copied to the wrong place shows) and making or checking 2 GiB costs
/// little more than a copy, even in a debug build.
fn stamp(piece: &mut [u8], tensor: u64, offset: u64) {
    piece[..8].copy_from_slice(&tensor.to_le_bytes());
    piece[8..16].copy_from_slice(&offset.to_le_bytes());
}

#[test]
fn export_of_a_2gib_model_holds_a_few_chunks_in_memory() {
    const TENSORS: u64 = 8;
    const ROWS: u64 = 16 * 1024;
    const COLS: u64 = 4096;
    const TENSOR_BYTES: u64 = ROWS * COLS * 4;
    const RSS_BYTES_MAX: u64 = 512 << 20;
    let t0 = Instant::now();
    let staged = tempfile::tempdir().unwrap();
    let headers: Vec<HeaderTensor> = (0..TENSORS)
        .map(|t| HeaderTensor {
            name: format!("state/model/layers.{t}.weight"),
            dtype: "F32".into(),
            shape: vec![ROWS, COLS],
            data_offsets: [t * TENSOR_BYTES, (t + 1) * TENSOR_BYTES],
        })
        .collect();
    let file = staged.path().join("rank-0/tensors.safetensors");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
    f.write_all(&header::write_header(&headers, &BTreeMap::new()))
        .unwrap();
    let block = tensor("block", "U8", &[PIECE_BYTES], 9).data;
    let mut piece = block.clone();
    for t in 0..TENSORS {
        for start in (0..TENSOR_BYTES).step_by(PIECE_BYTES) {
            stamp(&mut piece, t, start);
            f.write_all(&piece).unwrap();
        }
    }
    f.flush().unwrap();
    drop(f);
    let staged_s = t0.elapsed().as_secs_f64();
    let names: Vec<(String, String)> = headers
        .iter()
        .map(|h| (h.name["state/model/".len()..].to_string(), h.name.clone()))
        .collect();
    let metadata = common::state_metadata(&[(
        "model",
        names
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect(),
    )])
    .to_string();
    let (_bucket, url) = new_bucket();
    push(
        staged.path(),
        &url,
        "1",
        &metadata,
        &["--compress", "never"],
    );
    drop(staged);
    let pushed_s = t0.elapsed().as_secs_f64() - staged_s;

    let out = tempfile::tempdir().unwrap();
    let dest = out.path().join("hf");
    let t1 = Instant::now();
    // Reaped by wait4 below, which also gives this child's own peak RSS (getrusage's
    // RUSAGE_CHILDREN would mix in the other tests' children).
    #[allow(clippy::zombie_processes)]
    let child = Command::new(BIN)
        .args(["export", &url, dest.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; status and usage are writable.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "export failed: status {status}"
    );
    let export_s = t1.elapsed().as_secs_f64();
    // Linux reports ru_maxrss in KiB.
    let rss_bytes = usage.ru_maxrss as u64 * 1024;

    let mut f = std::fs::File::open(dest.join("model.safetensors")).unwrap();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).unwrap();
    let mut text = vec![0u8; u64::from_le_bytes(len) as usize];
    f.read_exact(&mut text).unwrap();
    let h = header::parse_header(&text, "model.safetensors").unwrap();
    assert_eq!(h.tensors.len(), TENSORS as usize);
    assert_eq!(h.metadata["format"], "pt");
    for ht in &h.tensors {
        let t: u64 = ht.name["layers.".len()..ht.name.len() - ".weight".len()]
            .parse()
            .unwrap();
        assert_eq!(ht.shape, [ROWS, COLS]);
        let mut want = block.clone();
        for start in (0..TENSOR_BYTES).step_by(PIECE_BYTES) {
            f.read_exact(&mut piece).unwrap();
            stamp(&mut want, t, start);
            assert!(piece == want, "{} differs in bytes from {start}", ht.name);
        }
    }
    assert_eq!(f.read(&mut [0u8; 1]).unwrap(), 0, "nothing after the data");
    eprintln!(
        "2 GiB export: peak RSS {:.0} MiB; staging {staged_s:.1} s, push {pushed_s:.1} s, \
         export {export_s:.1} s, total {:.1} s",
        rss_bytes as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        rss_bytes < RSS_BYTES_MAX,
        "export of a 2 GiB model peaked at {rss_bytes} bytes of RSS"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_command_writes_what_store_restore_writes_points_at_chunks_without_copies_and_refuses_a_non_empty_dir()
 {
    let (_bucket, url) = new_bucket();
    let store = Store::open(&url).unwrap();
    common::save_sharded(&store, 4, 2).await;
    let out = tempfile::tempdir().unwrap();
    for rank in 0..3u32 {
        let lib = out.path().join(format!("lib-{rank}"));
        store
            .restore(Some(4), rank, 3, &lib, &ReadOptions::default(), &cancel())
            .await
            .unwrap();
        let cli = out.path().join(format!("cli-{rank}"));
        let rank_text = rank.to_string();
        let stdout = ok(
            &[
                "restore",
                &url,
                cli.to_str().unwrap(),
                "--rank",
                &rank_text,
                "--world-size",
                "3",
                "--json",
            ],
            &[],
        );
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(report["step"], 4, "{report}");
        assert_eq!(
            report["files"]["state"],
            cli.join(RESTORE_FILE).to_str().unwrap(),
            "{report}"
        );
        assert_eq!(
            report["files"]["metadata"],
            cli.join(RESTORE_METADATA_FILE).to_str().unwrap(),
            "{report}"
        );
        for name in [RESTORE_FILE, RESTORE_METADATA_FILE] {
            assert!(
                std::fs::read(lib.join(name)).unwrap() == std::fs::read(cli.join(name)).unwrap(),
                "{name} of rank {rank}"
            );
        }
    }
    // Without copies, from raw chunks: the events say where each checked byte lies, and no
    // state file is written; put together, that is the file the library wrote. (The chunks
    // above are compressed: from those, the file is written as without it.)
    let (_raw_bucket, raw_url) = new_bucket();
    let (sharded, replicated) = common::global_state();
    let raw = checkpoint::SaveOptions {
        compress: false,
        ..common::small_chunks()
    };
    common::save_rows(
        &Store::open(&raw_url).unwrap(),
        4,
        2,
        &sharded,
        &replicated,
        &raw,
    )
    .await;
    let no_copy = |url: &str, dir: &Path| {
        let args = ["--rank", "1", "--world-size", "3", "--events", "--no-copy"];
        let dir = dir.to_str().unwrap();
        ok(&[&["--json", "restore", url, dir][..], &args].concat(), &[])
    };
    let compressed = out.path().join("no-copy-compressed");
    let report = no_copy(&url, &compressed);
    assert!(report.contains(r#"{"event":"file","#), "{report}");
    assert!(
        std::fs::read(compressed.join(RESTORE_FILE)).unwrap()
            == std::fs::read(out.path().join("lib-1").join(RESTORE_FILE)).unwrap()
    );
    let pointed = out.path().join("no-copy");
    let stdout = no_copy(&raw_url, &pointed);
    let (events, report): (Vec<&str>, Vec<&str>) =
        stdout.lines().partition(|l| l.starts_with(r#"{"event":"#));
    let report: serde_json::Value = serde_json::from_str(&report.join("\n")).unwrap();
    assert_eq!(
        (report["step"].clone(), report["files"]["state"].clone()),
        (4.into(), serde_json::Value::Null),
        "{report}"
    );
    assert!(!pointed.join(RESTORE_FILE).exists());
    let want = std::fs::read(out.path().join("lib-1").join(RESTORE_FILE)).unwrap();
    let mut got = Vec::new();
    let mut sources = 0;
    for line in events {
        let ev: serde_json::Value = serde_json::from_str(line).unwrap();
        match ev["event"].as_str().unwrap() {
            "header" => {
                let h = ev["header"].as_str().unwrap();
                got = (h.len() as u64).to_le_bytes().to_vec();
                got.extend_from_slice(h.as_bytes());
                got.resize(ev["bytes"].as_u64().unwrap() as usize, 0);
            }
            "source" => {
                use std::os::unix::fs::FileExt;
                sources += 1;
                let f = std::fs::File::open(ev["path"].as_str().unwrap()).unwrap();
                for r in ev["ranges"].as_array().unwrap() {
                    let [at, len, from] = [0, 1, 2].map(|i| r[i].as_u64().unwrap());
                    f.read_exact_at(&mut got[at as usize..(at + len) as usize], from)
                        .unwrap();
                }
            }
            "step" => {}
            other => panic!("unexpected event {other}: {line}"),
        }
    }
    assert!(sources > 0);
    assert!(
        got == want,
        "the sources put together differ from the restored file"
    );
    let r = run(
        &[
            "restore",
            &url,
            out.path().join("no-events").to_str().unwrap(),
            "--rank",
            "0",
            "--world-size",
            "3",
            "--no-copy",
        ],
        &[],
    );
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("--events"));

    let again = out.path().join("cli-0");
    let r = run(
        &[
            "restore",
            &url,
            again.to_str().unwrap(),
            "--rank",
            "0",
            "--world-size",
            "3",
        ],
        &[],
    );
    assert!(!r.status.success());
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("restore target") && err.contains("is not empty"),
        "{err}"
    );
}

/// `restore --events --into-parent`, with this test process as the parent that reads: it
/// answers the header with the address of a buffer of its own, and the restore fills it with
/// the state's data, bitwise what `Store::restore` writes into a file, and writes no state
/// file. A parent that answers `null` gets the file; an answer for another step, or none at
/// all, fails the restore, naming the targets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_into_parent_writes_into_the_memory_the_parent_names() {
    use std::io::BufRead;

    let (_bucket, url) = new_bucket();
    let (sharded, replicated) = common::global_state();
    // Compressed chunks: a restore that cannot point at them writes them out.
    common::save_rows(
        &Store::open(&url).unwrap(),
        4,
        2,
        &sharded,
        &replicated,
        &common::small_chunks(),
    )
    .await;
    let out = tempfile::tempdir().unwrap();
    let lib = out.path().join("lib");
    Store::open(&url)
        .unwrap()
        .restore(None, 1, 3, &lib, &ReadOptions::default(), &cancel())
        .await
        .unwrap();
    let want = std::fs::read(lib.join(RESTORE_FILE)).unwrap();

    // How the parent answers the header: with its buffer, with null, or for another step.
    enum Answer {
        Buffer,
        File,
        OtherStep,
        OtherProcess,
        Nothing,
    }
    let restore = |dir: &str, answer: Answer| {
        let mut child = Command::new(BIN)
            .args(["--json", "restore", &url])
            .arg(out.path().join(dir))
            .args([
                "--rank",
                "1",
                "--world-size",
                "3",
                "--events",
                "--into-parent",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take();
        let mut buf: Vec<u8> = Vec::new();
        let mut data_start = 0;
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            let ev: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if ev["event"] == "header" {
                assert_eq!(ev["targets"], true, "{line}");
                let h = ev["header"].as_str().unwrap();
                data_start = 8 + h.len() as u64;
                let total = ev["bytes"].as_u64().unwrap();
                buf = vec![0; (total - data_start) as usize];
                let targets = match answer {
                    Answer::Buffer | Answer::OtherStep | Answer::OtherProcess => {
                        serde_json::json!([[data_start, buf.len(), buf.as_mut_ptr() as u64]])
                    }
                    Answer::File => serde_json::Value::Null,
                    Answer::Nothing => {
                        stdin.take();
                        continue;
                    }
                };
                let step = if matches!(answer, Answer::OtherStep) {
                    3
                } else {
                    4
                };
                let pid = std::process::id() + u32::from(matches!(answer, Answer::OtherProcess));
                let reply = serde_json::json!({"step": step, "name": RESTORE_FILE, "pid": pid, "targets": targets});
                let input = stdin.as_mut().unwrap();
                writeln!(input, "{reply}").unwrap();
                input.flush().unwrap();
            }
            lines.push(line);
        }
        let status = child.wait().unwrap();
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status.success(), lines, buf, data_start as usize, err)
    };

    let (ok_, lines, buf, start, err) = restore("into", Answer::Buffer);
    assert!(ok_, "{err}");
    assert!(
        buf == want[start..],
        "the parent's buffer differs from the file a restore writes"
    );
    assert!(!out.path().join("into").join(RESTORE_FILE).exists());
    assert!(lines.iter().any(|l| l.contains(r#""event":"ready""#)));
    assert!(!lines.iter().any(|l| l.contains(r#""event":"file""#)));

    // Asked for the file, or answered by a process that is not the restore's parent: the
    // file, and nothing in memory.
    for (dir, answer) in [("file", Answer::File), ("not-parent", Answer::OtherProcess)] {
        let (ok_, lines, buf, _, err) = restore(dir, answer);
        assert!(ok_, "{err}");
        assert!(buf.iter().all(|&b| b == 0), "{dir}");
        assert!(
            lines.iter().any(|l| l.contains(r#""event":"file""#)),
            "{dir}"
        );
        assert!(std::fs::read(out.path().join(dir).join(RESTORE_FILE)).unwrap() == want);
    }

    for (dir, answer, says) in [
        (
            "other",
            Answer::OtherStep,
            "not for state.safetensors of step 4",
        ),
        (
            "nothing",
            Answer::Nothing,
            "its input ended before it answered",
        ),
    ] {
        let (ok_, _, buf, _, err) = restore(dir, answer);
        assert!(!ok_);
        assert!(
            err.contains("targets for state.safetensors") && err.contains(says),
            "{err}"
        );
        assert!(buf.iter().all(|&b| b == 0), "{dir}: written into after all");
        assert!(!out.path().join(dir).join(RESTORE_FILE).exists());
    }
}
