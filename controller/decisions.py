"""The pipeline's decision rules, as plain functions over plain numbers.

Kept apart from the asyncio code that applies them so they are unit-tested directly,
re-driven from the event log by `flexmarl replay --check`, and shared by sync and async
modes (sync mode is the same rules with the overlap switched off).

Versions: an agent at version v trains a global batch into version v + 1. Global batch
(iteration) `tag` = t trains every agent from version t - 1 to t. A sample's *lag* is the
trainer's version when it is trained minus the oldest policy version that produced any
turn of it; the bound `max_staleness` (k) says lag <= k. k = 0 is exactly on-policy.
"""

from __future__ import annotations


def min_generation_version(tag: int, max_staleness: int) -> int:
    """The oldest policy version allowed to generate any turn for global batch `tag`."""
    return tag - 1 - max_staleness


def may_generate(tag: int, rollout_version: int, max_staleness: int) -> bool:
    return rollout_version >= min_generation_version(tag, max_staleness)


def lag(trainer_version: int, sample_versions: list[int]) -> int:
    return trainer_version - min(sample_versions)


def too_stale(trainer_version: int, sample_versions: list[int], max_staleness: int) -> bool:
    return lag(trainer_version, sample_versions) > max_staleness


def cut_micro_batch(ready_samples: int, micro_batch: int, batch_complete: bool, overlap: bool) -> bool:
    """Whether to form a micro-batch now. With overlap (async), as soon as a full one is
    ready; always once the global batch is complete. Cutting only at >= micro_batch
    keeps the micro-batch composition identical to sync mode for the same arrival order."""
    if ready_samples == 0:
        return False
    return batch_complete or (overlap and ready_samples >= micro_batch)


def may_start_episode(tag: int, synced_versions: dict[str, int], overlap: bool) -> bool:
    """Sync mode starts global batch t only when every agent's rollout weights are at
    t - 1; async mode starts it at once and gates each turn with `may_generate`."""
    return overlap or all(v >= tag - 1 for v in synced_versions.values())


# ---------------------------------------------------------------- re-driving from a log

def partition_groups(group_sizes: list[int], micro_batch: int) -> list[list[int]]:
    """The micro-batches the store's `take` forms from ready groups in arrival order:
    consecutive whole groups, each micro-batch as full as fits (at least one group)."""
    batches: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(group_sizes):
        if current and filled + size > micro_batch:
            batches.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        batches.append(current)
    return batches


def redrive(log: list) -> list:
    """Recomputes the training decisions (which samples form each micro-batch, which
    groups the staleness bound drops, each optimizer step) from the logged inputs (groups
    opened and completed, the versions that generated each sample, the config), and the
    level 1 balancer's moves from the logged demand observations, with the same rules
    and code the controller used. `flexmarl replay --check` compares the result with
    the decisions the log recorded; ordering across agents is taken from the log, since
    it depends on timing, not on the rules."""
    import tomllib

    from flexmarl.runtime import events as ev

    start = next(e for e in log if isinstance(e, ev.RunStarted))
    micro_batch = tomllib.loads(start.config_toml)["pipeline"]["micro_batch"]
    k = start.max_staleness
    tag_of: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    version_of: dict[str, int] = {}
    completed: dict[tuple[str, int], list[str]] = {}
    # Which trainer runs a step is the allocator's choice, not re-derived here: take it
    # from the log.
    step_trainer = {(e.agent, e.version): e.trainer for e in log if isinstance(e, ev.OptimizerStep)}
    for e in log:
        if isinstance(e, ev.GroupOpened):
            tag_of[e.group_id], members[e.group_id] = e.tag, list(e.sample_ids)
        elif isinstance(e, ev.RequestsCompleted):
            version_of.update(zip(e.sample_ids, e.versions))
        elif isinstance(e, ev.GroupComplete):
            completed.setdefault((e.agent, tag_of[e.group_id]), []).append(e.group_id)
    made: dict[str, list] = {}
    for (agent, tag), groups in sorted(completed.items(), key=lambda kv: kv[0][1]):
        out = made.setdefault(agent, [])
        trained = 0
        for chunk in partition_groups([len(members[g]) for g in groups], micro_batch):
            sample_ids, min_versions = [], []
            for g in (groups[i] for i in chunk):
                versions = [version_of[s] for s in members[g]]
                if any(too_stale(tag - 1, [v], k) for v in versions):
                    continue  # the controller drops this group (SamplesDropped)
                sample_ids += members[g]
                min_versions += versions
            if sample_ids:
                trained += len(sample_ids)
                out.append(ev.MicroBatchFormed(agent, "", tag, sample_ids, min_versions))
        out.append(ev.OptimizerStep(agent, step_trainer.get((agent, tag), ""), tag, trained))
    moves = _redrive_balancer(log, tomllib.loads(start.config_toml)["router"])
    # Interleave agents and balancer moves in the order the log shows (timing), keeping
    # each one's own order.
    cursor = {a: 0 for a in made}
    result, next_move = [], iter(moves)
    for e in log:
        if isinstance(e, ev.RebalanceDecided):
            move = next(next_move, None)
            if move is not None:
                result.append(move)
        elif isinstance(e, REDRIVEN_TYPES) and cursor.get(e.agent, 0) < len(made.get(e.agent, [])):
            result.append(made[e.agent][cursor[e.agent]])
            cursor[e.agent] += 1
    for agent, items in made.items():
        result += items[cursor[agent]:]
    return result + list(next_move)


def _redrive_balancer(log: list, router: dict) -> list:
    """The level 1 balancer's moves for the logged demand observations, in order."""
    from flexmarl.runtime import events as ev
    from flexmarl.runtime.config import RouterConfig

    from .balancer import AgentDemand, RolloutBalancer

    balancer, moves = None, []
    for e in log:
        if not isinstance(e, ev.DemandObserved):
            continue
        if balancer is None:  # built as balance_loop builds it, from the logged config
            balancer = RolloutBalancer.from_config(RouterConfig(**router))
        balancer.move_cost_s = e.move_cost_s
        snapshot = {a: AgentDemand(e.outstanding[a], e.dispatched_tokens[a], e.busy_s.get(a, {}))
                    for a in e.outstanding}
        move = balancer.observe(snapshot, e.now)
        if move is not None:
            moves.append(ev.RebalanceDecided(list(move.instances), move.src, move.dst, move.why))
    return moves


def _redriven_types() -> tuple:
    from flexmarl.runtime import events as ev
    return (ev.MicroBatchFormed, ev.OptimizerStep, ev.RebalanceDecided)


REDRIVEN_TYPES = _redriven_types()
