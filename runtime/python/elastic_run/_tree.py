"""Training state of any shape: a mapping of names to objects, turned into tensors (written as
safetensors) and a JSON skeleton (written into ``meta.json``), and back.

An object is either *Stateful* (it has ``state_dict()`` and ``load_state_dict()``: modules,
optimizers, LR schedulers, ``GradScaler``, torchdata's ``StatefulDataLoader``, user classes),
or a nested value: dicts, lists, tuples, tensors, numpy arrays and scalars, ``bytes``,
``torch.dtype``, ``torch.device``, numbers, strings and ``None``. Nothing is pickled, and
loading never runs code from a checkpoint: the skeleton is plain JSON whose tagged objects
name one of the kinds above.

The skeleton of ``{"model": m, "rng": [torch.get_rng_state()]}`` (meta.json's ``state``)::

    {"format": "elastic_run.state/1",
     "entries": {"model": {"stateful": true,
                           "value": {"0.weight": {"$t": "state/model/0.weight"}, ...}},
                 "rng": {"stateful": false, "value": [{"$t": "state/rng/0"}]}}}

Values are JSON as they are, except for the tagged objects, each a one-key object whose key
starts with ``$``:

    {"$t": K}            a tensor, stored as tensor K       {"$tuple": [...]}   a tuple
    {"$nd": K}           a numpy array, stored as tensor K  {"$items": [[k, v]...]}  a dict with
    {"$np": [dtype, v]}  a numpy scalar                                          keys not all str
    {"$f": "nan"}        nan, inf or -inf                   {"$dict": {...}}    a dict with a str
    {"$int": "digits"}   an int beyond 2**53 - 1                                 key starting "$"
    {"$bytes": base64}   bytes                              {"$dtype": "float32"}, {"$device": "cpu"}

A DTensor on a 1-D device mesh (FSDP2's ``fully_shard`` parameters and their optimizer
state) is stored as this rank's local shard under its usual name: with ``Shard(0)`` its rows
``[lo, hi)`` of the global tensor are declared in the tensor file's ``elastic.shards``
metadata (see :func:`encode`), and a restore to any world size gives each rank its own rows;
with ``Replicate()`` it is a plain tensor. Loading wraps the rows back into a DTensor like the
one the target holds at that place.

Tensor names are ``state/<entry>/<path>``: a module's tensors are ``state/model/<its
state_dict() name>``. Path parts are dict keys and list indices; a str key is written with
``%``, ``/``, ``\\``, control characters and a leading ``~`` percent-escaped (and ``""``,
``"."``, ``".."`` as ``%``, ``%2E``, ``%2E%2E``), another key as ``~`` and its JSON. So names
are distinct, and valid names for the checkpoint store.
"""

import base64
import binascii
import json
import math
import re
import unicodedata
from collections.abc import Mapping, MutableMapping

from . import protocol
from .protocol import FormatError, _describe

STATE_FORMAT = "elastic_run.state/1"
_PREFIX = "state/"
# What an entry of the state may be called: a tensor name's first part, a word of letters,
# digits, "_", "." and "-" (not starting with "." or "-"), at most 128 characters.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# Ints beyond this are written as text: every JSON reader holds these exactly.
_SAFE_INT_MAX = 2**53 - 1
# The longest tensor name (the checkpoint store's limit).
_KEY_BYTES_MAX = 1024
# numpy scalar dtypes a checkpoint may name.
_NP_SCALARS = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64")
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class StateError(ValueError):
    """The state passed to ``load`` and the checkpoint do not fit: an entry one has and the
    other lacks (unless ``strict=False``), a tensor of another shape or dtype, or a Stateful
    object where the checkpoint holds a plain value (or the reverse). The message names the
    entry and the place in it."""


def is_tensor(v):
    try:
        import torch
    except ImportError:
        return False
    return isinstance(v, torch.Tensor)


def is_dtensor(v):
    """Whether ``v`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters are)."""
    if type(v).__name__ != "DTensor":  # cheap, and no torch.distributed import for the rest
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(v, DTensor)


def _placements(t):
    """A DTensor's placements and mesh, for messages: ``[Shard(dim=0)] on a 1-D mesh``."""
    return f"placements {list(t.placements)} on a {t.device_mesh.ndim}-D device mesh"


def _fsdp_layout(t):
    """``"shard"`` for a DTensor on a 1-D mesh placed ``Shard(0)``, ``"replicate"`` for one
    placed ``Replicate()``, else None (2-D meshes, ``Shard(d)`` with ``d != 0``, ``Partial``,
    strided shards): the layouts a checkpoint can hold at any world size."""
    from torch.distributed.tensor import Replicate, Shard

    if t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return None
    p = t.placements[0]
    if type(p) is Shard and p.dim == 0:
        return "shard"
    if type(p) is Replicate:
        return "replicate"
    return None


