"""Agent-centric training with real processes: three agents share one trainer by parking
and swapping their training states, and end where three dedicated trainers end."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from flexmarl.controller import Experiment, replay
from flexmarl.controller.digit_chain import default_config
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


def test_a_trainer_killed_while_agents_swap_stops_the_run_clearly_and_revives_no_lost_state(tmp_path):
    import os
    import signal

    cfg = load_config(None, ["run.steps=8", "pipeline.queries_per_step=4", "run.progress=false",
                             "pipeline.mode='sync'", "cluster.trainer_workers=2", "cluster.trainer_capacity=1",
                             "transport.heartbeat_timeout_s=3.0",
                             "cluster.max_restarts=0"],  # the dead trainer stays out of the pool
                      defaults=default_config())
    killed = {}

    async def main():
        async with Experiment(cfg, run_dir=tmp_path) as exp:
            train = asyncio.create_task(exp.train())
            while exp.training is None or exp.training.allocator is None or exp.training.allocator.swaps < 2:
                await asyncio.sleep(0.05)
                assert not train.done(), train.exception()
            victim = "trainer-1"
            killed["agents"] = sorted(a for a, t in exp.training.allocator.resident.items() if t == victim)
            killed["pid"] = next(wp.proc.pid for wp in exp.local.procs if wp.worker_id == victim)
            os.kill(killed["pid"], signal.SIGKILL)
            with pytest.raises(Exception) as failure:
                await train
            return failure.value, exp.training.allocator

    error, allocator = asyncio.run(main())
    # The killed trainer could not unlink its shared-memory segments; the launcher did.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"flexmarl-param-{killed['pid']}-")]
    assert "trainer-1" in str(error)
    assert "trainer-1" not in allocator.trainers
    events, problem = read_events(tmp_path / "events.log")
    assert problem is None
    died = next(i for i, e in enumerate(events) if isinstance(e, ev.WorkerDied) and e.worker == "trainer-1")
    lost = {e.agent for e in events[died:] if isinstance(e, ev.AllocationChanged) and e.why == "lost: trainer-1 died"}
    assert lost == set(killed["agents"]) and lost <= set(AGENTS)
    # Shutting the other workers down afterwards is not mistaken for more deaths.
    assert all(e.why == "lost: trainer-1 died" for e in events if isinstance(e, ev.AllocationChanged)
               and e.why.startswith("lost"))
    # A lost state is never rebuilt from scratch or bound again.
    assert not [e for e in events[died:] if isinstance(e, ev.AllocationChanged) and e.kind == "trainer"
                and e.agent in lost and e.workers]
