"""``python -m elastic_run env``: what this worker sees (a debugging aid).
``python -m elastic_run --print-sample-messages``: one request of every kind the client sends
the agent, one JSON line each, as it goes on the wire (for checks against the agent's parser)."""

import json
import sys

from elastic_run import _env, protocol

USAGE = "usage: python -m elastic_run env | --print-sample-messages"


def _main(argv):
    if argv[1:] == ["env"]:
        print(json.dumps(_env._debug_env(), sort_keys=True))
        return 0
    if argv[1:] == ["--print-sample-messages"]:
        for msg in protocol._sample_messages():
            sys.stdout.buffer.write(protocol._encode(msg))
        sys.stdout.flush()
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
