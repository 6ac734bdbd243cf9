"""The pipeline's decision rules, as plain synchronous functions over plain data.

Kept apart from the asyncio code that applies them so they are unit-tested directly,
re-driven from the event log by `flexmarl replay --check`, and shared by sync and async
modes (sync mode is the same rules with the overlap switched off). Each rule exists once:
the live pipeline, the store and the re-drive (redrive.py) all call the functions here.
A rule reads what it is given and returns its answer; the caller applies it (the store
cuts micro-batches with `cut_micro_batch`, `groups_in_micro_batch` and `split_stale`).

Versions: an agent at version v trains a global batch into version v + 1. Global batch
`batch` = t trains every agent from version t - 1 to t. A sample's *lag* is the trainer's
version when it is trained minus the oldest policy version that produced any turn of it;
the bound `max_staleness` (k) says lag <= k. k = 0 is exactly on-policy. The rule itself
(`lag`, `too_stale`) is runtime/staleness.py, which the trainer checks with too.

This module does not know about sockets, workers or asyncio.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from flexmarl.runtime.staleness import lag, too_stale  # noqa: F401 (the rule, shared with the trainer)


def min_generation_version(batch: int, max_staleness: int) -> int:
    """The oldest policy version allowed to generate any turn for global batch `batch`."""
    return batch - 1 - max_staleness


def may_generate(batch: int, rollout_version: int, max_staleness: int) -> bool:
    return rollout_version >= min_generation_version(batch, max_staleness)


def may_admit(running: int, ended: Mapping[int, int], first: int, newest: int, last: int, quota: int,
              spares: int) -> bool:
    """Continuous admission: whether another episode may start generating now, its agent's
    version allowing batches up to `newest`: while the episodes `running` and those `ended`
    (per batch, from `first`) number fewer than batches `first` to `newest` train (`quota`
    each) plus `spares`, each running episode can still be trained within the staleness
    bound if it ends in turn. The spares are over-provisioned once for the run: one that
    ended past its bound still counts, so it is not replaced (one abandoned as doomed,
    `doomed_through`, is: by a fresh spare). Never an episode whose bound is already full:
    it would be doomed at once. The last batch trains whatever is left: always."""
    if newest >= last:
        return True
    if newest <= doomed_through(ended, first, last, quota):
        return False  # every batch that could train it is full: it would be abandoned at once
    done = sum(n for b, n in ended.items() if b >= first)  # a carried one too: only an abandoned one is renewed
    return running + done < quota * (newest - first + 1) + spares


# Why an abandoned episode's samples are dropped (`doomed_through`).
ABANDONED = "abandoned: every batch its staleness bound allows is full"


def doomed_through(ended: Mapping[int, int], first: int, last: int, quota: int) -> int:
    """Continuous admission: the newest batch B before the last such that every batch from
    `first` to B has its `quota` of episodes ended (`first` - 1 when `first` has not). A
    running episode admitted while its version allowed batches up to B at most
    (`EpisodeSlot.admitted` <= B) is doomed: `assigned_batch` can only give it a later
    batch, which its oldest token (drawn by the version that admitted it) is too stale for,
    so it would run on in its engine only to be dropped there, taking that batch's place.
    (The rule judges by the admission: where a sync reached its instance between the
    admission and the first token, that token is one version newer and the next batch could
    have trained it; such an episode is abandoned all the same.)
    It is abandoned instead: its requests aborted, its samples dropped, its slot freed for a
    fresh episode. The last batch trains every episode left: one it may train is never
    doomed. Step admission has no slots, and with no spares no episode is ever doomed
    (`may_admit` then admits only what fits and `assigned_batch` keeps each one's place)."""
    batch = first - 1
    while batch + 1 < last and ended.get(batch + 1, 0) >= quota:
        batch += 1
    return batch


def spare_room(spares: int, drained: int | None) -> int:
    """The spares an admission may count on (`may_admit`'s `spares`): under continuous
    admission (`drained` None) every one of `partial_rollout`; under capacity admission only
    as many as the first turn's agent has instances that have drained (no group left on
    them), so episodes beyond what the staleness bound admits go only where an engine would
    otherwise idle, one per drained instance. Within the bound nothing changes: an episode
    that can be trained if it ends in turn is never held back."""
    return spares if drained is None else min(spares, drained)


def assigned_batch(ended: Mapping[int, int], due: Mapping[int, int], first: int, last: int, quota: int,
                   spares: int = 0, newest: int | None = None) -> int:
    """Continuous admission: the global batch that trains an episode ending now. `ended`:
    per batch, the episodes it trains that ended; `due`: per batch, the episodes still
    running whose staleness bound lets them train no later than it (the newest batch their
    version allowed when admitted). The earliest batch from `first` with fewer than
    `quota` ended, unless taking its place would leave the running episodes due by some
    later batch B more than fit in batches `first` to B (`quota` each, `spares` over): then
    the next such batch. So the first `quota` episodes to end fill a batch and a slow one
    carries over, but a newer episode never takes the place an older one needs within its
    bound (with spares, those over-provisioned may, and the one pushed past its bound is
    then dropped as too stale). An episode that already missed its own bound (`newest`, the
    last batch its admission allowed, is full) takes no place a running one needs, spares
    or not: it goes after them. `last` when every batch before it is full: the last batch
    trains whatever is left."""
    free = [b for b in range(first, last) if ended.get(b, 0) < quota]
    missed = newest is not None and newest < last and not any(b <= newest for b in free)
    for batch in free:
        if _leaves_room(ended, due, batch, first, last, quota, 0 if missed else spares):
            return batch
    return free[0] if free else last


def _leaves_room(ended: Mapping[int, int], due: Mapping[int, int], batch: int, first: int, last: int, quota: int,
                 spares: int) -> bool:
    taken = 1 + sum(ended.get(b, 0) for b in range(first, batch))  # the one ending now, in `batch`
    waiting = sum(n for d, n in due.items() if d < batch)
    for b in range(batch, min(last, max(due, default=batch) + 1)):
        taken += ended.get(b, 0)
        waiting += due.get(b, 0)
        if taken + waiting > quota * (b - first + 1) + spares:
            return False
    return True


def snapshot_version(batch: int, every: int) -> int:
    """The version of its source a snapshot refreshed every `every` steps plays at in
    global batch `batch`: the last multiple of `every` its source had reached when the
    batch started (sync mode: version batch - 1)."""
    return (batch - 1) // every * every


def may_play_snapshot(batch: int, snapshot_at: int, every: int, max_staleness: int) -> bool:
    """A snapshot's turn in `batch` waits for its refresh, as any agent's turn waits at the
    staleness gate: its weights at most `max_staleness` versions behind what it is due."""
    return snapshot_at >= snapshot_version(batch, every) - max_staleness


# Why dynamic sampling drops a complete group (DAPO's dynamic sampling).
EQUAL_REWARDS = "dynamic sampling: every reward of the group equal (no advantage, no gradient)"
SURPLUS = "dynamic sampling: the step already has its groups"


def dynamic_drop(rewards: list[float], kept: int, target: int | None) -> str:
    """Why dynamic sampling drops a group that just became complete ("": it is kept):
    its rewards all equal (its advantages are all 0), or, once the batch knows how many
    groups it should train (`target`: the agent's groups of the batch's regular episodes)
    and has `kept` of them, a group beyond that from an extra episode."""
    if max(rewards) == min(rewards):
        return EQUAL_REWARDS
    if target is not None and kept >= target:
        return SURPLUS
    return ""


def extra_episodes(missing: dict[str, int], per_episode: dict[str, float], drawn: int, bound: int) -> int:
    """How many more episodes a batch draws so that each dynamic-sampling agent gets back
    the groups it is `missing`: as many as would make them if none were dropped, from the
    agent's groups per regular episode; never past `bound` episodes in all (`drawn` so far).
    0 when nothing is missing, or when the bound is reached."""
    want = max((math.ceil(n / per_episode[a]) for a, n in missing.items() if n > 0 and per_episode[a] > 0), default=0)
    return max(0, min(want, bound - drawn))


def may_start_episode(batch: int, synced_versions: dict[str, int], overlap: bool) -> bool:
    """Sync mode starts global batch t only when every agent's rollout weights are at
    t - 1; async mode starts it at once and gates each turn with `may_generate`."""
    return overlap or all(v >= batch - 1 for v in synced_versions.values())


def expected_tokens(agents: dict[str, Any], agent: str) -> float:
    """An agent's rough demand, for the initial placement: its group size x output length,
    times its position in the config's agent order (requests multiply down a chain, so a
    later agent is asked more). `agents`: the config's agent tables, in config order. The
    router corrects it with measurements once the run goes."""
    a = agents[agent]
    return a.group_size * a.max_tokens * (1 + list(agents).index(agent))


def parallel_demand(agents: dict[str, Any], agent: str) -> float:
    """An agent's rough demand where every agent is asked as often as any other
    (`router.placement = "parallel"`): its group size x output length."""
    a = agents[agent]
    return a.group_size * a.max_tokens


# router.placement -> the demand rule of the initial placement
PLACEMENT_DEMAND = {"chain": expected_tokens, "parallel": parallel_demand}


def equal_demand(agents: dict[str, Any], agent: str) -> float:
    """Every agent expected to ask alike: spare instances go round the units in turn."""
    return 1.0


def unit_weights(units: Mapping[str, Any], demand: Callable[[str], float]) -> dict[str, float]:
    """Each engine unit's expected work for `place_agents`: its agents' demands summed."""
    return {name: sum(demand(a) for a in u.agents) for name, u in units.items()}


def place_agents(agents: list[str], instances: list[str], weight: dict[str, float]) -> dict[str, list[str]]:
    """Initial placement: every agent gets one instance, spare instances go to the agents
    with the most expected work per instance."""
    if len(instances) < len(agents):
        raise ValueError(f"{len(agents)} agents need at least {len(agents)} rollout workers, "
                         f"have {len(instances)}")
    plan = {a: [w] for a, w in zip(agents, instances)}
    for w in instances[len(agents):]:
        busiest = max(agents, key=lambda a: (weight[a] / len(plan[a]), a))
        plan[busiest].append(w)
    return plan


class AgentWork(NamedTuple):
    """What an agent has for a trainer, as the allocator weighs it."""

    ready: int = 0  # work it can send a trainer now: micro-batches formed or formable, a step due
    coming: int = 0  # samples ready in the store that do not make a micro-batch yet


def choose_placement(agent: str, trainers: list[str], capacity: int, resident: dict[str, str],
                     in_flight: dict[str, int], work: dict[str, AgentWork], last_used: dict[str, float],
                     prefetch: bool = False) -> tuple[str, str | None] | None:
    """Where `agent`'s training state should go: (trainer, None) for a free slot, (trainer,
    victim) to park an idle agent first, or None to wait. Free slots go to the least loaded
    trainer. An agent is parked only once its ready work is done (nothing in flight,
    nothing ready), so its micro-batches, step and publish are served in one stay; a
    prefetch (nobody waits yet) parks only an agent with no samples coming either, so it
    brings in the agent whose work will be ready first, and never swaps back and forth.
    The victim is the one with the fewest samples coming, longest unused."""
    load = collections.Counter(resident.values())
    free = [t for t in trainers if capacity <= 0 or load[t] < capacity]
    if free:
        return min(free, key=lambda t: (load[t], t)), None
    none = AgentWork()
    idle = [a for a in resident if a != agent and in_flight.get(a, 0) == 0 and not work.get(a, none).ready
            and not (prefetch and work.get(a, none).coming)]
    if not idle:
        return None
    victim = min(idle, key=lambda a: (work.get(a, none).coming, last_used.get(a, 0.0), a))
    return resident[victim], victim


# ---------------------------------------------------------------- micro-batches and steps

@dataclass(frozen=True)
class MicroBatchSize:
    """What a micro-batch is cut by: `samples` samples, or, with `tokens` > 0, a budget of
    that many tokens, counted as the trainer computes them (a group's prompt once, plus
    every output), so that micro-batches take about the same memory and time whatever
    lengths the policy writes. Either way a micro-batch holds whole groups."""

    samples: int
    tokens: int = 0

    @property
    def limit(self) -> int:
        return self.tokens or self.samples

    def of_group(self, samples: int, tokens: int) -> int:
        """A group's size in this measure: its `samples`, or its `tokens` (its prompt once
        plus every output)."""
        return tokens if self.tokens else samples


def cut_micro_batch(ready: int, limit: int, batch_complete: bool, overlap: bool) -> bool:
    """Whether to form a micro-batch now, with `ready` samples or tokens (`MicroBatchSize`)
    ready. With overlap (async), as soon as a full one is ready; always once the global
    batch is complete. Cutting only at >= limit keeps the micro-batch composition
    identical to sync mode for the same arrival order."""
    if ready == 0:
        return False
    return batch_complete or (overlap and ready >= limit)


def groups_in_micro_batch(group_sizes: Iterable[int], limit: int) -> int:
    """How many of the ready groups (oldest first, with these sizes in samples or tokens)
    the next micro-batch takes: consecutive whole groups, as many as fit in `limit`, at
    least one (a group is never split: its advantages are normalised together)."""
    taken = filled = 0
    for size in group_sizes:
        if taken and filled + size > limit:
            break
        taken += 1
        filled += size
    return taken


def step_due(batch_complete: bool, ready_samples: int) -> bool:
    """One optimizer step (and one weight sync) per agent per global batch: once every
    episode of the batch has ended and every ready sample has gone into a micro-batch."""
    return batch_complete and ready_samples == 0


def split_stale(taken: list, batch: int, max_staleness: int) -> tuple[list, list]:
    """Groups taken for global batch `batch` (store records: `oldest()`, each member's
    oldest version), split into those that may train version batch - 1 and those with any
    turn older than the bound: a group is kept or dropped whole. Changes nothing it is given.

    The staleness bound is enforced here, where samples meet the trainer: the gate
    (`may_generate`) makes a stale sample impossible in normal runs; this is the
    guarantee, the gate the mechanism."""
    kept: list = []
    stale: list = []
    for group in taken:
        (stale if too_stale(batch - 1, group.oldest(), max_staleness) else kept).append(group)
    return kept, stale
