"""The coding team as shipped: its TOML loads (two agents, environment workers, held-out
specs), the planted bugs are wrong and the rewards score exactly, with the programs run
in the sandbox."""

import json
import random
from pathlib import Path

from flexmarl.runtime.config import load_config
from flexmarl.runtime.model_specs import import_job

ROOT = Path(__file__).resolve().parents[2]
tasks = import_job(str(ROOT / "examples" / "code_team" / "code_tasks.py"))


def test_the_example_loads_with_environment_workers_and_held_out_specs_apart_from_training():
    cfg = load_config(ROOT / "examples" / "code_team.toml", [])
    assert list(cfg.agents) == ["coder", "tester"] and cfg.cluster.env_workers == 2
    rows = {name: [json.loads(line) for line in (ROOT / "examples" / "code_team" / "data" / f"{name}.jsonl").open()]
            for name in ("train", "eval")}
    train, held = ({(r["op"], r["d"]) for r in rows[n]} for n in ("train", "eval"))
    assert not train & held and train | held == set(tasks.all_specs())


def test_every_planted_bug_is_wrong_somewhere_and_written_in_the_vocabulary():
    rng = random.Random(0)
    for op, d in tasks.all_specs():
        for _ in range(5):
            planted = tasks.plant_bug(op, d, rng)
            assert tasks.exposing_inputs(op, d, planted)
            assert all(t in tasks.TOKEN_ID for t in planted.split())
        assert all(t in tasks.TOKEN_ID for t in tasks.program(op, d).split())


def test_the_coder_is_scored_by_held_back_tests_run_in_the_sandbox():
    assert tasks.pass_rate("add", 3, "x + 3") == 1.0
    assert tasks.pass_rate("add", 3, "3 + x") == 1.0  # any program that passes
    assert tasks.pass_rate("mod", 5, "x % 4") == 0.4  # agrees below 4
    assert tasks.pass_rate("max", 3, "max( x , x") == 0.0  # does not parse


def test_the_tester_is_rewarded_for_inputs_that_expose_the_planted_bug():
    assert tasks.catches("add", 3, "x + 3 if x != 7 else 1", ["7", "2", "x", ""]) == [1.0, 0.0, 0.0, 0.0]
    assert tasks.catches("max", 5, "max( x , 6 )", ["3", "9"]) == [1.0, 0.0]
