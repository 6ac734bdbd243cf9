"""Rejoining: a worker that registers again after the agents were placed gets work.

`Rejoin.joined(info)` listens to the server's joins. The workers set-up takes are its
business; nothing is taken once shutdown began (`closing()`). A worker that registers
while set-up runs (a process restarted after dying at set-up) is kept until set-up opens
its role (`open(placed, role)`: trainers once set-up handed its own to the allocator,
rollout workers once the agents are placed, `accepting()`), and then taken unless it is
the very registration set-up took, or was replaced or died since. Taken:
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
# A live worker whose admission failed (a load it could not make, a trainer that died during
# it) is admitted again this many times in all, RETRY_S apart, before it is left idle.
ADMISSION_ATTEMPTS = 3
RETRY_S = 2.0


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
                 trainer_joined: Callable[[str], None], closing: Callable[[], bool] = lambda: False) -> None:
        # Engine units (runtime/bases.engine_units): a worker joins a whole-model agent or
        # every adapter agent of a base.
        self.units = units
        self.instances = instances  # instances(agent), served_before(worker): read only
        self.admission = admission
        self.server = server
        self.accepting = accepting  # rollout workers are taken from then on (the agents are placed)
        self.closing = closing  # shutdown began: nothing is taken
        self.finished = finished
        self.trainer_joined = trainer_joined
        self.queue: asyncio.Queue[str] = asyncio.Queue()  # rollout workers waiting for an agent
        self.serving: str | None = None  # the worker being admitted now
        self.rejoined: list[tuple[str, str, float]] = []  # (worker, unit, seconds to serve)
        self.attempts: dict[str, int] = {}  # worker -> admissions tried for its live incarnation
        self.retrying: set[str] = set()  # workers waiting RETRY_S for their next admission
        self.opened: set[str] = set()  # roles set-up opened: their joins are taken at once
        self.early: list[Any] = []  # registrations while set-up ran, kept until their role opens

    def pending(self) -> bool:
        """Whether a rollout worker that joined is waiting for, or going through, admission."""
        return self.serving is not None or not self.queue.empty() or bool(self.retrying)

    def joined(self, info: Any) -> None:
        if self.closing() or info.role not in ("trainer", "rollout"):  # an environment worker: environments/
            return
        if info.role not in self.opened and not self.accepting():
            self.early.append(info)  # set-up's own, or a replacement registered while it ran: see open()
            return
        self._take(info)

    def open(self, placed: Mapping[str, Any], role: str) -> None:
        """Set-up is done with `role`'s workers: from now on they are taken as they join,
        and so is each that registered meanwhile and is still the live registration of its
        id, unless it is one set-up took itself (`placed`: worker id -> its registration)."""
        self.opened.add(role)
        kept, self.early = self.early, []
        for info in kept:
            if info.role != role:
                self.early.append(info)
            elif placed.get(info.worker_id) is not info and self._current(info) and not self.closing():
                log.info("%s registered again while set-up ran; it is taken now", info.worker_id)
                self._take(info)

    def _current(self, info: Any) -> bool:
        current = self.server.registry.workers.get(info.worker_id)
        return current is not None and current is info and current.alive

    def _take(self, info: Any) -> None:
        if info.role == "trainer":
            log.info("trainer %s joined; it is in the trainer pool again", info.worker_id)
            self.trainer_joined(info.worker_id)
        else:
            self.attempts[info.worker_id] = 0
            self.queue.put_nowait(info.worker_id)

    async def run(self) -> None:
        while not self.finished():
            try:
                worker = await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue
            self.serving = worker
            try:
                if await self.serve(worker) is None:
                    self._again(worker)
            finally:
                self.serving = None

    def _again(self, worker: str) -> None:
        """A live worker whose admission failed is admitted again RETRY_S later, up to
        ADMISSION_ATTEMPTS in all; a dead one comes back through its next registration."""
        info = self.server.registry.workers.get(worker)
        if info is None or not info.alive:
            return
        self.attempts[worker] = self.attempts.get(worker, 0) + 1
        if self.attempts[worker] >= ADMISSION_ATTEMPTS:
            log.error("%s could not be made to serve an agent in %d attempts; it stays idle (its log in the run "
                      "directory's logs/ folder says why)", worker, self.attempts[worker])
            return
        self.retrying.add(worker)

        def requeue() -> None:
            self.retrying.discard(worker)
            self.queue.put_nowait(worker)

        asyncio.get_running_loop().call_later(RETRY_S, requeue)

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
