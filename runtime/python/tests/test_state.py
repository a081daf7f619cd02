"""The state mapping form of save/async_save/load: any training state, bitwise across a restart.

python -m unittest discover -s runtime/python/tests -t runtime/python"""

import json
import os
import subprocess
import sys
import unittest
import warnings

from tests import test_client as tc

er = tc.er

# A training loop with every kind of state the client must carry: two models and an EMA copy,
# AdamW and SGD with momentum, a cosine LR schedule, a GradScaler that grows its scale, a
# StatefulDataLoader stopped mid-epoch, and the torch, Python and numpy RNGs nested in a list.
# `save STAGING WORLD` trains 6 steps, saves step 6 as WORLD ranks (async_save, so the loop
# mutates the state while it is written), and trains on to step 14. `resume [DIR]` loads into
# freshly built objects and trains steps 7-14. Both print the digests of the state at step 6
# and of steps 7-14. The 14 steps stay inside the loader's first epoch of 15 batches:
# torchdata resumes the rest of an epoch exactly, but shuffles the epochs after a resume
# otherwise than an uninterrupted run does.
LOOP = r"""
import copy, hashlib, json, os, random, sys, warnings
warnings.simplefilter("ignore")
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
import elastic_run as er
from torchdata.stateful_dataloader import StatefulDataLoader

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 120

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(8, generator=g), torch.randn(1, generator=g)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ema = copy.deepcopy(model)
head = torch.nn.Linear(1, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
opt2 = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)
scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
loader = StatefulDataLoader(Data(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
random.seed(2)
np.random.seed(3)
state = {"model": model, "ema": ema, "head": head, "opt": opt, "opt2": opt2, "sched": sched,
         "scaler": scaler, "data": loader, "rng": None, "progress": {"step": 0, "seen": []}}

def digest(obj):
    h = hashlib.sha256()
    def walk(v):
        if isinstance(v, torch.Tensor):
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, np.ndarray):
            h.update(v.tobytes())
        else:
            h.update(repr(v).encode())
    walk(obj)
    return h.hexdigest()

def digests():
    out = {k: digest(state[k].state_dict()) for k in ("model", "ema", "head", "opt", "opt2", "sched", "scaler")}
    out["data"] = digest(loader.state_dict())
    out["rng"] = digest([torch.get_rng_state(), random.getstate(), np.random.get_state()])
    out["progress"] = digest(state["progress"])
    return out

# Made at the first step: after load_state_dict, so that the loader resumes where it stopped.
batches = None

def train(step):
    global batches
    if batches is None:
        batches = iter(loader)
    try:
        ids, x, y = next(batches)
    except StopIteration:
        batches = iter(loader)
        ids, x, y = next(batches)
    x = x + 0.01 * torch.randn_like(x) + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
    loss = (head(model(x)) - y).pow(2).mean()
    opt.zero_grad()
    opt2.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.step(opt2)
    scaler.update()
    sched.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    state["progress"]["step"] = step
    state["progress"]["seen"].append(ids.tolist())
    return [ids.tolist(), loss.item().hex(), sched.get_last_lr()[0].hex(), scaler.get_scale()]

mode = sys.argv[2]
if mode == "save":
    staging, world = sys.argv[3], int(sys.argv[4])
    for step in range(1, 7):
        train(step)
    state["rng"] = [torch.get_rng_state(), random.getstate(), np.random.get_state()]
    at_save = digests()
    os.environ["ELASTIC_STAGING_DIR"] = staging
    os.environ["WORLD_SIZE"] = str(world)
    for r in range(world):
        os.environ["RANK"] = str(r)
        er.async_save(6, state)
    start = 6
else:
    for k in ("model", "head"):  # other weights than the saved ones, so a missed load shows
        torch.nn.init.normal_(state[k][0].weight if k == "model" else state[k].weight)
    start = er.load(state, resume_dir=sys.argv[3] if len(sys.argv) > 3 else None)
    torch.set_rng_state(state["rng"][0])
    random.setstate(state["rng"][1])
    np.random.set_state(state["rng"][2])
    at_save = digests()
after = [train(step) for step in range(start + 1, 15)]
er.wait()
print(json.dumps({"start": start, "at_save": at_save, "after": after, "end": digests()}))
"""


