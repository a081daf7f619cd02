"""Restore into a GPU: correctness of the pinned path, then its speed against the alternatives.

1. Correctness. A model of mixed tensors (several pinned buffers long, one byte, 0-dim, bf16,
   int64) and its Adam state, on the GPU, are saved with ``elastic_run.save`` (through its
   pinned buffers too), laid out as the
   agent restores a step (``rank-0/state.safetensors`` + ``metadata.json``), and loaded into a
   fresh model and optimizer on the GPU with ``elastic_run.load``: every tensor must come back
   bitwise, on the GPU, through the pinned path (checked by counting its copiers).
2. Speed. A model of about --gib GiB of fp32 parameters plus Adam state (3x that), restored
   from files in the page cache into GPU tensors, side by side and alternating:
     - elastic_run.load  (pinned buffers, asynchronous copies to the device)
     - torch.load(map_location="cuda") + load_state_dict
     - dcp.load           (torch.distributed.checkpoint, world 1, into GPU state dicts)
   One JSON line per measurement, then a summary with medians and ratios.

    python tests/gpu/restore_speed.py --gib 2 --repeat 3
"""
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "runtime", "python"))
import elastic_run as er  # noqa: E402
from elastic_run import _read  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def restore_layout(staging, step, out):
    """What the agent's restore lays out for rank 0 of world 1, from a staged world-1 step."""
    src = os.path.join(staging, f"step-{step}", "rank-0")
    with open(os.path.join(src, "meta.json")) as f:
        meta = json.load(f)
    d = os.path.join(out, "rank-0")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(os.path.join(src, "tensors.safetensors"), os.path.join(d, "state.safetensors"))
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"format_version": 1, "step": step, "rank": 0, "world_size": 1, "saved_world_size": 1,
                   "metadata": {"state": meta["state"]}}, f)
    return out


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # 80 MiB: three pinned buffers' worth, the last one partial.
        self.big = torch.nn.Parameter(torch.randn(20 * (1 << 20) + 7))
        self.small = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.bfloat16))
        self.one = torch.nn.Parameter(torch.randn(()))
        self.register_buffer("count", torch.arange(11, dtype=torch.int64))
        self.register_buffer("flag", torch.ones(1, dtype=torch.uint8))


def check_correctness(root):
    made = []
    real = _read._DeviceCopier

    class Counting(real):
        def __init__(self, *a, **kw):
            made.append(1)
            super().__init__(*a, **kw)

    torch.manual_seed(0)
    src = Mixed().cuda()
    opt = torch.optim.Adam(src.parameters(), lr=1e-3)
    (src.big.float().sum() + src.small.float().sum() + src.one).backward()
    opt.step()
    staging = os.path.join(root, "check-staging")
    os.environ["ELASTIC_STAGING_DIR"] = staging
    er.save(3, state={"model": src, "optim": opt})
    resume = restore_layout(staging, 3, os.path.join(root, "check-restore"))

    torch.manual_seed(1)
    dst = Mixed().cuda()
    dst_opt = torch.optim.Adam(dst.parameters(), lr=1e-3)
    _read._DeviceCopier = Counting
    try:
        step = er.load({"model": dst, "optim": dst_opt}, resume_dir=resume)
    finally:
        _read._DeviceCopier = real
    assert step == 3, step
    for k, v in src.state_dict().items():
        w = dst.state_dict()[k]
        assert w.device.type == "cuda", (k, w.device)
        assert torch.equal(v, w), k
    a, b = opt.state_dict()["state"], dst_opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        for k in a[i]:
            if k != "step":
                assert b[i][k].device.type == "cuda", (i, k, b[i][k].device)
            assert torch.equal(a[i][k].cpu(), b[i][k].cpu()), (i, k)
    assert made, "the pinned path was not taken"
    print(json.dumps({"correct": True, "copiers": len(made)}), flush=True)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(resume, ignore_errors=True)


def main():
    a = _common.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    root = _common.scratch("restore-", a.dir, 29534)
    check_correctness(root)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _common.build(a.gib, "cuda", seed=0)
    model(torch.randn(4, _common.WIDTH, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.synchronize()
    state_bytes = _common.state_bytes(model, opt)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "state_bytes": state_bytes}), flush=True)
    staging = os.path.join(root, "staging")
    os.environ["ELASTIC_STAGING_DIR"] = staging
    er.save(1, state={"model": model, "optim": opt})
    er_dir = restore_layout(staging, 1, os.path.join(root, "er"))
    shutil.rmtree(staging)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, os.path.join(root, "t.pt"))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "dcp"))
    del msd, osd, model, opt
    torch.cuda.empty_cache()

    # One fresh model and optimizer, reused: each restore overwrites them.
    model, opt = _common.build(a.gib, "cuda", seed=1)

    def run_er(i):
        er.load({"model": model, "optim": opt}, resume_dir=er_dir)

    def run_torch(i):
        sd = torch.load(os.path.join(root, "t.pt"), map_location="cuda", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def run_dcp(i):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    _common.compare({"elastic_run.load": run_er, "torch.load": run_torch, "dcp.load": run_dcp}, a.repeat,
                    state_bytes)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
