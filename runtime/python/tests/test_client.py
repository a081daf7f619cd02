"""Unit tests for the elastic_run worker client: python -m unittest discover -s runtime/python/tests"""

import json
import os
import socket
import sys
import tempfile
import threading
import time
import unittest
import warnings
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import elastic_run as er  # noqa: E402


def read_json(path):
    with open(path) as f:
        return json.load(f)


class FakeAgent:
    """A Unix-socket agent that records requests and answers like the real one."""

    def __init__(self, path, should_stop=False, checkpoint_at=None, refuse_saved=False, saved_delay_s=0.0):
        self.path = path
        self.saved_delay_s = saved_delay_s
        self.requests = []
        self.should_stop = should_stop
        self.checkpoint_at = checkpoint_at
        self.refuse_saved = refuse_saved
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(path)
        self.srv.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn):
        with conn, conn.makefile("rb") as f:
            self._lines(conn, f)

    def _lines(self, conn, f):
        for line in f:
            req = json.loads(line)
            self.requests.append(req)
            if req["type"] == "saved" and self.saved_delay_s:
                time.sleep(self.saved_delay_s)
            if req["type"] == "query":
                rep = {"type": "state", "should_stop": self.should_stop,
                       "should_checkpoint_at": self.checkpoint_at, "generation": 2}
            elif req["type"] == "saved" and self.refuse_saved:
                rep = {"type": "error", "message": "outside staging"}
            else:
                rep = {"type": "ok"}
            conn.sendall(json.dumps(rep).encode() + b"\n")

    def close(self):
        self.srv.close()


class Env(unittest.TestCase):
    def setUp(self):
        er._reset_for_tests()
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.addCleanup(er._reset_for_tests)

    def env(self, **kv):
        p = mock.patch.dict(os.environ, {k: str(v) for k, v in kv.items()})
        p.start()
        self.addCleanup(p.stop)