def is_stateful(obj):
    """Whether ``obj`` saves through ``state_dict()`` and loads through ``load_state_dict()``."""
    return (not isinstance(obj, (Mapping, type)) and not is_tensor(obj)
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def unwrap(obj):
    """The module inside DistributedDataParallel and DataParallel (their ``.module``), so that
    tensor names are the model's own; anything else as it is."""
    inner = getattr(obj, "module", None)
    if inner is not None and type(obj).__name__ in ("DistributedDataParallel", "DataParallel"):
        return inner
    return obj


def check_name(name):
    """``name`` as an entry of the state, or ValueError naming it."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"elastic_run: state name {_describe(name)} is not a valid key: use 1 to 128 letters, "
            "digits, '_', '.' or '-', not starting with '.' or '-'")
    return name


def _escape(part):
    if part == "":
        return "%"
    if part in (".", ".."):
        return part.replace(".", "%2E")
    out = []
    for i, c in enumerate(part):
        if c in "%/\\" or (i == 0 and c == "~") or unicodedata.category(c) == "Cc":
            out.append("".join(f"%{b:02X}" for b in c.encode()))
        else:
            out.append(c)
    return "".join(out)


def _is_numpy(v):
    return type(v).__module__ == "numpy"


def _plain_key(k):
    """Whether ``k`` can be a dict key in a checkpoint: a scalar or a tuple of them."""
    if k is None or isinstance(k, (bool, int, float, str)):
        return True
    return isinstance(k, tuple) and all(_plain_key(x) for x in k)


class _Encoder:
    def __init__(self):
        self.tensors = {}
        # Tensor name -> {"global_shape", "dim0_offset"} of the DTensor shards among them.
        self.shards = {}

    def entry(self, name, obj):
        check_name(name)
        stateful = is_stateful(obj)
        value = unwrap(obj).state_dict() if stateful else obj
        where = f"state[{name!r}]"
        if stateful and not isinstance(value, Mapping):
            raise TypeError(f"elastic_run: {where}: state_dict() of {type(obj).__name__} returned "
                            f"{type(value).__name__}, not a dict")
        return {"stateful": stateful, "value": self.enc(value, _PREFIX + name, where, 0)}

    def enc(self, v, key, where, depth):
        if depth > protocol.JSON_DEPTH_MAX:
            raise ValueError(f"elastic_run: {where}: nested deeper than {protocol.JSON_DEPTH_MAX} levels")
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            v = int(v)
            if abs(v) <= _SAFE_INT_MAX:
                return v
            try:
                return {"$int": str(v)}
            except ValueError:  # more digits than Python converts
                raise ValueError(f"elastic_run: {where}: an int of {v.bit_length()} bits cannot be saved") from None
        if isinstance(v, float):
            v = float(v)
            if math.isfinite(v):
                return v
            return {"$f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, str):
            self._utf8(v, where)
            return v
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode()}
        if is_tensor(v):
            return {"$t": self._tensor(v, key, where)}
        if _is_numpy(v):
            return self._numpy(v, key, where)
        import torch

        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, Mapping):
            return self._mapping(v, key, where, depth)
        if isinstance(v, (list, tuple)):
            items = [self.enc(x, f"{key}/{i}", f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
            return items if isinstance(v, list) else {"$tuple": items}
        raise TypeError(
            f"elastic_run: {where}: a {type(v).__module__}.{type(v).__qualname__} cannot be saved: a state "
            "entry is a Stateful object (state_dict/load_state_dict) or a value made of tensors, numpy "
            "arrays, numbers, strings, bytes, None, dtypes, devices, and lists, tuples and dicts of them "
            "(nothing is pickled)")

    def _mapping(self, v, key, where, depth):
        if all(isinstance(k, str) for k in v):
            out = {}
            for k, x in v.items():
                self._utf8(k, f"{where} key {_describe(k)}")
                out[k] = self.enc(x, f"{key}/{_escape(k)}", f"{where}[{k!r}]", depth + 1)
            return {"$dict": out} if any(k.startswith("$") for k in v) else out
        items = []
        for k, x in v.items():
            if not _plain_key(k):
                raise TypeError(f"elastic_run: {where}: the dict key {_describe(k)} cannot be saved: keys "
                                "are strings, numbers, None, or tuples of them")
            ek = self.enc(k, key, f"{where} key {_describe(k)}", depth + 1)
            part = _escape(k) if isinstance(k, str) else "~" + _escape(_json(ek))
            items.append([ek, self.enc(x, f"{key}/{part}", f"{where}[{k!r}]", depth + 2)])
        return {"$items": items}

    def _utf8(self, s, where):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"elastic_run: {where}: the string is not valid Unicode ({e.reason})") from None

    def _tensor(self, t, key, where):
        shard = None
        if is_dtensor(t):
            t, shard = self._local(t, where)
        elif not type(t).__module__.startswith("torch"):
            raise TypeError(f"elastic_run: {where}: a {type(t).__name__} cannot be saved: only torch tensors "
                            "and DTensors")
        import torch

        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"elastic_run: {where}: a {t.layout} tensor on {t.device} cannot be saved: only "
                            "dense tensors with data")
        if len(key.encode()) > _KEY_BYTES_MAX:
            raise ValueError(f"elastic_run: {where}: its tensor name is over {_KEY_BYTES_MAX} bytes")
        if key in self.tensors:  # not reachable by the naming scheme; a guard against a change
            raise ValueError(f"elastic_run: {where}: tensor name {key!r} is used twice")
        self.tensors[key] = t
        if shard is not None:
            self.shards[key] = shard
        return key

    def _local(self, t, where):
        """A DTensor as ``(its local tensor, its shard declaration or None)``."""
        layout = _fsdp_layout(t)
        if layout is None:
            raise TypeError(
                f"elastic_run: {where}: a DTensor with {_placements(t)} cannot be saved: checkpoints hold "
                "DTensors on a 1-D mesh placed Shard(0) (FSDP2's fully_shard) or Replicate(); call "
                ".full_tensor() on it, or redistribute it to one of these")
        local = t.to_local()
        if layout == "replicate":
            return local, None
        import torch.distributed as dist

        mesh = t.device_mesh
        world = dist.get_world_size()
        ranks = mesh.mesh.flatten().tolist()
        if ranks != list(range(world)):
            # A restore cuts rows by rank of the whole world: a mesh over other ranks (or in
            # another order) would be handed rows that are not its own.
            raise TypeError(f"elastic_run: {where}: a DTensor sharded over the ranks {_describe(ranks)} cannot "
                            f"be saved: its mesh must hold every rank of the world of {world}, in rank order")
        rows = t.shape[0]
        lo, hi = protocol.rows_for_rank(rows, mesh.get_local_rank(), world)
        if tuple(local.shape) != (hi - lo, *t.shape[1:]):
            raise TypeError(f"elastic_run: {where}: the local shard of a DTensor of shape {list(t.shape)} has "
                            f"shape {list(local.shape)}, not rows [{lo}, {hi}) as Shard(0) cuts it")
        return local.contiguous(), {"global_shape": list(t.shape), "dim0_offset": lo}

    def _numpy(self, v, key, where):
        import numpy as np
        import torch

        if isinstance(v, np.ndarray):
            if v.dtype.name not in _NP_SCALARS:
                raise TypeError(f"elastic_run: {where}: a numpy array of {v.dtype} cannot be saved")
            return {"$nd": self._tensor(torch.from_numpy(np.ascontiguousarray(v)), key, where)}
        if isinstance(v, np.generic) and v.dtype.name in _NP_SCALARS:
            return {"$np": [v.dtype.name, self.enc(v.item(), key, where, 0)]}
        raise TypeError(f"elastic_run: {where}: a numpy {type(v).__name__} cannot be saved")


def _json(v):
    return json.dumps(v, separators=(",", ":"), allow_nan=False)


def encode(state):
    """``state`` (a mapping of names to objects) as ``(tensors, skeleton, shards)``: tensors by
    name, the JSON-able skeleton, and the shard declarations of the tensors that are this
    rank's rows of a ``Shard(0)`` DTensor, ``{name: {"global_shape": [...], "dim0_offset":
    lo}}`` (the others are whole). Raises TypeError or ValueError naming the entry and the
    place of what cannot be saved."""
    if not isinstance(state, Mapping):
        raise TypeError(f"elastic_run: the state is a {type(state).__name__}, not a mapping of names to objects")
    e = _Encoder()
    entries = {name: e.entry(name, obj) for name, obj in state.items()}
    return e.tensors, {"format": STATE_FORMAT, "entries": entries}, e.shards


def _is_optimizer(obj):
    try:
        import torch
    except ImportError:
        return False
    return isinstance(obj, torch.optim.Optimizer)


def optimizers(state):
    """The optimizers among the state's entries."""
    return [o for o in state.values() if _is_optimizer(o)]


