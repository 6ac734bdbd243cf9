"""The README tells the truth: every configuration key is in its reference table (and
nothing else is), and its Python snippet runs as written."""

import dataclasses
import re
import types
from pathlib import Path

from flexmarl.runtime.config import AgentConfig, BaseConfig, ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def config_keys() -> set[str]:
    keys = set()
    for section in dataclasses.fields(ExperimentConfig):
        if section.name in ("agents", "bases"):  # one table per agent, per base
            table = AgentConfig if section.name == "agents" else BaseConfig
            keys |= {f"{section.name}.*.{f.name}" for f in dataclasses.fields(table)}
        else:
            keys |= {f"{section.name}.{f.name}" for f in dataclasses.fields(section.default_factory)}
    return keys


def test_every_config_key_is_in_the_readmes_reference_and_every_key_there_exists():
    reference = README.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_.*]+)` \|", reference, flags=re.M))
    assert config_keys() - documented == set(), "keys missing from the README's Configuration reference"
    assert documented - config_keys() == set(), "the README documents keys the config does not have"


def test_the_python_snippet_runs_as_written(monkeypatch):
    import flexmarl.controller

    snippet = README.split("## Python\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    ran = []

    class Experiment:  # stands in for the real one: the snippet's shape is what is tested
        def __init__(self, cfg):
            ran.append(cfg.run.steps)

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        async def train(self):
            return types.SimpleNamespace(report=lambda: "5 steps")

    monkeypatch.setattr(flexmarl.controller, "Experiment", Experiment)
    monkeypatch.chdir(ROOT)
    exec(compile(snippet, "README.md", "exec"), {"__name__": "__main__"})
    assert ran == [5]
