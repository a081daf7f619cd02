"""The connection to the agent over ``$ELASTIC_AGENT_SOCKET`` (one request line, one reply
line; see :mod:`elastic_run.protocol`), and what the training loop asks it: progress reports,
the agreed stop, and checkpoint requests."""

import os
import socket
import time

from . import _distributed, _state, protocol
from ._env import checkpoint_interval, local_rank, rank
from .protocol import (
    FormatError,
    _describe,
    _encode,
    _get,
    _get_int,
    _msg_peer_stop,
    _msg_progress,
    _msg_query,
    _msg_restore,
    _parse_json,
)

# Progress reports are rate-limited: the watchdog works in seconds, not steps.
PROGRESS_INTERVAL_S = 0.1
SOCKET_TIMEOUT_S = 30.0
# A `saved` reply waits while earlier checkpoints are still being committed (the agent bounds
# how far training may run ahead of the store); a slow store can hold it this long.
SAVED_TIMEOUT_S = 1800.0


class AgentError(RuntimeError):
    """The agent refused a request."""


class _Agent:
    def __init__(self, path):
        self.path = path
        self.sock = None
        self.buf = b""
        # Set by shut(): no request is sent again (no reconnect).
        self.shut_down = False

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(SOCKET_TIMEOUT_S)
        s.connect(self.path)
        self.sock = s
        self.buf = b""

    def request(self, obj, timeout_s=None, expect=protocol.REPLY_OK):
        """Sends ``obj`` and returns the reply, which must be of type ``expect``."""
        timeout_s = SOCKET_TIMEOUT_S if timeout_s is None else timeout_s
        line = _encode(obj)
        if len(line) > protocol.MESSAGE_BYTES_MAX:
            raise AgentError(f"message of {len(line)} bytes exceeds {protocol.MESSAGE_BYTES_MAX}")
        for attempt in (0, 1):
            try:
                if self.sock is None:
                    if self.shut_down:
                        raise ConnectionError("the connection to the agent was shut")
                    self._connect()
                self.sock.settimeout(timeout_s)
                self.sock.sendall(line)
                reply = self._read_reply()
                break
            except socket.timeout:
                # The agent got the request and has not answered: sending it again would not
                # help (and would repeat it).
                self.close()
                raise AgentError(f"no reply from the agent within {timeout_s:g} s to {obj.get('type')!r}") from None
            except OSError:
                # One reconnect: the agent may have closed an idle connection.
                self.close()
                if attempt == 1:
                    raise
        if reply["type"] != expect:
            kind = _describe(reply["type"])
            raise FormatError(f"agent reply to {obj.get('type')!r} is of type {kind}, not {expect!r}")
        return reply

    def _read_reply(self):
        while b"\n" not in self.buf:
            if len(self.buf) >= protocol.MESSAGE_BYTES_MAX:
                self._too_long()
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("agent closed the connection")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        if len(line) >= protocol.MESSAGE_BYTES_MAX:
            self._too_long()
        reply = _parse_json(line, "agent reply")
        if not isinstance(reply, dict):
            raise FormatError(f"agent reply {_describe(line)}: not a JSON object")
        if _get("agent reply", reply, "type", str) == protocol.REPLY_ERROR:
            raise AgentError(_get("agent reply", reply, "message", str, "agent error"))
        return reply

    def _too_long(self):
        # The next line boundary is unknown: this connection is done.
        self.close()
        raise FormatError(f"agent reply longer than {protocol.MESSAGE_BYTES_MAX} bytes")

    def shut(self):
        """Cuts off a request in flight (from another thread) and refuses any later one."""
        self.shut_down = True
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None


def _agent_conn():
    """The agent connection, or None when not running under elastic-run."""
    path = os.environ.get("ELASTIC_AGENT_SOCKET")
    if not path:
        return None
    if _state.agent is None or _state.agent.path != path:
        _state.agent = _Agent(path)
    return _state.agent


