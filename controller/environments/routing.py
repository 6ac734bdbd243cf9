"""Where an environment call goes: plain decisions over counts, no sockets.

The controller counts, per environment worker that is set up, the calls it has sent there
and not yet had answered (`outstanding`), its processes for stateless calls
(`capacity`) and its open sessions (`sessions`):

- a stateless call goes to the worker with the fewest outstanding calls per process
  (`least_loaded`); ties go to the first by id, so the choice is the same for the same
  counts;
- a session opens on the worker holding the fewest sessions, ties broken by load
  (`place_session`); its calls then go where it lives (the client keeps that);
- a stateless call whose worker died is sent again while it has tries left
  (`retry_after_loss`); a session's call never is: its state died with the worker.

It knows nothing of messages, futures or what the calls do.
"""

from __future__ import annotations

from collections.abc import Mapping


def least_loaded(outstanding: Mapping[str, int], capacity: Mapping[str, int]) -> str | None:
    """The worker with the fewest outstanding calls per process, or None if there is none."""
    if not capacity:
        return None
    return min(sorted(capacity), key=lambda w: outstanding.get(w, 0) / max(capacity[w], 1))


def place_session(sessions: Mapping[str, int], outstanding: Mapping[str, int],
                  capacity: Mapping[str, int]) -> str | None:
    """The worker a new session opens on: the fewest sessions, then the least loaded."""
    if not capacity:
        return None
    return min(sorted(capacity), key=lambda w: (sessions.get(w, 0), outstanding.get(w, 0) / max(capacity[w], 1)))


def retry_after_loss(tries: int, retries: int, in_session: bool) -> bool:
    """Whether a call whose worker died (after `tries` sends) is sent again."""
    return not in_session and tries <= retries
