"""The events the run's final state descends from, across restored trainers and resumes.

Two things undo logged work. A trainer that dies takes the agent's training state with
it; the agent is restored at its last saved version v and trained again from there
(`TrainingRestored`), so its micro-batches and steps into versions after v logged before
count no more: the same samples are trained again after the marker. And a resumed run
restarts from the checkpoint of step t (`RunResumed`): whatever the crashed
controller had done for the batches after t (groups opened, outputs received, micro-batches
formed, steps taken) was undone with it, and those batches are generated and trained
again, often under the same group keys (they derive from the seed). Under continuous
admission a group belongs to the batch its episode's `EpisodeAssigned` names, not the one
it started in: one trained by a batch up to t stays, however late it started, and one whose
episode had not ended by the resume is undone (the resumed run begins it again, carried
over or not). `lineage(events)` cuts
those undone events out, so exactly-once accounting and `replay --check` judge the run
that counts: every sample in it trained or dropped once.

Damage to the log file loses events (`EventsLost`: the reader puts one where damage it
passed over was; a resume records what it found, and a tail lost before the checkpoint it
starts from). A batch whose events the damage split (some of them before it, the rest lost
or after it) can be neither accounted nor re-driven: `lineage` leaves out every event of
those batches, and of the balancer's observations and moves from the damage to the next
resume (its state then is not known), and names the batches on the `EventsLost` it keeps
(`lost_batches`). Batches wholly before or wholly after the damage count as usual.

Also the log's own reach: the last batch it reached (`last_batch`) and the steps it
reached but never took (`open_steps`).

It knows which fields tie an event to a batch; it does not read files.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Callable

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime.config import admits_continuously
from flexmarl.runtime.keys import GroupKey

# Events of one version (= the batch that steps into it): undone when version > t.
_BY_VERSION = (ev.MicroBatchFormed, ev.MicroBatchTrained, ev.OptimizerStep, ev.WeightSyncStarted,
               ev.WeightSyncFinished, ev.SnapshotRefreshed)


# The events that undo logged work.
UNDOING = frozenset({ev.RunResumed, ev.TrainingRestored})

# What a trainer did to an agent's state: undone for versions after the one a
# `TrainingRestored` brought the agent back to.
_TRAINED = (ev.MicroBatchFormed, ev.MicroBatchTrained, ev.OptimizerStep)


def lineage(events: list[ev.Event]) -> list[ev.Event]:
    """`events` without what a later `RunResumed` undid, nor what damage split (see the
    module docstring)."""
    kinds = set(map(type, events))
    if UNDOING.isdisjoint(kinds) and ev.EventsLost not in kinds:
        return events
    lost, taints = _damage(events) if ev.EventsLost in kinds else ({}, {})
    kept: list[ev.Event] = []
    batch_of_group: dict[GroupKey, int] = {}
    # Continuous admission: a group trains in its episode's batch, named when the episode
    # ends (`EpisodeAssigned`); one whose episode had not ended at a resume is begun again.
    continuous, groups_of, batch_of_episode = False, _EpisodeGroups(), {}
    epoch, tainted_from = 0, taints.get(0)
    cut_here = lost.get(0, set())
    for e in events:
        if isinstance(e, (ev.RunStarted, ev.RunResumed)):
            continuous = _continuous(e.config_toml)
        if isinstance(e, ev.GroupOpened):
            batch_of_group[e.key] = e.batch
            if continuous:
                groups_of.opened(e.key)
        if isinstance(e, ev.EpisodeAssigned):
            batch_of_episode[e.episode] = e.batch
            for key in groups_of.ended(e.episode):
                batch_of_group[key] = e.batch
        if isinstance(e, ev.EpisodeAbandoned):  # in no batch; abandoned before batch `newest` trained
            batch_of_episode[e.episode] = e.newest
            for key in groups_of.ended(e.episode):
                batch_of_group[key] = e.newest
        if isinstance(e, ev.EventsLost):
            if e.first_seq in _named(kept):
                continue  # another record of damage already kept (the reader's and the resume's)
            kept.append(e if e.batches else
                        msgspec.structs.replace(e, batches=sorted(lost.get(_epoch_of(events, e), set()))))
            continue
        if isinstance(e, ev.RunResumed):
            step = e.step
            for key in groups_of.running():  # begun again after the resume
                batch_of_group[key] = step + 1
            groups_of = _EpisodeGroups()
            kept = [c for x in kept
                    if (c := _cut(x, lambda b: b is None or b <= step, batch_of_group, batch_of_episode, step + 1))
                    is not None]
            batch_of_episode = {name: b for name, b in batch_of_episode.items() if b <= step}
            # Keys of undone batches may be opened again: forget what they were.
            batch_of_group = {g: b for g, b in batch_of_group.items() if b <= e.step}
            epoch += 1
            tainted_from, cut_here = taints.get(epoch), lost.get(epoch, set())
        if cut_here:  # a group or sample of no known batch was opened in the damage: its batch is split
            part = _cut(e, lambda b: b is not None and b not in cut_here, batch_of_group)
            if part is None:
                continue
            e = part
        if tainted_from is not None and e.seq >= tainted_from and isinstance(e, _BALANCER):
            continue
        if isinstance(e, ev.TrainingRestored):
            kept = [x for x in kept if not (isinstance(x, _TRAINED) and x.agent == e.agent and x.version > e.version)]
        kept.append(e)
    return kept


def lost_batches(log: list) -> set[int]:
    """The batches damage left unaccounted (`log` a lineage): named on its EventsLost."""
    return {b for e in log if type(e) is ev.EventsLost for b in e.batches}


# What the level 1 balancer saw and decided: its state after lost events is not known.
_BALANCER = (ev.DemandObserved, ev.PlacementMeasured, ev.RebalanceDecided)


def _named(kept: list[ev.Event]) -> set[int]:
    """The damage already kept, by its first lost event (the same damage read where it lies
    and recorded by a resume, perhaps under another path to the file)."""
    return {x.first_seq for x in kept if type(x) is ev.EventsLost}


def _epochs(events: list[ev.Event]) -> list[int]:
    """The seq of each RunResumed, in order: epoch k runs from the k-th (0: the start)."""
    return [e.seq for e in events if type(e) is ev.RunResumed]


def _epoch_of(events: list[ev.Event], lost: ev.EventsLost) -> int:
    """The epoch the damage fell in: the resumes logged before its first lost event."""
    return sum(1 for s in _epochs(events) if s < lost.first_seq)


def _damage(events: list[ev.Event]) -> tuple[dict[int, set[int]], dict[int, int]]:
    """Per epoch (see `_epochs`): the batches damage split, and the seq from which the
    balancer's events are not judged (the first damage in it)."""
    start = next((e for e in events if type(e) is ev.RunStarted), None)
    agents = agent_roles(start).trained if start is not None else []
    resumes = [e for e in events if type(e) is ev.RunResumed]
    bounds = [-1] + [r.seq for r in resumes]
    lost: dict[int, set[int]] = {}
    taints: dict[int, int] = {}
    seen: set[int] = set()
    for gap in (e for e in events if type(e) is ev.EventsLost):
        if gap.first_seq in seen:
            continue
        seen.add(gap.first_seq)
        epoch = sum(1 for s in bounds[1:] if s < gap.first_seq)
        lo = resumes[epoch - 1].step if epoch else 0
        hi = resumes[epoch].step if epoch < len(resumes) else None
        members = [e for e in events if bounds[epoch] <= e.seq and (epoch + 1 >= len(bounds) or e.seq < bounds[epoch + 1])
                   and type(e) is not ev.EventsLost]
        lost.setdefault(epoch, set()).update(_split(members, gap, agents, lo, hi))
        taints[epoch] = min(taints.get(epoch, gap.first_seq), gap.first_seq)
    return lost, taints


