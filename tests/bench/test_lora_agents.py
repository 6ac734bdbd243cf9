"""bench/system/lora_agents.py's smoke run: two agents as adapters of one base and as whole
models, one step each; the adapter job runs one engine and moves far fewer bytes per sync
(an adapter is about 2% of the base). Not timed."""

import pytest

from bench_runs import json_rows, run_bench

pytestmark = pytest.mark.slow  # real jobs: vLLM engines and trainers


def test_the_smoke_run_reports_both_jobs_and_the_adapter_sync_is_a_small_fraction():
    out = run_bench("lora_agents.py", "--smoke", timeout=900)
    rows = {r["mode"]: r for r in json_rows(out)}
    assert set(rows) == {"adapters", "whole"}
    assert (rows["adapters"]["engines"], rows["whole"]["engines"]) == (1, 2)
    assert 0 < rows["adapters"]["sync_mb_per_step"] < 0.05 * rows["whole"]["sync_mb_per_step"]
    assert all(r["rollout_rss_mb"] > 0 and r["trainer_rss_mb"] > 0 and r["samples_per_s"] > 0 for r in rows.values())
    assert "| N | mode |" in out