def run_loop(*args, env=None):
    p = subprocess.run([sys.executable, "-c", LOOP, tc.CLIENT_DIR, *args], capture_output=True, text=True,
                       timeout=180, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise AssertionError(f"the training loop {args} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


class TrainingLoopState(tc.Restores):
    def test_a_full_training_state_resumes_bitwise_in_a_new_process_at_another_world_size(self):
        staging = os.path.join(self.tmp.name, "staging")
        saved = run_loop("save", staging, "2")
        staged = os.path.join(staging, "step-6")
        keys = [set(tc.read_json(os.path.join(staged, f"rank-{r}", "meta.json"))["keys"]) for r in (0, 1)]
        self.assertTrue(keys[0] and keys[1] and not keys[0] & keys[1], keys)
        # Module tensors keep their state_dict() names under the entry's name.
        self.assertIn("state/model/0.weight", keys[0] | keys[1])
        self.assertIn("state/ema/2.bias", keys[0] | keys[1])

        def check(resumed):
            self.assertEqual(resumed["start"], 6)
            self.assertEqual(resumed["at_save"], saved["at_save"])
            self.assertEqual(resumed["after"], saved["after"])
            self.assertEqual(resumed["end"], saved["end"])

        # A staged snapshot read whole, in a fresh interpreter at world 1.
        env = {"RANK": "0", "WORLD_SIZE": "1"}
        check(run_loop("resume", staged, env=env))
        # The agent's restore layout at world 3, found through the environment.
        out = self.restore(staged, world=3, step=6)
        check(run_loop("resume", env={"ELASTIC_RESUME_DIR": out, "ELASTIC_RESUME_STEP": "6", "RANK": "2",
                                      "WORLD_SIZE": "3"}))
        # The scale grew and the schedule moved: the loop exercises what it claims to.
        self.assertGreater(saved["after"][-1][3], 16.0)
        self.assertNotEqual(saved["after"][0][2], saved["after"][-1][2])


class StateMapping(tc.TorchEnv):
    def stage_dir(self):
        return os.path.join(self.tmp.name, "staging")

    def save(self, state, step=3):
        self.env(ELASTIC_STAGING_DIR=self.stage_dir(), RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        er.save(step, state)
        return os.path.join(self.stage_dir(), f"step-{step}")

    def test_plain_values_of_every_kind_come_back_in_the_mapping(self):
        import math

        import numpy as np
        torch = self.torch
        values = {
            "nested": {"a": [torch.arange(3), (torch.ones(2, dtype=torch.bfloat16), None)], "b": {"c": "x/y"}},
            "odd_keys": {0: "int", (1, "t"): 2.5, None: True, "$s": b"\x00\xffbytes", "": -0.0, ".": 1, "a/b": 2},
            "numbers": [2**53 - 1, 2**80, -(2**70), math.inf, -math.inf, 1e-310, 0.1 + 0.2],
            "numpy": [np.arange(4, dtype=np.uint32), np.float32(1.25), np.int64(-7)],
            "torch_kinds": [torch.float16, torch.device("cpu"), torch.zeros(0, 3)],
            "dollar": {"$t": "not a tensor", "$tuple": [1]},
        }
        d = self.save(dict(values, nan=float("nan")))
        back = {k: None for k in list(values) + ["nan"]}
        self.assertEqual(er.load(back, resume_dir=d), 3)
        self.assertTrue(math.isnan(back.pop("nan")))

        def same(a, b, at):
            self.assertIs(type(a), type(b), at)
            if isinstance(a, torch.Tensor):
                self.assertEqual((a.dtype, a.shape), (b.dtype, b.shape), at)
                self.assertTrue(torch.equal(a, b), at)
            elif isinstance(a, np.ndarray):
                self.assertEqual(a.dtype, b.dtype, at)
                self.assertTrue(np.array_equal(a, b), at)
            elif isinstance(a, dict):
                self.assertEqual(list(a), list(b), at)
                for k in a:
                    same(a[k], b[k], f"{at}[{k!r}]")
            elif isinstance(a, (list, tuple)):
                self.assertEqual(len(a), len(b), at)
                for i, (x, y) in enumerate(zip(a, b)):
                    same(x, y, f"{at}[{i}]")
            elif isinstance(a, float):
                self.assertEqual(a.hex(), b.hex(), at)
            else:
                self.assertEqual(a, b, at)

        same(values, back, "state")

    def test_async_save_captures_the_state_at_the_call_and_every_optimizer_waits_for_the_write(self):
        torch = self.torch
        model, opt = self.make(0)
        ema = torch.nn.Linear(2, 2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        self.env(ELASTIC_STAGING_DIR=self.stage_dir(), RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        state = {"model": model, "opt": opt, "ema": ema, "sched": sched}
        want = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.state_dict().items()}
                for k, v in (("model", model), ("ema", ema))}
        want_lr = sched.state_dict()["_last_lr"]
        pending = er.async_save(4, state)
        # The EMA weights (no optimizer guards them) and the schedule change at once; the
        # model's weights change through opt.step(), which waits for the write.
        with torch.no_grad():
            ema.weight.add_(1.0)
        sched.step()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        self.assertTrue(pending.done())
        fresh, fresh_opt = self.make(1)
        back = {"model": fresh, "opt": fresh_opt, "ema": torch.nn.Linear(2, 2),
                "sched": torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5)}
        self.assertEqual(er.load(back, resume_dir=os.path.join(self.stage_dir(), "step-4")), 4)
        for k in ("model", "ema"):
            for n, t in back[k].state_dict().items():
                self.assertTrue(torch.equal(t, want[k][n]), f"{k}.{n}")
        self.assertEqual(back["sched"].state_dict()["_last_lr"], want_lr)

    def test_missing_and_unknown_entries_are_refused_unless_strict_is_false(self):
        torch = self.torch
        model, opt = self.make(0)
        d = self.save({"model": model, "opt": opt, "step_info": {"n": 3}})
        fresh, fresh_opt = self.make(1)
        before = [t.clone() for t in fresh.state_dict().values()]
        with self.assertRaises(er.StateError) as e:
            er.load({"model": fresh, "ema": torch.nn.Linear(8, 16)}, resume_dir=d)
        msg = str(e.exception)
        self.assertIn("lacks 'ema'", msg)
        self.assertIn("holds 'opt', 'step_info'", msg)
        self.assertIn("strict=False", msg)
        # Nothing was loaded.
        for a, b in zip(before, fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
        partial = {"model": fresh, "ema": None}
        self.assertEqual(er.load(partial, resume_dir=d, strict=False), 3)
        self.assertIsNone(partial["ema"])
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))

    def test_a_shape_or_dtype_mismatch_names_the_entry_and_loads_nothing(self):
        torch = self.torch
        model, opt = self.make(0)
        d = self.save({"model": model, "opt": opt})
        for other, word in ((torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 1)),
                             "shape [16, 8]"),
                            (self.make(1)[0].to(torch.float64), "float32")):
            o = torch.optim.Adam(other.parameters())
            before = [t.clone() for t in other.state_dict().values()]
            with self.assertRaises(er.StateError) as e:
                er.load({"model": other, "opt": o}, resume_dir=d)
            self.assertIn("state['model']['0.weight']", str(e.exception))
            self.assertIn(word, str(e.exception))
            for a, b in zip(before, other.state_dict().values()):
                self.assertTrue(torch.equal(a, b))

    def test_what_cannot_be_saved_is_named_before_anything_is_written(self):
        torch = self.torch

        class Opaque:
            pass

        cases = [
            ({"bad name!": 1}, ValueError, "state name 'bad name!' is not a valid key"),
            ({"": 1}, ValueError, "is not a valid key"),
            ({"ok": {"deep": [Opaque()]}}, TypeError, "state['ok']['deep'][0]"),
            ({"ok": {"k": {1, 2}}}, TypeError, "builtins.set cannot be saved"),
            ({"ok": {[1][0]: 1, frozenset(): 2}}, TypeError, "dict key frozenset()"),
            ({"ok": "\ud800"}, ValueError, "not valid Unicode"),
            ({"ok": torch.zeros(2).to_sparse()}, TypeError, "sparse"),
        ]
        for state, kind, text in cases:
            with self.subTest(text=text):
                with self.assertRaises(kind) as e:
                    self.save(state)
                self.assertIn(text, str(e.exception))
        self.assertFalse(os.path.exists(os.path.join(self.stage_dir(), "step-3")))

    def test_the_two_forms_do_not_mix_or_load_each_others_checkpoints(self):
        model, opt = self.make(0)
        with self.assertRaises(TypeError):
            er.save(1, {"model": model}, optimizer=opt)
        with self.assertRaises(TypeError):
            er.load({"model": model}, model=model)
        self.env(ELASTIC_STAGING_DIR=self.stage_dir(), RANK=0, WORLD_SIZE=1)
        er.save(1, model=model, optimizer=opt, extra={"a": 1})
        er.save(2, {"model": model, "opt": opt})
        with self.assertRaisesRegex(er.StateError, r"load\(model=, optimizer=\)"):
            er.load({"model": model}, resume_dir=os.path.join(self.stage_dir(), "step-1"))
        with self.assertRaisesRegex(er.StateError, r"'model', 'opt'.*load\(state\)"):
            er.load(model=model, optimizer=opt, resume_dir=os.path.join(self.stage_dir(), "step-2"))
        # The legacy form positionally, as before.
        self.assertEqual(er.load(model, opt, os.path.join(self.stage_dir(), "step-1"))[0], 1)
        # A NaN in the legacy form's JSON is refused at the save, not written for no reader.
        with self.assertRaisesRegex(ValueError, "JSON state cannot be written"):
            er.save(5, model=model, extra={"loss": float("nan")})

    def test_forged_skeletons_are_format_errors_naming_the_place(self):
        torch = self.torch
        d = self.save({"v": {"t": torch.ones(2)}})
        meta_path = os.path.join(d, "rank-0", "meta.json")
        meta = tc.read_json(meta_path)
        cases = [
            ({"$t": "state/v/nope"}, "state['v']: refers to the tensor 'state/v/nope'"),
            ({"$t": 5}, "is not a tensor name"),
            ({"$t": "state/v/t", "x": 1}, "not a tagged value"),
            ({"$pickle": "gASV"}, "unknown tag '$pickle'"),
            ({"$bytes": "!!"}, "not base64"),
            ({"$dtype": "__class__"}, "not a torch dtype"),
            ({"$dtype": "nn"}, "not a torch dtype"),
            ({"$device": "nowhere:9"}, "not a torch device"),
            ({"$int": "12a"}, "not the digits"),
            ({"$f": "NaN"}, "not nan, inf or -inf"),
            ({"$np": ["object", 1]}, "not [numpy dtype, value]"),
            ({"$np": ["uint8", 300]}, "not a numpy uint8"),
            ({"$items": [[[1], 2]]}, "cannot be a dict key"),
            ({"$items": [[1, 2], [1, 3]]}, "given twice"),
            ({"$items": [1]}, "not a [key, value] pair"),
            ({"$tuple": {}}, "not an array"),
        ]
        for forged, text in cases:
            with self.subTest(forged=forged):
                meta["state"]["entries"]["v"]["value"] = forged
                with open(meta_path, "w") as f:
                    json.dump(meta, f)
                with self.assertRaises(er.FormatError) as e:
                    er.load({"v": None}, resume_dir=d)
                self.assertIn(text, str(e.exception))
                self.assertIn("staging", str(e.exception))
        for entries, text in (({"v": []}, "not {'stateful'"), ([], "entries is []")):
            meta["state"]["entries"] = entries
            with open(meta_path, "w") as f:
                json.dump(meta, f)
            with self.assertRaises(er.FormatError) as e:
                er.load({"v": None}, resume_dir=d)
            self.assertIn(text, str(e.exception))
        meta["state"] = {"format": "elastic_run.state/9", "entries": {}}
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        with self.assertRaisesRegex(er.FormatError, "unknown state format 'elastic_run.state/9'"):
            er.load({}, resume_dir=d)

    def test_a_stateful_entry_and_a_plain_one_are_not_taken_for_each_other(self):
        model, opt = self.make(0)
        d = self.save({"model": model, "plain": {"x": 1}})
        with self.assertRaisesRegex(er.StateError, "state\\['model'\\] was saved from a Stateful"):
            er.load({"model": {}, "plain": None}, resume_dir=d)
        with self.assertRaisesRegex(er.StateError, "state\\['plain'\\] was saved as a plain value"):
            er.load({"model": model, "plain": self.make(1)[0]}, resume_dir=d)