def _split(members: list[ev.Event], gap: ev.EventsLost, agents: list[str], lo: int, hi: int | None) -> set[int]:
    """The batches of one epoch (after the checkpoint of `lo`; up to `hi`, where a resume
    from `hi` follows) whose events the damage split: all but those wholly before it
    (stepped by every agent before it, and not trained again after it) and those wholly
    after it (started after it). With nothing after it (a lost tail), every batch up to
    `hi` not stepped before it."""
    before, after = gap.first_seq, gap.next_seq if gap.next_seq >= 0 else None
    batch_of_group: dict[GroupKey, int] = {}
    earliest: dict[int, int] = {}
    stepped: dict[int, set[str]] = {}
    retrained: set[int] = set()
    started_after: set[int] = set()
    for e in members:
        if type(e) is ev.GroupOpened:
            batch_of_group[e.key] = e.batch
        for b in _batches_of(e, batch_of_group):
            earliest[b] = min(earliest.get(b, e.seq), e.seq)
        if type(e) is ev.OptimizerStep and e.seq < before:
            stepped.setdefault(e.version, set()).add(e.agent)
        if isinstance(e, _TRAINED) and after is not None and e.seq >= after:
            retrained.add(e.version)
        if type(e) is ev.BatchStarted and after is not None and e.seq >= after:
            started_after.add(e.batch)
    top = hi if hi is not None and after is None else max(earliest, default=lo)
    if hi is not None:
        top = min(top, hi)
    whole_before = {b for b, who in stepped.items() if set(agents) <= who and b not in retrained}
    whole_after = {b for b in started_after if earliest.get(b, after or 0) >= (after or 0)}
    return {b for b in range(lo + 1, top + 1) if b not in whole_before and b not in whole_after}


