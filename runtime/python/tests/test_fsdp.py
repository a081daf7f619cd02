"""FSDP2 (DTensor) state: saved as each rank's shards with their rows, loaded at another world
size into each new rank's own rows, bitwise; layouts a checkpoint cannot hold are refused.

python -m unittest discover -s runtime/python/tests -t runtime/python -k Fsdp"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

from tests import test_client as tc

er = tc.er

# One interpreter imports torch once and forks every rank of a world from it (gloo on CPU over
# loopback, a file store: no port to race for). Ranks train a small FSDP2 model with AdamW; its
# linear layers have 7, 5 and 2 rows, so worlds of 4, 3 and 2 cut them unevenly and some ranks
# hold none of a tensor. `DRIVER CLIENT_DIR TMP` runs the phases below and prints one JSON
# object: the digests of every parameter and optimizer tensor, gathered whole, at the save and
# after each load, what a Replicate() DTensor saved and loaded, and the errors of the saves that
# must be refused.
DRIVER = r"""
import hashlib, itertools, json, multiprocessing, os, sys, traceback, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
# Imported once here, before the ranks fork, rather than by each of them (fully_shard imports
# torch._dynamo on its first call).
import torch._dynamo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
import elastic_run as er

TMP = sys.argv[2]
STAGING = os.path.join(TMP, "staging")
# A fresh file store for every world: one left by an earlier world would hand out its peers.
STORES = itertools.count()


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                torch.nn.Linear(5, 2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def digests(model, opt):
    # Every rank gathers every tensor (a collective), in the same order.
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model/{n}": p for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"opt/{names[id(p)]}/{k}"] = v
    out = {}
    for name in sorted(tensors):
        t = tensors[name].detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = hashlib.sha256(str((t.dtype, list(t.shape))).encode() + t.reshape(-1).view(torch.uint8)
                                   .numpy().tobytes()).hexdigest()
    return out


def save_phase():
    model, opt = build(0)
    for step in (1, 2, 3):
        train(model, opt, step)
    state = {"model": model, "opt": opt, "progress": {"step": 3}}
    er.async_save(3, state)
    saved = digests(model, opt)
    # opt.step() of the next step waits for the write: the snapshot keeps step 3's state.
    train(model, opt, 4)
    er.wait()
    locals_ = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    return {"saved": saved, "after": digests(model, opt), "local_shapes": locals_}


def local_ptrs(model, opt):
    # Where this rank's part of each parameter and optimizer state tensor lives.
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": p.to_local().data_ptr() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"opt/{names[id(p)]}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).data_ptr()
    return out


def load_phase(resume_dir):
    model, opt = build(1)
    train(model, opt, 1)  # other weights and optimizer state than the saved ones
    before = digests(model, opt)
    ptrs = local_ptrs(model, opt)
    state = {"model": model, "opt": opt, "progress": None}
    if resume_dir.startswith("file://"):
        step = er.load_from(resume_dir, state)  # each rank reads its rows from the bucket
    else:
        step = er.load(state, resume_dir=resume_dir)
    loaded = digests(model, opt)
    kept = sorted(k for k, v in local_ptrs(model, opt).items() if ptrs.get(k) == v)
    train(model, opt, 4)  # the loaded state trains on
    return {"step": step, "progress": state["progress"], "before": before, "loaded": loaded, "kept": kept}


def placements():
    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    # A Replicate() DTensor is saved whole (once, by one rank), and loads into one.
    er.save(8, {"extra": {"r": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Replicate()])}})
    dist.barrier()  # every rank's part is written
    back = {"extra": {"r": distribute_tensor(torch.zeros(3, 2), mesh, [Replicate()])}}
    er.load(back, resume_dir=os.path.join(STAGING, "step-8"))
    r = back["extra"]["r"]
    keys = 0
    for i in range(w):
        with open(os.path.join(STAGING, "step-8", f"rank-{i}", "meta.json")) as f:
            keys += len(json.load(f)["keys"])
    out = {"replicate": [type(r).__name__, str(list(r.placements)), r.to_local().tolist()], "replicate_keys": keys}
    cases = {
        "2d": distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1, w)), [Replicate(), Shard(0)]),
        "shard1": distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)]),
        "partial": DTensor.from_local(torch.ones(2), mesh, [Partial()]),
    }
    for name, t in cases.items():
        try:
            er.save(9, {"extra": {name: t}})
            out[name] = None
        except TypeError as e:
            out[name] = str(e)
    out["step_9_written"] = os.path.exists(os.path.join(STAGING, "step-9"))
    return out


