"""Recovery in place: when the job's membership changes, the workers are not restarted. The
agent offers the new generation over the agent socket (a ``watch`` request held until one
comes); every worker leaves its old process group, forms the new generation's group, and
trains on from the weights in its memory.

    ip = er.InPlace(state)                     # forms this generation's process group
    ddp = DistributedDataParallel(model, process_group=ip.group, init_sync=False)
    ip.attach(ddp)                             # gradients go through the switchable group
    step = ip.load()                           # er.load(state), then agree with live peers
    while step < steps:
        if ip.switch_pending():                # a new generation (or a failed step)
            step = ip.switch()                 # new group, ranks, scaling; the agreed step
        step += 1
        with ip.step():                        # a collective that fails ends the block
            loss = ...; loss.backward()
        if not ip.commit():                    # the vote: every rank's collectives held
            step -= 1
            continue
        opt.step()

- **The vote.** :meth:`InPlace.commit` is one small all-reduce: a rank whose gradient
  all-reduce failed (a peer died, or the agent offered a new generation while it was blocked
  on a peer that vanished) says no, and no rank applies the step. A rank that lost the vote's
  own result (a peer died in the middle of it) may be one step behind the others; the switch
  then gives it the state of a rank that is ahead.
- **The switch** (:meth:`InPlace.switch`): waits for the agent's offer, finishes the save in
  flight, takes the new environment (``RANK``, ``WORLD_SIZE``, ``MASTER_*``, the scaling),
  tells the agent, forms the group (a TCPStore at the generation's master address, hosted by
  rank 0), and agrees on the step: the ranks behind receive the whole state from the first
  rank that is furthest, over the new group. A worker that starts fresh in a generation
  (a joiner, or one restarted) does the same in :meth:`InPlace.load`, so the two meet.
- **Aborting.** Gradient all-reduces run on a copy of each bucket, so a collective given up
  (blocked on a peer that vanished without closing its sockets) never writes into memory in
  use again. A group with such a collective is kept, never destroyed (its threads are
  blocked), and given up for good at exit.
- **Bounds.** A failed step must be followed by a new generation within ``offer_wait_s``;
  otherwise the collective's error is raised (the worker fails and the agent restarts the
  group). Forming a group and every collective time out after ``timeout_s``.

The default ``torch.distributed`` group is not created: use :attr:`InPlace.group` (and
:func:`elastic_run.rank`, :func:`elastic_run.world_size`, which follow the switches) for
collectives of your own.
"""

import datetime
import json
import os
import threading
import time

from . import _state, protocol
from ._connection import _Agent, _agent_conn
from ._env import local_rank
from .protocol import FormatError, _get, _get_int, _msg_switched, _msg_watch


# How long a failed step waits for the agent to offer a new generation (the lost peer's lease
# must lapse first) before its error is raised.
OFFER_WAIT_S = 120.0
# Forming a group, and every collective on it.
TIMEOUT_S = 300.0
# How often blocked waits look for an offer.
_POLL_S = 0.02
# Pause before the watch thread asks again after its connection failed.
_RECONNECT_PAUSE_S = 0.5
# Groups given up with a collective blocked in them: past this many the worker fails instead
# of piling up threads (the agent restarts it).
_ABANDONED_GROUPS_MAX = 8
# Store keys of each generation's group live under this prefix.
_STORE_PREFIX = "elastic_run/inplace"


class SwitchError(RuntimeError):
    """A switch to a new generation could not be made (no offer came in time, or the group
    did not form); the worker should exit and let the agent restart it."""


def _is_collective_error(e):
    """Whether ``e`` is what a collective raises when a peer is gone (gloo's connection
    errors, a timed-out wait, a distributed backend error)."""
    try:
        import torch.distributed as dist

        if isinstance(e, dist.DistError):
            return True
    except (ImportError, AttributeError):
        pass
    if not isinstance(e, RuntimeError):
        return False
    text = str(e)
    return any(s in text for s in ("gloo", "Connection reset", "Connection closed", "Timed out",
                                   "NCCL", "ProcessGroup", "peer"))