def _batches_of(e: ev.Event, batch_of_group: dict[GroupKey, int]) -> list[int]:
    """The batches an event concerns (none: history, such as workers and placement)."""
    if isinstance(e, (ev.GroupOpened, ev.BatchStarted, ev.GroupTargets, ev.EpisodesDrawn, ev.TeacherScored)):
        return [e.batch]
    if isinstance(e, _BY_VERSION):
        return [e.version]
    if isinstance(e, (ev.GroupComplete, ev.GroupServed)):
        return [batch_of_group[e.key]] if e.key in batch_of_group else []
    return []


class _EpisodeGroups:
    """Continuous admission: the groups of each episode that has not ended yet."""

    def __init__(self) -> None:
        self._of: dict[str, list[GroupKey]] = {}

    def opened(self, key: GroupKey) -> None:
        self._of.setdefault(key.episode, []).append(key)

    def ended(self, episode: str) -> list[GroupKey]:
        return self._of.pop(episode, [])

    def running(self) -> list[GroupKey]:
        return [key for keys in self._of.values() for key in keys]


def _continuous(config_toml: str) -> bool:
    try:
        return admits_continuously(tomllib.loads(config_toml).get("pipeline", {}).get("admission"))
    except tomllib.TOMLDecodeError:
        return False


def _cut(e: ev.Event, keep: Callable[[int | None], bool], batch_of_group: dict[GroupKey, int],
         batch_of_episode: dict[str, int] | None = None, running: int | None = None) -> ev.Event | None:
    """`e` as far as it concerns batches `keep` keeps; None if nothing of it does (a group
    of no known batch is asked about as None; a later turn belongs to its group's batch;
    under continuous admission a group belongs to its episode's batch, and an episode
    that had not ended to batch `running`)."""
    if isinstance(e, ev.GroupOpened):
        return e if keep(batch_of_group.get(e.key, e.batch)) else None
    if batch_of_episode is not None and isinstance(e, (ev.EpisodeAdmitted, ev.EpisodeAssigned, ev.EpisodeAbandoned)):
        return e if keep(batch_of_episode.get(e.episode, running)) else None
    if isinstance(e, (ev.GroupComplete, ev.GroupServed)):
        return e if keep(batch_of_group.get(e.key)) else None
    if isinstance(e, (ev.BatchStarted, ev.GroupTargets, ev.EpisodesDrawn, ev.TeacherScored)):
        return e if keep(e.batch) else None
    if isinstance(e, ev.EvaluationDone):
        return e if keep(e.step + 1) else None  # an evaluation of step t belongs to batch t + 1
    if isinstance(e, _BY_VERSION):
        return e if keep(e.version) else None
    if isinstance(e, ev.RequestsCompleted):
        kept_at = _kept_parts(e.parts, keep, batch_of_group)
        if len(kept_at) == len(e.parts.keys):
            return e
        if not kept_at:
            return None
        return msgspec.structs.replace(e, versions=[e.versions[i] for i in kept_at], parts=_parts(e.parts, kept_at))
    if isinstance(e, (ev.RequestsDispatched, ev.SamplesDropped)):
        kept_at = _kept_parts(e.parts, keep, batch_of_group)
        if len(kept_at) == len(e.parts.keys):
            return e
        return msgspec.structs.replace(e, parts=_parts(e.parts, kept_at)) if kept_at else None
    return e  # workers, placement, demand: history, not undone


