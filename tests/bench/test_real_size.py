"""bench/system/real_size.py at tiny shapes: the same `flexmarl run` path as the real-size job
(model directories built from a config, a swap every step at capacity 1 against none at
capacity 2, a checkpoint and a resume), its JSON rows parsed. Not timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "system" / "real_size.py"


@pytest.mark.slow
def test_the_real_size_bench_at_tiny_shapes_swaps_checkpoints_resumes_and_reports_every_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(BENCH), "--smoke", "--modes", "sync", "--steps", "1",
                          "--capacities", "1,2", "--keep", str(tmp_path / "runs"), "--models", str(tmp_path / "models")],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {r["run"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == {"sync", "sync-resumed", "sync-capacity2", "memcpy", "sync-capacity-ratio"}
    # One slot for two agents: each swapped in at most once a step; two slots: never.
    assert all(0 <= n <= 1 for n in rows["sync"]["swap_ins_per_agent_step"].values())
    assert set(rows["sync-capacity2"]["swap_ins_per_agent_step"].values()) == {0.0}
    assert rows["sync"]["swap_wait_s"] >= 0 and not rows["sync"]["stopped"]
    assert rows["sync-capacity-ratio"]["step_wall_ratio"] > 0 and len(rows["sync"]["step_wall_s"]) == 1

    first, resumed = rows["sync"], rows["sync-resumed"]
    assert first["optimizer_steps"] == 2 and resumed["optimizer_steps"] == 2  # one step of each of two agents
    for row in (first, resumed):
        assert row["worker_deaths"] == []
        assert row["swaps"] >= 1  # trainer_capacity 1 with two agents: a step cannot go without one
        assert [c["step"] for c in row["checkpoints"]] == [row["steps"]]
        assert {s["agent"] for s in row["weight_syncs"]} == {"big0", "small"}
        assert all(s["bytes"] > 0 and s["vs_memcpy"] > 0 for s in row["weight_syncs"])
    # Every process of the first run reported its peak; the resumed run's, too.
    assert set(first["peak_rss_mib"]) == {"controller", "rollout-0", "rollout-1", "trainer-0"}
    assert set(resumed["peak_rss_mib"]) == set(first["peak_rss_mib"])
    assert all(mib > 0 for mib in first["peak_rss_mib"].values())
    # The resumed command started from the checkpoint, not from the models' directories.
    assert any(why.startswith("swapped in from checkpoint") for why in resumed["trainer_moves"])
    assert rows["memcpy"]["bytes"] == max(s["bytes"] for s in first["weight_syncs"])
    assert "| sync-resumed |" in out.stdout  # and the table
