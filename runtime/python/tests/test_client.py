"""Unit tests for the elastic_run worker client: python -m unittest discover -s runtime/python/tests"""

import errno
import json
import os
import random
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import unittest
import warnings
from unittest import mock

CLIENT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, CLIENT_DIR)

import elastic_run as er  # noqa: E402


def mapped_files():
    """The files this process maps (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def read_json(path):
    with open(path) as f:
        return json.load(f)


class FakeAgent:
    """A Unix-socket agent that records requests and answers like the real one."""

    def __init__(self, path, should_stop=False, checkpoint_at=None, refuse_saved=False, saved_delay_s=0.0,
                 raw_reply=None, restored=None):
        self.path = path
        # The reply to a `restore`: (step, dir), or a str (an error with that message).
        self.restored = restored
        # Bytes sent as they are in reply to every request (a misbehaving agent).
        self.raw_reply = raw_reply
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
            try:
                self._lines(conn, f)
            except ConnectionResetError:  # the client hung up on a reply it refused
                pass

    def _lines(self, conn, f):
        for line in f:
            req = json.loads(line)
            self.requests.append(req)
            if req["type"] == "saved" and self.saved_delay_s:
                time.sleep(self.saved_delay_s)
            if self.raw_reply is not None:
                conn.sendall(self.raw_reply)
                continue
            if req["type"] == "query":
                rep = {"type": "state", "should_stop": self.should_stop,
                       "should_checkpoint_at": self.checkpoint_at, "generation": 2}
            elif req["type"] == "restore" and isinstance(self.restored, tuple):
                rep = {"type": "restored", "step": self.restored[0], "dir": self.restored[1]}
            elif req["type"] == "restore":
                rep = {"type": "error", "message": str(self.restored)}
            elif req["type"] == "saved" and self.refuse_saved:
                rep = {"type": "error", "message": "outside staging"}
            elif req["type"] == "watch":
                # Generation 3 is on offer; a rank already in it is held, as the agent does.
                if req["generation"] == 3:
                    time.sleep(0.2)
                    rep = {"type": "generation", "generation": 3, "rank_offset": 0, "rank": req["rank"], "env": {}}
                else:
                    rep = {"type": "generation", "generation": 3, "rank_offset": 0, "rank": 0,
                           "env": {"WORLD_SIZE": "1", "ELASTIC_LR": ""}}
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
        with mock.patch.object(er._distributed, "_all_reduce_max", lambda v: [1, v[1]]):
            self.assertTrue(er.should_stop(30))
        self.assertEqual(agent.requests[-1], {"type": "peer_stop", "rank": 2, "step": 30})
        # This agent asked itself: nothing more to say.
        agent.should_stop = True
        with mock.patch.object(er._distributed, "_all_reduce_max", lambda v: [1, v[1]]):
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
    def test_only_the_save_of_an_agreed_stop_tells_the_agent_it_is_the_last(self):
        staging = os.path.join(self.tmp.name, "staging")
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, should_stop=False)
        self.addCleanup(agent.close)
        self.env(ELASTIC_STAGING_DIR=staging, ELASTIC_AGENT_SOCKET=path, LOCAL_RANK=0, RANK=0, WORLD_SIZE=1)
        model, opt = self.make(0)
        self.assertFalse(er.should_stop(5))
        er.save(5, model=model, optimizer=opt)
        agent.should_stop = True
        self.assertTrue(er.should_stop(6))
        # An earlier step's save that completes after the stop is not the last one.
        er.save(4, model=model, optimizer=opt)
        er.save(6, model=model, optimizer=opt)
        saved = [(q["step"], q["last"]) for q in agent.requests if q["type"] == "saved"]
        self.assertEqual(saved, [(5, False), (4, False), (6, True)])

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
        with mock.patch.object(er._connection, "SOCKET_TIMEOUT_S", 0.2), \
                mock.patch.object(er._connection, "SAVED_TIMEOUT_S", 10.0):
            er.save(1, model=model)
        self.assertEqual([q["step"] for q in agent.requests if q["type"] == "saved"], [1])

    def test_saved_without_reply_raises_once_and_is_not_resent(self):
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path, saved_delay_s=1.0)
        self.addCleanup(agent.close)
        model, _ = self.make(0)
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), ELASTIC_AGENT_SOCKET=path, RANK=0, WORLD_SIZE=1)
        with mock.patch.object(er._connection, "SAVED_TIMEOUT_S", 0.2):
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

    def gated_writes(self):
        """An event, and a patch under which every snapshot write waits for it (10 s at most)."""
        go = threading.Event()
        write = er._save._write_safetensors

        def gated(*a, **kw):
            self.assertTrue(go.wait(10))
            return write(*a, **kw)

        return go, mock.patch.object(er._save, "_write_safetensors", gated)

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
        go, gated = self.gated_writes()
        with gated:
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

    def test_a_load_waits_for_the_pending_write_before_it_changes_the_state(self):
        torch = self.torch
        staging = self.setup_env()
        model, opt = self.make(0)
        er.save(1, model=model, optimizer=opt)
        x = torch.randn(4, 8)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        before, before_opt = self.state_of(model, opt)
        go, gated = self.gated_writes()
        with gated:
            pending = er.async_save(2, model=model, optimizer=opt)
            # Loading step 1 writes into the tensors the pending write still reads: it waits.
            loader = threading.Thread(target=er.load, kwargs=dict(
                model=model, optimizer=opt, resume_dir=os.path.join(staging, "step-1")))
            loader.start()
            loader.join(0.3)
            self.assertTrue(loader.is_alive())
            go.set()
            loader.join(10)
        self.assertFalse(loader.is_alive())
        self.assertTrue(pending.done())
        fresh, fresh_opt = self.make(1)
        er.load(model=fresh, optimizer=fresh_opt, resume_dir=os.path.join(staging, "step-2"))
        after, after_opt = self.state_of(fresh, fresh_opt)
        for k in before:
            self.assertTrue(torch.equal(after[k], before[k]), k)
        for k in before_opt:
            self.assertTrue(torch.equal(after_opt[k], before_opt[k]), k)

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


class Restores(TorchEnv):
    """Stages snapshots through the client and lays them out as the agent's restore does (no
    tests of its own)."""

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


class RestoredLayout(Restores):
    """The layout the agent's restore writes (the checkpoint crate's ``Store::restore``):
    ``rank-R/state.safetensors`` with every tensor, ``__metadata__`` naming step, rank and world,
    and ``rank-R/metadata.json`` with the manifest metadata under ``"metadata"``."""

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

    def test_a_node_that_joined_without_a_restore_has_the_agent_restore_its_step_on_load(self):
        torch = self.torch
        model, _, staged = self.stage()
        out = self.restore(staged, world=3)
        sock = os.path.join(self.tmp.name, "agent.sock")
        agent = FakeAgent(sock, restored=(7, out))
        self.addCleanup(agent.close)
        os.environ.pop("ELASTIC_RESUME_DIR", None)
        os.environ.pop("ELASTIC_RESUME_STEP", None)
        self.env(ELASTIC_HEAL_STEP=7, ELASTIC_AGENT_SOCKET=sock, RANK=2, WORLD_SIZE=3)
        fresh = self.make(1)[0]
        step, _ = er.load(model=fresh)
        self.assertEqual(step, 7)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual([r for r in agent.requests if r["type"] == "restore"],
                         [{"type": "restore", "rank": 2, "step": 7}])
        # As for a worker the agent restored for before it started.
        self.assertEqual((os.environ.get("ELASTIC_RESUME_STEP"), os.environ.get("ELASTIC_RESUME_DIR")), ("7", out))
        self.assertNotIn("ELASTIC_HEAL_STEP", os.environ)

    def test_a_restore_the_agent_refuses_or_answers_with_a_newer_step_is_an_error(self):
        sock = os.path.join(self.tmp.name, "agent.sock")
        agent = FakeAgent(sock, restored="restore step 7 from file:///b (6 attempts): the store is down")
        self.addCleanup(agent.close)
        os.environ.pop("ELASTIC_RESUME_DIR", None)
        self.env(ELASTIC_HEAL_STEP=7, ELASTIC_AGENT_SOCKET=sock, RANK=0, WORLD_SIZE=1)
        with self.assertRaisesRegex(er.AgentError, "the store is down"):
            er.load(model=self.make(1)[0])
        agent.restored = (8, self.tmp.name)
        with self.assertRaisesRegex(ValueError, r"step is 8, not an integer in \[0, 7\]"):
            er.load(model=self.make(1)[0])

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


# Runs argv[3] in a fresh interpreter whose address space is capped at argv[1] bytes, so that an
# allocation sized by a hostile value fails there (MemoryError) instead of exhausting the machine.
# Prints [exception type, message] (["ok", ""] when nothing was raised).
_LIMITED = r"""
import json, resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.path.insert(0, sys.argv[2])
import elastic_run as er
try:
    exec(sys.argv[3])
