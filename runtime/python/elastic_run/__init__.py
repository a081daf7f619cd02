"""Worker side of elastic-run.

Reads the environment the agent sets (torchrun's variables plus ``ELASTIC_*``), talks to the
agent over ``$ELASTIC_AGENT_SOCKET`` (newline-delimited JSON, see the runtime crate's
``agent_socket`` module), and writes snapshots as safetensors into ``$ELASTIC_STAGING_DIR``.

Typical loop::

    import elastic_run as er
    er.init()
    start, extra = er.load(model=model, optimizer=opt) or (0, {})
    for step in range(start + 1, steps + 1):
        train_one_step(lr=er.scaled_lr(base_lr, step))
        er.report_progress(step)
        stop = er.should_stop(step)
        if stop:
            er.save(step, model=model, optimizer=opt, extra={...})
            break
        if er.should_checkpoint(step):
            # Returns once the state is captured; a thread writes it while training goes on
            # (opt.step() waits for the write). er.save(...) is the blocking form.
            er.async_save(step, model=model, optimizer=opt, extra={...})

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

import errno
import heapq
import json
import math
import operator
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import warnings

__all__ = [
    "init",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "generation",
    "scaled_lr",
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
    "report_progress",
    "assign_keys",
    "FormatError",
]

FORMAT_VERSION = 1
# Must match the agent's MESSAGE_BYTES_MAX.
MESSAGE_BYTES_MAX = 64 * 1024
# Progress reports are rate-limited: the watchdog works in seconds, not steps.
PROGRESS_INTERVAL_S = 0.1
SOCKET_TIMEOUT_S = 30.0
# A `saved` reply waits while earlier checkpoints are still being committed (the agent bounds
# how far training may run ahead of the store); a slow store can hold it this long.
SAVED_TIMEOUT_S = 1800.0
# Largest world size (ranks are below it) taken from the environment or from metadata, checked
# before anything is sized by it. Far above any real job; torch.distributed's ranks are int32.
WORLD_SIZE_MAX = 1 << 20
# Largest step: the largest integer a JSON number (an IEEE double) holds exactly.
STEP_MAX = 2**53 - 1
# Largest metadata file read (meta.json, metadata.json): the agent's limit too.
METADATA_BYTES_MAX = 16 * 1024 * 1024
# Deepest nesting of arrays and objects in JSON read. What `save` writes stays within it once
# the restore metadata wraps the state one level deeper than meta.json does.
JSON_DEPTH_MAX = 64

_TENSORS = "tensors.safetensors"
_META = "meta.json"
# What the agent restores from the checkpoint store (the checkpoint crate's restore layout).
_RESTORED = "state.safetensors"
_RESTORED_META = "metadata.json"
# Modes of what `save` creates, set explicitly: the umask is not relied on.
_DIR_MODE = 0o700
_FILE_MODE = 0o600


class FormatError(ValueError):
    """Malformed or out-of-bounds input from outside this process: a snapshot's or a restore's
    metadata, a reply from the agent, or an environment variable. The message names the file,
    reply or variable and the field."""


def _describe(v):
    """``v`` for an error message, cut short."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


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
    return _env_int("RANK", 0, 0, WORLD_SIZE_MAX - 1)


def local_rank():
    return _env_int("LOCAL_RANK", 0, 0, WORLD_SIZE_MAX - 1)


def world_size():
    return _env_int("WORLD_SIZE", 1, 1, WORLD_SIZE_MAX)


def local_world_size():
    return _env_int("LOCAL_WORLD_SIZE", 1, 1, WORLD_SIZE_MAX)


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
    return _env_int("ELASTIC_RESUME_STEP", None, 0, STEP_MAX)


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


# --- input from outside: JSON, fields, steps ---------------------------------------------------

# A JSON string; one left open runs to the end of the text, so that a scan stays linear.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_JSON_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
# Longest integer literal parsed (Python's own default limit, from 3.11 on).
_JSON_INT_DIGITS_MAX = 4300


def _json_too_deep(text, limit):
    """Whether JSON ``text`` nests arrays and objects deeper than ``limit``, found without
    parsing it: the parser recurses once per level."""
    depth = 0
    for c in _JSON_NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)):
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _json_int(s):
    if len(s.lstrip("-")) > _JSON_INT_DIGITS_MAX:
        raise ValueError(f"integer of {len(s)} digits")
    return int(s)


def _json_constant(name):
    raise ValueError(f"{name} is not JSON")


