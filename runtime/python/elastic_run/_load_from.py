"""Loading a checkpoint outside any elastic-run job, for evaluation and fine-tuning.

:func:`load_from` takes a checkpoint URL (it runs ``elastic-ckpt restore``, so it reads every
store ``elastic-ckpt`` reads) or a directory that one of these wrote:

- ``elastic-ckpt restore URL DIR --rank R --world-size W`` (``DIR/state.safetensors`` and
  ``DIR/metadata.json``), or the agent's restore layout (``DIR/rank-<R>/...``);
- a staged snapshot (``DIR/rank-<R>/tensors.safetensors`` and ``meta.json``, every rank's
  share);
- ``elastic-ckpt pull URL DIR`` (the staged files without ``meta.json``: only module entries
  can be read back, by their tensor names);
- ``elastic-ckpt export URL DIR`` (one entry, Hugging Face's layout).

Every file is checked as :func:`elastic_run.load` checks it, and nothing is loaded until the
whole checkpoint fits the state.
"""

import ctypes
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import urllib.parse

from . import _load, _read, _save, _tree
from ._env import rank, world_size
from .protocol import _RESTORED, _RESTORED_META, FormatError, _describe, _is_int, _parse_json

# The longest an `elastic-ckpt restore` may take before load_from gives up on it.
RESTORE_TIMEOUT_S = 3600
# What of a failed `elastic-ckpt` run's error output is shown.
_STDERR_SHOWN_BYTES_MAX = 4000
# Hugging Face's file names for one exported entry.
_HF_SINGLE = "model.safetensors"
_HF_INDEX = "model.safetensors.index.json"
# Whether a restore from a URL writes the tensors' bytes straight into this process's memory
# (``elastic-ckpt restore --into-parent``) when it does not read them in place. False: through
# a file under work_dir, as where the system denies it.
_INTO_PROCESS = True
# Held while a restore may write into this process (PR_SET_PTRACER names one process only): a
# load that finds it taken reads through a file.
_INTO_PROCESS_LOCK = threading.Lock()
# prctl(2)'s PR_SET_PTRACER (Yama): which process may access this one's memory.
_PR_SET_PTRACER = 0x59616D61
_URL_SCHEMES = ("file", "s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "adl", "memory", "http", "https")


class CheckpointUnavailable(RuntimeError):
    """``elastic-ckpt restore`` could not give a step: no committed step, a store that does not
    answer, or a step that does not read whole. The message holds its error output."""


def load_from(source, state, step=None, *, strict=True, work_dir=None):
    """Loads a checkpoint into ``state`` outside an elastic-run job, and returns its step.

    ``source`` is a checkpoint URL (``s3://bucket/job``, ``file:///path``, ...: the newest step
    that reads whole, or ``step``) or a directory (see the module docs). ``state`` is the
    mapping :func:`elastic_run.load` takes, filled in place the same way: Stateful entries
    through ``load_state_dict``, plain values set in the mapping; ``strict=False`` lets either
    side hold entries the other lacks.

    From a URL, the step is restored into a private directory under ``work_dir`` (the system's
    temporary directory by default; a memory file system such as ``/dev/shm`` spares the
    disk), removed before this returns. The load overlaps the restore: once the restored
    file's header is written, it is checked against ``state`` in full, and each range of
    tensor bytes is then read into the state's own tensors as soon as the restore has written
    it and checked its chunk. When the newest step turns out corrupt midway, the restore falls
    back to an older one, whose bytes are read over what was read; what a load returns is
    always one step, whole. (An older step that does not fit ``state`` raises
    :class:`StateError` then, and ``state`` may hold part of the newer step.) From a
    ``file://`` URL whose chunks are raw, nothing is written under ``work_dir``: the restore
    checks each chunk where it lies (``--no-copy``), and its bytes are read from there; a chunk
    replaced since its check raises :class:`FormatError`. From any other URL, when every
    tensor is read into CPU memory, nothing is written there either: the restore writes each
    block straight into the tensors as it decodes it (``--into-parent``), so each byte is
    copied once on its way from the store, and the step counts once its chunks are checked
    (a load that raises may leave bytes in the state that failed their check); where the
    system does not let a process write into its parent's memory, it writes the file.

    Inside a torchrun or elastic-run job (``RANK``/``WORLD_SIZE`` set) each rank reads what its
    rank of that world holds: its rows of sharded (FSDP2) state. Outside one, rank 0 of 1: every
    tensor whole.

    An exported directory holds one entry: ``state`` then names exactly one object (a module,
    or a dict that receives the tensors). Its step is the one the export recorded, or None.

    Raises :class:`FormatError` for a malformed or unknown directory or a step other than
    ``step``, :class:`StateError` when the checkpoint does not fit ``state`` (nothing is loaded
    then), and :class:`CheckpointUnavailable` when ``elastic-ckpt`` cannot restore from a URL.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"elastic_run.load_from: the source is a {type(source).__name__}, not a URL or a path")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"elastic_run.load_from: step {_describe(step)} is not a step number")
    src = os.fspath(source)
    # The load writes into the tensors a pending async_save may still be reading.
    _save.wait()
    if _is_url(src):
        return _from_store(src, state, step, strict, work_dir)
    if not os.path.isdir(src):
        raise FormatError(f"{src}: neither a checkpoint URL nor a directory")
    return _from_dir(src, state, step, strict)


def _is_url(s):
    scheme, sep, _ = s.partition("://")
    return bool(sep) and scheme.lower() in _URL_SCHEMES


def _local_root(url):
    """The directory of a ``file://`` URL as the store reads it, in normal form; None for
    another store. As in the store: a backslash is a slash (an escaped one, %5C, is a
    backslash in a name), the host is empty or ``localhost`` in any case, and ``//`` and
    ``/./`` are one slash. A directory named with an escaped ``..`` is None: its chunks are
    never read in place."""
    scheme, sep, rest = url.partition(":")
    if scheme.lower() != "file" or not sep:
        return None
    parts = urllib.parse.urlsplit("file:" + rest.replace("\\", "/"))
    if parts.netloc.lower() not in ("", "localhost"):
        return None
    path = urllib.parse.unquote(parts.path) or "/"
    if ".." in path.split("/"):
        return None
    return _read.normal_path(path)


def _ckpt_exe():
    """``$ELASTIC_CKPT``, else ``elastic-ckpt`` on ``PATH`` (the wheel installs it there)."""
    exe = os.environ.get("ELASTIC_CKPT") or shutil.which("elastic-ckpt")
    if not exe:
        raise CheckpointUnavailable("elastic_run.load_from: elastic-ckpt is not on PATH (install the elastic-run "
                                    "wheel, or set ELASTIC_CKPT to its path)")
    return exe


def _from_store(url, state, step, strict, work_dir):
    # A private directory (mkdtemp makes it 0700), removed afterwards whatever happens.
    tmp = tempfile.mkdtemp(prefix="elastic_run-load_from-", dir=work_dir)
    into = _INTO_PROCESS and _INTO_PROCESS_LOCK.acquire(blocking=False)
    try:
        dest = os.path.join(tmp, "restored")
        cmd = [_ckpt_exe(), "restore", url, dest, "--rank", str(rank()), "--world-size", str(world_size()),
               "--events", "--no-sync", "--no-copy"] + (["--into-parent"] if into else [])
        if step is not None:
            cmd += ["--step", str(step)]
        load = _Overlapped(url, dest, state, strict)
        timed_out = threading.Event()
        with open(os.path.join(tmp, "stderr"), "w+b") as err:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            if into:
                # Under Yama's ptrace_scope 1 only a process named so may write into this one
                # (the restore waits for the answer to its header before it tries).
                _set_ptracer(p.pid)
                load.answer_fd = p.stdin.fileno()

            def give_up():
                timed_out.set()
                p.kill()

            timer = threading.Timer(RESTORE_TIMEOUT_S, give_up)
            timer.start()
            try:
                with p.stdout, p.stdin:
                    for line in p.stdout:
                        load.event(line)
                rc = p.wait()
            except BaseException:
                # Dead before anything is freed: it may be writing into this process's tensors.
                p.kill()
                _wait_out(p)
                load.abandon()
                raise
            finally:
                timer.cancel()
                if into:
                    _set_ptracer(0)
            if rc != 0:
                load.abandon()
                if timed_out.is_set():
                    raise CheckpointUnavailable(f"elastic-ckpt restore {url}: no answer within {RESTORE_TIMEOUT_S} s")
                err.seek(0, os.SEEK_END)
                err.seek(max(err.tell() - _STDERR_SHOWN_BYTES_MAX, 0))
                text = err.read().decode(errors="replace").strip()
                raise CheckpointUnavailable(f"elastic-ckpt restore {url} failed (exit {rc}): {text}")
        got, tensors, rest, shards = load.finish()
        if step is not None and got != step:
            raise FormatError(f"{url}: elastic-ckpt restored step {got}, not step {step}")
        return _apply(state, rest, tensors, f"{url} step {got}", strict, got, shards)
    finally:
        if into:
            _INTO_PROCESS_LOCK.release()
        shutil.rmtree(tmp, ignore_errors=True)


def _set_ptracer(pid):
    """Lets process ``pid`` (0: none) access this process's memory where Yama restricts it to
    a process's descendants; nothing where there is no Yama (the call fails with EINVAL)."""
    try:
        _read._libc().prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the restore finds it cannot write, and writes the file


def _wait_out(p):
    """Waits until ``p`` (killed) has exited, whatever interrupts the wait."""
    while True:
        try:
            p.wait()
            return
        except KeyboardInterrupt:
            continue


class _Overlapped:
    """A load from ``elastic-ckpt restore --events``, read into the state while the restore
    goes on: once a step's file exists with its header, it is checked against the state in
    full (nothing is read when it does not fit), and then each range of it is read into the
    state's own tensors (:class:`_read.RangedRead`) as the restore reports it written and
    checked. A step that fails midway (the restore then falls back to an older one) is
    dropped, and the older step is read over it."""

    def __init__(self, url, dest, state, strict):
        self.url, self.dest, self.state, self.strict = url, dest, state, strict
        self.root = _local_root(url)  # where the chunks that source events name must lie
        self.meta = None  # (step, rank, world, rest) of the step being read
        self.file = None
        self.reader = None
        self.release_fd = None
        self.shards = None
        self.gone = False  # the step being read failed before its file could be opened
        self.answer_fd = None  # the restore's stdin, where the targets of a header go

    def event(self, line):
        if not line.startswith(b"{"):
            return  # the report's line
        ev = _parse_json(line, f"elastic-ckpt restore {self.url}: an event")
        kind = ev.get("event") if isinstance(ev, dict) else None
        step = ev.get("step") if isinstance(ev, dict) else None
        if kind not in ("step", "file", "header", "ready", "source", "failed") or not _is_int(step):
            raise FormatError(f"elastic-ckpt restore {self.url}: unknown event {_describe(ev)}")
        where = f"{self.url} step {step}"
        if kind == "step":
            self._drop()
            md = ev.get("metadata")
            if not isinstance(md, dict):
                raise FormatError(f"{where}: the restore's metadata is {_describe(md)}, not an object")
            self.meta = _load._restored_meta(md, f"{where}: metadata")
            if self.meta[0] != step:
                raise FormatError(f"{where}: the restore's metadata is of step {self.meta[0]}")
        elif kind == "failed":
            self._drop()
        elif self.meta is None or self.meta[0] != step:
            raise FormatError(f"elastic-ckpt restore {self.url}: a {kind} event of step {step} outside it")
        elif kind == "file":
            self._begin(ev, where)
        elif kind == "header":
            self._begin_header(ev, where)
        elif not self.gone:
            if self.reader is None or ev.get("name") != _RESTORED:
                raise FormatError(f"{where}: bytes of {_describe(ev.get('name'))} ready, which is not being read")
            if kind == "ready" and not isinstance(self.file, _read.SourcedFile):
                self.reader.ready(ev.get("ranges"))
            elif kind == "source" and isinstance(self.file, _read.SourcedFile):
                self.reader.ready(self.file.add(self._source_path(ev.get("path"), where), ev.get("dev"),
                                                ev.get("ino"), ev.get("bytes"), ev.get("ctime_ns"),
                                                ev.get("ranges")))
            else:
                raise FormatError(f"{where}: a {kind} event for a state file that is "
                                  f"{'not ' if kind == 'source' else ''}read from the store's chunks")

    def _begin(self, ev, where):
        if self.reader is not None and self.reader.in_place_untouched():
            # Answered with targets, but the restore writes the file after all (it is not let
            # write into this process, or a wrapper stands between): nothing was written into
            # memory, and the file is read instead.
            self.reader.abandon()
            self.reader = None
            self._close()
        path, name, size = ev.get("path"), ev.get("name"), ev.get("bytes")
        if self.reader is not None or self.gone or name != _RESTORED or not isinstance(path, str) \
                or not _is_int(size):
            raise FormatError(f"{where}: unexpected file event {_describe(ev)}")
        # The restore writes only into the directory given to it.
        if os.path.dirname(path) != self.dest or not os.path.basename(path).startswith("."):
            raise FormatError(f"{where}: the restore names {path!r}, outside {self.dest}")
        opened = self._open_written(path, name, self.meta[0])
        if opened is None:
            # The step failed before this event was read: its file is gone, and a "failed"
            # event follows.
            self.gone = True
            return
        # The file is read once and removed: with a descriptor open for writing, the pages
        # of each range read are given back as the load goes, so the file holds little more
        # than what is not yet read.
        self.file, self.release_fd = opened
        if self.file.size != size:
            raise FormatError(f"{self.file.path}: {self.file.size} bytes, the restore says {size}")
        self._plan(where)

    def _begin_header(self, ev, where):
        """A step whose state file the restore does not write: its header comes in the event.
        Restored without copies (``--no-copy``: raw chunks of a local directory), its bytes are
        read from the store's chunks as the restore names each one checked. With
        ``"targets": true`` (``--into-parent``) the restore writes them into this process's
        memory: this answers on the restore's stdin with where each tensor's bytes go (the
        state's own tensors, once the header is checked against the state), or with none (a
        tensor read into device memory, or writes into memory not wanted), and then a file
        event follows, as without ``--into-parent``."""
        name, size, header = ev.get("name"), ev.get("bytes"), ev.get("header")
        in_memory = ev.get("targets") is True
        if self.reader is not None or self.gone or name != _RESTORED or not isinstance(header, str) \
                or not _is_int(size) or (in_memory and self.answer_fd is None):
            raise FormatError(f"{where}: unexpected header event {_describe(ev)}")
        try:
            header = header.encode()
        except UnicodeEncodeError as e:
            raise FormatError(f"{where}: the restore's header is not UTF-8 ({e.reason} at {e.start})") from None
        path = os.path.join(self.dest, name)
        self.file = _read.HeaderFile(path, header, size) if in_memory else _read.SourcedFile(path, header, size)
        self._plan(where)
        if not in_memory:
            return
        targets = self.reader.in_place() if _INTO_PROCESS else None
        if targets is None:
            self.reader.abandon()
            self.reader = None
            self._close()
        answer = {"step": self.meta[0], "name": name, "pid": os.getpid(), "targets": targets}
        line = memoryview(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
        try:
            # Unbuffered: nothing is left to flush (and fail) when the pipe is closed.
            while line:
                line = line[os.write(self.answer_fd, line):]
        except BrokenPipeError:
            pass  # the restore ended: its exit status and error output say why

    def _plan(self, where):
        """Checks the step's file against its metadata and the state, and starts its reads."""
        step, r, world, rest = self.meta
        self.shards = _load._check_restored(self.file, self.dest, f"{where}: metadata", step, r, world)
        into = self._destinations(rest, where)
        self.reader = _read.RangedRead(self.file, into, release_fd=self.release_fd)

    def _source_path(self, path, where):
        return _read.chunk_path(self.root, self.url, path, where)

    def _open_written(self, path, name, step):
        """``(TensorFile, descriptor for writing)`` of the file a ``file`` event of ``step``
        names: at its temporary ``path``, or, when this event is read late, at its own name
        (a restore that ended renamed it there). None when neither holds ``step``: the step
        failed and its file is gone."""
        for p in (path, os.path.join(self.dest, name)):
            try:
                fd = os.open(p, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                f = _read.TensorFile(p)
            except FormatError:
                os.close(fd)
                if os.path.lexists(p):
                    raise
                continue  # renamed or removed in between
            if not os.path.samestat(os.fstat(fd), os.fstat(f.fd)):
                f.close()
                os.close(fd)
                raise FormatError(f"{p}: replaced while it was opened")
            if p != path and f.metadata.get("elastic.step") != str(step):
                f.close()
                os.close(fd)
                return None
            return f, fd
        return None
    def _destinations(self, rest, where):
        """Which tensors the bytes go straight into (see :func:`_load._into`, which checks the
        state against the file first): the state form's own tensors, or the model and
        optimizer of a ``save(step, model=, optimizer=)`` step."""
        if _tree.is_skeleton(rest):
            plan = _load._into(self.state, None, None, self.strict, self.shards, where)
        elif isinstance(self.state, dict) and set(self.state) <= {"model", "optimizer"}:
            plan = _load._into(None, self.state.get("model"), self.state.get("optimizer"), self.strict,
                               self.shards, where)
        else:
            return None
        return plan(rest, self.file.entries)

    def _drop(self):
        if self.reader is not None:
            self.reader.abandon()
            self.reader = None
        self._close()
        self.meta = None
        self.gone = False

    def _close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.release_fd is not None:
            os.close(self.release_fd)
            self.release_fd = None

    def abandon(self):
        """Stops reading (the restore failed, or the load did)."""
        self._drop()

    def finish(self):
        """``(step, tensors, rest, shards)`` once the restore ended well."""
        if self.reader is None:
            raise CheckpointUnavailable(f"elastic-ckpt restore {self.url}: ended without restoring a step")
        try:
            tensors = self.reader.finish()
        finally:
            self.reader = None
            self._close()
        return self.meta[0], tensors, self.meta[3], self.shards


def _from_dir(d, state, step, strict):
    def is_file(*parts):
        return os.path.isfile(os.path.join(d, *parts))

    shards = {}
    ranks = sorted(n for n in os.listdir(d) if n.startswith("rank-") and os.path.isdir(os.path.join(d, n)))
    if _load._has_restored(d) and is_file(_RESTORED_META):
        got, tensors, rest = _load._read_restored(d, shards=shards)
    elif _load._has_restored(os.path.join(d, f"rank-{rank()}")):
        got, tensors, rest = _load._read_restored(os.path.join(d, f"rank-{rank()}"), shards=shards)
    elif any(is_file(r, "meta.json") for r in ranks):
        got, tensors, rest = _load._read_staged(d, shards=shards)
    elif is_file(_HF_INDEX) or is_file(_HF_SINGLE):
        return _from_export(d, state, step, strict)
    elif any(is_file(r, "tensors.safetensors") for r in ranks):
        return _from_pull(d, [os.path.join(d, r, "tensors.safetensors") for r in ranks], state, step, strict)
    else:
        raise FormatError(f"{d}: not a checkpoint directory (no {_RESTORED}, rank-*/, {_HF_SINGLE} or {_HF_INDEX})")
    if step is not None and got != step:
        raise FormatError(f"{d}: holds step {got}, not step {step}")
    return _apply(state, rest, tensors, d, strict, got, shards)


def _apply(state, rest, tensors, where, strict, step, shards):
    if _tree.is_skeleton(rest):
        _tree.apply(state, rest, tensors, where, strict=strict, shards=shards)
        return step
    if shards:
        raise _tree.StateError(f"{where}: step {step} holds sharded tensors, which only a state mapping loads")
    # A checkpoint of save(step, model=, optimizer=, extra=): its model and optimizer load into
    # entries named so.
    if not isinstance(state, dict) or not set(state) <= {"model", "optimizer"}:
        raise _tree.StateError(f"{where}: step {step} was saved with save(step, model=, optimizer=, extra=): load it "
                               "into a state of the entries 'model' and 'optimizer'")
    _load._apply(tensors, rest, state.get("model"), state.get("optimizer"), where)
    return step


def _single_entry(state, where):
    if not isinstance(state, dict) or len(state) != 1:
        names = sorted(state) if isinstance(state, dict) else state
        raise _tree.StateError(f"{where}: holds one entry's tensors: pass a state of one entry, not {_describe(names)}")
    return next(iter(state.items()))


def _load_flat(state, name, tensors, where, strict):
    """Loads ``tensors`` (a module's ``state_dict()`` names) into ``state[name]``: a module (or
    another Stateful object) through ``load_state_dict``, else the dict is set in the mapping."""
    # Through the state form's own path, so a flat entry gets every check a saved one gets.
    names = {k: f"flat/{i}" for i, k in enumerate(tensors)}
    skeleton = {"format": _tree.STATE_FORMAT, "entries": {name: {
        "stateful": _tree.is_stateful(state[name]), "value": {k: {"$t": n} for k, n in names.items()}}}}
    one = {name: state[name]}
    _tree.apply(one, skeleton, {n: tensors[k] for k, n in names.items()}, where, strict=strict)
    state[name] = one[name]


def _regular(path):
    """Whether ``path`` is a regular file, without following a symlink."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _from_export(d, state, step, strict):
    from safetensors import SafetensorError, safe_open

    name, _ = _single_entry(state, d)
    if os.path.isfile(os.path.join(d, _HF_INDEX)):
        index = _load._read_object(os.path.join(d, _HF_INDEX))
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FormatError(f"{d}/{_HF_INDEX}: weight_map is {_describe(weight_map)}, not an object of file names")
        files = sorted(set(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f or f in (".", "..") or not f.endswith(".safetensors"):
                raise FormatError(f"{d}/{_HF_INDEX}: {f!r} is not a safetensors file name in {d}")
    else:
        weight_map, files = None, [_HF_SINGLE]
    tensors, steps = {}, set()
    for f in files:
        path = os.path.join(d, f)
        if not _regular(path):
            raise FormatError(f"{path}: missing or not a regular file")
        try:
            with safe_open(path, framework="pt") as sf:
                md = sf.metadata() or {}
                if "elastic.step" in md:
                    steps.add(md["elastic.step"])
                for k in sf.keys():
                    if k in tensors:
                        raise FormatError(f"{d}: tensor {k!r} is stored twice")
                    if weight_map is not None and weight_map.get(k) != f:
                        raise FormatError(f"{d}/{_HF_INDEX}: tensor {k!r} is in {f}, the index says "
                                          f"{_describe(weight_map.get(k))}")
                    tensors[k] = sf.get_tensor(k)
        except SafetensorError as e:
            raise FormatError(f"{path}: not a safetensors file: {e}") from None
    if weight_map is not None and set(weight_map) != set(tensors):
        missing = sorted(set(weight_map) - set(tensors))[:5]
        raise FormatError(f"{d}/{_HF_INDEX}: names tensors no file holds: {missing}")
    got = None
    if len(steps) > 1:
        raise FormatError(f"{d}: files of different steps {sorted(steps)}")
    if steps:
        text = steps.pop()
        if not text.isdigit() or len(text) > 16:
            raise FormatError(f"{d}: elastic.step {_describe(text)} is not a step number")
        got = int(text)
    if step is not None and got != step:
        raise FormatError(f"{d}: holds step {got}, not step {step}")
    _load_flat(state, name, tensors, d, strict)
    return got


def _unescape(part, where):
    """A path part of a tensor name back to the ``state_dict()`` key it was written from (the
    inverse of ``_tree``'s escaping of str keys)."""
    if part == "%":
        return ""
    if part.startswith("~"):
        raise FormatError(f"{where}: the key {part!r} is not a string key")
    return urllib.parse.unquote(part, errors="strict")


def _from_pull(d, paths, state, step, strict):
    """A pulled step: every rank's staged tensors, without the JSON skeleton, so only entries
    whose tensors are a flat ``state_dict()`` (modules) can be read back."""
    tensors, steps = {}, set()
    for path in paths:
        shards = {}

        def check(header, keys, path=path, shards=shards):
            if "step" in header:
                steps.add(header["step"])
            if header.get("elastic.shards"):
                shards.update(json.loads(header["elastic.shards"]))

        for k, t in _load._read_tensors(path, check).items():
            if k in shards:
                raise FormatError(f"{path}: {k!r} is sharded: load a pulled sharded step with "
                                  "load_from(URL), which restores this rank's rows")
            if k in tensors:
                raise FormatError(f"{d}: tensor {k!r} stored twice")
            tensors[k] = t
    if len(steps) > 1:
        raise FormatError(f"{d}: files of different steps {sorted(steps)}")
    got = int(steps.pop()) if steps and next(iter(steps)).isdigit() else None
    if step is not None and got != step:
        raise FormatError(f"{d}: holds step {got}, not step {step}")
    entries = {}
    for k, t in tensors.items():
        head, _, rest = k.partition("/")
        if head == "state":
            name, _, key = rest.partition("/")
        elif head == "model":  # save(step, model=...)
            name, key = "model", rest
        else:
            continue
        if "/" in key:
            entries.setdefault(name, None)  # nested: not a module's flat state_dict()
        elif entries.get(name, {}) is not None:
            entries.setdefault(name, {})[_unescape(key, f"{d}: tensor {k!r}")] = t
    unknown = sorted(set(entries) - set(state))
    missing = sorted(set(state) - set(entries))
    if strict and (unknown or missing):
        raise _tree.StateError(f"{d}: the pulled step holds the tensors of {sorted(entries)}, the state names "
                               f"{sorted(state)}; a pulled directory holds no JSON state, so only modules load from "
                               "it (load_from(URL) reads the whole state; strict=False allows the difference)")
    for name in sorted(set(entries) & set(state)):
        if entries[name] is None or not _tree.is_stateful(state[name]):
            raise _tree.StateError(f"{d}: state[{name!r}] is not a module's flat state_dict(): a pulled directory "
                                   "holds no JSON state; load it with load_from(URL)")
    for name in sorted(set(entries) & set(state)):
        _load_flat(state, name, entries[name], d, strict)
    return got
