"""Recovery in place: when the job's membership changes, the workers are not restarted. The
agent offers the new generation over the agent socket (a ``watch`` request held until one
comes); every worker leaves its old process group, forms the new generation's group, and
trains on from the weights in its memory.

    ip = er.InPlace(state)                     # forms this generation's process group
    ddp = ip.ddp(model)                        # DDP, made anew on each generation's group
    step = ip.load()                           # er.load(state), then agree with live peers
    while step < steps:
        if ip.switch_pending():                # a new generation (or a failed step)
            step = ip.switch(step)             # new group, ranks, scaling; the agreed step
        step += 1
        with ip.step():                        # a collective that fails ends the block
            loss = ddp(x).loss(); loss.backward()
        if not ip.commit():                    # the vote: every rank's collectives held
            step -= 1
            continue
        opt.step()

- **The vote.** :meth:`InPlace.commit` is one small all-reduce: a rank that saw a new
  generation offered during its step says no, and no rank applies the step. A rank whose
  collective failed (a peer died, or the agent offered a new generation while it was blocked
  on a peer that vanished) starts no other collective on that group, its vote included
  (collectives pair up by their order on each rank), so no peer's vote completes: they give it
  up when the generation is offered, and nobody applies the step. A rank that lost the vote's
  own result (a peer died in the middle of it) may be one step behind the others; the switch
  then gives it the state of a rank that is ahead.
- **The switch** (:meth:`InPlace.switch`): waits for the agent's offer, finishes the save in
  flight, takes the new environment (``RANK``, ``WORLD_SIZE``, ``MASTER_*``, the scaling),
  tells the agent, forms the group (a TCPStore at the generation's master address, hosted by
  rank 0), and agrees on the step: the ranks behind receive the whole state from the first
  rank that is furthest, over the new group. A worker that starts fresh in a generation
  (a joiner, or one restarted) does the same in :meth:`InPlace.load`, so the two meet.
- **Joiners heal from peers.** A node that joins members continuing from the generation
  before is started without a restore (``ELASTIC_HEAL_STEP`` names the step it would have
  restored): its ranks take the state from the continuing ranks, and nothing is read from the
  store. When no live rank holds that step (the continuing members were restarted too), the
  ranks that joined ask their agents to restore it (``restore``) and the ranks agree again.
- **Drains.** When another node is preempted, :func:`elastic_run.should_stop` tells this
  rank False (the draining node's ranks are told True): every rank saves the agreed step, the
  draining node's ranks exit, and the others switch to the generation without it.
- **Gradients** are averaged by the ``DistributedDataParallel`` behind :meth:`InPlace.ddp`,
  which every rank makes anew on each generation's group (its reducer is bound to one group,
  and re-orders its buckets after its first backward: fresh on every rank, a joiner's and a
  survivor's agree); its all-reduces go through the client (see ``_ddp``). A loop without
  DDP calls :meth:`InPlace.sync_gradients` after the backward: the mean in parameter order,
  in buffers of at most ``GRAD_BUFFER_BYTES`` (once per step, whatever the accumulation).
- **Aborting.** All-reduces run on a copy of the gradients, so a collective given up (blocked
  on a peer that vanished without closing its sockets) never writes into memory in use again.
  On NCCL the group's communicators are aborted (``ncclCommAbort``, within
  ``ABORT_TIMEOUT_S``), which ends the blocked collective. A gloo group with such a
  collective, or an NCCL one whose abort did not finish in time, is kept, never destroyed
  (its threads are blocked).
- **Bounds.** A failed step must be followed by a new generation within ``offer_wait_s``;
  otherwise the collective's error is raised (the worker fails and the agent restarts the
  group). Forming a group and every collective time out after ``timeout_s``.

The default ``torch.distributed`` group is not created: use :attr:`InPlace.group` (and
:func:`elastic_run.rank`, :func:`elastic_run.world_size`, which follow the switches) for
collectives of your own.
"""

import atexit
import datetime
import json
import os
import threading
import time

from . import _state, protocol
from ._connection import _Agent, _agent_conn
from ._env import _env_int, local_rank
from .protocol import FormatError, _get, _get_int, _msg_collective_failed, _msg_switched, _msg_watch


