"""What the agent tells a worker through the environment: torchrun's variables (``RANK``,
``WORLD_SIZE``, ...) and ``ELASTIC_*``, each checked (:class:`~elastic_run.FormatError`)."""

import math
import os

from . import protocol
from .protocol import FormatError, _describe


def _env_int(name, default=None, lo=None, hi=None):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise FormatError(f"{name}={_describe(v)} is not an integer") from None
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        raise FormatError(f"{name}={n} is outside [{lo}, {'...' if hi is None else hi}]")
    return n


def _env_float(name, default=None):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        x = float(v)
    except ValueError:
        raise FormatError(f"{name}={_describe(v)} is not a number") from None
    if not math.isfinite(x):
        raise FormatError(f"{name}={v!r} is not finite")
    return x


def rank():
    return _env_int("RANK", 0, 0, protocol.WORLD_SIZE_MAX - 1)


def local_rank():
    return _env_int("LOCAL_RANK", 0, 0, protocol.WORLD_SIZE_MAX - 1)


def world_size():
    return _env_int("WORLD_SIZE", 1, 1, protocol.WORLD_SIZE_MAX)


def local_world_size():
    return _env_int("LOCAL_WORLD_SIZE", 1, 1, protocol.WORLD_SIZE_MAX)


def generation():
    return _env_int("ELASTIC_GENERATION", 0, 0)


def lr_scale():
    return _env_float("ELASTIC_LR_SCALE", 1.0)


def batch_size(default=None):
    """Per-worker batch (``--batch-size``), or ``default``."""
    return _env_int("ELASTIC_BATCH_SIZE", default)


def grad_accum_steps():
    return max(1, _env_int("ELASTIC_GRAD_ACCUM_STEPS", 1))


def global_batch(default=None):
    return _env_int("ELASTIC_GLOBAL_BATCH", default)


def warmup_steps():
    return max(0, _env_int("ELASTIC_WARMUP_STEPS", 0))


def resume_step():
    """The committed step this generation resumes from, or None."""
    return _env_int("ELASTIC_RESUME_STEP", None, 0, protocol.STEP_MAX)


def heal_step():
    """The step this worker's node joined at without restoring it (``ELASTIC_HEAL_STEP``): the
    generation's continuing members hold it in memory. :class:`elastic_run.InPlace` takes it
    from them; :func:`elastic_run.load` asks the agent to restore it. None otherwise."""
    return _env_int("ELASTIC_HEAL_STEP", None, 0, protocol.STEP_MAX)


def checkpoint_interval():
    return max(0, _env_int("ELASTIC_CHECKPOINT_INTERVAL", 0))


def scaled_lr(base, step=None):
    """``base`` scaled for the current world size.

    With ``--warmup-steps W`` and a ``step``, the scale ramps linearly from 1 to its target over
    the first W steps after the resume step, so a rescale does not jolt the optimizer.
    """
    scale = lr_scale()
    w = warmup_steps()
    if step is None or w == 0 or scale == 1.0:
        return base * scale
    start = resume_step() or 0
    frac = min(1.0, max(0.0, (step - start) / w))
    return base * (1.0 + (scale - 1.0) * frac)


# What `python -m elastic_run env` prints besides ELASTIC_* and TORCHELASTIC_*.
_DEBUG_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _debug_env():
    """The variables this worker sees that concern it (``python -m elastic_run env``)."""
    keys = sorted(k for k in os.environ if k.startswith(("ELASTIC_", "TORCHELASTIC_")) or k in _DEBUG_VARS)
    return {k: os.environ[k] for k in keys}
