"""Experiment: what an open experiment changes in its process, and that leaving undoes it."""

import asyncio
import gc

import pytest

from flexmarl.controller import digit_chain
from flexmarl.controller.experiment import GC_THRESHOLDS, Experiment
from flexmarl.runtime.config import load_config


async def test_an_experiment_makes_collector_passes_rare_while_open_and_restores_them_even_when_entry_fails(tmp_path):
    # No worker ever connects: entering waits for them (the collector's thresholds are
    # looked at meanwhile), then fails, and the teardown restores them.
    cfg = load_config(defaults=digit_chain.default_config(),
                      overrides=["cluster.rollout_workers=1", "cluster.trainer_workers=1",
                                 "cluster.worker_start_timeout_s=1.0", "run.progress=false"])
    before = gc.get_threshold()
    assert before != GC_THRESHOLDS
    seen = []

    async def look() -> None:
        await asyncio.sleep(0.3)
        seen.append(gc.get_threshold())

    looking = asyncio.create_task(look())
    with pytest.raises(TimeoutError):
        async with Experiment(cfg, run_dir=tmp_path / "run", spawn_workers=False):
            pass
    await looking
    assert seen == [GC_THRESHOLDS]
    assert gc.get_threshold() == before
