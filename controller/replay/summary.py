"""What a run did, read back from its event log: the summary of `flexmarl replay`.

- ``summarize(events)``: every worker's busy and idle time, per-agent throughput and
  prefix-cache hits (the share of prompt tokens the engines found cached, first turns and
  later turns of conversations), the staleness histogram, and sample accounting (generated
  = trained + dropped + in flight, per agent and per generating version: accounting.py).
  Accounting that does not reconcile, or a sample
  past the staleness bound, is an error (`Summary.errors`; the command exits 1).
- ``trace_json(summary)``: a Chrome / Perfetto trace, one named track per worker and agent.
- ``write_plot(summary, path)``: a timeline of busy spans and utilization per worker.

Busy means: a rollout worker while it has a dispatched request not yet completed, or while
it loads weights; a trainer while it runs a micro-batch or publishes weights.

Works on the event list alone: it knows no sockets, processes or config files, and it
never trusts the log to be consistent (that is what it checks).
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from flexmarl.runtime import collector
from flexmarl.runtime.events import (
    PROMPT_FIELDS,
    AllocationChanged,
    BatchStarted,
    Event,
    GroupComplete,
    GroupOpened,
    MicroBatchFormed,
    MicroBatchTrained,
    OptimizerStep,
    RequestsCompleted,
    RequestsDispatched,
    RunResumed,
    RunStarted,
    WeightSyncFinished,
    WeightSyncStarted,
    WorkerDied,
    WorkerJoined,
    WorkerRestarted,
)

from .accounting import ACCOUNTED_EVENTS, AccountRow, accounting
from .lineage import UNDOING, lineage, open_steps

GENERATE, TRAIN, SYNC, STEP, ITERATION = "generate", "train", "sync", "step", "iteration"


@dataclass
class Span:
    start: float
    end: float
    kind: str  # GENERATE | TRAIN | SYNC | STEP | ITERATION
    name: str
    args: dict = field(default_factory=dict)


@dataclass
class WorkerUsage:
    worker: str
    role: str
    start: float  # joined (or first seen)
    end: float  # died, or the end of the log
    spans: list[Span] = field(default_factory=list)
    restarts: int = 0  # times the launcher started its process again

    def times(self, now: float = math.inf) -> tuple[float, float, float]:
        """(busy_s, idle_s, utilization), from one union of the spans; of a log still being
        written, up to `now` (its last event's time)."""
        end = min(self.end, now)
        busy = sum(b - a for a, b in union(((sp.start, sp.end) for sp in self.spans), self.start, end))
        life = end - self.start
        return busy, max(0.0, life - busy), busy / life if life > 0 else 0.0

    @property
    def busy_s(self) -> float:
        return self.times()[0]

    @property
    def idle_s(self) -> float:
        return self.times()[1]

    @property
    def utilization(self) -> float:
        return self.times()[2]


@dataclass
class AgentStats:
    agent: str
    samples_trained: int = 0  # sum of OptimizerStep.samples: what went into the weights
    micro_batches: int = 0
    optimizer_steps: int = 0
    version: int = 0  # the last version an optimizer step produced
    rewards: list[float] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # iterations and weight syncs
    # Prompt tokens of its generated samples and those found in the prefix cache, first
    # turns and later turns (RequestsCompleted's fields of those names).
    prompts: collections.Counter = field(default_factory=collections.Counter)

    def hit_rate(self, later: bool = False) -> float | None:
        prompt = self.prompts["turn_prompt_tokens" if later else "prompt_tokens"]
        return self.prompts["turn_cached_tokens" if later else "cached_tokens"] / prompt if prompt else None
    swap_ins: int = 0  # training state loaded from a copy a trainer parked
    swap_wait_s: float = 0.0  # seconds its ready work waited on those swap-ins

    @property
    def swap_ins_per_step(self) -> float:
        return self.swap_ins / self.optimizer_steps if self.optimizer_steps else 0.0


@dataclass
class Summary:
    run: RunStarted | None
    t_start: float
    t_end: float
    events: int
    workers: dict[str, WorkerUsage]
    agents: dict[str, AgentStats]
    staleness: dict[str, collections.Counter]  # agent -> lag -> samples
    accounting: list[AccountRow]  # per agent and version, then one total row per agent
    errors: list[str]
    resumed_at: list[int] = field(default_factory=list)  # checkpoint steps the run resumed from
    training_s: float = 0.0  # from each process's first batch to its last event: no set-up, no downtime
    open_steps: dict[str, list[int]] = field(default_factory=dict)  # agent -> steps begun, never taken

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start


# ---------------------------------------------------------------- summary


def summarize(events: list[Event]) -> Summary:
    """Everything the log says about the run. Never raises on inconsistent logs: the
    inconsistencies are in ``errors`` (the table is what helps find them).

    One pass over the log hands each part of the summary the event types it reads, in log
    order (a long log is mostly groups opened and completed and requests sent and
    answered, which only some parts read); the parts count samples in bulk where they can.
    The summary is hundreds of thousands of new objects for a long log, none in a
    reference cycle: Python's cyclic garbage collector, which would walk every object of
    the log again each time they pile up, is paused while they are made."""
    with collector.paused():
        return _summarize(events)


def _summarize(events: list[Event]) -> Summary:
    run = next((e for e in events if type(e) is RunStarted), None)
    t_start = run.t if run else (events[0].t if events else 0.0)
    t_end = events[-1].t if events else t_start  # RunFinished, unless the run crashed
    read = _route(events, tuple(_READS))
    resumed_at = [e.step for e in read["marks"] if type(e) is RunResumed]
    crashed_at = crash_times(events, t_start) if resumed_at else []
    workers = _worker_usage(read["usage"], t_start, t_end, iter(crashed_at))
    if read["undoing"]:
        read.update(_route(lineage(events), ("agents", "accounting", "steps")))  # without what a resume undid
    agents = _agent_stats(read["agents"], run)
    rows, staleness, errors = accounting(read["accounting"], run)
    unfinished: dict[str, list[int]] = {}
    for agent, batch in sorted(open_steps(read["steps"])):
        unfinished.setdefault(agent, []).append(batch)
    training_s = training_time(read["marks"], iter(crashed_at), t_end if events else 0.0)
    return Summary(run, t_start, t_end, len(events), workers, agents, staleness, rows, errors, resumed_at,
                   training_s, unfinished)


def _route(events: list[Event], parts: tuple[str, ...]) -> dict[str, list]:
    """The events each of `parts` reads (`_READS`), in log order, in one pass over `events`."""
    read: dict[str, list] = {part: [] for part in parts}
    appends: dict[type, list[Callable[[Event], None]]] = collections.defaultdict(list)
    for part in parts:
        for kind in _READS[part]:
            appends[kind].append(read[part].append)
    routes = {kind: tuple(to) for kind, to in appends.items()}
    nowhere: tuple = ()
    for e in events:
        for append in routes.get(type(e), nowhere):
            append(e)
    return read


def crash_times(events: list[Event], before: float) -> list[float]:
    """Per `RunResumed`, in order: when the controller before it crashed (the time of the
    event before it; `before` for one that comes first: the start of the run, or the time
    of the last event of the part of the log read before these)."""
    return [events[i - 1].t if i else before for i, e in enumerate(events) if type(e) is RunResumed]


def training_seconds(events: list[Event]) -> float:
    """Seconds spent training: from each controller process's first `BatchStarted` to its
    last event (the next `RunResumed` ends a crashed one), so model builds, engine starts
    and the time a crashed run lay dead are not counted."""
    marks = [e for e in events if type(e) in TRAINING_MARKS]
    return training_time(marks, iter(crash_times(events, 0.0)), events[-1].t if events else 0.0)


def training_time(marks: list[Event], crashed_at: Iterator[float], last_t: float) -> float:
    """`training_seconds` from the log's `TRAINING_MARKS`, when the controller before each
    `RunResumed` crashed, and the time of the log's last event."""
    total, began = 0.0, None
    for e in marks:
        if type(e) is RunResumed:
            crashed = next(crashed_at)
            if began is not None:
                total += crashed - began
            began = None
        elif began is None:
            began = e.t
    return total + (last_t - began if began is not None else 0.0)


TRAINING_MARKS = frozenset({RunResumed, BatchStarted})


def _worker_usage(events: list[Event], t_start: float, t_end: float,
                  crashed_at: Iterator[float]) -> dict[str, WorkerUsage]:
    """From the log's `USAGE_EVENTS`, and when the controller before each `RunResumed` crashed."""
    usage = UsageReader(t_start, t_end)
    usage.read(events, crashed_at)
    usage.finish()
    return usage.workers


class UsageReader:
    """Each worker's spans, read from the log's `USAGE_EVENTS` in order, a part of the log at
    a time (`read`), and what is under way (requests, weight syncs). `finish` ends what is
    still under way at `t_end`: the summary's last event, or, for a log still being written,
    left at infinity (then `WorkerUsage.times(now)` counts up to now). One method per event
    type it reads besides requests sent and answered (`_USAGE_READERS`)."""

    def __init__(self, t_start: float, t_end: float = math.inf) -> None:
        self.t_start, self.t_end = t_start, t_end
        self.workers: dict[str, WorkerUsage] = {}
        # (worker, request, agent): a message's groups of an agent
        self.outstanding: dict[tuple[str, int, str], RequestsDispatched] = {}
        self.sync_started: dict[tuple[str, int], WeightSyncStarted] = {}
        self.trainer_of: dict[str, str] = {}  # agent -> the trainer that last stepped it (publishes its weights)

    def read(self, events: list[Event], crashed_at: Iterator[float]) -> None:
        """`events` (of `USAGE_EVENTS`, in log order, after those read before); `crashed_at`:
        when the controller before each of their `RunResumed` crashed (`crash_times`)."""
        workers, outstanding, worker = self.workers, self.outstanding, self.worker
        for e in events:
            # Requests sent and answered, most of a long log, are read here rather than by a
            # method call each.
            if type(e) is RequestsDispatched:
                if e.worker not in workers:
                    worker(e.worker, "rollout", e.t)
                outstanding[(e.worker, e.request_id, e.agent)] = e
            elif type(e) is RequestsCompleted:
                d = outstanding.pop((e.worker, e.request_id, e.agent), None)
                if d is not None:
                    w = workers.get(e.worker) or worker(e.worker, "rollout", d.t)
                    w.spans.append(_request_span(d, e.t, e.tokens))
            elif type(e) is RunResumed:
                self.resumed(next(crashed_at))
            else:
                _USAGE_READERS[type(e)](self, e)

    def finish(self) -> None:
        """Requests still generating when the log ends end with it (at `t_end`)."""
        for name, span in self.under_way(self.t_end):
            self.workers[name].spans.append(span)
        self.outstanding.clear()

    def under_way(self, now: float) -> list[tuple[str, Span]]:
        """The requests still generating, each as its worker's span up to `now`."""
        return [(name, _request_span(d, now)) for (name, _, _), d in self.outstanding.items()]

    def worker(self, name: str, role: str, t: float) -> WorkerUsage:
        w = self.workers.get(name)
        if w is None:
            w = self.workers[name] = WorkerUsage(name, role, t, self.t_end)
        return w

    def resumed(self, last_t: float) -> None:
        """The controller crashed at its last event (`last_t`): what it had under way ended
        there. Its workers went with it; those of the resumed run join again."""
        for (name, _, _), d in self.outstanding.items():
            self.workers[name].spans.append(_request_span(d, last_t, lost=True))
        for w in self.workers.values():
            w.end = min(w.end, max(last_t, w.start))
        self.outstanding.clear()
        self.sync_started.clear()

    def joined(self, e: WorkerJoined) -> None:
        w = self.worker(e.worker, e.role, e.t)
        w.role, w.end = e.role, self.t_end  # a worker back after dying: its downtime is idle

    def died(self, e: WorkerDied) -> None:
        w = self.worker(e.worker, "?", self.t_start)
        w.end = e.t
        for key in [k for k in self.outstanding if k[0] == e.worker]:
            w.spans.append(_request_span(self.outstanding.pop(key), e.t, lost=True))

    def restarted(self, e: WorkerRestarted) -> None:
        self.worker(e.worker, e.role, e.t).restarts = e.restarts

    def trained(self, e: MicroBatchTrained) -> None:
        span = Span(e.t - e.seconds, e.t, TRAIN, f"{e.agent} v{e.version} micro-batch",
                    {"agent": e.agent, "version": e.version, "samples": e.n})
        self.worker(e.trainer, "trainer", span.start).spans.append(span)
        self.trainer_of[e.agent] = e.trainer

    def stepped(self, e: OptimizerStep) -> None:
        self.worker(e.trainer, "trainer", e.t).spans.append(
            Span(e.t, e.t, STEP, f"{e.agent} step -> v{e.version}", {"samples": e.samples}))
        self.trainer_of[e.agent] = e.trainer

    def sync_began(self, e: WeightSyncStarted) -> None:
        self.sync_started[(e.agent, e.version)] = e

    def synced(self, e: WeightSyncFinished) -> None:
        started = self.sync_started.pop((e.agent, e.version), None)
        start = started.t if started else e.t - e.seconds
        span = Span(start, e.t, SYNC, f"{e.agent} weights v{e.version}", {"bytes": e.nbytes})
        publishers = [self.trainer_of[e.agent]] if e.agent in self.trainer_of else []
        for name in publishers + (started.targets if started else []):
            self.worker(name, "trainer" if name in publishers else "rollout", start).spans.append(span)


# What UsageReader does with each event type it reads besides requests sent and answered
# (and a RunResumed, which ends what was under way); every other type only moves the clock.
_USAGE_READERS: dict[type, Callable[[UsageReader, Any], None]] = {
    WorkerJoined: UsageReader.joined, WorkerDied: UsageReader.died, WorkerRestarted: UsageReader.restarted,
    MicroBatchTrained: UsageReader.trained, OptimizerStep: UsageReader.stepped,
    WeightSyncStarted: UsageReader.sync_began, WeightSyncFinished: UsageReader.synced}
USAGE_EVENTS = frozenset({RequestsDispatched, RequestsCompleted, RunResumed, *_USAGE_READERS})


def _request_span(d: RequestsDispatched, end: float, tokens: int | None = None,
                  lost: bool = False) -> Span:
    args = {"agent": d.agent, "request_id": d.request_id, "samples": d.parts.count,
            "prompt_tokens": d.tokens}
    if tokens is not None:
        args["output_tokens"] = tokens
    if lost:
        args["lost"] = True  # the worker died with it outstanding
    return Span(d.t, end, GENERATE, f"{d.agent} generate", args)


def _agent_stats(events: list, run: RunStarted | None) -> dict[str, AgentStats]:
    """From the log's `_AGENT_EVENTS` (without what a resume undid)."""
    agents = {a: AgentStats(a) for a in (run.agents if run else [])}
    reader = _AgentReader()
    completed: dict[str, list[RequestsCompleted]] = collections.defaultdict(list)
    for e in events:
        stats = agents.get(e.agent)
        if stats is None:
            if e.agent is None:
                continue
            stats = agents[e.agent] = AgentStats(e.agent)
        kind = type(e)
        # Groups and requests completed, most of a long log, are read here rather than by
        # a method call each.
        if kind is GroupComplete:
            stats.rewards += e.rewards
        elif kind is RequestsCompleted:
            completed[e.agent].append(e)  # their prompt counts are summed at the end
        else:
            _AGENT_READERS[kind](reader, stats, e)
    for agent, requests in completed.items():
        agents[agent].prompts.update({name: sum(map(attrgetter(name), requests)) for name in PROMPT_FIELDS})
    return agents


class _AgentReader:
    """What `_agent_stats` keeps while it reads the log: when each iteration and weight
    sync began. One method per event type it reads besides groups and requests completed
    (`_AGENT_READERS`)."""

    def __init__(self) -> None:
        self.iteration_start: dict[tuple[str, int], float] = {}
        self.sync_start: dict[tuple[str, int], float] = {}

    def formed(self, stats: AgentStats, e: MicroBatchFormed) -> None:
        self.iteration_start.setdefault((stats.agent, e.version), e.t)

    def trained(self, stats: AgentStats, e: MicroBatchTrained) -> None:
        stats.micro_batches += 1

    def stepped(self, stats: AgentStats, e: OptimizerStep) -> None:
        stats.samples_trained += e.samples
        stats.optimizer_steps += 1
        stats.version = max(stats.version, e.version)
        start = self.iteration_start.pop((stats.agent, e.version), e.t)
        stats.spans.append(Span(start, e.t, ITERATION, f"train -> v{e.version}",
                                {"samples": e.samples, "trainer": e.trainer}))

    def allocation(self, stats: AgentStats, e: AllocationChanged) -> None:
        if e.kind == "trainer" and e.swap == "in":
            stats.swap_ins += 1
            stats.swap_wait_s += e.waited_s

    def sync_began(self, stats: AgentStats, e: WeightSyncStarted) -> None:
        self.sync_start[(stats.agent, e.version)] = e.t

    def synced(self, stats: AgentStats, e: WeightSyncFinished) -> None:
        start = self.sync_start.pop((stats.agent, e.version), e.t - e.seconds)
        stats.spans.append(Span(start, e.t, SYNC, f"sync v{e.version}", {"bytes": e.nbytes}))


# What _agent_stats does with each event type it reads.
_AGENT_READERS: dict[type, Callable[[_AgentReader, AgentStats, Any], None]] = {
    MicroBatchFormed: _AgentReader.formed, MicroBatchTrained: _AgentReader.trained,
    OptimizerStep: _AgentReader.stepped, AllocationChanged: _AgentReader.allocation,
    WeightSyncStarted: _AgentReader.sync_began, WeightSyncFinished: _AgentReader.synced}
_AGENT_EVENTS = frozenset({GroupComplete, RequestsCompleted, *_AGENT_READERS})


# The event types each part of the summary reads (`_route`): a worker's spans, an agent's
# statistics, the sample accounting, the steps left open (what `open_steps` reads),
# training time, and whether the lineage differs from the log.
_READS = {"usage": USAGE_EVENTS, "agents": _AGENT_EVENTS, "accounting": ACCOUNTED_EVENTS,
          "steps": frozenset({RunStarted, GroupOpened, OptimizerStep}), "marks": TRAINING_MARKS,
          "undoing": UNDOING}



# ---------------------------------------------------------------- text


@collector.paused()  # makes thousands of objects (a worker's spans sorted), none in a cycle
def format_summary(s: Summary) -> str:
    head = f"run: {s.wall_s:.1f} s ({s.training_s:.1f} s training), {s.events} events"
    if s.run:
        head += (f", mode {s.run.mode}, max_staleness {s.run.max_staleness}, seed {s.run.seed}, "
                 f"agents {', '.join(s.run.agents)}")
    if s.resumed_at:
        head += (f"; resumed from the checkpoint of step {', '.join(map(str, s.resumed_at))} (work logged past "
                 "it before the resume is not counted)")
    if s.open_steps:
        head += ("\nthe log ends mid-step (the run stopped before these steps were taken; their samples are in "
                 "flight): " + "; ".join(f"{a} step {', '.join(map(str, b))}" for a, b in s.open_steps.items()))
    out = [head]
    out.append(_table(["worker", "role", "busy s", "idle s", "util", "restarts"],
                      [[w.worker, w.role, *_worker_times(w), w.restarts]
                       for w in sorted(s.workers.values(), key=lambda w: (w.role, w.worker))], left=2))
    out.append(_table(["agent", "samples", "samples/s", "micro-batches", "steps", "version", "reward",
                       "prefix hits", "turn prefix hits", "swap-ins/step", "swap wait s"],
                      [[a.agent, a.samples_trained,
                        f"{a.samples_trained / s.training_s:.2f}" if s.training_s > 0 else "-",
                        a.micro_batches, a.optimizer_steps, a.version,
                        f"{sum(a.rewards) / len(a.rewards):.3f}" if a.rewards else "-",
                        _share(a.hit_rate()), _share(a.hit_rate(later=True)),
                        f"{a.swap_ins_per_step:.2f}", f"{a.swap_wait_s:.2f}"]
                       for a in s.agents.values()]))
    lags = sorted({lag for h in s.staleness.values() for lag in h})
    if lags:
        out.append("staleness: trained samples per lag (policy versions behind the trainer)\n" + _table(
            ["agent"] + [f"lag {lag}" for lag in lags],
            [[a] + [h.get(lag, 0) for lag in lags] for a, h in sorted(s.staleness.items())]))
    rows = sorted(s.accounting, key=lambda r: (r.agent, r.total))  # stable: versions, then total
    out.append("sample accounting: generated = trained + dropped + in flight\n" + _table(
        ["agent", "version", "generated", "trained", "dropped", "in flight", ""],
        [[r.agent, "total" if r.total else "-" if r.version is None else r.version,
          r.generated, r.trained, r.dropped, r.in_flight, "" if r.reconciles else "MISMATCH"]
         for r in rows]))
    return "\n\n".join(out)


def _worker_times(w: WorkerUsage) -> list[str]:
    busy, idle, utilization = w.times()
    return [f"{busy:.2f}", f"{idle:.2f}", f"{utilization:.0%}"]


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _table(headers: list[str], rows: list[list], left: int = 1) -> str:
    """Plain text columns: the first `left` columns left-aligned, the rest right-aligned."""
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------- trace and plot


def trace_json(s: Summary) -> dict:
    """Chrome trace-event JSON (Perfetto opens it): a process per role, a thread per worker
    and per agent, "X" complete events in microseconds since the run started."""
    groups = {"rollout": (1, "rollout workers"), "trainer": (2, "trainer workers")}
    agents_pid, other_pid = 3, 4
    events: list[dict] = []
    named: set[int] = set()

    def meta(name: str, pid: int, tid: int, args: dict) -> None:
        events.append({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})

    def track(pid: int, pname: str, tid: int, tname: str) -> None:
        if pid not in named:
            named.add(pid)
            meta("process_name", pid, 0, {"name": pname})
        meta("thread_name", pid, tid, {"name": tname})
        meta("thread_sort_index", pid, tid, {"sort_index": tid})

    def spans(pid: int, tid: int, spans: list[Span]) -> None:
        for sp in spans:
            events.append({"ph": "X", "name": sp.name, "cat": sp.kind, "pid": pid, "tid": tid,
                           "ts": _us(sp.start - s.t_start), "dur": _us(sp.end - sp.start),
                           "args": sp.args})

    for tid, w in enumerate(sorted(s.workers.values(), key=lambda w: (w.role, w.worker)), start=1):
        pid, pname = groups.get(w.role, (other_pid, "workers"))
        track(pid, pname, tid, w.worker)
        # Overlapping requests would not nest on one track; merge them into busy stretches.
        generating = [sp for sp in w.spans if sp.kind == GENERATE]
        spans(pid, tid, _merge_requests(generating) + [sp for sp in w.spans if sp.kind != GENERATE])
    for tid, a in enumerate(s.agents.values(), start=1):
        track(agents_pid, "agents", tid, a.agent)
        spans(agents_pid, tid, a.spans)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _merge_requests(spans: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for sp in sorted(spans, key=lambda sp: sp.start):
        if merged and sp.start <= merged[-1].end:
            m = merged[-1]
            m.end = max(m.end, sp.end)
            m.args["requests"] += 1
            m.args["samples"] += sp.args["samples"]
            m.name = "generate"
        else:
            merged.append(Span(sp.start, sp.end, GENERATE, sp.name,
                               {"requests": 1, "samples": sp.args["samples"]}))
    return merged


def write_trace(s: Summary, path: str | Path) -> None:
    Path(path).write_text(json.dumps(trace_json(s)))


def write_plot(s: Summary, path: str | Path) -> None:
    """A PNG: busy spans per worker over time (left) and utilization per worker (right)."""
    import matplotlib
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {GENERATE: "tab:blue", TRAIN: "tab:orange", SYNC: "tab:green"}
    workers = sorted(s.workers.values(), key=lambda w: (w.role, w.worker))
    fig, (ax, ax_util) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * max(1, len(workers))),
                                      gridspec_kw={"width_ratios": [4, 1]}, sharey=True)
    for row, w in enumerate(workers):
        for kind, color in colors.items():
            busy = union(((sp.start, sp.end) for sp in w.spans if sp.kind == kind), w.start, w.end)
            bars = [(a - s.t_start, b - a) for a, b in busy]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, label=kind if row == 0 else None)
        ax.hlines(row, w.start - s.t_start, w.end - s.t_start, colors="lightgrey", linewidth=0.5,
                  zorder=0)  # the worker's lifetime, so idle stretches show
    ax.set_yticks(range(len(workers)), [f"{w.worker} ({w.role})" for w in workers])
    ax.set_xlabel("seconds since the run started")
    ax.set_title("busy spans per worker", loc="left")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(colors), fontsize="small",
              frameon=False)
    ax.invert_yaxis()
    util = [100 * w.utilization for w in workers]
    ax_util.barh(range(len(workers)), util, color="tab:grey")
    for row, u in enumerate(util):
        ax_util.text(min(u, 75) + 2, row, f"{u:.0f}%", va="center", fontsize="small")
    ax_util.set_xlim(0, 100)
    ax_util.set_xlabel("busy %")
    ax_util.set_title("utilization")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def union(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of (start, end) intervals (a worker's spans': what counts as busy), clipped
    to [lo, hi], as sorted disjoint pairs."""
    out: list[tuple[float, float]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
