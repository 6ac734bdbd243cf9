"""What a generated group comes back to the workflow as: `GroupOutput`, one value per group.

A group may have been split over instances (contiguous parts, each answered by its own
`GroupResult`); `assemble` puts the parts back in member order. Token ids and logprobs
stay packed arrays (protocol.TOKEN_TYPECODE, LOGPROB_TYPECODE), one per member, copied out
of the reply once; every member carries the version and the instance that generated it
(a later turn of the sample goes back to that instance: its prefix cache holds the
conversation).

Plain data: no sockets, no asyncio.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass
from typing import Sequence

from flexmarl.runtime import protocol


@dataclass(slots=True)
class GroupOutput:
    token_ids: list[array.array]  # per member, in order
    logprobs: list[array.array]  # per member: one per token
    finish_reasons: list[str]
    versions: list[int]  # per member: the policy version that generated it
    served_by: list[str]  # per member: the instance that generated it
    # Prompt tokens each member's engine found in its prefix cache (vLLM counts one per
    # request: a part's first member is counted as having found nothing, never flattering).
    cached_tokens: list[int]

    @property
    def n(self) -> int:
        return len(self.token_ids)


def assemble(parts: Sequence[tuple[protocol.GroupResult, str]]) -> GroupOutput:
    """One group's output from its parts' results (each with the instance that sent it)."""
    out = GroupOutput([], [], [], [], [], [])
    for result, worker in (parts if len(parts) == 1 else sorted(parts, key=lambda part: part[0].first)):
        tokens = protocol.unpacked(protocol.TOKEN_TYPECODE, result.token_ids)
        logprobs = protocol.unpacked(protocol.LOGPROB_TYPECODE, result.logprobs)
        ends = list(itertools.accumulate(result.lengths))
        starts = [0, *ends[:-1]]
        out.token_ids += [tokens[a:b] for a, b in zip(starts, ends)]
        out.logprobs += [logprobs[a:b] for a, b in zip(starts, ends)]
        n = len(ends)
        out.cached_tokens += [0 if n > 1 else result.cached_tokens] + [result.cached_tokens] * (n - 1)
        out.finish_reasons += result.finish_reasons or [""] * n
        out.versions += [result.version] * n
        out.served_by += [worker] * n
    return out


def output_of(token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], version: int = 0,
              worker: str = "", finish_reason: str = "") -> GroupOutput:
    """A GroupOutput from plain lists, as one part made by `worker` (fakes and tests)."""
    return GroupOutput([array.array(protocol.TOKEN_TYPECODE, t) for t in token_ids],
                       [array.array(protocol.LOGPROB_TYPECODE, lp) for lp in logprobs],
                       [finish_reason] * len(token_ids), [version] * len(token_ids), [worker] * len(token_ids),
                       [0] * len(token_ids))