class LRScalingWithSchedulers(tc.TorchEnv):
    def run_steps(self, opt, sched, steps):
        """The LR each opt.step() ran with (seen by a hook after the scaling's), and the
        scheduler's own LR after each step."""
        torch = self.torch
        used = []
        h = opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
        self.addCleanup(h.remove)
        p = opt.param_groups[0]["params"][0]
        own = []
        for _ in range(steps):
            p.grad = torch.ones_like(p)
            opt.step()
            sched.step()
            own.append(opt.param_groups[0]["lr"])
        h.remove()
        return used, own

    def make_opt(self):
        torch = self.torch
        p = torch.nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([p], lr=0.4)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=0.01)

    def test_a_cosine_schedule_across_a_rescale_from_4_to_2_runs_at_exactly_half_after_the_warmup(self):
        import math

        # The schedule without elastic-run: what the scaled one must be a multiple of.
        ref_opt, ref_sched = self.make_opt()
        _, ref = self.run_steps(ref_opt, ref_sched, 20)
        ref = [0.4] + ref  # the LR of step t+1 is the scheduler's LR after t steps

        # Generation 1: world 4 is the reference world (scale 1); 10 steps, then a checkpoint.
        self.env(ELASTIC_LR_SCALE="1.0", ELASTIC_WARMUP_STEPS="3")
        os.environ.pop("ELASTIC_RESUME_STEP", None)
        opt, sched = self.make_opt()
        self.assertIs(er.scale_lr(opt), er.scale_lr(opt))
        used1, own1 = self.run_steps(opt, sched, 10)
        self.assertEqual(used1, ref[:10])
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "st"), RANK=0, WORLD_SIZE=1)
        er.save(10, {"opt": opt, "sched": sched})
        # The checkpoint holds the scheduler's own LR, not a scaled one.
        self.assertEqual(opt.state_dict()["param_groups"][0]["lr"], ref[10])

        # Generation 2 at world 2, linear scaling: scale 2/4, ramped over 3 steps from step 10.
        self.env(ELASTIC_LR_SCALE="0.5", ELASTIC_RESUME_STEP="10")
        opt2, sched2 = self.make_opt()
        self.assertEqual(er.load({"opt": opt2, "sched": sched2},
                                 resume_dir=os.path.join(self.tmp.name, "st", "step-10")), 10)
        er.scale_lr(opt2)
        used2, own2 = self.run_steps(opt2, sched2, 10)
        # Steps 11-13 ramp: cosine(t) x (1 - 0.5 * (t - 10) / 3), where t is the step's number
        # within the warm-up, counted as scaled_lr counts it.
        for i, t in enumerate(range(11, 14)):
            self.assertEqual(used2[i], ref[10 + i] * (1.0 + (0.5 - 1.0) * min(1.0, (t - 10) / 3)))
        # From step 13 on, exactly cosine(t) x 2/4; the scheduler itself never sees the scale.
        for i in range(2, 10):
            self.assertEqual(used2[i], ref[10 + i] * 0.5, f"step {11 + i}")
        self.assertEqual(own2, ref[11:21])
        # And the schedule is the cosine: the closed form, to rounding.
        for i, lr in enumerate(own2):
            t = 11 + i
            self.assertAlmostEqual(lr, 0.01 + (0.4 - 0.01) * (1 + math.cos(math.pi * t / 30)) / 2, places=12)

    def test_without_elastic_run_the_factor_is_one_and_remove_undoes_it(self):
        for k in ("ELASTIC_LR_SCALE", "ELASTIC_WARMUP_STEPS", "ELASTIC_RESUME_STEP"):
            os.environ.pop(k, None)
        opt, sched = self.make_opt()
        s = er.scale_lr(opt)
        self.assertEqual(s.factor(), 1.0)
        ref_opt, ref_sched = self.make_opt()
        self.assertEqual(self.run_steps(opt, sched, 3), self.run_steps(ref_opt, ref_sched, 3))
        self.env(ELASTIC_LR_SCALE="3.0")
        s.remove()
        self.assertIsNot(er.scale_lr(opt), s)
        er.scale_lr(opt).remove()
        used, _ = self.run_steps(opt, sched, 1)
        self.assertEqual(used, [ref_opt.param_groups[0]["lr"]])
        # A step counter of the caller's own drives the warm-up.
        self.env(ELASTIC_WARMUP_STEPS="4", ELASTIC_RESUME_STEP="100")
        self.assertEqual(er.scale_lr(opt, step=lambda: 102).factor(), 1.0 + 2.0 * 0.5)


