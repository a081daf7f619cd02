"""``DistributedDataParallel`` across switches in place (:meth:`elastic_run.InPlace.ddp`).

A DDP module is bound to one process group: its reducer holds the group, and its buckets are
laid out on its second iteration and agreed with rank 0. So the model the loop calls is a
stable :class:`InPlaceDDP` module, and the DDP behind it is made anew on every generation's
group, by every rank at the switch, so a joiner's DDP and a survivor's start alike.

Nothing of DDP may block the loop on a peer that vanished without closing its sockets, where
the client could not notice an offer:

- the gradient all-reduce of each bucket goes through a comm hook: it runs on a copy of the
  bucket, and a thread of the module's own polls it and completes the future DDP waits for,
  or fails it when a new generation is offered or the collective times out (the backward then
  raises, inside :meth:`~elastic_run.InPlace.step`, and the vote drops the step);
- DDP's construction does no collective (``init_sync=False``: the switch's agreement already
  gave every rank the same state);
- the buffers are broadcast from rank 0 before each forward by the client, polled, as DDP does
  with ``broadcast_buffers`` (the default); DDP's own broadcast is off;
- the bucket layout DDP agrees on its second iteration (a broadcast on its group) is run on a
  helper thread and polled, before DDP's forward finds it done.

A DDP given up with a collective blocked in it is kept, never destroyed, as its group is.
"""

import queue
import threading
import time

from . import _inplace


# The module class, made at first use (torch is imported lazily).
_CLASS = None


