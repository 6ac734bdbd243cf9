"""Level 1 of the hierarchical load balancer: how many rollout instances each agent gets.

`RolloutBalancer.observe(snapshot, now)` takes one demand snapshot per agent and returns a
`Move` (instances, from agent, to agent, why) or None. It keeps a little state between
observations: smoothed dispatch rates, a smoothed service rate per agent, and the
hysteresis (how long the current imbalance has lasted, when the last move happened).

The load of an agent is the work it has queued or in flight plus what keeps arriving
(the smoothed dispatch rate over a short horizon), converted from tokens into seconds of
instance time with the agent's measured service rate (tokens finished per busy second of
its instances), and divided by its instance count. Seconds, not tokens, because agents'
models differ: a token of a large model costs more than a token of a small one, and a
1-token answer to a long prompt costs one engine step, not as many as its prompt has tokens.

A move takes instances from the least loaded agent that has two or more to the most loaded
one when the ratio of their per-instance loads reaches `threshold`, only if the move
lowers the larger of the two loads, only if the receiver has more work per instance than
a move costs (`move_cost_s`: drain and restart), only after the same (to, from) pair has
been chosen for `patience` consecutive observations, and never within `cooldown_s` of the
previous move. Oscillating demand therefore moves nothing. Several instances may move at once
(as many as keep lowering the pair's maximum), which matters at hundreds of instances.


Plain synchronous Python over plain data: no sockets, no asyncio, no clocks of its own.
It does not know how a move is carried out (controller/rollout/balance_loop.py does it for real,
controller/rollout/simulator.py on a virtual clock), nor what a worker or an engine is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from flexmarl.runtime.config import RouterConfig

from ..state.decisions import place_agents


@dataclass(frozen=True)
class AgentDemand:
    """One agent at one observation."""

    # The agent's instances (its current assignment), each with the tokens (prompt +
    # max_tokens) queued or in flight on it, as the router counts them.
    outstanding: dict[str, float]
    # Tokens ever dispatched to the agent (cumulative); its rate is the arrival rate.
    dispatched_tokens: float = 0.0
    # Cumulative busy seconds per instance (the workers' heartbeat `busy_s`); with the
    # tokens finished it gives the service rate. Missing: service rate unknown.
    busy_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Move:
    """Reassign `instances` from agent `src` to agent `dst`."""

    instances: tuple[str, ...]
    src: str
    dst: str
    why: str


@dataclass
class _AgentEstimate:
    dispatched: float
    backlog: float
    busy: dict[str, float]
    rate: float = 0.0  # tokens/s arriving, smoothed
    done_tokens: float = 0.0  # smoothed tokens finished ...
    done_busy_s: float = 0.0  # ... per smoothed busy second: the service rate

    @property
    def service_rate(self) -> float:
        return self.done_tokens / self.done_busy_s if self.done_busy_s > 1e-9 else 0.0


class RolloutBalancer:
    """Decides level 1 moves from a stream of demand snapshots (see the module doc)."""

    def __init__(self, threshold: float = 5.0, patience: int = 3, cooldown_s: float = 5.0,
                 horizon_s: float = 1.0, smoothing_s: float = 5.0, move_cost_s: float = 0.0) -> None:
        if threshold < 1.0 or patience < 1:
            raise ValueError("threshold must be >= 1 and patience >= 1")
        self.threshold = threshold
        self.patience = patience
        self.cooldown_s = cooldown_s
        self.horizon_s = horizon_s  # how much of the arrival rate counts as demand now
        self.smoothing_s = smoothing_s  # time constant of the rate estimates
        # Seconds an instance is out of service while it moves (drain + restart). A receiver
        # with less work per instance than that would be done before the newcomer arrives.
        # Meaningful once service rates are measured (loads are seconds then).
        self.move_cost_s = move_cost_s
        self._est: dict[str, _AgentEstimate] = {}
        self._last_t: float | None = None
        self._streak: tuple[str, str] | None = None
        self._streak_len = 0
        self._last_move_t = -math.inf
        self.loads: dict[str, float] = {}  # per-instance load of each agent, last observation

    @classmethod
    def from_config(cls, cfg: RouterConfig, **kw) -> "RolloutBalancer":
        return cls(cfg.disparity_threshold, cfg.patience, cfg.cooldown_s, **kw)

    def observe(self, snapshot: dict[str, AgentDemand], now: float) -> Move | None:
        """One observation (`now` in seconds on any monotonic clock); the move to make, if any."""
        self._update_estimates(snapshot, now)
        self.loads = self.per_instance_loads(snapshot)
        choice = self._candidate(snapshot)
        if choice is None:
            self._streak, self._streak_len = None, 0
            return None
        dst, src, count, disparity = choice
        if (dst, src) == self._streak:
            self._streak_len += 1
        else:
            self._streak, self._streak_len = (dst, src), 1
        if self._streak_len < self.patience or now - self._last_move_t < self.cooldown_s:
            return None
        donors = sorted(snapshot[src].outstanding, key=lambda w: (snapshot[src].outstanding[w], w))
        why = (f"{dst} {self.loads[dst]:.3g}s vs {src} {self.loads[src]:.3g}s of work per instance "
               f"(disparity {disparity:.1f} >= {self.threshold:g} for {self._streak_len} observations)")
        self._last_move_t = now
        self._streak, self._streak_len = None, 0
        return Move(tuple(donors[:count]), src, dst, why)

    # ------------------------------------------------------------ estimates

    def _update_estimates(self, snapshot: dict[str, AgentDemand], now: float) -> None:
        dt = now - self._last_t if self._last_t is not None else 0.0
        self._last_t = now
        alpha = 1.0 - math.exp(-dt / self.smoothing_s) if dt > 0 else 0.0
        for agent, d in snapshot.items():
            backlog = sum(d.outstanding.values())
            est = self._est.get(agent)
            if est is None:
                self._est[agent] = _AgentEstimate(d.dispatched_tokens, backlog, dict(d.busy_s))
                continue
            if dt > 0:
                arrived = max(0.0, d.dispatched_tokens - est.dispatched)
                finished = max(0.0, arrived - (backlog - est.backlog))
                # Only instances that served this agent at both observations: a newcomer's
                # busy time so far belongs to its previous agent or to its restart.
                busy = sum(max(0.0, d.busy_s[w] - est.busy[w]) for w in d.busy_s if w in est.busy)
                est.rate += alpha * (arrived / dt - est.rate)
                est.done_tokens += alpha * (finished - est.done_tokens)
                est.done_busy_s += alpha * (busy - est.done_busy_s)
            est.dispatched, est.backlog, est.busy = d.dispatched_tokens, backlog, dict(d.busy_s)

    def _measured(self, agent: str) -> bool:
        return agent in self._est and self._est[agent].service_rate > 0

    def service_rates(self, agents) -> dict[str, float]:
        """Tokens per busy instance-second per agent; agents not yet measured get the mean
        of those measured, and if none is, 1 (loads are then in tokens, alike for all)."""
        known = {a: self._est[a].service_rate for a in agents if a in self._est and self._est[a].service_rate > 0}
        default = sum(known.values()) / len(known) if known else 1.0
        return {a: known.get(a, default) for a in agents}

    def demand_s(self, snapshot: dict[str, AgentDemand]) -> dict[str, float]:
        """Seconds of instance time each agent's work needs: backlog plus arrivals over the horizon."""
        rates = self.service_rates(snapshot)
        out = {}
        for agent, d in snapshot.items():
            est = self._est.get(agent)
            tokens = sum(d.outstanding.values()) + (est.rate * self.horizon_s if est else 0.0)
            out[agent] = tokens / rates[agent]
        return out

    def per_instance_loads(self, snapshot: dict[str, AgentDemand]) -> dict[str, float]:
        return {a: _per_instance(work, len(snapshot[a].outstanding)) for a, work in self.demand_s(snapshot).items()}

    # ------------------------------------------------------------ the decision

    def _candidate(self, snapshot: dict[str, AgentDemand]) -> tuple[str, str, int, float] | None:
        """(to, from, how many instances, disparity) if a move is warranted now."""
        loads = self.loads
        if len(loads) < 2:
            return None
        dst = max(loads, key=lambda a: (loads[a], a))
        donors = [a for a in loads if a != dst and len(snapshot[a].outstanding) >= 2]
        if not donors or loads[dst] <= 0 or loads[dst] < self.move_cost_s:
            return None
        if snapshot[dst].outstanding and not self._measured(dst):
            return None  # its work in seconds is a guess until its instances have been seen busy
        src = min(donors, key=lambda a: (loads[a], a))
        disparity = loads[dst] / loads[src] if loads[src] > 0 else math.inf
        if disparity < self.threshold:
            return None
        work = self.demand_s(snapshot)
        count = instances_to_move(work[dst], len(snapshot[dst].outstanding), work[src], len(snapshot[src].outstanding))
        return (dst, src, count, disparity) if count > 0 else None


