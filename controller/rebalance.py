"""Level 1 load balancing, the asyncio side: observe demand, move rollout instances.

`Rebalancer.run()` runs next to the training loops when `router.across_agents` is on.
Consumes: the rollout client's counters (tokens outstanding per instance, tokens
dispatched per agent) and the rollout workers' heartbeat loads (`busy_s`). Produces:
moves, each carried out by `reassign`, and `DemandObserved` / `RebalanceDecided` events
(so `replay --check` re-drives the balancer). Waits for: `router.interval_s` between
observations, and for a move to finish before the next observation. Ends by itself once
the schedule says every global batch is trained.

`reassign(worker, src, dst)` moves one instance: it leaves `src`'s assignment (no
new requests), its outstanding work drains (bounded wait; if it does not drain, the
instance goes back to `src`), it loads `dst`'s model (an engine restart: agents'
architectures differ), then, holding `dst`'s sync lock so no weight sync of `dst` runs in
between, `dst`'s synced weights, and joins `dst`'s assignment. Every change is an
AllocationChanged event whose `why` carries the cost in seconds; `reassignments` lists
them. An agent is never left without an instance.

The decisions are in balancer.py; this module only gathers numbers and executes.
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
from typing import Any, Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.config import RouterConfig

from .balancer import AgentDemand, RolloutBalancer
from .server import RemoteError, WorkerDied

log = logging.getLogger("flexmarl.rebalance")

DRAIN_TIMEOUT_S = 30.0  # an instance whose work has not drained by then stays where it was
# What a move is assumed to cost until one has been measured: a vLLM engine restart on a
# CPU host took 4-10 s in bench/load_balance.py. Measured costs replace it.
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
    def __init__(self, cfg: RouterConfig, agents: list[str], client: Any, server: Any, weights: Any,
                 model_path: dict[str, str], load_model_message: Callable[[str], protocol.LoadModel],
                 emit: Callable[[ev.Event], Any], finished: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.agents = list(agents)
        self.client = client  # assignment, instances(), outstanding, dispatched_tokens
        self.server = server  # call(), next_request_id(), registry.workers (heartbeat loads)
        self.weights = weights  # locks, synced, start_engine(), bring_up_to_date()
        self.model_path = model_path  # to tell whether two agents' engines have the same shape
        self.load_model_message = load_model_message  # agent -> the LoadModel that starts its engine
        self.emit = emit
        self.finished = finished
        self.reassignments: list[Reassignment] = []

    def demand_snapshot(self) -> dict[str, AgentDemand]:
        client, workers = self.client, self.server.registry.workers
        snapshot = {}
        for agent in self.agents:
            instances = client.instances(agent)
            snapshot[agent] = AgentDemand(
                outstanding={w: max(0.0, client.outstanding[w]) for w in instances},
                dispatched_tokens=client.dispatched_tokens[agent],
                busy_s={w: workers[w].load["busy_s"] for w in instances if "busy_s" in workers[w].load})
        return snapshot

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
            await asyncio.gather(*(self.reassign(w, move.src, move.dst, move.why) for w in move.instances))
            if self.reassignments:  # the balancer weighs the next move by what moves really cost
                balancer.move_cost_s = sum(r.seconds for r in self.reassignments) / len(self.reassignments)

    async def reassign(self, worker: str, src: str, dst: str, why: str = "",
                       drain_timeout_s: float = DRAIN_TIMEOUT_S) -> Reassignment | None:
        """Moves `worker` from agent `src` to agent `dst` (see module doc); None if it did not."""
        client = self.client
        t0 = time.monotonic()
        async with self.weights.locks[src]:  # no weight sync of src is addressing this instance now
            if worker not in client.assignment.get(src, []) or len(client.instances(src)) < 2:
                log.info("not moving %s from %s: it is not there or is the agent's last instance", worker, src)
                return None
            client.assignment[src].remove(worker)
            self.emit(ev.AllocationChanged("rollout", src, list(client.assignment[src]),
                                           f"{worker} leaves for {dst}: {why}"))
        if not await _drained(client, worker, drain_timeout_s):
            async with self.weights.locks[src]:  # src may have synced while the instance was out
                if self.weights.synced[src] > 0:
                    await self.weights.bring_up_to_date(worker, src)
                client.assignment[src].append(worker)
            self.emit(ev.AllocationChanged("rollout", src, list(client.assignment[src]),
                                           f"{worker} stays: its work did not drain within {drain_timeout_s:.0f}s"))
            log.warning("%s did not drain within %.0fs; it keeps serving %s", worker, drain_timeout_s, src)
            return None
        t_drained = time.monotonic()
        try:
            restarted = await self._join(worker, src, dst)
            done = Reassignment(worker, src, dst, t_drained - t0, time.monotonic() - t_drained, restarted)
            self.emit(ev.AllocationChanged(
                "rollout", dst, list(client.assignment[dst]),
                f"{worker} joins from {src}: {done.seconds:.2f}s (drain {done.drain_s:.2f}s, "
                f"{'engine restart' if restarted else 'weights in place'} {done.load_s:.2f}s)"))
        except WorkerDied as exc:
            log.warning("%s died while moving to %s: %s", worker, dst, exc)
            return None
        except RemoteError as exc:
            log.error("%s could not load %s (%s); it serves no agent now. Check its log in the run "
                      "directory's logs/ folder.", worker, dst, exc)
            return None
        self.reassignments.append(done)
        log.info("%s now serves %s (from %s) after %.2fs", worker, dst, src, done.seconds)
        return done

    async def _load_model(self, worker: str, agent: str) -> None:
        await self.weights.start_engine(worker, self.load_model_message(agent))

    async def _join(self, worker: str, src: str, dst: str) -> bool:
        """Makes `worker` serve `dst` at its synced version and adds it to `dst`'s
        assignment; True if its engine restarted.

        Agents' models differ, so the engine restarts on `dst`'s model (LoadModel at
        version 0, then LoadWeights of `dst`'s synced version past 0). The restart happens
        outside `dst`'s sync lock: it needs none of `dst`'s weights, and `dst` keeps
        syncing meanwhile. The weights are loaded and the instance joins under the lock, so
        the published handle stays valid and no sync of `dst` runs in between. With the
        same architecture, loading `dst`'s weights in place is enough; an instance that
        refuses (a worker that binds its engine to one agent does) restarts instead."""
        restarted = False
        if not same_architecture(self.model_path[src], self.model_path[dst]):
            await self._load_model(worker, dst)
            restarted = True
        async with self.weights.locks[dst]:
            if self.weights.synced[dst] > 0:
                try:
                    await self.weights.bring_up_to_date(worker, dst)
                except RemoteError as exc:
                    if restarted:
                        raise
                    log.info("%s cannot swap weights in place (%s); restarting its engine", worker, exc)
                    await self._load_model(worker, dst)
                    await self.weights.bring_up_to_date(worker, dst)
                    restarted = True
            elif not restarted:  # dst is still at version 0: its weights are the model directory's
                await self._load_model(worker, dst)
                restarted = True
            self.client.assignment.setdefault(dst, []).append(worker)
        return restarted


async def _drained(client: Any, worker: str, timeout_s: float) -> bool:
    """True once no request is outstanding on `worker`. Waits one loop turn first: a batch
    planned for it just before it left the assignment is counted only when it is sent."""
    deadline = time.monotonic() + timeout_s
    await asyncio.sleep(0)
    while client.outstanding[worker] > 0.5:
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
