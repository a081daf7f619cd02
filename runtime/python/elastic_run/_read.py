"""Reading a safetensors file straight into tensors.

The header is parsed and checked here, by the rules safetensors itself applies: a JSON object
of at most HEADER_BYTES_MAX bytes, every tensor's dtype known, its byte range the size its
shape and dtype make, the ranges in order with no gap or overlap, and the file exactly as long
as they say. Then each tensor is either read with ``preadv`` into a tensor the caller names (a
module's own parameter: the bytes go from the file into the model in one copy, and several
reads run at once on a large file, since they release the GIL; optimizer state the optimizer
already holds is read the same way), or read the same way into a new tensor of its own. Only
tensors the caller asks for as views (shards of a staged snapshot, which are cut to a rank's
rows and copied at once) are views of a private, copy-on-write mapping of the file: a view
keeps the whole file in memory for as long as any tensor of it lives (a restored file in
``/dev/shm`` for the whole run, after the agent removed it), and copies each page again on
its first write, so nothing that outlives the load is one. A tensor named on a CUDA
device is read through pinned host buffers, a few megabytes at a time, each copied to the
device asynchronously on a stream of the reading thread's own while the next is read.
"""

import ctypes
import errno
import mmap
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor

from .protocol import FormatError, _describe, _is_int, _parse_json

# safetensors' own bound on the header.
HEADER_BYTES_MAX = 100_000_000
# One preadv at most (Linux reads at most 2 GiB - 4 KiB per call).
_READ_BYTES_MAX = 1 << 30
# Files at least this big are read by several threads, each taking whole tensors.
_PARALLEL_BYTES_MIN = 64 << 20
_THREADS_MAX = 4
# Reading into device memory: each reading thread's pinned host buffers (two, so that one is
# read while the other is copied to the device), each at most this many bytes.
_PINNED_BUFFER_BYTES = 32 << 20
_PINNED_BUFFERS = 2
# Threads of a RangedRead: it shares the cores with the process writing the file (one measured
# faster than two on 2 cores, BENCHMARKS.md §3).
_OVERLAP_THREADS = 1
# A RangedRead drops its finished reads from its list once it holds more than this many.
_PENDING_CHECK = 64
# What a RangedRead gives back of the file it read: whole pages, with fallocate(2)'s
# FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE.
_PAGE_BYTES = 4096
_FALLOC_PUNCH_HOLE = 0x02 | 0x01
_LIBC = []  # this process's C library (errno kept), loaded once
_FALLOCATE = []  # the fallocate function (or None), looked up once


def _libc():
    """The C library this process runs on, loaded once, with ``errno`` kept for each call."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _fallocate():
    """libc's ``fallocate``, or None where there is none (not Linux)."""
    if not _FALLOCATE:
        fn = getattr(_libc(), "fallocate", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _FALLOCATE.append(fn)
    return _FALLOCATE[0]

# safetensors dtype -> (torch dtype name, bytes per element).
_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}


class Entry:
    """One tensor of the file: name, safetensors dtype, shape, and its byte range in the file."""

    __slots__ = ("name", "dtype", "shape", "start", "nbytes")

    def __init__(self, name, dtype, shape, start, nbytes):
        self.name, self.dtype, self.shape, self.start, self.nbytes = name, dtype, shape, start, nbytes

    def torch_dtype(self):
        import torch

        return getattr(torch, _DTYPES[self.dtype][0])


