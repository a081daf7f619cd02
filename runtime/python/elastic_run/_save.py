"""Snapshots: this rank's share of the state written into ``$ELASTIC_STAGING_DIR`` as
safetensors plus ``meta.json`` (the layout in :mod:`elastic_run.protocol`), under a temporary
name, fsynced and renamed, then handed to the agent. :func:`save` blocks; :func:`async_save`
writes from a thread."""

import errno
import heapq
import json
import os
import shutil
import threading
import warnings

from collections.abc import Mapping

from . import _connection, _state, _tree, protocol
from ._connection import AgentError, _Agent, _agent_conn
from ._env import rank, world_size
from .protocol import (
    _META,
    _TENSORS,
    FormatError,
    _check_step,
    _describe,
    _is_int,
    _json_too_deep,
    _msg_saved,
    _msg_skipped,
)

# Modes of what `save` creates, set explicitly: the umask is not relied on.
_DIR_MODE = 0o700
_FILE_MODE = 0o600


def assign_keys(sizes, world):
    """Splits tensors between ``world`` ranks by bytes: largest first, each to the rank with the
    fewest bytes so far (ties to the lower rank). Deterministic, so every rank computes the same
    split from the same replicated state. Returns ``{key: rank}``."""
    if not _is_int(world) or not 1 <= world <= protocol.WORLD_SIZE_MAX:
        raise ValueError(f"world size must be an integer in [1, {protocol.WORLD_SIZE_MAX}], not {_describe(world)}")
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


_unwrap = _tree.unwrap


def _state_form(caller, state, model, optimizer, extra):
    """``(state, model)`` of a call ``caller(step, state, ...)``: ``state`` a mapping (the state
    form), or None with ``model`` what the legacy form passed, by keyword or in the place of
    ``state``. The two forms do not mix."""
    if state is None or not isinstance(state, Mapping):
        if state is not None and model is not None:
            raise TypeError(f"elastic_run.{caller}: the model is given twice")
        return None, model if state is None else state
    if model is not None or optimizer is not None or extra is not None:
        raise TypeError(f"elastic_run.{caller}: pass the state as one mapping, or model=, optimizer= and "
                        "extra=, not both")
    return state, None


_is_tensor = _tree.is_tensor


def _flatten(model, optimizer, extra):
    """Tensors by key, and the JSON-able rest."""
    tensors, rest = {}, {}
    if model is not None:
        for k, v in _unwrap(model).state_dict().items():
            if _tree.is_dtensor(v):
                raise TypeError(f"elastic_run: model {k!r} is a DTensor: save sharded (FSDP2) state in the state "
                                "mapping form, save(step, {'model': model, 'opt': opt, ...})")
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
    staging = os.environ.get("ELASTIC_STAGING_DIR")
    if not staging and not _state.warned_no_staging:
        _state.warned_no_staging = True
        warnings.warn(
            f"elastic_run.{caller}: ELASTIC_STAGING_DIR is not set (not under elastic-run); "
            "checkpoints are not written",
            RuntimeWarning,
            stacklevel=3,
        )
    return staging or None


def _storage_key(t):
    if _tree.is_dtensor(t):
        # What a snapshot writes of a DTensor is its local tensor.
        t = t.to_local()
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

    def __init__(self, staging, step, rank_, world, tensors, rest, shards=None):
        self.staging, self.step, self.rank, self.world = staging, step, rank_, world
        self.tensors = tensors
        # The shard declarations of the tensors that are this rank's rows of a sharded one.
        self.shards = shards or {}
        # meta.json as bytes now: later changes to the objects the JSON state came from do not
        # reach the snapshot, and what is not JSON, or what load could not read back (too big,
        # too deep), fails here, in the caller.
        try:
            text = json.dumps({
                "format_version": protocol.FORMAT_VERSION,
                "step": step,
                "rank": rank_,
                "world_size": world,
                "keys": sorted(tensors),
                # Every rank records the (replicated) JSON state, so any node's agent can commit.
                "state": rest,
            }, allow_nan=False)
        except ValueError as e:
            # NaN or infinity in extra=: no JSON reader (the agent's included) takes it.
            raise ValueError(f"elastic_run: the JSON state cannot be written: {e} (the state mapping "
                             "form saves them)") from None
        # The restore's metadata.json holds the state one level deeper than meta.json.
        if _json_too_deep(text, protocol.JSON_DEPTH_MAX - 1):
            raise ValueError(f"the JSON state is nested deeper than {protocol.JSON_DEPTH_MAX - 2} levels")
        self.meta_json = text.encode()
        if len(self.meta_json) > protocol.METADATA_BYTES_MAX:
            raise ValueError(
                f"{_META} would be {len(self.meta_json)} bytes, over the limit of {protocol.METADATA_BYTES_MAX}")


