"""The groups a rollout worker's engine is running, and their replies: pure bookkeeping.

A GENERATE message carries groups (protocol.GenGroup); the worker adds each to its engine
as one request of n samples, its members named `KEY/INDEX` (the engine's request ids, which
stay inside this process). `RunningGroups` remembers which request and group each member
belongs to, collects the members as the engine finishes them, and turns a group whose
members have all finished into one `GroupResult`, its token ids and logprobs packed as
arrays. A message is done once every group it carried came back or was refused.

It does not touch the engine or the socket (worker.py does both), so it is tested alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from flexmarl.runtime import protocol


def member_ids(group: protocol.GenGroup) -> list[str]:
    """The engine's request ids of the part's members (unique while it runs: a group's
    id, or a later turn's, names nothing else in flight)."""
    return [f"{group.key}/{group.first + j}" for j in range(group.n)]


@dataclass
class _Running:
    request_id: int
    group: protocol.GenGroup
    version: int
    outputs: list[Any] = field(default_factory=list)  # engine Completions, by member
    left: int = 0


class RunningGroups:
    def __init__(self) -> None:
        self._member: dict[str, tuple[_Running, int]] = {}  # engine request id -> (group, member)
        self._open: dict[int, int] = defaultdict(int)  # request id -> its groups still running
        self._tokens: dict[int, int] = defaultdict(int)  # request id -> prompt + max tokens of those

    def started(self, request_id: int, group: protocol.GenGroup, version: int) -> None:
        """The engine took `group` (its member ids from `member_ids`), running under `version`."""
        running = _Running(request_id, group, version, [None] * group.n, group.n)
        for j, rid in enumerate(member_ids(group)):
            self._member[rid] = (running, j)
        self._open[request_id] += 1
        self._tokens[request_id] += cost(group)

    def finished(self, completions: Iterable[Any]) -> dict[int, list[protocol.GroupResult]]:
        """The groups the engine's finished `completions` complete, per request."""
        done: dict[int, list[protocol.GroupResult]] = defaultdict(list)
        for c in completions:
            running, j = self._member.pop(c.request_id)
            running.outputs[j] = c
            running.left -= 1
            if running.left == 0:
                rid = running.request_id
                done[rid].append(group_result(running.group, running.version, running.outputs))
                self._open[rid] -= 1
                self._tokens[rid] -= cost(running.group)
        return done

    def done(self, request_id: int) -> bool:
        """Every group of the request came back (or was never started)."""
        if self._open.get(request_id, 0) > 0:
            return False
        self._open.pop(request_id, None)
        self._tokens.pop(request_id, None)
        return True

    @property
    def samples(self) -> int:
        return len(self._member)

    @property
    def tokens(self) -> int:
        return sum(self._tokens.values())

    def __bool__(self) -> bool:
        return bool(self._member)


def cost(group: protocol.GenGroup) -> int:
    """The tokens a group may cost its engine: each member's prompt and max_tokens."""
    return group.n * (len(group.prompt_ids) + group.max_tokens)


def group_result(group: protocol.GenGroup, version: int, outputs: list[Any]) -> protocol.GroupResult:
    tokens: list[int] = []
    logprobs: list[float] = []
    for c in outputs:
        tokens += c.token_ids
        logprobs += c.logprobs
    return protocol.GroupResult(group.key, group.first, version, [len(c.token_ids) for c in outputs],
                                protocol.packed(protocol.TOKEN_TYPECODE, tokens),
                                protocol.packed(protocol.LOGPROB_TYPECODE, logprobs),
                                [c.finish_reason or "" for c in outputs],
                                max((c.cached_tokens for c in outputs), default=0))
