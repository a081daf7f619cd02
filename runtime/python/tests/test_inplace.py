"""Recovery in place without an agent: two ranks (forked from one interpreter, gloo over
loopback) form a group, a rank behind takes the state of the rank ahead, gradients are averaged
in bounded buffers, and the vote says no on every rank when one rank's step failed.

python -m unittest discover -s runtime/python/tests -t runtime/python -k InPlace"""

import json
import os
import socket
import subprocess
import sys
import time
from unittest import mock

from tests import test_client as tc

er = tc.er

# Both drivers run two ranks forked from one interpreter, each putting (rank, results) on a
# queue; the driver prints them as one JSON line.
RUN_RANKS = r"""
def run_ranks(rank_main, extra, wait_s):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    shared = extra(ctx)
    procs = [ctx.Process(target=rank_main, args=(r, out, *shared)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=wait_s) for _ in procs)
    for p in procs:
        p.join(60)
    print(json.dumps(got))
"""

DRIVER = RUN_RANKS + r"""
import json, multiprocessing, os, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch
import elastic_run as er
from elastic_run import _inplace

PORT = int(sys.argv[2])


def rank_main(rank, out):
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), ELASTIC_GENERATION="1")
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    torch.manual_seed(rank)                      # the ranks start with different weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = er.ElasticSampler(64, seed=0, batch_size=2)
    for _ in range(5 if rank == 0 else 2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sampler.advance()
    state = {"model": model, "opt": opt, "data": sampler, "note": {"rank": rank}}
    ip = er.InPlace(state, timeout_s=60)
    step = ip._agree(5 if rank == 0 else 2)
    res = {"step": step, "note": state["note"], "consumed": sampler.consumed,
           "weights": [p.detach().flatten().tolist() for p in model.parameters()],
           "momentum": [opt.state[p]["momentum_buffer"].flatten().tolist() for p in model.parameters()]}
    # Gradients: rank r's are all r + 1; the mean is 1.5 everywhere, in buffers of 16 bytes
    # (every parameter alone, and the larger ones over the limit).
    _inplace.GRAD_BUFFER_BYTES = 16
    with ip.step():
        for p in model.parameters():
            p.grad = torch.full_like(p, rank + 1.0)
        ok = ip.sync_gradients(model)
    res["synced"] = ok
    res["grads"] = sorted({v for p in model.parameters() for v in p.grad.flatten().tolist()})
    res["vote_ok"] = ip.commit()
    # A step that failed on rank 1 only: no rank may apply it.
    with ip.step():
        if rank == 1:
            raise RuntimeError("Connection reset by peer (gloo)")
    res["failed_step_raised"] = False
    res["vote_failed"] = ip.commit()
    res["pending"] = ip.switch_pending()
    # A fresh start (step 0 everywhere): every rank takes rank 0's initial weights.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank + 1))
    ip.failed = None
    res["fresh_step"] = ip._agree(0)
    res["fresh_weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    # A joiner (rank 1, started without a restore: ELASTIC_HEAL_STEP) beside a rank that holds
    # a newer step takes the state from it and restores nothing.
    from elastic_run import _load
    restores = []
    def restore_from_store(state, *a, **k):
        restores.append(os.environ.pop("ELASTIC_HEAL_STEP"))
        state["note"] = {"restored": 7}
        return 7
    _load.load = restore_from_store
    state["note"] = {"rank": rank}
    if rank == 1:
        os.environ["ELASTIC_HEAL_STEP"] = "7"
    res["healed_step"] = ip.load() if rank == 1 else ip._agree(9)
    res["healed_note"] = dict(state["note"])
    # No live rank holds the step the joiner came for (rank 0 is at 3): the joiner restores it,
    # and the other rank takes it from the joiner.
    state["note"] = {"rank": rank}
    if rank == 1:
        os.environ["ELASTIC_HEAL_STEP"] = "7"
    res["restored_step"] = ip.load() if rank == 1 else ip._agree(3)
    res["restored_note"] = dict(state["note"])
    res["restores"] = restores
    res["heal_env_left"] = os.environ.get("ELASTIC_HEAL_STEP")
    ip.close()
    out.put((rank, res))


if __name__ == "__main__":
    run_ranks(rank_main, lambda ctx: (), 120)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SwitchRetry(tc.Env):
    def test_a_switch_whose_group_fails_waits_for_the_next_generation_and_switches_to_it(self):
        from unittest import mock

        from elastic_run import _inplace

        self.env(WORLD_SIZE=3)  # the environment is restored after the test
        ip = _inplace.InPlace.__new__(_inplace.InPlace)
        ip.group, ip.store, ip.works, ip.abandoned, ip.state, ip.broken = None, None, [], [], {}, None
        ip.timeout_s, ip.failed, ip.awaiting, ip.reported_for = 60.0, None, None, None
        ip.offers = mock.Mock(pending=lambda: False)
        # A module of ip.ddp(): its DDP is made anew once, on the group of the switch that held.
        regrouped = []
        ip.models = [mock.Mock(_regroup=lambda group, blocked: regrouped.append((group, blocked)))]
        offers = iter([(5, 1), (6, 0)])
        formed, reported, agreed = [], [], []

        def form(timeout_s, params=None):
            formed.append(os.environ.get("ELASTIC_GENERATION"))
            return "store", f"group-{len(formed)}"

        def agree(step, need=0):
            agreed.append(step)
            if len(agreed) == 1:  # rank 0 of generation 5 died while the group formed
                raise _inplace.SwitchError("a collective of the switch failed: connection closed")
            return step + 2

        def take():
            g, r = next(offers)
            os.environ["ELASTIC_GENERATION"] = str(g)
            return g, r

        with mock.patch.object(_inplace, "_form_group", form), \
                mock.patch.object(ip, "_take_offer", take), \
                mock.patch.object(ip, "_agree", agree), \
                mock.patch.object(ip, "_retire", lambda g, s: None), \
                mock.patch.object(ip, "_report_failure", lambda: reported.append(str(ip.failed))):
            self.assertEqual(ip.switch(40), 42)
        self.assertEqual(formed, ["5", "6"])
        self.assertEqual(agreed, [40, 40], "the failed attempt left the step as it was")
        self.assertEqual(reported, ["a collective of the switch failed: connection closed"])
        self.assertEqual(ip.group, "group-2")
        self.assertEqual(regrouped, [("group-2", False)])
        self.assertIsNone(ip.failed)

        # Past _SWITCH_ATTEMPTS_MAX failures, the worker fails (its agent restarts it).
        ip.failed = None
        with mock.patch.object(_inplace, "_form_group", mock.Mock(side_effect=RuntimeError("store gone"))), \
                mock.patch.object(ip, "_take_offer", lambda: (7, 0)), \
                mock.patch.object(ip, "_retire", lambda g, s: None), \
                mock.patch.object(ip, "_report_failure", lambda: None):
            with self.assertRaisesRegex(_inplace.SwitchError, "no switch completed"):
                ip.switch(40)

    def test_a_group_that_cannot_form_is_given_up_for_a_newer_generation(self):
        """A member of generation 5 confirmed the regroup and died before it joined: forming
        generation 5's group blocks until its timeout. The offer of generation 6 (the job
        without it) ends the wait; the rank switches to 6 and nothing is reported."""
        import threading
        from unittest import mock

        from elastic_run import _inplace

        self.env(WORLD_SIZE=3, RANK=1)
        ip = _inplace.InPlace.__new__(_inplace.InPlace)
        ip.group, ip.store, ip.works, ip.abandoned, ip.state, ip.broken = None, None, [], [], {}, None
        ip.timeout_s, ip.failed, ip.awaiting, ip.reported_for = 60.0, None, None, None
        ip.models = []
        offered_at = time.monotonic() + 0.2
        ip.offers = mock.Mock(pending=lambda: generation[0] == 5 and time.monotonic() >= offered_at)
        offers = iter([(5, 1), (6, 0)])
        generation, formed, reported = [None], [], []
        never = threading.Event()

        def form(timeout_s, params=None):
            formed.append(params[2])
            if params[2] == 5:  # rank 1 of generation 5 never comes
                never.wait(timeout_s)
                raise RuntimeError("timed out waiting for rank 1")
            return "store", f"group-{params[2]}"

        def take():
            g, r = next(offers)
            generation[0] = g
            os.environ["ELASTIC_GENERATION"] = str(g)
            return g, r

        t = time.monotonic()
        try:
            with mock.patch.object(_inplace, "_form_group", form), \
                    mock.patch.object(ip, "_take_offer", take), \
                    mock.patch.object(ip, "_agree", lambda step, need=0: step), \
                    mock.patch.object(ip, "_retire", lambda g, s: None), \
                    mock.patch.object(ip, "_report_failure", lambda: reported.append(str(ip.failed))):
                self.assertEqual(ip.switch(40), 40)
        finally:
            never.set()
        self.assertLess(time.monotonic() - t, 10.0, "the rank did not wait out the form timeout")
        self.assertEqual(formed, [5, 6])
        self.assertEqual(ip.group, "group-6")
        self.assertEqual(reported, [], "a generation superseded is not a failed collective")
        self.assertEqual(len(ip.abandoned), 1, "the blocked form is counted against the bound")


class SwitchCollectives(tc.Env):
    """The collectives of a switch or a heal give up when a newer generation is offered (a peer
    vanished in the middle without closing its sockets), time out, or fail, as SwitchError."""

    class Work:
        def __init__(self, fut):
            self.fut = fut

        def get_future(self):
            return self.fut

    class Future:
        def __init__(self, done=False, error=None):
            self._done, self.error = done, error

        def done(self):
            return self._done

        def value(self):
            if self.error:
                raise self.error

    class Offers:
        def __init__(self, after_s):
            self.at = None if after_s is None else time.monotonic() + after_s

        def pending(self):
            return self.at is not None and time.monotonic() >= self.at

    def ip(self, offer_after_s=None, timeout_s=30.0):
        from elastic_run import _inplace

        ip = _inplace.InPlace.__new__(_inplace.InPlace)
        ip.works, ip.timeout_s, ip.offers = [], timeout_s, self.Offers(offer_after_s)
        ip.group, ip.broken, ip.failed = object(), None, None
        return ip, _inplace

    def test_a_blocked_collective_gives_up_on_a_newer_offer_or_the_timeout(self):
        ip, _inplace = self.ip(offer_after_s=0.2)
        t = time.monotonic()
        with self.assertRaisesRegex(_inplace.SwitchError, "newer generation was offered"):
            ip._sync(lambda: self.Work(self.Future()))
        self.assertLess(time.monotonic() - t, 5.0)
        self.assertEqual(len(ip.works), 1, "the future given up is kept: its group is retired as blocked")
        ip, _inplace = self.ip(timeout_s=0.2)
        with self.assertRaisesRegex(_inplace.SwitchError, "did not complete in 0.2 s"):
            ip._sync(lambda: self.Work(self.Future()))

    def test_a_failed_collective_is_a_switch_error_and_a_done_one_returns(self):
        ip, _inplace = self.ip()
        with self.assertRaisesRegex(_inplace.SwitchError, "Connection reset by peer"):
            ip._sync(lambda: self.Work(self.Future(done=True, error=RuntimeError("Connection reset by peer"))))

        def refuse():
            raise RuntimeError("the group is aborted")
        ip.group = object()  # the next generation's
        with self.assertRaisesRegex(_inplace.SwitchError, "aborted"):
            ip._sync(refuse)
        ip.group = object()
        ip._sync(lambda: self.Work(self.Future(done=True)))

    def test_after_a_collective_given_up_or_failed_no_other_is_started_on_its_group(self):
        """Collectives pair up by their order on each rank: a rank that left one (given up for
        an offer, or failed) while its peers go on would pair its next one (the vote) with a
        different collective of theirs, which made gloo abort the process on the size
        mismatch. It starts none on that group; the next generation's group is clean."""
        ip, _inplace = self.ip(offer_after_s=0.1)
        self.assertIsNone(ip._wait(lambda: self.Work(self.Future()), "t"))
        started = []

        def vote():
            started.append(1)
            return self.Work(self.Future(done=True))
        self.assertIsNone(ip._wait(vote, "t"))
        self.assertEqual(started, [], "a collective was started on a group where one was given up")
        self.assertIsInstance(ip.failed, _inplace.CollectiveGivenUp)
        ip.group, ip.failed = object(), None
        self.assertEqual(ip._wait(vote, "t"), "t")
        self.assertEqual(started, [1])
        # A failed one (a peer closed its sockets) too.
        ip, _inplace = self.ip()
        self.assertIsNone(ip._wait(lambda: self.Work(self.Future(done=True, error=RuntimeError("Connection reset"))),
                                   "t"))
        self.assertIsNone(ip._wait(vote, "t"))
        self.assertEqual(started, [1])


