"""Level 1 load balancing, the asyncio side: observe demand, move rollout instances.

`Rebalancer.run()` runs next to the training loops when `router.across_agents` is on.
Consumes: the rollout client's counters (tokens outstanding per instance, tokens
dispatched per agent) and the rollout workers' heartbeat loads (`busy_s`). Produces:
moves, each carried out by `reassign`, and `DemandObserved` / `RebalanceDecided` events
(so `replay --check` re-drives the balancer). Waits for: `router.interval_s` between
observations, and for a move to finish before the next observation. Ends by itself once
the schedule says every global batch is trained.

`place_by_measure(step, ...)` runs once after the first batch (`router.measured_placement`):
where that batch's tokens per instance were uneven and the most-asked unit's instances busy,
it moves instances so that each unit's share follows the tokens sent
(`balance_rules.measured_placement`), logging `PlacementMeasured` and the moves.

`reassign(worker, src, dst)` moves one instance (`reassign_together` several, admitted at
once): it leaves `src` (no new requests), its outstanding work drains (bounded wait), and
the admission (admission.py) makes it serve `dst`: an engine restart on `dst`'s model
where the architectures differ, else the weights swapped in place, then `dst`'s synced
weights under `dst`'s sync lock. If the work does not drain in time the instance goes back
to `src` through the admission (which loads nothing unless `src` synced while it was out).
A worker that dies or refuses on the way fails its move alone, never the run. Every change
is an AllocationChanged event; `reassignments` lists the moves with what each cost. An
agent is never left without an instance.

It balances engine units (runtime/bases.engine_units): a whole-model agent, or every
adapter agent of one base, whose instances serve all of them at once. A base's agents
share its instances, so there is nothing to move between them; a unit's demand is its
agents' together, and an instance moving into or out of a base restarts its engine (a
base's engine has LoRA slots, a whole model's has none).

The decisions are in balance_rules.py; this module only gathers numbers and executes.
It does not know how demand is weighed or when a move is warranted, nor anything of
training beyond "every batch is trained".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from flexmarl.runtime import events as ev
from flexmarl.runtime.bases import EngineUnit
from flexmarl.runtime.config import RouterConfig

from ..control.interfaces import Emit, WorkerDirectory
from .balance_rules import (BUSY_ENOUGH, AgentDemand, RolloutBalancer, measured_placement, nearest_rule,
                            uneven_placement)

if TYPE_CHECKING:
    from ..state.instances import RolloutInstances
    from ..weights.sync import WeightSync
    from .admission import Admission
    from .router import RolloutClient

log = logging.getLogger("flexmarl.balance_loop")

DRAIN_TIMEOUT_S = 30.0  # an instance whose work has not drained by then stays where it was
# What a move is assumed to cost until one has been measured: a vLLM engine restart on a
# CPU host took 4-10 s in bench/system/load_balance.py. Measured costs replace it.
FIRST_MOVE_COST_S = 5.0


@dataclass
class Reassignment:
    worker: str
    src: str
    dst: str
    drain_s: float
    load_s: float
    restarted: bool

    @property
    def seconds(self) -> float:
        return self.drain_s + self.load_s


class Rebalancer:
    def __init__(self, cfg: RouterConfig, units: Mapping[str, EngineUnit], instances: RolloutInstances,
                 admission: Admission, client: RolloutClient, server: WorkerDirectory, weights: WeightSync,
                 model_path: dict[str, str],
                 emit: Emit, finished: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.units = units  # what the balancer sees and moves instances between
        self.instances = instances
        self.admission = admission
        self.client = client
        self.server = server
        self.weights = weights
        self.model_path = model_path  # unit -> model: whether two units' engines have the same shape
        self.emit = emit
        self.finished = finished
        self.reassignments: list[Reassignment] = []

    def demand_snapshot(self) -> dict[str, AgentDemand]:
        owner, workers = self.instances, self.server.registry.workers
        snapshot = {}
        for unit, u in self.units.items():
            instances = owner.instances(u.agents[0])  # every agent of a unit has the same ones
            snapshot[unit] = AgentDemand(
                outstanding={w: max(0.0, owner.outstanding[w]) for w in instances},
                dispatched_tokens=sum(self.client.dispatched_tokens[a] for a in u.agents),
                busy_s={w: workers[w].load["busy_s"] for w in instances if "busy_s" in workers[w].load})
        return snapshot

    def placement_hint(self, step: int, rules: Mapping[str, Mapping[str, float]]) -> str:
        """One line for the run's log where the instances' shares of the tokens sent so far
        (through `step`) differ by `router.disparity_threshold` or more per instance, and an
        instance could move (`balance_rules.uneven_placement`): the two units, and the
        placement rule (`rules`: router.placement's choices, each unit's weight) whose shares
        the tokens sent fit within that threshold, where it is not the one in use; "" where
        they do not differ."""
        snapshot = self.demand_snapshot()
        found = uneven_placement(snapshot, self.cfg.disparity_threshold)
        if found is None:
            return ""
        most, fewest, ratio = found
        n_most, n_fewest = len(snapshot[most].outstanding), len(snapshot[fewest].outstanding)
        fit, off = nearest_rule({u: d.dispatched_tokens for u, d in snapshot.items()}, rules)
        advice = (f"the tokens sent fit router.placement = {fit!r} (every unit's share within {off:.1f}x): set it, "
                  f"or router.across_agents = true to move instances by measured demand"
                  if fit and fit != self.cfg.placement and off < self.cfg.disparity_threshold
                  else "router.across_agents = true moves instances by measured demand")
        return (f"rollout instances are unevenly loaded: through step {step}, {most} ({_instances(n_most)}) was "
                f"sent {ratio:.1f}x the tokens per instance of {fewest} ({_instances(n_fewest)}) "
                f"(router.placement = {self.cfg.placement!r}); {advice}")

    async def place_by_measure(self, step: int, busy_s: Mapping[str, float],
                               seconds: float) -> list[Reassignment | None]:
        """Once `step`'s rollout ended (`router.measured_placement`): where the instances'
        shares of the tokens sent so far are uneven and the most-asked unit's instances were
        busy (`busy_s`: each instance's busy seconds over the `seconds` so far), moves
        instances so that each unit's share follows the tokens (`balance_rules.measured_placement`),
        every move at once. Logs the measurement (PlacementMeasured) and each move
        (RebalanceDecided) first. What each instance's move came to, in order (None: it did
        not move)."""
        snapshot = self.demand_snapshot()
        busy = {u: round(sum(busy_s.get(w, 0.0) for w in d.outstanding) / len(d.outstanding) / seconds, 4)
                for u, d in snapshot.items() if d.outstanding and seconds > 0}
        self.emit(ev.PlacementMeasured(step, {u: dict(d.outstanding) for u, d in snapshot.items()},
                                       {u: d.dispatched_tokens for u, d in snapshot.items()}, busy))
        moves = measured_placement(snapshot, self.cfg.disparity_threshold, busy)
        found = uneven_placement(snapshot, self.cfg.disparity_threshold)
        if not moves:
            if found is not None:
                log.info("rollout instances unevenly asked through step %d (each instance of %s was sent %.1fx the "
                         "tokens of each of %s's), but %s's were busy %.0f%% of the time (under %.0f%%): the first "
                         "placement is kept", step, found[0], found[2], found[1], found[0],
                         100 * busy.get(found[0], 0.0), 100 * BUSY_ENOUGH)
            return []
        for move in moves:
            self.emit(ev.RebalanceDecided(list(move.instances), move.src, move.dst, move.why))
        before = {u: len(d.outstanding) for u, d in snapshot.items()}
        after = dict(before)
        for move in moves:
            after[move.src] -= len(move.instances)
            after[move.dst] += len(move.instances)
        changed = ", ".join(f"{u} {before[u]} -> {after[u]}" for u in before if after[u] != before[u])
        most = found[0] if found is not None else ""
        log.info("rollout instances %s through step %d, %s's busy %.0f%% of the time (router.placement = %r; "
                 "router.measured_placement = false keeps the first placement): %s", moves[0].why, step, most,
                 100 * busy.get(most, 0.0), self.cfg.placement, changed)
        done = await asyncio.gather(*(self.reassign_together(m.instances, m.src, m.dst, m.why) for m in moves))
        return [r for rs in done for r in rs]

    async def run(self) -> None:
        """Observes demand every interval and carries out the balancer's moves (see module doc)."""
        balancer = RolloutBalancer.from_config(self.cfg, move_cost_s=FIRST_MOVE_COST_S)
        while not self.finished():
            await asyncio.sleep(self.cfg.interval_s)
            snapshot, now = self.demand_snapshot(), time.monotonic()
            self.emit(ev.DemandObserved(
                now, balancer.move_cost_s, {a: dict(d.outstanding) for a, d in snapshot.items()},
                {a: d.dispatched_tokens for a, d in snapshot.items()}, {a: dict(d.busy_s) for a, d in snapshot.items()}))
            move = balancer.observe(snapshot, now)
            if move is None:
                continue
            self.emit(ev.RebalanceDecided(list(move.instances), move.src, move.dst, move.why))
            log.info("moving %s from %s to %s: %s", ", ".join(move.instances), move.src, move.dst, move.why)
            await self.reassign_together(move.instances, move.src, move.dst, move.why)
            if self.reassignments:  # the balancer weighs the next move by what moves really cost
                balancer.move_cost_s = sum(r.seconds for r in self.reassignments) / len(self.reassignments)

    async def reassign(self, worker: str, src: str, dst: str, why: str = "",
                       drain_timeout_s: float = DRAIN_TIMEOUT_S) -> Reassignment | None:
        """Moves `worker` from unit `src` to unit `dst` (see module doc); None if it did not."""
        return (await self.reassign_together([worker], src, dst, why, drain_timeout_s))[0]

    async def reassign_together(self, workers: list[str] | tuple[str, ...], src: str, dst: str, why: str = "",
                                drain_timeout_s: float = DRAIN_TIMEOUT_S) -> list[Reassignment | None]:
        """Moves `workers` from unit `src` to unit `dst` together: each leaves and drains on
        its own, those drained are admitted to `dst` at once (`Admission.admit_together`:
        their loads side by side, not one after another under `dst`'s sync lock). Per
        worker, in order, what its move came to (None: it did not move)."""
        owner, first = self.instances, self.units[src].agents[0]
        t0 = time.monotonic()
        leaving = []
        for worker in workers:
            if worker not in owner.instances(first) or len(owner.instances(first)) < 2:
                log.info("not moving %s from %s: it is not there or is the agent's last instance", worker, src)
                continue
            for agent in self.units[src].agents:
                async with self.weights.locks[agent]:  # no weight sync of it is addressing this instance now
                    owner.leave(worker, agent, f"{worker} leaves for {dst}: {why}")
            leaving.append(worker)
        drained_at: dict[str, float] = {}

        async def drain(worker: str) -> None:
            if await _drained(owner, worker, drain_timeout_s):
                drained_at[worker] = time.monotonic()

        await asyncio.gather(*(drain(w) for w in leaving))
        stuck = [w for w in leaving if w not in drained_at]
        for worker in stuck:
            log.warning("%s did not drain within %.0fs; it keeps serving %s", worker, drain_timeout_s, src)
        if stuck:  # through the admission: nothing to load unless src synced while they were out
            await self.admission.admit_together(stuck, src, restart=False,
                                                why=f"stays: its work did not drain within {drain_timeout_s:.0f}s")
        moving = [w for w in leaving if w in drained_at]
        starts = {w: owner.starts(w) for w in moving}
        restart = (self.units[src].lora or self.units[dst].lora
                   or not same_architecture(self.model_path[src], self.model_path[dst]))
        admitted = await self.admission.admit_together(moving, dst, restart=restart, why=f"joins from {src}") \
            if moving else {}
        t1 = time.monotonic()
        done: dict[str, Reassignment] = {}
        for worker in moving:
            if not admitted[worker]:
                continue
            done[worker] = r = Reassignment(worker, src, dst, drained_at[worker] - t0, t1 - drained_at[worker],
                                            owner.starts(worker) > starts[worker])
            self.reassignments.append(r)
            log.info("%s now serves %s (from %s) after %.2fs (drain %.2fs, %s %.2fs)", worker, dst, src, r.seconds,
                     r.drain_s, "engine restart" if r.restarted else "weights in place", r.load_s)
        return [done.get(w) for w in workers]


def _instances(n: int) -> str:
    return f"{n} instance" if n == 1 else f"{n} instances"


async def _drained(instances: Any, worker: str, timeout_s: float) -> bool:
    """True once no request is outstanding on `worker`. Waits one loop turn first: a batch
    planned for it just before it left the assignment is counted only when it is sent."""
    deadline = time.monotonic() + timeout_s
    await asyncio.sleep(0)
    while instances.outstanding[worker] > 0.5:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def same_architecture(model_a: str, model_b: str) -> bool:
    """Whether two Hugging Face model directories share the engine shape: identical
    config.json (ignoring private `_` keys) and identical tokenizer files."""
    if model_a == model_b:
        return True
    a, b = Path(model_a), Path(model_b)
    try:
        ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    except (OSError, ValueError):
        return False
    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    if strip(ca) != strip(cb):
        return False
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        fa, fb = a / name, b / name
        if fa.exists() != fb.exists() or (fa.exists() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True
