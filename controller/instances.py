"""The rollout instances: which agents each serves, the version of each it holds, its
outstanding work, what it served before; and the one way an instance comes to serve an
agent (`Admission`).

`RolloutInstances` is the only writer of that state. The rollout client reads which
instances serve an agent and counts work on them through it (`add_work`, `work_done`);
the weight sync records what it loaded (`loaded`); balancing and the death of a worker
take an instance out of an agent (`leave`, `died`). An instance serves a *set* of agents,
so one engine may serve several. Routing order is set-up's placement order (`place`;
engines start concurrently and finish in any order), then the order others joined.

`Admission.admit(worker, agent)` is "instance `worker` serves `agent` at the agent's
synced version", used by set-up, rejoin, resume and balancing alike. It (re)starts the
engine where asked (outside the agent's sync lock: the agent keeps syncing meanwhile),
then, holding the agent's sync lock so no sync runs in between, loads the agent's
newest publication if the instance holds an older version (the weight sync publishes
again from the trainer when the last publication was released or was an NCCL
broadcast, at the version the trainer holds then: a step that raced the join is served,
never refused), and only then lets requests reach it. A worker that dies or refuses
fails its own admission (False), never the run.

An instance of a base serves every adapter agent of it (`sharing`, from
runtime/bases.engine_units): admitting it for one of them admits it for all, the base's
engine started once, then each agent's adapter loaded at its synced version under that
agent's sync lock (an adapter is always loaded from its trainer, version 0 included: the
base alone is no agent's weights). Such an instance leaves its agents together, so
balancing and rejoin move instances between engine units, never between agents of a base.

It does not decide which agent an instance should serve (rejoin.py and the balancer
do), nor when an agent syncs (the pipeline does).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol

from .server import RemoteError, WorkerDied
from .versions import SyncedVersions
from .weight_sync import engines_sharing_gpu

log = logging.getLogger("flexmarl.instances")


@dataclass
class Instance:
    worker: str
    serves: set[str] = field(default_factory=set)  # agents whose requests it takes
    holds: dict[str, int] = field(default_factory=dict)  # agent -> version of its weights it holds
    served_before: set[str] = field(default_factory=set)  # agents it served until it left or died


class RolloutInstances:
    def __init__(self, server: Any, emit: Callable[[ev.Event], Any] | None = None) -> None:
        self.server = server  # registry.alive(): only live workers are routed to
        self.emit = emit or (lambda event: None)
        self._instances: dict[str, Instance] = {}
        self._order: dict[str, list[str]] = defaultdict(list)  # agent -> instances serving it, in routing order
        self._placed: dict[str, int] = {}  # worker -> its position in set-up's placement
        self.outstanding: dict[str, float] = defaultdict(float)  # worker -> tokens in flight (read-only outside)

    def _get(self, worker: str) -> Instance:
        if worker not in self._instances:
            self._instances[worker] = Instance(worker)
        return self._instances[worker]

    # ------------------------------------------------------------ reading

    def instances(self, agent: str) -> list[str]:
        """The live instances serving `agent`, in the order they joined it."""
        alive = {w.worker_id for w in self.server.registry.alive("rollout")}
        return [w for w in self._order.get(agent, []) if w in alive]

    @property
    def assignment(self) -> dict[str, list[str]]:
        """agent -> the instances serving it (live or not), in join order; a copy."""
        return {a: list(ws) for a, ws in self._order.items()}

    def holds(self, worker: str, agent: str) -> int | None:
        """The version of `agent`'s weights `worker` holds, None if none."""
        inst = self._instances.get(worker)
        return None if inst is None else inst.holds.get(agent)

    def serves(self, worker: str) -> set[str]:
        inst = self._instances.get(worker)
        return set(inst.serves) if inst is not None else set()

    def served_before(self, worker: str) -> str | None:
        inst = self._instances.get(worker)
        return min(inst.served_before) if inst is not None and inst.served_before else None

    # ------------------------------------------------------------ writing (asked by others)

    def place(self, plan: dict[str, list[str]]) -> None:
        """Set-up's placement (agent -> workers): the routing order of the workers once admitted."""
        self._placed = {w: i for i, w in enumerate(w for ws in plan.values() for w in ws)}

    def engine_started(self, worker: str, agent: str, version: int | None) -> None:
        """`worker`'s engine (re)started on `agent`'s model at `version`: it holds nothing
        else (None: a base's engine, which holds no adapter until one is loaded)."""
        self._get(worker).holds = {} if version is None else {agent: version}

    def loaded(self, worker: str, agent: str, version: int) -> None:
        self._get(worker).holds[agent] = version

    def serve(self, worker: str, agent: str, why: str) -> None:
        """Requests of `agent` may reach `worker` (the admission calls this, last)."""
        inst = self._get(worker)
        inst.serves.add(agent)
        inst.served_before.discard(agent)
        order = self._order[agent]
        if worker not in order:
            order.append(worker)
            order.sort(key=lambda w: self._placed.get(w, len(self._placed)))  # stable: joiners keep their order
        self.emit(ev.AllocationChanged("rollout", agent, list(self._order[agent]), why))

    def leave(self, worker: str, agent: str, why: str) -> None:
        """No new request of `agent` reaches `worker` (what is in flight finishes)."""
        inst = self._get(worker)
        inst.serves.discard(agent)
        inst.served_before.add(agent)
        if worker in self._order[agent]:
            self._order[agent].remove(worker)
        self.emit(ev.AllocationChanged("rollout", agent, list(self._order[agent]), why))

    def died(self, worker: str) -> None:
        """A dead instance leaves every agent and holds nothing (its unfinished work is
        re-issued by the rollout client); a new process under its id starts bare."""
        inst = self._instances.get(worker)
        if inst is None:
            return
        for agent in sorted(inst.serves):
            self.leave(worker, agent, f"{worker} died")
            if not self._order[agent]:
                log.error("agent %s has no rollout instance left; its requests wait for one to (re)join", agent)
        inst.holds = {}

    def add_work(self, worker: str, tokens: float) -> None:
        self.outstanding[worker] += tokens

    def work_done(self, worker: str, tokens: float) -> None:
        self.outstanding[worker] -= tokens