def is_skeleton(rest):
    """Whether the JSON state ``rest`` of a checkpoint was written from a state mapping."""
    return isinstance(rest, dict) and "entries" in rest


class _Decoder:
    """Decodes a skeleton read from a checkpoint (``where`` names the file): every tag and type
    checked, FormatError otherwise. ``dry``: the tensors hold no data yet (``meta`` tensors),
    so numpy arrays stay tensors."""

    def __init__(self, tensors, where, dry=False):
        self.tensors, self.where, self.dry = tensors, where, dry

    def fail(self, at, what):
        raise FormatError(f"{self.where}: {at}: {what}")

    def dec(self, v, at):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.dec(x, f"{at}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict):
            self.fail(at, f"{_describe(v)} is not JSON")
        tags = [k for k in v if k.startswith("$")]
        if not tags:
            return {k: self.dec(x, f"{at}[{k!r}]") for k, x in v.items()}
        if len(v) != 1:
            self.fail(at, f"an object with the key {_describe(tags[0])} and others is not a tagged value")
        tag, x = next(iter(v.items()))
        if tag == "$t":
            return self.tensor(x, at)
        if tag == "$nd":
            t = self.tensor(x, at)
            if str(t.dtype).removeprefix("torch.") not in _NP_SCALARS:
                self.fail(at, f"a numpy array stored as a {t.dtype} tensor")
            return t if self.dry else t.numpy()
        if tag == "$tuple":
            if not isinstance(x, list):
                self.fail(at, f"$tuple holds {_describe(x)}, not an array")
            return tuple(self.dec(y, f"{at}[{i}]") for i, y in enumerate(x))
        if tag == "$dict":
            if not isinstance(x, dict):
                self.fail(at, f"$dict holds {_describe(x)}, not an object")
            return {k: self.dec(y, f"{at}[{k!r}]") for k, y in x.items()}
        if tag == "$items":
            return self.items(x, at)
        if tag == "$f":
            if x not in _FLOATS:
                self.fail(at, f"$f holds {_describe(x)}, not nan, inf or -inf")
            return _FLOATS[x]
        if tag == "$int":
            if not isinstance(x, str) or not re.fullmatch(r"-?[0-9]{1,4300}", x):
                self.fail(at, f"$int holds {_describe(x)}, not the digits of an integer")
            return int(x)
        if tag == "$bytes":
            try:
                return base64.b64decode(x, validate=True)
            except (binascii.Error, TypeError, ValueError):
                self.fail(at, f"$bytes holds {_describe(x)}, not base64")
        if tag == "$np":
            if not (isinstance(x, list) and len(x) == 2 and x[0] in _NP_SCALARS):
                self.fail(at, f"$np holds {_describe(x)}, not [numpy dtype, value]")
            import numpy as np

            val = self.dec(x[1], at)
            try:
                return np.dtype(x[0]).type(val)
            except (TypeError, ValueError, OverflowError):
                self.fail(at, f"{_describe(val)} is not a numpy {x[0]}")
        if tag == "$dtype":
            import torch

            dt = getattr(torch, x, None) if isinstance(x, str) and x.isidentifier() else None
            if not isinstance(dt, torch.dtype):
                self.fail(at, f"$dtype holds {_describe(x)}, not a torch dtype")
            return dt
        if tag == "$device":
            import torch

            try:
                if not isinstance(x, str) or len(x) > 64:
                    raise ValueError
                return torch.device(x)
            except (RuntimeError, ValueError, TypeError):
                self.fail(at, f"$device holds {_describe(x)}, not a torch device")
        self.fail(at, f"unknown tag {_describe(tag)}")

    def tensor(self, key, at):
        if not isinstance(key, str):
            self.fail(at, f"{_describe(key)} is not a tensor name")
        t = self.tensors.get(key)
        if t is None:
            self.fail(at, f"refers to the tensor {key!r}, which the checkpoint does not hold")
        return t

    def items(self, x, at):
        if not isinstance(x, list):
            self.fail(at, f"$items holds {_describe(x)}, not an array")
        out = {}
        for i, pair in enumerate(x):
            if not (isinstance(pair, list) and len(pair) == 2):
                self.fail(f"{at}[{i}]", f"{_describe(pair)} is not a [key, value] pair")
            k = self.dec(pair[0], f"{at} key {i}")
            if not _plain_key(k):
                self.fail(f"{at} key {i}", f"{_describe(k)} cannot be a dict key")
            if k in out:
                self.fail(f"{at} key {i}", f"the key {_describe(k)} is given twice")
            out[k] = self.dec(pair[1], f"{at}[{k!r}]")
        return out


def _is_module(target):
    import torch

    return isinstance(unwrap(target), torch.nn.Module)


def _check_keys(saved, current, at, where):
    """A module's saved ``state_dict()`` names the keys its own has, as ``load_state_dict``
    with ``strict=True`` requires: checked before anything is loaded."""
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks the keys {_describe(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"holds the keys {_describe(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}, "
                         "which the module does not have")
        raise StateError(f"{where}: {at}: the checkpoint's state_dict() {' and '.join(parts)} "
                         "(load(..., strict=False) allows it)")


def _check_fits(saved, current, at, where):
    """Every tensor of ``saved`` that ``current`` (the target's own state_dict()) has at the
    same place has its shape and dtype."""
    if is_tensor(saved) and is_tensor(current):
        if saved.dtype != current.dtype or saved.shape != current.shape:
            raise StateError(
                f"{where}: {at}: the checkpoint holds a {str(saved.dtype).removeprefix('torch.')} tensor of "
                f"shape {list(saved.shape)}, the state has {str(current.dtype).removeprefix('torch.')} "
                f"{list(current.shape)}")
    elif isinstance(saved, Mapping) and isinstance(current, Mapping):
        for k, v in saved.items():
            if k in current:
                _check_fits(v, current[k], f"{at}[{k!r}]", where)
    elif isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)):
        for i, (v, c) in enumerate(zip(saved, current)):
            _check_fits(v, c, f"{at}[{i}]", where)


