"""The pipeline's decision rules, as plain functions over plain numbers.

Kept apart from the asyncio code that applies them so they are unit-tested directly,
re-driven from the event log by `flexmarl replay --check`, and shared by sync and async
modes (sync mode is the same rules with the overlap switched off).

Versions: an agent at version v trains a global batch into version v + 1. Global batch
(iteration) `tag` = t trains every agent from version t - 1 to t. A sample's *lag* is the
trainer's version when it is trained minus the oldest policy version that produced any
turn of it; the bound `max_staleness` (k) says lag <= k. k = 0 is exactly on-policy.
"""

from __future__ import annotations


def min_generation_version(tag: int, max_staleness: int) -> int:
    """The oldest policy version allowed to generate any turn for global batch `tag`."""
    return tag - 1 - max_staleness


def may_generate(tag: int, rollout_version: int, max_staleness: int) -> bool:
    return rollout_version >= min_generation_version(tag, max_staleness)


def lag(trainer_version: int, sample_versions: list[int]) -> int:
    return trainer_version - min(sample_versions)


def too_stale(trainer_version: int, sample_versions: list[int], max_staleness: int) -> bool:
    return lag(trainer_version, sample_versions) > max_staleness


def cut_micro_batch(ready_samples: int, micro_batch: int, batch_complete: bool, overlap: bool) -> bool:
    """Whether to form a micro-batch now. With overlap (async), as soon as a full one is
    ready; always once the global batch is complete. Cutting only at >= micro_batch
    keeps the micro-batch composition identical to sync mode for the same arrival order."""
    if ready_samples == 0:
        return False
    return batch_complete or (overlap and ready_samples >= micro_batch)


def may_start_episode(tag: int, synced_versions: dict[str, int], overlap: bool) -> bool:
    """Sync mode starts global batch t only when every agent's rollout weights are at
    t - 1; async mode starts it at once and gates each turn with `may_generate`."""
    return overlap or all(v >= tag - 1 for v in synced_versions.values())