class EnvironmentHelpers(Env):
    def test_values_come_from_elastic_variables(self):
        self.env(RANK=3, WORLD_SIZE=8, LOCAL_RANK=1, ELASTIC_LR_SCALE=2.0, ELASTIC_BATCH_SIZE=32,
                 ELASTIC_GRAD_ACCUM_STEPS=4, ELASTIC_GLOBAL_BATCH=1024, ELASTIC_GENERATION=5)
        self.assertEqual((er.rank(), er.world_size(), er.local_rank(), er.generation()), (3, 8, 1, 5))
        self.assertEqual(er.scaled_lr(0.1), 0.2)
        self.assertEqual((er.batch_size(), er.grad_accum_steps(), er.global_batch()), (32, 4, 1024))

    def test_defaults_outside_elastic_run(self):
        for k in ("ELASTIC_LR_SCALE", "ELASTIC_BATCH_SIZE", "ELASTIC_GRAD_ACCUM_STEPS", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
        self.assertEqual(er.scaled_lr(0.5), 0.5)
        self.assertEqual(er.batch_size(7), 7)
        self.assertEqual((er.grad_accum_steps(), er.rank(), er.world_size()), (1, 0, 1))

    def test_warmup_ramps_from_unscaled_to_scaled_after_the_resume_step(self):
        self.env(ELASTIC_LR_SCALE=3.0, ELASTIC_WARMUP_STEPS=10, ELASTIC_RESUME_STEP=100)
        self.assertAlmostEqual(er.scaled_lr(1.0, step=100), 1.0)
        self.assertAlmostEqual(er.scaled_lr(1.0, step=105), 2.0)
        self.assertAlmostEqual(er.scaled_lr(1.0, step=110), 3.0)
        self.assertAlmostEqual(er.scaled_lr(1.0, step=500), 3.0)
        self.assertAlmostEqual(er.scaled_lr(1.0), 3.0)

    def test_garbage_values_raise_with_the_variable_name(self):
        self.env(ELASTIC_BATCH_SIZE="lots")
        with self.assertRaisesRegex(ValueError, "ELASTIC_BATCH_SIZE"):
            er.batch_size()

    def test_interval_checkpoints(self):
        self.env(ELASTIC_CHECKPOINT_INTERVAL=5)
        self.assertEqual([s for s in range(0, 16) if er.should_checkpoint(s)], [5, 10, 15])


class Split(unittest.TestCase):
    def test_each_key_written_once_and_bytes_balanced(self):
        sizes = {f"k{i}": (i + 1) * 100 for i in range(20)}
        for world in (1, 2, 3, 7, 40):
            owner = er.assign_keys(sizes, world)
            self.assertEqual(set(owner), set(sizes))
            loads = [0] * world
            for k, r in owner.items():
                loads[r] += sizes[k]
            self.assertLessEqual(max(loads) - min(loads), max(sizes.values()), (world, loads))

    def test_split_is_independent_of_dict_order(self):
        sizes = {"a": 5, "b": 5, "c": 9, "d": 1}
        rev = dict(reversed(list(sizes.items())))
        self.assertEqual(er.assign_keys(sizes, 2), er.assign_keys(rev, 2))


class AgentProtocol(Env):
    def test_should_stop_and_checkpoint_request_come_from_the_agent(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, should_stop=False, checkpoint_at=12)
        self.addCleanup(agent.close)
        self.env(ELASTIC_AGENT_SOCKET=path, LOCAL_RANK=0, RANK=0)
        self.assertFalse(er.should_stop(10))
        self.assertFalse(er.should_checkpoint(11))
        self.assertTrue(er.should_checkpoint(12))
        # The agent repeats its request in every reply: it is honoured once.
        self.assertFalse(er.should_stop(13))
        self.assertFalse(er.should_checkpoint(13))
        agent.checkpoint_at = 20
        self.assertFalse(er.should_stop(14))
        self.assertTrue(er.should_checkpoint(20))
        agent.should_stop = True
        agent.checkpoint_at = None
        self.assertTrue(er.should_stop(21))
        self.assertEqual([r["type"] for r in agent.requests], ["query"] * 4)

    def test_a_stop_another_node_asked_for_is_reported_to_this_agent(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, should_stop=False)
        self.addCleanup(agent.close)
        self.env(ELASTIC_AGENT_SOCKET=path, LOCAL_RANK=0, RANK=2)
        # The all-reduce says stop although this agent did not ask: a peer's drain.
        with mock.patch.object(er, "_all_reduce_max", lambda v: [1, v[1]]):
            self.assertTrue(er.should_stop(30))
        self.assertEqual(agent.requests[-1], {"type": "peer_stop", "rank": 2, "step": 30})
        # This agent asked itself: nothing more to say.
        agent.should_stop = True
        with mock.patch.object(er, "_all_reduce_max", lambda v: [1, v[1]]):
            self.assertTrue(er.should_stop(31))
        self.assertEqual([r["type"] for r in agent.requests], ["query", "peer_stop", "query"])

    def test_only_local_rank_zero_asks_the_agent(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, should_stop=True)
        self.addCleanup(agent.close)
        self.env(ELASTIC_AGENT_SOCKET=path, LOCAL_RANK=1, RANK=1)
        self.assertFalse(er.should_stop(1))  # no process group: rank 1 alone cannot know
        self.assertEqual(agent.requests, [])

    def test_progress_is_rate_limited(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path)
        self.addCleanup(agent.close)
        self.env(ELASTIC_AGENT_SOCKET=path, RANK=4)
        for s in range(50):
            er.report_progress(s)
        self.assertEqual(agent.requests[0], {"type": "progress", "rank": 4, "step": 0})
        self.assertLess(len(agent.requests), 5)


class TorchEnv(Env):
    """torch, and a small trained model (no tests of its own)."""

    def setUp(self):
        super().setUp()
        import torch
        self.torch = torch

    def make(self, seed):
        torch = self.torch
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(4, 8)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return model, opt


class Snapshots(TorchEnv):
    def test_two_ranks_split_the_state_and_any_world_loads_it_back(self):
        torch = self.torch
        staging = os.path.join(self.tmp.name, "staging")
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path)
        self.addCleanup(agent.close)
        model, opt = self.make(0)
        rng = torch.get_rng_state()
        for r in (0, 1):
            self.env(ELASTIC_STAGING_DIR=staging, ELASTIC_AGENT_SOCKET=path, RANK=r, WORLD_SIZE=2)
            d = er.save(7, model=model, optimizer=opt, extra={"data_pos": 56, "rng": rng})
            self.assertEqual(d, os.path.join(staging, "step-7", f"rank-{r}"))
        saved = [q for q in agent.requests if q["type"] == "saved"]
        self.assertEqual([(q["rank"], q["step"]) for q in saved], [(0, 7), (1, 7)])
        # No temporary directories left; each rank holds part of the tensors, none twice.
        step_dir = os.path.join(staging, "step-7")
        self.assertEqual(sorted(os.listdir(step_dir)), ["rank-0", "rank-1"])
        keys = [set(read_json(os.path.join(step_dir, f"rank-{r}", "meta.json"))["keys"]) for r in (0, 1)]
        self.assertTrue(keys[0] and keys[1])
        self.assertFalse(keys[0] & keys[1])

        fresh, fresh_opt = self.make(1)
        step, extra = er.load(model=fresh, optimizer=fresh_opt, resume_dir=step_dir)
        self.assertEqual(step, 7)
        self.assertEqual(extra["data_pos"], 56)
        self.assertTrue(torch.equal(extra["rng"], rng))
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
        # Training on continues identically from the loaded optimizer state.
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))

    def test_load_refuses_a_snapshot_with_a_missing_rank(self):
        staging = os.path.join(self.tmp.name, "staging")
        model, opt = self.make(0)
        self.env(ELASTIC_STAGING_DIR=staging, RANK=1, WORLD_SIZE=2)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        er.save(3, model=model, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "incomplete"):
            er.load(model=model, resume_dir=os.path.join(staging, "step-3"))

    def test_nothing_to_resume_is_none(self):
        os.environ.pop("ELASTIC_RESUME_DIR", None)
        self.assertIsNone(er.load(model=None))
        self.env(ELASTIC_RESUME_DIR=os.path.join(self.tmp.name, "nope"))
        self.assertIsNone(er.load(model=None))

    def test_refused_hand_over_raises(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, refuse_saved=True)
        self.addCleanup(agent.close)
        model, _ = self.make(0)
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), ELASTIC_AGENT_SOCKET=path, RANK=0, WORLD_SIZE=1)
        with self.assertRaisesRegex(er.AgentError, "outside staging"):
            er.save(1, model=model)

    def test_save_outside_elastic_run_warns_once_and_writes_nothing(self):
        model, opt = self.make(0)
        self.env(RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_STAGING_DIR", None)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        cwd = os.getcwd()
        os.chdir(self.tmp.name)
        self.addCleanup(os.chdir, cwd)
        with self.assertWarnsRegex(RuntimeWarning, "ELASTIC_STAGING_DIR"):
            self.assertIsNone(er.save(5, model=model, optimizer=opt))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertIsNone(er.save(10, model=model, optimizer=opt))
        self.assertEqual(caught, [])
        self.assertEqual(os.listdir(self.tmp.name), [])

    def test_saved_waits_for_a_backed_up_agent_beyond_the_socket_timeout(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, saved_delay_s=0.6)
        self.addCleanup(agent.close)
        model, _ = self.make(0)
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), ELASTIC_AGENT_SOCKET=path, RANK=0, WORLD_SIZE=1)
        with mock.patch.object(er, "SOCKET_TIMEOUT_S", 0.2), mock.patch.object(er, "SAVED_TIMEOUT_S", 10.0):
            er.save(1, model=model)
        self.assertEqual([q["step"] for q in agent.requests if q["type"] == "saved"], [1])

    def test_saved_without_reply_raises_once_and_is_not_resent(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, saved_delay_s=1.0)
        self.addCleanup(agent.close)
        model, _ = self.make(0)
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), ELASTIC_AGENT_SOCKET=path, RANK=0, WORLD_SIZE=1)
        with mock.patch.object(er, "SAVED_TIMEOUT_S", 0.2):
            with self.assertRaisesRegex(er.AgentError, "no reply from the agent within 0.2 s to 'saved'"):
                er.save(1, model=model)
        time.sleep(0.3)
        self.assertEqual([q["step"] for q in agent.requests if q["type"] == "saved"], [1])

    def test_tied_weights_are_saved(self):
        torch = self.torch
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        d = er.save(1, model=model)
        fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
        er.load(model=fresh, resume_dir=os.path.dirname(d))
        self.assertTrue(torch.equal(fresh["head"].weight, emb.weight))