class _Fit:
    """Puts the checkpoint's tensors into the shape of the target's DTensors: where the target
    holds a DTensor, the tensor read is this rank's rows of it (a sharded tensor, ``shards``
    says which rows) or the whole of it, and becomes a DTensor of the target's mesh and
    placements. A sharded tensor with no DTensor to go into must be whole (a world of one)."""

    def __init__(self, tensors, shards, where):
        # Decoded values hold the very tensor objects read, so identity finds their names.
        self.names = {id(t): k for k, t in tensors.items()}
        self.shards, self.where = shards or {}, where

    def fail(self, at, what):
        raise StateError(f"{self.where}: {at}: {what}")

    def spec(self, t):
        return self.shards.get(self.names.get(id(t)))

    def walk(self, saved, current, at):
        """``saved`` with every tensor fitted to what ``current`` (the target's value, or None)
        holds at its place."""
        if is_tensor(saved):
            return self.tensor(saved, current, at)
        if isinstance(saved, dict):
            cur = current if isinstance(current, Mapping) else {}
            return {k: self.walk(v, cur.get(k), f"{at}[{k!r}]") for k, v in saved.items()}
        if isinstance(saved, (list, tuple)):
            cur = list(current) if isinstance(current, (list, tuple)) else []
            out = [self.walk(v, cur[i] if i < len(cur) else None, f"{at}[{i}]") for i, v in enumerate(saved)]
            return out if isinstance(saved, list) else tuple(out)
        return saved

    def tensor(self, saved, current, at):
        spec = self.spec(saved)
        if is_dtensor(current):
            return self.dtensor(saved, spec, current, at)
        if spec is not None and not (spec["dim0_offset"] == 0 and saved.shape[0] == spec["global_shape"][0]):
            self.fail(at, f"the checkpoint holds rows [{spec['dim0_offset']}, {spec['dim0_offset'] + saved.shape[0]}) "
                          f"of a tensor of shape {spec['global_shape']} sharded along dim 0, and the state has "
                          f"{_what(current)} there: load it into the model sharded as it was saved (fully_shard), "
                          "whose DTensors take this rank's rows")
        return saved

    def dtensor(self, saved, spec, like, at):
        """``saved`` as a DTensor like ``like``: its rows for this rank, checked."""
        from torch.distributed.tensor import DTensor

        layout = _fsdp_layout(like)
        if layout is None:
            self.fail(at, f"the state holds a DTensor with {_placements(like)}: checkpoints load into DTensors on "
                          "a 1-D mesh placed Shard(0) (FSDP2's fully_shard) or Replicate()")
        glob = list(like.shape)
        if spec is not None and spec["global_shape"] != glob:
            self.fail(at, f"the checkpoint holds a shard of a tensor of shape {spec['global_shape']}, the state's "
                          f"DTensor has shape {glob}")
        if layout == "replicate":
            lo, hi = 0, glob[0] if glob else 0
        else:
            mesh = like.device_mesh
            lo, hi = protocol.rows_for_rank(glob[0], mesh.get_local_rank(), mesh.size())
            if tuple(like.to_local().shape) != (hi - lo, *glob[1:]):
                self.fail(at, f"the state's DTensor of shape {glob} holds a local shard of shape "
                              f"{list(like.to_local().shape)}, not rows [{lo}, {hi}) as Shard(0) cuts it")
        if spec is None:
            # Whole (saved unsharded: by DDP, or as Replicate()): this rank's rows of it.
            if list(saved.shape) != glob:
                self.fail(at, f"the checkpoint holds a tensor of shape {list(saved.shape)}, the state's DTensor "
                              f"has shape {glob}")
            local = saved if layout == "replicate" else saved[lo:hi]
        else:
            have = (spec["dim0_offset"], spec["dim0_offset"] + saved.shape[0])
            if have != (lo, hi):
                self.fail(at, f"the checkpoint holds rows [{have[0]}, {have[1]}) of this tensor of {glob[0]} rows, "
                              f"this rank's DTensor holds rows [{lo}, {hi}): it was restored for another rank or "
                              "world size")
            local = saved
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())

    def optimizer(self, value, opt, at):
        """An optimizer's saved state_dict() with the state of DTensor parameters as DTensors.
        A fresh optimizer holds no state to compare with: each state tensor takes the mesh and
        placements of its parameter (``state`` is keyed by the parameters' positions in
        ``param_groups`` order)."""
        state = value.get("state")
        if not isinstance(state, dict):
            return self.walk(value, None, at)
        params = [p for g in opt.param_groups for p in g["params"]]
        out = {}
        for idx, st in state.items():
            a = f"{at}['state'][{idx!r}]"
            p = params[idx] if isinstance(idx, int) and not isinstance(idx, bool) and 0 <= idx < len(params) else None
            if not (isinstance(st, dict) and is_dtensor(p)):
                out[idx] = self.walk(st, None, a)
                continue
            out[idx] = {}
            for k, v in st.items():
                # A tensor saved as rows, or of the parameter's shape (exp_avg, momentum...),
                # goes with the parameter; scalars (Adam's step) stay as they are.
                with_param = is_tensor(v) and v.dim() > 0 and (
                    self.spec(v) is not None or list(v.shape) == list(p.shape))
                out[idx][k] = (self.dtensor(v, self.spec(v), p, f"{a}[{k!r}]") if with_param
                               else self.walk(v, None, f"{a}[{k!r}]"))
        rest = {k: self.walk(v, None, f"{at}[{k!r}]") for k, v in value.items() if k != "state"}
        return {**rest, "state": out}


