"""NCCL groups for weight sync: per agent, the communicator that joins its trainer (rank
0) to its rollout instances, by name. Each worker of an instance's engine is a rank of its
own (it receives the broadcast itself): an instance whose engine spans `width` ranks
(tensor parallelism) takes `width` consecutive ranks, the i-th instance 1 + i * width on.

The controller sets a group up and hands out only its name and the ranks: the trainer
makes the NCCL unique id at its first publication to a new group name, and the id reaches
the instances inside the published handle. A group is kept, so its communicator is made
once and reused by every later sync, while the agent's trainer and instances stay the
same; it is replaced (a new name) when either changes, or dropped when a sync over it did
not complete, since its communicator is then in no known state.

Plain data, no sockets and no NCCL: `WeightSync` asks it which group and ranks a sync uses.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

__all__ = ["NcclGroup", "NcclGroups"]


@dataclass(frozen=True)
class NcclGroup:
    name: str
    trainer: str  # rank 0
    instances: tuple[str, ...]  # instances[i]'s engine workers are ranks 1 + i * width ...
    width: int = 1  # ranks per instance: its engine's workers

    def rank(self, instance: str) -> int:
        """The instance's first rank; its engine's worker r takes this + r."""
        return self.instances.index(instance) * self.width + 1

    @property
    def receivers(self) -> int:
        return len(self.instances) * self.width


class NcclGroups:
    def __init__(self) -> None:
        self._current: dict[str, NcclGroup] = {}
        self._made = 0
        # Names stay unique across controller restarts that meet the same workers.
        self._nonce = secrets.token_hex(3)

    def for_sync(self, agent: str, trainer: str, instances: list[str], width: int = 1) -> NcclGroup:
        """The agent's group for a sync from `trainer` to `instances` (engines of `width`
        ranks each): the current one if its members are exactly these, else a new one that
        replaces it."""
        group = self._current.get(agent)
        if (group is not None and group.trainer == trainer and sorted(group.instances) == sorted(instances)
                and group.width == width):
            return group
        self._made += 1
        group = NcclGroup(f"{agent}/{self._nonce}-{self._made}", trainer, tuple(instances), width)
        self._current[agent] = group
        return group

    def drop(self, agent: str) -> None:
        """A sync over the agent's group failed: the next one makes a new group."""
        self._current.pop(agent, None)

    def current(self, agent: str) -> NcclGroup | None:
        return self._current.get(agent)