# How long a failed step waits for the agent to offer a new generation (the lost peer's lease
# must lapse first) before its error is raised.
OFFER_WAIT_S = 120.0
# Gradients are all-reduced in buffers of at most this many bytes (one parameter larger than it
# goes alone).
GRAD_BUFFER_BYTES = 32 * 1024 * 1024
# Every collective on a group.
TIMEOUT_S = 300.0
# Forming a group at a switch: the TCPStore and the connections to every rank (a peer that is
# restarted instead of switching needs its interpreter and torch first).
FORM_TIMEOUT_S = 90.0
# Offers taken at one switch while newer ones replace them.
_SWITCH_ATTEMPTS_MAX = 8
# A collective's completion is polled every _POLL_FINE_S for its first _POLL_FINE_FOR_S (a
# step's collectives: a late look is a late step), then every _POLL_S, which is also how soon a
# long wait notices an offer.
_POLL_FINE_S = 0.0001
_POLL_FINE_FOR_S = 0.05
_POLL_S = 0.005
# How long closing waits for the client's own threads to end.
_STOP_JOIN_S = 2.0
# Pause before the watch thread asks again after its connection failed.
_RECONNECT_PAUSE_S = 0.5
# Groups given up with a collective blocked in them: past this many the worker fails instead
# of piling up threads (the agent restarts it).
_ABANDONED_GROUPS_MAX = 8
# How long aborting an NCCL group's communicators may take before the group is kept instead.
ABORT_TIMEOUT_S = 10.0
# How often a rank tries rank 0's store at a switch, until it listens.
_LISTEN_POLL_S = 0.001
# Store keys of each generation's group live under this prefix.
_STORE_PREFIX = "elastic_run/inplace"


# The TCPStores this process serves, by port: a generation whose master port is one of them
# uses it again (the leader alternates a node's two master ports). The oldest is let go past
# _SERVED_STORES_MAX (rank 0 moved between nodes that many times).
_served = {}
_SERVED_STORES_MAX = 4


class SwitchError(RuntimeError):
    """A switch to a new generation could not be made (no offer came in time, or the group
    did not form); the worker should exit and let the agent restart it."""


# What a CollectiveGivenUp's message starts with.
_GIVEN_UP = "elastic_run: collective given up: "


class CollectiveGivenUp(RuntimeError):
    """A collective of the client's was given up (a new generation was offered while it was
    blocked, or it timed out) or failed: raised where the loop must stop the step, inside
    :meth:`InPlace.step`, which ends the block and fails the step."""


class _Superseded(SwitchError):
    """A newer generation was offered while this one's group formed (a member of this one was
    lost before it joined): the switch takes the newer one."""


def _is_collective_error(e):
    """Whether ``e`` is what a collective raises when a peer is gone (gloo's connection
    errors, a timed-out wait, a distributed backend error)."""
    try:
        import torch.distributed as dist

        if isinstance(e, dist.DistError):
            return True
    except (ImportError, AttributeError):
        pass
    if isinstance(e, CollectiveGivenUp):
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e)
    # (A CollectiveGivenUp raised through a future DDP waits for reaches the loop as a
    # RuntimeError that quotes it.)
    return any(s in text for s in ("gloo", "Connection reset", "Connection closed", "Timed out", "NCCL",
                                   _GIVEN_UP))