except BaseException as e:
    print(json.dumps([type(e).__name__, str(e)]))
else:
    print(json.dumps(["ok", ""]))
"""


def run_limited(code, limit=1 << 30, timeout_s=60):
    """``code`` under :data:`_LIMITED`: ``(exception type or "ok", message, seconds)``."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _LIMITED, str(limit), CLIENT_DIR, code],
                         capture_output=True, text=True, timeout=timeout_s, check=True)
    kind, msg = json.loads(out.stdout.strip().splitlines()[-1])
    return kind, msg, time.monotonic() - t0


# A field left out of a metadata file or reply.
DROP = object()


def nested(depth):
    """A JSON array nested ``depth`` deep."""
    return "[" * depth + "]" * depth


def old_assign_keys(sizes, world):
    """assign_keys as it was first written (one load counter per rank), the reference."""
    load_bytes = [0] * world
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load_bytes[i], i))
        out[key] = r
        load_bytes[r] += sizes[key]
    return out


class BoundedEnvironment(Env):
    def test_world_sizes_ranks_and_steps_out_of_bounds_are_refused(self):
        cases = [
            ("WORLD_SIZE", 10**9, er.world_size),
            ("WORLD_SIZE", 0, er.world_size),
            ("WORLD_SIZE", er.WORLD_SIZE_MAX + 1, er.world_size),
            ("LOCAL_WORLD_SIZE", 10**9, er.local_world_size),
            ("RANK", -1, er.rank),
            ("RANK", er.WORLD_SIZE_MAX, er.rank),
            ("LOCAL_RANK", 10**9, er.local_rank),
            ("ELASTIC_RESUME_STEP", -1, er.resume_step),
            ("ELASTIC_RESUME_STEP", er.STEP_MAX + 1, er.resume_step),
            ("ELASTIC_GENERATION", -3, er.generation),
            ("ELASTIC_LR_SCALE", "nan", er.lr_scale),
            ("ELASTIC_LR_SCALE", "inf", er.lr_scale),
            ("ELASTIC_BATCH_SIZE", "lots", er.batch_size),
        ]
        for name, value, read in cases:
            with self.subTest(name=name, value=value):
                self.env(**{name: value})
                with self.assertRaisesRegex(er.FormatError, name):
                    read()
        self.env(WORLD_SIZE=er.WORLD_SIZE_MAX, RANK=er.WORLD_SIZE_MAX - 1, ELASTIC_RESUME_STEP=er.STEP_MAX)
        self.assertEqual((er.world_size(), er.rank(), er.resume_step()),
                         (er.WORLD_SIZE_MAX, er.WORLD_SIZE_MAX - 1, er.STEP_MAX))
        self.assertTrue(issubclass(er.FormatError, ValueError))
        self.assertIn("FormatError", er.__all__)

    def test_a_huge_world_size_in_meta_json_is_refused_before_any_allocation(self):
        d = os.path.join(self.tmp.name, "step-1")
        os.makedirs(os.path.join(d, "rank-0"))
        with open(os.path.join(d, "rank-0", "meta.json"), "w") as f:
            json.dump({"format_version": 1, "step": 1, "rank": 0, "world_size": 10**9, "keys": [], "state": {}}, f)
        # Sized by 10**9, a list needs gigabytes: under the cap it would be a MemoryError.
        kind, msg, took = run_limited(f"er.load(resume_dir={d!r})")
        self.assertEqual(kind, "FormatError", msg)
        self.assertIn("meta.json: world_size is 1000000000, not an integer in [1, 1048576]", msg)
        self.assertLess(took, 20)

    def test_split_memory_does_not_grow_with_the_world_size(self):
        sizes = {"a": 30, "b": 20, "c": 10}
        kind, msg, _ = run_limited(f"er.assign_keys({sizes!r}, 10**9)")
        self.assertEqual(kind, "ValueError", msg)
        self.assertIn("world size must be an integer in [1, 1048576]", msg)
        tracemalloc.start()
        self.addCleanup(tracemalloc.stop)
        owner = er.assign_keys(sizes, er.WORLD_SIZE_MAX)
        _, peak = tracemalloc.get_traced_memory()
        self.assertEqual(owner, {"a": 0, "b": 1, "c": 2})
        self.assertLess(peak, 64 * 1024)

    def test_split_is_the_one_each_rank_counting_its_bytes_gives(self):
        rnd = random.Random(7)
        for _ in range(300):
            n = rnd.randrange(0, 30)
            sizes = {f"k{i}": rnd.choice([0, 1, 8, 8, 64, rnd.randrange(1000)]) for i in range(n)}
            world = rnd.randrange(1, 40)
            self.assertEqual(er.assign_keys(sizes, world), old_assign_keys(sizes, world), (sizes, world))
        for world in (0, -1, True, 2.0, er.WORLD_SIZE_MAX + 1):
            with self.subTest(world=world), self.assertRaises(ValueError):
                er.assign_keys({"a": 1}, world)


