"""torch.distributed, when there is one: :func:`init`, and the one small collective per step
that makes every rank agree on stopping and checkpointing."""

import os

from ._env import local_rank


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    return dist


def init(backend=None, **kwargs):
    """Initializes ``torch.distributed`` from the environment if not done yet.

    gloo on CPU, nccl when CUDA is available (and the device is set to LOCAL_RANK). Returns the
    backend in use, or None without torch.distributed or outside a multi-process job.
    """
    dist = _dist()
    if dist is None:
        return None
    if dist.is_initialized():
        return dist.get_backend()
    if "MASTER_ADDR" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    import torch

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return backend


def _all_reduce_max(values):
    """Element-wise MAX of a short int list across all ranks: the one collective per step.
    Under recovery in place it runs on the switchable group; when it fails there (a peer is
    gone) the step is marked failed and the local values are returned: the loop switches
    before its next step."""
    from . import _state

    ip = _state.in_place
    if ip is not None:
        return ip._all_reduce_max(values)
    dist = _dist()
    if dist is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    import torch

    device = "cpu"
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]
