"""Recovery in place without an agent: two ranks (forked from one interpreter, gloo over
loopback) form a group, a rank behind takes the state of the rank ahead, gradients are averaged
in bounded buffers, and the vote says no on every rank when one rank's step failed.

python -m unittest discover -s runtime/python/tests -t runtime/python -k InPlace"""

import json
import socket
import subprocess
import sys

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