class _Offers:
    """The generations the agent offers, heard by a daemon thread that holds a ``watch``
    request on its own connection."""

    def __init__(self, generation, rank_offset):
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.current = generation
        self.offset = rank_offset
        self.offer = None  # (generation, rank_offset, env)
        self.stopped = False
        path = os.environ.get("ELASTIC_AGENT_SOCKET")
        self.thread = None
        if path:
            self.thread = threading.Thread(target=self._run, args=(path,), name="elastic_run-watch",
                                           daemon=True)
            self.thread.start()

    def _run(self, path):
        conn = _Agent(path)
        while not self.stopped:
            with self.lock:
                gen = self.offer[0] if self.offer else self.current
                offset = self.offer[1] if self.offer else self.offset
            try:
                reply = conn.request(_msg_watch(offset + local_rank(), gen),
                                     timeout_s=protocol.WATCH_HOLD_S + 30.0,
                                     expect=protocol.REPLY_GENERATION)
                where = "agent reply to 'watch'"
                g = _get_int(where, reply, "generation", 0, protocol.STEP_MAX)
                o = _get_int(where, reply, "rank_offset", 0, protocol.WORLD_SIZE_MAX - 1)
                env = _get(where, reply, "env", dict, {})
                if any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
                    raise FormatError(f"{where}: env holds a value that is not a string")
            except (OSError, FormatError, RuntimeError):
                conn.close()
                time.sleep(_RECONNECT_PAUSE_S)
                continue
            if g != gen and env:
                with self.lock:
                    self.offer = (g, o, env)
                self.changed.set()

    def pending(self):
        with self.lock:
            return self.offer is not None and self.offer[0] != self.current

    def take(self, wait_s):
        """The offer, waiting up to ``wait_s`` for one; None if none came."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.lock:
                if self.offer is not None and self.offer[0] != self.current:
                    return self.offer
                self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.changed.wait(min(left, 1.0))

    def switched(self, generation, offset):
        with self.lock:
            self.current, self.offset = generation, offset
            if self.offer is not None and self.offer[0] == generation:
                self.offer = None


def _form_group(timeout_s):
    """This generation's process group, from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ``ELASTIC_GENERATION``): a TCPStore hosted by rank 0 and
    a gloo (CPU) or NCCL (CUDA) group on a prefix of the generation's own. Returns
    ``(store, group)``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroup, TCPStore

    from ._env import generation, rank, world_size

    r, w, g = rank(), world_size(), generation()
    timeout = datetime.timedelta(seconds=timeout_s)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0"))
    store = TCPStore(addr, port, w, is_master=(r == 0), timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore(f"{_STORE_PREFIX}/{g}/", store)
    pg = ProcessGroup(prefixed, r, w)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(PrefixStore("nccl/", prefixed), r, w, opts)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    else:
        backend = dist.ProcessGroupGloo(PrefixStore("gloo/", prefixed), r, w, timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    pg._register_backend(device, kind, backend)
    pg._set_default_backend(kind)
    pg._set_group_name(f"elastic_run_{g}")
    return store, pg


class _Pending:
    """Collectives in flight that an offer gives up: each has a callback that completes its
    future as failed. Completing twice is harmless."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items = {}
        self.next_id = 0

    def add(self, fail):
        with self.lock:
            self.next_id += 1
            self.items[self.next_id] = fail
            return self.next_id

    def done(self, key):
        with self.lock:
            self.items.pop(key, None)

    def fail_all(self):
        with self.lock:
            items, self.items = list(self.items.values()), {}
        for fail in items:
            fail()
        return len(items)


class InPlace:
    """Recovery in place for one training loop (see the module docs). ``state`` is the mapping
    given to :func:`elastic_run.save` and :func:`elastic_run.load`: it is what a rank that is
    behind receives from a peer."""

    def __init__(self, state, *, timeout_s=TIMEOUT_S, offer_wait_s=OFFER_WAIT_S):
        from ._env import generation, rank, world_size

        self.state = state
        self.timeout_s = float(timeout_s)
        self.offer_wait_s = float(offer_wait_s)
        self.ddp = None
        self.step_count = None
        self.failed = None  # the exception (or reason) that failed the current step
        self.abandoned = []
        self.pending = _Pending()
        # Futures of the collectives issued on the current group, until done: one left
        # undone at a switch means the old group has a blocked thread.
        self.works = []
        self.switches = 0
        self.store, self.group = _form_group(self.timeout_s)
        self.offers = _Offers(generation(), rank() - local_rank())
        self._watch_offers = threading.Thread(target=self._abort_on_offer, name="elastic_run-abort",
                                              daemon=True)
        self._watch_offers.start()
        self.world = world_size()
        _state.in_place = self

    # --- what the loop calls -----------------------------------------------------------------

    def attach(self, ddp):
        """Routes ``ddp``'s gradient all-reduce through the switchable group (a comm hook) and
        moves it to each new group."""
        self.ddp = ddp
        ddp.register_comm_hook(None, self._hook)

    def load(self):
        """:func:`elastic_run.load` of the state (what the agent restored, if anything), then
        the step agreed with the live peers of this generation: a rank behind receives the
        state from one ahead. Returns the step (0 for a fresh start)."""
        from ._load import load

        step = load(self.state) or 0
        self.step_count = self._agree(step)
        return self.step_count

    def switch_pending(self):
        """Whether the loop must switch before its next step: a generation was offered, or the
        last step failed (a new generation must follow)."""
        return self.failed is not None or self.offers.pending()

    def step(self):
        """A context for one step's forward and backward: a collective that fails inside it
        ends the block and fails the step (:meth:`commit` then says no)."""
        self.failed = None
        self.works = [f for f in self.works if not f.done()]
        return _StepBlock(self)

    def commit(self):
        """The vote, after the backward and before ``optimizer.step()``: True when every rank's
        collectives of this step held. False drops the step on every rank."""
        if self.failed is not None:
            ok = 0
        elif self.offers.pending():
            self.failed = "a new generation was offered during the step"
            ok = 0
        else:
            ok = 1
        import torch

        t = torch.tensor([ok], dtype=torch.int64, device=self._device())
        result = self._wait(lambda: self.group.allreduce([t], _reduce_op("MIN")), t)
        if result is None:
            self.failed = self.failed or "the commit vote did not complete"
            return False
        if int(t[0]) != 1:
            self.failed = self.failed or "another rank's step failed"
            return False
        return True

    def switch(self, step=None):
        """Leaves the old group for the offered generation's (waiting for the offer up to
        ``offer_wait_s``) and returns the step every rank of the new group continues from.
        ``step``: the last step this rank applied (default: as the loop left it)."""
        from ._save import wait as wait_saves

        if step is not None:
            self.step_count = step
        started = time.monotonic()
        offer = self.offers.take(self.offer_wait_s)
        if offer is None:
            why = self.failed
            if isinstance(why, BaseException):
                raise why
            raise SwitchError(f"elastic_run: no new generation was offered within {self.offer_wait_s:g} s "
                              f"after: {why}")
        generation, offset, env = offer
        try:
            wait_saves()
        except Exception as e:  # the save's own error was reported to the agent
            print(f"elastic_run: the save in flight failed before the switch: {e}", flush=True)
        for k, v in env.items():
            if v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        new_rank = offset + local_rank()
        os.environ["RANK"] = os.environ["ROLE_RANK"] = str(new_rank)
        conn = _agent_conn()
        if conn is not None:
            conn.request(_msg_switched(new_rank, generation))
        self.offers.switched(generation, offset)
        self._retire(self.group, self.store)
        self.store, self.group = _form_group(self.timeout_s)
        from ._env import world_size

        self.world = world_size()
        if self.ddp is not None:
            self.ddp._update_process_group(self.group)
        self.failed = None
        self.step_count = self._agree(self.step_count or 0)
        os.environ["ELASTIC_RESUME_STEP"] = str(self.step_count)
        self._restart_lr_scaling()
        self.switches += 1
        _state.checkpoint_at = None
        ms = (time.monotonic() - started) * 1000
        if new_rank == 0:
            print(f"elastic_run: switched to generation {generation} in place at step {self.step_count} "
                  f"(world {self.world}) in {ms:.0f} ms", flush=True)
        return self.step_count

    def close(self):
        """Stops watching for generations and shuts the group down, at the end of training (as
        ``destroy_process_group`` at the end of a script)."""
        self.offers.stopped = True
        self.pending.fail_all()
        _state.in_place = None
        # As destroy_process_group does at the end of a script: a group left to the
        # interpreter's exit may still hear its peers leave and fail then.
        if not any(not f.done() for f in self.works):
            try:
                self.group.shutdown()
            except Exception:  # noqa: BLE001 (a peer that left first may make it refuse)
                pass

    # --- inside ----------------------------------------------------------------------------------

    def _all_reduce_max(self, values):
        import torch

        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self._device())
        if self._wait(lambda: self.group.allreduce([t], _reduce_op("MAX")), t) is None:
            self.failed = self.failed or "a collective of should_stop did not complete"
            return list(values)
        return [int(x) for x in t.tolist()]

    def _device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def _abort_on_offer(self):
        while True:
            self.offers.changed.wait()
            if self.offers.pending():
                self.pending.fail_all()
            time.sleep(_POLL_S)

    def _hook(self, _state_unused, bucket):
        """DDP comm hook: the bucket's all-reduce, on a copy, on the current group; a failure
        or an offer completes the future with the bucket unchanged and fails the step."""
        import torch

        buf = bucket.buffer()
        out = torch.futures.Future()
        lock = threading.Lock()
        finished = [False]
        copy = buf.clone()
        world = self.world

        def finish(ok, why=None):
            with lock:
                if finished[0]:
                    return
                finished[0] = True
            self.pending.done(key)
            if ok:
                buf.copy_(copy).div_(world)
            elif self.failed is None:
                self.failed = why or "a gradient all-reduce was given up"
            out.set_result(buf)

        key = self.pending.add(lambda: finish(False, "a new generation was offered during the all-reduce"))
        if self.offers.pending():
            finish(False, "a new generation was offered")
            return out
        try:
            work = self.group.allreduce([copy])
        except Exception as e:  # noqa: BLE001 (any failure to issue fails the step)
            finish(False, e)
            return out

        def done(f):
            try:
                f.value()
            except Exception as e:  # noqa: BLE001
                finish(False, e)
                return
            finish(True)

        fut = work.get_future()
        self.works.append(fut)
        fut.add_done_callback(done)
        return out

    def _wait(self, issue, t):
        """Runs one small collective, waiting in slices: None when it failed, timed out, or an
        offer came meanwhile (the collective is then given up)."""
        try:
            work = issue()
        except Exception as e:  # noqa: BLE001
            self.failed = self.failed or e
            return None
        ev = threading.Event()
        err = []

        def done(f):
            try:
                f.value()
            except Exception as e:  # noqa: BLE001
                err.append(e)
            ev.set()

        fut = work.get_future()
        self.works.append(fut)
        fut.add_done_callback(done)
        deadline = time.monotonic() + self.timeout_s
        while not ev.wait(_POLL_S):
            if self.offers.pending() or time.monotonic() > deadline:
                return None
        if err:
            self.failed = self.failed or err[0]
            return None
        return t

    def _retire(self, group, store):
        """Lets go of the old group: destroyed when nothing is blocked in it, else kept (its
        threads are blocked) and given up at exit."""
        self.pending.fail_all()
        blocked = any(not f.done() for f in self.works)
        self.works = []
        if blocked:
            # Never destroyed, not even at exit: its destructor would join threads that are
            # blocked on a peer that is gone. One reference more than anyone holds keeps it.
            import ctypes

            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
            self.abandoned.append((group, store))
            if len(self.abandoned) > _ABANDONED_GROUPS_MAX:
                raise SwitchError(f"elastic_run: {len(self.abandoned)} process groups were given up "
                                  "with collectives blocked in them; restart the worker")
            return
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001 (a group whose peer died may refuse; it is dropped)
            pass

    def _agree(self, step):
        """The step every rank of the current group continues from, the highest any holds:
        ranks behind receive the state from the lowest rank at it."""
        import torch

        if self.world == 1:
            return step
        dev = self._device()
        t = torch.tensor([step, -step], dtype=torch.int64, device=dev)
        self._sync(lambda: self.group.allreduce([t], _reduce_op("MAX")))
        hi, lo = int(t[0]), -int(t[1])
        if hi == lo:
            return step
        from ._env import rank

        me = rank()
        src = torch.tensor([-(me if step == hi else self.world)], dtype=torch.int64, device=dev)
        self._sync(lambda: self.group.allreduce([src], _reduce_op("MAX")))
        source = -int(src[0])
        self._broadcast_state(source, me)
        return hi

    def _sync(self, issue):
        work = issue()
        self.works.append(work.get_future())
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise SwitchError(f"elastic_run: a collective of the switch failed: {e}") from e

    def _broadcast_state(self, source, me):
        """The whole state from rank ``source`` to every other rank of the group: a JSON header
        (the skeleton, and each tensor's name, dtype and shape), then the tensors."""
        import torch

        from . import _tree

        dev = self._device()
        if me == source:
            tensors, skeleton, shards = _tree.encode(self.state)
            if shards:
                raise SwitchError("elastic_run: sharded (FSDP2) state cannot be healed from a peer yet")
            names = sorted(tensors)
            header = json.dumps({"skeleton": skeleton,
                                 "tensors": [[n, str(tensors[n].dtype).removeprefix("torch."),
                                              list(tensors[n].shape)] for n in names]}).encode()
            size = torch.tensor([len(header)], dtype=torch.int64, device=dev)
        else:
            size = torch.tensor([0], dtype=torch.int64, device=dev)
        self._sync(lambda: self.group.broadcast([size], _bcast_opts(source)))
        n = int(size[0])
        if not 0 < n <= protocol.METADATA_BYTES_MAX:
            raise SwitchError(f"elastic_run: a state header of {n} bytes from rank {source}")
        if me == source:
            data = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=dev)
        self._sync(lambda: self.group.broadcast([data], _bcast_opts(source)))
        meta = protocol._parse_json(bytes(data.cpu().numpy()), f"state header from rank {source}")
        received = {}
        for name, dtype, shape in meta["tensors"]:
            if me == source:
                t = tensors[name].detach().contiguous().to(dev)
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
            self._sync(lambda t=t: self.group.broadcast([t], _bcast_opts(source)))
            received[name] = t
        if me != source:
            _tree.apply(self.state, meta["skeleton"], received, f"state received from rank {source}")

    def _restart_lr_scaling(self):
        from . import _lr, _tree

        for opt in _tree.optimizers(self.state):
            scaling = getattr(opt, _lr._ATTR, None)
            if scaling is not None:
                scaling._steps = 0


class _StepBlock:
    def __init__(self, ip):
        self.ip = ip

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and _is_collective_error(e):
            self.ip.failed = e
            return True
        return False


def _bcast_opts(root):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return opts


def _reduce_op(name):
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, name)
    return opts
