"""Rollout at scale on a virtual clock: the controller's routing decisions driving
simulated inference instances (docs/architecture.md, "The path a group takes": rollout
routing; figures in bench/RESULTS.md, "system/load_balance.py").

Simulated: `instances` engines doing continuous batching (each step admits queued requests
up to `max_batch` sequences and takes `a + b * tokens` seconds of its agent's model, tokens
being the prompts admitted plus one per running sequence; a request admitted at step s with
an output of L tokens finishes at the end of step s + L - 1); a closed-loop multi-agent chain
(`concurrency` queries in flight; each output of agent d starts a group of agent d + 1); the
controller's groups (the samples of one parent output are one group, routed whole; the
groups that arise at the same virtual instant are routed together); level 1 moves (the instance leaves its agent, drains, restarts for
`reload_s`, then joins the other agent).

Reused unchanged: level 2 `route_group` (the function RolloutClient routes each group
with) and level 1 `RolloutBalancer`.

No sockets, processes or real time: a heap of events ordered by (virtual time, sequence).
Deterministic for a seed: each sample's output length derives from the seed and its place
in its query, so every configuration sees the same samples.

It does not model networks, weight syncs, training, failures or the controller's own CPU
time; its absolute numbers come from the cost model, only ratios between configs mean much.
"""

from __future__ import annotations

import heapq
import random
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flexmarl.runtime.config import RouterConfig

from .balance_rules import AgentDemand, RolloutBalancer
from .router import route_group

# name -> (within-agent routing, level 1 on?)
CONFIGS = {"static": ("round_robin", False), "intra": ("least_loaded", False), "hierarchical": ("least_loaded", True)}


@dataclass(frozen=True)
class AgentProfile:
    """One agent of the chain: its requests and its model's step cost."""

    name: str
    group_size: int  # samples per group; a group per output of the previous agent
    prompt_tokens: int
    min_output: int  # output lengths are uniform in [min_output, max_output]
    max_output: int
    step_base_s: float  # a: per-step cost of the model
    step_token_s: float  # b: cost per token in the step's batch


@dataclass(frozen=True)
class SimWorkload:
    chain: tuple[AgentProfile, ...]
    queries: int
    concurrency: int  # queries in flight (closed loop: one ends, the next starts)
    seed: int = 0


def skewed_workload(queries: int = 2000, concurrency: int = 512, seed: int = 0) -> SimWorkload:
    """A planner -> solver -> checker chain like the digit chain, at scale: the solver gets 8x
    the planner's requests, ~12x longer outputs and a 2.5x costlier model; most work is its."""
    return SimWorkload((
        AgentProfile("planner", 4, 8, 2, 6, 0.006, 0.00002),
        AgentProfile("solver", 8, 16, 24, 72, 0.015, 0.00006),
        AgentProfile("checker", 1, 64, 1, 3, 0.008, 0.00003),
    ), queries, concurrency, seed)


@dataclass
class SimResult:
    config: str
    instances: int
    samples: int
    virtual_s: float
    busy: list[float]  # per instance: fraction of the virtual time spent in engine steps
    reassignments: int  # instances moved between agents
    final_assignment: dict[str, int] = field(default_factory=dict)  # agent -> instances at the end

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.virtual_s if self.virtual_s > 0 else 0.0


class _Instance:
    __slots__ = ("name", "agent", "queue", "finish", "running", "step", "busy_s", "stepping", "leaving", "outstanding")

    def __init__(self, name: str, agent: str) -> None:
        self.name, self.agent = name, agent
        self.queue: deque = deque()  # requests routed here, not yet admitted
        self.finish: dict[int, list] = {}  # step index -> requests whose last token it makes
        self.running = self.step = 0
        self.busy_s = 0.0
        self.stepping = False
        self.leaving = ""  # the agent it moves to, while it drains and restarts
        self.outstanding = 0.0  # the router's view: tokens routed here and unfinished


@dataclass
class _Clock:
    """Virtual time and the events due on it, in time order (ties: in the order scheduled)."""

    now: float = 0.0
    events: list = field(default_factory=list)  # heap of (time, seq, kind, arg)
    seq: int = 0

    def at(self, t: float, kind: str, arg) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg))

    def pending(self) -> bool:
        return bool(self.events)

    def pending_now(self) -> bool:
        """Another event is due at this same instant."""
        return bool(self.events) and self.events[0][0] <= self.now

    def advance(self) -> tuple[str, Any]:
        """Moves to the next event's time; its kind and argument."""
        self.now, _, kind, arg = heapq.heappop(self.events)
        return kind, arg


@dataclass
class _Counts:
    """What happened so far: samples finished, queries started and done, instance moves,
    and when the last query finished."""

    samples: int = 0
    queries_started: int = 0
    queries_done: int = 0
    moved: int = 0
    last_done_t: float = 0.0