class VoteFailure(tc.TorchEnv):
    """A vote whose own collective fails (a peer was killed inside it) drops the step and
    tells the agent at once; one given up for a newer offer tells it nothing."""

    class Group:
        def __init__(self, error):
            self.error = error

        def allreduce(self, tensors, opts):
            fut = SwitchCollectives.Future(done=True, error=self.error)
            return SwitchCollectives.Work(fut)

    class Conn:
        def __init__(self):
            self.sent = []

        def request(self, msg):
            self.sent.append(msg)

    def vote(self, offer_after_s, times):
        from elastic_run import _inplace

        ip = _inplace.InPlace.__new__(_inplace.InPlace)
        ip.works, ip.timeout_s, ip.broken = [], 30.0, None
        ip.offers = SwitchCollectives.Offers(offer_after_s)
        ip.failed, ip.reported_for = None, None
        ip.group = self.Group(RuntimeError("Connection reset by peer"))
        conn = self.Conn()
        self.env(RANK=1, ELASTIC_GENERATION=4)
        with mock.patch.object(_inplace, "_agent_conn", lambda: conn):
            oks = []
            for _ in range(times):
                oks.append((ip.commit(), len(conn.sent)))
        return oks, ip, conn

    def test_a_vote_that_fails_drops_the_step_and_tells_the_agent_once(self):
        oks, ip, conn = self.vote(offer_after_s=None, times=2)
        # Told by the failed vote itself, and not again by the next step's.
        self.assertEqual(oks, [(False, 1), (False, 1)])
        self.assertEqual(ip.failed, "the commit vote did not complete (Connection reset by peer)")
        self.assertEqual(len(conn.sent), 1, conn.sent)
        msg = conn.sent[0]
        self.assertEqual(msg["type"], "collective_failed")
        self.assertEqual((msg["rank"], msg["generation"]), (1, 4))

    def test_a_vote_given_up_for_a_newer_offer_tells_the_agent_nothing(self):
        oks, _ip, conn = self.vote(offer_after_s=0.0, times=1)
        self.assertEqual(oks, [(False, 0)])
        self.assertEqual(conn.sent, [])


