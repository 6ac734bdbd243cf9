"""The cluster as the event log tells it: each rollout instance's and trainer's busy and idle
time, on a timeline, and what happened to it (weight syncs, swaps, balancer moves, deaths,
restarts, checkpoints, resumes).

What counts as busy is the replay summary's rule (replay/summary.py): `UsageReader` makes
each worker's spans and busy time is their `union` over the worker's life. This module
feeds the reader the log a part at a time instead of all at once, and keeps what it made
small: after each part, a worker's new spans are merged, kind by kind, into the union of
its earlier ones (`WorkerBusy`; only the end of that union can meet new spans, so a long
run costs a pair of numbers per busy stretch and each part only its own work). A request
still under way counts as busy up to the log's last event.

Busy seconds between any two times come from prefix sums over a worker's intervals
(`busy_until`), so the timeline (a row per worker, a column per stretch of time, each
cell its busy share) costs the same zoomed in on a long run as over all of it.
"""

from __future__ import annotations

import base64
import bisect
from typing import Any, Sequence

import numpy as np

from flexmarl.runtime.events import (
    AllocationChanged,
    CheckpointWritten,
    Event,
    RebalanceDecided,
    RunFinished,
    RunResumed,
    RunStarted,
    TrainingRestored,
    WeightSyncFinished,
    WeightSyncStarted,
    WorkerDied,
    WorkerRestarted,
)

from ..replay.summary import TRAINING_MARKS, USAGE_EVENTS, Span, UsageReader, crash_times, training_time, union


class WorkerBusy:
    """One worker's busy intervals: per kind of span the union of those read so far (sorted,
    disjoint), and over all kinds the union with the busy seconds before each interval."""

    def __init__(self) -> None:
        self.kinds: dict[str, list[tuple[float, float]]] = {}
        self._all: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add(self, spans: list[Span]) -> None:
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for sp in spans:
            if sp.end > sp.start:  # an instant (an optimizer step's mark) adds no busy time
                by_kind.setdefault(sp.kind, []).append((sp.start, sp.end))
        for kind, new in by_kind.items():
            old = self.kinds.setdefault(kind, [])
            # Disjoint and sorted, so their ends are sorted: the ones a new span can touch are at the end.
            keep = bisect.bisect_left(old, min(a for a, _ in new), key=lambda pair: pair[1])
            old[keep:] = union(old[keep:] + new, -np.inf, np.inf)
        if by_kind:
            self._all = None

    def intervals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Over all kinds: the busy intervals' starts and ends, and the busy seconds before each."""
        if self._all is None:
            pairs = union((pair for kind in self.kinds.values() for pair in kind), -np.inf, np.inf)
            starts = np.array([a for a, _ in pairs], dtype=np.float64)
            ends = np.array([b for _, b in pairs], dtype=np.float64)
            self._all = starts, ends, np.concatenate(([0.0], np.cumsum(ends - starts)[:-1])) if pairs else ends
        return self._all

    def until(self, times: np.ndarray, under_way: Sequence[Span] = ()) -> np.ndarray:
        """At each of `times`, the busy seconds so far; with `under_way`, spans not yet read
        into it (requests still generating), counted where they add to it."""
        starts, ends, before = self.intervals()
        busy = busy_until(times, starts, ends, before)
        for a, b in union(((sp.start, sp.end) for sp in under_way), -np.inf, np.inf):
            inside = np.clip(times, a, b)  # |this one up to t| minus what of it is busy already
            busy = busy + (inside - a) - (busy_until(inside, starts, ends, before) - busy_until(np.array([a]), starts, ends, before))
        return busy


