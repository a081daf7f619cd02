"""Loading a committed step: the agent's restore layout or a staged snapshot (both in
:mod:`elastic_run.protocol`), every file checked before use, into a model and optimizer at
any world size."""

import os
import stat

from . import _read, _tree, protocol
from ._env import heal_step, rank, resume_step, world_size
from ._save import _state_form, _unwrap, wait
from .protocol import (
    _META,
    _RESTORED,
    _RESTORED_MARKER,
    _RESTORED_META,
    _RESTORED_SOURCES,
    _RESTORED_SOURCES_VERSIONS,
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
    ``DIR/rank-$RANK/metadata.json``; restored without copies, ``elastic-run
    --restore-no-copy``, ``sources.json`` in place of the tensor file: its bytes are read
    from the store's chunks, each only while it is the file the agent checked), and a staged
    snapshot (``DIR/rank-*/tensors.safetensors``
    and ``meta.json``, every rank's share). Sharded state (FSDP2's DTensors, saved as each
    rank's rows) loads into the DTensors ``state`` holds at any world size: a restore holds this
    rank's rows, and a staged snapshot's shards are put together and cut here; rows cut for
    another rank or world are a :class:`FormatError` or :class:`StateError` naming the tensor.
    Without ``resume_dir``, the step read must be
    ``$ELASTIC_RESUME_STEP`` when that is set. A worker whose node joined the generation without
    restoring its step (``$ELASTIC_HEAL_STEP``: live peers hold it, which
    :class:`elastic_run.InPlace` takes from them) has the agent restore it first. Raises :class:`FormatError` (a ``ValueError``)
    on malformed metadata or tensor files, an unknown format version, a step that does not
    match, or a directory that is neither layout. A pending :func:`async_save` is finished
    first (and its error, if any, raised here): the load writes into the tensors it reads."""
    state, model = _state_form("load", state, model, optimizer, None)
    # The load writes into the tensors a pending async_save may still be reading.
    wait()
    from_env = resume_dir is None
    d = resume_dir or os.environ.get("ELASTIC_RESUME_DIR")
    if not d and from_env and heal_step() is not None:
        # The node joined without restoring the step (its peers hold it): the agent restores
        # it now.
        from ._connection import restore

        _, d = restore(heal_step())
    if not d or not os.path.isdir(d):
        return None
    mine = os.path.join(d, f"rank-{rank()}")
    shards = {}
    if _has_restored(mine):
        into = _into(state, model, optimizer, strict, shards, d)
        step, tensors, rest = _read_restored(mine, shards=shards, into=into)
    elif _is_restore_dir(d):
        raise FormatError(f"{d}: restored for other ranks: no {_RESTORED} for rank {rank()}")
    else:
        step, tensors, rest = _read_staged(d, shards=shards)
    expected = resume_step() if from_env else None
    if expected is not None and step != expected:
        raise FormatError(f"{d}: holds step {step}, but ELASTIC_RESUME_STEP is {expected}")
    if state is not None:
        if not _tree.is_skeleton(rest):
            raise _tree.StateError(f"{d}: step {step} was saved with save(step, model=, optimizer=, extra=): "
                                   "load it with load(model=, optimizer=)")
        _tree.apply(state, rest, tensors, d, strict=strict, shards=shards)
        return step
    if shards:
        raise _tree.StateError(f"{d}: step {step} holds sharded tensors ({_describe(sorted(shards))}), which "
                               "only load(state) puts into their DTensors")
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
    with _read.TensorFile(path) as f:
        if check is not None:
            check(f.metadata, list(f.entries))
        return f.read()


def _into(state, model, optimizer, strict, shards, where):
    """What :func:`load` reads straight into the state's own tensors (the ``into`` of
    :func:`_read_restored`): the tensors of every module that the checkpoint fills exactly, so
    that the bytes go from the restored file into the model in one copy. The state form is
    first checked in full against tensors without data (``apply``'s dry run), so a checkpoint
    that does not fit loads nothing; ``shards`` holds the file's shard declarations by then.
    The optimizer's own state tensors are read into too where it holds them already (an
    optimizer that has stepped: :func:`_tree.state_destinations`), in the model form only when
    the model qualifies; other optimizer state of CUDA parameters is named with the device to
    create it on (:func:`_tree.device_hints`)."""

    def state_form(rest, entries):
        _tree.apply(state, rest, _meta_tensors(entries), where, strict=strict, shards=shards, dry_run=True)
        out = _tree.destinations(state, rest, entries, shards)
        out.update(_tree.optimizer_destinations(state, rest, entries, out, shards))
        return {**_tree.device_hints(state, rest, entries), **out}

    def model_form(rest, entries):
        if model is None or shards:
            return None
        current = _unwrap(model).state_dict()
        names = {k[len("model/"):] for k in entries if k.startswith("model/")}
        if names != set(current):
            return None
        out = {f"model/{k}": t for k, t in current.items()}
        if not all(_read.fits(t, entries[k]) for k, t in out.items()):
            return None
        param_of = _tree.saved_params(optimizer, rest.get("optim_param_groups")) if optimizer is not None else None
        if param_of is not None:
            items = []
            for k in entries:
                at = _optim_state_key(k)
                if at:  # malformed names are not read into here; _apply raises on them
                    items.append((*at, k))
            out.update(_tree.state_destinations(optimizer, param_of, items, entries, out))
        return out

    def plan(rest, entries):
        if state is not None:
            return state_form(rest, entries) if _tree.is_skeleton(rest) else None
        return None if _tree.is_skeleton(rest) else model_form(rest, entries)

    return plan


def _read_shards(path, header, tensors):
    """The shard declarations of tensor file ``path`` (its header's ``elastic.shards``), each
    checked against the tensor it names: ``{name: {"global_shape": [...], "dim0_offset": n}}``."""
    text = header.get(protocol._SHARDS_KEY)
    if text is None:
        return {}
    where = f"{path}: {protocol._SHARDS_KEY}"
    declared = _parse_json(text.encode(), where)
    if not isinstance(declared, dict):
        raise FormatError(f"{where} is {_describe(declared)}, not an object")
    out = {}
    for name, spec in declared.items():
        at = f"{where}[{name!r}]"
        t = tensors.get(name)
        if t is None:
            raise FormatError(f"{at}: names a tensor the file does not hold")
        if not (isinstance(spec, dict) and set(spec) == {"global_shape", "dim0_offset"}):
            raise FormatError(f"{at} is {_describe(spec)}, not {{'global_shape': [...], 'dim0_offset': n}}")
        shape, lo = spec["global_shape"], spec["dim0_offset"]
        if not (isinstance(shape, list) and shape and all(_is_int(n) and n >= 0 for n in shape)):
            raise FormatError(f"{at}: global_shape {_describe(shape)} is not the shape of a tensor of 1 or more dims")
        if not _is_int(lo) or lo < 0:
            raise FormatError(f"{at}: dim0_offset {_describe(lo)} is not a row number")
        if list(t.shape[1:]) != shape[1:] or t.dim() != len(shape) or lo + t.shape[0] > shape[0]:
            raise FormatError(f"{at}: a tensor of shape {list(t.shape)} is not rows of {shape} from row {lo}")
        out[name] = {"global_shape": shape, "dim0_offset": lo}
    return out


def _has_restored(d):
    """Whether ``d`` holds a restored rank's tensors: its tensor file, or where the file's
    bytes lie in the store's chunks (a restore without copies)."""
    return os.path.isfile(os.path.join(d, _RESTORED)) or os.path.isfile(os.path.join(d, _RESTORED_SOURCES))


def _is_restore_dir(d):
    if os.path.isfile(os.path.join(d, _RESTORED_MARKER)):
        return True
    for name in os.listdir(d):
        if name.startswith("rank-") and _has_restored(os.path.join(d, name)):
            return True
    return False


def _open_restored(d):
    """The tensor file of restored rank directory ``d``: ``state.safetensors``, or, when the
    agent restored without copies, the file it would have been, read from the store's chunks
    that ``sources.json`` names (:class:`_read.SourcedFile`: each read only while it is the
    chunk the agent checked)."""
    tensors_path = os.path.join(d, _RESTORED)
    path = os.path.join(d, _RESTORED_SOURCES)
    if os.path.lexists(tensors_path) or not os.path.lexists(path):
        return _read.TensorFile(tensors_path)
    doc = _read_object(path)
    version = doc.get("version")
    if version not in _RESTORED_SOURCES_VERSIONS or not _is_int(version):
        raise FormatError(f"{path}: unknown version {_describe(version)} (this client reads "
                          f"{', '.join(map(str, _RESTORED_SOURCES_VERSIONS))})")
    store = _get(path, doc, "store", str)
    header = _get(path, doc, "header", str)
    size = _get_int(path, doc, "bytes", 0, 2**63 - 1)
    if doc.get("name") != _RESTORED:
        raise FormatError(f"{path}: names {_describe(doc.get('name'))}, not {_RESTORED}")
    root = _get(path, doc, "root", str)
    if not os.path.isabs(root) or "\0" in root:
        raise FormatError(f"{path}: root {_describe(root)} is not an absolute path")
    root = _read.normal_path(root)
    try:
        f = _read.SourcedFile(tensors_path, header.encode(), size)
    except UnicodeEncodeError as e:
        raise FormatError(f"{path}: the header is not UTF-8 ({e.reason} at {e.start})") from None
    try:
        for i, src in enumerate(_get(path, doc, "sources", list)):
            where = f"{path}: sources[{i}]"
            if not isinstance(src, dict):
                raise FormatError(f"{where} is {_describe(src)}, not an object")
            f.add(_read.chunk_path(root, store, src.get("path"), where), src.get("dev"), src.get("ino"),
                  src.get("bytes"), src.get("ctime_ns"), src.get("ranges"))
    except BaseException:
        f.close()
        raise
    return f


def _read_restored(d, shards=None, into=None):
    """``(step, tensors, rest)`` of a restored rank directory; ``shards``, a dict, receives the
    declarations of the tensors that are this rank's rows of a sharded tensor. ``into(rest,
    entries)``, once the file's header and declarations are checked, may name tensors to read
    some of the file straight into (name -> tensor, see :meth:`_read.TensorFile.read`)."""
    path = os.path.join(d, _RESTORED_META)
    step, r, world, rest = _restored_meta(_read_object(path), path)
    with _open_restored(d) as f:
        found = _check_restored(f, d, path, step, r, world)
        if shards is not None:
            shards.update(found)
        tensors = f.read(into(rest, f.entries) if into is not None else None)
    return step, tensors, rest


def _restored_meta(meta, path):
    """``(step, rank, world_size, rest)`` of a restore's ``metadata.json`` object ``meta``
    (read from ``path``, or named so), each field checked."""
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
    return step, r, world, rest


def _check_restored(f, d, path, step, r, world):
    """Checks the open restored tensor file ``f`` of directory ``d`` against its metadata
    (``path``: its step, rank ``r`` and ``world``), and returns its shard declarations, each
    checked to be this worker's rows."""
    header_of = dict(f.metadata)
    saved_step = header_of.get("elastic.step")
    if saved_step is not None and saved_step != str(step):
        raise FormatError(f"{d}: {_RESTORED} holds step {saved_step[:40]}, {_RESTORED_META} says step {step}")
    found = _read_shards(f.path, header_of, _meta_tensors(f.entries))
    _check_rows(d, path, f.path, r, world, header_of, found, f.entries)
    return found


def _meta_tensors(entries):
    """A tensor without data (``meta``) of each entry's shape and dtype."""
    import torch

    return {k: torch.empty(e.shape, dtype=e.torch_dtype(), device="meta") for k, e in entries.items()}


def _check_rows(d, path, tensors_path, r, world, header_of, found, entries):
    """The sharded tensors ``found`` in a restored rank directory are this worker's rows."""
    if found:
        # Sharded rows depend on the rank and world they were cut for (the tensor file's header
        # says which); replicated tensors serve any rank (the agent links one restore for all
        # of its ranks, each with its own metadata.json).
        named = _describe(sorted(found))
        for key, have in (("rank", r), ("world_size", world),
                          ("rank", header_of.get("elastic.rank")), ("world_size", header_of.get("elastic.world_size"))):
            want = rank() if key == "rank" else world_size()
            if have is not None and str(have) != str(want):
                raise FormatError(f"{path}: sharded state (tensors {named}) restored for {key} {str(have)[:40]}, "
                                  f"this worker has {want}")
        for name, spec in sorted(found.items()):
            lo, hi = protocol.rows_for_rank(spec["global_shape"][0], rank(), world_size())
            have = (spec["dim0_offset"], spec["dim0_offset"] + entries[name].shape[0])
            if have != (lo, hi):
                raise FormatError(f"{tensors_path}: tensor {name!r} holds rows [{have[0]}, {have[1]}) of "
                                  f"{spec['global_shape'][0]}, rank {rank()} of {world_size()} holds [{lo}, {hi})")


def _read_staged(d, shards=None):
    """``(step, tensors, rest)`` of a staged snapshot (every rank's share): replicated tensors
    whole, sharded ones assembled from every rank's shard and cut to this rank's rows, which
    ``shards`` (a dict) receives the declarations of."""
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
    # Sharded tensor name -> [(dim0_offset, global_shape, the shard)] from every rank.
    pieces = {}
    for r, (name, m) in metas.items():
        path = os.path.join(d, name, _TENSORS)
        header_of = {}

        def check(header, keys, name=name, m=m, header_of=header_of):
            if set(keys) != set(m["keys"]):
                raise FormatError(f"{d}/{name}: tensors do not match {_META}")
            header_of.update(header)

        with _read.TensorFile(path) as f:
            check(f.metadata, list(f.entries))
            found = _read_shards(path, header_of, _meta_tensors(f.entries))
            # Shards are cut to this rank's rows, copied, below: as views of the file, only
            # those rows are read, and nothing of the file outlives this load.
            got = f.read(views=set(found))
        for k, t in got.items():
            if k in tensors or (k in pieces and k not in found):
                raise FormatError(f"{d}: tensor {k!r} stored twice")
            if k in found:
                pieces.setdefault(k, []).append((found[k]["dim0_offset"], found[k]["global_shape"], t))
            else:
                tensors[k] = t
    for k, parts in pieces.items():
        if k in tensors:
            raise FormatError(f"{d}: tensor {k!r} stored twice")
        tensors[k], spec = _rows_of(d, k, parts, rank(), world_size())
        if shards is not None:
            shards[k] = spec
    return step, tensors, rest


def _rows_of(d, name, parts, rank_, world):
    """The rows ``rank_`` of ``world`` holds of sharded tensor ``name``, cut from every rank's
    shard of it (``parts``: ``(dim0_offset, global_shape, shard)``), which must tile dim 0.
    Returns the rows and their shard declaration."""
    import torch

    shapes = {tuple(g) for _, g, _ in parts}
    dtypes = {t.dtype for _, _, t in parts}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise FormatError(f"{d}: the shards of tensor {name!r} disagree: global shapes {sorted(shapes)}, "
                          f"dtypes {sorted(map(str, dtypes))}")
    shape = list(shapes.pop())
    parts = sorted(parts, key=lambda p: (p[0], p[2].shape[0]))
    row = 0
    for lo, _, t in parts:
        if lo != row:
            raise FormatError(f"{d}: the shards of tensor {name!r} do not tile dim 0: a shard at row {lo}, "
                              f"expected row {row}")
        row += t.shape[0]
    if row != shape[0]:
        raise FormatError(f"{d}: the shards of tensor {name!r} cover {row} rows of {shape[0]}")
    lo, hi = protocol.rows_for_rank(shape[0], rank_, world)
    mine = [t[max(lo, at) - at:min(hi, at + t.shape[0]) - at] for at, _, t in parts
            if max(lo, at) < min(hi, at + t.shape[0])]
    rows = torch.cat(mine) if mine else torch.empty((0, *shape[1:]), dtype=dtypes.pop())
    return rows, {"global_shape": shape, "dim0_offset": lo}


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
            at = _optim_state_key(k)
            if at is False:
                raise FormatError(f"{where}: tensor {_describe(k)} is not optim/state/<index>/<name>")
            if at is not None:
                state.setdefault(at[0], {})[at[1]] = v
        optimizer.load_state_dict({"state": state, "param_groups": rest.get("optim_param_groups") or []})


def _optim_state_key(key):
    """``(parameter index, state name)`` of tensor name ``optim/state/<index>/<name>`` of the
    model form; None for a name outside ``optim/state/``, False for one inside it that is
    malformed."""
    if not key.startswith("optim/state/"):
        return None
    parts = key.split("/", 3)
    if len(parts) != 4 or not _is_index_text(parts[2]) or not parts[3]:
        return False
    return int(parts[2]), parts[3]
