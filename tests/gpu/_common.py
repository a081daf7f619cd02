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
