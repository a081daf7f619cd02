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
reads every rank's share, so a checkpoint can be loaded at any world size.

torch is optional: the environment helpers work without it.
"""

import json
import os
import shutil
import socket
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

_TENSORS = "tensors.safetensors"
_META = "meta.json"
# What the agent restores from the checkpoint store (the checkpoint crate's restore layout).
_RESTORED = "state.safetensors"
_RESTORED_META = "metadata.json"


def _env_int(name, default=None):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None


def _env_float(name, default=None):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None


def rank():
    return _env_int("RANK", 0)


def local_rank():
    return _env_int("LOCAL_RANK", 0)


def world_size():
    return _env_int("WORLD_SIZE", 1)


def local_world_size():
    return _env_int("LOCAL_WORLD_SIZE", 1)


def generation():
    return _env_int("ELASTIC_GENERATION", 0)


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
    return _env_int("ELASTIC_RESUME_STEP", None)


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

    def request(self, obj, timeout_s=None):
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
                return self._read_reply()
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

    def _read_reply(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("agent closed the connection")
            self.buf += chunk
            if len(self.buf) > MESSAGE_BYTES_MAX:
                raise AgentError("reply from agent too long")
        line, _, self.buf = self.buf.partition(b"\n")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise AgentError(f"malformed reply {line!r}")
        if reply.get("type") == "error":
            raise AgentError(reply.get("message", "agent error"))
        return reply

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
        reply = conn.request({"type": "query"})
        stop = 1 if reply.get("should_stop") else 0
        at = reply.get("should_checkpoint_at")
        ckpt = int(at) + 1 if isinstance(at, int) and at >= 0 else 0
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
    if world < 1:
        raise ValueError("world size must be at least 1")
    load_bytes = [0] * world
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(world), key=lambda i: (load_bytes[i], i))
        out[key] = r
        load_bytes[r] += sizes[key]
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
        # The JSON state as text now: later changes to the objects it came from do not reach
        # the snapshot, and what is not JSON fails here, in the caller.
        self.rest_json = json.dumps(rest)


def _snapshot(staging, step, model, optimizer, extra, copy_unguarded):
    step, r, w = int(step), rank(), world_size()
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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


def _write_snapshot(snap, conn):
    """Writes ``snap`` under a temporary name, fsyncs, renames it into place, and tells the
    agent (``conn``; None outside elastic-run). Returns the directory."""
    step, r = snap.step, snap.rank
    step_dir = os.path.join(snap.staging, f"step-{step}")
    final = os.path.join(step_dir, f"rank-{r}")
    tmp = os.path.join(step_dir, f".rank-{r}.tmp-{os.getpid()}")
    os.makedirs(step_dir, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "rank": r,
        "world_size": snap.world,
        "keys": sorted(snap.tensors),
        # Every rank records the (replicated) JSON state, so any node's agent can commit.
        "state": json.loads(snap.rest_json),
    }
    _write_safetensors(os.path.join(tmp, _TENSORS), snap.tensors, {"step": str(step), "rank": str(r)})
    mpath = os.path.join(tmp, _META)
    with open(mpath, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
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
    written. A pending :func:`async_save` is finished first.

    Outside elastic-run (plain ``torchrun`` or ``python``, no ``$ELASTIC_STAGING_DIR``) there
    is no agent to commit a snapshot: it warns once and returns None, so one script runs under
    both launchers.
    """
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
    ``$ELASTIC_RESUME_STEP`` when that is set. Raises ``ValueError`` on an unknown format
    version, a step that does not match, or a directory that is neither layout."""
    from_env = resume_dir is None
    d = resume_dir or os.environ.get("ELASTIC_RESUME_DIR")
    if not d or not os.path.isdir(d):
        return None
    mine = os.path.join(d, f"rank-{rank()}")
    if os.path.isfile(os.path.join(mine, _RESTORED)):
        step, tensors, rest = _read_restored(mine)
    elif _is_restore_dir(d):
        raise ValueError(f"{d}: restored for other ranks: no {_RESTORED} for rank {rank()}")
    else:
        step, tensors, rest = _read_staged(d)
    expected = resume_step() if from_env else None
    if expected is not None and step != expected:
        raise ValueError(f"{d}: holds step {step}, but ELASTIC_RESUME_STEP is {expected}")
    _apply(tensors, rest, model, optimizer)
    extra = dict(rest.get("extra", {}))
    for k, v in tensors.items():
        if k.startswith("extra/"):
            extra[k[len("extra/"):]] = v
    return step, extra


# The restore metadata versions this client reads (``metadata.json`` has no version field yet;
# a future one must say so).
_RESTORED_VERSIONS = (1,)
# Largest metadata.json / meta.json read: a corrupt file must not exhaust memory.
_META_BYTES_MAX = 16 * 1024 * 1024


def _read_json(path):
    size = os.path.getsize(path)
    if size > _META_BYTES_MAX:
        raise ValueError(f"{path}: {size} bytes, over the limit of {_META_BYTES_MAX}")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None


def _is_restore_dir(d):
    if os.path.isfile(os.path.join(d, "restored.json")):
        return True
    for name in os.listdir(d):
        if name.startswith("rank-") and os.path.isfile(os.path.join(d, name, _RESTORED)):
            return True
    return False


def _read_restored(d):
    from safetensors import safe_open

    path = os.path.join(d, _RESTORED_META)
    meta = _read_json(path)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    version = meta.get("format_version", 1)
    if version not in _RESTORED_VERSIONS:
        raise ValueError(f"{path}: unknown restore format version {version!r} (this client reads {_RESTORED_VERSIONS})")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{path}: no step")
    md = meta.get("metadata")
    md = {} if md is None else md
    if not isinstance(md, dict):
        raise ValueError(f"{path}: metadata is not an object")
    rest = md.get("state")
    rest = {} if rest is None else rest
    if not isinstance(rest, dict):
        raise ValueError(f"{path}: metadata.state is not an object")
    tensors = {}
    with safe_open(os.path.join(d, _RESTORED), framework="pt") as f:
        header = f.metadata() or {}
        saved_step = header.get("elastic.step")
        if saved_step is not None and saved_step != str(step):
            raise ValueError(f"{d}: {_RESTORED} holds step {saved_step}, {_RESTORED_META} says step {step}")
        # Sharded rows depend on the rank and world they were cut for; replicated tensors
        # serve any rank (the agent links one restore for all of its ranks).
        if header.get("elastic.shards"):
            for key, want in (("rank", rank()), ("world_size", world_size())):
                if meta.get(key) != want:
                    raise ValueError(f"{path}: sharded state restored for {key} {meta.get(key)!r}, this worker has {want}")
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    return step, tensors, rest


def _read_staged(d):
    from safetensors import safe_open

    metas = {}
    for name in os.listdir(d):
        if name.startswith("rank-") and os.path.isdir(os.path.join(d, name)):
            m = _read_json(os.path.join(d, name, _META))
            if not isinstance(m, dict):
                raise ValueError(f"{d}/{name}/{_META}: not a JSON object")
            if m.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"{d}/{name}: unknown snapshot format {m.get('format_version')!r}")
            if not isinstance(m.get("rank"), int) or not isinstance(m.get("step"), int):
                raise ValueError(f"{d}/{name}/{_META}: no rank or step")
            metas[m["rank"]] = (name, m)
    if not metas:
        raise ValueError(f"{d}: no rank-* snapshot directories")
    saved_world = metas[min(metas)][1]["world_size"]
    steps = {m["step"] for _, m in metas.values()}
    if sorted(metas) != list(range(saved_world)) or len(steps) != 1:
        raise ValueError(
            f"{d}: incomplete or mixed snapshot: ranks {sorted(metas)} of world {saved_world}, steps {sorted(steps)}"
        )
    step = steps.pop()
    tensors = {}
    for r, (name, m) in metas.items():
        with safe_open(os.path.join(d, name, _TENSORS), framework="pt") as f:
            keys = set(f.keys())
            if keys != set(m["keys"]):
                raise ValueError(f"{d}/{name}: tensors do not match meta.json")
            for k in keys:
                if k in tensors:
                    raise ValueError(f"{d}: tensor {k!r} stored twice")
                tensors[k] = f.get_tensor(k)
    rest = metas[0][1].get("state", {})
    return step, tensors, rest


def _apply(tensors, rest, model, optimizer):
    if model is not None:
        target = _unwrap(model)
        sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        target.load_state_dict(sd)
    if optimizer is not None:
        state = {}
        for idx, st in rest.get("optim_state", {}).items():
            state.setdefault(int(idx), {}).update(st)
        for k, v in tensors.items():
            if k.startswith("optim/state/"):
                _, _, idx, name = k.split("/", 3)
                state.setdefault(int(idx), {})[name] = v
        optimizer.load_state_dict({"state": state, "param_groups": rest.get("optim_param_groups", [])})


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