class TensorFile:
    """An open safetensors file whose header has been checked: ``entries`` (name -> Entry, in
    file order), ``metadata`` (its ``__metadata__``). Close it, or use it in a ``with``."""

    def __init__(self, path):
        self.path = path
        self._map = None
        try:
            # Non-blocking: a FIFO in its place must not hang the open.
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise FormatError(f"{path}: missing") from None
        try:
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path}: not a regular file")
            self.size = st.st_size
            self.entries, self.metadata, self.data_start = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _bad(self, what):
        return FormatError(f"{self.path}: not a safetensors file: {what}")

    def _header(self):
        if self.size < 8:
            raise self._bad(f"{self.size} bytes, shorter than the header length")
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        if n > HEADER_BYTES_MAX:
            raise self._bad(f"a header of {n} bytes, over the limit of {HEADER_BYTES_MAX}")
        if 8 + n > self.size:
            raise self._bad(f"a header of {n} bytes in a file of {self.size}")
        return self._parse_header(self._pread_bytes(n, 8))

    def _parse_header(self, raw):
        """``(entries, metadata, data_start)`` of the header ``raw`` (its JSON bytes), checked
        against the file's size."""
        n = len(raw)
        header = _parse_json(raw, f"{self.path}: header")
        if not isinstance(header, dict):
            raise self._bad(f"the header is {_describe(header)}, not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ is not an object of strings")
        entries = []
        for name, spec in header.items():
            if not (isinstance(spec, dict) and set(spec) == {"dtype", "shape", "data_offsets"}):
                raise self._bad(f"tensor {name!r} is {_describe(spec)}, not {{dtype, shape, data_offsets}}")
            dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
            if dtype not in _DTYPES:
                raise self._bad(f"tensor {name!r} has the unknown dtype {_describe(dtype)}")
            if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
                raise self._bad(f"tensor {name!r} has the shape {_describe(shape)}")
            if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                    and 0 <= offs[0] <= offs[1]):
                raise self._bad(f"tensor {name!r} has the data offsets {_describe(offs)}")
            numel = 1
            for d in shape:
                numel *= d
            if offs[1] - offs[0] != numel * _DTYPES[dtype][1]:
                raise self._bad(f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} of {dtype}")
            entries.append(Entry(name, dtype, tuple(shape), offs[0], offs[1] - offs[0]))
        entries.sort(key=lambda e: (e.start, e.nbytes))
        at = 0
        for e in entries:
            if e.start != at:
                raise self._bad(f"tensor {e.name!r} starts at byte {e.start} of the data, not {at}")
            at += e.nbytes
        data_start = 8 + n
        if data_start + at != self.size:
            raise self._bad(f"the tensors end at byte {data_start + at}, the file at {self.size}")
        return {e.name: e for e in entries}, metadata, data_start

    def _pread_bytes(self, n, offset):
        buf = bytearray(n)
        self._readinto(memoryview(buf), offset)
        return bytes(buf)

    def _readinto(self, mv, offset):
        """Fills ``mv`` from byte ``offset``; a file that ends early (cut after it was
        checked) is a FormatError."""
        done = 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:done + _READ_BYTES_MAX]], offset + done)
            if n == 0:
                raise FormatError(f"{self.path}: ended at byte {offset + done}, its header says "
                                  f"{offset + len(mv)}: cut while it was read")
            done += n

    def read(self, into=None, views=()):
        """Every tensor, name -> tensor: read into ``into[name]`` when given there (a contiguous
        CPU or CUDA tensor of its dtype and shape, which is returned for it; or a device, to
        read into a new tensor there), else a new CPU tensor read from the file; a name in
        ``views`` is instead a view of the file's copy-on-write mapping (a new tensor where its
        bytes are not aligned to its dtype), for a caller that copies what it needs of it
        before the load ends."""
        out, jobs, device_jobs = self._plan(into, views)
        self._read_all(jobs, self._read_one)
        if device_jobs:
            self._read_to_device(device_jobs)
        return out

    def _plan(self, into, views=()):
        """What :meth:`read` reads where: ``(out, jobs, device_jobs)``, every tensor by name,
        and the ``(entry, tensor)`` pairs to read into CPU and into device memory."""
        import torch

        into = into or {}
        out, jobs, device_jobs = {}, [], []
        for e in self.entries.values():
            dest = into.get(e.name)
            if isinstance(dest, torch.device):
                dest = torch.empty(e.shape, dtype=e.torch_dtype(), device=dest)
            if dest is not None:
                if not fits(dest, e):
                    raise ValueError(f"{self.path}: tensor {e.name!r} cannot be read into {_what(dest)}")
                if dest.device.type != "cpu":
                    out[e.name] = dest
                    if e.nbytes:
                        device_jobs.append((e, dest))
                    continue
            elif e.name in views and e.nbytes and (self.data_start + e.start) % _DTYPES[e.dtype][1] == 0:
                out[e.name] = self._view(e)
                continue
            else:
                dest = torch.empty(e.shape, dtype=e.torch_dtype())
            out[e.name] = dest
            if e.nbytes:
                jobs.append((e, dest))
        return out, jobs, device_jobs

    def _read_all(self, jobs, read_one):
        """Runs ``read_one(e, dest)`` for each job, on several threads when there is enough to
        read."""
        total = sum(e.nbytes for e, _ in jobs)
        threads = min(_THREADS_MAX, os.cpu_count() or 1, len(jobs))
        if total < _PARALLEL_BYTES_MIN or threads < 2:
            for e, dest in jobs:
                read_one(e, dest)
            return
        # Largest first, so the threads finish together.
        jobs = sorted(jobs, key=lambda j: -j[0].nbytes)
        with ThreadPoolExecutor(threads, thread_name_prefix="elastic-run-read") as pool:
            for f in [pool.submit(read_one, e, dest) for e, dest in jobs]:
                f.result()

    def _read_to_device(self, jobs):
        """Reads each job's bytes into its device tensor through pinned host buffers: each
        reading thread holds :data:`_PINNED_BUFFERS` of them and a stream of its own, reads the
        file into one buffer while the other is copied to the device, and waits for its stream
        before it ends. The copies start after the work queued on the caller's current stream
        (which may still use the tensors), and are done when this returns."""
        import threading

        import torch

        devices = {dest.device for _, dest in jobs}
        after = {d: torch.cuda.current_stream(d) for d in devices}
        local = threading.local()
        made = []
        lock = threading.Lock()

        def read_one(e, dest):
            copier = getattr(local, "copier", None)
            if copier is None or copier.device != dest.device:
                copier = local.copier = _DeviceCopier(dest.device, after[dest.device], self)
                with lock:
                    made.append(copier)
            copier.copy(e, dest)

        try:
            self._read_all(jobs, read_one)
        finally:
            for c in made:
                c.finish()


    def _view(self, e):
        """Entry ``e`` as a view of the file's private mapping (made on first use): its pages
        are the file's until written, then the writer's own."""
        import torch

        if self._map is None:
            self._map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_COPY)
        numel = e.nbytes // _DTYPES[e.dtype][1]
        return torch.frombuffer(self._map, dtype=e.torch_dtype(), count=numel,
                                offset=self.data_start + e.start).reshape(e.shape)

    def _read_one(self, e, dest):
        mv = memoryview((ctypes.c_char * e.nbytes).from_address(dest.data_ptr())).cast("B")
        self._readinto(mv, self.data_start + e.start)


