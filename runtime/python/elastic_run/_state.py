"""The client's module-level state, all of it in one place: the one agent connection of the
training thread, what the agent's replies asked for, the save in flight, and warnings given.
Other modules read and set these as ``_state.<name>``."""

import threading

# The training thread's connection to the agent (an ``_connection._Agent``), made on first use.
agent = None
# When report_progress last told the agent (time.monotonic()).
last_progress = 0.0
# A checkpoint step the agent asked for and not yet honoured, and the last request seen (the
# agent repeats its request in every reply until a newer one replaces it).
checkpoint_at = None
checkpoint_request_seen = None
# The step at which the ranks agreed to stop (a drain), once should_stop said so: a save of it
# or later is this worker's last, and says so to the agent.
stop_step = None
# Whether save/async_save warned that they run outside elastic-run.
warned_no_staging = False
# The InPlace of this worker's loop (recovery in place), once made: the group collectives of the
# client go through it.
in_place = None
# The async_save in flight (a PendingSave), if any. Not reset by _reset_for_tests.
pending = None
pending_lock = threading.Lock()


def _reset_for_tests():
    global agent, last_progress, checkpoint_at, checkpoint_request_seen, warned_no_staging, stop_step, in_place
    if agent is not None:
        agent.close()
    agent = None
    last_progress = 0.0
    checkpoint_at = None
    checkpoint_request_seen = None
    stop_step = None
    warned_no_staging = False
    in_place = None
