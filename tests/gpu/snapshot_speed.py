"""Device-to-host snapshot speed on a GPU: the training stall of a checkpoint.

Builds a model of about --gib GiB of fp32 parameters on the GPU plus Adam state (so 3x that in
state), then times, side by side and alternating, the blocking part of:
  - elastic_run.save   (the worker client: device-to-host copy + safetensors into staging)
  - torch.save         (of the same state dict, to the same directory)
  - dcp.save           (torch.distributed.checkpoint, world 1)
Prints one JSON line per measurement and a summary with medians and ratios.

    python tests/gpu/snapshot_speed.py --gib 2 --repeat 3 --dir /dev/shm/snap
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runtime", "python"))
import elastic_run as er  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def build(gib, device):
    model, opt = _common.build(gib, device)
    model(torch.randn(4, _common.WIDTH, device=device)).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    return model, opt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    root = _common.scratch("snap-", a.dir, 29533)
    model, opt = build(a.gib, "cuda")
    state_bytes = _common.state_bytes(model, opt)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "state_bytes": state_bytes}), flush=True)

    def run_er(i):
        os.environ["ELASTIC_STAGING_DIR"] = os.path.join(root, "er")
        er.save(i, model=model, optimizer=opt, extra={"i": i})

    def run_torch(i):
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(root, f"t{i}.pt"))

    def run_dcp(i):
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(root, f"dcp{i}"))

    results = {"elastic_run.save": [], "torch.save": [], "dcp.save": []}
    fns = {"elastic_run.save": run_er, "torch.save": run_torch, "dcp.save": run_dcp}
    for i in range(a.repeat):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            results[name].append(dt)
            print(json.dumps({"what": name, "i": i, "s": round(dt, 3), "GBps": round(state_bytes / dt / 1e9, 2)}), flush=True)
            for e in os.listdir(root):
                shutil.rmtree(os.path.join(root, e), ignore_errors=True) if os.path.isdir(os.path.join(root, e)) else os.remove(os.path.join(root, e))
    med = {k: statistics.median(v) for k, v in results.items()}
    print(json.dumps({"summary": {k: {"median_s": round(v, 3), "GBps": round(state_bytes / v / 1e9, 2)} for k, v in med.items()},
                      "ratio_dcp_over_er": round(med["dcp.save"] / med["elastic_run.save"], 2),
                      "ratio_torch_over_er": round(med["torch.save"] / med["elastic_run.save"], 2)}), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