class HeaderFile(TensorFile):
    """A safetensors file that was never written: its header as given (checked as a file's
    is), and no bytes to read. ``elastic-ckpt restore --into-parent`` writes its tensors'
    bytes into this process's memory instead (:meth:`RangedRead.in_place`)."""

    def __init__(self, path, header, size):
        self.path, self.size, self._map, self.fd = path, size, None, -1
        if size < 8 + len(header):
            raise self._bad(f"a header of {len(header)} bytes in a file of {size}")
        if len(header) > HEADER_BYTES_MAX:
            raise self._bad(f"a header of {len(header)} bytes, over the limit of {HEADER_BYTES_MAX}")
        self.entries, self.metadata, self.data_start = self._parse_header(header)

    def _readinto(self, mv, offset):
        raise FormatError(f"{self.path}: byte {offset} was read, but the restore writes this state into memory")


def normal_path(path):
    """An absolute path in normal form: one leading slash (``normpath`` keeps two)."""
    return "/" + os.path.normpath(path).lstrip("/")


def chunk_path(root, url, path, where):
    """A chunk file that a restore names (a ``source`` event, or a restore's ``sources.json``),
    in normal form: an absolute path inside ``root``, the directory of the store ``url``, with
    no ``..`` and nothing a file name cannot hold."""
    try:
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path or ".." in path.split("/") \
                or root is None:
            raise ValueError(path)
        os.fsencode(path)  # a lone surrogate cannot name a file
        normal = normal_path(path)
        if normal == root or os.path.commonpath([root, normal]) != root:
            raise ValueError(path)
        return normal
    except (UnicodeError, ValueError):
        raise FormatError(f"{where}: the restore names the chunk {_describe(path)}, not a file in the store "
                          f"{url}") from None


