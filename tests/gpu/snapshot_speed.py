"""Device-to-host snapshot speed on a GPU: the training stall of a checkpoint.

Builds a model of about --gib GiB of fp32 parameters on the GPU plus Adam state (so 3x that in
state), then times, side by side and alternating, the blocking part of:
  - elastic_run.save   (the worker client: device-to-host copy + safetensors into staging)
  - torch.save         (of the same state dict, to the same directory)
  - dcp.save           (torch.distributed.checkpoint, world 1)
Prints one JSON line per measurement and a summary with medians and ratios.

    python tests/gpu/snapshot_speed.py --gib 2 --repeat 3 --dir /dev/shm/snap
"""
import json
import os
import shutil
import sys

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
    a = _common.parse_args()
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

    def clear():
        for e in os.listdir(root):
            p = os.path.join(root, e)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)

    _common.compare({"elastic_run.save": run_er, "torch.save": run_torch, "dcp.save": run_dcp}, a.repeat,
                    state_bytes, after_each=clear)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