def _snapshot(staging, step, model, optimizer, extra, copy_unguarded, state=None):
    r, w = rank(), world_size()
    if r >= w:
        raise FormatError(f"RANK={r} is not below WORLD_SIZE={w}")
    shards = {}
    if state is not None:
        tensors, rest, shards = _tree.encode(state)
        opts = _tree.optimizers(state)
    else:
        tensors, rest = _flatten(model, optimizer, extra)
        opts = [optimizer]
    if shards:
        import torch.distributed as dist

        # Shards are cut by the process group's ranks, and restored by RANK of WORLD_SIZE.
        if (dist.get_rank(), dist.get_world_size()) != (r, w):
            raise FormatError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, but "
                              f"RANK={r} and WORLD_SIZE={w}: sharded state cannot be saved")
    # Replicated tensors are split between the ranks by bytes; each rank writes its own shards.
    owner = assign_keys({k: v.numel() * v.element_size() for k, v in tensors.items() if k not in shards}, w)
    guarded = set().union(*(_guarded_storages(o) for o in opts)) if copy_unguarded else set()
    mine = {}
    for k, v in tensors.items():
        if k not in shards and owner[k] != r:
            continue
        t = v.detach()
        if copy_unguarded and _storage_key(t) not in guarded:
            # Buffers (BatchNorm statistics change in forward), extra tensors, and parameters
            # without an optimizer to guard them: copied now.
            t = t.to("cpu", copy=True)
        # Tensors sharing memory (tied weights) need nothing special: the writer writes each
        # key's bytes on their own.
        mine[k] = t
    return _Snapshot(staging, step, r, w, mine, rest, shards)


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
    every tensor's bytes in name order. CUDA tensors go through pinned buffers
    (:class:`_HostStager`), other device tensors are copied to the host one at a time.
    ``os.write`` releases the GIL, so a writer thread lets training go on meanwhile."""
    import struct

    names = sorted(tensors)
    if names:
        # Only torch makes tensors: a state of JSON values alone is written without it.
        import torch
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
    stager = None
    try:
        _write_all(fd, struct.pack("<Q", len(h)) + h)
        for n in names:
            t = tensors[n]
            if t.numel() == 0:
                continue
            if t.device.type == "cuda" and t.is_contiguous():
                stager = stager if stager is not None and stager.device == t.device else _HostStager(t.device)
                stager.write(fd, t)
                continue
            if t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            _write_all(fd, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)


# Writing device tensors: two pinned host buffers of at most this many bytes each; one is
# written to the file while the next piece is copied into the other.
_PINNED_BUFFER_BYTES = 32 << 20


class _HostStager:
    """Copies CUDA tensors to the file through two pinned host buffers, on a stream of its own
    that starts after the work queued on the current stream (which made the tensors): the
    copy of a tensor's next piece runs while the piece before it is written."""

    def __init__(self, device):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.buffers = []
        self.events = [torch.cuda.Event(), torch.cuda.Event()]

    def write(self, fd, t):
        import torch

        flat = t.detach().reshape(-1).view(torch.uint8)
        total, done, turn, pending = flat.numel(), 0, 0, None
        while done < total or pending is not None:
            piece = None
            if done < total:
                n = min(_PINNED_BUFFER_BYTES, total - done)
                i = turn % 2
                turn += 1
                if i == len(self.buffers):
                    self.buffers.append(torch.empty(_PINNED_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True))
                with torch.cuda.stream(self.stream):
                    self.buffers[i][:n].copy_(flat[done:done + n], non_blocking=True)
                    self.events[i].record(self.stream)
                piece = (i, n)
                done += n
            if pending is not None:
                j, m = pending
                self.events[j].synchronize()
                _write_all(fd, memoryview(self.buffers[j][:m].numpy()))
            pending = piece


def _write_all(fd, buf):
    mv = memoryview(buf)
    while mv:
        n = os.write(fd, mv[:_WRITE_BYTES_MAX])
        mv = mv[n:]


# A full staging file system (or quota): the snapshot is skipped, never the training.
_STAGING_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


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
                conn.request(_msg_skipped(snap.rank, snap.step, why), timeout_s=_connection.SAVED_TIMEOUT_S)
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
    header = {"step": str(step), "rank": str(r)}
    if snap.shards:
        # The agent reads these when it uploads the file: the manifest records each shard's
        # rows, and a restore cuts every rank's own rows from them.
        header[protocol._SHARDS_KEY] = json.dumps(snap.shards, separators=(",", ":"), sort_keys=True)
    _write_safetensors(os.path.join(tmp, _TENSORS), snap.tensors, header)
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
        last = _state.stop_step is not None and step >= _state.stop_step
        conn.request(_msg_saved(r, step, final, last), timeout_s=_connection.SAVED_TIMEOUT_S)
    return final