class SourcedFile(HeaderFile):
    """A safetensors file that was never written (``elastic-ckpt restore --no-copy``): its
    header as given, and its data in other files, the chunks of a local store that the
    restore checked. :meth:`add` says where a range of it lies; a read opens that file again
    (never through a symlink) and reads there only while it is still the file that was
    checked, unchanged: the same device, inode, length and inode change time, before and
    after the read (a rename puts another inode there; a write in place moves the change
    time, which no one can set back, at the grain of the kernel's clock tick). Reads are as
    :class:`TensorFile`'s, from any thread."""

    def __init__(self, path, header, size):
        super().__init__(path, header, size)
        # (start, end, source path, offset there, (dev, ino, length, ctime_ns)), sorted by
        # start, never overlapping. Replaced whole by add(), never changed in place: a read
        # on another thread works on the list it took.
        self._sources = ()

    def add(self, source, dev, ino, length, ctime_ns, ranges):
        """Bytes ``[at, at + n)`` of this file, for each ``[at, n, offset]`` of ``ranges``, are
        bytes ``[offset, offset + n)`` of the file ``source`` (``length`` bytes on device
        ``dev``, inode ``ino``, inode change time ``ctime_ns`` when it was checked). Returns
        the ``[at, n]`` pairs. A range outside the file, or over one already given, is a
        :class:`FormatError`."""
        import bisect

        if not (all(_is_int(v) and v >= 0 for v in (dev, ino, length)) and _is_int(ctime_ns)):
            raise FormatError(f"{self.path}: the source {source!r} is given as "
                              f"{_describe([dev, ino, length, ctime_ns])}")
        sources, out = list(self._sources), []
        for r in ranges if isinstance(ranges, list) else [ranges]:
            if not (isinstance(r, list) and len(r) == 3 and all(_is_int(v) and v >= 0 for v in r)
                    and r[2] + r[1] <= length and r[0] + r[1] <= self.size):
                raise FormatError(f"{self.path}: a source range in {source!r} is {_describe(r)}, not "
                                  f"[offset in {self.size} bytes, length, offset in a file of {length} bytes]")
            item = (r[0], r[0] + r[1], source, r[2], (dev, ino, length, ctime_ns))
            i = bisect.bisect_left(sources, item)
            if (i > 0 and sources[i - 1][1] > item[0]) or (i < len(sources) and sources[i][0] < item[1]):
                raise FormatError(f"{self.path}: bytes [{item[0]}, {item[1]}) are said to lie in two places")
            sources.insert(i, item)
            out.append(r[:2])
        self._sources = tuple(sources)
        return out

    def _readinto(self, mv, offset):
        import bisect

        sources = self._sources  # the list as now: add() replaces it, never changes it
        done, n = 0, len(mv)
        while done < n:
            at = offset + done
            i = bisect.bisect_right(sources, (at, float("inf"))) - 1
            if i < 0 or sources[i][1] <= at:
                raise FormatError(f"{self.path}: byte {at} was read before the restore said where it lies")
            lo, hi, source, from_, ident = sources[i]
            k = min(hi - at, n - done)
            self._read_source(source, ident, mv[done:done + k], from_ + at - lo)
            done += k

    @staticmethod
    def _identity(st):
        return st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns

    def _read_source(self, source, ident, mv, offset):
        changed = f"{source}: not the chunk the restore checked (replaced or changed since)"
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as e:
            # Gone since its check (removed, or its directory replaced): not the chunk checked.
            raise FormatError(f"{source}: a chunk the restore checked cannot be opened: {e.strerror}") from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise  # local trouble (descriptors, memory, I/O), named as it is
            raise FormatError(f"{source}: a chunk the restore checked is now a symlink") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or self._identity(st) != ident:
                raise FormatError(changed)
            done = 0
            while done < len(mv):
                got = os.preadv(fd, [mv[done:done + _READ_BYTES_MAX]], offset + done)
                if got == 0:
                    raise FormatError(f"{source}: ended at byte {offset + done}, cut while it was read")
                done += got
            # Written while it was read: what was read may be neither the old bytes nor new.
            if self._identity(os.fstat(fd)) != ident:
                raise FormatError(changed)
        finally:
            os.close(fd)