class Simulation:
    """One configuration on one workload: equal split at the start, then `run()` to the
    last query. `router` supplies level 1's threshold, patience, cooldown and interval."""

    def __init__(self, workload: SimWorkload, instances: int, config: str = "hierarchical", *,
                 router: RouterConfig | None = None, max_batch: int = 32, reload_s: float = 5.0) -> None:
        if config not in CONFIGS:
            raise ValueError(f"unknown config {config!r} (known: {', '.join(CONFIGS)})")
        chain = workload.chain
        if instances < len(chain):
            raise ValueError(f"{len(chain)} agents need at least {len(chain)} instances")
        self.w, self.config, self.max_batch, self.reload_s = workload, config, max_batch, reload_s
        self.within, level1 = CONFIGS[config]
        self.router = router or RouterConfig()
        self.balancer = RolloutBalancer.from_config(self.router, move_cost_s=reload_s) if level1 else None
        self.profile = {p.name: p for p in chain}
        self.inst = [_Instance(f"i{k}", chain[k % len(chain)].name) for k in range(instances)]  # equal split
        self.by_name = {i.name: i for i in self.inst}
        self.assignment = {p.name: [i.name for i in self.inst if i.agent == p.name] for p in chain}
        self.dispatched = {p.name: 0.0 for p in chain}
        self._turn = {p.name: 0 for p in chain}
        self._rng = random.Random(workload.seed)
        self._coalesce: dict[str, list] = {p.name: [] for p in chain}  # agent -> groups (lists of requests)
        self.clock = _Clock()
        self.count = _Counts()
        self._pending: dict[int, int] = {}  # query -> samples not yet finished

    # ------------------------------------------------------------ the clock

    @property
    def now(self) -> float:
        return self.clock.now

    def _at(self, t: float, kind: str, arg) -> None:
        self.clock.at(t, kind, arg)

    def run(self) -> SimResult:
        for _ in range(min(self.w.concurrency, self.w.queries)):
            self._start_query()
        if self.balancer is not None:
            self._at(self.router.interval_s, "observe", None)
        self._flush()
        handlers = {"step": self._step_done, "observe": self._observe, "joined": self._joined}
        while self.clock.pending() and self.count.queries_done < self.w.queries:
            kind, arg = self.clock.advance()
            handlers[kind](arg)
            if not self.clock.pending_now():
                self._flush()
        t = self.count.last_done_t
        return SimResult(self.config, len(self.inst), self.count.samples, t,
                         [round(i.busy_s / t, 4) if t else 0.0 for i in self.inst], self.count.moved,
                         {a: len(ws) for a, ws in self.assignment.items()})

    # ------------------------------------------------------------ the workload

    def _start_query(self) -> None:
        q = self.count.queries_started
        self.count.queries_started += 1
        self._pending[q] = 0
        self._spawn(q, 0, str(q))

    def _spawn(self, q: int, depth: int, key: str) -> None:
        p = self.w.chain[depth]
        span = p.max_output - p.min_output + 1
        group = []
        for j in range(p.group_size):
            k = f"{key}.{j}"
            length = p.min_output + zlib.crc32(f"{self.w.seed}:{k}".encode()) % span
            group.append((q, depth, k, p.prompt_tokens + p.max_output, length))
        self._coalesce[p.name].append(group)
        self._pending[q] += p.group_size

    def _finished(self, req) -> None:
        q, depth, key, _, _ = req
        self.count.samples += 1
        if depth + 1 < len(self.w.chain):
            self._spawn(q, depth + 1, key)
        self._pending[q] -= 1
        if self._pending[q] == 0:
            del self._pending[q]
            self.count.queries_done += 1
            self.count.last_done_t = self.now
            if self.count.queries_started < self.w.queries:
                self._start_query()

    # ------------------------------------------------------------ level 2: routing

    def _flush(self) -> None:
        for agent, batch in self._coalesce.items():
            if batch and self.assignment[agent]:
                self._coalesce[agent] = []
                self._dispatch(agent, batch)

    def _dispatch(self, agent: str, groups: list) -> None:
        names = self.assignment[agent]
        touched = {}
        for group in groups:
            w = route_group(self.within, names, lambda w: self.by_name[w].outstanding, self._turn[agent], self._rng)
            self._turn[agent] += 1
            inst = touched[w] = self.by_name[w]
            for req in group:
                inst.queue.append(req)
                inst.outstanding += req[3]
                self.dispatched[agent] += req[3]
        for inst in touched.values():
            if not inst.stepping:
                self._start_step(inst)

    # ------------------------------------------------------------ the engines

    def _start_step(self, inst: _Instance) -> None:
        p = self.profile[inst.agent]
        tokens = inst.running
        while inst.queue and inst.running < self.max_batch:
            req = inst.queue.popleft()
            inst.finish.setdefault(inst.step + req[4] - 1, []).append(req)
            inst.running += 1
            tokens += p.prompt_tokens
        inst.stepping = True
        seconds = p.step_base_s + p.step_token_s * tokens
        self._at(self.now + seconds, "step", (inst, seconds))

    def _step_done(self, arg) -> None:
        inst, seconds = arg
        inst.busy_s += seconds
        done = inst.finish.pop(inst.step, ())
        inst.step += 1
        inst.running -= len(done)
        for req in done:
            inst.outstanding -= req[3]
            self._finished(req)
        if inst.running or inst.queue:
            self._start_step(inst)
        else:
            inst.stepping = False
            if inst.leaving:
                self._at(self.now + self.reload_s, "joined", inst)

    # ------------------------------------------------------------ level 1: moves

    def _observe(self, _) -> None:
        snapshot = {a: AgentDemand({w: self.by_name[w].outstanding for w in ws}, self.dispatched[a],
                                   {w: self.by_name[w].busy_s for w in ws})
                    for a, ws in self.assignment.items()}
        assert self.balancer is not None  # observed only where level 1 balances
        move = self.balancer.observe(snapshot, self.now)
        if move is not None:
            for w in move.instances:
                inst = self.by_name[w]
                self.assignment[move.src].remove(w)
                inst.leaving = move.dst
                if not inst.stepping:  # idle: restarts at once
                    self._at(self.now + self.reload_s, "joined", inst)
        self._at(self.now + self.router.interval_s, "observe", None)

    def _joined(self, inst: _Instance) -> None:
        inst.agent, inst.leaving = inst.leaving, ""
        inst.finish, inst.step = {}, 0
        self.assignment[inst.agent].append(inst.name)
        self.count.moved += 1


def simulate(workload: SimWorkload, instances: int, config: str, **kw) -> SimResult:
    return Simulation(workload, instances, config, **kw).run()
