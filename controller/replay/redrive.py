"""Re-driving the controller's decisions from an event log (`flexmarl replay --check`).

`redrive(events)` feeds the logged inputs (groups opened, the versions that generated
each sample, rewards, demand observations) to the very code the controller ran: a fresh
`ExperienceStore` cut by its `form_micro_batches` and `decisions.step_due`, and a
`RolloutBalancer` observing the logged demand (and `measured_placement` the logged
measurement of a run's first batch). It returns the decision events that code
makes, for replay to compare with the ones the log recorded.

It does not read files or know how decisions are carried out.
"""

from __future__ import annotations

import collections
import itertools
import tomllib
from typing import Sequence

from flexmarl.runtime import collector
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import RouterConfig, admits_continuously

from ..rollout.balance_rules import AgentDemand, RolloutBalancer, measured_placement
from ..state import decisions
from ..state.store import ExperienceStore
from .lineage import agent_roles, last_batch, lineage, lost_batches, open_steps

# The events that feed a group to the store, each naming its agent.
_GROUP_EVENTS = frozenset({ev.GroupOpened, ev.RequestsCompleted, ev.GroupComplete})

# The decision events the re-drive derives; replay compares these, in order.
REDRIVEN_TYPES = (ev.MicroBatchFormed, ev.OptimizerStep, ev.RebalanceDecided, ev.EpisodeAdmitted, ev.EpisodeAssigned,
                  ev.EpisodeAbandoned)


def redrive(log: list) -> list:
    """Recomputes the training decisions (which samples form each micro-batch, which
    groups the staleness bound drops, each optimizer step) and the level 1 balancer's
    moves from the logged inputs, by calling the same code the controller ran: an
    `ExperienceStore` is refilled from the logged groups, versions and rewards, and
    `form_micro_batches` / `step_due` cut it; `RolloutBalancer.observe` sees the logged
    demand, `measured_placement` the logged first batch. `flexmarl replay --check`
    compares the result with the decisions the log recorded; ordering across agents is
    taken from the log, since it depends on timing, not on the rules."""
    log = lineage(log)  # a resumed run: what the crashed controller did past its checkpoint is undone
    return in_log_order(log, training_decisions(log, agent_roles(run_of(log)).trained), balancer_moves(log),
                        episode_assignments(log))


def run_of(log: list) -> ev.RunStarted:
    return next(e for e in log if type(e) is ev.RunStarted)


def training_decisions(log: list, agents: Sequence[str]) -> dict[str, list]:
    """Per agent of `agents` (some or all of the run's), in order: the micro-batches and
    steps the rules cut from a store refilled with that agent's groups (`log` a lineage).
    An agent's decisions depend on its own groups alone, so a share of the agents may be
    re-driven apart from the rest (replay's check re-drives two shares at once) and the
    results joined."""
    start = run_of(log)
    pipeline = tomllib.loads(start.config_toml)["pipeline"]
    with collector.rare_collections():  # a refilled store is a heap of records, as the controller's
        store = _refilled_store(log, list(agents), set(start.agents) - set(agents), agent_roles(start).dynamic,
                                admits_continuously(pipeline.get("admission")))
        return _redrive_training(log, store, list(agents), pipeline, start.max_staleness)


