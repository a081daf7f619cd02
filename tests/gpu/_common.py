"""What the GPU speed checks share: a model of about ``gib`` GiB of fp32 parameters with Adam,
and a scratch directory with a world-1 gloo group."""
import os
import tempfile

import torch
import torch.distributed as dist

WIDTH = 8192


def build(gib, device, seed=None):
    """``(model, optimizer)``: 8192 x 8192 ``Linear`` layers, about ``gib`` GiB of parameters,
    on ``device``; Adam has no state yet."""
    if seed is not None:
        torch.manual_seed(seed)
    n = int(gib * (1 << 30) / 4)
    layers = max(1, n // (WIDTH * WIDTH))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def state_bytes(model, opt):
    """Bytes of the model's and the optimizer's tensors."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return n + sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values()
                   for v in s.values() if torch.is_tensor(v))


def scratch(prefix, directory, port):
    """A scratch directory (in /dev/shm when there is one, unless ``directory``), after a
    world-1 gloo group is initialised on ``port``."""
    root = directory or tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(root, exist_ok=True)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"})
    os.environ.pop("ELASTIC_AGENT_SOCKET", None)
    dist.init_process_group("gloo", rank=0, world_size=1)
    return root


def parse_args():
    """``--gib`` (model size), ``--repeat`` (runs of each method), ``--dir`` (scratch)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    return p.parse_args()


def compare(fns, repeat, nbytes, after_each=None):
    """Times each of ``fns`` (name -> fn(i), the first one elastic-run's, then torch's, then
    DCP's), ``repeat`` times, alternating, the device synchronized around each run; prints a
    JSON line per run and a summary with medians and the ratios to the first."""
    import json
    import statistics
    import time

    results = {k: [] for k in fns}
    for i in range(repeat):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(i)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            results[name].append(dt)
            print(json.dumps({"what": name, "i": i, "s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 2)}),
                  flush=True)
            if after_each is not None:
                after_each()
    med = {k: statistics.median(v) for k, v in results.items()}
    er, torch_, dcp = list(med)
    print(json.dumps({"summary": {k: {"median_s": round(v, 3), "GBps": round(nbytes / v / 1e9, 2)}
                                  for k, v in med.items()},
                      "ratio_dcp_over_er": round(med[dcp] / med[er], 2),
                      "ratio_torch_over_er": round(med[torch_] / med[er], 2)}), flush=True)