def _what(v):
    if v is None:
        return "nothing"
    if is_tensor(v):
        return f"a plain tensor of shape {list(v.shape)}"
    return f"a {type(v).__name__}"


def apply(state, skeleton, tensors, where, strict=True, shards=None, dry_run=False):
    """Fills ``state`` in place from a checkpoint's skeleton and tensors: Stateful entries
    through ``load_state_dict``, plain values set in the mapping. Everything is decoded and
    checked before anything is loaded. ``where`` names the checkpoint in errors. ``dry_run``
    decodes and checks against ``tensors`` that hold no data yet (``meta`` tensors of the
    checkpoint's shapes and dtypes) and loads nothing: whatever it raises, the load would.

    ``shards`` declares which tensors are this rank's rows of a tensor sharded along dim 0
    (``{name: {"global_shape": [...], "dim0_offset": lo}}``, as the tensor file's
    ``elastic.shards`` says): each goes into the DTensor the target holds at its place, whose
    own rows they must be."""
    if not isinstance(state, Mapping):
        raise TypeError(f"elastic_run: the state is a {type(state).__name__}, not a mapping of names to objects")
    fmt = skeleton.get("format")
    if fmt != STATE_FORMAT:
        raise FormatError(f"{where}: unknown state format {_describe(fmt)} (this client reads {STATE_FORMAT})")
    entries = skeleton.get("entries")
    if not isinstance(entries, dict):
        raise FormatError(f"{where}: state entries are {_describe(entries)}, not an object")
    unknown = sorted(set(entries) - set(state))
    missing = sorted(set(state) - set(entries))
    if strict and (unknown or missing):
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(map(repr, missing))}, which the state asks for")
        if unknown:
            parts.append(f"holds {', '.join(map(repr, unknown))}, which the state does not name")
        raise StateError(f"{where}: the checkpoint {' and '.join(parts)} (load(..., strict=False) allows it)")
    d = _Decoder(tensors, where, dry=dry_run)
    fit = _Fit(tensors, shards, where)
    plan = []
    for name in sorted(set(entries) & set(state)):
        e = entries[name]
        at = f"state[{name!r}]"
        if not (isinstance(e, dict) and isinstance(e.get("stateful"), bool) and "value" in e):
            raise FormatError(f"{where}: {at} is {_describe(e)}, not {{'stateful': bool, 'value': ...}}")
        value = d.dec(e["value"], at)
        target = state[name]
        if e["stateful"]:
            if not is_stateful(target):
                raise StateError(f"{where}: {at} was saved from a Stateful object's state_dict(); the state "
                                 f"holds a {type(target).__name__}, which has no load_state_dict()")
            if not isinstance(value, dict):
                raise FormatError(f"{where}: {at} holds {_describe(value)}, not a state_dict()")
            current = unwrap(target).state_dict()
            if _is_optimizer(target):
                value = fit.optimizer(value, target, at)
            else:
                value = fit.walk(value, current, at)
            if strict and _is_module(target):
                _check_keys(value, current, at, where)
            _check_fits(value, current, at, where)
        elif is_stateful(target):
            raise StateError(f"{where}: {at} was saved as a plain value; the state holds a "
                             f"{type(target).__name__}, a Stateful object")
        else:
            value = fit.walk(value, target, at)
        plan.append((name, e["stateful"], value))
    if any(not stateful for _, stateful, _ in plan) and not isinstance(state, MutableMapping):
        raise TypeError("elastic_run: load sets plain values in the state: pass a dict")
    if dry_run:
        return
    for name, stateful, value in plan:
        if not stateful:
            state[name] = value
            continue
        target = unwrap(state[name])
        try:
            import torch

            if isinstance(target, torch.nn.Module):
                target.load_state_dict(value, strict=strict)
            else:
                target.load_state_dict(value)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise StateError(f"{where}: state[{name!r}]: {type(target).__name__}.load_state_dict refused "
                             f"the checkpoint's state: {e}") from e