def save(step, state=None, optimizer=None, extra=None, *, model=None):
    """Writes this rank's share of the state for ``step`` into staging, then tells the agent.

    ``state`` maps names to objects: Stateful ones (``state_dict()``/``load_state_dict()``:
    modules, optimizers, LR schedulers, GradScaler, StatefulDataLoader, your own classes) and
    nested values (dicts, lists and tuples of tensors, numpy arrays, numbers, strings...), for
    example ``save(step, {"model": model, "opt": opt, "sched": sched, "rng": rngs})``. Tensors
    go into safetensors, the rest into JSON; nothing is pickled (see :mod:`elastic_run._tree`).
    The older form ``save(step, model=, optimizer=, extra=)`` (``extra`` a dict of JSON values
    and tensors) works as before.

    Every rank must call this at the same step with the same replicated state: each entry is
    taken to be equal on every rank (data-parallel state), and one copy of it is kept, its
    tensors split between the ranks by bytes. State that differs by rank (an RNG seeded by rank,
    a loader over a ``DistributedSampler``'s slice) is not kept per rank; :class:`ElasticSampler`
    gives every rank the same stream state. Sharded state is the exception: a DTensor placed
    ``Shard(0)`` on a 1-D mesh of every rank (FSDP2's ``fully_shard`` parameters and their
    optimizer state) is written by each rank as its own rows, with their place in the global
    tensor, and a restore at any world size gives each rank its new rows. Returns the directory
    written, or None when the staging file system is full: that checkpoint is then skipped
    with a warning giving the sizes, and training goes on. A pending :func:`async_save` is finished first.

    Outside elastic-run (plain ``torchrun`` or ``python``, no ``$ELASTIC_STAGING_DIR``) there
    is no agent to commit a snapshot: it warns once and returns None, so one script runs under
    both launchers.

    ``step`` is an integer in [0, ``STEP_MAX``] (else :class:`FormatError`).
    """
    step = _check_step(step, "save")
    state, model = _state_form("save", state, model, optimizer, extra)
    wait()
    staging = _staging_dir("save")
    if staging is None:
        return None
    # Nothing runs until the write ends: every tensor is written from its own memory.
    snap = _snapshot(staging, step, model, optimizer, extra, copy_unguarded=False, state=state)
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


def wait():
    """Waits for the pending :func:`async_save`, if any, and raises its error. Returns the
    directory it wrote, or None."""
    with _state.pending_lock:
        p = _state.pending
    if p is None:
        return None
    try:
        return p.wait()
    finally:
        with _state.pending_lock:
            if _state.pending is p:
                _state.pending = None


def _step_pre_hook(optimizer, args, kwargs):
    # optimizer.step() changes the parameters and the optimizer state in place: the pending
    # snapshot must be written first.
    wait()


def async_save(step, state=None, optimizer=None, extra=None, *, model=None):
    """Like :func:`save`, but returns as soon as the state is captured; a thread writes it into
    staging and tells the agent. Returns a :class:`PendingSave` (None outside elastic-run).

    What stays consistent: the parameters and the optimizer state are written from their own
    memory, so ``optimizer.step()`` of every optimizer passed here (``optimizer=``, or the
    optimizers among the state's entries) waits for the write first (a step pre-hook), as do
    the next ``save``/``async_save`` and :func:`wait`. The JSON state (schedulers, scalers, data
    loaders...) is captured at the call. Buffers
    (BatchNorm statistics change in forward), ``extra`` tensors, and the parameters when no
    optimizer is given are copied before this returns. Code that changes parameters in place
    other than through ``optimizer.step()`` must call :func:`wait` before it does. The write's
    error, if any, is raised at that next wait. One save is in flight at a time."""
    step = _check_step(step, "async_save")
    state, model = _state_form("async_save", state, model, optimizer, extra)
    wait()
    staging = _staging_dir("async_save")
    if staging is None:
        return None
    for opt in _tree.optimizers(state) if state is not None else [optimizer]:
        if opt is not None and not getattr(opt, "_elastic_run_hooked", False):
            opt.register_step_pre_hook(_step_pre_hook)
            opt._elastic_run_hooked = True
    snap = _snapshot(staging, step, model, optimizer, extra, copy_unguarded=True, state=state)
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

    with _state.pending_lock:
        _state.pending = pending
    # Not a daemon: an interpreter that exits still finishes the write.
    threading.Thread(target=write, name=f"elastic_run-save-{snap.step}").start()
    return pending
