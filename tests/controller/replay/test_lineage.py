"""Across a resume, the log's accounting counts the run that the final weights come from."""

import pytest

from flexmarl.controller import replay
from flexmarl.controller.replay.lineage import lineage
from flexmarl.runtime import events as ev


def batch(agent, b, version_made, compact=False):
    """One group of two samples of batch `b`, generated, completed, trained into version b;
    `compact`: its samples named by the group (log format 2), not listed (format 1)."""
    g = f"s{b}q0/{agent}"
    ids = [f"{g}/0", f"{g}/1"]
    if compact:
        parts = ev.Parts([g], [0], [2])
        opened = [ev.GroupOpened(agent, g, [], b, 2), ev.RequestsDispatched("r0", agent, b, [], 4, parts),
                  ev.RequestsCompleted("r0", agent, b, [], [version_made], 6, parts=parts)]
    else:
        opened = [ev.GroupOpened(agent, g, ids, b), ev.RequestsDispatched("r0", agent, b, ids, 4),
                  ev.RequestsCompleted("r0", agent, b, ids, [version_made] * 2, 6)]
    return [*opened,
            ev.GroupComplete(agent, g, [1.0, 0.0]),
            ev.MicroBatchFormed(agent, "t0", b, ids, [version_made] * 2),
            ev.MicroBatchTrained(agent, "t0", b, 2, 0.01),
            ev.OptimizerStep(agent, "t0", b, 2)]


def stamped(events):
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    return events


START = ev.RunStarted("[pipeline]\nmicro_batch = 2\n", ["a"], "sync", 0, 0)


@pytest.mark.parametrize("compact", [False, True])
def test_a_resume_undoes_the_crashed_segments_work_past_the_checkpoint(compact):
    crashed = [START, *batch("a", 1, 0, compact), *batch("a", 2, 1, compact), *batch("a", 3, 2, compact)[:5]]
    resumed = [ev.RunResumed(2, "ckpt/step-000002", ""), *batch("a", 3, 2, compact), *batch("a", 4, 3, compact)]
    log = stamped(crashed + resumed)
    kept = lineage(log)
    assert [e.version for e in kept if isinstance(e, ev.OptimizerStep)] == [1, 2, 3, 4]
    opened = [e.group_id for e in kept if isinstance(e, ev.GroupOpened)]
    assert opened == ["s1q0/a", "s2q0/a", "s3q0/a", "s4q0/a"]  # batch 3 once: the redo
    summary = replay.summarize(log)
    assert summary.errors == []
    total = [r for r in summary.accounting if r.total][0]
    assert (total.generated, total.trained, total.dropped, total.in_flight) == (8, 8, 0, 0)


def test_without_the_resume_marker_the_redone_batch_counts_twice():
    crashed = [START, *batch("a", 1, 0), *batch("a", 2, 1), *batch("a", 3, 2)[:5]]
    log = stamped(crashed + batch("a", 3, 2))
    errors = replay.summarize(log).errors
    assert any("opened twice" in e for e in errors) and any("trained twice" in e for e in errors)


def test_work_past_the_checkpoint_that_shares_a_request_with_earlier_work_is_cut_per_sample():
    ids = ["s2q0/a/0", "s3q0/a/0"]
    log = stamped([START, ev.GroupOpened("a", "s2q0/a", ids[:1], 2), ev.GroupOpened("a", "s3q0/a", ids[1:], 3),
                   ev.RequestsCompleted("r0", "a", 7, ids, [1, 2], 4), ev.RunResumed(2, "ckpt", "")])
    completed = [e for e in lineage(log) if isinstance(e, ev.RequestsCompleted)]
    assert [(e.sample_ids, e.versions) for e in completed] == [(["s2q0/a/0"], [1])]


def test_a_compact_request_shared_by_work_before_and_past_the_checkpoint_is_cut_per_sample():
    parts = ev.Parts(["s2q0/a", "s3q0/a"], [0, 0], [1, 1])
    log = stamped([START, ev.GroupOpened("a", "s2q0/a", [], 2, 1), ev.GroupOpened("a", "s3q0/a", [], 3, 1),
                   ev.RequestsCompleted("r0", "a", 7, [], [1, 2], 4, parts=parts), ev.RunResumed(2, "ckpt", "")])
    completed = [e for e in lineage(log) if isinstance(e, ev.RequestsCompleted)]
    assert [(e.samples(), e.sample_versions()) for e in completed] == [(["s2q0/a/0"], [1])]