def destinations(state, skeleton, entries, shards=None):
    """Where tensors of a checkpoint can be read straight into the state: for each module of
    ``state`` whose saved ``state_dict()`` names exactly the module's own keys, each as a
    tensor, the module's own tensors (a DTensor's local shard when the checkpoint holds this
    rank's rows of it, or all of it for ``Replicate()``), where every one has the dtype and
    shape of its tensor in the checkpoint (``entries``: name -> :class:`_read.Entry`).
    Returns ``{tensor name: tensor}``; a module that does not qualify in full is left out, and
    its tensors are read as before and loaded through ``load_state_dict``. Call it once
    :func:`apply` has checked the checkpoint against the state (``dry_run``): loading the
    module afterwards then copies nothing."""
    import torch

    from ._read import fits

    shards = shards or {}
    out = {}
    for name, e in (skeleton.get("entries") or {}).items():
        target = unwrap(state[name]) if name in state else None
        value = e.get("value") if isinstance(e, dict) and e.get("stateful") is True else None
        if not (isinstance(target, torch.nn.Module) and isinstance(value, dict)):
            continue
        current = target.state_dict()
        if set(value) != set(current):
            continue
        mine = {}
        for k, v in value.items():
            key = v.get("$t") if isinstance(v, dict) and len(v) == 1 else None
            ent = entries.get(key) if isinstance(key, str) else None
            dest = _local_destination(current[k], shards.get(key)) if ent is not None else None
            if dest is None or not fits(dest, ent) or key in mine:
                mine = None
                break
            mine[key] = dest
        if mine:
            out.update(mine)
    return out