def uneven_placement(snapshot: dict[str, AgentDemand], threshold: float) -> tuple[str, str, float] | None:
    """Whether the instances' shares of the work so far are uneven where another placement
    exists: the unit each of whose instances was sent the most tokens, the one each of whose
    were sent the fewest (with two or more instances, one of which it could give up), and the
    ratio of the two, where it reaches `threshold`; None where it does not. Units sent
    nothing yet are left out (a workflow may call an agent later, or seldom)."""
    per = {unit: _per_instance(d.dispatched_tokens, len(d.outstanding)) for unit, d in snapshot.items()
           if d.outstanding and d.dispatched_tokens > 0}
    donors = [u for u in per if len(snapshot[u].outstanding) >= 2]
    if len(per) < 2 or not donors:
        return None
    most = max(per, key=lambda u: (per[u], u))
    fewest = min(donors, key=lambda u: (per[u], u))
    ratio = per[most] / per[fewest]
    return (most, fewest, ratio) if most != fewest and ratio >= threshold else None


# The measured placement moves instances only where the most-asked unit's were busy at
# least this share of the first batch: below it little waited on them, and spreading an
# agent's groups over more instances sends more, smaller messages (RESULTS run AA).
BUSY_ENOUGH = 0.5


def measured_placement(snapshot: dict[str, AgentDemand], threshold: float,
                       busy: Mapping[str, float] | None = None) -> list[Move]:
    """Once, after a run's first batch: where the instances' shares of what was sent are
    uneven (`uneven_placement` at `threshold`) and the most-asked unit's instances were busy
    (`busy`: each unit's instances' mean busy share of the batch, BUSY_ENOUGH or more; None:
    not known, taken as busy), the moves that share the instances of the units sent
    something out again in proportion to the tokens each was sent (`decisions.place_agents`,
    set-up's rule, with the tokens for its weights); [] otherwise. Units sent nothing yet neither give nor take (a workflow
    may call an agent later). A giver gives its least loaded instances; givers and takers
    are paired in name order, the most over or under first.

    Unlike `RolloutBalancer.observe`, this weighs no move cost: it answers a placement that
    misjudged the workflow's shape (a whole batch's tokens, not a moment's backlog), which
    every later batch would pay for, once."""
    found = uneven_placement(snapshot, threshold)
    if found is None or (busy is not None and busy.get(found[0], 1.0) < BUSY_ENOUGH):
        return []
    sent = {u: d.dispatched_tokens for u, d in snapshot.items() if d.outstanding and d.dispatched_tokens > 0}
    have = {u: len(snapshot[u].outstanding) for u in sent}
    theirs = [w for u in sent for w in snapshot[u].outstanding]  # only how many each gets is used
    want = {u: len(ws) for u, ws in place_agents(list(sent), theirs, sent).items()}
    spare = {u: sorted(snapshot[u].outstanding, key=lambda w: (snapshot[u].outstanding[w], w))[:have[u] - want[u]]
             for u in sorted(sent, key=lambda u: (want[u] - have[u], u)) if have[u] > want[u]}
    short = {u: want[u] - have[u] for u in sorted(sent, key=lambda u: (have[u] - want[u], u)) if want[u] > have[u]}
    most, fewest, ratio = found
    why = f"placed by the tokens sent: each instance of {most} was sent {ratio:.1f}x the tokens of each of {fewest}'s"
    moves: list[Move] = []
    givers = iter(spare.items())
    src, pool = next(givers, ("", []))
    for dst, need in short.items():
        while need > 0 and pool:
            take, pool = pool[:need], pool[need:]
            moves.append(Move(tuple(take), src, dst, why))
            need -= len(take)
            if not pool:
                src, pool = next(givers, ("", []))
    return moves


