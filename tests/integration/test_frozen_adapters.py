"""Frozen agents and snapshots as LoRA adapters of one base, in a real run: the snapshot is
one more adapter slot on the base's engine, refreshed from its source's adapter, and a
frozen judge's adapter is read from a PEFT directory (as an earlier run's checkpoint holds
one); neither takes a trainer."""

import asyncio
from pathlib import Path

import pytest
import torch

from flexmarl.controller import Experiment, replay
from flexmarl.controller.run.model_resolution import resolve_model
from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def judge_adapter(folder: Path) -> Path:
    """A rank-8 PEFT adapter of the planner, its B not zero (so it is not the base)."""
    from flexmarl.workers.adapters import SharedBase
    from flexmarl.workers.precision import TrainPlacement

    base = SharedBase(resolve_model("tiny:planner"), TrainPlacement.resolve(protocol.TrainerSettings(), "cpu"))
    adapter = base.add("judge", protocol.LoraSettings(rank=8), seed=3)
    with torch.no_grad():
        for _, p in adapter.named_parameters():
            p.normal_(0, 0.05)
    adapter.save_pretrained(folder)
    return folder


def test_a_snapshot_and_a_frozen_judge_as_adapters_of_the_players_base(tmp_path):
    adapter_dir = judge_adapter(tmp_path / "judge-adapter")
    cfg = load_config(ROOT / "examples" / "self_play.toml", [
        "run.steps=2", "pipeline.queries_per_step=2", "run.progress=false", "cluster.rollout_workers=1",
        "bases.b.model='tiny:planner'", "agents.player.model=''", "agents.player.base='b'",
        "agents.past.snapshot_every=1", "agents.judge.model=''", "agents.judge.base='b'",
        f"agents.judge.adapter='{adapter_dir}'"])
    assert cfg.agents["past"].base == "b"

    async def main():
        async with Experiment(cfg, run_dir=tmp_path / "run") as exp:
            return await exp.train()

    asyncio.run(main())
    events, _ = read_events(tmp_path / "run" / "events.log")
    assert {e.agent for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "trainer"} == {"player"}
    assert [(e.agent, e.version) for e in events if isinstance(e, ev.SnapshotRefreshed)] == [("past", 1), ("past", 2)]
    served = {e.agent for e in events if isinstance(e, ev.GroupServed)}
    assert served == {"past", "judge"}
    assert replay.check(events) is None
