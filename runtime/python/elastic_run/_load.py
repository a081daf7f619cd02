"""Loading a committed step: the agent's restore layout or a staged snapshot (both in
:mod:`elastic_run.protocol`), every file checked before use, into a model and optimizer at
any world size."""

import os
import stat

from . import _tree, protocol
from ._env import rank, resume_step, world_size
from ._save import _state_form, _unwrap
from .protocol import (
    _META,
    _RESTORED,
    _RESTORED_MARKER,
    _RESTORED_META,
    _RESTORED_VERSIONS,
    _TENSORS,
    FormatError,
    _describe,
    _get,
    _get_int,
    _is_index_text,
    _is_int,
    _parse_json,
)


def load(state=None, optimizer=None, resume_dir=None, *, model=None, strict=True):
    """Loads the committed step the agent resumes from (``$ELASTIC_RESUME_DIR``), whatever world
    size saved it.

    ``load(state)`` fills the mapping ``state`` in place, as :func:`save` took it: Stateful
    entries through ``load_state_dict``, plain values set in the mapping. It returns the step
    loaded, or None when there is nothing to resume from (``state`` is then left as it is).
    Every entry of the checkpoint must be in ``state`` and the reverse, and modules load with
    ``strict=True``: ``strict=False`` allows entries (and module keys) on either side alone.
    A tensor of another shape or dtype than its target's, or a checkpoint saved in the other
    form, raises :class:`StateError` naming the entry; nothing is loaded then.

    The older form ``load(model=, optimizer=)`` loads a checkpoint saved by ``save(step,
    model=, optimizer=, extra=)`` and returns ``(step, extra)``, or None.

    Two layouts are read: what the agent restores from the checkpoint store
    (``DIR/rank-$RANK/state.safetensors`` with every tensor this rank needs, and
    ``DIR/rank-$RANK/metadata.json``), and a staged snapshot (``DIR/rank-*/tensors.safetensors``
    and ``meta.json``, every rank's share). Without ``resume_dir``, the step read must be
    ``$ELASTIC_RESUME_STEP`` when that is set. Raises :class:`FormatError` (a ``ValueError``)
    on malformed metadata or tensor files, an unknown format version, a step that does not
    match, or a directory that is neither layout."""
    state, model = _state_form("load", state, model, optimizer, None)
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
    if state is not None:
        if not _tree.is_skeleton(rest):
            raise _tree.StateError(f"{d}: step {step} was saved with save(step, model=, optimizer=, extra=): "
                                   "load it with load(model=, optimizer=)")
        _tree.apply(state, rest, tensors, d, strict=strict)
        return step
    if _tree.is_skeleton(rest):
        raise _tree.StateError(f"{d}: step {step} was saved from a state mapping "
                               f"({', '.join(map(repr, sorted(rest['entries'])))}): load it with load(state)")
    _apply(tensors, rest, model, optimizer, d)
    extra = dict(rest.get("extra") or {})
    for k, v in tensors.items():
        if k.startswith("extra/"):
            extra[k[len("extra/"):]] = v
    return step, extra


def _read_json(path):
    """The JSON in metadata file ``path``: a regular file, read up to METADATA_BYTES_MAX bytes
    (a corrupt or hostile file must not exhaust memory)."""
    limit = protocol.METADATA_BYTES_MAX
    try:
        # Non-blocking: a FIFO in its place must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise FormatError(f"{path}: missing") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path}: not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FormatError(f"{path}: over the limit of {limit} bytes")
    return _parse_json(data, path)


def _read_object(path):
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: {_describe(obj)} is not a JSON object")
    return obj


def _check_state(rest, where, parent):
    """The fields of the replicated JSON state ``rest`` that :func:`load` reads; ``parent``: its
    place in file ``where``. The state form's skeleton is checked as it is decoded."""
    if _tree.is_skeleton(rest):
        if not isinstance(rest["entries"], dict):
            raise FormatError(f"{where}: {parent}entries is {_describe(rest['entries'])}, not an object")
        return
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
    if os.path.isfile(os.path.join(d, _RESTORED_MARKER)):
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
    step = _get_int(path, meta, "step", 0, protocol.STEP_MAX)
    world = _get_int(path, meta, "world_size", 1, protocol.WORLD_SIZE_MAX, None)
    r = _get_int(path, meta, "rank", 0, (world or protocol.WORLD_SIZE_MAX) - 1, None)
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
        if not _is_int(version) or version != protocol.FORMAT_VERSION:
            raise FormatError(f"{d}/{name}: unknown snapshot format {_describe(version)}")
        world = _get_int(path, m, "world_size", 1, protocol.WORLD_SIZE_MAX)
        r = _get_int(path, m, "rank", 0, world - 1)
        _get_int(path, m, "step", 0, protocol.STEP_MAX)
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
