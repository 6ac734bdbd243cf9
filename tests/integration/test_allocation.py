"""Agent-centric training with real processes: three agents share one trainer by parking
and swapping their training states, and end where three dedicated trainers end."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from flexmarl.controller import Experiment, replay
from flexmarl.controller.workflows import default_config
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events

pytestmark = pytest.mark.slow

AGENTS = ("planner", "solver", "checker")


def run(run_dir, *overrides):
    cfg = load_config(None, ["run.steps=3", "pipeline.queries_per_step=4", "run.progress=false",
                             "pipeline.mode='sync'", *overrides], defaults=default_config())

    async def main():
        async with Experiment(cfg, run_dir=run_dir) as exp:
            summary = await exp.train()
            return summary, exp.training.allocator.swaps

    return asyncio.run(main())


def test_three_agents_swapping_on_one_trainer_match_three_dedicated_trainers(tmp_path):
    swapped_summary, swaps = run(tmp_path / "one", "cluster.trainer_workers=1", "cluster.trainer_capacity=1")
    dedicated_summary, none = run(tmp_path / "three", "cluster.trainer_workers=3")
    assert none == 0 and swaps >= 3 * 3, "every agent should have been swapped in at every step"
    for agent in AGENTS:
        assert swapped_summary.rewards[agent] == dedicated_summary.rewards[agent]
        a = load_file(str(tmp_path / "one" / "checkpoints" / "final" / agent / "model.safetensors"))
        b = load_file(str(tmp_path / "three" / "checkpoints" / "final" / agent / "model.safetensors"))
        for k in a:
            # exact when micro-batches accumulate in the same order, round-off otherwise
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    events, problem = read_events(tmp_path / "one" / "events.log")
    assert problem is None and replay.summarize(events).errors == []
    parked = [e for e in events if isinstance(e, ev.AllocationChanged) and e.kind == "trainer" and not e.workers]
    assert {e.agent for e in parked} == set(AGENTS)
    # exactly one owner at any moment: at most one agent bound to the trainer at a time
    bound = {}
    for e in events:
        if isinstance(e, ev.AllocationChanged) and e.kind == "trainer":
            bound[e.agent] = bool(e.workers)
            assert sum(bound.values()) <= 1
