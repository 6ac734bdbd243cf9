"""Each agent's synced version: the one version every rollout instance of the agent is
known to hold (or hold a newer one), the truth the staleness gate reads.

`SyncedVersions` has two writers by design of the run's life, never at once: a resumed
run sets every agent to the checkpoint's step before any loop starts (`resume_at`), and
from then on only the weight sync moves an agent forward (`set`), once every instance of
the agent loaded the new version (a snapshot's version is its source's at its last
refresh; a frozen agent's stays 0). Readers (the schedule's gate and start rule, the
admission of an instance) read it; a waiter for one agent is woken by that agent's changes
only (the staleness gate of each turn), a waiter for any by every change (the start rule).

It does not know instances, trainers or batches.
"""

from __future__ import annotations

import asyncio


class SyncedVersions:
    def __init__(self, agents: list[str]) -> None:
        self._version = {a: 0 for a in agents}
        self._changed = asyncio.Event()  # any agent's
        self._changed_of = {a: asyncio.Event() for a in agents}

    def __getitem__(self, agent: str) -> int:
        return self._version[agent]

    def as_dict(self) -> dict[str, int]:
        return dict(self._version)

    def set(self, agent: str, version: int) -> None:
        """Every instance of `agent` holds `version` now (the weight sync says so)."""
        self._version[agent] = version
        self._wake([agent])

    def resume_at(self, step: int, agents: list[str] | None = None) -> None:
        """A run resumed from the checkpoint of `step`: every agent (of `agents`: the ones
        whose weights follow the steps; a frozen agent stays at 0) is at version `step`."""
        moved = list(self._version) if agents is None else agents
        for agent in moved:
            self._version[agent] = step
        self._wake(moved)

    async def changed(self, agent: str | None = None) -> None:
        """Returns after the next change of `agent`'s version (None: of any agent's)."""
        await (self._changed if agent is None else self._changed_of[agent]).wait()

    def _wake(self, agents: list[str]) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for agent in agents:
            self._changed_of[agent].set()
            self._changed_of[agent] = asyncio.Event()