def restore(step):
    """Asks the agent to restore ``step`` from the checkpoint store for this node's ranks (once
    for all of them): the node joined without restoring it (``$ELASTIC_HEAL_STEP``) and no live
    peer held it. The agent may give the newest older step that verifies. Returns ``(step,
    dir)`` and sets ``ELASTIC_RESUME_STEP`` and ``ELASTIC_RESUME_DIR`` as for a worker started
    after a restore."""
    conn = _agent_conn()
    if conn is None:
        raise AgentError(f"ELASTIC_HEAL_STEP is {step}, but there is no agent to restore it (ELASTIC_AGENT_SOCKET)")
    reply = conn.request(_msg_restore(rank(), step), timeout_s=protocol.RESTORE_WAIT_S,
                         expect=protocol.REPLY_RESTORED)
    where = f"agent reply to {protocol.MSG_RESTORE!r}"
    got = _get_int(where, reply, "step", 0, int(step))
    d = _get(where, reply, "dir", str)
    if not d:
        raise FormatError(f"{where}: an empty dir")
    os.environ["ELASTIC_RESUME_STEP"] = str(got)
    os.environ["ELASTIC_RESUME_DIR"] = d
    os.environ.pop("ELASTIC_HEAL_STEP", None)
    return got, d


def report_progress(step, force=False):
    """Tells the agent this rank finished ``step`` (feeds the hang watchdog). Rate-limited."""
    conn = _agent_conn()
    if conn is None:
        return
    now = time.monotonic()
    if not force and now - _state.last_progress < PROGRESS_INTERVAL_S:
        return
    _state.last_progress = now
    conn.request(_msg_progress(rank(), step))


def should_stop(step):
    """Whether every rank should save ``step`` and exit (the agent is draining). Under
    recovery in place (:class:`elastic_run.InPlace`), only the ranks of the node that drains
    exit: the others are told False, save ``step`` too (:func:`should_checkpoint` says so),
    and switch to the next generation in place.

    Local rank 0 of each node asks its agent; one tiny all-reduce (MAX) makes every rank agree,
    so all ranks call this at the same steps. It also learns the step the agent wants a
    checkpoint at, which :func:`should_checkpoint` then honours.
    """
    stop, ckpt = 0, 0
    conn = _agent_conn()
    if conn is not None and local_rank() == 0:
        reply = conn.request(_msg_query(), expect=protocol.REPLY_STATE)
        where = f"agent reply to {protocol.MSG_QUERY!r}"
        stop = 1 if _get(where, reply, "should_stop", bool) else 0
        at = _get_int(where, reply, "should_checkpoint_at", 0, protocol.STEP_MAX, None)
        ckpt = 0 if at is None else at + 1
    asked = stop
    stop, ckpt = _distributed._all_reduce_max([stop, ckpt])
    ip = _state.in_place
    if stop and ip is not None and conn is not None and not ip._node_leaves(asked):
        # Recovery in place: another node drains. This rank saves the same step (what
        # should_checkpoint says next) and switches to the generation without that node.
        _state.checkpoint_at = int(step)
        ip._peer_drains(step)
        return False
    if stop and _state.stop_step is None:
        _state.stop_step = int(step)
    if stop and not asked and conn is not None and local_rank() == 0:
        # Another node's agent asked: tell ours, so that it does not take the clean exit that
        # follows for the end of the job (it may not have heard of the drain itself).
        conn.request(_msg_peer_stop(rank(), step))
    if ckpt > 0 and ckpt - 1 != _state.checkpoint_request_seen:
        _state.checkpoint_request_seen = ckpt - 1
        _state.checkpoint_at = ckpt - 1
    return bool(stop)


def should_checkpoint(step):
    """Whether ``step`` is a checkpoint step: every ``--checkpoint-interval`` steps, or the
    step the agent asked for (learned by the last :func:`should_stop`). No collective."""
    n = checkpoint_interval()
    if n > 0 and step > 0 and step % n == 0:
        return True
    if _state.checkpoint_at is not None and step >= _state.checkpoint_at:
        _state.checkpoint_at = None
        return True
    return False
