"""Experiment: what an open experiment changes in its process, and that leaving undoes it."""

import asyncio
import gc
from types import SimpleNamespace

import pytest

from flexmarl.controller.run.experiment import GC_THRESHOLDS, Experiment
from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import events as ev
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


def test_a_restarted_worker_is_logged_with_how_the_one_it_replaces_ended_as_its_launcher_saw_it():
    # The controller may have lost it first ("connection lost"): only the launcher says why.
    emitted = []
    lost = "its Ray actor flexmarl-t-rollout-0-1 (worker pid 7 on node n1 at 10.0.0.1) was lost with its node"
    old = SimpleNamespace(exit_code=None, why_exited=lambda: lost)
    new = SimpleNamespace(worker_id="rollout-0", role="rollout", pid=0)
    Experiment._restarted(SimpleNamespace(emit=emitted.append), old, new, 1)
    assert emitted == [ev.WorkerRestarted("rollout-0", "rollout", None, 1, 0, why=lost)]
