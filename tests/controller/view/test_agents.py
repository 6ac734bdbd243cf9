"""controller/view/agents.py: metrics.jsonl's rows as each agent's curves."""

import math

import pytest

from flexmarl.controller.view.agents import WINDOW, AgentCurves


def test_each_row_is_a_point_of_its_agents_curves_and_evaluations_a_point_of_their_own():
    curves = AgentCurves()
    curves.add({"step": 1, "agent": "a", "reward_mean": 0.5, "samples": 8, "time": 12.0, "step_s": 2.0,
                "loss": math.nan, "grad_norm": 1.5, "logprob_abs_diff": 1e-7, "staleness_mean": 0.0})
    curves.add({"step": 1, "agent": "b", "reward_mean": None, "samples": 4, "time": 13.0, "step_s": 4.0})
    curves.add({"kind": "eval", "step": 1, "agent": "a", "reward_mean": 0.75})
    curves.add({"kind": "something new", "step": 1, "agent": "a"})  # a kind of row this view does not know
    curves.add({"step": "x", "agent": "a"})  # not a row of any kind
    assert curves.agents == ["a", "b"]
    assert curves.train["agent"] == [0, 1] and curves.train["step"] == [1, 1]
    assert curves.train["reward"] == [0.5, None] and curves.train["loss"] == [None, None]  # NaN: a gap, as JSON has none
    assert curves.train["mismatch"] == [1e-7, None] and curves.train["samples_s"] == [4.0, 1.0]  # 8 / 2 s, 4 / 4 s
    assert curves.eval == {"agent": [0], "step": [1], "reward": [0.75]}
    assert curves.latest() == {"a": pytest.approx({"step": 1, "samples_s": 4.0, "reward": 0.5, "staleness": 0.0,
                                                   "staleness_max": None, "mismatch": 1e-7, "rollout_kl": None,
                                                   "loss": None, "grad_norm": 1.5, "entropy": None, "time": 12.0}),
                               "b": curves.latest()["b"]}
    part = curves.since(1, 1)
    assert part["train"]["step"] == [1] and part["eval"]["step"] == [] and part["train_rows"] == 2


def test_samples_per_second_is_taken_over_the_last_steps_not_the_gap_before_one():
    curves = AgentCurves()
    times = [10.0, 20.0, 20.1, 30.0, 40.0, 50.0, 60.0, 70.0]  # step 3 came right after step 2
    for step, t in enumerate(times, start=1):
        curves.add({"step": step, "agent": "a", "samples": 10, "time": t, "step_s": 5.0})
    rates = curves.train["samples_s"]
    assert rates[:WINDOW] == pytest.approx([10 / 5.0, 20 / 15.0, 30 / 15.1, 40 / 25.0, 50 / 35.0], abs=1e-3)  # since its first step began
    assert rates[WINDOW] == pytest.approx(50 / (50.0 - 10.0), abs=1e-3)  # the last five steps, after the step before them
    assert max(rates) < 2.1  # no jump at step 3
    curves.add({"step": 9, "agent": "a", "samples": 10, "time": 4.0, "step_s": 2.0})  # a resumed run's clock
    assert curves.train["samples_s"][-1] == 5.0
