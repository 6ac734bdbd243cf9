"""What a generated group comes back to the workflow as: `GroupOutput`, one value per group.

A group comes back as the rollout replies carried it: one `GroupResult` per part (a group
split over instances came back in contiguous parts), each with the instance that sent it.
Nothing is sliced per member here: the experience store keeps a part's packed arrays as
they arrived (store.py), a group of several parts joined once, in member order.

Plain data: no sockets, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

from flexmarl.runtime import protocol
from flexmarl.runtime.keys import GroupKey


@dataclass(slots=True)
class GroupOutput:
    # The parts' results in member order, each with the instance that generated it.
    parts: list[tuple[protocol.GroupResult, str]]

    @property
    def n(self) -> int:
        n = 0
        for result, _ in self.parts:  # most often one: a loop, not sum() over a generator
            n += len(result.lengths)
        return n


@dataclass(slots=True)
class Scored:
    """A scoring request's output (a group of one, `GenGroup.score_from`)."""
    logprobs: list[float]  # of each scored id
    version: int  # the scoring model's
    # With score_top_k k: per scored id, the k most likely ids at its position and their
    # logprobs, packed as the reply carried them (empty otherwise).
    top_ids: bytes = b""
    top_logprobs: bytes = b""


def scored(output: GroupOutput) -> Scored:
    """A scoring request's output: the logprob of each scored id, the version that scored
    them and, where asked, the top-k ids and logprobs at each position."""
    (result, _), = output.parts
    return Scored(cast(list[float], protocol.unpacked(protocol.LOGPROB_TYPECODE, result.logprobs).tolist()),
                  result.version, result.top_ids, result.top_logprobs)


def assemble(parts: Sequence[tuple[protocol.GroupResult, str]]) -> GroupOutput:
    """One group's output from its parts' results (each with the instance that sent it), in member order."""
    return GroupOutput(list(parts) if len(parts) == 1 else sorted(parts, key=lambda part: part[0].first))


def output_of(token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
              version: int | Sequence[int] = 0, worker: str = "", finish_reason: str = "",
              key: GroupKey = GroupKey("", "", "")) -> GroupOutput:
    """A GroupOutput from plain lists (fakes and tests): one part made by `worker`, or with
    a version per member, a part of one member each."""
    if isinstance(version, int):
        return GroupOutput([(_result(key, 0, version, token_ids, logprobs, finish_reason), worker)])
    return GroupOutput([(_result(key, j, v, token_ids[j:j + 1], logprobs[j:j + 1], finish_reason), worker)
                        for j, v in enumerate(version)])


def _result(key: GroupKey, first: int, version: int, token_ids: Sequence[Sequence[int]],
            logprobs: Sequence[Sequence[float]], finish_reason: str) -> protocol.GroupResult:
    return protocol.GroupResult(key, first, version, [len(t) for t in token_ids],
                                protocol.packed(protocol.TOKEN_TYPECODE, [t for ids in token_ids for t in ids]),
                                protocol.packed(protocol.LOGPROB_TYPECODE, [lp for lps in logprobs for lp in lps]),
                                [finish_reason] * len(token_ids))