class MalformedStaged(TorchEnv):
    """Staged snapshots (``rank-R/meta.json``) with something wrong: one FormatError each."""

    def write(self, metas, tensors=True):
        """A staged step, in a directory of its own: ``metas`` are meta.json contents (dicts, or
        bytes written as they are)."""
        d = os.path.join(tempfile.mkdtemp(dir=self.tmp.name), "step-3")
        for r, meta in enumerate(metas):
            os.makedirs(os.path.join(d, f"rank-{r}"), exist_ok=True)
            with open(os.path.join(d, f"rank-{r}", "meta.json"), "wb") as f:
                f.write(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
            if tensors:
                er._write_safetensors(os.path.join(d, f"rank-{r}", "tensors.safetensors"), {}, {})
        return d

    @staticmethod
    def meta(**kv):
        m = {"format_version": 1, "step": 3, "rank": 0, "world_size": 1, "keys": [], "state": {}}
        m.update(kv)
        return {k: v for k, v in m.items() if v is not DROP}

    def assertRefused(self, d, pattern):
        with self.assertRaisesRegex(er.FormatError, pattern):
            er.load(resume_dir=d, optimizer=self.make(0)[1])

    def test_a_valid_empty_snapshot_loads(self):
        self.assertEqual(er.load(resume_dir=self.write([self.meta()])), (3, {}))

    def test_missing_fields_wrong_types_and_bad_values_are_format_errors(self):
        deep = {"x": json.loads(nested(er.JSON_DEPTH_MAX))}
        cases = [
            # Missing keys (KeyError before).
            (self.meta(world_size=DROP), r"meta.json: no world_size"),
            (self.meta(keys=DROP), r"meta.json: no keys"),
            (self.meta(step=DROP), r"meta.json: no step"),
            (self.meta(rank=DROP), r"meta.json: no rank"),
            # Wrong types (TypeError and AttributeError before, or taken as they came).
            (self.meta(world_size="2"), r"meta.json: world_size is '2', not an integer"),
            (self.meta(world_size=True), r"meta.json: world_size is True, not an integer"),
            (self.meta(rank=0.0), r"meta.json: rank is 0.0, not an integer"),
            (self.meta(step="3"), r"meta.json: step is '3', not an integer"),
            (self.meta(keys="model/w"), r"meta.json: keys is 'model/w', not an array"),
            (self.meta(keys=[1]), r"meta.json: keys holds 1, not a string"),
            (self.meta(keys=["a", "a"]), r"meta.json: keys names a tensor twice"),
            (self.meta(state=[]), r"meta.json: state is \[\], not an object"),
            (self.meta(state={"extra": [1]}), r"meta.json: state.extra is \[1\], not an object"),
            (self.meta(state={"optim_state": {"x": {}}}), r"meta.json: state.optim_state has key 'x'"),
            (self.meta(state={"optim_state": {"0": 5}}), r"meta.json: state.optim_state\['0'\] is 5"),
            (self.meta(state={"optim_param_groups": {}}), r"meta.json: state.optim_param_groups is \{\}, not an array"),
            (self.meta(state={"optim_param_groups": [{"lr": 1}]}), r"no state.optim_param_groups\[0\].params"),
            (self.meta(state={"optim_param_groups": [{"params": [True]}]}), r"groups\[0\].params holds True"),
            (self.meta(format_version=True), r"rank-0: unknown snapshot format True"),
            # Out of bounds.
            (self.meta(world_size=er.WORLD_SIZE_MAX + 1), r"world_size is 1048577, not an integer in \[1, 1048576\]"),
            (self.meta(world_size=0), r"meta.json: world_size is 0"),
            (self.meta(rank=1), r"meta.json: rank is 1, not an integer in \[0, 0\]"),
            (self.meta(rank=-1), r"meta.json: rank is -1"),
            (self.meta(step=-1), r"meta.json: step is -1, not an integer in \[0, 9007199254740991\]"),
            (self.meta(step=2**53), r"meta.json: step is 9007199254740992"),
            # Not a JSON object, not JSON, not UTF-8, not standard JSON.
            (b"[1, 2]", r"meta.json: \[1, 2\] is not a JSON object"),
            (b"null", r"meta.json: None is not a JSON object"),
            (b"{\"step\": ", r"meta.json: not JSON"),
            (b"\xff\xfe{}", r"meta.json: not UTF-8"),
            (json.dumps(self.meta(step=float("nan"))).encode(), r"meta.json: not JSON: NaN is not JSON"),
            (b'{"step": ' + b"1" * 5000 + b"}", r"meta.json: not JSON: integer of 5000 digits"),
            # Nested too deep: one level over the bound, and far over (RecursionError before).
            (json.dumps(self.meta(state={"extra": deep})).encode(), r"meta.json: JSON nested deeper than 64"),
            (b'{"state": ' + nested(100_000).encode() + b"}", r"meta.json: JSON nested deeper than 64"),
        ]
        for i, (meta, pattern) in enumerate(cases):
            with self.subTest(case=i, pattern=pattern):
                self.assertRefused(self.write([meta]), pattern)

    def test_brackets_in_strings_do_not_count_as_nesting(self):
        state = {"extra": {"s": "[[[{{{" * 100 + '\\"]' + "\\", "t": "]]]" * 50}}
        d = self.write([self.meta(state=state)])
        self.assertEqual(er.load(resume_dir=d), (3, state["extra"]))

    def test_missing_or_odd_files_and_inconsistent_ranks_are_format_errors(self):
        d = self.write([self.meta(), self.meta(rank=1)])
        self.assertRefused(d, r"rank-1/meta.json: rank is 1, not an integer in \[0, 0\]")
        d = self.write([self.meta(world_size=2), self.meta(rank=0, world_size=2)])
        self.assertRefused(d, r"rank-1/meta.json: rank 0 in directory rank-1")
        d = self.write([self.meta(world_size=2), self.meta(rank=1, world_size=3)])
        self.assertRefused(d, r"incomplete or mixed snapshot: ranks \[0, 1\] of world \[2, 3\]")
        d = self.write([self.meta(world_size=2), self.meta(rank=1, world_size=2, step=4)])
        self.assertRefused(d, r"incomplete or mixed snapshot: .* steps \[3, 4\]")
        d = self.write([self.meta()])
        os.remove(os.path.join(d, "rank-0", "meta.json"))
        self.assertRefused(d, r"rank-0/meta.json: missing")
        os.mkdir(os.path.join(d, "rank-0", "meta.json"))
        self.assertRefused(d, r"rank-0/meta.json: not a regular file")
        d = self.write([self.meta()], tensors=False)
        self.assertRefused(d, r"rank-0/tensors.safetensors: missing")
        with open(os.path.join(d, "rank-0", "tensors.safetensors"), "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        self.assertRefused(d, r"rank-0/tensors.safetensors: not a safetensors file")

    def test_metadata_files_are_read_up_to_the_bound(self):
        d = self.write([self.meta(state={"extra": {"pad": "x" * 200}})])
        with mock.patch.object(er.protocol, "METADATA_BYTES_MAX", 100):
            self.assertRefused(d, r"meta.json: over the limit of 100 bytes")
        self.assertEqual(er.load(resume_dir=d)[0], 3)


class MalformedRestored(Restores):
    """The agent's restore layout (``rank-R/metadata.json``) with something wrong."""

    def restored(self, meta, tensors=None):
        d = os.path.join(self.tmp.name, "restore", "step-7", "rank-0")
        os.makedirs(d, exist_ok=True)
        from safetensors.torch import save_file
        save_file(tensors or {}, os.path.join(d, "state.safetensors"), metadata={"elastic.step": "7"})
        with open(os.path.join(d, "metadata.json"), "wb") as f:
            f.write(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
        self.env(RANK=0, WORLD_SIZE=1)
        return os.path.dirname(d)

    @staticmethod
    def meta(**kv):
        m = {"step": 7, "rank": 0, "world_size": 1, "saved_world_size": 2,
             "metadata": {"elastic": {"generation": 3}, "state": {"extra": {"data_pos": 1}}}}
        m.update(kv)
        return {k: v for k, v in m.items() if v is not DROP}

    def test_a_valid_restore_loads(self):
        self.assertEqual(er.load(resume_dir=self.restored(self.meta())), (7, {"data_pos": 1}))

    def test_missing_fields_wrong_types_and_bad_values_are_format_errors(self):
        cases = [
            (self.meta(step=DROP), r"metadata.json: no step"),
            (self.meta(step="7"), r"metadata.json: step is '7', not an integer"),
            (self.meta(step=2**53), r"metadata.json: step is 9007199254740992, not an integer in \[0, 9007"),
            (self.meta(world_size=10**9), r"metadata.json: world_size is 1000000000"),
            (self.meta(rank="0"), r"metadata.json: rank is '0'"),
            (self.meta(rank=1), r"metadata.json: rank is 1, not an integer in \[0, 0\]"),
            (self.meta(format_version=True), r"unknown restore format version True"),
            (self.meta(metadata=[]), r"metadata.json: metadata is \[\], not an object"),
            (self.meta(metadata={"state": "x"}), r"metadata.json: metadata.state is 'x', not an object"),
            (self.meta(metadata={"state": {"extra": 5}}), r"metadata.json: metadata.state.extra is 5, not an object"),
            (self.meta(metadata={"state": {"optim_state": {"01": {}}}}), r"metadata.state.optim_state has key '01'"),
            (b"[]", r"metadata.json: \[\] is not a JSON object"),
            (b'{"step": 7, "metadata": ' + nested(100_000).encode() + b"}", r"metadata.json: JSON nested deeper"),
        ]
        for i, (meta, pattern) in enumerate(cases):
            with self.subTest(case=i, pattern=pattern):
                with self.assertRaisesRegex(er.FormatError, pattern):
                    er.load(resume_dir=self.restored(meta))

    def test_tensor_files_and_names_that_are_not_the_formats_are_format_errors(self):
        torch = self.torch
        out = self.restored(self.meta())
        with open(os.path.join(out, "rank-0", "state.safetensors"), "wb") as f:
            f.write(b"garbage")
        with self.assertRaisesRegex(er.FormatError, r"rank-0/state.safetensors: not a safetensors file"):
            er.load(resume_dir=out)
        for name in ("optim/state/x/exp_avg", "optim/state/0", "optim/state/-1/exp_avg"):
            with self.subTest(name=name):
                out = self.restored(self.meta(), tensors={name: torch.zeros(1)})
                with self.assertRaisesRegex(er.FormatError, "is not optim/state/<index>/<name>"):
                    er.load(resume_dir=out, optimizer=self.make(0)[1])

    def test_state_at_the_depth_bound_saves_and_loads_through_a_restore_and_one_deeper_is_refused(self):
        # state {"extra": {"x": <k deep>}, ...}: 2 + k levels, and the restore wraps it in 2 more.
        k = er.JSON_DEPTH_MAX - 4
        staging = os.path.join(self.tmp.name, "staging")
        self.env(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        model, opt = self.make(0)
        er.save(7, model=model, optimizer=opt, extra={"x": json.loads(nested(k))})
        out = self.restore(os.path.join(staging, "step-7"), world=1)
        _, extra = er.load(model=self.make(1)[0], resume_dir=out)
        self.assertEqual(json.dumps(extra["x"]), json.dumps(json.loads(nested(k))))
        with self.assertRaisesRegex(ValueError, "the JSON state is nested deeper than 62 levels"):
            er.save(8, model=model, optimizer=opt, extra={"x": json.loads(nested(k + 1))})
        with mock.patch.object(er.protocol, "METADATA_BYTES_MAX", 100):
            with self.assertRaisesRegex(ValueError, "over the limit of 100$"):
                er.async_save(9, model=model, optimizer=opt)
        self.assertEqual(os.listdir(staging), ["step-7"])


class MalformedReplies(Env):
    """An agent whose every reply is ``raw``: one FormatError each, never a leaked KeyError,
    JSONDecodeError, RecursionError or a reply taken as it came."""

    def agent(self, raw):
        path = os.path.join(self.tmp.name, f"a{len(os.listdir(self.tmp.name))}.sock")
        agent = FakeAgent(path, raw_reply=raw)
        self.addCleanup(agent.close)
        er._reset_for_tests()
        self.env(ELASTIC_AGENT_SOCKET=path, LOCAL_RANK=0, RANK=0)
        return agent

    def test_query_replies(self):
        def state(**kv):
            m = {"type": "state", "should_stop": False, "should_checkpoint_at": None, "generation": 2}
            m.update(kv)
            return json.dumps({k: v for k, v in m.items() if v is not DROP}).encode() + b"\n"

        cases = [
            (b"[]\n", r"agent reply b'\[\]': not a JSON object"),
            (b"7\n", r"not a JSON object"),
            (b"garbage\n", r"agent reply: not JSON"),
            (b"\xff\n", r"agent reply: not UTF-8"),
            (nested(30_000).encode() + b"\n", r"agent reply: JSON nested deeper than 64"),
            (b'{"should_stop": true}\n', r"agent reply: no type"),
            (b'{"type": 5}\n', r"agent reply: type is 5, not a string"),
            (b'{"type": "ok"}\n', r"agent reply to 'query' is of type 'ok', not 'state'"),
            (b'{"type": "error", "message": ["x"]}\n', r"agent reply: message is \['x'\], not a string"),
            (state(should_stop=DROP), r"agent reply to 'query': no should_stop"),
            (state(should_stop="yes"), r"agent reply to 'query': should_stop is 'yes', not true or false"),
            (state(should_stop=1), r"should_stop is 1, not true or false"),
            (state(should_checkpoint_at="12"), r"should_checkpoint_at is '12', not an integer"),
            (state(should_checkpoint_at=True), r"should_checkpoint_at is True, not an integer"),
            (state(should_checkpoint_at=-1), r"should_checkpoint_at is -1, not an integer in \[0, 9007199254740991\]"),
            (state(should_checkpoint_at=2**53), r"should_checkpoint_at is 9007199254740992"),
            (state(should_checkpoint_at=1.5), r"should_checkpoint_at is 1.5"),
            (b'{"type": "state", "should_stop": false, "should_checkpoint_at": NaN}\n', r"NaN is not JSON"),
        ]
        for raw, pattern in cases:
            with self.subTest(raw=raw[:60]):
                self.agent(raw)
                with self.assertRaisesRegex(er.FormatError, pattern):
                    er.should_stop(1)
        self.agent(state(should_checkpoint_at=er.STEP_MAX))
        self.assertFalse(er.should_stop(1))
        self.assertTrue(er.should_checkpoint(er.STEP_MAX))

    def test_a_reply_too_long_closes_the_connection(self):
        self.agent(b"x" * (er.MESSAGE_BYTES_MAX + 10))
        with self.assertRaisesRegex(er.FormatError, r"agent reply longer than 65536 bytes"):
            er.should_stop(1)
        self.assertIsNone(er._state.agent.sock)

    def test_a_reply_of_the_wrong_type_to_progress(self):
        self.agent(b'{"type": "state", "should_stop": false}\n')
        with self.assertRaisesRegex(er.FormatError, r"agent reply to 'progress' is of type 'state', not 'ok'"):
            er.report_progress(1, force=True)


class StepsAndModes(TorchEnv):
    def test_steps_outside_the_json_safe_integers_are_refused_before_anything_is_written(self):
        torch = self.torch
        staging = os.path.join(self.tmp.name, "staging")
        self.env(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        model, opt = self.make(0)
        for step in (-1, er.STEP_MAX + 1, 2**64, 1.5, 2.0, True, "3", None, torch.tensor(2.0)):
            for save in (er.save, er.async_save):
                with self.subTest(step=step, save=save.__name__):
                    pattern = rf"elastic_run.{save.__name__}: step .* is not an integer in \[0, 9007199254740991\]"
                    with self.assertRaisesRegex(er.FormatError, pattern):
                        save(step, model=model, optimizer=opt)
        self.assertFalse(os.path.exists(staging))
        # Integers of other types (numpy, 0-d tensors) are integers; the largest step is fine.
        er.save(torch.tensor(4), model=model, optimizer=opt)
        er.async_save(er.STEP_MAX, model=model, optimizer=opt).wait()
        self.assertEqual(sorted(os.listdir(staging)), ["step-4", f"step-{er.STEP_MAX}"])
        self.assertEqual(read_json(os.path.join(staging, "step-4", "rank-0", "meta.json"))["step"], 4)
        self.assertEqual(er.load(model=model, resume_dir=os.path.join(staging, f"step-{er.STEP_MAX}"))[0], er.STEP_MAX)

    def test_a_rank_outside_the_world_is_refused(self):
        self.env(ELASTIC_STAGING_DIR=os.path.join(self.tmp.name, "s"), RANK=2, WORLD_SIZE=2)
        with self.assertRaisesRegex(er.FormatError, "RANK=2 is not below WORLD_SIZE=2"):
            er.save(1, model=self.make(0)[0])

    def test_what_save_writes_is_private_whatever_the_umask(self):
        model, opt = self.make(0)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        for umask in (0o000, 0o022, 0o277):
            with self.subTest(umask=oct(umask)):
                # The staging directory and a parent of it do not exist yet: save makes them.
                top = os.path.join(self.tmp.name, f"u{umask:o}")
                staging = os.path.join(top, "staging")
                self.env(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=2)
                old = os.umask(umask)
                try:
                    er.save(1, model=model, optimizer=opt)
                    self.env(RANK=1)
                    er.async_save(1, model=model, optimizer=opt).wait()
                finally:
                    os.umask(old)
                modes = {}
                for root, dirs, files in os.walk(top):
                    for n in dirs + files:
                        p = os.path.join(root, n)
                        modes[os.path.relpath(p, top)] = stat.S_IMODE(os.lstat(p).st_mode)
                want = {"staging": 0o700, "staging/step-1": 0o700}
                for r in (0, 1):
                    want[f"staging/step-1/rank-{r}"] = 0o700
                    want[f"staging/step-1/rank-{r}/meta.json"] = 0o600
                    want[f"staging/step-1/rank-{r}/tensors.safetensors"] = 0o600
                self.assertEqual({k: oct(v) for k, v in modes.items()}, {k: oct(v) for k, v in want.items()})
                self.assertEqual(stat.S_IMODE(os.stat(top).st_mode), 0o700)


class StagingFull(TorchEnv):
    """A full staging file system skips that checkpoint, with the sizes, and training goes on."""

    def _full_staging(self):
        # A real, tiny tmpfs where this machine lets us mount one (CI runs as root); else the
        # same ENOSPC injected at the write.
        staging = os.path.join(self.tmp.name, "shm")
        os.makedirs(staging)
        if os.geteuid() == 0 and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", staging],
                capture_output=True).returncode == 0:
            self.addCleanup(subprocess.run, ["umount", "-l", staging], capture_output=True)
            return staging, None
        real = er._save._write_all

        def full(fd, buf):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        er._save._write_all = full
        return staging, lambda: setattr(er._save, "_write_all", real)

    def test_a_checkpoint_that_does_not_fit_is_skipped_with_the_sizes_and_the_next_that_fits_is_written(self):
        torch = self.torch
        staging, undo = self._full_staging()
        self.env(ELASTIC_STAGING_DIR=staging, RANK=0, WORLD_SIZE=1)
        os.environ.pop("ELASTIC_AGENT_SOCKET", None)
        torch.manual_seed(0)
        big = torch.nn.Linear(256, 256)  # 257 KiB of weights: more than the 64 KiB staging
        opt = torch.optim.SGD(big.parameters(), lr=0.1)
        for save in (er.save, lambda s, **kw: er.async_save(s, **kw).wait()):
            with self.assertWarnsRegex(RuntimeWarning, r"skipping the checkpoint of step 3 on rank 0: "
                                       r"the staging file system .* is full .*snapshot is \d+ bytes"):
                self.assertIsNone(save(3, model=big, optimizer=opt))
            # Nothing of the skipped snapshot is left to fill the staging further.
            self.assertEqual(os.listdir(os.path.join(staging, "step-3")), [])
        # Training goes on: the optimizer steps (async_save's hook does not raise)...
        big(torch.randn(2, 256)).sum().backward()
        opt.step()
        if undo:
            undo()
        # ...and a snapshot that fits is written as usual.
        small = torch.nn.Linear(2, 2)
        self.assertTrue(er.save(4, model=small))
        self.assertEqual(er.load(model=small, resume_dir=os.path.join(staging, "step-4"))[0], 4)

    def test_the_agent_hears_of_a_skipped_snapshot_so_that_no_node_waits_for_it(self):
        torch = self.torch
        staging = os.path.join(self.tmp.name, "staging")
        real = er._save._write_safetensors

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        er._save._write_safetensors = full
        self.addCleanup(setattr, er._save, "_write_safetensors", real)
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path)
        self.addCleanup(agent.close)
        self.env(ELASTIC_STAGING_DIR=staging, ELASTIC_AGENT_SOCKET=path, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            self.assertIsNone(er.save(6, model=torch.nn.Linear(4, 4)))
        said = [str(w.message) for w in seen]
        self.assertTrue(any("skipping the checkpoint of step 6 on rank 0" in m for m in said), said)
        told = [r for r in agent.requests if r["type"] != "query"]
        self.assertEqual([(r["type"], r["rank"], r["step"]) for r in told], [("skipped", 0, 6)], said)
        self.assertIn("is full", told[0]["reason"])


class Messages(TorchEnv):
    """What the client sends the agent: one builder per request kind in elastic_run.protocol,
    and ``python -m elastic_run --print-sample-messages`` printing one of each."""

    def test_print_sample_messages_prints_one_line_per_request_kind(self):
        requests = er.protocol.REQUESTS
        out = subprocess.run([sys.executable, "-m", "elastic_run", "--print-sample-messages"], cwd=CLIENT_DIR,
                             capture_output=True, check=True, timeout=60).stdout
        lines = out.split(b"\n")
        self.assertEqual(lines[-1], b"", out)
        msgs = [json.loads(line) for line in lines[:-1]]
        self.assertEqual([m["type"] for m in msgs], list(requests))
        self.assertEqual(set(requests), {"progress", "query", "peer_stop", "saved", "skipped", "watch", "switched",
                                         "collective_failed", "restore"})
        for line, m in zip(lines, msgs):
            with self.subTest(kind=m["type"]):
                self.assertIsInstance(m, dict)
                self.assertEqual(list(m), ["type", *requests[m["type"]]])
                self.assertLess(len(line) + 1, er.MESSAGE_BYTES_MAX)
                for field in requests[m["type"]]:
                    v = m[field]
                    if field == "rank":
                        self.assertTrue(type(v) is int and 0 <= v < er.WORLD_SIZE_MAX, v)
                    elif field in ("step", "generation"):
                        self.assertTrue(type(v) is int and 0 <= v <= er.STEP_MAX, v)
                    elif field == "last":
                        self.assertIs(type(v), bool)
                    else:
                        self.assertIsInstance(v, str)
                        self.assertTrue(v)
        # Built by the client's own builders and encoding, not copies.
        self.assertEqual(out, b"".join(er.protocol._encode(m) for m in er.protocol._sample_messages()))
        # The other command and the usage are as they were.
        env = subprocess.run([sys.executable, "-m", "elastic_run", "env"], cwd=CLIENT_DIR, capture_output=True,
                             check=True, timeout=60, env={**os.environ, "ELASTIC_GENERATION": "4"}).stdout
        self.assertEqual(json.loads(env)["ELASTIC_GENERATION"], "4")
        bad = subprocess.run([sys.executable, "-m", "elastic_run", "--nope"], cwd=CLIENT_DIR, capture_output=True,
                             timeout=60)
        self.assertEqual((bad.returncode, bad.stdout), (2, b""))
        self.assertIn(b"--print-sample-messages", bad.stderr)

    def test_every_request_the_client_sends_is_a_protocol_kind_built_by_its_builder(self):
        torch = self.torch
        path = os.path.join(self.tmp.name, "a.sock")
        agent = FakeAgent(path)
        self.addCleanup(agent.close)
        staging = os.path.join(self.tmp.name, "staging")
        self.env(ELASTIC_AGENT_SOCKET=path, ELASTIC_STAGING_DIR=staging, RANK=0, LOCAL_RANK=0, WORLD_SIZE=1)
        er.report_progress(1, force=True)
        er.should_stop(1)
        with mock.patch.object(er._distributed, "_all_reduce_max", lambda v: [1, v[1]]):
            self.assertTrue(er.should_stop(2))
        model = torch.nn.Linear(2, 2)
        er.save(3, model=model)
        er.async_save(4, model=model).wait()

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with mock.patch.object(er._save, "_write_safetensors", full), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertIsNone(er.save(5, model=model))
        # Recovery in place: the watch thread hears the offer of generation 3; the switch to it
        # is announced.
        offers = er._inplace._Offers(2, 0)
        self.addCleanup(setattr, offers, "stopped", True)
        self.assertEqual(offers.take(30), (3, 0, 0, {"WORLD_SIZE": "1", "ELASTIC_LR": ""}))
        offers.stopped = True
        er._connection._agent_conn().request(er.protocol._msg_switched(0, 3))
        # A failed collective, reported once per generation.
        ip = er._inplace.InPlace.__new__(er._inplace.InPlace)
        ip.reported_for, ip.failed = None, RuntimeError("Connection reset by peer")
        self.env(ELASTIC_GENERATION=3)
        ip._report_failure()
        ip._report_failure()
        # A node that joined without a restore, whose peers did not hold the step.
        agent.restored = (6, self.tmp.name)
        self.assertEqual(er._connection.restore(6), (6, self.tmp.name))
        self.assertEqual(agent.requests[7], er.protocol._msg_watch(0, 2))
        kinds = [r["type"] for r in agent.requests if r["type"] != "watch"]
        self.assertEqual(kinds, ["progress", "query", "query", "peer_stop", "saved", "saved", "skipped", "switched",
                                 "collective_failed", "restore"])
        kinds = [r["type"] for r in agent.requests]
        self.assertEqual(set(kinds), set(er.protocol.REQUESTS))
        for r in agent.requests:
            with self.subTest(request=r):
                fields = er.protocol.REQUESTS[r["type"]]
                self.assertEqual(list(r), ["type", *fields])
                build = getattr(er.protocol, "_msg_" + r["type"])
                self.assertEqual(build(*(r[f] for f in fields)), r)


if __name__ == "__main__":
    unittest.main()
