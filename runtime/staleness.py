"""The staleness rule, once, for both sides: the controller enforces it (controller/state/decisions.py,
replay's check) and the trainer refuses what breaks it (workers/trainer/worker.py).

A sample's *lag* is the trainer's version when it is trained minus the oldest policy
version that produced any turn of it; the bound `max_staleness` (k) says lag <= k.
k = 0 is exactly on-policy. The oldest version counts the sample's oldest token: a load that
let a request continue under new weights makes its tokens span versions (`spanned_oldest`).
Plain functions over ints: no controller, no torch.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def lag(trainer_version: int, sample_versions: Iterable[int]) -> int:
    return trainer_version - min(sample_versions)


def too_stale(trainer_version: int, sample_versions: Iterable[int], max_staleness: int) -> bool:
    return lag(trainer_version, sample_versions) > max_staleness


# A member whose tokens are all of the version its request was admitted under.
UNSPANNED = -(2 ** 31)


def spanned_oldest(lengths: Sequence[int], admitted: int, token_versions: Sequence[int]) -> list[int]:
    """Per member of a reply (`lengths` of its members, back to back in `token_versions`, one
    version per token; the request admitted under `admitted`): the oldest version of its
    tokens where they are not all `admitted`'s (a load let the request continue under new
    weights), UNSPANNED where they are."""
    out, at = [], 0
    for length in lengths:
        own = token_versions[at:at + length]
        at += length
        oldest, newest = (min(own), max(own)) if length else (admitted, admitted)
        out.append(oldest if (oldest, newest) != (admitted, admitted) else UNSPANNED)
    return out
