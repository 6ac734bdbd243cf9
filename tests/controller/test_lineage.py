"""Across a resume, the log's accounting counts the run that the final weights come from."""

from flexmarl.controller import replay
from flexmarl.controller.lineage import lineage
from flexmarl.runtime import events as ev


def batch(agent, b, version_made):
    """One group of two samples of batch `b`, generated, completed, trained into version b."""
    g = f"s{b}q0/{agent}"
    ids = [f"{g}/0", f"{g}/1"]
    return [ev.GroupOpened(agent, g, ids, b),
            ev.RequestsDispatched("r0", agent, b, ids, 4),
            ev.RequestsCompleted("r0", agent, b, ids, [version_made] * 2, 6),
            ev.GroupComplete(agent, g, [1.0, 0.0]),
            ev.MicroBatchFormed(agent, "t0", b, ids, [version_made] * 2),
            ev.MicroBatchTrained(agent, "t0", b, 2, 0.01),
            ev.OptimizerStep(agent, "t0", b, 2)]


def stamped(events):
    for i, e in enumerate(events):
        e.seq, e.t = i, float(i)
    return events


START = ev.RunStarted("[pipeline]\nmicro_batch = 2\n", ["a"], "sync", 0, 0)


def test_a_resume_undoes_the_crashed_segments_work_past_the_checkpoint():
    crashed = [START, *batch("a", 1, 0), *batch("a", 2, 1), *batch("a", 3, 2)[:5]]  # killed in batch 3
    resumed = [ev.RunResumed(2, "ckpt/step-000002", ""), *batch("a", 3, 2), *batch("a", 4, 3)]
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