class InPlaceGroup(tc.TorchEnv):
    def test_a_rank_behind_takes_the_state_and_gradients_and_votes_agree(self):
        out = subprocess.run([sys.executable, "-c", DRIVER, tc.CLIENT_DIR, str(_free_port())],
                             capture_output=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-3000:])
        got = json.loads(out.stdout.decode().strip().splitlines()[-1])
        a, b = got["0"], got["1"]
        self.assertEqual((a["step"], b["step"]), (5, 5))
        # Rank 1 took everything from rank 0: weights, optimizer state, the sampler, plain values.
        self.assertEqual(b["weights"], a["weights"])
        self.assertEqual(b["momentum"], a["momentum"])
        self.assertEqual(b["consumed"], a["consumed"])
        self.assertEqual(b["note"], {"rank": 0})
        self.assertIn("took the state of step 5 from rank 0 (it held step 2)", out.stdout.decode())
        for r in (a, b):
            self.assertTrue(r["synced"])
            self.assertEqual(r["grads"], [1.5])
            self.assertTrue(r["vote_ok"])
            self.assertFalse(r["vote_failed"], "a step that failed on one rank is dropped on every rank")
        # A failed vote means a collective failed somewhere: every rank waits for the new
        # generation before its next step.
        self.assertTrue(a["pending"] and b["pending"])
        self.assertEqual((a["fresh_step"], b["fresh_step"]), (0, 0))
        self.assertEqual(b["fresh_weights"], a["fresh_weights"])
        self.assertNotEqual(a["fresh_weights"], a["weights"], "rank 0's own weights were changed too")
        # The joiner healed from its peer's step 9 without a restore...
        self.assertEqual((a["healed_step"], b["healed_step"]), (9, 9))
        self.assertEqual(b["healed_note"], {"rank": 0})
        # ...and, when no one held step 7, restored it once and gave it to the peer.
        self.assertEqual((a["restored_step"], b["restored_step"]), (7, 7))
        self.assertEqual((a["restored_note"], b["restored_note"]), ({"restored": 7}, {"restored": 7}))
        self.assertEqual((a["restores"], b["restores"]), ([], ["7"]))
        self.assertIsNone(b["heal_env_left"])
        self.assertIn("no live rank holds step 7 (the highest is 3)", out.stdout.decode())


