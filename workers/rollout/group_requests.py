"""The groups a rollout worker's engine is running, and their replies: pure bookkeeping.

A GENERATE message carries groups (protocol.GenGroup); the worker adds each to its engine
as one request of n samples under an engine request id of its own (`RunningGroups.next_id`:
a number, unique in this process, naming nothing else). `RunningGroups` remembers which
GENERATE request and group each engine request is, and turns a finished one (the engine
returns a request whole) into one `GroupResult`, its token ids and logprobs packed as
arrays. A message is done once every group it carried came back or was refused.

It does not touch the engine or the socket (worker.py does both), so it is tested alone.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from flexmarl.runtime import protocol


@dataclass(slots=True)
class _Running:
    request_id: int  # the GENERATE message's
    group: protocol.GenGroup
    version: int


class RunningGroups:
    def __init__(self) -> None:
        self._running: dict[str, _Running] = {}  # engine request id -> its group
        self._open: dict[int, int] = defaultdict(int)  # request id -> its groups still running
        self._tokens: dict[int, int] = defaultdict(int)  # request id -> prompt + max tokens of those
        self._ids = itertools.count()
        self.samples = 0  # of the groups running

    def next_id(self) -> str:
        """The engine request id for the next group."""
        return str(next(self._ids))

    def started(self, engine_id: str, request_id: int, group: protocol.GenGroup, version: int) -> None:
        """The engine took `group` (of GENERATE `request_id`) as `engine_id`, running under `version`."""
        self._running[engine_id] = _Running(request_id, group, version)
        self._open[request_id] += 1
        self._tokens[request_id] += cost(group)
        self.samples += group.n

    def finished(self, completions: Iterable[Any]) -> dict[int, list[protocol.GroupResult]]:
        """The results of the groups the engine finished (`completions`, one per engine
        request, every sample of it), per GENERATE request."""
        done: dict[int, list[protocol.GroupResult]] = defaultdict(list)
        for c in completions:
            running = self._running.pop(c.request_id)
            rid = running.request_id
            done[rid].append(group_result(running.group, running.version, c))
            self._open[rid] -= 1
            self._tokens[rid] -= cost(running.group)
            self.samples -= running.group.n
        return done

    def aborted(self, names: set[tuple[Any, int, int]]) -> dict[str, tuple[int, protocol.GenGroup]]:
        """The running groups named (key, first, turn) in `names`, by engine request id, each
        with its GENERATE request: they leave the bookkeeping (the caller aborts them in the
        engine and says so in their request's reply)."""
        found = {eid: r for eid, r in self._running.items() if (r.group.key, r.group.first, r.group.turn) in names}
        for eid, r in found.items():
            del self._running[eid]
            self._open[r.request_id] -= 1
            self._tokens[r.request_id] -= cost(r.group)
            self.samples -= r.group.n
        return {eid: (r.request_id, r.group) for eid, r in found.items()}

    def done(self, request_id: int) -> bool:
        """Every group of the request came back (or was never started)."""
        if self._open.get(request_id, 0) > 0:
            return False
        self._open.pop(request_id, None)
        self._tokens.pop(request_id, None)
        return True

    @property
    def tokens(self) -> int:
        return sum(self._tokens.values())

    def __bool__(self) -> bool:
        return bool(self._running)


def cost(group: protocol.GenGroup) -> int:
    """The tokens a group may cost its engine: each member's prompt and max_tokens."""
    return group.n * (len(group.prompt_ids) + group.max_tokens)


def group_result(group: protocol.GenGroup, version: int, completion: Any) -> protocol.GroupResult:
    """The reply for `group`, from the engine's `Completion` of it (its samples back to back;
    each token's version where a load let it continue under new weights)."""
    versions = completion.token_versions
    return protocol.GroupResult(group.key, group.first, version, list(completion.lengths),
                                protocol.packed(protocol.TOKEN_TYPECODE, completion.token_ids),
                                protocol.packed(protocol.LOGPROB_TYPECODE, completion.logprobs),
                                list(completion.finish_reasons), completion.cached_tokens, group.turn,
                                protocol.packed(protocol.TOKEN_TYPECODE, versions) if versions else b"",
                                protocol.packed(protocol.TOKEN_TYPECODE, completion.top_ids or ()),
                                protocol.packed(protocol.LOGPROB_TYPECODE, completion.top_logprobs or ()))