class AsyncSaves(TorchEnv):
    def setup_env(self, agent=None):
        staging = os.path.join(self.tmp.name, "staging")
        kv = dict(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=1)
        if agent is not None:
            kv["ELASTIC_AGENT_SOCKET"] = agent.path
        else:
            os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        self.env(**kv)
        return staging

    def state_of(self, model, opt):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        osd = opt.state_dict()["state"]
        return sd, {(i, n): v.clone() for i, st in osd.items() for n, v in st.items() if self.torch.is_tensor(v)}

    def test_returns_before_the_write_and_the_step_after_waits_for_it(self):
        torch = self.torch
        path = os.path.join(self.tmp.name, "a.sock")
        # The agent takes 0.5 s to acknowledge: the write cannot have finished when async_save
        # returns, and opt.step() must not change the state before it has.
        agent = FakeAgent(path, saved_delay_s=0.5)
        self.addCleanup(agent.close)
        staging = self.setup_env(agent)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        before, before_opt = self.state_of(model, opt)
        # The writer starts writing only once the forward below has run.
        go = threading.Event()
        write = er._write_safetensors

        def gated(*a, **kw):
            self.assertTrue(go.wait(10))
            return write(*a, **kw)

        with mock.patch.object(er, "_write_safetensors", gated):
            pending = er.async_save(3, model=model, optimizer=opt, extra={"data_pos": 9, "rng": torch.ones(2)})
            self.assertFalse(pending.done())
            # Training goes on: forward changes BatchNorm's running statistics (copied at the
            # call), and the step waits for the write before it changes parameters and Adam's
            # state.
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            self.assertFalse(torch.equal(model[1].running_mean, before["1.running_mean"]))
            go.set()
            loss.backward()
            opt.step()
        self.assertTrue(pending.done())
        d = pending.wait()
        self.assertEqual(d, os.path.join(staging, "step-3", "rank-0"))
        self.assertEqual([q["step"] for q in agent.requests if q["type"] == "saved"], [3])
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        step, extra = er.load(model=fresh, optimizer=fresh_opt, resume_dir=os.path.dirname(d))
        self.assertEqual((step, extra["data_pos"]), (3, 9))
        after, after_opt = self.state_of(fresh, fresh_opt)
        self.assertEqual(sorted(after), sorted(before))
        for k in before:
            self.assertTrue(torch.equal(after[k], before[k]), k)
        self.assertEqual(sorted(after_opt), sorted(before_opt))
        for k in before_opt:
            self.assertTrue(torch.equal(after_opt[k], before_opt[k]), k)
        # The model itself has moved on since.
        self.assertFalse(torch.equal(model.state_dict()["0.weight"], before["0.weight"]))

    def test_a_failed_write_is_raised_at_the_next_step(self):
        staging = self.setup_env()
        model, opt = self.make(0)
        os.makedirs(staging)
        # A file where the step's directory must go: the writer thread fails.
        with open(os.path.join(staging, "step-4"), "w") as f:
            f.write("in the way")
        pending = er.async_save(4, model=model, optimizer=opt)
        with self.assertRaises(OSError):
            opt.step()
        with self.assertRaises(OSError):
            pending.wait()
        # Reported once; the next save goes ahead.
        self.assertIsNone(er.wait())
        self.assertTrue(os.path.isdir(er.save(5, model=model, optimizer=opt)))

    def test_the_next_save_waits_for_the_pending_one(self):
        staging = self.setup_env()
        model, opt = self.make(0)
        first = er.async_save(1, model=model, optimizer=opt)
        second = er.async_save(2, model=model, optimizer=opt)
        self.assertTrue(first.done())
        second.wait()
        self.assertEqual(sorted(os.listdir(staging)), ["step-1", "step-2"])

    def test_without_an_optimizer_the_parameters_are_copied_at_the_call(self):
        torch = self.torch
        staging = self.setup_env()
        model, _ = self.make(0)
        w = model[0].weight.detach().clone()
        pending = er.async_save(1, model=model)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        pending.wait()
        fresh, _ = self.make(1)
        er.load(model=fresh, resume_dir=os.path.join(staging, "step-1"))
        self.assertTrue(torch.equal(fresh[0].weight, w))

    def test_outside_elastic_run_it_warns_and_returns_none(self):
        os.environ.pop("ELASTIC_STAGING_DIR", None)
        model, opt = self.make(0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            self.assertIsNone(er.async_save(1, model=model, optimizer=opt))
        self.assertIn("ELASTIC_STAGING_DIR", str(w[0].message))


class SafetensorsWriter(TorchEnv):
    def test_every_dtype_shape_and_layout_reads_back_through_safetensors(self):
        torch = self.torch
        from safetensors import safe_open

        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        tensors = {
            "f32": base,
            "bf16": base.to(torch.bfloat16),
            "f16": base.to(torch.float16),
            "f64": base.to(torch.float64),
            "i64": torch.arange(5),
            "u8": torch.arange(7, dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 3),
            "transposed": base.t(),
            "strided": base[:, ::2],
            "naïve/ключ": torch.ones(2),
        }
        path = os.path.join(self.tmp.name, "t.safetensors")
        er._write_safetensors(path, tensors, {"step": "1"})
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        self.assertEqual(n % 8, 0)
        with safe_open(path, framework="pt") as f:
            self.assertEqual(f.metadata(), {"step": "1"})
            self.assertEqual(sorted(f.keys()), sorted(tensors))
            for k, v in tensors.items():
                got = f.get_tensor(k)
                self.assertEqual((got.dtype, tuple(got.shape)), (v.dtype, tuple(v.shape)), k)
                self.assertTrue(torch.equal(got, v), k)

    def test_a_dtype_safetensors_lacks_is_named(self):
        torch = self.torch
        with self.assertRaisesRegex(ValueError, "'c': dtype torch.complex64"):
            er._write_safetensors(os.path.join(self.tmp.name, "c.safetensors"),
                                  {"c": torch.zeros(2, dtype=torch.complex64)}, {})


class RestoredLayout(TorchEnv):
    """The layout the agent's restore writes (the checkpoint crate's ``Store::restore``):
    ``rank-R/state.safetensors`` with every tensor, ``__metadata__`` naming step, rank and world,
    and ``rank-R/metadata.json`` with the manifest metadata under ``"metadata"``."""

    def stage(self, step=7, world=2):
        torch = self.torch
        staging = os.path.join(self.tmp.name, "staging")
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        model, opt = self.make(0)
        self.rng = torch.get_rng_state()
        for r in range(world):
            self.env(ELASTIC_STAGING_DIR=staging, RANK=r, WORLD_SIZE=world)
            er.save(step, model=model, optimizer=opt, extra={"data_pos": 56, "rng": self.rng})
        return model, opt, os.path.join(staging, f"step-{step}")

    def restore(self, staged, world, step=7, meta_step=None, version=None, shards=None, ranks=None):
        """What the agent lays out for ``world``: every rank gets the union of the staged parts."""
        from safetensors.torch import load_file, save_file

        tensors = {}
        state = None
        for name in sorted(os.listdir(staged)):
            tensors.update(load_file(os.path.join(staged, name, "tensors.safetensors")))
            state = state or read_json(os.path.join(staged, name, "meta.json"))["state"]
        out = os.path.join(self.tmp.name, "restore", f"step-{step}")
        for r in range(world) if ranks is None else ranks:
            d = os.path.join(out, f"rank-{r}")
            os.makedirs(d, exist_ok=True)
            header = {"elastic.step": str(step), "elastic.rank": str(r), "elastic.world_size": str(world)}
            if shards:
                header["elastic.shards"] = json.dumps(shards)
            save_file(tensors, os.path.join(d, "state.safetensors"), metadata=header)
            meta = {"step": step if meta_step is None else meta_step, "rank": r, "world_size": world,
                    "saved_world_size": 2, "metadata": {"elastic": {"generation": 3}, "state": state}}
            if version is not None:
                meta["format_version"] = version
            with open(os.path.join(d, "metadata.json"), "w") as f:
                json.dump(meta, f)
        return out

    def test_load_reads_the_agents_restore_layout_at_a_new_world_size(self):
        torch = self.torch
        model, opt, staged = self.stage()
        out = self.restore(staged, world=3)
        self.env(ELASTIC_RESUME_DIR=out, ELASTIC_RESUME_STEP=7, RANK=2, WORLD_SIZE=3)
        fresh, fresh_opt = self.make(1)
        step, extra = er.load(model=fresh, optimizer=fresh_opt)
        self.assertEqual(step, 7)
        self.assertEqual(extra["data_pos"], 56)
        self.assertTrue(torch.equal(extra["rng"], self.rng))
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))

    def test_a_restored_step_other_than_the_resume_step_is_refused(self):
        _, _, staged = self.stage()
        out = self.restore(staged, world=1)
        self.env(ELASTIC_RESUME_DIR=out, ELASTIC_RESUME_STEP=8, RANK=0, WORLD_SIZE=1)
        with self.assertRaisesRegex(ValueError, "holds step 7, but ELASTIC_RESUME_STEP is 8"):
            er.load(model=self.make(1)[0])

    def test_metadata_and_tensors_of_different_steps_are_refused(self):
        _, _, staged = self.stage()
        out = self.restore(staged, world=1, meta_step=9)
        self.env(RANK=0, WORLD_SIZE=1)
        with self.assertRaisesRegex(ValueError, "holds step 7.*says step 9"):
            er.load(model=self.make(1)[0], resume_dir=out)

    def test_unknown_restore_format_version_is_refused(self):
        _, _, staged = self.stage()
        out = self.restore(staged, world=1, version=2)
        self.env(RANK=0, WORLD_SIZE=1)
        with self.assertRaisesRegex(ValueError, "unknown restore format version 2"):
            er.load(model=self.make(1)[0], resume_dir=out)

    def test_unknown_staged_format_version_is_refused(self):
        _, _, staged = self.stage()
        path = os.path.join(staged, "rank-1", "meta.json")
        meta = read_json(path)
        meta["format_version"] = 99
        with open(path, "w") as f:
            json.dump(meta, f)
        with self.assertRaisesRegex(ValueError, "unknown snapshot format 99"):
            er.load(model=self.make(1)[0], resume_dir=staged)

    def test_a_restore_without_this_rank_is_refused(self):
        _, _, staged = self.stage()
        out = self.restore(staged, world=4, ranks=[0, 1])
        self.env(RANK=3, WORLD_SIZE=4)
        with self.assertRaisesRegex(ValueError, "no state.safetensors for rank 3"):
            er.load(model=self.make(1)[0], resume_dir=out)

    def test_sharded_rows_of_another_world_are_refused(self):
        _, _, staged = self.stage()
        shards = {"model/0.weight": {"global_shape": [16, 8], "dim0_offset": 0}}
        out = self.restore(staged, world=2, shards=shards)
        self.env(RANK=1, WORLD_SIZE=3)
        with self.assertRaisesRegex(ValueError, "world_size 2, this worker has 3"):
            er.load(model=self.make(1)[0], resume_dir=out)

    def test_every_rank_records_the_state(self):
        _, _, staged = self.stage(world=3)
        states = [read_json(os.path.join(staged, f"rank-{r}", "meta.json"))["state"] for r in range(3)]
        self.assertEqual(states[0]["extra"], {"data_pos": 56})
        self.assertTrue(states[0]["optim_param_groups"])
        self.assertEqual(states[0], states[1])
        self.assertEqual(states[0], states[2])


if __name__ == "__main__":
    unittest.main()
