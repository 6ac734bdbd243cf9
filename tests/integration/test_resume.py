"""A controller killed mid-run, resumed from its checkpoint: real processes, real SIGKILL."""

import json

import pytest
import torch
from killed_runs import finish, flexmarl_run, kill_past_checkpoint
from safetensors.torch import load_file

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

pytestmark = pytest.mark.slow

AGENTS = ("planner", "solver", "checker")
RUN = ["--steps", "6", "--seed", "5", "--mode", "async", "--max-staleness", "0", "--no-progress",
       "--set", "pipeline.queries_per_step=4", "--set", "run.checkpoint_every=2"]


def rewards(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], r["agent"]): r["reward_mean"] for r in rows if "kind" not in r}


def test_a_controller_killed_mid_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    finish(flexmarl_run(*RUN, "--out", str(whole)), 600)

    kill_past_checkpoint(flexmarl_run(*RUN, "--out", str(broken)), broken, 600)  # mid-batch 3
    out = finish(flexmarl_run("--resume", str(broken)), 600)
    assert "resuming" in out

    for agent in AGENTS:  # K = 0: the same samples at every step, so the same updates
        a = load_file(str(whole / "checkpoints" / "final" / agent / "model.safetensors"))
        b = load_file(str(broken / "checkpoints" / "final" / agent / "model.safetensors"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert rewards(whole) == rewards(broken)  # every step's row once, none from the crashed segment

    events, problem = read_events(broken / "events.log")
    assert problem is None
    resumed = [e for e in events if isinstance(e, ev.RunResumed)]
    assert len(resumed) == 1 and resumed[0].step in (2, 4)  # the last checkpoint before the kill
    before = events[:events.index(resumed[0])]
    assert any(isinstance(e, ev.MicroBatchFormed) and e.version > resumed[0].step for e in before)  # undone
    summary = replay.summarize(events)
    assert summary.errors == []  # every sample of the final lineage trained or dropped exactly once
    assert replay.check(events) is None
    # No optimizer step applied twice: after the cut, each version is stepped once.
    steps = [(e.agent, e.version) for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    assert sorted(steps) == sorted((a, v) for a in AGENTS for v in range(1, 7))
