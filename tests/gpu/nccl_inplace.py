"""The in-place client on NCCL, one GPU: (a) a group of one trains, votes and shuts down;
(b) a group of two whose second rank never comes: the gradient all-reduce is given up within
the client's timeout, the communicator is aborted (the group not kept), and the process exits. Prints one JSON
line per part; exits non-zero when a part fails. With --ddp the model is ip.ddp(model): the
gradients go through DDP's comm hook (a group of one), and the blocked all-reduce is given up
by the hook's thread, failing the backward (a group of two). Run each part in its own process:

    python tests/gpu/nccl_inplace.py one [--ddp]
    timeout 120 python tests/gpu/nccl_inplace.py alone --timeout-s 5 [--ddp]
"""
import argparse
import json
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runtime", "python"))
import elastic_run as er  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["one", "alone"])
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--ddp", action="store_true", help="train through ip.ddp(model)")
    a = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1" if a.part == "one" else "2", "ELASTIC_GENERATION": "1"})
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.monotonic()
    ip = er.InPlace({"model": model, "optim": opt}, timeout_s=a.timeout_s, offer_wait_s=1.0)
    backend = type(ip.group._get_backend(torch.device("cuda", 0))).__name__
    out = {"part": a.part, "ddp": a.ddp, "backend": backend, "form_ms": round((time.monotonic() - t0) * 1000)}
    net = ip.ddp(model) if a.ddp else model
    if a.part == "one":
        step = ip.load()
        w0 = model.weight.detach().clone()
        for _ in range(5):
            with ip.step():
                net(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
            assert ip.sync_gradients(net), ip.failed
            assert ip.commit(), ip.failed
            opt.step()
            opt.zero_grad()
            step += 1
        ip.close()
        out.update(ok=bool(step == 5 and not torch.equal(w0, model.weight)), steps=step)
    else:
        t1 = time.monotonic()
        with ip.step():
            net(torch.randn(8, 64, device="cuda")).pow(2).mean().backward()
        synced = ip.sync_gradients(net)
        out["sync_returned_ms"] = round((time.monotonic() - t1) * 1000)
        out["synced"] = synced
        out["failed"] = str(ip.failed)[:200]
        blocked = any(not f.done() for f in ip.works)
        out["blocked_after_give_up"] = blocked
        from elastic_run import _inplace

        real, aborted = _inplace._abort_nccl, [False]

        def counting(group, timeout_s=None):
            aborted[0] = real(group, timeout_s)
            return aborted[0]

        _inplace._abort_nccl = counting
        t2 = time.monotonic()
        ip._retire(ip.group, ip.store)
        out["retire_ms"] = round((time.monotonic() - t2) * 1000)
        out["kept"] = len(ip.abandoned)
        ip.group = None
        ip.closed = True
        ip.offers.stop()
        out["aborted"] = aborted[0]
        out["ok"] = bool(not synced and out["kept"] == 0 and aborted[0]
                         and out["sync_returned_ms"] < (a.timeout_s + 30) * 1000)
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
