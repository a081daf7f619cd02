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

DRIVER = r"""
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
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    print(json.dumps(got))
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
        ip.group, ip.store, ip.works, ip.abandoned, ip.state = None, None, [], [], {}
        ip.timeout_s, ip.failed, ip.awaiting, ip.reported_for = 60.0, None, None, None
        ip.offers = mock.Mock(pending=lambda: False)
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
        ip.group, ip.store, ip.works, ip.abandoned, ip.state = None, None, [], [], {}
        ip.timeout_s, ip.failed, ip.awaiting, ip.reported_for = 60.0, None, None, None
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
        with self.assertRaisesRegex(_inplace.SwitchError, "aborted"):
            ip._sync(refuse)
        ip._sync(lambda: self.Work(self.Future(done=True)))


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
        ip.works, ip.timeout_s = [], 30.0
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