class ClusterView:
    """`read(events)` takes the log a part at a time, in order. `workers()` is each worker's
    busy and idle time so far, `grid(...)` the timeline, `happenings` the list of what
    happened, oldest first."""

    def __init__(self) -> None:
        self.usage = UsageReader(0.0)
        self.busy: dict[str, WorkerBusy] = {}
        self.t_start: float | None = None
        self.last_t = 0.0
        self.marks: list[Event] = []  # TRAINING_MARKS, for training_time
        self.crashed_at: list[float] = []
        self.happenings: list[dict[str, Any]] = []
        self.finished = False
        self._sync_started: dict[tuple[str, int], WeightSyncStarted] = {}
        # every weight sync, as columns: the agent's index in `sync_agents`, its version, seconds, bytes
        self.sync_agents: list[str] = []
        self.syncs: dict[str, list[Any]] = {"agent": [], "version": [], "seconds": [], "bytes": []}

    def read(self, events: list[Event]) -> None:
        if not events:
            return
        if self.t_start is None:
            first = next((e for e in events if type(e) is RunStarted), events[0])
            self.t_start = self.usage.t_start = first.t
        crashes = crash_times(events, self.last_t)
        self.crashed_at += crashes
        self.usage.read([e for e in events if type(e) in USAGE_EVENTS], iter(crashes))
        self.marks += [e for e in events if type(e) in TRAINING_MARKS]
        for e in events:
            note = _NOTES.get(type(e))
            if note is not None:
                note(self, e)
        self.last_t = events[-1].t
        for name, w in self.usage.workers.items():
            if w.spans:  # the reader only appends to them: what it made is taken over here
                self.busy.setdefault(name, WorkerBusy()).add(w.spans)
                w.spans.clear()

    @property
    def training_s(self) -> float:
        return training_time(self.marks, iter(self.crashed_at), self.last_t)

    def _ordered(self) -> list[Any]:
        return sorted(self.usage.workers.values(), key=lambda w: (w.role, w.worker))

    def workers(self) -> list[dict[str, Any]]:
        """Per worker, sorted by role and name: busy and idle seconds over its life so far
        (`WorkerUsage.times`'s figures), utilization, restarts, and whether it is alive at
        the end of what was read."""
        now, rows = self.last_t, []
        under_way = self._under_way()
        for w in self._ordered():
            lo, hi = w.start, min(w.end, now)
            life = hi - lo
            busy = 0.0
            if life > 0:
                at = self.busy.get(w.worker, WorkerBusy()).until(np.array([lo, hi]), under_way.get(w.worker, []))
                busy = float(at[1] - at[0])
            rows.append({"worker": w.worker, "role": w.role, "busy_s": round(busy, 3),
                         "idle_s": round(max(0.0, life - busy), 3),
                         "utilization": round(busy / life, 4) if life > 0 else 0.0, "restarts": w.restarts,
                         "alive": w.end > now})
        return rows

    def _under_way(self) -> dict[str, list[Span]]:
        """Per worker, its requests still generating, as spans up to the last event."""
        found: dict[str, list[Span]] = {}
        for name, span in self.usage.under_way(self.last_t):
            found.setdefault(name, []).append(span)
        return found

    def grid(self, t0: float | None = None, t1: float | None = None, columns: int = 200) -> dict[str, Any]:
        """The timeline between t0 and t1 (seconds since the run started; default: all of
        it): per worker (as `workers()` orders them) a row of `columns` busy shares, 0-255."""
        start = self.t_start or 0.0
        lo = start + (t0 if t0 is not None else 0.0)
        hi = start + (t1 if t1 is not None else self.last_t - start)
        columns = max(1, min(columns, 2000))
        hi = max(hi, lo + 1e-6)
        edges = np.linspace(lo, hi, columns + 1)
        under_way = self._under_way()
        workers = self._ordered()
        grid: np.ndarray = np.zeros((len(workers), columns), dtype=np.uint8)
        for row, w in enumerate(workers):
            # Busy only within its life, as the figures count it.
            clipped = np.clip(edges, w.start, max(w.start, min(w.end, self.last_t)))
            busy = np.diff(self.busy.get(w.worker, WorkerBusy()).until(clipped, under_way.get(w.worker, [])))
            grid[row] = np.clip(np.round(255 * busy / np.diff(edges)), 0, 255)
        return {"t0": lo - start, "t1": hi - start, "columns": columns,
                "workers": [{"worker": w.worker, "role": w.role} for w in workers],
                "busy": base64.b64encode(grid.tobytes()).decode()}

    # ------------------------------------------------------------ what happened

    def _note(self, e: Event, kind: str, who: str, what: str, seconds: float | None = None) -> None:
        self.happenings.append({"t": round(e.t - (self.t_start or 0.0), 3), "kind": kind, "who": who,
                                "what": what, "seconds": None if seconds is None else round(seconds, 3)})

    def _sync_began(self, e: WeightSyncStarted) -> None:
        self._sync_started[(e.agent, e.version)] = e

    def _synced(self, e: WeightSyncFinished) -> None:
        began = self._sync_started.pop((e.agent, e.version), None)
        to = f" to {len(began.targets)} instance{'s' if len(began.targets) != 1 else ''}" if began else ""
        over = f" over {began.transport}" if began is not None and began.transport else ""
        self._note(e, "sync", e.agent, f"v{e.version}{to}{over}, {e.nbytes / 1e6:.1f} MB", e.seconds)
        if e.agent not in self.sync_agents:
            self.sync_agents.append(e.agent)
        for column, value in (("agent", self.sync_agents.index(e.agent)), ("version", e.version),
                              ("seconds", round(e.seconds, 4)), ("bytes", e.nbytes)):
            self.syncs[column].append(value)

    def _allocated(self, e: AllocationChanged) -> None:
        if e.swap:
            waited = f", its work waited {e.waited_s:.2f} s" if e.waited_s else ""
            self._note(e, "swap", e.agent, f"{e.swap} on {', '.join(e.workers) or '-'}{waited}", e.seconds)
        elif e.kind == "rollout":
            self._note(e, "placement", e.agent, f"{len(e.workers)} instances: {e.why}", e.seconds or None)
        else:
            self._note(e, "placement", e.agent, f"trainer {', '.join(e.workers) or '-'}: {e.why}", e.seconds or None)

    def _moved(self, e: RebalanceDecided) -> None:
        self._note(e, "move", f"{e.src} -> {e.dst}", f"{', '.join(e.instances)}: {e.why}")

    def _died(self, e: WorkerDied) -> None:
        self._note(e, "death", e.worker, e.why)

    def _restarted(self, e: WorkerRestarted) -> None:
        code = "" if e.exit_code is None else f" (exit code {e.exit_code})"
        self._note(e, "restart", e.worker, f"restart {e.restarts}{code}{': ' + e.why if e.why else ''}")

    def _checkpoint(self, e: CheckpointWritten) -> None:
        self._note(e, "checkpoint", f"step {e.step}", f"{e.nbytes / 1e6:.1f} MB at {e.path}", e.seconds)

    def _resumed(self, e: RunResumed) -> None:
        self.finished = False
        self._note(e, "resume", f"step {e.step}", f"resumed from {e.checkpoint}")

    def _restored(self, e: TrainingRestored) -> None:
        self._note(e, "restore", e.agent, f"restored at v{e.version}, batch {e.batch} on trained again: {e.why}")

    def _finished(self, e: RunFinished) -> None:
        self.finished = True
        self._note(e, "finish", f"{e.steps} steps", f"{e.wall_s:.1f} s of training")


