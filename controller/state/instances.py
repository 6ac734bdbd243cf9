"""The rollout instances: which engine unit each serves, the version of each agent it
holds, its outstanding work, what it served before.

`RolloutInstances` is the only writer of that state. An engine unit
(runtime/bases.EngineUnit) is a whole-model agent, or a base with every adapter agent of
it: loading a whole model replaces what an instance holds, loading an adapter adds to it
(`loaded`). The rollout client reads the live instances serving an agent and counts work
on them through it (`add_work`, `work_done`); the weight sync records what it loaded;
balancing and the death of a worker take an instance out (`leave`, `died`). The live
instances of each agent are kept by those events (join, death, leave), never rebuilt from
the registry, so reading them is O(1). Routing order is set-up's placement order
(`place`; engines start concurrently and finish in any order), then the order others
joined.

The one way an instance comes to serve a unit is `Admission.admit` (rollout/admission.py),
which loads weights and then calls `serve` here. This module holds plain state: it sends
nothing and does not decide which unit an instance should serve (rejoin.py and the
balancer do), nor when an agent syncs (the pipeline does).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime.bases import EngineUnit, Units

from ..control.interfaces import Emit

log = logging.getLogger("flexmarl.instances")

@dataclass
class Instance:
    worker: str
    serves: set[str] = field(default_factory=set)  # agents whose requests it takes
    holds: dict[str, int] = field(default_factory=dict)  # agent -> version of its weights it holds
    served_before: str | None = None  # the unit it served until it left or died
    starts: int = 0  # engines started on it so far

class RolloutInstances:
    def __init__(self, units: Mapping[str, EngineUnit], emit: Emit | None = None) -> None:
        self.units = units if isinstance(units, Units) else Units(dict(units))
        self.emit = emit or (lambda event: None)
        self._instances: dict[str, Instance] = {}
        self._live: dict[str, list[str]] = defaultdict(list)  # agent -> instances serving it, in routing order
        self._placed: dict[str, int] = {}  # worker -> its position in set-up's placement
        self.outstanding: dict[str, float] = defaultdict(float)  # worker -> tokens in flight (read-only outside)
        self.on_drained: list[Callable[[str], None]] = []  # told when an instance's last group came back

    def _get(self, worker: str) -> Instance:
        if worker not in self._instances:
            self._instances[worker] = Instance(worker)
        return self._instances[worker]

    # ------------------------------------------------------------ reading

    def instances(self, agent: str) -> list[str]:
        """The live instances serving `agent`, in routing order (the owner's list: read it,
        never change it)."""
        return self._live[agent]

    @property
    def assignment(self) -> dict[str, list[str]]:
        """agent -> the instances serving it, in routing order; a copy."""
        return {a: list(ws) for a, ws in self._live.items()}

    def holds(self, worker: str, agent: str) -> int | None:
        """The version of `agent`'s weights `worker` holds, None if none."""
        inst = self._instances.get(worker)
        return None if inst is None else inst.holds.get(agent)

    def serving(self, worker: str, agent: str) -> bool:
        """Whether `worker` takes `agent`'s requests now (O(1))."""
        inst = self._instances.get(worker)
        return inst is not None and agent in inst.serves

    def serves(self, worker: str) -> set[str]:
        inst = self._instances.get(worker)
        return set(inst.serves) if inst is not None else set()

    def starts(self, worker: str) -> int:
        """How many engines were started on `worker` so far."""
        inst = self._instances.get(worker)
        return 0 if inst is None else inst.starts

    def served_before(self, worker: str) -> str | None:
        """The unit `worker` served until it left it or died."""
        inst = self._instances.get(worker)
        return None if inst is None else inst.served_before

    # ------------------------------------------------------------ writing (asked by others)

    def place(self, plan: dict[str, list[str]]) -> None:
        """Set-up's placement (unit or agent -> workers): the routing order of the workers once admitted."""
        self._placed = {w: i for i, w in enumerate(w for ws in plan.values() for w in ws)}

    def engine_started(self, worker: str, unit: str, version: int) -> None:
        """`worker`'s engine (re)started on `unit`'s model at `version`: it holds nothing
        else (a base's engine holds no adapter until one is loaded)."""
        u, inst = self.units[unit], self._get(worker)
        inst.holds = {} if u.lora else {u.agents[0]: version}
        inst.starts += 1

    def loaded(self, worker: str, agent: str, version: int) -> None:
        """`worker` loaded `agent`'s weights at `version`: an adapter joins what it holds;
        a whole model replaces it (the engine's weights are this agent's now, whatever
        it held before)."""
        inst = self._get(worker)
        if self.units.of(agent).lora:
            inst.holds[agent] = version
        else:
            inst.holds = {agent: version}

    def serve(self, worker: str, agent: str, why: str) -> None:
        """Requests of `agent` may reach `worker` (the admission calls this, last)."""
        inst = self._get(worker)
        inst.serves.add(agent)
        live = self._live[agent]
        if worker not in live:
            live.append(worker)
            live.sort(key=lambda w: self._placed.get(w, len(self._placed)))  # stable: joiners keep their order
        self.emit(ev.AllocationChanged("rollout", agent, list(live), why))

    def leave(self, worker: str, agent: str, why: str) -> None:
        """No new request of `agent` reaches `worker` (what is in flight finishes)."""
        inst = self._get(worker)
        inst.serves.discard(agent)
        inst.served_before = self.units.of(agent).name
        if worker in self._live[agent]:
            self._live[agent].remove(worker)
        self.emit(ev.AllocationChanged("rollout", agent, list(self._live[agent]), why))

    def died(self, worker: str) -> None:
        """A dead instance leaves every agent and holds nothing (its unfinished work is
        re-issued by the rollout client); a new process under its id starts bare."""
        inst = self._instances.get(worker)
        if inst is None:
            return
        for agent in sorted(inst.serves):
            self.leave(worker, agent, f"{worker} died")
            if not self._live[agent]:
                log.error("agent %s has no rollout instance left; its requests wait for one to (re)join", agent)
        inst.holds = {}

    def add_work(self, worker: str, tokens: float) -> None:
        self.outstanding[worker] += tokens

    def work_done(self, worker: str, tokens: float) -> None:
        self.outstanding[worker] -= tokens
        if self.outstanding[worker] <= 0:
            for hook in self.on_drained:
                hook(worker)

    def drained(self, agent: str) -> int:
        """How many of the live instances serving `agent` have no group outstanding (capacity
        admission's measure of an engine about to idle: a group comes back whole, so the
        router sees an instance's batch drain group by group)."""
        return sum(1 for w in self._live.get(agent, ()) if self.outstanding.get(w, 0.0) <= 0)
