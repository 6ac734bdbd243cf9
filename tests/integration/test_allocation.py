"""Agent-centric training with real processes: three agents share one trainer by parking
and swapping their training states, and end where three dedicated trainers end."""

import asyncio

import pytest
import torch
from killed_runs import kill_worker, run_training, small_config
from safetensors.torch import load_file

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

pytestmark = pytest.mark.slow

AGENTS = ("planner", "solver", "checker")


def run(run_dir, *overrides):
    cfg = small_config("pipeline.mode='sync'", *overrides)
    out = {}
    summary, _ = run_training(cfg, run_dir, out=out)
    return summary, out["training"].parts.allocator.swaps


def test_three_agents_swapping_on_one_trainer_match_three_dedicated_trainers(tmp_path):
    swapped_summary, swaps = run(tmp_path / "one", "cluster.trainer_workers=1", "cluster.trainer_capacity=1")
    dedicated_summary, none = run(tmp_path / "three", "cluster.trainer_workers=3")
    assert none == 0 and swaps >= 3 * 2, "with one slot for three agents every step swaps"
    import json

    rows = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["swap_ins"] <= 1 for row in rows), "an agent was swapped in twice in one step"
    assert all(sum(r["swap_ins"] for r in rows if r["step"] == step) >= 2 for step in (2, 3))
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


def trained_on(run_dir, trainer, version):
    """A micro-batch towards `version` was trained on `trainer` (the log is written as it goes)."""
    try:
        events, _ = read_events(run_dir / "events.log")
    except FileNotFoundError:
        return False
    return any(isinstance(e, ev.MicroBatchTrained) and e.trainer == trainer and e.version >= version
               for e in events)


def test_a_trainer_killed_mid_batch_is_restarted_its_agents_restored_and_every_sample_trained_once(tmp_path):
    """SIGKILL a trainer while it holds accumulated gradients of a global batch: its agents
    come back from their last saved state (a checkpoint every 2 steps) on a live trainer,
    what was trained since is trained again, and the run ends with the weights of a run
    never interrupted (sync mode: the same samples), each sample counted once."""
    import os

    shared = ["run.steps=5", "pipeline.mode='sync'", "cluster.trainer_workers=2", "run.checkpoint_every=2",
              "transport.heartbeat_timeout_s=3.0",
              # Restarted at once: with a backoff the run can finish on the live trainer first.
              "cluster.restart_backoff_s=0.0"]
    cfg = small_config(*shared)
    killed = {}

    async def kill_trainer_1_mid_batch_4(exp, train):
        victim = "trainer-1"
        # Mid-global-batch 4 (past the checkpoint of step 2): trainer-1 has trained a
        # micro-batch of it, and not yet stepped; batch 3 is redone as well.
        while not trained_on(tmp_path / "killed", victim, 4):
            await asyncio.sleep(0.05)
            assert not train.done(), train.exception()
        killed["agents"] = sorted(a for a, t in exp.training.parts.allocator.resident.items() if t == victim)
        killed["pid"] = kill_worker(exp, victim)

    summary, _ = run_training(cfg, tmp_path / "killed", during=kill_trainer_1_mid_batch_4)
    assert summary.steps == 5 and killed["agents"]
    # The killed trainer could not unlink its shared-memory segments; the launcher did.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"flexmarl-param-{killed['pid']}-")]
    events, problem = read_events(tmp_path / "killed" / "events.log")
    assert problem is None
    restored = {e.agent: e for e in events if isinstance(e, ev.TrainingRestored)}
    # Each from its last saved state: step 2's, or step 4's if it stepped and saved 4 before the kill.
    assert set(restored) == set(killed["agents"]) and all(e.version in (2, 4) for e in restored.values())
    assert any(isinstance(e, ev.WorkerRestarted) and e.worker == "trainer-1" for e in events)
    summary_of_log = replay.summarize(events)
    assert summary_of_log.errors == []  # 0 samples lost, 0 trained twice
    assert replay.check(events) is None
    steps = [(e.agent, e.version) for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    assert sorted(steps) == sorted((a, v) for a in AGENTS for v in range(1, 6))

    run_training(small_config(*shared), tmp_path / "whole")  # never interrupted
    for agent in AGENTS:
        a = load_file(str(tmp_path / "whole" / "checkpoints" / "final" / agent / "model.safetensors"))
        b = load_file(str(tmp_path / "killed" / "checkpoints" / "final" / agent / "model.safetensors"))
        for k in a:  # the redone steps, in the same micro-batches: round-off at most
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