class OneGlobalStream(tc.TorchEnv):
    def layout(self, world, accum, batch, rank=0, fixed=None):
        self.env(WORLD_SIZE=world, RANK=rank, ELASTIC_GRAD_ACCUM_STEPS=accum, ELASTIC_BATCH_SIZE=batch,
                 ELASTIC_GLOBAL_BATCH=fixed or batch * world * accum)

    def take_step(self, sampler_state, world, accum, batch):
        """Every rank's ids for the next global batch (each rank's sampler made afresh from the
        saved state, as after a restart), checked to split it exactly; returns the batch."""
        shares = []
        for r in range(world):
            self.layout(world, accum, batch, rank=r)
            s = er.ElasticSampler(50, seed=7)
            s.load_state_dict(sampler_state)
            shares.append(list(s))
        self.layout(world, accum, batch)
        s = er.ElasticSampler(50, seed=7)
        s.load_state_dict(sampler_state)
        g = s.global_batch()
        want = s.ids(s.consumed, g)
        # The ranks' shares are the batch's micro-batch slices, in order, and cover it once.
        got = []
        for r, share in enumerate(shares):
            self.assertEqual(len(share) % batch, 0)
            got.extend(share[:g // world])
        self.assertEqual(sorted(got), sorted(want))
        for a in range(accum):
            for r in range(world):
                lo = (a * world + r) * batch
                self.assertEqual(shares[r][a * batch:(a + 1) * batch], want[lo:lo + batch])
        s.advance()
        return want, s.state_dict()

    def test_world_size_changes_in_both_modes_and_a_redo_continue_the_one_stream(self):
        stream = er.ElasticSampler(50, seed=7)
        taken = []
        st = stream.state_dict()
        saved = None
        # (world, accum, per-worker batch): linear 3 -> 2 -> 3 with 4 per worker, then a fixed
        # global batch of 12 as 3 x 1 x 4, 2 x 2 x 3 and 1 x 3 x 4, across many epochs of 50.
        plan = [(3, 1, 4)] * 7 + [(2, 1, 4)] * 9 + [(3, 1, 4)] * 5 + [(3, 1, 4), (2, 2, 3), (1, 3, 4)] * 6
        for i, (world, accum, batch) in enumerate(plan):
            if i == 10:
                saved = (dict(st), len(taken))
            if i == 14:
                # A SIGKILL: the job resumes from the checkpoint of step 10 and redoes 10..13,
                # which take exactly the same samples again.
                redo_from, n = saved
                redone = []
                st = redo_from
                for w, a, b in plan[10:14]:
                    ids, st = self.take_step(st, w, a, b)
                    redone.extend(ids)
                self.assertEqual(redone, taken[n:])
            ids, st = self.take_step(st, world, accum, batch)
            taken.extend(ids)
        self.assertEqual(taken, stream.ids(0, len(taken)))
        # No sample repeats within an epoch, and every epoch is a permutation of the dataset.
        for e in range(len(taken) // 50):
            self.assertEqual(sorted(taken[e * 50:(e + 1) * 50]), list(range(50)))
        self.assertGreater(len(taken) // 50, 5)
        self.assertNotEqual(taken[:50], taken[50:100])

    def test_a_data_loader_gives_the_micro_batches_and_the_state_rides_in_the_state_mapping(self):
        torch = self.torch
        self.layout(world=2, accum=2, batch=3, rank=1)
        s = er.ElasticSampler(20, seed=1)
        loader = torch.utils.data.DataLoader(list(range(20)), batch_size=3, sampler=s)
        micro = [b.tolist() for b in loader]
        flat = [i for b in micro for i in b]
        self.assertEqual(flat, list(s))
        # One epoch's worth of global batches of 12 over 20 samples: 2, the second reaching
        # into the next epoch.
        self.assertEqual(len(micro), 4)
        s.advance(2)
        self.assertEqual(s.epoch, 1)
        expected = list(s)
        # Saved by a world of one, loaded, and read again as rank 1 of 2.
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "st"), WORLD_SIZE=1, RANK=0)
        er.save(2, {"data": s})
        back = er.ElasticSampler(20, seed=1)
        er.load({"data": back}, resume_dir=os.path.join(self.tmp.name, "st", "step-2"))
        self.assertEqual(back.consumed, 24)
        self.layout(world=2, accum=2, batch=3, rank=1)
        self.assertEqual(list(back), expected)
        with self.assertRaisesRegex(ValueError, "seed 1, this sampler 2"):
            er.load({"data": er.ElasticSampler(20, seed=2)}, resume_dir=os.path.join(self.tmp.name, "st", "step-2"))

    def test_bad_arguments_and_a_layout_off_the_global_batch_are_named(self):
        for kw, text in (({"dataset_len": 0}, "dataset_len 0"), ({"dataset_len": 5, "seed": -1}, "seed -1"),
                         ({"dataset_len": 2.5}, "dataset_len 2.5"), ({"dataset_len": 5, "batch_size": 0}, "batch_size 0")):
            with self.assertRaisesRegex(ValueError, text):
                er.ElasticSampler(**kw)
        self.layout(world=2, accum=1, batch=4, fixed=12)
        with self.assertRaisesRegex(ValueError, "is 8, not the job's global batch 12"):
            list(er.ElasticSampler(10))
        os.environ.pop("ELASTIC_BATCH_SIZE")
        os.environ.pop("ELASTIC_GLOBAL_BATCH")
        with self.assertRaisesRegex(ValueError, "no batch size"):
            list(er.ElasticSampler(10))
        unshuffled = er.ElasticSampler(5, shuffle=False, batch_size=2)
        self.assertEqual(unshuffled.ids(3, 5), [3, 4, 0, 1, 2])


if __name__ == "__main__":
    warnings.simplefilter("default")
    unittest.main()
