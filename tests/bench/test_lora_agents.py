"""bench/system/lora_agents.py's smoke run: two agents as adapters of one base and as whole
models, one step each; the adapter job runs one engine and moves far fewer bytes per sync
(an adapter is about 2% of the base). Not timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # real jobs: vLLM engines and trainers


def test_the_smoke_run_reports_both_jobs_and_the_adapter_sync_is_a_small_fraction():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "bench/system/lora_agents.py", "--smoke"], capture_output=True, text=True,
                         timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {r["mode"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"adapters", "whole"}
    assert (rows["adapters"]["engines"], rows["whole"]["engines"]) == (1, 2)
    assert 0 < rows["adapters"]["sync_mb_per_step"] < 0.05 * rows["whole"]["sync_mb_per_step"]
    assert all(r["rollout_rss_mb"] > 0 and r["trainer_rss_mb"] > 0 and r["samples_per_s"] > 0 for r in rows.values())
    assert "| N | mode |" in out.stdout
