"""The events the run's final state descends from, across restored trainers and resumes.

Two things undo logged work. A trainer that dies takes the agent's training state with
it; the agent is restored at its last saved version v and trained again from there
(`TrainingRestored`), so its micro-batches and steps into versions after v logged before
count no more: the same samples are trained again after the marker. And a resumed run
restarts from the checkpoint of step t (`RunResumed`): whatever the crashed
controller had done for the batches after t (groups opened, outputs received, micro-batches
formed, steps taken) was undone with it, and those batches are generated and trained
again, often under the same group keys (they derive from the seed). `lineage(events)` cuts
those undone events out, so exactly-once accounting and `replay --check` judge the run
that counts: every sample in it trained or dropped once.

Also the log's own reach: the last batch it reached (`last_batch`) and the steps it
reached but never took (`open_steps`).

It knows which fields tie an event to a batch; it does not read files.
"""

from __future__ import annotations

import msgspec

from flexmarl.runtime import events as ev
from flexmarl.runtime.keys import GroupKey

# Events of one version (= the batch that steps into it): undone when version > t.
_BY_VERSION = (ev.MicroBatchFormed, ev.MicroBatchTrained, ev.OptimizerStep, ev.WeightSyncStarted,
               ev.WeightSyncFinished)


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
    batch_of_group: dict[GroupKey, int] = {}
    for e in events:
        if isinstance(e, ev.GroupOpened):
            batch_of_group[e.key] = e.batch
        if isinstance(e, ev.TrainingRestored):
            kept = [x for x in kept if not (isinstance(x, _TRAINED) and x.agent == e.agent and x.version > e.version)]
        if isinstance(e, ev.RunResumed):
            kept = [c for x in kept if (c := _cut(x, e.step, batch_of_group)) is not None]
            # Keys of undone batches may be opened again: forget what they were.
            batch_of_group = {g: b for g, b in batch_of_group.items() if b <= e.step}
        kept.append(e)
    return kept


def _cut(e: ev.Event, step: int, batch_of_group: dict[GroupKey, int]) -> ev.Event | None:
    """`e` as far as it concerns batches up to `step`; None if nothing of it does."""
    if isinstance(e, ev.GroupOpened):
        return e if e.batch <= step else None
    if isinstance(e, ev.GroupComplete):
        return e if batch_of_group.get(e.key, 0) <= step else None
    if isinstance(e, ev.BatchStarted):
        return e if e.batch <= step else None
    if isinstance(e, ev.EvaluationDone):
        return e if e.step < step else None
    if isinstance(e, _BY_VERSION):
        return e if e.version <= step else None
    if isinstance(e, ev.RequestsCompleted):
        kept_at = _kept_parts(e.parts, step, batch_of_group)
        if not kept_at:
            return None
        return msgspec.structs.replace(e, versions=[e.versions[i] for i in kept_at], parts=_parts(e.parts, kept_at))
    if isinstance(e, (ev.RequestsDispatched, ev.SamplesDropped)):
        kept_at = _kept_parts(e.parts, step, batch_of_group)
        return msgspec.structs.replace(e, parts=_parts(e.parts, kept_at)) if kept_at else None
    return e  # workers, placement, demand: history, not undone


def _kept_parts(parts: ev.Parts, step: int, batch_of_group: dict[GroupKey, int]) -> list[int]:
    """The indices of the parts whose groups belong to batches up to `step`."""
    return [i for i, key in enumerate(parts.keys) if batch_of_group.get(key, 0) <= step]


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
    return {(a, b) for b in range(1, last_batch(log) + 1) for a in start.agents if (a, b) not in stepped}
