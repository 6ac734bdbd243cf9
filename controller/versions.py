"""Each agent's synced version: the one version every rollout instance of the agent is
known to hold (or hold a newer one), the truth the staleness gate reads.

`SyncedVersions` has two writers by design of the run's life, never at once: a resumed
run sets every agent to the checkpoint's step before any loop starts (`resume_at`), and
from then on only the weight sync moves an agent forward (`set`), once every instance of
the agent loaded the new version. Readers (the schedule's gate and start rule, the
admission of an instance) read it; waiters are woken on every change.

It does not know instances, trainers or batches.
"""

from __future__ import annotations

import asyncio


class SyncedVersions:
    def __init__(self, agents: list[str]) -> None:
        self._version = {a: 0 for a in agents}
        self._changed = asyncio.Event()

    def __getitem__(self, agent: str) -> int:
        return self._version[agent]

    def as_dict(self) -> dict[str, int]:
        return dict(self._version)

    def set(self, agent: str, version: int) -> None:
        """Every instance of `agent` holds `version` now (the weight sync says so)."""
        self._version[agent] = version
        self._wake()

    def resume_at(self, step: int) -> None:
        """A run resumed from the checkpoint of `step`: every agent is at version `step`."""
        for agent in self._version:
            self._version[agent] = step
        self._wake()

    async def changed(self) -> None:
        """Returns after the next change of any agent's version."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