def _saved_optimizers(state, skeleton):
    """``(optimizer, param_of, items)`` for each optimizer of ``state`` that the checkpoint
    saved: ``param_of`` maps each saved parameter index to the optimizer's own parameter, by
    the order of its ``param_groups``, as ``load_state_dict`` pairs them (an optimizer whose
    saved groups differ from its own in number or size is left out: loading it fails);
    ``items`` is each ``(index, name, tensor name)`` of the saved per-parameter state."""
    import torch

    for name, e in (skeleton.get("entries") or {}).items():
        target = state.get(name) if isinstance(state, Mapping) else None
        value = e.get("value") if isinstance(e, dict) and e.get("stateful") is True else None
        if not (isinstance(target, torch.optim.Optimizer) and isinstance(value, dict)):
            continue
        param_of = saved_params(target, value.get("param_groups"))
        if param_of is None:
            continue
        items = value.get("state")
        items = items.get("$items") if isinstance(items, dict) else None
        found = []
        for item in items if isinstance(items, list) else ():
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
                    and isinstance(item[0], int) and not isinstance(item[0], bool)):
                continue
            for k, v in item[1].items():
                key = v.get("$t") if isinstance(v, dict) and len(v) == 1 else None
                if isinstance(key, str):
                    found.append((item[0], k, key))
        yield target, param_of, found


