"""Across a resume, the log's accounting counts the run that the final weights come from."""

import pytest

from flexmarl.controller import replay
from flexmarl.controller.replay.lineage import lineage
from flexmarl.controller.replay.redrive import episode_assignments
from flexmarl.runtime import events as ev
from flexmarl.runtime.keys import GroupKey


def key(agent, b):
    return GroupKey(f"s{b}q0", agent, "0")


def batch(agent, b, version_made):
    """One group of two samples of batch `b`, generated, completed, trained into version b."""
    g = key(agent, b)
    parts = ev.Parts([g], [0], [2])
    return [ev.GroupOpened(g, b, 2), ev.RequestsDispatched("r0", agent, b, 4, parts),
            ev.RequestsCompleted("r0", agent, b, [version_made], 6, parts=parts),
            ev.GroupComplete(g, [1.0, 0.0]),
            ev.MicroBatchFormed(agent, "t0", b, parts, [version_made] * 2),
            ev.MicroBatchTrained(agent, "t0", b, 2, 0.01),
            ev.OptimizerStep(agent, "t0", b, 2)]


def stamped(events):
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    return events


START = ev.RunStarted("[pipeline]\nmicro_batch = 2\n", ["a"], "sync", 0, 0)


def test_a_resume_undoes_the_crashed_segments_work_past_the_checkpoint():
    crashed = [START, *batch("a", 1, 0), *batch("a", 2, 1), *batch("a", 3, 2)[:5]]
    resumed = [ev.RunResumed(2, "ckpt/step-000002", ""), *batch("a", 3, 2), *batch("a", 4, 3)]
    log = stamped(crashed + resumed)
    kept = lineage(log)
    assert [e.version for e in kept if isinstance(e, ev.OptimizerStep)] == [1, 2, 3, 4]
    opened = [e.key for e in kept if isinstance(e, ev.GroupOpened)]
    assert opened == [key("a", b) for b in (1, 2, 3, 4)]  # batch 3 once: the redo
    summary = replay.summarize(log)
    assert summary.errors == []
    total = [r for r in summary.accounting if r.total][0]
    assert (total.generated, total.trained, total.dropped, total.in_flight) == (8, 8, 0, 0)


def test_without_the_resume_marker_the_redone_batch_counts_twice():
    crashed = [START, *batch("a", 1, 0), *batch("a", 2, 1), *batch("a", 3, 2)[:5]]
    log = stamped(crashed + batch("a", 3, 2))
    errors = replay.summarize(log).errors
    assert any("opened twice" in e for e in errors) and any("trained twice" in e for e in errors)


def test_a_request_shared_by_work_before_and_past_the_checkpoint_is_cut_per_part():
    parts = ev.Parts([key("a", 2), key("a", 3)], [0, 0], [1, 1])
    log = stamped([START, ev.GroupOpened(key("a", 2), 2, 1), ev.GroupOpened(key("a", 3), 3, 1),
                   ev.RequestsDispatched("r0", "a", 7, 4, parts),
                   ev.RequestsCompleted("r0", "a", 7, [1, 2], 4, parts=parts), ev.RunResumed(2, "ckpt", "")])
    kept = lineage(log)
    completed = [e for e in kept if isinstance(e, ev.RequestsCompleted)]
    assert [(e.parts, e.versions) for e in completed] == [(ev.Parts([key("a", 2)], [0], [1]), [1])]
    dispatched = [e for e in kept if isinstance(e, ev.RequestsDispatched)]
    assert [e.parts for e in dispatched] == [ev.Parts([key("a", 2)], [0], [1])]


CONTINUOUS = ev.RunStarted('[run]\nsteps = 2\n[pipeline]\nmicro_batch = 2\nqueries_per_step = 1\n'
                           'admission = "continuous"\n', ["a"], "async", 1, 0)


def episode(name, started, version_made):
    """One episode of one group of two samples, started as one of batch `started`'s, up to its end."""
    g = GroupKey(name, "a", "0")
    parts = ev.Parts([g], [0], [2])
    return [ev.GroupOpened(g, started, 2), ev.RequestsDispatched("r0", "a", started, 4, parts),
            ev.RequestsCompleted("r0", "a", started, [version_made], 6, parts=parts), ev.GroupComplete(g, [1.0, 0.0])]


def trained(name, b, version_made):
    parts = ev.Parts([GroupKey(name, "a", "0")], [0], [2])
    return [ev.MicroBatchFormed("a", "t0", b, parts, [version_made] * 2), ev.MicroBatchTrained("a", "t0", b, 2, 0.01),
            ev.OptimizerStep("a", "t0", b, 2)]


def test_under_continuous_admission_a_resume_keeps_an_episode_by_the_batch_that_trained_it():
    # s2q0 ended first and batch 1 trained it; s1q0 was still running at the checkpoint of
    # step 1 (carried over): the resumed run begins it again and batch 2 trains it.
    crashed = [CONTINUOUS, *episode("s1q0", 1, 0)[:3], *episode("s2q0", 2, 0),
               ev.EpisodeAssigned("s2q0", 2, 1), *trained("s2q0", 1, 0)]
    resumed = [ev.RunResumed(1, "ckpt/step-000001", CONTINUOUS.config_toml), *episode("s1q0", 1, 1),
               ev.EpisodeAssigned("s1q0", 1, 2), *trained("s1q0", 2, 1)]
    log = stamped(crashed + resumed)
    kept = lineage(log)
    assert [e.key.episode for e in kept if isinstance(e, ev.GroupOpened)] == ["s2q0", "s1q0"]  # each once
    assert [(e.episode, e.batch) for e in kept if isinstance(e, ev.EpisodeAssigned)] == [("s2q0", 1), ("s1q0", 2)]
    assert [(e.episode, e.batch) for e in episode_assignments(kept)
            if isinstance(e, ev.EpisodeAssigned)] == [("s2q0", 1), ("s1q0", 2)]  # re-derived
    summary = replay.summarize(log)
    assert summary.errors == []
    total = [r for r in summary.accounting if r.total][0]
    assert (total.generated, total.trained, total.dropped, total.in_flight) == (4, 4, 0, 0)
