"""Worker side of elastic-run.

Reads the environment the agent sets (torchrun's variables plus ``ELASTIC_*``), talks to the
agent over ``$ELASTIC_AGENT_SOCKET`` (newline-delimited JSON, see the ``elastic-run-worker``
crate's ``protocol`` module, ``runtime/worker/src/protocol.rs``), and writes snapshots as
safetensors into ``$ELASTIC_STAGING_DIR``.

Typical loop::

    import elastic_run as er
    er.init()
    # Any training state: Stateful objects (state_dict/load_state_dict) and nested values.
    state = {"model": model, "opt": opt, "sched": sched, "scaler": scaler, "data": {"pos": 0}}
    start = er.load(state) or 0          # fills `state` in place; plain values come back in it
    er.scale_lr(opt)                     # opt.step() runs at the scheduler's LR x the elastic scale
    for step in range(start + 1, steps + 1):
        train_one_step()                 # ... opt.step(); sched.step()
        er.report_progress(step)
        stop = er.should_stop(step)
        if stop:
            er.save(step, state)
            break
        if er.should_checkpoint(step):
            # Returns once the state is captured; a thread writes it while training goes on
            # (opt.step() waits for the write). er.save(...) is the blocking form.
            er.async_save(step, state)

The older form ``load(model=, optimizer=)`` / ``save(step, model=, optimizer=, extra=)`` works
as before. How the state is encoded (tensor names, the JSON skeleton) is in ``_tree``.

Snapshot layout (one directory per rank, written under a temporary name and renamed)::

    $ELASTIC_STAGING_DIR/step-<N>/rank-<R>/tensors.safetensors   this rank's share of the tensors
    $ELASTIC_STAGING_DIR/step-<N>/rank-<R>/meta.json             format version, step, rank, world
                                                                 size, keys, and the (replicated)
                                                                 non-tensor state

Every rank records the non-tensor state, so any node's agent can commit the step. What the
agent restores from the checkpoint store for a new generation (``$ELASTIC_RESUME_DIR``)::

    $ELASTIC_RESUME_DIR/rank-<R>/state.safetensors   every tensor rank R needs (DDP: all of them)
    $ELASTIC_RESUME_DIR/rank-<R>/metadata.json       {"step", "rank", "world_size",
                                                      "saved_world_size", "metadata":
                                                      {"elastic": {...}, "state": {...}}}

Replicated (DDP) state is split between ranks by bytes, so each byte is written once; ``load``
reads every rank's share, so a checkpoint can be loaded at any world size. Staged files are
private to the user whatever the umask: directories 0700, files 0600.

What comes from outside this process (``meta.json`` and ``metadata.json``, the agent's replies,
``RANK``, ``WORLD_SIZE`` and ``ELASTIC_*``) is checked before use: world sizes and ranks within
``WORLD_SIZE_MAX``, steps within ``STEP_MAX``, metadata files of at most ``METADATA_BYTES_MAX``
bytes, JSON nested at most ``JSON_DEPTH_MAX`` deep, and every field of the type it must have.
Anything else raises :class:`FormatError` (a ``ValueError``) naming the file, variable or reply
and the field.

torch is optional: the environment helpers work without it.
"""

# The face of the package: everything below is defined in its own module.
#
#   protocol       the worker <-> agent contract: format version, staged and restored file names,
#                  size and value bounds, message kinds and one builder per request, FormatError
#                  and the checks on JSON from outside
#   _env           rank(), world_size(), lr_scale(), scaled_lr() ...: the environment
#   _state         all module-level state (the one agent connection, the save in flight) and
#                  _reset_for_tests
#   _connection    the agent connection (AgentError), report_progress, should_stop,
#                  should_checkpoint
#   _distributed   init and the per-step all-reduce
#   _lr            scale_lr: the elastic scale on top of any LR scheduler
#   _sampler       ElasticSampler: one global seeded sample stream for any world size
#   _tree          any training state <-> tensors and a JSON skeleton, StateError
#   _save          save, async_save, wait, PendingSave, assign_keys, the safetensors writer
#   _load          load
#   _load_from     load_from: a checkpoint URL or directory, outside a job
#   _inplace       InPlace: recovery in place (switch process groups without a restart)
#
# Constants are re-exported here for reading; patch them where they are defined (e.g.
# elastic_run.protocol.METADATA_BYTES_MAX, elastic_run._connection.SAVED_TIMEOUT_S), as the
# modules read them there. The same goes for the private functions re-exported below.

from . import protocol
from ._connection import (
    PROGRESS_INTERVAL_S,
    SAVED_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    AgentError,
    report_progress,
    should_checkpoint,
    should_stop,
)
from ._distributed import init
from ._env import (
    batch_size,
    checkpoint_interval,
    generation,
    global_batch,
    grad_accum_steps,
    local_rank,
    local_world_size,
    lr_scale,
    rank,
    resume_step,
    scaled_lr,
    warmup_steps,
    world_size,
)
from ._inplace import InPlace, SwitchError
from ._load import load
from ._load_from import CheckpointUnavailable, load_from
from ._lr import LRScaling, scale_lr
from ._sampler import ElasticSampler
from ._tree import StateError
from ._save import PendingSave, _flatten, _write_safetensors, assign_keys, async_save, save, wait
from .protocol import (
    FORMAT_VERSION,
    JSON_DEPTH_MAX,
    MESSAGE_BYTES_MAX,
    METADATA_BYTES_MAX,
    STEP_MAX,
    WORLD_SIZE_MAX,
    FormatError,
)
from ._state import _reset_for_tests

__all__ = [
    "init",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "generation",
    "scaled_lr",
    "scale_lr",
    "LRScaling",
    "ElasticSampler",
    "lr_scale",
    "batch_size",
    "grad_accum_steps",
    "global_batch",
    "warmup_steps",
    "resume_step",
    "checkpoint_interval",
    "should_checkpoint",
    "should_stop",
    "save",
    "async_save",
    "wait",
    "PendingSave",
    "load",
    "load_from",
    "CheckpointUnavailable",
    "report_progress",
    "assign_keys",
    "InPlace",
    "SwitchError",
    "FormatError",
    "StateError",
]

# The public names say they are elastic_run's, as when they were defined here (reprs,
# tracebacks, pickles, help()).
for _name in __all__ + ["AgentError"]:
    globals()[_name].__module__ = __name__
del _name

# Importable from here as before, but not part of `from elastic_run import *` (named here so
# that linters see them used). The private ones are used outside the package: bench/ calls
# _flatten, the tests _write_safetensors and _reset_for_tests.
_ALSO_EXPORTED = (
    protocol, AgentError, FORMAT_VERSION, JSON_DEPTH_MAX, MESSAGE_BYTES_MAX, METADATA_BYTES_MAX,
    STEP_MAX, WORLD_SIZE_MAX, PROGRESS_INTERVAL_S, SAVED_TIMEOUT_S, SOCKET_TIMEOUT_S,
    _flatten, _write_safetensors, _reset_for_tests,
)