DDP_DRIVER = RUN_RANKS + r"""
import copy, json, multiprocessing, os, sys, threading, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch
import elastic_run as er
from elastic_run import _inplace

PORT, SOLO_PORT = int(sys.argv[2]), int(sys.argv[3])


def batch(rank, i):
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * rank + i))


def regroup(ip, generation, world=2, port=PORT, blocked=False):
    # What InPlace.switch does once the offer is taken: the generation's group, then the DDPs.
    os.environ.update(ELASTIC_GENERATION=str(generation), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    ip.store, ip.group = _inplace._form_group(60)
    ip.world = world
    ip.offers.offer = None
    ip.failed = None
    for m in ip.models:
        m._regroup(ip.group, blocked)


def offer_in(ip, seconds):
    # The agent's offer of a newer generation, while this rank is blocked on its peer.
    def later():
        time.sleep(seconds)
        with ip.offers.lock:
            ip.offers.offer = (99, 0, 0, {"ELASTIC_TEST": "1"})
    threading.Thread(target=later, daemon=True).start()


def given_up_step(ip, m, rank, i, res, key):
    # A step whose peer does not come: the offer (0.5 s in) ends it inside ip.step().
    offer_in(ip, 0.5)
    t0 = time.monotonic()
    with ip.step():
        m(batch(rank, i)).sum().backward()
        res[key + "_raised"] = False
    res[key + "_given_up_s"] = time.monotonic() - t0
    res[key + "_failed"] = str(ip.failed)


def train(ip, m, opt, rank, i, res):
    x = batch(rank, i)
    ref = copy.deepcopy(m.module)            # this rank's own gradient, without DDP
    ref(x).pow(2).sum().backward()
    opt.zero_grad()
    with ip.step():
        m(x).pow(2).sum().backward()
    res.setdefault("synced", []).append(ip.sync_gradients(m))
    res.setdefault("votes", []).append(ip.commit())
    res.setdefault("local", []).append([p.grad.flatten().tolist() for p in ref.parameters()])
    res.setdefault("grads", []).append([p.grad.flatten().tolist() for p in m.module.parameters()])
    opt.step()


def rank_main(rank, out, peer_back, peer_done):
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), ELASTIC_GENERATION="1")
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    torch.manual_seed(rank)                  # the ranks start with different weights
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    with torch.no_grad():                    # different buffers too
        model[1].running_mean.fill_(float(rank + 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ip = er.InPlace({"model": model, "opt": opt}, timeout_s=60)
    m = ip.ddp(model)
    seen = []                                # the buffers each forward of the model starts from
    model.register_forward_pre_hook(lambda mod, args: seen.append(mod[1].running_mean.tolist())
                                    if mod is model else None)
    res = {"step": ip._agree(0)}
    for i in range(3):
        train(ip, m, opt, rank, i, res)
    res["seen"] = seen[:]
    res["layout_agreed"] = m._layout_agreed
    res["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    res["state_keys"] = sorted(m.state_dict())
    # Generation 2: a new DDP on a new group; the old one's hooks are off the parameters.
    old = m.ddp
    regroup(ip, 2)
    res["new_ddp"] = m.ddp is not old
    calls = m._hook_calls
    train(ip, m, opt, rank, 3, res)
    res["hook_calls"] = m._hook_calls - calls
    # Rank 1 joins the buffer broadcast of the next forward but not the layout broadcast
    # after it: rank 0's forward gives the layout up when an offer comes.
    if rank == 1:
        m._broadcast_buffers()
        peer_back.wait(60)
    else:
        given_up_step(ip, m, rank, 4, res, "layout")
        res["abandoned"] = len(ip.abandoned)
        peer_back.set()
    # Generation 3: the DDP whose layout broadcast is blocked is let go (its hooks come off
    # the parameters though its reducer is held), and the ranks train again.
    regroup(ip, 3)
    for i in range(5, 7):
        train(ip, m, opt, rank, i, res)
    # Rank 1 runs the forward but not the backward: rank 0's gradient all-reduce blocks, and
    # is given up when an offer comes; the backward raises inside ip.step().
    if rank == 1:
        m(batch(rank, 7))
        peer_done.wait(60)
    else:
        given_up_step(ip, m, rank, 7, res, "grad")
        res["grad_vote_pending"] = ip.switch_pending()
        blocked = any(not f.done() for f in ip.works)
        res["grad_blocked"] = blocked
        # Alone (world 1) on a group of its own: trains on.
        os.environ["RANK"] = "0"
        regroup(ip, 4, world=1, port=SOLO_PORT, blocked=blocked)
        train(ip, m, opt, rank, 8, res)
        peer_done.set()
    out.put((rank, res))
    out.close()
    out.join_thread()
    # Blocked collectives and groups given up stay as they are (never destroyed).
    os._exit(0)


if __name__ == "__main__":
    run_ranks(rank_main, lambda ctx: (ctx.Event(), ctx.Event()), 180)
"""