class RangedRead:
    """Reads the tensors of a :class:`TensorFile` that is still being written, as its writer
    says which byte ranges of it are final (``elastic-ckpt restore --events``), so the reads
    overlap the writing. Planned as :meth:`TensorFile.read` plans (without views); each range
    is read, as soon as it is given, into the parts of the CPU tensors it holds, on a thread of
    its own. Tensors on a device are read whole by :meth:`finish`. Given ``release_fd`` (the
    file open for writing), the pages of what was read into CPU tensors are given back as it
    goes. Each byte of every tensor must be given exactly once: :meth:`finish` raises
    :class:`FormatError` for a tensor that is not complete, and :meth:`ready` for a range
    outside the data or given twice."""

    def __init__(self, f, into=None, release_fd=None):
        self.f = f
        # A descriptor of the file open for writing: the pages of each range read into a CPU
        # tensor are then given back (``_release``).
        self._release_fd = release_fd
        self.out, jobs, self._device = f._plan(into)
        on_cpu = {id(dest) for _, dest in jobs}
        # Every tensor's bytes, in file order: (start in the file, entry, tensor or None for
        # a tensor read by finish()).
        self._jobs = sorted(((f.data_start + e.start, e, self.out[e.name] if id(self.out[e.name]) in on_cpu else None)
                             for e in f.entries.values() if e.nbytes), key=lambda j: j[0])
        self._starts = [j[0] for j in self._jobs]
        self._got = [0] * len(self._jobs)
        self._pool = ThreadPoolExecutor(min(_OVERLAP_THREADS, os.cpu_count() or 1),
                                        thread_name_prefix="elastic-run-read")
        self._pending = []
        self._in_place = False

    def in_place(self):
        """Where in this process's memory each tensor's bytes go, for a writer that puts them
        there itself (``elastic-ckpt restore --into-parent``): ``[offset in the file, length,
        address]`` for every tensor, in file order; :meth:`ready` then only counts the
        ranges, and reads nothing. None (and nothing changes) when a tensor is read into
        device memory, which only a read from a file does. The tensors (the state's own, or
        new ones in :attr:`out`) must not be freed before the writer ends."""
        if self._device:
            return None
        self._in_place = True
        return [[start, e.nbytes, dest.data_ptr()] for start, e, dest in self._jobs]

    def in_place_untouched(self):
        """Whether this read was given to a writer into memory (:meth:`in_place`) that has
        said no range is there yet."""
        return self._in_place and not any(self._got)

    def ready(self, ranges):
        """Reads ``ranges`` (``[offset, length]`` pairs of the file) into the tensors that
        hold them, in the background."""
        import bisect

        pieces, spans = [], []
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and all(_is_int(v) and v >= 0 for v in r)):
                raise FormatError(f"{self.f.path}: a ready range is {_describe(r)}, not [offset, length]")
            lo, hi = r[0], r[0] + r[1]
            if lo < self.f.data_start or hi > self.f.size:
                raise FormatError(f"{self.f.path}: ready bytes [{lo}, {hi}) are outside its data "
                                  f"[{self.f.data_start}, {self.f.size})")
            i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
            mine = []
            while i < len(self._jobs) and self._jobs[i][0] < hi:
                start, e, dest = self._jobs[i]
                a, b = max(lo, start), min(hi, start + e.nbytes)
                if a < b:
                    self._got[i] += b - a
                    if self._got[i] > e.nbytes:
                        raise FormatError(f"{self.f.path}: bytes of tensor {e.name!r} were given as ready twice")
                    if dest is not None:
                        mine.append((dest, a - start, a, b - a))
                i += 1
            if self._in_place:
                continue  # written where it belongs by the restore
            pieces += mine
            # What is read here may be given back: the whole range, unless part of it waits
            # for finish() (a device tensor's bytes).
            if sum(n for *_, n in mine) == hi - lo:
                spans.append((lo, hi))
            else:
                spans += [(a, a + n) for _, _, a, n in mine]
        if pieces:
            self._pending.append(self._pool.submit(self._read_pieces, pieces, spans))
            # Keep what is waited for bounded: drop the futures that are done.
            if len(self._pending) > _PENDING_CHECK:
                self._pending = [p for p in self._pending if not p.done() or p.exception() is not None]

    def _read_pieces(self, pieces, spans):
        for dest, at, offset, n in pieces:
            mv = memoryview((ctypes.c_char * n).from_address(dest.data_ptr() + at)).cast("B")
            self.f._readinto(mv, offset)
        for lo, hi in spans:
            if self._release_fd is not None:
                self._release(lo, hi)

    def _release(self, lo, hi):
        """Gives back the file's pages wholly inside ``[lo, hi)``, which were read: a hole is
        punched there, so the file holds little more than the bytes not yet read. A file
        system that cannot punch holes keeps them."""
        lo, hi = -(-lo // _PAGE_BYTES) * _PAGE_BYTES, hi // _PAGE_BYTES * _PAGE_BYTES
        if hi <= lo:
            return
        fallocate = _fallocate()
        if fallocate is None or fallocate(self._release_fd, _FALLOC_PUNCH_HOLE, lo, hi - lo) != 0:
            self._release_fd = None

    def finish(self):
        """Waits for the reads, checks that every tensor was read whole, reads the device
        tensors, and returns every tensor by name."""
        pending, self._pending = self._pending, []
        try:
            for p in pending:
                p.result()
        finally:
            self._pool.shutdown(wait=True)
        for (_, e, _), got in zip(self._jobs, self._got):
            if got != e.nbytes:
                raise FormatError(f"{self.f.path}: {got} of the {e.nbytes} bytes of tensor {e.name!r} were given "
                                  "as ready")
        if self._device:
            self.f._read_to_device(self._device)
        return self.out

    def abandon(self):
        """Stops: the reads not yet started are dropped, the ones running waited for."""
        for p in self._pending:
            p.cancel()
        self._pending = []
        self._pool.shutdown(wait=True, cancel_futures=True)


class _DeviceCopier:
    """One thread's way from the file to device memory: pinned buffers, a stream and an event
    per buffer, so that a buffer is read into again only once its copy is done."""

    def __init__(self, device, after, tensor_file):
        import torch

        self.device, self.file = device, tensor_file
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(after)
        self.buffers, self.events, self.turn = [], [], 0

    def _buffer(self, n):
        import torch

        i = self.turn % _PINNED_BUFFERS
        self.turn += 1
        if i == len(self.buffers):
            self.buffers.append(torch.empty(_PINNED_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True))
            self.events.append(None)
        elif self.events[i] is not None:
            self.events[i].synchronize()
        return i, self.buffers[i][:n]

    def copy(self, e, dest):
        import torch

        flat = dest.detach().reshape(-1).view(torch.uint8)
        done = 0
        while done < e.nbytes:
            n = min(_PINNED_BUFFER_BYTES, e.nbytes - done)
            i, buf = self._buffer(n)
            mv = memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")
            self.file._readinto(mv, self.file.data_start + e.start + done)
            with torch.cuda.stream(self.stream):
                flat[done:done + n].copy_(buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self.events[i] = ev
            done += n

    def finish(self):
        self.stream.synchronize()


def fits(t, e):
    """Whether tensor ``t`` can take entry ``e``'s bytes as they are: a dense, contiguous CPU
    or CUDA tensor of its dtype and shape (a parameter's own tensor qualifies: its memory is
    written directly, outside autograd)."""
    import torch

    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.device.type in ("cpu", "cuda") and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and tuple(t.shape) == e.shape and t.dtype == e.torch_dtype())


def _what(t):
    return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)} on {t.device}"
