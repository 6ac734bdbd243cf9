"""bench/system/adapter_lr.py's smoke run: the digit team at two learning rates, two steps
each; every adapter agent gets a row per rate with its reward at both ends. Not timed."""

import pytest

from bench_runs import json_rows, run_bench

pytestmark = pytest.mark.slow  # real jobs: vLLM engines and trainers


def test_the_smoke_run_reports_every_adapter_agent_at_every_rate():
    out = run_bench("adapter_lr.py", "--smoke", timeout=1200)
    rows = json_rows(out)
    assert sorted((r["lr"], r["agent"]) for r in rows) == sorted(
        (lr, agent) for lr in (0.002, 0.02) for agent in ("sorter", "expander", "copier", "reverser"))
    assert all(r["steps"] == 2 and r["train_start"] is not None and r["train_end"] is not None for r in rows)
    assert "| lr | agent | train (first 1 steps -> last 1) | held-out (first -> last evaluation) |" in out
