"""The worker <-> agent contract, defined once: the wire format on ``$ELASTIC_AGENT_SOCKET``
(the ``elastic-run-worker`` crate's ``protocol`` module), the staged and restored file
layout, the bounds on everything read from outside this process, and the checks that
enforce them.

Requests are newline-delimited JSON objects with a ``type``. Each kind the client sends is
built by one function here (``_msg_<kind>``); :data:`REQUESTS` lists the kinds and their fields,
and :func:`_sample_messages` builds one of each (``python -m elastic_run
--print-sample-messages`` prints them as they go on the wire).

Other modules read the constants through this module (``protocol.STEP_MAX``), so that there is
one binding of each.
"""

import json
import operator
import re

FORMAT_VERSION = 1
# Must match the agent's MESSAGE_BYTES_MAX.
MESSAGE_BYTES_MAX = 64 * 1024
# Largest world size (ranks are below it) taken from the environment or from metadata, checked
# before anything is sized by it. Far above any real job; torch.distributed's ranks are int32.
WORLD_SIZE_MAX = 1 << 20
# Largest step: the largest integer a JSON number (an IEEE double) holds exactly.
STEP_MAX = 2**53 - 1
# Largest metadata file read (meta.json, metadata.json): the agent's limit too.
METADATA_BYTES_MAX = 16 * 1024 * 1024
# Deepest nesting of arrays and objects in JSON read. What `save` writes stays within it once
# the restore metadata wraps the state one level deeper than meta.json does.
JSON_DEPTH_MAX = 64

# --- staged and restored layout ----------------------------------------------------------------

# What `save` writes: $ELASTIC_STAGING_DIR/step-<N>/rank-<R>/{_TENSORS,_META}.
_TENSORS = "tensors.safetensors"
_META = "meta.json"
# What the agent restores from the checkpoint store (the checkpoint crate's restore layout):
# $ELASTIC_RESUME_DIR/rank-<R>/{_RESTORED,_RESTORED_META}, and _RESTORED_MARKER in the top
# directory.
_RESTORED = "state.safetensors"
_RESTORED_META = "metadata.json"
# In place of _RESTORED when the agent restored without copies (--restore-no-copy): where the
# bytes of the file it did not write lie in the store's chunks (runtime/worker/src/protocol.rs).
_RESTORED_SOURCES = "sources.json"
_RESTORED_SOURCES_VERSIONS = (1,)
_RESTORED_MARKER = "restored.json"
# The restore metadata versions this client reads (``metadata.json`` has no version field yet;
# a future one must say so).
_RESTORED_VERSIONS = (1,)
# The safetensors ``__metadata__`` key under which a tensor file (staged or restored) declares
# its sharded tensors: JSON text ``{"<tensor>": {"global_shape": [...], "dim0_offset": n}}``,
# the tensor being rows ``[n, n + shape[0])`` of the global one (the checkpoint crate's
# ``format::SHARDS_METADATA_KEY``).
_SHARDS_KEY = "elastic.shards"