def _parse_json(data, where):
    """JSON from outside this process (bytes): UTF-8, standard (no NaN or Infinity), at most
    JSON_DEPTH_MAX deep. FormatError otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: not UTF-8: {e}") from None
    if _json_too_deep(text, JSON_DEPTH_MAX):
        raise FormatError(f"{where}: JSON nested deeper than {JSON_DEPTH_MAX}")
    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except ValueError as e:  # JSONDecodeError, and the two above
        raise FormatError(f"{where}: not JSON: {e}") from None


_REQUIRED = object()
_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true or false"}


def _get(where, obj, key, kind, default=_REQUIRED, parent=""):
    """``obj[key]`` of type ``kind`` (absent or null: ``default``, unless it is required).
    ``where`` names the file or reply and ``parent`` the object's place in it."""
    v = obj.get(key)
    if v is None:
        if default is _REQUIRED:
            raise FormatError(f"{where}: no {parent}{key}")
        return default
    if not isinstance(v, kind):
        raise FormatError(f"{where}: {parent}{key} is {_describe(v)}, not {_KINDS[kind]}")
    return v


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _get_int(where, obj, key, lo, hi, default=_REQUIRED, parent=""):
    """``obj[key]``, an integer (not a bool) in ``[lo, hi]``; see :func:`_get`."""
    v = obj.get(key)
    if v is None:
        if default is _REQUIRED:
            raise FormatError(f"{where}: no {parent}{key}")
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise FormatError(f"{where}: {parent}{key} is {_describe(v)}, not an integer in [{lo}, {hi}]")
    return v


def _is_index_text(s):
    """Whether ``s`` is a parameter index as ``str(int)`` writes it."""
    return s.isascii() and s.isdigit() and len(s) <= 18 and (s == "0" or s[0] != "0")


def _check_step(step, caller):
    """``step`` as an int in [0, STEP_MAX] (an ``__index__`` integer, not a bool or a float)."""
    if not isinstance(step, bool):
        try:
            n = operator.index(step)
        except TypeError:
            n = None
        if n is not None and 0 <= n <= STEP_MAX:
            return n
    raise FormatError(f"elastic_run.{caller}: step {_describe(step)} is not an integer in [0, {STEP_MAX}]")


# --- agent connection -------------------------------------------------------------------------


class AgentError(RuntimeError):
    """The agent refused a request."""


class _Agent:
    def __init__(self, path):
        self.path = path
        self.sock = None
        self.buf = b""

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(SOCKET_TIMEOUT_S)
        s.connect(self.path)
        self.sock = s
        self.buf = b""

    def request(self, obj, timeout_s=None, expect="ok"):
        """Sends ``obj`` and returns the reply, which must be of type ``expect``."""
        timeout_s = SOCKET_TIMEOUT_S if timeout_s is None else timeout_s
        line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        if len(line) > MESSAGE_BYTES_MAX:
            raise AgentError(f"message of {len(line)} bytes exceeds {MESSAGE_BYTES_MAX}")
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    self._connect()
                self.sock.settimeout(timeout_s)
                self.sock.sendall(line)
                reply = self._read_reply()
                break
            except socket.timeout:
                # The agent got the request and has not answered: sending it again would not
                # help (and would repeat it).
                self.close()
                raise AgentError(f"no reply from the agent within {timeout_s:g} s to {obj.get('type')!r}") from None
            except OSError:
                # One reconnect: the agent may have closed an idle connection.
                self.close()
                if attempt == 1:
                    raise
        if reply["type"] != expect:
            kind = _describe(reply["type"])
            raise FormatError(f"agent reply to {obj.get('type')!r} is of type {kind}, not {expect!r}")
        return reply

    def _read_reply(self):
        while b"\n" not in self.buf:
            if len(self.buf) >= MESSAGE_BYTES_MAX:
                self._too_long()
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("agent closed the connection")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        if len(line) >= MESSAGE_BYTES_MAX:
            self._too_long()
        reply = _parse_json(line, "agent reply")
        if not isinstance(reply, dict):
            raise FormatError(f"agent reply {_describe(line)}: not a JSON object")
        if _get("agent reply", reply, "type", str) == "error":
            raise AgentError(_get("agent reply", reply, "message", str, "agent error"))
        return reply

    def _too_long(self):
        # The next line boundary is unknown: this connection is done.
        self.close()
        raise FormatError(f"agent reply longer than {MESSAGE_BYTES_MAX} bytes")

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None