def episode_assignments(log: list) -> list:
    """Continuous and capacity admission: each episode's admission and the batch that
    trains it, in log order (`log` a lineage). An `EpisodeAdmitted` comes back as logged
    when `decisions.may_admit` allows it from the episodes then running and ended, the
    newest batch it was admitted for and the spares it could count on
    (`decisions.spare_room`, from the drained instances it logged), and with `newest` -1
    when the rules would have held it back; an `EpisodeAssigned` names the batch
    `decisions.assigned_batch` gives from the order the episodes were admitted and ended;
    an `EpisodeAbandoned` as logged when `decisions.doomed_through` says every batch its
    bound allowed was full then, with `newest` -1 when it was not. (That every doomed
    episode was abandoned shows in the assignments: one that was not would have ended in a
    later batch, which the rules, abandoning it, no longer count.)"""
    quota, last, spares = _admission_settings(run_of(log).config_toml, (0, 0, 0))
    first = 1  # a resumed run's schedule starts after its checkpoint
    ended: collections.Counter[int] = collections.Counter()
    due: collections.Counter[int] = collections.Counter()
    newest: dict[str, int] = {}
    # What the admitting process's schedule counted: a resumed one starts with none.
    running: set[str] = set()
    ended_here: collections.Counter[int] = collections.Counter()
    made: list[ev.EpisodeAdmitted | ev.EpisodeAssigned | ev.EpisodeAbandoned] = []
    for e in log:
        kind = type(e)
        if kind is ev.RunResumed:
            quota, last, spares = _admission_settings(e.config_toml, (quota, last, spares))
            first = e.step + 1
            running, ended_here = set(), collections.Counter()
        elif kind is ev.EpisodeAdmitted:
            room = decisions.spare_room(spares, None if e.drained < 0 else e.drained)
            allowed = decisions.may_admit(len(running), ended_here, first, e.newest, last, quota, room)
            made.append(ev.EpisodeAdmitted(e.episode, e.started, e.newest if allowed else -1, e.drained))
            running.add(e.episode)
            newest[e.episode] = e.newest
            due[e.newest] += 1
        elif kind is ev.EpisodeAssigned:
            admitted = newest.pop(e.episode, None)
            if admitted is not None:
                due[admitted] -= 1
            batch = decisions.assigned_batch(ended, +due, first, last, quota, spares, admitted)
            ended[batch] += 1
            running.discard(e.episode)
            ended_here[batch] += 1
            made.append(ev.EpisodeAssigned(e.episode, e.started, batch))
        elif kind is ev.EpisodeAbandoned:
            admitted = newest.pop(e.episode, None)
            if admitted is not None:
                due[admitted] -= 1
            running.discard(e.episode)
            doomed = admitted is not None and admitted <= decisions.doomed_through(ended_here, first, last, quota)
            made.append(ev.EpisodeAbandoned(e.episode, e.started, admitted if doomed and admitted is not None else -1))
    return made


def _admission_settings(config_toml: str, otherwise: tuple[int, int, int]) -> tuple[int, int, int]:
    """queries_per_step, run.steps and partial_rollout of a logged config (`otherwise`
    where it does not say: a config of a test, or none)."""
    try:
        run = tomllib.loads(config_toml)
        pipeline = run["pipeline"]
        return pipeline["queries_per_step"], run["run"]["steps"], pipeline.get("partial_rollout", 0)
    except (tomllib.TOMLDecodeError, KeyError):
        return otherwise


def balancer_moves(log: list) -> list:
    """The level 1 balancer's moves for the logged demand observations, in order (`log` a
    lineage)."""
    return _redrive_balancer(log, tomllib.loads(run_of(log).config_toml)["router"])


def _refilled_store(log: list, agents: list[str], others: set[str], dynamic: Sequence[str] = (),
                    continuous: bool = False) -> ExperienceStore:
    """An `ExperienceStore` of `agents` fed their logged groups, versions and rewards, in
    the order the controller saw them (and, for the agents with dynamic sampling, each
    batch's targets when the log set them; with continuous admission, each episode's
    groups moved to the batch the rules assign it); the run's `others` are left out."""
    store = ExperienceStore(agents, dynamic=[a for a in dynamic if a in agents], assigned_at_end=continuous)
    opened, completed, rewarded = ev.GroupOpened, ev.RequestsCompleted, ev.GroupComplete
    if others:  # a share of the run's agents: the others' groups are not refilled here
        log = [e for e in log if type(e) not in _GROUP_EVENTS or e.agent not in others]
    assigned = iter([e for e in episode_assignments(log) if type(e) is ev.EpisodeAssigned] if continuous else ())
    groups_of: dict[str, list] = {}  # episode -> its groups
    for e in log:
        kind = type(e)
        if kind is ev.EpisodeAssigned:
            store.assign(groups_of.pop(e.episode, ()), next(assigned).batch)
        elif kind is ev.EpisodeAbandoned:
            store.abandon(groups_of.pop(e.episode, ()), decisions.ABANDONED)
        elif kind is opened:
            store.open_group(e.key, (), e.n, e.batch)
            groups_of.setdefault(e.key.episode, []).append(e.key)
        elif kind is completed:  # a part: members of one group, or a later turn (its group's versions are the first's)
            spans = e.oldest or itertools.repeat(())
            for (key, first, size, turn), version, oldest in zip(e.parts, e.versions, spans):
                if not turn and store.holds(key):
                    store.record_versions(key, first, size, version, oldest)
        elif kind is rewarded:  # the log has no token ids, only the count
            store.set_group_rewards(e.key, e.rewards, size=e.tokens)
        elif kind is ev.GroupTargets:
            for agent, n in e.targets.items():
                if agent in store.dynamic:
                    store.set_target(agent, e.batch, n)
    return store