class Admission:
    """The one path by which an instance comes to serve an agent (see the module doc)."""

    def __init__(self, instances: RolloutInstances, weights: Any, versions: SyncedVersions, server: Any,
                 engine_message: Callable[[str], protocol.LoadModel],
                 sharing: dict[str, list[str]] | None = None) -> None:
        # adapter agent -> every adapter agent of its base (what one engine of it serves);
        # an agent not named is a whole model, served alone.
        self.sharing = sharing or {}
        self.instances = instances
        self.weights = weights  # locks, load_newest(worker, agent) -> version
        self.versions = versions
        self.server = server  # call(), registry.workers
        self.engine_message = engine_message  # agent -> the LoadModel that starts its engine at version 0

    async def admit(self, worker: str, agent: str, *, restart: bool = True, why: str = "joins",
                    engine: protocol.LoadModel | None = None) -> bool:
        """Makes `worker` serve `agent` at the agent's synced version (or newer); False if
        the worker died or refused (it then serves no new agent; the run goes on).

        `restart`: start the engine on the agent's model first (`engine`: with this message
        instead of the model directory's, as set-up of a resumed run does). Without it the
        weights are swapped in place, and the engine restarts if the instance refuses or
        if the agent is still at version 0 (its weights are the model directory's)."""
        agents = self.sharing.get(agent, [agent])
        adapters = agent in self.sharing
        try:
            if restart:
                await self._start_engine(worker, agent, engine)
            for each in agents:  # one lock at a time: each agent's syncs wait only for its own load
                async with self.weights.locks[each]:
                    held = self.instances.holds(worker, each)
                    if held is None or held < self.versions[each]:
                        if adapters:  # an adapter comes from its trainer, version 0 included
                            self.instances.loaded(worker, each, await self.weights.load_newest(worker, each))
                        else:
                            await self._load(worker, each, restarted=restart)
                    if not self._alive(worker):
                        raise WorkerDied(worker, "it died while being admitted")
                    self.instances.serve(worker, each, f"{worker} {why}")
        except WorkerDied as exc:
            log.warning("%s died while joining %s: %s", worker, agent, exc)
            return False
        except RemoteError as exc:
            log.error("%s could not serve %s (%s); it serves no new agent. Check its log in the run "
                      "directory's logs/ folder.", worker, agent, exc)
            return False
        return True

    async def _start_engine(self, worker: str, agent: str, engine: protocol.LoadModel | None = None) -> None:
        message = engine or self.engine_message(agent)
        shared = engines_sharing_gpu(worker, self.server.registry.workers)  # they split the GPU's share
        if shared != message.engine.engines_on_gpu:
            message = msgspec.structs.replace(message, engine=msgspec.structs.replace(message.engine,
                                                                                      engines_on_gpu=shared))
        reply, _ = await self.server.call(worker, message)
        base = message.engine.max_loras > 0  # a base's engine: its agents' adapters come next
        self.instances.engine_started(worker, agent, None if base else message.version)
        log.info("%s runs %s's engine at version %d (%.1fs to start)", worker, agent, message.version,
                 getattr(reply, "seconds", 0.0))

    async def _load(self, worker: str, agent: str, restarted: bool) -> None:
        if self.versions[agent] == 0 and not restarted:  # version 0 is the model directory's weights
            await self._start_engine(worker, agent)
            return
        try:
            version = await self.weights.load_newest(worker, agent)
        except RemoteError as exc:
            if restarted:
                raise
            log.info("%s cannot swap %s's weights in place (%s); restarting its engine", worker, agent, exc)
            await self._start_engine(worker, agent)
            if self.versions[agent] == 0:
                return
            version = await self.weights.load_newest(worker, agent)
        self.instances.loaded(worker, agent, version)

    def _alive(self, worker: str) -> bool:
        info = self.server.registry.workers.get(worker)
        return info is not None and info.alive