# What ClusterView notes of each event type (besides the usage the summary's reader takes).
_NOTES: dict[type, Any] = {
    WeightSyncStarted: ClusterView._sync_began, WeightSyncFinished: ClusterView._synced,
    AllocationChanged: ClusterView._allocated, RebalanceDecided: ClusterView._moved, WorkerDied: ClusterView._died,
    WorkerRestarted: ClusterView._restarted, CheckpointWritten: ClusterView._checkpoint,
    RunResumed: ClusterView._resumed, TrainingRestored: ClusterView._restored, RunFinished: ClusterView._finished}
HAPPENINGS = ("sync", "swap", "placement", "move", "death", "restart", "checkpoint", "resume", "restore", "finish")


def busy_until(times: np.ndarray, starts: np.ndarray, ends: np.ndarray, before: np.ndarray) -> np.ndarray:
    """At each of `times`, the busy seconds so far, of disjoint sorted intervals `starts` to
    `ends` with `before` the busy seconds ahead of each."""
    if len(starts) == 0:
        return np.zeros(len(times))
    i = np.searchsorted(starts, times, side="right") - 1
    inside = np.clip(times - starts[np.maximum(i, 0)], 0.0, ends[np.maximum(i, 0)] - starts[np.maximum(i, 0)])
    return np.where(i >= 0, before[np.maximum(i, 0)] + inside, 0.0)