def _redrive_training(log: list, store: ExperienceStore, agents: list[str], pipeline: dict,
                      k: int) -> dict[str, list]:
    """Per agent, the micro-batches and steps the rules make of `store`, in order.

    Every agent steps every batch up to the last batch the log reached, but a step the
    log never took (`open_steps`): its micro-batches are every one the rules would cut
    from what was ready when the log ends; the log's must be the first of them."""
    size = decisions.MicroBatchSize(pipeline["micro_batch"], pipeline.get("micro_batch_tokens", 0))
    # Which trainer runs a step is the allocator's choice, not re-derived here.
    step = ev.OptimizerStep
    step_trainer = {(e.agent, e.version): e.trainer for e in log if type(e) is step}
    made: dict[str, list] = {a: [] for a in agents}
    unfinished = open_steps(log)
    lost = lost_batches(log)  # damage to the log split them: neither re-driven nor compared
    for batch in range(1, last_batch(log) + 1):
        if batch in lost:
            continue
        for agent in agents:
            trained = 0
            for mb in store.form_micro_batches(agent, batch, size, True, False, k):
                trained += mb.samples
                made[agent].append(ev.MicroBatchFormed(agent, "", batch, mb.parts(), mb.oldest()))
            assert decisions.step_due(True, store.ready_samples(agent, batch))
            if (agent, batch) not in unfinished:
                made[agent].append(ev.OptimizerStep(agent, step_trainer.get((agent, batch), ""), batch, trained))
    return made


def in_log_order(log: list, made: dict[str, list], moves: list, assignments: Sequence = ()) -> list:
    """The agents' decisions, the balancer's moves and the episodes' batches interleaved in
    the order the log shows (timing), each one's own order kept."""
    cursor = {a: 0 for a in made}
    result, next_move, next_assigned = [], iter(moves), iter(assignments)
    redriven = frozenset(REDRIVEN_TYPES)
    for e in log:
        kind = type(e)
        if kind not in redriven:
            continue
        if kind is ev.RebalanceDecided or kind is ev.EpisodeAssigned or kind is ev.EpisodeAdmitted \
                or kind is ev.EpisodeAbandoned:
            move = next(next_move if kind is ev.RebalanceDecided else next_assigned, None)
            if move is not None:
                result.append(move)
        elif cursor.get(e.agent, 0) < len(made.get(e.agent, [])):
            result.append(made[e.agent][cursor[e.agent]])
            cursor[e.agent] += 1
    for agent, items in made.items():
        result += items[cursor[agent]:]
    return result + list(next_move) + list(next_assigned)


def _redrive_balancer(log: list, router: dict) -> list:
    """The level 1 balancer's moves for the logged demand observations, and the placement
    by measured demand's for its measurement, in log order."""
    balancer, moves = None, []
    for e in log:
        kind = type(e)
        if kind is ev.RunResumed:
            balancer = None  # the resumed controller's balancer starts afresh
        if kind is ev.PlacementMeasured:
            measured = {u: AgentDemand(e.outstanding[u], e.dispatched_tokens.get(u, 0.0)) for u in e.outstanding}
            moves += [ev.RebalanceDecided(list(m.instances), m.src, m.dst, m.why)
                      for m in measured_placement(measured, RouterConfig(**router).disparity_threshold,
                                                  e.busy or None)]
            continue
        if kind is not ev.DemandObserved:
            continue
        if balancer is None:  # built as the rebalancer builds it, from the logged config
            balancer = RolloutBalancer.from_config(RouterConfig(**router))
        balancer.move_cost_s = e.move_cost_s
        snapshot = {a: AgentDemand(e.outstanding[a], e.dispatched_tokens[a], e.busy_s.get(a, {}))
                    for a in e.outstanding}
        move = balancer.observe(snapshot, e.now)
        if move is not None:
            moves.append(ev.RebalanceDecided(list(move.instances), move.src, move.dst, move.why))
    return moves