def nearest_rule(sent: Mapping[str, float], rules: Mapping[str, Mapping[str, float]]) -> tuple[str, float]:
    """Of placement rules (name -> each unit's weight), the one whose shares are nearest the
    tokens each unit was sent (units sent something), and how near: the largest ratio, either
    way, between a unit's share of the tokens and its share of the rule's weight; ("", inf)
    where nothing was sent."""
    asked = {u: t for u, t in sent.items() if t > 0}
    total = sum(asked.values())
    best = ("", math.inf)
    if total <= 0:
        return best
    for name, weights in rules.items():
        weight = sum(weights[u] for u in asked)
        if weight <= 0 or any(weights[u] <= 0 for u in asked):
            continue
        worst = max(max(r, 1 / r) for r in ((asked[u] / total) / (weights[u] / weight) for u in asked))
        if worst < best[1]:
            best = (name, worst)
    return best


def _per_instance(work: float, n: int) -> float:
    if n == 0:
        return math.inf if work > 0 else 0.0
    return work / n


def instances_to_move(work_dst: float, n_dst: int, work_src: float, n_src: int) -> int:
    """How many instances to move from src to dst: each one must lower the larger of the
    two agents' per-instance loads, and src keeps at least one."""
    k = 0
    while n_src - k > 1:
        now = max(_per_instance(work_dst, n_dst + k), _per_instance(work_src, n_src - k))
        after = max(_per_instance(work_dst, n_dst + k + 1), _per_instance(work_src, n_src - k - 1))
        if after >= now:
            break
        k += 1
    return k

