"""The events the run's final state descends from, across restored trainers and resumes.

Two things undo logged work. A trainer that dies takes the agent's training state with
it; the agent is restored at its last saved version v and trained again from there
(`TrainingRestored`), so its micro-batches and steps into versions after v logged before
count no more: the same samples are trained again after the marker. And a resumed run
restarts from the checkpoint of step t (`RunResumed`): whatever the crashed
controller had done for the batches after t (groups opened, outputs received, micro-batches
formed, steps taken) was undone with it, and those batches are generated and trained
again, often under the same sample ids (they derive from the seed). `lineage(events)` cuts
those undone events out, so exactly-once accounting and `replay --check` judge the run
that counts: every sample in it trained or dropped once.

Also the log's own reach: the last batch it reached (`last_batch`) and the steps it
reached but never took (`open_steps`).

It knows which fields tie an event to a batch; it does not read files.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

import msgspec

from flexmarl.runtime import events as ev

# Events of one version (= the batch that steps into it): undone when version > t.
_BY_VERSION = (ev.MicroBatchFormed, ev.MicroBatchTrained, ev.OptimizerStep, ev.WeightSyncStarted,
               ev.WeightSyncFinished, ev.SnapshotRefreshed)


# The events that undo logged work.
UNDOING = frozenset({ev.RunResumed, ev.TrainingRestored})

# What a trainer did to an agent's state: undone for versions after the one a
# `TrainingRestored` brought the agent back to.
_TRAINED = (ev.MicroBatchFormed, ev.MicroBatchTrained, ev.OptimizerStep)


def lineage(events: list[ev.Event]) -> list[ev.Event]:
    """`events` without what a later `RunResumed` undid (see the module docstring)."""
    if UNDOING.isdisjoint(map(type, events)):
        return events
    kept: list[ev.Event] = []
    batch_of_group: dict[str, int] = {}
    batch_of_sample: dict[str, int] = {}
    for e in events:
        if isinstance(e, ev.GroupOpened):
            batch_of_group[e.group_id] = e.batch
            for sid in e.members():
                batch_of_sample[sid] = e.batch
        if isinstance(e, ev.TrainingRestored):
            kept = [x for x in kept if not (isinstance(x, _TRAINED) and x.agent == e.agent and x.version > e.version)]
        if isinstance(e, ev.RunResumed):
            kept = [c for x in kept if (c := _cut(x, e.step, batch_of_group, batch_of_sample)) is not None]
            # Ids of undone batches may be opened again: forget what they were.
            batch_of_group = {g: b for g, b in batch_of_group.items() if b <= e.step}
            batch_of_sample = {s: b for s, b in batch_of_sample.items() if b <= e.step}
        kept.append(e)
    return kept


def _cut(e: ev.Event, step: int, batch_of_group: dict[str, int], batch_of_sample: dict[str, int]) -> ev.Event | None:
    """`e` as far as it concerns batches up to `step`; None if nothing of it does."""
    if isinstance(e, ev.GroupOpened):
        return e if e.batch <= step else None
    if isinstance(e, ev.GroupComplete):
        return e if batch_of_group.get(e.group_id, 0) <= step else None
    if isinstance(e, (ev.BatchStarted, ev.GroupTargets, ev.EpisodesDrawn)):
        return e if e.batch <= step else None
    if isinstance(e, ev.TeacherScored):
        return e if e.batch <= step else None
    if isinstance(e, ev.GroupServed):
        return e if batch_of_group.get(e.group_id, 0) <= step else None
    if isinstance(e, ev.EvaluationDone):
        return e if e.step < step else None
    if isinstance(e, _BY_VERSION):
        return e if e.version <= step else None
    if isinstance(e, ev.RequestsCompleted):  # kept in the form that lists every sample
        samples, versions = e.samples(), e.sample_versions()
        kept_at = [i for i, sid in enumerate(samples) if batch_of_sample.get(sid, 0) <= step]
        if not kept_at:
            return None
        return msgspec.structs.replace(e, sample_ids=[samples[i] for i in kept_at],
                                       versions=[versions[i] for i in kept_at], parts=ev.Parts())
    if isinstance(e, ev.RequestsDispatched):
        keep = [sid for sid in e.samples() if batch_of_sample.get(sid, 0) <= step]
        return msgspec.structs.replace(e, sample_ids=keep, parts=ev.Parts()) if keep else None
    if isinstance(e, ev.SamplesDropped):
        keep = [sid for sid in e.sample_ids if batch_of_sample.get(sid, 0) <= step]
        return msgspec.structs.replace(e, sample_ids=keep) if keep else None
    return e  # workers, placement, demand: history, not undone


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
    return {(a, b) for b in range(1, last_batch(log) + 1) for a in agent_roles(start).trained if (a, b) not in stepped}


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
