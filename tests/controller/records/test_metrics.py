"""The progress line: its time and ETA count training, not set-up (model builds, engine starts)."""

import pytest

from flexmarl.controller.records import metrics as metrics_module
from flexmarl.controller.records.metrics import MetricsLog


def test_the_eta_counts_training_only(tmp_path, capsys):
    now = {"t": 0.0}
    metrics = MetricsLog(tmp_path, ["a"], clock=lambda: now["t"])
    now["t"] = 175.0  # set-up: models built, engines started
    metrics.training_started()
    now["t"] = 180.0
    metrics.write({"step": 1, "agent": "a", "reward_mean": 0.5})
    metrics.end_step(1, 4)
    metrics._fh.close()
    line = capsys.readouterr().err.strip()
    assert line.endswith("step 1/4  reward: a 0.500  5s training, ~15s left")


def test_each_row_says_what_the_agents_engines_prefilled_since_its_last_row(tmp_path):
    import types

    counts = {"a": {"prompt_tokens": 100, "cached_tokens": 20, "turn_prompt_tokens": 0, "turn_cached_tokens": 0}}
    metrics = MetricsLog(tmp_path, ["a"], progress=False, prompt_counts=counts.__getitem__)
    times = types.SimpleNamespace()
    metrics.record(1, "a", 1, [], times)
    counts["a"] = {"prompt_tokens": 300, "cached_tokens": 20, "turn_prompt_tokens": 80, "turn_cached_tokens": 60}
    metrics.record(2, "a", 2, [], times)
    metrics._fh.close()
    first, second = ({k: r[k] for k in ("prompt_tokens", "cached_prompt_tokens", "prefix_hit_rate",
                                        "turn_prefix_hit_rate")} for r in metrics.rows)
    assert first == {"prompt_tokens": 100, "cached_prompt_tokens": 20, "prefix_hit_rate": 0.2,
                     "turn_prefix_hit_rate": None}
    assert second == {"prompt_tokens": 280, "cached_prompt_tokens": 60, "prefix_hit_rate": 0.0,
                      "turn_prefix_hit_rate": 0.75}


async def test_rows_are_made_durable_once_however_many_agents_checkpoint_the_step(tmp_path, monkeypatch):
    import asyncio
    import os

    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    metrics = MetricsLog(tmp_path, ["a", "b"], progress=False)
    metrics.write({"step": 1, "agent": "a", "reward_mean": 0.5})
    metrics.write({"step": 1, "agent": "b", "reward_mean": 0.5})
    await asyncio.gather(metrics.make_durable(), metrics.make_durable())
    assert len(synced) == 1
    metrics.write({"step": 2, "agent": "a", "reward_mean": 0.5})
    await metrics.make_durable()
    assert len(synced) == 2
    metrics._fh.close()


def test_a_steps_reward_mean_does_not_depend_on_the_order_its_samples_trained_in(tmp_path):
    """Sync mode and K = 0 train the same samples, in micro-batches that may arrive in
    another order: the row's mean is the same to the last bit."""
    import types

    rewards = [0.1, 0.7, 0.3, 0.9, 0.2, 0.6, 0.4]
    micro_batches = [types.SimpleNamespace(rewards=lambda r=r: [r], oldest=lambda: [0], keys=lambda: [])
                     for r in rewards]  # one sample each
    metrics = MetricsLog(tmp_path, ["a"], progress=False)
    metrics.record(1, "a", 1, micro_batches, types.SimpleNamespace())
    metrics.record(1, "a", 1, micro_batches[::-1], types.SimpleNamespace())
    metrics._fh.close()
    forward, backward = (r["reward_mean"] for r in metrics.rows)
    assert sum(rewards) != sum(rewards[::-1])  # plain summation would differ
    assert forward == backward


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. "Tight layout not applied": 32 agents' legend did not fit
def test_closing_at_the_end_of_a_run_draws_the_plot_off_the_event_loop(tmp_path, monkeypatch):
    """The reward plot of a run with many agents takes about a second to draw: the run's
    end closes the log in a worker thread, so the loop still answers its workers; the
    legend of 32 agents goes beside the axes, where it fits."""
    import asyncio
    import threading
    import types

    drawn_in: list[int] = []
    real = metrics_module.plot_rewards
    monkeypatch.setattr(metrics_module, "plot_rewards",
                        lambda *a: (drawn_in.append(threading.get_ident()), real(*a)))
    agents = [f"agent{i}" for i in range(32)]
    log = MetricsLog(tmp_path, agents, progress=False)
    sample = types.SimpleNamespace(rewards=lambda: [1.0], oldest=lambda: [0], keys=lambda: [])
    times = types.SimpleNamespace(rollout_s=0.1, train_s=0.2, sync_s=0.01)
    for step in (1, 2):
        for agent in agents:
            log.record(step, agent, step, [sample], times)

    async def end_of_run() -> int:
        await log.aclose()
        return threading.get_ident()

    loop_thread = asyncio.run(end_of_run())
    assert drawn_in and drawn_in[0] != loop_thread
    assert (tmp_path / "rewards.png").read_bytes().startswith(b"\x89PNG")
