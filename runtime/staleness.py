"""The staleness rule, once, for both sides: the controller enforces it (controller/state/decisions.py,
replay's check) and the trainer refuses what breaks it (workers/trainer/worker.py).

A sample's *lag* is the trainer's version when it is trained minus the oldest policy
version that produced any turn of it; the bound `max_staleness` (k) says lag <= k.
k = 0 is exactly on-policy. Plain functions over ints: no controller, no torch.
"""

from __future__ import annotations

from typing import Iterable


def lag(trainer_version: int, sample_versions: Iterable[int]) -> int:
    return trainer_version - min(sample_versions)


def too_stale(trainer_version: int, sample_versions: Iterable[int], max_staleness: int) -> bool:
    return lag(trainer_version, sample_versions) > max_staleness