def _module_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import torch

    class InPlaceDDP(torch.nn.Module):
        """``module`` wrapped in a ``DistributedDataParallel`` that is made anew on each
        generation's group. Call it as the DDP module; ``.module`` is the model, and its
        ``state_dict`` has DDP's ``module.`` prefix. ``no_sync()`` works as DDP's."""

        def __init__(self, ip, module, kwargs):
            super().__init__()
            self.module = module
            kwargs = dict(kwargs)
            for k in ("process_group", "init_sync"):
                if k in kwargs:
                    raise ValueError(f"elastic_run: InPlace.ddp sets {k} itself")
            sync = kwargs.pop("forward_sync_buffers", None)
            broadcast = kwargs.pop("broadcast_buffers", None)
            state = self.__dict__
            state["_ip"] = ip
            state["_kwargs"] = kwargs
            state["_sync_buffers"] = (sync if sync is not None else broadcast if broadcast is not None else True)
            state["_layout_agreed"] = False
            state["_ddp"] = None
            state["_epoch"] = 0
            state["_hook_calls"] = 0
            state["_queue"] = queue.SimpleQueue()
            state["_thread"] = None
            state["_stopped"] = False
            # A DDP whose layout broadcast was given up blocked (its reducer is held).
            state["_blocked"] = False
            self._build(ip.group)

        # --- what the loop calls ----------------------------------------------------------

        def forward(self, *args, **kwargs):
            ip, ddp = self._ip, self._ddp
            if ip.world > 1:
                # When DDP would sync them: after a forward that needs the gradients synced
                # (not under no_grad, not inside no_sync).
                if self._sync_buffers and ddp.require_forward_param_sync:
                    self._broadcast_buffers()
                if torch.is_grad_enabled() and not self._layout_agreed:
                    self._agree_layout()
            return ddp(*args, **kwargs)

        def no_sync(self):
            """DDP's ``no_sync()``: the gradients of the backwards inside accumulate locally."""
            return self._ddp.no_sync()

        @property
        def ddp(self):
            """This generation's ``DistributedDataParallel`` (replaced at each switch)."""
            return self._ddp

        # --- the switch -------------------------------------------------------------------

        def _build(self, group):
            """A DDP of the module on ``group``: no collective (the ranks agreed on the state
            already), the comm hook, and no buffer broadcast of its own."""
            from torch.nn.parallel import DistributedDataParallel

            self.__dict__["_epoch"] += 1
            ddp = DistributedDataParallel(self.module, process_group=group, init_sync=False,
                                          forward_sync_buffers=False, **self._kwargs)
            ddp.register_comm_hook(self._epoch, self._hook)
            self.__dict__["_ddp"] = ddp
            # DDP agrees on its bucket layout after its first backward, unless it finds unused
            # parameters on a dynamic graph (then the layout is never rebuilt).
            self.__dict__["_layout_agreed"] = ddp.find_unused_parameters and not ddp.static_graph

        def _regroup(self, group, blocked):
            """At a switch: the old DDP's hooks are taken off the parameters (a DDP with a
            collective blocked in it, ``blocked``, is kept for ever, as its group), and a new
            one is made on ``group``."""
            old = self._ddp
            self.__dict__["_ddp"] = None
            blocked = blocked or self._blocked
            self.__dict__["_blocked"] = False
            if old is not None:
                old._remove_autograd_hooks()
                if blocked:
                    import ctypes

                    ctypes.pythonapi.Py_IncRef(ctypes.py_object(old))
            self._build(group)

        def _stop(self):
            self.__dict__["_stopped"] = True
            self._queue.put(None)
            t = self._thread
            if t is not None and t is not threading.current_thread():
                t.join(_inplace._STOP_JOIN_S)

        # --- inside -----------------------------------------------------------------------

        def _fail(self, why, group=None):
            """The error that fails the step, and the group marked broken (``group``, by default
            the current one): this rank starts no other collective on it."""
            ip = self._ip
            ip._broken(group)
            ip.failed = ip.failed or why
            return _inplace.CollectiveGivenUp(f"{_inplace._GIVEN_UP}{why}")

        def _hook(self, epoch, bucket):
            """DDP's comm hook: the bucket's all-reduce on a copy, completed (divided by the
            world) or failed by the module's thread. A bucket of a step that failed already, or
            during which a new generation was offered, is not all-reduced."""
            ip = self._ip
            self.__dict__["_hook_calls"] += 1
            out = torch.futures.Future()
            if ip.world == 1:
                out.set_result(bucket.buffer())
                return out
            if ip.failed is not None or ip.offers.pending():
                out.set_exception(self._fail(ip.failed or "a new generation was offered during the step"))
                return out
            flat = bucket.buffer().clone()
            group = ip.group
            try:
                fut = ip._issue(lambda: group.allreduce([flat]))
            except Exception as e:  # noqa: BLE001 (a peer gone before the collective started)
                out.set_exception(self._fail(e))
                return out
            self._ensure_thread()
            self._queue.put((epoch, group, fut, flat, out, ip.world))
            return out

        def _ensure_thread(self):
            if self._thread is None:
                t = threading.Thread(target=self._complete, name="elastic_run-ddp", daemon=True)
                self.__dict__["_thread"] = t
                t.start()

        def _complete(self):
            """The module's thread: each bucket's all-reduce polled until it is done, then its
            future completed; failed when it failed, when a new generation is offered, or after
            ``timeout_s``, and then the later buckets of the same DDP fail at once. A bucket of
            a DDP replaced meanwhile (a switch) fails without touching the loop's state."""
            failed_epoch = None
            while True:
                item = self._queue.get()
                if item is None or self._stopped:
                    return
                epoch, group, fut, flat, out, world = item
                stale = _inplace.CollectiveGivenUp(f"{_inplace._GIVEN_UP}a gradient all-reduce of an earlier generation")
                if epoch != self._epoch:
                    out.set_exception(stale)
                    continue
                if epoch == failed_epoch:
                    out.set_exception(self._fail("a gradient all-reduce of a step that failed", group))
                    continue
                why = self._poll(fut, epoch)
                if why is None:
                    try:
                        fut.value()
                    except Exception as e:  # noqa: BLE001
                        why = f"a gradient all-reduce failed: {e}"
                if why is None:
                    flat.div_(world)
                    out.set_result(flat)
                elif epoch != self._epoch:
                    out.set_exception(stale)
                else:
                    failed_epoch = epoch
                    out.set_exception(self._fail(why, group))

        def _poll(self, fut, epoch):
            ip = self._ip
            start = time.monotonic()
            while not fut.done():
                if ip.offers.pending() or epoch != self._epoch or self._stopped:
                    return "a gradient all-reduce was given up for a newer generation"
                waited = time.monotonic() - start
                if waited > ip.timeout_s:
                    return f"a gradient all-reduce did not complete in {ip.timeout_s:g} s"
                time.sleep(_inplace._POLL_FINE_S if waited < _inplace._POLL_FINE_FOR_S else _inplace._POLL_S)
            return None

        def _broadcast_buffers(self):
            """The module's buffers from rank 0, in runs of one dtype, polled."""
            ip = self._ip
            buffers = list(self.module.buffers())
            runs = {}
            for b in buffers:
                runs.setdefault(b.dtype, []).append(b)
            for run in runs.values():
                flat = torch.cat([b.detach().reshape(-1) for b in run])
                if ip._wait(lambda flat=flat: ip.group.broadcast([flat], _inplace._bcast_opts(0)), flat) is None:
                    raise self._fail(ip.failed or "the buffer broadcast did not complete")
                offset = 0
                with torch.no_grad():
                    for b in run:
                        n = b.numel()
                        b.copy_(flat[offset:offset + n].view_as(b))
                        offset += n

        def _agree_layout(self):
            """DDP's bucket layout, agreed with rank 0 after the first backward (a broadcast on
            the group), run on a helper thread and polled. Given up, the DDP is given up with
            its group at the switch."""
            ip = self._ip
            if ip.broken is not None and ip.broken is ip.group:
                raise self._fail("a collective of this generation's group failed or was given up")
            reducer = self._ddp.reducer
            done = threading.Event()
            box = {}

            def run():
                try:
                    box["rebuilt"] = reducer._rebuild_buckets()
                except BaseException as e:  # noqa: BLE001 (handed to the loop's thread)
                    box["error"] = e
                finally:
                    done.set()

            t = threading.Thread(target=run, name="elastic_run-ddp-layout", daemon=True)
            start = time.monotonic()
            t.start()
            while not done.wait(_inplace._POLL_S):
                if ip.offers.pending():
                    why = "DDP's bucket layout was given up for a newer generation"
                elif time.monotonic() - start > ip.timeout_s:
                    why = f"DDP's bucket layout did not complete in {ip.timeout_s:g} s"
                else:
                    continue
                self.__dict__["_blocked"] = True
                ip._abandon(t)
                raise self._fail(why)
            if "error" in box:
                raise self._fail(f"DDP's bucket layout failed: {box['error']}")
            if box.get("rebuilt"):
                self.__dict__["_layout_agreed"] = True

    _CLASS = InPlaceDDP
    return _CLASS


def wrap(ip, module, kwargs):
    return _module_class()(ip, module, kwargs)
