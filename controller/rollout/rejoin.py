"""Rejoining: a worker that registers again after the agents were placed gets work.

`Rejoin.joined(info)` listens to the server's joins. Workers that join before the agents
are placed are set-up's business and ignored here (`accepting()` is false then, and
again once shutdown began). After that:
- a trainer is handed to the allocator (`trainer_joined`), which binds agents to it as
  they need one;
- a rollout worker is queued for `run()`.

`Rejoin.run()` runs next to the training loops. Consumes: the rollout workers that joined.
Produces: each of them serving a unit. For each it picks the engine unit (`choose_unit`: a
whole-model agent, or every adapter agent of a base at once) and
hands the rest to the admission (admission.py): the engine starts on the agent's model,
the instance is brought to the agent's synced version (a resumed run's included) and only
then is routed to. Waits for: a worker to join. Ends once every batch is trained.

Requests that were in flight on the dead process are not its business: the rollout client
re-issued them when the worker was declared dead. It does not start processes (the
launcher does) and knows nothing of what the agents learn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from flexmarl.runtime.bases import EngineUnit

from ..control.interfaces import WorkerDirectory

if TYPE_CHECKING:
    from ..state.instances import RolloutInstances
    from .admission import Admission

log = logging.getLogger("flexmarl.rejoin")

POLL_S = 0.5  # how often run() checks whether every batch is trained while no worker joins


def choose_unit(instances: dict[str, int], served_before: str | None) -> str:
    """The engine unit a rejoining rollout worker serves: the one with the fewest live
    instances (a unit left with none first); on a tie the one it served before, then
    the first in order. `instances` lists every unit, in order."""
    fewest = min(instances.values())
    tied = [a for a, n in instances.items() if n == fewest]
    return served_before if served_before in tied else tied[0]


class Rejoin:
    def __init__(self, units: Mapping[str, EngineUnit], instances: RolloutInstances, admission: Admission,
                 server: WorkerDirectory, *,
                 accepting: Callable[[], bool], finished: Callable[[], bool],
                 trainer_joined: Callable[[str], None]) -> None:
        # Engine units (runtime/bases.engine_units): a worker joins a whole-model agent or
        # every adapter agent of a base.
        self.units = units
        self.instances = instances  # instances(agent), served_before(worker): read only
        self.admission = admission
        self.server = server
        self.accepting = accepting
        self.finished = finished
        self.trainer_joined = trainer_joined
        self.queue: asyncio.Queue[str] = asyncio.Queue()  # rollout workers waiting for an agent
        self.serving: str | None = None  # the worker being admitted now
        self.rejoined: list[tuple[str, str, float]] = []  # (worker, unit, seconds to serve)

    def pending(self) -> bool:
        """Whether a rollout worker that joined is waiting for, or going through, admission."""
        return self.serving is not None or not self.queue.empty()

    def joined(self, info: Any) -> None:
        if not self.accepting():
            return
        if info.role == "trainer":
            log.info("trainer %s joined; it is in the trainer pool again", info.worker_id)
            self.trainer_joined(info.worker_id)
        elif info.role == "rollout":  # an environment worker is the environment client's (environments/)
            self.queue.put_nowait(info.worker_id)

    async def run(self) -> None:
        while not self.finished():
            try:
                worker = await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue
            self.serving = worker
            try:
                await self.serve(worker)
            finally:
                self.serving = None

    async def serve(self, worker: str) -> str | None:
        """Makes `worker` serve a unit (see the module doc); the unit, or None if the
        worker died again or could not load the model."""
        info = self.server.registry.workers.get(worker)
        if info is None or not info.alive:
            return None  # died again before its turn: its next incarnation will be queued
        unit = choose_unit({name: len(self.instances.instances(u.agents[0])) for name, u in self.units.items()},
                           self.instances.served_before(worker))
        t0 = time.monotonic()
        if not await self.admission.admit(worker, unit, why="rejoined"):
            return None
        seconds = time.monotonic() - t0
        self.rejoined.append((worker, unit, seconds))
        first = self.units[unit].agents[0]
        log.info("%s rejoined and serves %s at version %s after %.1fs", worker, unit,
                 self.instances.holds(worker, first), seconds)
        return unit
