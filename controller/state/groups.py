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
        return sum(len(result.lengths) for result, _ in self.parts)


def scored(output: GroupOutput) -> tuple[list[float], int]:
    """A scoring request's output (a group of one, `GenGroup.score_from`): the logprob of
    each scored id, and the version that scored them."""
    (result, _), = output.parts
    return cast(list[float], protocol.unpacked(protocol.LOGPROB_TYPECODE, result.logprobs).tolist()), result.version


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
