"""The review-chain example run as a user runs it: `flexmarl run examples/review_chain.toml`
in a child process from the repository root (real controller, vLLM rollout workers, torch
trainer; models built from the job's recipes on first use)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
AGENTS = {"solver", "verifier"}


def test_the_review_chain_trains_both_agents_and_evaluates_on_held_out_rows(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "run", "examples/review_chain.toml",
                           "--steps", "2", "--out", str(run_dir), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("kind") != "eval"]
    assert {r["agent"] for r in trained} == AGENTS
    assert {r["step"] for r in trained} == {1, 2}
    for r in trained:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["samples"] > 0
    # The eval rows come from the held-out file and never train.
    assert {r["agent"] for r in rows if r.get("kind") == "eval"} == AGENTS
