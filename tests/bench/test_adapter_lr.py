"""bench/system/adapter_lr.py's smoke run: the digit team at two learning rates, two steps
each; every adapter agent gets a row per rate with its reward at both ends. Not timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # real jobs: vLLM engines and trainers


def test_the_smoke_run_reports_every_adapter_agent_at_every_rate():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "bench/system/adapter_lr.py", "--smoke"], capture_output=True, text=True,
                         timeout=1200, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted((r["lr"], r["agent"]) for r in rows) == sorted(
        (lr, agent) for lr in (0.002, 0.02) for agent in ("sorter", "expander", "copier", "reverser"))
    assert all(r["steps"] == 2 and r["train_start"] is not None and r["train_end"] is not None for r in rows)
    assert "| lr | agent | train (first 1 steps -> last 1) | held-out (first -> last evaluation) |" in out.stdout