_agent = None
_last_progress = 0.0
# A checkpoint step the agent asked for and not yet honoured, and the last request seen (the
# agent repeats its request in every reply until a newer one replaces it).
_checkpoint_at = None
_checkpoint_request_seen = None
_warned_no_staging = False


def _agent_conn():
    """The agent connection, or None when not running under elastic-run."""
    global _agent
    path = os.environ.get("ELASTIC_AGENT_SOCKET")
    if not path:
        return None
    if _agent is None or _agent.path != path:
        _agent = _Agent(path)
    return _agent


def _reset_for_tests():
    global _agent, _last_progress, _checkpoint_at, _checkpoint_request_seen, _warned_no_staging
    if _agent is not None:
        _agent.close()
    _agent = None
    _last_progress = 0.0
    _checkpoint_at = None
    _checkpoint_request_seen = None
    _warned_no_staging = False


def report_progress(step, force=False):
    """Tells the agent this rank finished ``step`` (feeds the hang watchdog). Rate-limited."""
    global _last_progress
    conn = _agent_conn()
    if conn is None:
        return
    now = time.monotonic()
    if not force and now - _last_progress < PROGRESS_INTERVAL_S:
        return
    _last_progress = now
    conn.request({"type": "progress", "rank": rank(), "step": int(step)})


# --- torch.distributed ------------------------------------------------------------------------


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
    """Element-wise MAX of a short int list across all ranks: the one collective per step."""
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


def should_stop(step):
    """Whether every rank should save ``step`` and exit (the agent is draining).

    Local rank 0 of each node asks its agent; one tiny all-reduce (MAX) makes every rank agree,
    so all ranks call this at the same steps. It also learns the step the agent wants a
    checkpoint at, which :func:`should_checkpoint` then honours.
    """
    global _checkpoint_at, _checkpoint_request_seen
    stop, ckpt = 0, 0
    conn = _agent_conn()
    if conn is not None and local_rank() == 0:
        reply = conn.request({"type": "query"}, expect="state")
        where = "agent reply to 'query'"
        stop = 1 if _get(where, reply, "should_stop", bool) else 0
        at = _get_int(where, reply, "should_checkpoint_at", 0, STEP_MAX, None)
        ckpt = 0 if at is None else at + 1
    asked = stop
    stop, ckpt = _all_reduce_max([stop, ckpt])
    if stop and not asked and conn is not None and local_rank() == 0:
        # Another node's agent asked: tell ours, so that it does not take the clean exit that
        # follows for the end of the job (it may not have heard of the drain itself).
        conn.request({"type": "peer_stop", "rank": rank(), "step": int(step)})
    if ckpt > 0 and ckpt - 1 != _checkpoint_request_seen:
        _checkpoint_request_seen = ckpt - 1
        _checkpoint_at = ckpt - 1
    return bool(stop)


def should_checkpoint(step):
    """Whether ``step`` is a checkpoint step: every ``--checkpoint-interval`` steps, or the
    step the agent asked for (learned by the last :func:`should_stop`). No collective."""
    global _checkpoint_at
    n = checkpoint_interval()
    if n > 0 and step > 0 and step % n == 0:
        return True
    if _checkpoint_at is not None and step >= _checkpoint_at:
        _checkpoint_at = None
        return True
    return False


# --- snapshots --------------------------------------------------------------------------------


def assign_keys(sizes, world):
    """Splits tensors between ``world`` ranks by bytes: largest first, each to the rank with the
    fewest bytes so far (ties to the lower rank). Deterministic, so every rank computes the same
    split from the same replicated state. Returns ``{key: rank}``."""
    if not _is_int(world) or not 1 <= world <= WORLD_SIZE_MAX:
        raise ValueError(f"world size must be an integer in [1, {WORLD_SIZE_MAX}], not {_describe(world)}")
    # (bytes, rank) of the ranks given a key so far; the others hold 0 bytes, and `fresh` is
    # the lowest of them. Time and memory grow with the keys, not with the world size.
    used, fresh = [], 0
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        if fresh < world and (not used or (0, fresh) < used[0]):
            held, r = 0, fresh
            fresh += 1
        else:
            held, r = heapq.heappop(used)
        out[key] = r
        heapq.heappush(used, (held + sizes[key], r))
    return out


def _unwrap(model):
    # DistributedDataParallel and DataParallel keep the real module in .module.
    inner = getattr(model, "module", None)
    if inner is not None and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return model


def _is_tensor(v):
    try:
        import torch
    except ImportError:
        return False
    return isinstance(v, torch.Tensor)