def _kept_parts(parts: ev.Parts, keep: Callable[[int | None], bool], batch_of_group: dict[GroupKey, int]) -> list[int]:
    """The indices of the parts whose groups belong to batches `keep` keeps."""
    return [i for i, key in enumerate(parts.keys) if keep(batch_of_group.get(key))]


def _parts(parts: ev.Parts, at: list[int]) -> ev.Parts:
    if len(at) == len(parts.keys):
        return parts
    return ev.Parts([parts.keys[i] for i in at], [parts.firsts[i] for i in at], [parts.sizes[i] for i in at],
                    [parts.turns[i] for i in at] if parts.turns else [])


def last_batch(log: list) -> int:
    """The last global batch the log reached (a group opened, or a step taken)."""
    opened, stepped = ev.GroupOpened, ev.OptimizerStep
    return max([e.batch for e in log if type(e) is opened] + [e.version for e in log if type(e) is stepped],
               default=0)


def open_steps(log: list) -> set[tuple[str, int]]:
    """(agent, batch) of each step the run reached but never took: it stopped mid-step
    (an error, a crash, Ctrl-C). `log` is a lineage (what a resume undid is cut)."""
    start = next((e for e in log if isinstance(e, ev.RunStarted)), None)
    if start is None:
        return set()
    step = ev.OptimizerStep
    stepped = {(e.agent, e.version) for e in log if type(e) is step}
    lost = lost_batches(log)
    return {(a, b) for b in range(1, last_batch(log) + 1) for a in agent_roles(start).trained
            if (a, b) not in stepped and b not in lost}


@dataclass(frozen=True)
class AgentRoles:
    """What the run's config says of its agents, as the re-drive needs it."""

    trained: list[str]  # those that step (not frozen, not snapshots), in config order
    dynamic: list[str]  # those with dynamic sampling
    snapshots: dict[str, int]  # snapshot agents -> their refresh interval


def agent_roles(start: ev.RunStarted) -> AgentRoles:
    """The run's agents by role, from the config its log starts with (a log without one:
    every agent trained, none with dynamic sampling)."""
    tables = tomllib.loads(start.config_toml).get("agents", {}) if start.config_toml else {}
    trained = [a for a in start.agents
               if tables.get(a, {}).get("train", True) and not tables.get(a, {}).get("snapshot_of")]
    return AgentRoles(trained, [a for a in start.agents if tables.get(a, {}).get("dynamic_sampling", False)],
                      {a: tables[a].get("snapshot_every", 1) for a in start.agents if tables.get(a, {}).get("snapshot_of")})
