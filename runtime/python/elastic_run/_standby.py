"""A warm standby interpreter for one local rank (``elastic-run --warm-standby``).

The agent starts it as ``python -u -c <this file>`` while a worker group trains, with the
environment that rank's worker had, and its stdin a Unix socket to the agent. It imports torch
and waits. When the agent restarts the workers, it sends the new worker's command line and
environment, with its stdout and stderr as file descriptors (SCM_RIGHTS), and the standby runs
the script as ``python -u SCRIPT ARGS`` (or ``python -u -m MODULE ARGS``) would: the same
``sys.argv``, ``sys.path[0]`` and ``__main__``, its exit status the script's. The agent uses a
standby only when every variable that matters before the script starts (all but the
per-generation ones) is what the standby started with; else it starts a fresh interpreter.

The message: 4 bytes big-endian length, then JSON ``{"argv": [...], "env": {...}, "unset": [...]}``;
``argv`` is ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]``. End of file before a message:
the agent let the standby go, and it exits 0.

This file runs on its own (``-c``): it imports nothing from elastic_run.
"""

import json
import os
import socket
import struct
import sys

MESSAGE_BYTES_MAX = 1 << 20
STDIN_FD = 0


def _receive(sock):
    """The activation message and its two descriptors; None at end of file."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 64 * 1024, 2)
    if not data:
        return None
    while len(data) < 4:
        more = sock.recv(4 - len(data))
        if not more:
            raise ValueError("the activation message ends inside its length")
        data += more
    (length,) = struct.unpack(">I", data[:4])
    if length > MESSAGE_BYTES_MAX:
        raise ValueError(f"activation message of {length} bytes (at most {MESSAGE_BYTES_MAX})")
    body = data[4:]
    while len(body) < length:
        more = sock.recv(min(64 * 1024, length - len(body)))
        if not more:
            raise ValueError("the activation message is cut short")
        body += more
    if len(body) != length or len(fds) != 2:
        raise ValueError(f"activation message: {len(body)} of {length} bytes, {len(fds)} of 2 descriptors")
    msg = json.loads(body.decode("utf-8"))
    argv, env, unset = msg["argv"], msg["env"], msg["unset"]
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("activation message: argv must be a non-empty list of strings")
    if argv[0] == "-m" and len(argv) < 2:
        raise ValueError("activation message: -m without a module")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("activation message: env must map strings to strings")
    if not (isinstance(unset, list) and all(isinstance(k, str) for k in unset)):
        raise ValueError("activation message: unset must be a list of strings")
    return argv, env, unset, fds


def _warm():
    try:
        import torch  # noqa: F401 (the point: the import is done before the script needs it)
    except ImportError:
        pass


def main():
    sock = socket.socket(fileno=os.dup(STDIN_FD))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, STDIN_FD)
    os.close(null)
    _warm()
    try:
        got = _receive(sock)
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as e:
        print(f"elastic-run warm standby: {e}", file=sys.stderr, flush=True)
        os._exit(70)
    finally:
        sock.close()
    if got is None:
        os._exit(0)
    argv, env, unset, (out_fd, err_fd) = got
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    for k in unset:
        os.environ.pop(k, None)
    os.environ.update(env)
    import runpy

    if argv[0] == "-m":
        # As `python -m`: the current directory first on the path; run_module sets argv[0].
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        # As `python SCRIPT`: the script's own directory (symlinks resolved) first on the path.
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