class _Offers:
    """The generations the agent offers, heard by a daemon thread that holds a ``watch``
    request on its own connection. An offer is ``(generation, rank_offset, rank, env)``:
    ``rank`` is this worker's in it, as the agent maps it (local ranks may all read 0 under
    torchrun's virtual local rank)."""

    def __init__(self, generation, rank):
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.current = generation
        self.rank = rank
        self.offer = None
        self.stopped = False
        self.conn = None
        path = os.environ.get("ELASTIC_AGENT_SOCKET")
        self.thread = None
        if path:
            self.conn = _Agent(path)
            self.thread = threading.Thread(target=self._run, name="elastic_run-watch", daemon=True)
            self.thread.start()

    def _run(self):
        conn = self.conn
        while not self.stopped:
            with self.lock:
                gen, rank = (self.offer[0], self.offer[2]) if self.offer else (self.current, self.rank)
            try:
                reply = conn.request(_msg_watch(rank, gen), timeout_s=protocol.WATCH_HOLD_S + 30.0,
                                     expect=protocol.REPLY_GENERATION)
                where = "agent reply to 'watch'"
                g = _get_int(where, reply, "generation", 0, protocol.STEP_MAX)
                o = _get_int(where, reply, "rank_offset", 0, protocol.WORLD_SIZE_MAX - 1)
                r = _get_int(where, reply, "rank", 0, protocol.WORLD_SIZE_MAX - 1)
                env = _get(where, reply, "env", dict, {})
                if any(not isinstance(k, str) or not isinstance(v, str) for k, v in env.items()):
                    raise FormatError(f"{where}: env holds a value that is not a string")
            except (OSError, FormatError, RuntimeError):
                conn.close()
                if not self.stopped:
                    time.sleep(_RECONNECT_PAUSE_S)
                continue
            if g != gen and env:
                with self.lock:
                    self.offer = (g, o, r, env)
                self.changed.set()

    def stop(self):
        """Ends the watch thread: its held request is cut off, and not sent again (a thread
        still blocked in it when the interpreter exits would wake up in a half torn-down
        interpreter)."""
        self.stopped = True
        self.changed.set()
        if self.conn is not None:
            self.conn.shut()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(_STOP_JOIN_S)

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

    def switched(self, generation, rank):
        with self.lock:
            self.current, self.rank = generation, rank
            if self.offer is not None and self.offer[0] == generation:
                self.offer = None


def _group_params():
    """What forming this generation's group needs from the environment (``RANK``,
    ``WORLD_SIZE``, ``ELASTIC_GENERATION``, ``MASTER_ADDR``, ``MASTER_PORT``), read at once."""
    from ._env import generation, rank, world_size

    return (rank(), world_size(), generation(), os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "0")))


