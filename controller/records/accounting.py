"""The sample accounting of a run's log: every sample generated once and then trained,
dropped or still in flight once (`flexmarl replay`'s table and its errors).

`accounting(events, run)` counts per agent and generating version, with multiplicity, so
that every way of breaking exactly-once also breaks generated = trained + dropped + in
flight, and says which way it broke. It reads only `ACCOUNTED_EVENTS`; the lineage (what a
resume undid) is the caller's to cut.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from flexmarl.runtime.events import (
    Event,
    GroupOpened,
    MicroBatchFormed,
    OptimizerStep,
    Parts,
    RequestsCompleted,
    RunStarted,
    SamplesDropped,
)
from flexmarl.runtime.staleness import lag as staleness_lag
from flexmarl.runtime.staleness import too_stale


@dataclass
class AccountRow:
    agent: str
    version: int | None  # the generating policy version; None: not generated yet
    generated: int = 0
    trained: int = 0  # with multiplicity, so a double-trained sample breaks the sum
    dropped: int = 0
    in_flight: int = 0
    total: bool = False  # the agent's row over all versions

    @property
    def reconciles(self) -> bool:
        return self.generated == self.trained + self.dropped + self.in_flight


@dataclass
class _Tally:
    """What one pass over the log counts per sample (`_tally`), with multiplicity."""

    owner: dict[str, str] = field(default_factory=dict)  # sample -> agent whose group opened it
    made_by: dict[str, int] = field(default_factory=dict)  # sample -> oldest policy version that generated it
    trained: collections.Counter = field(default_factory=collections.Counter)
    unstepped: collections.Counter = field(default_factory=collections.Counter)  # in micro-batches of a step not logged
    dropped: collections.Counter = field(default_factory=collections.Counter)
    trained_by: dict[str, str] = field(default_factory=dict)
    dropped_by: dict[str, str] = field(default_factory=dict)
    staleness: dict[str, collections.Counter] = field(default_factory=dict)  # agent -> lag histogram
    stale: collections.Counter = field(default_factory=collections.Counter)  # agent -> trained outside the bound
    errors: list[str] = field(default_factory=list)
    members: dict[str, list[str]] = field(default_factory=dict)  # group named by its members' count -> their ids
    by_opener: bool = True  # every sample sent to a trainer opened, and by the agent it trains


# The events the accounting reads.
ACCOUNTED_EVENTS = frozenset({GroupOpened, RequestsCompleted, MicroBatchFormed, OptimizerStep, SamplesDropped})

def accounting(events: list[Event], run: RunStarted | None):
    """(rows, staleness histograms, errors). Counts trained and dropped with multiplicity
    so that every way of breaking exactly-once also breaks generated = trained + dropped
    + in flight; the error then says which way it broke. A sample is trained once the
    optimizer step of its micro-batch is logged; in a micro-batch whose step is not (the
    run stopped mid-step), it is in flight: read, never committed to the weights. Written
    for logs of millions of samples: a sample costs a few dictionary operations, done in
    bulk where they can be. `events` may be just the `ACCOUNTED_EVENTS` of the log."""
    bound = run.max_staleness if run is not None else None
    t = _tally(events, bound)
    rows = _account_rows(t)
    totals: dict[str, AccountRow] = {}
    for r in rows.values():
        total = totals.setdefault(r.agent, AccountRow(r.agent, None, total=True))
        total.generated += r.generated
        total.trained += r.trained
        total.dropped += r.dropped
        total.in_flight += r.in_flight
    errors = t.errors + _accounting_errors(t, totals, bound)
    ordered = sorted(rows.values(), key=lambda r: (r.agent, r.version is None, r.version or 0))
    ordered += [total for _, total in sorted(totals.items())]
    return ordered, t.staleness, errors


def _tally(events: list[Event], bound: int | None) -> _Tally:
    """One pass over the log: who opened, generated, trained and dropped each sample. The
    groups opened and the requests completed between two micro-batches are counted
    together, in bulk, when the next micro-batch (which reads them) comes."""
    t = _Tally()
    stepped = {(e.agent, e.version) for e in events if type(e) is OptimizerStep}
    opened: list[GroupOpened] = []
    completed: list[RequestsCompleted] = []
    for e in events:
        if type(e) is GroupOpened:
            opened.append(e)
        elif type(e) is RequestsCompleted:
            completed.append(e)
        elif type(e) is MicroBatchFormed:
            _tally_opened(t, opened)
            _tally_completed(t, completed)
            opened, completed = [], []
            _tally_micro_batch(t, e, (e.agent, e.version) in stepped, bound)
        elif type(e) is SamplesDropped:
            t.dropped.update(e.sample_ids)
            t.dropped_by.update(dict.fromkeys(e.sample_ids, e.agent))
    _tally_opened(t, opened)
    _tally_completed(t, completed)
    t.by_opener = t.trained_by.items() <= t.owner.items()
    return t


def _tally_opened(t: _Tally, groups: list[GroupOpened]) -> None:
    """Groups opened, in log order: in bulk, or one at a time where a sample is opened
    again (the first opening counts; the errors name the others)."""
    members = [e.members() for e in groups]
    samples = list(itertools.chain.from_iterable(members))
    agents = itertools.chain.from_iterable(map(itertools.repeat, [e.agent for e in groups], map(len, members)))
    if not _add_new(t.owner, samples, agents):
        for e, group in zip(groups, members):
            if not t.owner.keys().isdisjoint(group):
                t.errors += [f"agent {e.agent!r}: sample {sid} opened twice (group {e.group_id})"
                             for sid in group if sid in t.owner]
                group = [sid for sid in group if sid not in t.owner]
            t.owner.update(dict.fromkeys(group, e.agent))
    t.members.update((e.group_id, group) for e, group in zip(groups, members)
                     if not e.sample_ids and "@" not in e.group_id)  # named by the group


def _tally_completed(t: _Tally, completed: list[RequestsCompleted]) -> None:
    """Requests completed, in log order: in bulk, or one at a time where a sample is
    generated again (re-issued: the oldest version counts)."""
    samples: list[str] = []
    versions: list[int] = []
    ends = [len(_versions_made(e, t.members, samples, versions)) for e in completed]
    if _add_new(t.made_by, samples, versions):
        return
    for start, end in zip([0] + ends, ends):
        made = dict(zip(samples[start:end], versions[start:end]))
        for sid in made.keys() & t.made_by.keys():
            made[sid] = min(made[sid], t.made_by[sid])
        t.made_by.update(made)


def _add_new(into: dict[str, Any], keys: list[str], values: Iterable) -> bool:
    """Adds `keys` (each with its one of `values`) to `into` if each is new and named once,
    and says whether it did; if not, `into` is left as it was."""
    if not into.keys().isdisjoint(keys):
        return False
    size = len(into)
    into.update(zip(keys, values))
    if len(into) == size + len(keys):
        return True
    for key in keys:  # one named twice: take them out again (each was new)
        into.pop(key, None)
    return False


def _versions_made(e: RequestsCompleted, members: dict[str, list[str]], samples: list[str],
                   versions: list[int]) -> list[str]:
    """Appends `e.samples()` and `e.sample_versions()` (the version that generated each),
    as far as both go, to `samples` and `versions`, and returns `samples`. A part of a
    group named by its members' count is a slice of the group's `members` rather than each
    sample named again."""
    if e.sample_ids:
        n = min(len(e.sample_ids), len(e.versions))
        samples += e.sample_ids[:n]
        versions += e.versions[:n]
        return samples
    parts = e.parts
    for key, first, size, version in zip(parts.keys, parts.firsts, parts.sizes, e.versions):
        group = members.get(key)
        if group is not None and 0 <= first <= first + size <= len(group):
            samples += group[first:first + size]
        else:
            samples += Parts([key], [first], [size]).sample_ids()
        versions += [version] * (len(samples) - len(versions))
    return samples


def _tally_micro_batch(t: _Tally, e: MicroBatchFormed, stepped: bool, bound: int | None) -> None:
    if len(e.min_versions) != len(e.sample_ids):
        t.errors.append(f"agent {e.agent!r}: micro-batch at seq {e.seq} has {len(e.sample_ids)} "
                        f"samples but {len(e.min_versions)} versions")
    (t.trained if stepped else t.unstepped).update(e.sample_ids)
    t.trained_by.update(dict.fromkeys(e.sample_ids, e.agent))
    if not all(map(t.made_by.__contains__, e.sample_ids)):  # made by no request logged before
        t.made_by.update({sid: v for sid, v in zip(e.sample_ids, e.min_versions) if sid not in t.made_by})
    # The rule per distinct version rather than per sample: a micro-batch has few.
    histogram = t.staleness.setdefault(e.agent, collections.Counter())
    stale = 0
    for v, n in collections.Counter(e.min_versions).items():
        lag = staleness_lag(e.version - 1, [v])
        histogram[lag] += n
        if lag < 0 or (bound is not None and too_stale(e.version - 1, [v], bound)):
            stale += n
    t.stale[e.agent] += stale


def _account_rows(t: _Tally) -> dict[tuple, AccountRow]:
    """The rows, keyed (agent, the version that made the sample)."""
    made = t.made_by.get
    generated = collections.Counter(zip(t.owner.values(), map(made, t.owner)))
    in_flight: collections.Counter[tuple[str, int | None]] = collections.Counter()
    # The usual case; with every sample trained opened by its agent, as many trained as opened says it.
    all_trained = (t.by_opener and len(t.trained) == len(t.owner)) or all(map(t.trained.__contains__, t.owner))
    if not all_trained:
        in_flight.update((agent, made(sid)) for sid, agent in t.owner.items()
                         if sid not in t.trained and sid not in t.dropped and sid not in t.unstepped)
    for key, n in _rows_of(t.unstepped, t.owner, t.trained_by, made).items():
        in_flight[key] += n
    if all_trained and len(t.trained) == len(t.owner) == t.trained.total() and all(t.owner.values()):
        trained_rows = generated  # each sample opened trained once, and none other: the same counts
    else:
        trained_rows = _rows_of(t.trained, t.owner, t.trained_by, made)
    dropped_rows = _rows_of(t.dropped, t.owner, t.dropped_by, made)
    return {(agent, version): AccountRow(agent, version, generated[agent, version], trained_rows[agent, version],
                                         dropped_rows[agent, version], in_flight[agent, version])
            for agent, version in {**generated, **trained_rows, **dropped_rows, **in_flight}}


def _rows_of(counts: collections.Counter, owner: dict[str, str], by: dict[str, str],
             made: Callable[[str], int | None]) -> collections.Counter[tuple[str, int | None]]:
    """`counts` (sample -> times) summed per (the agent that opened the sample, or else the
    one in `by`; the version that made it)."""
    agents: list = list(map(owner.get, counts))
    if not all(agents):  # some not opened (or by an agent named "")
        agents = [agent or by[sid] for sid, agent in zip(counts, agents)]
    keys = zip(agents, map(made, counts))
    if counts.total() == len(counts):  # each once, the usual case
        return collections.Counter(keys)
    rows: collections.Counter[tuple[str, int | None]] = collections.Counter()
    for key, n in zip(keys, counts.values()):
        rows[key] += n
    return rows


def _accounting_errors(t: _Tally, totals: dict[str, AccountRow], bound: int | None) -> list[str]:
    """Each agent whose samples do not reconcile (and why), and each that trained a sample
    outside the staleness bound."""
    errors = []
    formed = t.trained  # sent to a trainer, stepped or not
    if t.unstepped:
        formed = t.trained.copy()
        formed.update(t.unstepped)
    why = _why_unreconciled(t.owner, formed, t.dropped, t.trained_by, t.dropped_by, t.by_opener)
    for agent, total in sorted(totals.items()):
        if not total.reconciles or why.get(agent):
            errors.append(f"agent {agent!r}: samples do not reconcile: generated {total.generated} != "
                          f"trained {total.trained} + dropped {total.dropped} + in flight {total.in_flight}"
                          + (f" ({'; '.join(why[agent])})" if why.get(agent) else ""))
    for agent, n in sorted(t.stale.items()):
        if n:
            errors.append(f"agent {agent!r}: {n} trained sample(s) outside the staleness bound "
                          f"0 <= lag <= {bound if bound is not None else '?'} (see the staleness histogram)")
    return errors


def _why_unreconciled(owner, trained, dropped, trained_by, dropped_by, by_opener: bool) -> dict[str, list[str]]:
    """Per agent, each way exactly-once broke, with examples. The samples that need a look
    (trained or dropped more than once, both, not generated, or by another agent) are
    found with set operations over all of them; only those are looked at one by one.
    `by_opener`: every sample in `trained` was opened by the agent that trained it."""
    found: dict[str, dict[str, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))

    def note(what: str, samples, agent_of: Callable[[str], str]) -> None:
        for s in samples:
            found[agent_of(s)][what].append(s)

    if trained.total() != len(trained):
        note("trained twice", [s for s, n in trained.items() if n > 1], lambda s: owner.get(s, trained_by[s]))
    note("trained and dropped", trained.keys() & dropped.keys(), lambda s: owner.get(s, trained_by[s]))
    if not by_opener:
        note("trained without being generated", trained.keys() - owner.keys(), trained_by.__getitem__)
        note("trained by another agent", [s for s in trained if s in owner and trained_by[s] != owner[s]],
             owner.__getitem__)
    if dropped.total() != len(dropped):
        note("dropped twice", [s for s, n in dropped.items() if n > 1], lambda s: owner.get(s, dropped_by[s]))
    note("dropped without being generated", dropped.keys() - owner.keys(), dropped_by.__getitem__)
    order = ("trained twice", "trained and dropped", "dropped twice", "trained without being generated",
             "dropped without being generated", "trained by another agent")
    return {agent: [f"{len(ids[what])} sample(s) {what}, e.g. {', '.join(sorted(ids[what])[:3])}"
                    for what in order if ids.get(what)] for agent, ids in found.items()}
