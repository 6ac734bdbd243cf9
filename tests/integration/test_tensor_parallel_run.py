"""A user's job whose agent runs on rollout engines of two tensor-parallel ranks, through
`flexmarl run` on the CPU: the rollout worker's engine is a process per rank, every weight
sync is received by both of them from shared memory (nothing but the handle through
vLLM's calls), and the run trains and replays like any other."""

import json
import os
import subprocess
import sys

import pytest
from test_user_job_runs import JOB, ROOT, flexmarl, write_job

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")]


def test_an_agent_on_two_rank_engines_trains_through_flexmarl_run_and_replays(tmp_path):
    config = write_job(tmp_path / "job", job=JOB + "tensor_parallel_size = 2\n")
    run_dir = tmp_path / "run"
    proc = flexmarl("run", str(config), "--out", str(run_dir), "--no-progress")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2]
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "tensor_parallel_size=2" in log
    # Both ranks' processes took the receive in (vLLM logs it once per worker process).
    assert log.count("Injected <class 'flexmarl.workers.rollout.engine_receive.WeightReceiver'>") == 2
    events = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "replay", str(run_dir / "events.log"),
                             "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert events.returncode == 0, events.stdout[-2000:] + events.stderr[-2000:]