def _flatten(model, optimizer, extra):
    """Tensors by key, and the JSON-able rest."""
    tensors, rest = {}, {}
    if model is not None:
        for k, v in _unwrap(model).state_dict().items():
            tensors["model/" + k] = v
    if optimizer is not None:
        sd = optimizer.state_dict()
        opt_json = {}
        for idx, st in sd["state"].items():
            for name, v in st.items():
                if _is_tensor(v):
                    tensors[f"optim/state/{idx}/{name}"] = v
                else:
                    opt_json.setdefault(str(idx), {})[name] = v
        rest["optim_state"] = opt_json
        rest["optim_param_groups"] = sd["param_groups"]
    if extra is not None:
        ej = {}
        for k, v in extra.items():
            if _is_tensor(v):
                tensors["extra/" + k] = v
            else:
                ej[k] = v
        rest["extra"] = ej
    for k in tensors:
        if "\n" in k or len(k) > 1024:
            raise ValueError(f"tensor name {k!r} cannot be stored")
    return tensors, rest


def _makedirs_private(path):
    """Creates ``path`` and its missing parents with mode 0700, whatever the umask; directories
    that exist are left as they are."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        try:
            os.mkdir(p, _DIR_MODE)
        except FileExistsError:
            if os.path.isdir(p):  # another rank made it meanwhile
                continue
            raise
        os.chmod(p, _DIR_MODE)


def _open_private(path):
    """A new (or truncated) file opened for writing, mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    try:
        os.fchmod(fd, _FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging_dir(caller):
    """$ELASTIC_STAGING_DIR, or None (warned once) outside elastic-run."""
    global _warned_no_staging
    staging = os.environ.get("ELASTIC_STAGING_DIR")
    if not staging and not _warned_no_staging:
        _warned_no_staging = True
        warnings.warn(
            f"elastic_run.{caller}: ELASTIC_STAGING_DIR is not set (not under elastic-run); "
            "checkpoints are not written",
            RuntimeWarning,
            stacklevel=3,
        )
    return staging or None


def _storage_key(t):
    return t.untyped_storage().data_ptr() if t.numel() else None


def _guarded_storages(optimizer):
    """Storages that only ``optimizer.step()`` changes: its parameters and its state tensors."""
    out = set()
    if optimizer is None:
        return out
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.add(_storage_key(p))
            for v in optimizer.state.get(p, {}).values():
                if _is_tensor(v):
                    out.add(_storage_key(v))
    out.discard(None)
    return out


class _Snapshot:
    """One rank's share of one step, ready to be written. Its tensors are either the training
    state's own memory (written as they are: nothing may change them until the write ends) or
    host copies made for the snapshot; the writer moves device tensors to the host one by one."""

    def __init__(self, staging, step, rank_, world, tensors, rest):
        self.staging, self.step, self.rank, self.world = staging, step, rank_, world
        self.tensors = tensors
        # meta.json as bytes now: later changes to the objects the JSON state came from do not
        # reach the snapshot, and what is not JSON, or what load could not read back (too big,
        # too deep), fails here, in the caller.
        text = json.dumps({
            "format_version": FORMAT_VERSION,
            "step": step,
            "rank": rank_,
            "world_size": world,
            "keys": sorted(tensors),
            # Every rank records the (replicated) JSON state, so any node's agent can commit.
            "state": rest,
        })
        # The restore's metadata.json holds the state one level deeper than meta.json.
        if _json_too_deep(text, JSON_DEPTH_MAX - 1):
            raise ValueError(f"the JSON state is nested deeper than {JSON_DEPTH_MAX - 2} levels")
        self.meta_json = text.encode()
        if len(self.meta_json) > METADATA_BYTES_MAX:
            raise ValueError(f"{_META} would be {len(self.meta_json)} bytes, over the limit of {METADATA_BYTES_MAX}")


def _snapshot(staging, step, model, optimizer, extra, copy_unguarded):
    r, w = rank(), world_size()
    if r >= w:
        raise FormatError(f"RANK={r} is not below WORLD_SIZE={w}")
    tensors, rest = _flatten(model, optimizer, extra)
    owner = assign_keys({k: v.numel() * v.element_size() for k, v in tensors.items()}, w)
    guarded = _guarded_storages(optimizer) if copy_unguarded else set()
    mine = {}
    for k, v in tensors.items():
        if owner[k] != r:
            continue
        t = v.detach()
        if copy_unguarded and _storage_key(t) not in guarded:
            # Buffers (BatchNorm statistics change in forward), extra tensors, and parameters
            # without an optimizer to guard them: copied now.
            t = t.to("cpu", copy=True)
        # Tensors sharing memory (tied weights) need nothing special: the writer writes each
        # key's bytes on their own.
        mine[k] = t
    return _Snapshot(staging, step, r, w, mine, rest)


# safetensors dtype names.
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
# One os.write at most (Linux writes at most 2 GiB - 4 KiB per call).
_WRITE_BYTES_MAX = 1 << 30


def _write_safetensors(path, tensors, metadata):
    """Writes ``tensors`` (name -> tensor) as a safetensors file straight from their memory: an
    8-byte little-endian header length, the JSON header padded with spaces to 8 bytes, then
    every tensor's bytes in name order. Device tensors are copied to the host one at a time.
    ``os.write`` releases the GIL, so a writer thread lets training go on meanwhile."""
    import struct

    import torch

    names = sorted(tensors)
    header, off = {}, 0
    for n in names:
        t = tensors[n]
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {n!r}: dtype {t.dtype} cannot be stored in safetensors")
        size = t.numel() * t.element_size()
        header[n] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [off, off + size]}
        off += size
    header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    fd = _open_private(path)
    try:
        _write_all(fd, struct.pack("<Q", len(h)) + h)
        for n in names:
            t = tensors[n]
            if t.numel() == 0:
                continue
            if t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            _write_all(fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd, buf):
    mv = memoryview(buf)
    while mv:
        n = os.write(fd, mv[:_WRITE_BYTES_MAX])
        mv = mv[n:]


