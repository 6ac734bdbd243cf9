"""bench/system/signals.py's smoke run: both parts at tiny sizes. On identical weights the
trainer's scoring of top_p- and top_k-cut samples equals the engine's and no correction
flags a token, while the plain temperature-scaled softmax beside it does not; the short
K=2 run reports every agent. Not timed."""

import math

import pytest

from bench_runs import json_rows, run_bench

pytestmark = pytest.mark.slow  # starts a vLLM engine and a real job's processes


def test_the_smoke_run_shows_the_cut_scored_exactly_after_and_not_before_and_a_k2_run_per_agent():
    out = run_bench("signals.py", "--smoke", timeout=900)
    rows = json_rows(out)

    mismatch = [r for r in rows if r["part"] == "mismatch" and r["agent"] == "all"]
    assert {(r["temperature"], r["top_p"], r["top_k"]) for r in mismatch} == {(0.8, 0.7, 0), (0.8, 1.0, 5)}
    for r in mismatch:
        assert r["tokens"] > 0
        if r["scoring"] == "after":
            assert r["logprob_abs_diff"] < 1e-4 and abs(r["ratio_min"] - 1) < 1e-3
            assert set(r["flagged"].values()) == {0}
        else:  # the full softmax gives every kept token less than the cut distribution did
            assert r["logprob_abs_diff"] > 1e-3 and r["ratio_mean"] < 1
    assert "| T | top_p | top_k | trainer scoring |" in out

    runs = [r for r in rows if r["part"] == "run"]
    assert {r["agent"] for r in runs} == {"planner", "solver", "checker"}
    for r in runs:
        assert r["setting"] == "async K=2 ppo_clip" and r["skipped_steps"] == 0
        assert 0 <= r["last_reward_mean"] <= 1 and math.isfinite(r["mean_logprob_abs_diff"])
        assert 0 <= r["mean_clip_frac"] <= 1
    assert "| setting | agent | reward first -> last |" in out