def saved_params(optimizer, saved_groups):
    """The optimizer's own parameter for each parameter index in ``saved_groups`` (a
    checkpoint's ``param_groups``), paired by position as ``load_state_dict`` pairs them; None
    when the groups differ from the optimizer's in number or size."""
    groups = optimizer.param_groups
    if not (isinstance(saved_groups, list) and len(saved_groups) == len(groups) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and len(g["params"]) == len(c["params"])
            for g, c in zip(saved_groups, groups))):
        return None
    param_of = {}
    for g, c in zip(saved_groups, groups):
        for i, p in zip(g["params"], c["params"]):
            if isinstance(i, int) and not isinstance(i, bool):
                param_of[i] = p
    return param_of


def device_hints(state, skeleton, entries):
    """Optimizer state to create on the device of its parameter while it is read (a CUDA
    parameter's ``exp_avg`` and the like, read through pinned buffers rather than copied
    from host memory by ``load_state_dict``): ``{tensor name: device}``. Covers the
    optimizers of ``state`` over plain tensors whose saved ``param_groups`` match their own in
    shape; each tensor has its parameter's shape and dtype. ``step`` counters stay where the
    optimizer keeps them."""
    import torch

    out = {}
    for _, param_of, items in _saved_optimizers(state, skeleton):
        for idx, k, key in items:
            p, ent = param_of.get(idx), entries.get(key)
            if (p is None or type(p) not in (torch.Tensor, torch.nn.Parameter) or p.device.type != "cuda"
                    or k == "step" or ent is None):
                continue
            if ent.shape == tuple(p.shape) and ent.torch_dtype() == p.dtype:
                out[key] = p.device
    return out


def optimizer_destinations(state, skeleton, entries, taken, shards=None):
    """The optimizer state of ``state`` that a checkpoint can be read straight into, as
    :func:`state_destinations` finds it for each optimizer the checkpoint saved."""
    out = {}
    for optimizer, param_of, items in _saved_optimizers(state, skeleton):
        # Against what earlier optimizers were given too: no two read into one tensor.
        out.update(state_destinations(optimizer, param_of, items, entries, {**taken, **out}, shards))
    return out


def state_destinations(optimizer, param_of, items, entries, taken, shards=None):
    """The tensors ``optimizer`` already holds as state that checkpoint tensors can be read
    straight into: for each ``(index, name, tensor name)`` of ``items``, the state ``name`` of
    the parameter ``param_of[index]`` where the optimizer holds it as a tensor that fits the
    entry as it is (:func:`_read.fits`). Reading into them copies the bytes once, as into a
    parameter: ``load_state_dict`` then keeps the same tensors, and nothing is allocated or
    freed. An optimizer without state yet (a fresh one) gets new tensors read from the file
    instead. With ``shards`` (the file's shard declarations: the state form), state held as a
    DTensor (FSDP2's) is read into too, into its local tensor, where that holds exactly the
    rows the checkpoint holds for this rank (:func:`_local_destination`). ``taken``
    (destinations already chosen, name -> tensor) and what this returns never share memory
    with each other or with a parameter: a tensor that does is left to be read as before."""
    from ._read import fits

    used = {_storage_of(t) for t in [*taken.values(), *param_of.values()]} - {None}
    out = {}
    for idx, k, key in items:
        p, ent = param_of.get(idx), entries.get(key)
        current = optimizer.state.get(p, {}).get(k) if p is not None else None
        if ent is None or current is None or key in out or key in taken or not is_tensor(current):
            continue
        if is_dtensor(current):
            current = _local_destination(current, shards.get(key)) if shards is not None else None
        if current is None or not ent.nbytes or not fits(current, ent):
            continue
        ptr = _storage_of(current)
        if ptr is None or ptr in used:
            continue
        used.add(ptr)
        out[key] = current
    return out


def _storage_of(t):
    """Where the memory of tensor ``t`` starts: a DTensor's is its local tensor's (None for
    anything but a tensor)."""
    import torch

    if is_dtensor(t):
        t = t.to_local()
    return t.untyped_storage().data_ptr() if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _local_destination(current, spec):
    """The tensor that holds ``current``'s own bytes as a checkpoint tensor declared ``spec``
    would give them (None when the bytes need cutting first)."""
    if not is_dtensor(current):
        return current if spec is None else None
    layout = _fsdp_layout(current)
    glob = list(current.shape)
    if layout == "replicate" and spec is None:
        return current.to_local()
    if layout == "shard" and spec is not None and glob and spec["global_shape"] == glob:
        mesh = current.device_mesh
        lo, _ = protocol.rows_for_rank(glob[0], mesh.get_local_rank(), mesh.size())
        if spec["dim0_offset"] == lo:
            return current.to_local()
    return None