# A full staging file system (or quota): the snapshot is skipped, never the training.
_STAGING_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# The reason a skip reports to the agent is cut to this (a message line is bounded).
_SKIP_REASON_CHARS_MAX = 1000


def _write_snapshot(snap, conn):
    """Writes ``snap`` under a temporary name, fsyncs, renames it into place, and tells the
    agent (``conn``; None outside elastic-run). Returns the directory, or None when the
    staging file system is full: then this checkpoint is skipped with a warning that gives
    the sizes, what was written of it is removed, and training goes on (the agent cannot
    commit the step without this rank's part, and commits the next checkpoint that fits)."""
    try:
        return _write_snapshot_inner(snap, conn)
    except OSError as e:
        if e.errno not in _STAGING_FULL_ERRNOS:
            raise
        step_dir = os.path.join(snap.staging, f"step-{snap.step}")
        shutil.rmtree(os.path.join(step_dir, f".rank-{snap.rank}.tmp-{os.getpid()}"), ignore_errors=True)
        try:
            st = os.statvfs(snap.staging)
            room = f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"
        except OSError:
            room = "free space unknown"
        need = sum(t.numel() * t.element_size() for t in snap.tensors.values()) + len(snap.meta_json)
        why = (f"the staging file system {snap.staging} is full ({os.strerror(e.errno)}; this "
               f"rank's snapshot is {need} bytes, {room})")
        warnings.warn(
            f"elastic_run: skipping the checkpoint of step {snap.step} on rank {snap.rank}: {why}; "
            "training goes on and the next checkpoint is tried as usual",
            RuntimeWarning,
            stacklevel=2,
        )
        if conn is not None:
            # The agent gives the step up in the store, so no node waits for this part.
            try:
                conn.request({"type": "skipped", "rank": snap.rank, "step": snap.step,
                              "reason": why[:_SKIP_REASON_CHARS_MAX]}, timeout_s=SAVED_TIMEOUT_S)
            except (AgentError, OSError) as told:
                warnings.warn(f"elastic_run: could not tell the agent that step {snap.step} was "
                              f"skipped: {told}", RuntimeWarning, stacklevel=2)
        return None


def _write_snapshot_inner(snap, conn):
    step, r = snap.step, snap.rank
    step_dir = os.path.join(snap.staging, f"step-{step}")
    final = os.path.join(step_dir, f"rank-{r}")
    tmp = os.path.join(step_dir, f".rank-{r}.tmp-{os.getpid()}")
    _makedirs_private(step_dir)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    _makedirs_private(tmp)
    _write_safetensors(os.path.join(tmp, _TENSORS), snap.tensors, {"step": str(step), "rank": str(r)})
    fd = _open_private(os.path.join(tmp, _META))
    try:
        _write_all(fd, snap.meta_json)
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(tmp)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(step_dir)
    if conn is not None:
        conn.request({"type": "saved", "rank": r, "step": step, "dir": final}, timeout_s=SAVED_TIMEOUT_S)
    return final