def rank_main(rank, world, store, phase, arg, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), ELASTIC_STAGING_DIR=STAGING)
    try:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
        result = phase(arg) if arg is not None else phase()
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", result))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run(world, phase, arg=None):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    store = os.path.join(TMP, f"store-{next(STORES)}")
    procs = [ctx.Process(target=rank_main, args=(r, world, store, phase, arg, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, status, value = results.get(timeout=150)
            if status != "ok":
                raise SystemExit(f"rank {rank} of {world} in {phase.__name__} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got[0]


def restore_layout(world):
    # What the agent's restore lays out for each rank of `world` (every replicated tensor whole,
    # its rows of every sharded one, and the rows declared), cut here by the client's own reader
    # of the staged snapshot.
    from safetensors.torch import save_file
    from elastic_run import _load

    staged = os.path.join(STAGING, "step-3")
    out = os.path.join(TMP, f"restored-{world}")
    for r in range(world):
        os.environ.update(RANK=str(r), WORLD_SIZE=str(world))
        shards = {}
        step, tensors, rest = _load._read_staged(staged, shards=shards)
        d = os.path.join(out, f"rank-{r}")
        os.makedirs(d)
        save_file({k: t.contiguous() for k, t in tensors.items()}, os.path.join(d, "state.safetensors"), metadata={
            "elastic.step": str(step), "elastic.rank": str(r), "elastic.world_size": str(world),
            "elastic.shards": json.dumps(shards)})
        with open(os.path.join(d, "metadata.json"), "w") as f:
            json.dump({"step": step, "rank": r, "world_size": world, "saved_world_size": 4,
                       "metadata": {"state": rest}}, f)
    return out


def bucket(staged, step, world):
    # The staged step committed to a file:// bucket in raw chunks, as the agent commits it.
    import subprocess

    url = "file://" + os.path.join(TMP, "bucket")
    with open(os.path.join(staged, "rank-0", "meta.json")) as f:
        skeleton = json.load(f)["state"]
    subprocess.run([os.environ["ELASTIC_CKPT"], "push", staged, url, "--step", str(step), "--world-size", str(world),
                    "--no-compress", "--metadata", json.dumps({"state": skeleton})], check=True, capture_output=True)
    return url


report = {"save": run(4, save_phase)}
staged = os.path.join(STAGING, "step-3")
report["staged_headers"] = {}
for r in range(4):
    with open(os.path.join(staged, f"rank-{r}", "tensors.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        report["staged_headers"][r] = json.loads(f.read(n))
report["load3"] = run(3, load_phase, staged)
report["load3_restored"] = run(3, load_phase, restore_layout(3))
report["load2"] = run(2, load_phase, staged)
report["load3_from_bucket"] = run(3, load_phase, bucket(staged, 3, 4))
report["placements"] = run(2, placements)
print(json.dumps(report))
"""


class FsdpState(tc.Env):
    """Sharded state through save and load at other world sizes, with real FSDP2 and gloo."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        from tests.test_load_from import ckpt_exe

        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "ELASTIC_CKPT": ckpt_exe()}
        for k in ("ELASTIC_AGENT_SOCKET", "ELASTIC_RESUME_DIR", "ELASTIC_RESUME_STEP", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        p = subprocess.run([sys.executable, "-c", DRIVER, tc.CLIENT_DIR, cls.dir.name], capture_output=True,
                           text=True, timeout=600, env=env)
        if p.returncode != 0:
            cls.dir.cleanup()
            raise AssertionError(f"the FSDP2 driver failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        cls.report = json.loads(p.stdout.strip().splitlines()[-1])

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def test_each_rank_saves_its_own_rows_with_their_place_in_the_global_tensor(self):
        rows = {"state/model/0.weight": (7, 6), "state/model/2.weight": (5, 7), "state/model/4.bias": (2,)}
        for r, header in self.report["staged_headers"].items():
            shards = json.loads(header["__metadata__"]["elastic.shards"])
            for name, shape in rows.items():
                lo, hi = er.protocol.rows_for_rank(shape[0], int(r), 4)
                self.assertEqual(shards[name], {"global_shape": list(shape), "dim0_offset": lo}, (r, name))
                self.assertEqual(header[name]["shape"], [hi - lo, *shape[1:]], (r, name))
            # AdamW's moments are sharded like their parameter; its step count is replicated.
            self.assertIn("state/opt/state/~0/exp_avg", shards)
            self.assertNotIn("state/opt/state/~0/step", shards)
        # Ranks past the last row of a tensor save an empty shard of it.
        self.assertEqual(self.report["staged_headers"]["3"]["state/model/2.weight"]["shape"], [0, 7])
        self.assertEqual(self.report["save"]["local_shapes"]["4.bias"], [1])
        # Replicated tensors are still split between the ranks: each is written once.
        steps = [r for r, h in self.report["staged_headers"].items() if "state/opt/state/~0/step" in h]
        self.assertEqual(len(steps), 1, steps)

    def test_every_tensor_loads_gathered_bitwise_equal_at_worlds_of_3_and_2(self):
        saved = self.report["save"]["saved"]
        # Every parameter and both AdamW moments and the step of each: 6 parameters.
        self.assertEqual(len(saved), 6 * 4, sorted(saved))
        self.assertNotEqual(self.report["save"]["after"], saved, "the step after the save changed the state")
        for phase in ("load3", "load3_restored", "load2", "load3_from_bucket"):
            got = self.report[phase]
            self.assertEqual(got["step"], 3, phase)
            self.assertEqual(got["progress"], {"step": 3}, phase)
            self.assertNotEqual(got["before"], saved, f"{phase}: the check must be able to fail")
            self.assertEqual(got["loaded"], saved, phase)

    def test_a_restore_is_read_into_the_local_tensors_the_model_and_optimizer_hold(self):
        # Rank 0 of 3 holds rows of every tensor: each parameter, moment and step count keeps
        # its memory, the bytes read straight into it.
        saved = sorted(self.report["save"]["saved"])
        self.assertEqual(self.report["load3_restored"]["kept"], saved)
        # From a bucket too: each rank's rows are read from its chunks into them.
        self.assertEqual(self.report["load3_from_bucket"]["kept"], saved)
        # A staged snapshot is put together first: only the parameters are copied into.
        self.assertEqual(self.report["load3"]["kept"], [k for k in saved if k.startswith("model/")])

    def test_a_replicated_dtensor_is_saved_once_whole_and_loads_into_a_replicated_dtensor(self):
        ref = self.report["placements"]
        self.assertEqual(ref["replicate"], ["DTensor", "[Replicate()]", [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]])
        self.assertEqual(ref["replicate_keys"], 1)

    def test_layouts_a_checkpoint_cannot_hold_are_refused_by_entry_and_placement(self):
        ref = self.report["placements"]
        self.assertRegex(ref["2d"], r"state\['extra'\]\['2d'\].*Replicate\(\), Shard\(dim=0\)\].*2-D")
        self.assertRegex(ref["shard1"], r"state\['extra'\]\['shard1'\].*Shard\(dim=1\)")
        self.assertRegex(ref["partial"], r"state\['extra'\]\['partial'\].*Partial")
        self.assertFalse(ref["step_9_written"], "nothing of a refused save is written")

    def test_a_restore_cut_for_another_world_is_refused_naming_the_tensors(self):
        out = os.path.join(self.dir.name, "restored-3")
        self.env(RANK=1, WORLD_SIZE=2)
        with self.assertRaisesRegex(er.FormatError, r"state/model/0\.bias.*world_size 3, this worker has 2"):
            er.load({}, resume_dir=out)
        # The rank and world in metadata.json rewritten (as for a dense step's linked ranks): the
        # tensor file's own header still says what it was cut for.
        forged = os.path.join(self.tmp.name, "forged")
        shutil.copytree(out, forged)
        meta_path = os.path.join(forged, "rank-1", "metadata.json")
        meta = tc.read_json(meta_path)
        meta["world_size"] = 2
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        with self.assertRaisesRegex(er.FormatError, r"world_size 3, this worker has 2"):
            er.load({}, resume_dir=forged)
        # Its header rewritten too: the rows themselves are not rank 1 of 2's.
        rewrite_header(os.path.join(forged, "rank-1", "state.safetensors"), {"elastic.world_size": "2"})
        with self.assertRaisesRegex(er.FormatError, r"'state/model/0\.bias' holds rows \[3, 6\) of 7, rank 1 of 2 "
                                                    r"holds \[4, 7\)"):
            er.load({}, resume_dir=forged)

    def test_staged_shards_that_overlap_run_past_the_end_or_repeat_a_whole_tensor_are_refused(self):
        staged = os.path.join(self.tmp.name, "staged")
        shutil.copytree(os.path.join(self.dir.name, "staging", "step-3"), staged)
        self.env(RANK=0, WORLD_SIZE=2)
        path = os.path.join(staged, "rank-2", "tensors.safetensors")
        shards = json.loads(read_header(path)["elastic.shards"])

        def declare(change):
            rewrite_header(path, {"elastic.shards": json.dumps({**shards, **change})})

        # Rank 2 claims rank 1's rows of a tensor: they overlap, and rows 4-5 are missing.
        declare({"state/model/0.weight": {"global_shape": [7, 6], "dim0_offset": 2}})
        with self.assertRaisesRegex(er.FormatError, r"state/model/0\.weight.*do not tile dim 0"):
            er.load({}, resume_dir=staged)
        declare({"state/model/0.weight": {"global_shape": [7, 6], "dim0_offset": 6}})
        with self.assertRaisesRegex(er.FormatError, r"state/model/0\.weight.*not rows of \[7, 6\] from row 6"):
            er.load({}, resume_dir=staged)
        # Rank 2's rows declared as a whole tensor, which the other ranks hold shards of.
        del shards["state/model/0.weight"]
        declare({})
        with self.assertRaisesRegex(er.FormatError, r"tensor 'state/model/0\.weight' stored twice"):
            er.load({}, resume_dir=staged)

    def test_a_world_of_one_loads_the_sharded_state_into_a_plain_model_and_another_world_is_refused(self):
        import torch

        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        staged = os.path.join(self.dir.name, "staging", "step-3")
        self.env(RANK=1, WORLD_SIZE=2)
        with self.assertRaisesRegex(er.StateError, r"state\['model'\]\['0\.weight'\]: the checkpoint holds rows "
                                                   r"\[4, 7\) of a tensor of shape \[7, 6\] sharded.*plain tensor"):
            er.load({"model": model, "opt": opt, "progress": None}, resume_dir=staged)
        self.env(RANK=0, WORLD_SIZE=1)
        from elastic_run import _read

        real, seen = _read.TensorFile.read, []

        def read(f, into=None, views=()):
            seen.extend(views)
            return real(f, into, views)

        with mock.patch.object(_read.TensorFile, "read", read):
            self.assertEqual(er.load({"model": model, "opt": opt, "progress": None}, resume_dir=staged), 3)
        # The shards were cut from views of the files; nothing loaded is one.
        self.assertIn("state/model/0.weight", seen)
        self.assertFalse([p for p in tc.mapped_files() if p.startswith(staged)])
        names = {id(p): n for n, p in model.named_parameters()}
        got = {f"model/{n}": p for n, p in model.named_parameters()}
        got.update({f"opt/{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()})
        self.assertEqual({k: digest(t) for k, t in got.items()}, self.report["save"]["saved"])


def digest(t):
    """The driver's digest of a whole tensor."""
    import torch

    t = t.detach()
    return hashlib.sha256(str((t.dtype, list(t.shape))).encode() + t.reshape(-1).view(torch.uint8)
                          .numpy().tobytes()).hexdigest()


def read_header(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.metadata()


def rewrite_header(path, changes):
    """Rewrites safetensors file ``path`` with ``changes`` made to its ``__metadata__``."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(path), path, metadata={**read_header(path), **changes})
