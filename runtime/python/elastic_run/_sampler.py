"""One global data stream for the whole job: :class:`ElasticSampler`."""

import operator

from . import _env
from .protocol import _describe

# The permutation of epoch e is seeded with seed * _EPOCH_SEED_MUL + e.
_EPOCH_SEED_MUL = 1_000_003
# Largest dataset and seed taken (a permutation is held in memory: 8 bytes a sample).
_DATASET_LEN_MAX = 1 << 40
_SEED_MAX = (1 << 63) // _EPOCH_SEED_MUL - (1 << 20)


def _int(v, what, lo, hi):
    if isinstance(v, bool):
        v = None
    try:
        n = operator.index(v)
    except TypeError:
        n = None
    if n is None or not lo <= n <= hi:
        raise ValueError(f"elastic_run.ElasticSampler: {what} {_describe(v)} is not an integer in [{lo}, {hi}]")
    return n


def _sampler_base():
    try:
        from torch.utils.data import Sampler
    except ImportError:  # the sampler works without torch (shuffle needs it)
        return object
    return Sampler


class ElasticSampler(_sampler_base()):
    """A torch ``Sampler`` over one global, seeded order of the job's samples, whatever the
    world size: epoch ``e`` is a permutation seeded by ``(seed, e)`` (or ``0..n-1`` without
    ``shuffle``), and the epochs follow each other into one stream. Step after step, the job
    takes the next *global batch* of the stream, and each rank takes its slice of it. The state
    is the number of samples the job has consumed: save the sampler with the rest of the state,
    and after any world-size change (linear scaling or a fixed global batch with gradient
    accumulation alike) training goes on exactly where the stream stopped, no sample skipped or
    repeated.

    The global batch is ``batch_size x WORLD_SIZE x grad_accum_steps()`` (``batch_size``
    defaults to elastic-run's ``--batch-size``, ``ELASTIC_BATCH_SIZE``), read at each
    ``iter()``. Within it, rank ``r``'s micro-batch ``a`` (of the accumulation) is the slice
    ``[(a * world + r) * batch_size, ... + batch_size)``; iterating yields this rank's ids in
    that order, micro-batch after micro-batch, so a ``DataLoader(..., batch_size=batch_size,
    sampler=s)`` gives the micro-batches.

    Call :meth:`advance` once per optimizer step: a ``DataLoader`` reads its sampler ahead
    (prefetching), so the sampler cannot tell by itself what was trained on. An iteration
    yields the global batches from the position to the end of its epoch (the last one may
    reach into the next epoch, so that every batch is whole); a new ``iter()`` goes on from the
    position, so ``for epoch ...: for batch in loader`` works, and so does one long iterator.
    """

    def __init__(self, dataset_len, *, seed=0, shuffle=True, batch_size=None):
        self.dataset_len = _int(dataset_len, "dataset_len", 1, _DATASET_LEN_MAX)
        self.seed = _int(seed, "seed", 0, _SEED_MAX)
        self.shuffle = bool(shuffle)
        self.batch_size = None if batch_size is None else _int(batch_size, "batch_size", 1, 1 << 30)
        self.consumed = 0
        self._perm = (None, None)

    # --- the stream -----------------------------------------------------------------------

    def _epoch_order(self, epoch):
        if not self.shuffle:
            return None
        if self._perm[0] != epoch:
            import torch

            g = torch.Generator().manual_seed(self.seed * _EPOCH_SEED_MUL + epoch)
            self._perm = (epoch, torch.randperm(self.dataset_len, generator=g).tolist())
        return self._perm[1]

    def ids(self, start, count):
        """Sample ids ``start .. start + count`` of the job's global stream."""
        out = []
        pos = start
        while len(out) < count:
            epoch, off = divmod(pos, self.dataset_len)
            take = min(count - len(out), self.dataset_len - off)
            order = self._epoch_order(epoch)
            out.extend(range(off, off + take) if order is None else order[off:off + take])
            pos += take
        return out

    def layout(self):
        """``(batch_size, world, rank, accum)`` this iteration uses."""
        b = self.batch_size or _env.batch_size()
        if b is None:
            raise ValueError("elastic_run.ElasticSampler: no batch size: pass batch_size= or run under "
                             "elastic-run --batch-size")
        world, rank, accum = _env.world_size(), _env.rank(), _env.grad_accum_steps()
        g = _env.global_batch()
        if g is not None and g != b * world * accum:
            raise ValueError(f"elastic_run.ElasticSampler: batch_size {b} x world {world} x accumulation "
                             f"{accum} is {b * world * accum}, not the job's global batch {g}")
        return b, world, rank, accum

    def global_batch(self):
        b, world, _, accum = self.layout()
        return b * world * accum

    def rank_ids(self, global_ids):
        """This rank's share of one global batch, micro-batch after micro-batch."""
        b, world, rank, accum = self.layout()
        out = []
        for a in range(accum):
            lo = (a * world + rank) * b
            out.extend(global_ids[lo:lo + b])
        return out

    def __iter__(self):
        g = self.global_batch()
        pos = self.consumed
        end_epoch = pos // self.dataset_len
        while pos // self.dataset_len == end_epoch:
            yield from self.rank_ids(self.ids(pos, g))
            pos += g

    def advance(self, steps=1):
        """The job took ``steps`` more global batches."""
        self.consumed += _int(steps, "steps", 0, 1 << 40) * self.global_batch()

    @property
    def epoch(self):
        """The epoch the next sample comes from."""
        return self.consumed // self.dataset_len

    # --- Stateful --------------------------------------------------------------------------

    def state_dict(self):
        return {"consumed": self.consumed, "dataset_len": self.dataset_len, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, sd):
        for k, want in (("dataset_len", self.dataset_len), ("seed", self.seed), ("shuffle", self.shuffle)):
            if sd.get(k) != want:
                raise ValueError(f"elastic_run.ElasticSampler: the saved stream has {k} {_describe(sd.get(k))}, "
                                 f"this sampler {want!r}: it would be another stream")
        self.consumed = _int(sd.get("consumed"), "consumed", 0, 1 << 62)