def _form_group(timeout_s, params=None):
    """This generation's process group (``params`` from :func:`_group_params`, read now when
    None): a TCPStore hosted by rank 0 and a gloo (CPU) or NCCL (CUDA) group on a prefix of the
    generation's own. Returns ``(store, group)``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroup, TCPStore

    r, w, g, addr, port = params if params is not None else _group_params()
    timeout = datetime.timedelta(seconds=timeout_s)
    if r == 0 and port in _served:
        # This process served the store of an earlier generation on this port (the leader
        # alternates a node's two master ports), and that store may still be alive (held by
        # a group given up, or by references not yet collected): keys are per generation,
        # so it serves this one too.
        store = _served[port]
    else:
        if r != 0:
            _await_listener(addr, port, timeout_s)
        store = TCPStore(addr, port, w, is_master=(r == 0), timeout=timeout, wait_for_workers=False)
        if r == 0:
            _served[port] = store
            while len(_served) > _SERVED_STORES_MAX:
                del _served[next(iter(_served))]
    prefixed = PrefixStore(f"{_STORE_PREFIX}/{g}/", store)
    pg = ProcessGroup(prefixed, r, w)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # Non-blocking communicators: a peer gone while the group forms does not hold this
        # rank in ncclCommInitRank for ever (the wait for a communicator is bounded by
        # TORCH_NCCL_NONBLOCKING_TIMEOUT, which defaults here to the group's timeout), and an
        # abort can end it.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s))))
        try:
            opts.config.blocking = 0
        except AttributeError:  # a build without NCCL's config
            pass
        backend = dist.ProcessGroupNCCL(PrefixStore("nccl/", prefixed), r, w, opts)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda", torch.cuda.current_device())
    else:
        backend = dist.ProcessGroupGloo(PrefixStore("gloo/", prefixed), r, w, timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    pg._register_backend(device, kind, backend)
    pg._set_default_backend(kind)
    pg._set_group_name(f"elastic_run_{g}")
    return store, pg


def _await_listener(addr, port, timeout_s):
    """Waits until something listens on ``addr:port`` (rank 0's store), trying every
    ``_LISTEN_POLL_S``, for at most ``timeout_s``. A TCPStore client that comes before its
    server backs off for about half a second after the first refusal; the ranks of a switch
    reach the new group within milliseconds of each other, so rank 0 is often a little late."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.001, min(1.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return  # the store's own connect says why
            time.sleep(_LISTEN_POLL_S)


class InPlace:
    """Recovery in place for one training loop (see the module docs). ``state`` is the mapping
    given to :func:`elastic_run.save` and :func:`elastic_run.load`: it is what a rank that is
    behind receives from a peer."""

    def __init__(self, state, *, timeout_s=TIMEOUT_S, offer_wait_s=OFFER_WAIT_S):
        from ._env import generation, rank, world_size

        self.state = state
        self.timeout_s = float(timeout_s)
        self.offer_wait_s = float(offer_wait_s)
        self.failed = None  # the exception (or reason) that failed the current step
        # Why a new generation is awaited though no step failed (another node drains).
        self.awaiting = None
        self.abandoned = []
        # Futures of the collectives issued on the current group, until done: one left
        # undone at a switch means the old group has a blocked thread.
        self.works = []
        self.store, self.group = _form_group(self.timeout_s)
        self.offers = _Offers(generation(), rank())
        self.world = world_size()
        self.closed = False
        # The generation whose failed collective was reported to the agent.
        self.reported_for = None
        # The modules of ddp(), made anew on each generation's group.
        self.models = []
        # The group on which a collective failed or was given up (none is started on it).
        self.broken = None
        _state.in_place = self
        # Threads of its own end before the interpreter does, should the loop not close it.
        atexit.register(self.close)

    # --- what the loop calls -----------------------------------------------------------------

    def load(self):
        """:func:`elastic_run.load` of the state (what the agent restored, if anything), then
        the step agreed with the live peers of this generation: a rank behind receives the
        state from one ahead. Returns the step (0 for a fresh start).

        A worker whose node joined a generation with continuing members was started without a
        restore (``$ELASTIC_HEAL_STEP``): it takes the state from them, reading nothing from
        the store, unless no live rank holds that step (they were restarted too); then it asks
        its agent to restore it."""
        from ._env import heal_step
        from ._load import load

        heal = heal_step()
        if heal is None:
            step = self._agree(load(self.state) or 0)
        else:
            step = self._agree(0, need=heal)
            os.environ.pop("ELASTIC_HEAL_STEP", None)
        self._started_at(step)
        return step

    def switch_pending(self):
        """Whether the loop must switch before its next step: a generation was offered, the
        last step failed, or another node drained (a new generation must follow)."""
        return self.failed is not None or self.awaiting is not None or self.offers.pending()

    def ddp(self, module, **kwargs):
        """``module`` in a ``DistributedDataParallel`` (``kwargs`` are its own, but for
        ``process_group`` and ``init_sync``) that follows the switches: the module returned is
        the one to call in the loop, and the DDP behind it is made anew on each generation's
        group. Its gradient all-reduces, its buffer broadcast (``broadcast_buffers``, on by
        default) and its bucket layout go through the client, so a peer that vanished fails
        the step instead of blocking it; :meth:`sync_gradients` is then not called (it does
        nothing for such a module)."""
        from . import _ddp

        m = _ddp.wrap(self, module, kwargs)
        self.models.append(m)
        return m

    def step(self):
        """A context for one step's forward and backward: a collective that fails inside it
        ends the block and fails the step (:meth:`commit` then says no)."""
        self.failed = None
        self.works = [f for f in self.works if not f.done()]
        return _StepBlock(self)

    def sync_gradients(self, params):
        """Replaces every gradient of ``params`` (a module or an iterable of parameters) with its
        mean over the group's ranks. A parameter without a gradient counts as zeros. Returns
        False when a collective failed or a new generation came (the step then fails)."""
        import torch

        if any(params is m for m in self.models):
            return self.failed is None  # its DDP averaged them in the backward
        if hasattr(params, "parameters"):
            params = params.parameters()
        params = [p for p in params if p.requires_grad]
        if self.world == 1 or self.failed is not None:
            return self.failed is None
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for chunk in _grad_buffers(params):
            flat = torch.cat([p.grad.reshape(-1) for p in chunk])
            if self._wait(lambda flat=flat: self.group.allreduce([flat]), flat) is None:
                self.failed = self.failed or "a gradient all-reduce did not complete"
                return False
            flat.div_(self.world)
            offset = 0
            for p in chunk:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        return True

    def commit(self):
        """The vote, after the backward and before ``optimizer.step()``: True when every rank's
        collectives of this step held. False drops the step on every rank."""
        if self.failed is not None:
            ok = 0
            if not self.offers.pending():  # else the regroup was made already
                self._report_failure()
        elif self.offers.pending():
            self.failed = "a new generation was offered during the step"
            ok = 0
        else:
            ok = 1
        import torch

        t = torch.tensor([ok], dtype=torch.int64, device=self._device())
        before = self.failed
        result = self._wait(lambda: self.group.allreduce([t], _reduce_op("MIN")), t)
        if result is None:
            if before is None:
                why = self.failed if self.failed is not None else "given up for a newer generation"
                self.failed = f"the commit vote did not complete ({why})"
            if not self.offers.pending():
                # The vote itself failed (a peer died inside it): the agent is told at once,
                # as for a failed step, rather than left to wait for the lost peer's lease.
                self._report_failure()
            return False
        if int(t[0]) != 1:
            self.failed = self.failed or "another rank's step failed"
            return False
        return True

    def switch(self, step):
        """Leaves the old group for the offered generation's (waiting for the offer up to
        ``offer_wait_s``) and returns the step every rank of the new group continues from.
        ``step``: the last step this rank applied. A switch whose collectives fail (a member
        was lost meanwhile) waits for the next generation and switches to it, at most
        ``_SWITCH_ATTEMPTS_MAX`` times."""
        from ._save import wait as wait_saves

        from ._env import world_size

        started = time.monotonic()
        # Where the switch's time goes, in seconds: printed by rank 0.
        spent = dict.fromkeys(("save", "offer", "group", "agree"), 0.0)
        mark = [started]

        def lap(phase):
            now = time.monotonic()
            spent[phase] += now - mark[0]
            mark[0] = now

        try:
            wait_saves()
        except Exception as e:  # the save's own error was reported to the agent
            print(f"elastic_run: the save in flight failed before the switch: {e}", flush=True)
        lap("save")
        blocked = False
        for _ in range(_SWITCH_ATTEMPTS_MAX):
            generation, new_rank = self._take_offer()
            lap("offer")
            blocked = blocked or any(not f.done() for f in self.works)
            if self.group is not None:
                old, self.group, self.store = (self.group, self.store), None, None
                self._retire(*old)
                del old
            self.failed = None
            self.awaiting = None
            try:
                self.store, self.group = self._form(min(self.timeout_s, FORM_TIMEOUT_S))
                lap("group")
                self.world = world_size()
                step = self._agree(step)
                for m in self.models:
                    m._regroup(self.group, blocked)
                lap("agree")
                break
            except _Superseded as e:
                print(f"elastic_run: {e}; taking the newer one", flush=True)
            except (SwitchError, RuntimeError) as e:
                # A member was lost while the group formed or the ranks agreed (the rank whose
                # state a joiner takes, say): this rank's state is as it was, and the
                # generation without that member is offered once the job regroups.
                print(f"elastic_run: the switch to generation {generation} failed ({e}); waiting for the next",
                      flush=True)
                self.failed = e
                self._report_failure()
            lap("group")
        else:
            raise SwitchError(f"elastic_run: no switch completed in {_SWITCH_ATTEMPTS_MAX} attempts")
        self._started_at(step)
        _state.checkpoint_at = None
        ms = (time.monotonic() - started) * 1000
        if new_rank == 0:
            parts = ", ".join(f"{k} {v * 1000:.0f}" for k, v in spent.items())
            print(f"elastic_run: switched to generation {generation} in place at step {step} "
                  f"(world {self.world}) in {ms:.0f} ms ({parts} ms)", flush=True)
        return step

    def _form(self, timeout_s):
        """:func:`_form_group` on a helper thread, given up (``_Superseded``) when a newer
        generation is offered meanwhile: forming blocks until every rank has come, and a
        member lost after the leader froze this generation never comes, so without this the
        rank would wait out ``timeout_s`` before it could take the generation without it. A
        thread given up stays blocked until its own timeout; past ``_ABANDONED_GROUPS_MAX`` of
        them and of groups given up, the worker fails (the agent restarts it)."""
        import torch

        from ._env import generation

        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
        params = _group_params()
        done = threading.Event()
        box = {}

        def run():
            try:
                box["group"] = _form_group(timeout_s, params)
            except BaseException as e:  # noqa: BLE001 (handed to the switching thread)
                box["error"] = e
            finally:
                done.set()

        t = threading.Thread(target=run, name=f"elastic_run-form-{params[2]}", daemon=True)
        t.start()
        while not done.wait(_POLL_S):
            if self.offers.pending():
                self._abandon(t)
                raise _Superseded(f"generation {generation()} was superseded while its group formed")
        if "error" in box:
            raise box["error"]
        return box["group"]

    def _abandon(self, thread):
        """Gives up a helper thread blocked in a collective (it ends with its own timeout);
        past ``_ABANDONED_GROUPS_MAX`` of them and of groups given up, the worker fails (the
        agent restarts it)."""
        self.abandoned.append((thread, None))
        if len(self.abandoned) > _ABANDONED_GROUPS_MAX:
            raise SwitchError(f"elastic_run: {len(self.abandoned)} process groups were given up "
                              "while blocked; restart the worker")

    def _take_offer(self):
        """Waits for the agent's offer (up to ``offer_wait_s``), says ``switched``, and takes
        the offered environment. Returns the generation and this rank in it."""
        from ._connection import AgentError

        for _ in range(_SWITCH_ATTEMPTS_MAX):
            offer = self.offers.take(self.offer_wait_s)
            if offer is None:
                why = self.failed or self.awaiting
                if isinstance(why, BaseException):
                    raise why
                raise SwitchError(f"elastic_run: no new generation was offered within {self.offer_wait_s:g} s "
                                  f"after: {why}")
            generation, _offset, new_rank, env = offer
            conn = _agent_conn()
            try:
                if conn is not None:
                    conn.request(_msg_switched(new_rank, generation))
                break
            except AgentError as e:
                # A newer generation replaced the offer meanwhile: take that one.
                print(f"elastic_run: the switch to generation {generation} was refused ({e}); taking the newer offer",
                      flush=True)
                time.sleep(_POLL_S)
        else:
            raise SwitchError(f"elastic_run: no switch was accepted in {_SWITCH_ATTEMPTS_MAX} attempts")
        for k, v in env.items():
            if v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ["RANK"] = os.environ["ROLE_RANK"] = str(new_rank)
        self.offers.switched(generation, new_rank)
        return generation, new_rank

    def close(self):
        """Stops watching for generations and shuts the group down, at the end of training (as
        ``destroy_process_group`` at the end of a script)."""
        if self.closed:
            return
        self.closed = True
        self.offers.stop()
        for m in self.models:
            m._stop()
        _state.in_place = None
        # As destroy_process_group does at the end of a script: a group left to the
        # interpreter's exit may still hear its peers leave and fail then.
        if self.group is not None and not any(not f.done() for f in self.works):
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

    def _node_leaves(self, asked):
        """Whether this rank's node is the one that drains, when the ranks agreed to stop:
        one MAX all-reduce over a flag per node, set by each node's local rank 0 from its own
        agent's answer (``asked``)."""
        from ._env import local_rank

        nodes = _env_int("GROUP_WORLD_SIZE", 1, 1, protocol.WORLD_SIZE_MAX)
        me = _env_int("GROUP_RANK", 0, 0)
        if not 0 <= me < nodes:
            return True
        flags = [0] * nodes
        if local_rank() == 0:
            flags[me] = 1 if asked else 0
        return bool(self._all_reduce_max(flags)[me])

    def _peer_drains(self, step):
        """Another node drains at ``step``: this rank saves the same step and then waits for
        the generation without that node (:meth:`switch_pending`)."""
        self.awaiting = f"another node drained at step {step}"

    def _device(self):
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

    def _report_failure(self):
        """Tells the agent, once per generation, that a collective of this rank failed: it asks
        etcd to regroup now rather than wait for a lost peer's lease to lapse."""
        from ._env import generation, rank

        g = generation()
        conn = _agent_conn()
        if conn is None or self.reported_for == g:
            return
        self.reported_for = g
        try:
            conn.request(_msg_collective_failed(rank(), g, str(self.failed)))
        except (OSError, RuntimeError) as e:  # the lease still decides
            print(f"elastic_run: cannot tell the agent of the failed collective: {e}", flush=True)

    def _wait(self, issue, t):
        """Runs one collective, waiting in slices: None when it failed, timed out, or an offer
        came meanwhile (the collective is then given up). The future is polled, never given a
        Python callback: a collective given up may complete on a backend thread at any time,
        even while the interpreter exits."""
        try:
            fut = self._issue(issue)
            if self._given_up(fut) is not None:
                self._broken()
                return None
            fut.value()
        except Exception as e:  # noqa: BLE001
            self._broken()
            self.failed = self.failed or e
            return None
        return t

    def _issue(self, issue):
        """Starts one collective and records its future (one left undone at a switch means
        the group has a blocked thread). None is started on a group where one failed or was
        given up (:meth:`_broken`)."""
        if self.broken is not None and self.broken is self.group:
            raise CollectiveGivenUp(f"{_GIVEN_UP}a collective of this generation's group failed or was given up; "
                                    "no other is started on it")
        fut = issue().get_future()
        self.works.append(fut)
        return fut

    def _broken(self, group=None):
        """A collective on the current group failed or was given up: this rank starts no other
        on it. Collectives are matched by their order on each rank, so one that this rank left
        while its peers go on (a gradient all-reduce given up for an offer while a peer still
        runs it) would pair its next one, the vote say, with a different collective of theirs:
        gloo aborts the process on the size mismatch, or mixes the bytes up. The peers' own
        collectives then wait for the offer, as this rank does; the step is dropped everywhere.
        ``group``: the group of the collective, by default the current one."""
        self.broken = group if group is not None else self.group

    def _given_up(self, fut):
        """Polls ``fut`` in slices until it is done (None), or says why it is given up: a newer
        generation was offered meanwhile, or ``timeout_s`` passed."""
        start = time.monotonic()
        while not fut.done():
            if self.offers.pending():
                return "a newer generation was offered"
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                return f"it did not complete in {self.timeout_s:g} s"
            time.sleep(_POLL_FINE_S if waited < _POLL_FINE_FOR_S else _POLL_S)
        return None

    def _retire(self, group, store):
        """Lets go of the old group: an NCCL group whose collective failed or is blocked is
        aborted; any other is destroyed when nothing is blocked in it, else kept (its threads
        are blocked) and given up at exit."""
        blocked = any(not f.done() for f in self.works)
        self.works = []
        if (blocked or self.failed is not None) and _abort_nccl(group):
            return
        if blocked:
            from ._env import rank

            print(f"elastic_run: rank {rank()} gives up its old process group with a collective blocked in it",
                  flush=True)
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

    def _agree(self, step, need=0):
        """The step every rank of the current group continues from, the highest any holds:
        ranks behind receive the state from the lowest rank at it. At a fresh start (step 0
        everywhere) every rank takes rank 0's state, its initial weights, as DDP's construction
        would broadcast them.

        ``need``: the step this rank's node joined at without restoring it (its generation's
        continuing members hold it). When no rank holds the highest such step, the ranks that
        joined without a restore ask their agents for it, and the ranks agree again."""
        import torch

        from ._env import heal_step, rank
        from ._load import load

        if self.world == 1:
            return (load(self.state) or 0) if step < need else step
        dev = self._device()
        me = rank()
        t = torch.tensor([step, -step, need], dtype=torch.int64, device=dev)
        self._sync(lambda: self.group.allreduce([t], _reduce_op("MAX")))
        hi, lo, need = int(t[0]), -int(t[1]), int(t[2])
        if hi < need:
            print(f"elastic_run: rank {me}: no live rank holds step {need} (the highest is {hi}); "
                  "restoring it from the checkpoint store", flush=True)
            if heal_step() is not None:
                step = load(self.state) or 0
            return self._agree(step)
        if hi == lo and hi > 0:
            return step
        if hi == 0:
            self._broadcast_state(0, me)
            return 0
        src = torch.tensor([-(me if step == hi else self.world)], dtype=torch.int64, device=dev)
        self._sync(lambda: self.group.allreduce([src], _reduce_op("MAX")))
        source = -int(src[0])
        self._broadcast_state(source, me)
        if step != hi:
            print(f"elastic_run: rank {me} took the state of step {hi} from rank {source} (it held step {step})",
                  flush=True)
        return hi

    def _sync(self, issue):
        """One collective of a switch or a heal, waited for in slices: a failure, the timeout, or
        a newer generation offered meanwhile (a peer vanished in the middle, without closing its
        sockets) raise :class:`SwitchError`, and the collective is given up."""
        try:
            fut = self._issue(issue)
            why = self._given_up(fut)
            if why is None:
                fut.value()
        except Exception as e:  # noqa: BLE001
            self._broken()
            raise SwitchError(f"elastic_run: a collective of the switch failed: {e}") from e
        if why is not None:
            self._broken()
            raise SwitchError(f"elastic_run: a collective of the switch was given up: {why}")

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

    def _started_at(self, step):
        """This generation's training starts after ``step``, on every rank alike: the LR warm-up
        counts from it (``ELASTIC_RESUME_STEP``, as after a restore)."""
        from . import _lr, _tree

        os.environ["ELASTIC_RESUME_STEP"] = str(step)
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
        if isinstance(e, SwitchError):  # the worker must be restarted
            return False
        if e is not None and (_is_collective_error(e) or self.ip.failed is not None):
            # The first reason stays (a DDP's hook names the collective it gave up).
            self.ip.failed = self.ip.failed or e
            return True
        return False


def _abort_nccl(group, timeout_s=None):
    """Aborts the NCCL communicators of ``group``, which ends any collective blocked in them.
    True when it was done within ``timeout_s`` (:data:`ABORT_TIMEOUT_S`); False for a group
    with no NCCL backend, or an abort that failed or did not finish in time (it goes on in a
    daemon thread, and the group must be kept)."""
    import torch

    from ._env import rank

    if not torch.cuda.is_available():
        return False
    import torch.distributed as dist

    try:
        backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 (no backend for the device: not an NCCL group)
        return False
    if not isinstance(backend, dist.ProcessGroupNCCL):
        return False
    done, failed = threading.Event(), []

    def abort():
        try:
            backend.abort()
        except Exception as e:  # noqa: BLE001
            failed.append(e)
        done.set()

    started = time.monotonic()
    threading.Thread(target=abort, name="elastic_run-nccl-abort", daemon=True).start()
    wait_s = ABORT_TIMEOUT_S if timeout_s is None else timeout_s
    if not done.wait(wait_s):
        print(f"elastic_run: rank {rank()}: aborting the NCCL group did not finish in {wait_s:g} s; keeping it",
              flush=True)
        return False
    if failed:
        print(f"elastic_run: rank {rank()}: aborting the NCCL group failed: {failed[0]}; keeping it", flush=True)
        return False
    print(f"elastic_run: rank {rank()} aborted its old NCCL group (a collective in it failed or is blocked) in "
          f"{(time.monotonic() - started) * 1000:.0f} ms", flush=True)
    return True


def _grad_buffers(params):
    """``params`` (with gradients) in runs of one dtype and at most ``GRAD_BUFFER_BYTES`` of
    gradient each, in order; a parameter larger than that is a run of its own."""
    run, size = [], 0
    for p in params:
        n = p.grad.numel() * p.grad.element_size()
        if run and (p.grad.dtype != run[0].grad.dtype or size + n > GRAD_BUFFER_BYTES):
            yield run
            run, size = [], 0
        run.append(p)
        size += n
    if run:
        yield run


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