def rows_for_rank(rows, rank, world):
    """Rows ``[lo, hi)`` of dim 0 that ``rank`` of ``world`` holds of a tensor of ``rows`` rows:
    PyTorch's ``Shard(0)`` rule (what DTensor and FSDP2 give each rank), chunks of
    ``ceil(rows / world)`` rows in rank order; the last ranks may hold fewer or none. The
    checkpoint crate's restore cuts by the same rule (``restore::rows_for_rank``)."""
    chunk = -(-rows // world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)

# --- messages ------------------------------------------------------------------------------------

# Request kinds (worker -> agent), the `type` of each request line.
MSG_PROGRESS = "progress"
MSG_QUERY = "query"
MSG_PEER_STOP = "peer_stop"
MSG_SAVED = "saved"
MSG_SKIPPED = "skipped"
MSG_WATCH = "watch"
MSG_SWITCHED = "switched"
MSG_COLLECTIVE_FAILED = "collective_failed"
MSG_RESTORE = "restore"
# Every request kind and its fields besides `type`, in the order sent (protocol.rs
# `Request`: rank is a u32, step a u64, dir and reason strings, last a bool).
REQUESTS = {
    MSG_PROGRESS: ("rank", "step"),
    MSG_QUERY: (),
    MSG_PEER_STOP: ("rank", "step"),
    MSG_SAVED: ("rank", "step", "dir", "last"),
    MSG_SKIPPED: ("rank", "step", "reason"),
    MSG_WATCH: ("rank", "generation"),
    MSG_SWITCHED: ("rank", "generation"),
    MSG_COLLECTIVE_FAILED: ("rank", "generation", "reason"),
    MSG_RESTORE: ("rank", "step"),
}
# Reply kinds (agent -> worker). `state` carries should_stop (a bool), should_checkpoint_at (a
# step or null) and generation; `error` a message.
REPLY_OK = "ok"
REPLY_STATE = "state"
REPLY_ERROR = "error"
# `generation` carries generation, rank_offset and env (recovery in place, see _inplace).
REPLY_GENERATION = "generation"
# `restored` carries the step restored for a `restore` and its dir (the restore layout).
REPLY_RESTORED = "restored"
# The longest a `restore` waits for its reply: the agent's restore of a large checkpoint from a
# slow store, retries included (protocol.rs RESTORE_WAIT_MS).
RESTORE_WAIT_S = 3600.0
# The longest the agent holds a `watch` before answering it unchanged (protocol.rs
# WATCH_HOLD_MS).
WATCH_HOLD_S = 10.0
# The reason a skip (or a failed collective) reports to the agent is cut to this (a message line
# is bounded).
_SKIP_REASON_CHARS_MAX = 1000


def _msg_progress(rank, step):
    """Rank ``rank`` finished ``step`` (feeds the agent's hang watchdog)."""
    return {"type": MSG_PROGRESS, "rank": rank, "step": int(step)}


def _msg_query():
    """What should the workers do? Answered by a ``state`` reply."""
    return {"type": MSG_QUERY}


def _msg_peer_stop(rank, step):
    """The workers agreed to stop at ``step`` because another node's agent asked."""
    return {"type": MSG_PEER_STOP, "rank": rank, "step": int(step)}


def _msg_saved(rank, step, dir_, last=False):
    """Rank ``rank`` wrote its snapshot of ``step`` into ``dir_`` (under the staging dir);
    ``last``: the ranks agreed to stop (a drain) and this is the rank's last save, so the agent
    may leave the job once this step is committed, without waiting for the worker to exit."""
    return {"type": MSG_SAVED, "rank": rank, "step": step, "dir": dir_, "last": bool(last)}


def _msg_skipped(rank, step, reason):
    """Rank ``rank`` could not write its snapshot of ``step``; ``reason`` is cut to
    ``_SKIP_REASON_CHARS_MAX`` characters."""
    return {"type": MSG_SKIPPED, "rank": rank, "step": step, "reason": reason[:_SKIP_REASON_CHARS_MAX]}


def _msg_watch(rank, generation):
    """Rank ``rank`` switches generations in place: answered once the agent offers a generation
    other than ``generation`` (or after WATCH_HOLD_S, unchanged)."""
    return {"type": MSG_WATCH, "rank": rank, "generation": int(generation)}


def _msg_switched(rank, generation):
    """Rank ``rank`` (its rank in ``generation``) left its old process group for
    ``generation``'s, with no save of the old generation in flight."""
    return {"type": MSG_SWITCHED, "rank": rank, "generation": int(generation)}


def _msg_collective_failed(rank, generation, reason):
    """A collective of rank ``rank`` failed in ``generation`` (a peer may be gone): the agent
    asks etcd to regroup it now. ``reason`` is cut to ``_SKIP_REASON_CHARS_MAX`` characters."""
    return {"type": MSG_COLLECTIVE_FAILED, "rank": rank, "generation": int(generation),
            "reason": reason[:_SKIP_REASON_CHARS_MAX]}


def _msg_restore(rank, step):
    """Rank ``rank`` needs ``step`` from the checkpoint store: its node joined without a restore
    (``$ELASTIC_HEAL_STEP``) and no live peer held the step. Answered by ``restored``."""
    return {"type": MSG_RESTORE, "rank": rank, "step": int(step)}


def _sample_messages():
    """One request of every kind in :data:`REQUESTS`, in that order, built by the same
    functions the client sends them with, from representative values."""
    return [
        _msg_progress(3, 120),
        _msg_query(),
        _msg_peer_stop(3, 120),
        _msg_saved(3, 100, "/tmp/elastic-run/staging/step-100/rank-3", last=True),
        _msg_skipped(3, 100, "the staging file system /tmp/elastic-run/staging is full (No space left on "
                             "device; this rank's snapshot is 1048576 bytes, 4096 of 65536 bytes free)"),
        _msg_watch(3, 4),
        _msg_switched(1, 5),
        _msg_collective_failed(3, 4, "[pair.cc:537] Read error [10.0.0.2]:41234: Connection reset by peer"),
        _msg_restore(3, 120),
    ]


def _encode(obj):
    """A request as it goes on the wire: compact JSON and a newline."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# --- input from outside: JSON, fields, steps ---------------------------------------------------


class FormatError(ValueError):
    """Malformed or out-of-bounds input from outside this process: a snapshot's or a restore's
    metadata, a reply from the agent, or an environment variable. The message names the file,
    reply or variable and the field."""


def _describe(v):
    """``v`` for an error message, cut short."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# A JSON string; one left open runs to the end of the text, so that a scan stays linear.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.DOTALL)
_JSON_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
# Longest integer literal parsed (Python's own default limit, from 3.11 on).
_JSON_INT_DIGITS_MAX = 4300


def _json_too_deep(text, limit):
    """Whether JSON ``text`` nests arrays and objects deeper than ``limit``, found without
    parsing it: the parser recurses once per level."""
    depth = 0
    for c in _JSON_NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)):
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _json_int(s):
    if len(s.lstrip("-")) > _JSON_INT_DIGITS_MAX:
        raise ValueError(f"integer of {len(s)} digits")
    return int(s)


