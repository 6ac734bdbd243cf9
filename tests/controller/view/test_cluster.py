"""controller/view/cluster.py: the workers' busy and idle time, read a part of the log at a
time, is the replay summary's; the timeline's grid; what happened, in words."""

import base64
import random

import numpy as np
import pytest

from flexmarl.controller.replay import summarize
from flexmarl.controller.replay.summary import Span, union
from flexmarl.controller.view.cluster import ClusterView, WorkerBusy, busy_until
from flexmarl.runtime import events as ev
from flexmarl.runtime.keys import GroupKey


def a_log(seed=0, requests=400):
    """A log with everything the usage rules read: overlapping requests on two instances,
    one lost when its instance dies (and restarts), micro-batches, steps and weight syncs,
    then a controller crash and a resume whose requests are left outstanding."""
    rng = random.Random(seed)
    out, t = [], 0.0

    def at(e, dt=0.01):
        nonlocal t
        t += dt
        e.t = t
        out.append(e)

    at(ev.RunStarted("", ["a"], "async", 1, 0))
    for w in ("r0", "r1"):
        at(ev.WorkerJoined(w, "rollout", "h", 1))
    at(ev.WorkerJoined("t0", "trainer", "h", 1))
    at(ev.BatchStarted(1, 0))
    open_requests = []
    for i in range(requests):
        worker = rng.choice(["r0", "r1"])
        at(ev.RequestsDispatched(worker, "a", i, 4, ev.Parts([GroupKey("e", "a", f"g{i}")], [0], [1])), rng.random() * 0.05)
        open_requests.append((worker, i))
        if rng.random() < 0.6 and open_requests:
            w, j = open_requests.pop(rng.randrange(len(open_requests)))
            at(ev.RequestsCompleted(w, "a", j, [0], 3, parts=ev.Parts([GroupKey("e", "a", f"g{j}")], [0], [1])),
               rng.random() * 0.05)
        if i == requests // 3:
            at(ev.WorkerDied("r1", "killed"))
            at(ev.WorkerRestarted("r1", "rollout", -9, 1, 2, why="killed"))
            at(ev.WorkerJoined("r1", "rollout", "h", 2))
            open_requests = [(w, j) for w, j in open_requests if w != "r1"]
        if i % 50 == 49:
            at(ev.MicroBatchTrained("a", "t0", i // 50 + 1, 8, 0.2))
            at(ev.OptimizerStep("a", "t0", i // 50 + 1, 8))
            at(ev.WeightSyncStarted("a", i // 50 + 1, ["r0", "r1"], "shm"))
            at(ev.WeightSyncFinished("a", i // 50 + 1, 0.05, 1000), 0.05)
    at(ev.RunResumed(2, "checkpoints/step-000002", ""), 1.0)
    for w in ("r0", "r1"):
        at(ev.WorkerJoined(w, "rollout", "h", 3))
    at(ev.BatchStarted(3, 100))
    at(ev.RequestsDispatched("r0", "a", 9999, 4, ev.Parts([GroupKey("e", "a", "x")], [0], [1])), 0.5)
    for i, e in enumerate(out):
        e.seq = i
    return out


@pytest.mark.parametrize("part", [1, 7, 100, 10**6])
def test_busy_and_idle_read_a_part_at_a_time_are_the_replay_summarys(part):
    events = a_log()
    view = ClusterView()
    for i in range(0, len(events), part):
        view.read(events[i:i + part])
    summary = summarize(events)
    mine = {w["worker"]: (w["busy_s"], w["idle_s"], w["restarts"]) for w in view.workers()}
    # the summary ends a request still outstanding at the log's last event; so does the view
    assert mine == {name: (round(u.busy_s, 3), round(u.idle_s, 3), u.restarts) for name, u in summary.workers.items()}
    assert view.training_s == pytest.approx(summary.training_s)
    assert all(not u.spans for u in view.usage.workers.values())  # taken over: a pair per busy stretch is kept


def test_a_workers_busy_intervals_grow_by_merging_new_spans_into_the_end_of_the_union():
    rng = random.Random(1)
    spans = []
    for i in range(500):
        start = i * 0.1 + rng.random() * 0.5 - (3.0 if i % 97 == 0 else 0.0)  # now and then one that reaches back
        spans.append(Span(start, start + rng.random() * 0.3, rng.choice(["generate", "sync"]), "x"))
    spans.append(Span(7.0, 7.0, "step", "x"))  # an instant: no busy time
    busy = WorkerBusy()
    for i in range(0, len(spans), 37):
        busy.add(spans[i:i + 37])
    for kind in ("generate", "sync"):
        assert busy.kinds[kind] == union(((s.start, s.end) for s in spans if s.kind == kind), -np.inf, np.inf)
    assert "step" not in busy.kinds
    starts, ends, _ = busy.intervals()
    assert list(zip(starts, ends)) == union(((s.start, s.end) for s in spans), -np.inf, np.inf)
    under_way = [Span(49.0, 60.0, "generate", "x"), Span(55.0, 58.0, "generate", "x")]
    expected = sum(b - a for a, b in union(((s.start, s.end) for s in spans + under_way), -np.inf, 60.0))
    assert busy.until(np.array([60.0]), under_way)[0] == pytest.approx(expected)


G = GroupKey("e", "a", "g")


def test_the_grid_is_each_workers_busy_share_of_each_stretch():
    events = [ev.RunStarted("", ["a"], "sync", 0, 0), ev.WorkerJoined("r0", "rollout", "h", 1),
              ev.RequestsDispatched("r0", "a", 1, 1, ev.Parts([G], [0], [1])),
              ev.RequestsCompleted("r0", "a", 1, [0], 1, parts=ev.Parts([G], [0], [1])),
              ev.RunFinished(1, 4.0)]
    for i, (e, t) in enumerate(zip(events, [0.0, 0.0, 1.0, 2.5, 4.0])):
        e.seq, e.t = i, t
    view = ClusterView()
    view.read(events)
    grid = view.grid(columns=4)
    assert grid["workers"] == [{"worker": "r0", "role": "rollout"}] and (grid["t0"], grid["t1"]) == (0.0, 4.0)
    assert list(base64.b64decode(grid["busy"])) == [0, 255, 128, 0]
    zoomed = view.grid(t0=1.0, t1=2.0, columns=2)
    assert list(base64.b64decode(zoomed["busy"])) == [255, 255]


def test_busy_until_counts_the_seconds_of_disjoint_intervals_up_to_each_time():
    starts, ends = np.array([1.0, 5.0]), np.array([2.0, 8.0])
    before = np.array([0.0, 1.0])
    assert busy_until(np.array([0.0, 1.5, 3.0, 6.0, 10.0]), starts, ends, before).tolist() == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert busy_until(np.array([1.0, 2.0]), np.zeros(0), np.zeros(0), np.zeros(0)).tolist() == [0.0, 0.0]


def test_what_happened_is_told_in_words_oldest_first():
    events = [ev.RunStarted("", ["a"], "sync", 0, 0),
              ev.WeightSyncStarted("a", 1, ["r0", "r1"], "tcp"), ev.WeightSyncFinished("a", 1, 0.25, 2_000_000),
              ev.AllocationChanged("trainer", "a", ["t0"], "ready work", swap="in", seconds=1.5, waited_s=0.5),
              ev.RebalanceDecided(["r1"], "a", "b", "disparity 6.0 > 5"),
              ev.WorkerDied("r1", "connection lost"), ev.WorkerRestarted("r1", "rollout", -9, 1, 77),
              ev.CheckpointWritten(1, "checkpoints/step-000001", 3_000_000, 0.5), ev.RunFinished(1, 9.0)]
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    view = ClusterView()
    view.read(events)
    said = [(h["kind"], h["who"], h["what"], h["seconds"]) for h in view.happenings]
    assert said == [("sync", "a", "v1 to 2 instances over tcp, 2.0 MB", 0.25),
                    ("swap", "a", "in on t0, its work waited 0.50 s", 1.5),
                    ("move", "a -> b", "r1: disparity 6.0 > 5", None),
                    ("death", "r1", "connection lost", None),
                    ("restart", "r1", "restart 1 (exit code -9)", None),
                    ("checkpoint", "step 1", "3.0 MB at checkpoints/step-000001", 0.5),
                    ("finish", "1 steps", "9.0 s of training", None)]
    assert view.finished