def save(step, model=None, optimizer=None, extra=None):
    """Writes this rank's share of the state for ``step`` into staging, then tells the agent.

    ``extra`` is a dict of JSON values and tensors (RNG states, data position...). Every rank
    must call this at the same step with the same replicated state. Returns the directory
    written, or None when the staging file system is full: that checkpoint is then skipped
    with a warning giving the sizes, and training goes on. A pending :func:`async_save` is finished first.

    Outside elastic-run (plain ``torchrun`` or ``python``, no ``$ELASTIC_STAGING_DIR``) there
    is no agent to commit a snapshot: it warns once and returns None, so one script runs under
    both launchers.

    ``step`` is an integer in [0, ``STEP_MAX``] (else :class:`FormatError`).
    """
    step = _check_step(step, "save")
    wait()
    staging = _staging_dir("save")
    if staging is None:
        return None
    # Nothing runs until the write ends: every tensor is written from its own memory.
    snap = _snapshot(staging, step, model, optimizer, extra, copy_unguarded=False)
    return _write_snapshot(snap, _agent_conn())


class PendingSave:
    """An :func:`async_save` in progress: a thread is writing the snapshot."""

    def __init__(self, step):
        self.step = step
        self._done = threading.Event()
        self._result = None
        self._error = None

    def done(self):
        return self._done.is_set()

    def wait(self, timeout_s=None):
        """Waits for the write (and the agent's acknowledgement); returns the directory
        written, or raises what the writer raised. ``timeout_s``: ``TimeoutError`` after it."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"elastic_run: the save of step {self.step} is still being written")
        if self._error is not None:
            raise self._error
        return self._result


_pending = None
_pending_lock = threading.Lock()


def wait():
    """Waits for the pending :func:`async_save`, if any, and raises its error. Returns the
    directory it wrote, or None."""
    global _pending
    with _pending_lock:
        p = _pending
    if p is None:
        return None
    try:
        return p.wait()
    finally:
        with _pending_lock:
            if _pending is p:
                _pending = None


def _step_pre_hook(optimizer, args, kwargs):
    # optimizer.step() changes the parameters and the optimizer state in place: the pending
    # snapshot must be written first.
    wait()


def async_save(step, model=None, optimizer=None, extra=None):
    """Like :func:`save`, but returns as soon as the state is captured; a thread writes it into
    staging and tells the agent. Returns a :class:`PendingSave` (None outside elastic-run).

    What stays consistent: the parameters and the optimizer state are written from their own
    memory, so ``optimizer.step()`` of the optimizer passed here waits for the write first (a
    step pre-hook), as do the next ``save``/``async_save`` and :func:`wait`. Buffers
    (BatchNorm statistics change in forward), ``extra`` tensors, and the parameters when no
    optimizer is given are copied before this returns. Code that changes parameters in place
    other than through ``optimizer.step()`` must call :func:`wait` before it does. The write's
    error, if any, is raised at that next wait. One save is in flight at a time."""
    global _pending
    step = _check_step(step, "async_save")
    wait()
    staging = _staging_dir("async_save")
    if staging is None:
        return None
    if optimizer is not None and not getattr(optimizer, "_elastic_run_hooked", False):
        optimizer.register_step_pre_hook(_step_pre_hook)
        optimizer._elastic_run_hooked = True
    snap = _snapshot(staging, step, model, optimizer, extra, copy_unguarded=True)
    pending = PendingSave(snap.step)
    path = os.environ.get("ELASTIC_AGENT_SOCKET")

    def write():
        # A connection of its own: the training thread keeps using the shared one meanwhile.
        conn = _Agent(path) if path else None
        try:
            pending._result = _write_snapshot(snap, conn)
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            pending._error = e
        finally:
            if conn is not None:
                conn.close()
            pending._done.set()

    with _pending_lock:
        _pending = pending
    # Not a daemon: an interpreter that exits still finishes the write.
    threading.Thread(target=write, name=f"elastic_run-save-{snap.step}").start()
    return pending


def load(model=None, optimizer=None, resume_dir=None):
    """Loads the committed step the agent resumes from (``$ELASTIC_RESUME_DIR``) into ``model``
    and ``optimizer``, whatever world size saved it. Returns ``(step, extra)``, or None when
    there is nothing to resume from.

    Two layouts are read: what the agent restores from the checkpoint store
    (``DIR/rank-$RANK/state.safetensors`` with every tensor this rank needs, and
    ``DIR/rank-$RANK/metadata.json``), and a staged snapshot (``DIR/rank-*/tensors.safetensors``
    and ``meta.json``, every rank's share). Without ``resume_dir``, the step read must be
    ``$ELASTIC_RESUME_STEP`` when that is set. Raises :class:`FormatError` (a ``ValueError``)
    on malformed metadata or tensor files, an unknown format version, a step that does not
    match, or a directory that is neither layout."""
    from_env = resume_dir is None
    d = resume_dir or os.environ.get("ELASTIC_RESUME_DIR")
    if not d or not os.path.isdir(d):
        return None
    mine = os.path.join(d, f"rank-{rank()}")
    if os.path.isfile(os.path.join(mine, _RESTORED)):
        step, tensors, rest = _read_restored(mine)
    elif _is_restore_dir(d):
        raise FormatError(f"{d}: restored for other ranks: no {_RESTORED} for rank {rank()}")
    else:
        step, tensors, rest = _read_staged(d)
    expected = resume_step() if from_env else None
    if expected is not None and step != expected:
        raise FormatError(f"{d}: holds step {step}, but ELASTIC_RESUME_STEP is {expected}")
    _apply(tensors, rest, model, optimizer, d)
    extra = dict(rest.get("extra") or {})
    for k, v in tensors.items():
        if k.startswith("extra/"):
            extra[k[len("extra/"):]] = v
    return step, extra


# The restore metadata versions this client reads (``metadata.json`` has no version field yet;
# a future one must say so).
_RESTORED_VERSIONS = (1,)


def _read_json(path):
    """The JSON in metadata file ``path``: a regular file, read up to METADATA_BYTES_MAX bytes
    (a corrupt or hostile file must not exhaust memory)."""
    try:
        # Non-blocking: a FIFO in its place must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise FormatError(f"{path}: missing") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path}: not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(METADATA_BYTES_MAX + 1)
    finally:
        os.close(fd)
    if len(data) > METADATA_BYTES_MAX:
        raise FormatError(f"{path}: over the limit of {METADATA_BYTES_MAX} bytes")
    return _parse_json(data, path)


def _read_object(path):
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: {_describe(obj)} is not a JSON object")
    return obj


def _check_state(rest, where, parent):
    """The fields of the replicated JSON state ``rest`` that :func:`load` reads; ``parent``: its
    place in file ``where``."""
    _get(where, rest, "extra", dict, {}, parent)
    for idx, st in _get(where, rest, "optim_state", dict, {}, parent).items():
        if not _is_index_text(idx):
            raise FormatError(f"{where}: {parent}optim_state has key {_describe(idx)}, not a parameter index")
        if not isinstance(st, dict):
            raise FormatError(f"{where}: {parent}optim_state[{idx!r}] is {_describe(st)}, not an object")
    for i, group in enumerate(_get(where, rest, "optim_param_groups", list, [], parent)):
        at = f"{parent}optim_param_groups[{i}]"
        if not isinstance(group, dict):
            raise FormatError(f"{where}: {at} is {_describe(group)}, not an object")
        for p in _get(where, group, "params", list, parent=at + "."):
            if not _is_int(p) or p < 0:
                raise FormatError(f"{where}: {at}.params holds {_describe(p)}, not a parameter index")


def _read_tensors(path, check=None):
    """Every tensor in safetensors file ``path``; ``check(header_metadata, keys)`` first."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise FormatError(f"{path}: missing")
    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            if check is not None:
                check(f.metadata() or {}, keys)
            return {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:
        raise FormatError(f"{path}: not a safetensors file: {e}") from None


def _is_restore_dir(d):
    if os.path.isfile(os.path.join(d, "restored.json")):
        return True
    for name in os.listdir(d):
        if name.startswith("rank-") and os.path.isfile(os.path.join(d, name, _RESTORED)):
            return True
    return False


def _read_restored(d):
    path = os.path.join(d, _RESTORED_META)
    meta = _read_object(path)
    version = meta.get("format_version", 1)
    if not _is_int(version) or version not in _RESTORED_VERSIONS:
        raise FormatError(
            f"{path}: unknown restore format version {_describe(version)} (this client reads {_RESTORED_VERSIONS})"
        )
    step = _get_int(path, meta, "step", 0, STEP_MAX)
    world = _get_int(path, meta, "world_size", 1, WORLD_SIZE_MAX, None)
    r = _get_int(path, meta, "rank", 0, (world or WORLD_SIZE_MAX) - 1, None)
    md = _get(path, meta, "metadata", dict, {})
    rest = _get(path, md, "state", dict, {}, "metadata.")
    _check_state(rest, path, "metadata.state.")

    def check(header, keys):
        saved_step = header.get("elastic.step")
        if saved_step is not None and saved_step != str(step):
            raise FormatError(f"{d}: {_RESTORED} holds step {saved_step[:40]}, {_RESTORED_META} says step {step}")
        # Sharded rows depend on the rank and world they were cut for; replicated tensors
        # serve any rank (the agent links one restore for all of its ranks).
        if header.get("elastic.shards"):
            for key, have, want in (("rank", r, rank()), ("world_size", world, world_size())):
                if have != want:
                    raise FormatError(f"{path}: sharded state restored for {key} {have!r}, this worker has {want}")

    return step, _read_tensors(os.path.join(d, _RESTORED), check), rest


def _read_staged(d):
    metas = {}
    for name in os.listdir(d):
        if not (name.startswith("rank-") and os.path.isdir(os.path.join(d, name))):
            continue
        path = os.path.join(d, name, _META)
        m = _read_object(path)
        version = m.get("format_version")
        if not _is_int(version) or version != FORMAT_VERSION:
            raise FormatError(f"{d}/{name}: unknown snapshot format {_describe(version)}")
        world = _get_int(path, m, "world_size", 1, WORLD_SIZE_MAX)
        r = _get_int(path, m, "rank", 0, world - 1)
        _get_int(path, m, "step", 0, STEP_MAX)
        if name != f"rank-{r}":
            raise FormatError(f"{path}: rank {r} in directory {name}")
        keys = _get(path, m, "keys", list)
        for k in keys:
            if not isinstance(k, str):
                raise FormatError(f"{path}: keys holds {_describe(k)}, not a string")
        if len(set(keys)) != len(keys):
            raise FormatError(f"{path}: keys names a tensor twice")
        metas[r] = (name, m)
    if not metas:
        raise FormatError(f"{d}: no rank-* snapshot directories")
    # Ranks are distinct and each below its world size: as many as one world size, and they
    # are all of that world.
    worlds = {m["world_size"] for _, m in metas.values()}
    steps = {m["step"] for _, m in metas.values()}
    if len(worlds) != 1 or len(metas) != min(worlds) or len(steps) != 1:
        raise FormatError(
            f"{d}: incomplete or mixed snapshot: ranks {sorted(metas)} of world {sorted(worlds)}, steps {sorted(steps)}"
        )
    step = steps.pop()
    rest = _get(os.path.join(d, metas[0][0], _META), metas[0][1], "state", dict, {})
    _check_state(rest, os.path.join(d, metas[0][0], _META), "state.")
    tensors = {}
    for r, (name, m) in metas.items():
        path = os.path.join(d, name, _TENSORS)

        def check(header, keys, name=name, m=m):
            if set(keys) != set(m["keys"]):
                raise FormatError(f"{d}/{name}: tensors do not match {_META}")

        for k, t in _read_tensors(path, check).items():
            if k in tensors:
                raise FormatError(f"{d}: tensor {k!r} stored twice")
            tensors[k] = t
    return step, tensors, rest


def _apply(tensors, rest, model, optimizer, where):
    if model is not None:
        target = _unwrap(model)
        sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        target.load_state_dict(sd)
    if optimizer is not None:
        state = {}
        for idx, st in (rest.get("optim_state") or {}).items():
            state.setdefault(int(idx), {}).update(st)
        for k, v in tensors.items():
            if k.startswith("optim/state/"):
                parts = k.split("/", 3)
                if len(parts) != 4 or not _is_index_text(parts[2]) or not parts[3]:
                    raise FormatError(f"{where}: tensor {_describe(k)} is not optim/state/<index>/<name>")
                state.setdefault(int(parts[2]), {})[parts[3]] = v
        optimizer.load_state_dict({"state": state, "param_groups": rest.get("optim_param_groups") or []})


def _main(argv):
    # `python -m elastic_run env`: print what this worker sees (debugging aid).
    if argv[1:] == ["env"]:
        keys = sorted(k for k in os.environ if k.startswith(("ELASTIC_", "TORCHELASTIC_")) or k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"))
        print(json.dumps({k: os.environ[k] for k in keys}, sort_keys=True))
        return 0
    print("usage: python -m elastic_run env", file=sys.stderr)
    return 2