def _json_constant(name):
    raise ValueError(f"{name} is not JSON")


def _parse_json(data, where):
    """JSON from outside this process (bytes): UTF-8, standard (no NaN or Infinity), at most
    JSON_DEPTH_MAX deep. FormatError otherwise."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{where}: not UTF-8: {e}") from None
    if _json_too_deep(text, JSON_DEPTH_MAX):
        raise FormatError(f"{where}: JSON nested deeper than {JSON_DEPTH_MAX}")
    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except ValueError as e:  # JSONDecodeError, and the two above
        raise FormatError(f"{where}: not JSON: {e}") from None


_REQUIRED = object()
_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true or false"}


def _get(where, obj, key, kind, default=_REQUIRED, parent=""):
    """``obj[key]`` of type ``kind`` (absent or null: ``default``, unless it is required).
    ``where`` names the file or reply and ``parent`` the object's place in it."""
    v = obj.get(key)
    if v is None:
        if default is _REQUIRED:
            raise FormatError(f"{where}: no {parent}{key}")
        return default
    if not isinstance(v, kind):
        raise FormatError(f"{where}: {parent}{key} is {_describe(v)}, not {_KINDS[kind]}")
    return v


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _get_int(where, obj, key, lo, hi, default=_REQUIRED, parent=""):
    """``obj[key]``, an integer (not a bool) in ``[lo, hi]``; see :func:`_get`."""
    v = obj.get(key)
    if v is None:
        if default is _REQUIRED:
            raise FormatError(f"{where}: no {parent}{key}")
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise FormatError(f"{where}: {parent}{key} is {_describe(v)}, not an integer in [{lo}, {hi}]")
    return v


def _is_index_text(s):
    """Whether ``s`` is a parameter index as ``str(int)`` writes it."""
    return s.isascii() and s.isdigit() and len(s) <= 18 and (s == "0" or s[0] != "0")


def _check_step(step, caller):
    """``step`` as an int in [0, STEP_MAX] (an ``__index__`` integer, not a bool or a float)."""
    if not isinstance(step, bool):
        try:
            n = operator.index(step)
        except TypeError:
            n = None
        if n is not None and 0 <= n <= STEP_MAX:
            return n
    raise FormatError(f"elastic_run.{caller}: step {_describe(step)} is not an integer in [0, {STEP_MAX}]")
