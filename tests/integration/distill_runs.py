"""The distillation tests' real run: the dynamic-sampling example's sorter distilled from a
frozen one-token teacher (tiny:checker), trained through `Experiment` in this process with
real workers; what each test varies is given as config overrides."""

import asyncio
import json
from pathlib import Path

from flexmarl.controller import Experiment
from flexmarl.runtime.config import load_config
from flexmarl.runtime.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]
TEACHER = ["agents.sorter.teacher='teacher'", "agents.teacher.model='tiny:checker'", "agents.teacher.train=false",
           "agents.teacher.max_tokens=1"]


def run_distilled(run_dir: Path, steps: int, queries: int, overrides: list[str]) -> tuple[list[dict], list]:
    """Trains the sorter `steps` steps of `queries` queries with its teacher (TEACHER and
    `overrides` over the example); its metrics rows (steps only) and the run's events."""
    cfg = load_config(ROOT / "examples" / "dynamic_sampling.toml", [
        f"run.steps={steps}", f"pipeline.queries_per_step={queries}", "run.progress=false", "eval.every=0",
        "cluster.rollout_workers=2", *TEACHER, *overrides])

    async def main():
        async with Experiment(cfg, run_dir=run_dir) as exp:
            return await exp.train()

    asyncio.run(main())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "kind" not in r], read_events(run_dir / "events.log")[0]