class InPlaceDDPGroup(tc.TorchEnv):
    def test_a_ddp_module_follows_the_switches_and_gives_up_a_blocked_collective(self):
        out = subprocess.run([sys.executable, "-c", DDP_DRIVER, tc.CLIENT_DIR, str(_free_port()), str(_free_port())],
                             capture_output=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr.decode()[-3000:])
        got = json.loads(out.stdout.decode().strip().splitlines()[-1])
        a, b = got["0"], got["1"]
        self.assertEqual((a["step"], b["step"]), (0, 0))
        # Every step the ranks trained together: DDP's gradients are the mean of the ranks' own,
        # the vote held, and the weights stay equal.
        self.assertEqual(len(a["grads"]), 7)
        self.assertEqual(len(b["grads"]), 6)
        for i in range(6):
            mean = [[(x + y) / 2 for x, y in zip(pa, pb)] for pa, pb in zip(a["local"][i], b["local"][i])]
            for got_r in (a["grads"][i], b["grads"][i]):
                for g, want in zip(got_r, mean):
                    for x, y in zip(g, want):
                        self.assertAlmostEqual(x, y, places=5, msg=f"step {i}")
        self.assertEqual(a["synced"], [True] * 7)
        self.assertEqual(a["votes"], [True] * 7)
        self.assertEqual(b["votes"], [True] * 6)
        self.assertEqual(a["weights"], b["weights"])
        # The buffers each forward starts from are rank 0's (rank 1's own were 2.0).
        self.assertEqual(a["seen"], b["seen"])
        self.assertEqual(a["seen"][0], [1.0, 1.0, 1.0])
        self.assertTrue(a["layout_agreed"] and b["layout_agreed"])
        self.assertIn("module.1.running_mean", a["state_keys"])
        self.assertNotIn("ddp", " ".join(a["state_keys"]))
        # Generation 2: a new DDP, and only its hooks run (one bucket: one call a step).
        self.assertTrue(a["new_ddp"] and b["new_ddp"])
        self.assertEqual((a["hook_calls"], b["hook_calls"]), (1, 1))
        # The layout broadcast and the gradient all-reduce blocked on rank 1 were given up
        # when the offer came (0.5 s in), not after the group's 60 s timeout.
        self.assertNotIn("layout_raised", a)
        self.assertLess(a["layout_given_up_s"], 10)
        self.assertIn("bucket layout was given up for a newer generation", a["layout_failed"])
        self.assertEqual(a["abandoned"], 1)
        self.assertNotIn("grad_raised", a)
        self.assertLess(a["grad_given_up_s"], 10)
        self.assertIn("gradient all-reduce was given up for a newer generation", a["grad_failed"])
        self.assertTrue(a["grad_vote_pending"])
        self.assertTrue(a["grad_blocked"])
        # Alone afterwards (world 1), rank 0's DDP leaves its own gradient as it is.
        self.assertEqual(a["grads"][6], a["local"][6])


class StoreListener(tc.Env):
    def test_a_rank_waits_for_rank_0s_store_to_listen_and_gives_up_at_its_timeout(self):
        """A TCPStore client refused at first backs off for about half a second: the ranks of
        a switch try the port themselves until rank 0's store listens."""
        import threading

        from elastic_run import _inplace

        port = _free_port()
        listening = threading.Event()

        def listen_later():
            time.sleep(0.2)
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen(1)
            listening.set()
            conn, _ = s.accept()
            conn.close()
            s.close()

        t = threading.Thread(target=listen_later, daemon=True)
        t.start()
        _inplace._await_listener("127.0.0.1", port, 30.0)
        self.assertTrue(listening.is_set(), "returned before anything listened")
        t.join(5)
        # Nothing ever listens: it returns at its timeout, and the store's own connect says why.
        started = time.monotonic()
        _inplace._await_listener("127.0.0.1", _free_port(), 0.3)
        self.assertGreaterEqual(time.monotonic() - started, 0.3)
