"""Whole-model and adapter agents in one job, through `flexmarl run` (real processes): two
whole models and three LoRA adapters of one base; the controller is killed (SIGKILL, by
PID) past a checkpoint, the run resumes and finishes, every version of every agent is
stepped once, `replay --check` re-derives the logged decisions, and each adapter agent's
checkpoint is a PEFT adapter directory."""

import json
from pathlib import Path

import pytest
from killed_runs import finish, flexmarl_run, kill_past_checkpoint

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

pytestmark = pytest.mark.slow

TEAM = Path(__file__).resolve().parents[2] / "examples" / "digit_team"
WHOLE, ADAPTERS = ("sorter", "maxer"), ("expander", "copier", "reverser")
STEPS = 4


def job(tmp_path):
    agents = {"sorter": 'model = "tiny:planner"', "maxer": 'model = "tiny:checker"'}
    agents |= {a: 'base = "team"' for a in ADAPTERS}
    length = {"sorter": 3, "maxer": 1, "expander": 6, "copier": 3, "reverser": 3}
    text = f"""
[run]
workflow = "{TEAM / 'workflow.py'}:episode"
steps = {STEPS}
seed = 3
checkpoint_every = 2
progress = false
[cluster]
rollout_workers = 3
trainer_workers = 1
[pipeline]
mode = "async"
max_staleness = 1
queries_per_step = 2
micro_batch = 8
[bases.team]
model = "tiny:{TEAM / 'models.py'}:base"
""" + "".join(f"[agents.{a}]\n{line}\ngroup_size = 2\nmax_tokens = {length[a]}\nignore_eos = true\n"
              for a, line in agents.items())
    path = tmp_path / "team.toml"
    path.write_text(text)
    return path


def test_whole_model_and_adapter_agents_run_resume_after_a_sigkill_and_replay(tmp_path):
    run_dir = tmp_path / "run"
    kill_past_checkpoint(flexmarl_run(str(job(tmp_path)), "--out", str(run_dir)), run_dir, 900, tail=4000)
    finish(flexmarl_run("--resume", str(run_dir)), 900, tail=4000)

    events, problem = read_events(run_dir / "events.log")
    assert problem is None
    assert len([e for e in events if isinstance(e, ev.RunResumed)]) == 1
    assert replay.summarize(events).errors == []  # every sample trained or dropped exactly once
    assert replay.check(events) is None
    steps = [(e.agent, e.version) for e in replay.lineage(events) if isinstance(e, ev.OptimizerStep)]
    assert sorted(steps) == sorted((a, v) for a in WHOLE + ADAPTERS for v in range(1, STEPS + 1))
    # One instance per engine unit (3 workers, 3 units): the base's serves all three adapter
    # agents and nothing else, each whole model has its own.
    served = {}
    for e in events:
        if isinstance(e, ev.RequestsDispatched):
            served.setdefault(e.agent, set()).add(e.worker)
    base_instances = set.union(*(served[a] for a in ADAPTERS))
    assert len(base_instances) == 1 and all(served[a] == base_instances for a in ADAPTERS)
    assert all(not served[a] & base_instances for a in WHOLE)
    final = run_dir / "checkpoints" / "final"
    for agent in ADAPTERS:
        config = json.loads((final / agent / "adapter_config.json").read_text())
        assert config["r"] == 8 and (final / agent / "adapter_model.safetensors").exists()
    for agent in WHOLE:
        assert (final / agent / "model.safetensors").exists()
