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
`Admission.admit_together(workers, unit)` admits several at once (instances moved together),
each agent's lock held once for all of them and their loads side by side where they read one
publication: held once per instance, the last of n instances would wait n loads.

What each instance serves and holds is recorded with the instances' owner
(state/instances.py); this module does not decide which unit an instance should serve
(rejoin.py and the balancer do), nor when an agent syncs (the pipeline does).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Awaitable, Callable

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
        return (await self.admit_together([worker], unit, restart=restart, why=why, engine=engine))[worker]

    async def admit_together(self, workers: list[str], unit: str, *, restart: bool = True, why: str = "joins",
                             engine: protocol.LoadModel | None = None) -> dict[str, bool]:
        """`admit` for several workers joining one unit at once (instances moved together):
        their engines started side by side, and under one hold of each agent's sync lock
        their loads made side by side where the agent's publication can be read by all
        (`WeightSync.readable`) or where the load is an engine start (a whole model at
        version 0), else one after another. A lock held once per instance would
        make the last of n instances wait n loads. Each worker's outcome is its own.
        `engine` (one message, one request id) is for one worker only."""
        if engine is not None and len(workers) > 1:
            raise ValueError(f"one engine message for {len(workers)} workers: each start needs its own request")
        u = self.units[unit]
        # a process registered again is not the one admitted
        registration = {w: self.server.registry.workers.get(w) for w in workers}
        admitted = dict.fromkeys(workers, True)

        async def each(worker: str, work: Callable[[], Awaitable[None]]) -> None:
            try:
                await work()
            except WorkerDied as exc:
                log.warning("%s died while joining %s: %s", worker, unit, exc)
                admitted[worker] = False
            except RemoteError as exc:
                log.error("%s could not serve %s (%s); it serves no new agent. Check its log in the run "
                          "directory's logs/ folder.", worker, unit, exc)
                admitted[worker] = False

        if restart:
            await asyncio.gather(*(each(w, functools.partial(self._start_engine, w, unit, engine)) for w in workers))
        for agent in u.agents:  # one agent at a time: each agent's syncs wait only for its own loads
            async with self.weights.locks_of(agent):  # a snapshot's: its source's too
                joining = [w for w in workers if admitted[w]]
                stale = [w for w in joining if (held := self.instances.holds(w, agent)) is None
                         or held < self.versions[agent]]
                loads = [functools.partial(self._load, w, unit, agent, restart) for w in stale]
                # At version 0 a whole model's load is its engine's start (the model directory's
                # weights): nothing is read from a publication.
                if len(loads) > 1 and (self.weights.readable(agent) or (self.versions[agent] == 0 and not u.lora)):
                    await asyncio.gather(*(each(w, load) for w, load in zip(stale, loads)))
                else:
                    for w, load in zip(stale, loads):
                        await each(w, load)
                for w in joining:
                    if admitted[w] and not self._alive(w, registration[w]):
                        log.warning("%s died while joining %s (while being admitted)", w, unit)
                        admitted[w] = False
                    if admitted[w]:
                        self.instances.serve(w, agent, f"{w} {why}")
        return admitted

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
        if self.units[unit].lora:  # an adapter comes from its trainer, version 0 included
            self.instances.loaded(worker, agent, await self.weights.load_newest(worker, agent))
            return
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
