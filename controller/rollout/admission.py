"""The one way a rollout instance comes to serve an engine unit: `Admission.admit`.

`Admission.admit(worker, unit)` is "instance `worker` serves `unit` at its agents' synced
versions", used by set-up, rejoin, resume and balancing alike. It (re)starts the engine
where asked (outside the agents' sync locks: they keep syncing meanwhile), then, for each
agent of the unit, holding that agent's sync lock so no sync of it runs in between, loads
the agent's newest publication if the instance holds an older version (the weight sync
publishes again from the trainer when the last publication was released or was an NCCL
broadcast, at the version the trainer holds then: a step that raced the join is served,
never refused), and only then lets the agent's requests reach it. For a unit of adapters,
the base's engine starts once and each agent's adapter is loaded from its trainer (version 0
included: the base alone is no agent's weights). A worker that dies or refuses fails its
own admission (False), never the run; so does one that died and registered again while
being admitted (its calls may have reached the new process, which is admitted on its own).

What each instance serves and holds is recorded with the instances' owner
(state/instances.py); this module does not decide which unit an instance should serve
(rejoin.py and the balancer do), nor when an agent syncs (the pipeline does).
"""

from __future__ import annotations

import logging
from typing import Callable

import msgspec

from flexmarl.runtime import protocol

from ..control.interfaces import WorkerServer
from ..control.server import RemoteError, WorkerDied
from ..state.instances import RolloutInstances
from ..state.versions import SyncedVersions
from ..weights.sync import WeightSync, engines_sharing_gpu

log = logging.getLogger("flexmarl.instances")


class Admission:
    """The one path by which an instance comes to serve a unit (see the module doc)."""

    def __init__(self, instances: RolloutInstances, weights: WeightSync, versions: SyncedVersions, server: WorkerServer,
                 engine_message: Callable[[str], protocol.LoadModel]) -> None:
        self.instances = instances
        self.units = instances.units
        self.weights = weights
        self.versions = versions
        self.server = server
        self.engine_message = engine_message  # unit -> the LoadModel that starts its engine at version 0

    async def admit(self, worker: str, unit: str, *, restart: bool = True, why: str = "joins",
                    engine: protocol.LoadModel | None = None) -> bool:
        """Makes `worker` serve `unit` at its agents' synced versions (or newer); False if
        the worker died or refused (it then serves no new agent; the run goes on).

        `restart`: start the engine on the unit's model first (`engine`: with this message
        instead of the model directory's, as set-up of a resumed run does). Without it the
        weights are swapped in place, and the engine restarts if the instance refuses or
        if the agent is still at version 0 (its weights are the model directory's)."""
        u = self.units[unit]
        registration = self.server.registry.workers.get(worker)  # a process registered again is not this one
        try:
            if restart:
                await self._start_engine(worker, unit, engine)
            for agent in u.agents:  # one agent at a time: each agent's syncs wait only for its own load
                async with self.weights.locks_of(agent):  # a snapshot's: its source's too
                    held = self.instances.holds(worker, agent)
                    if held is None or held < self.versions[agent]:
                        if u.lora:  # an adapter comes from its trainer, version 0 included
                            self.instances.loaded(worker, agent, await self.weights.load_newest(worker, agent))
                        else:
                            await self._load(worker, unit, agent, restarted=restart)
                    if not self._alive(worker, registration):
                        raise WorkerDied(worker, "it died while being admitted")
                    self.instances.serve(worker, agent, f"{worker} {why}")
        except WorkerDied as exc:
            log.warning("%s died while joining %s: %s", worker, unit, exc)
            return False
        except RemoteError as exc:
            log.error("%s could not serve %s (%s); it serves no new agent. Check its log in the run "
                      "directory's logs/ folder.", worker, unit, exc)
            return False
        return True

    async def _start_engine(self, worker: str, unit: str, engine: protocol.LoadModel | None = None) -> None:
        message = engine or self.engine_message(unit)
        shared = engines_sharing_gpu(worker, self.server.registry.workers)  # they split the GPU's share
        if shared != message.engine.engines_on_gpu:
            message = msgspec.structs.replace(message, engine=msgspec.structs.replace(message.engine,
                                                                                      engines_on_gpu=shared))
        reply, _ = await self.server.call(worker, message)
        self.instances.engine_started(worker, unit, message.version)
        log.info("%s runs %s's engine at version %d (%.1fs to start)", worker, unit, message.version,
                 getattr(reply, "seconds", 0.0))

    async def _load(self, worker: str, unit: str, agent: str, restarted: bool) -> None:
        if self.versions[agent] == 0 and not restarted:  # version 0 is the model directory's weights
            await self._start_engine(worker, unit)
            return
        try:
            version = await self.weights.load_newest(worker, agent)
        except RemoteError as exc:
            if restarted:
                raise
            log.info("%s cannot swap %s's weights in place (%s); restarting its engine", worker, agent, exc)
            await self._start_engine(worker, unit)
            if self.versions[agent] == 0:
                return
            version = await self.weights.load_newest(worker, agent)
        self.instances.loaded(worker, agent, version)

    def _alive(self, worker: str, registration: object) -> bool:
        """Whether `worker` is still the live process registered as `registration` (one that
        died and registered again holds none of what was loaded into the old one)."""
        info = self.server.registry.workers.get(worker)
        return info is not None and info is registration and info.alive
