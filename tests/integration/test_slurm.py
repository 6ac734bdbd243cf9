"""scripts/flexmarl.sbatch under a real Slurm: the batch script places the controller and
the workers (job steps via srun) on the allocated node(s), CURVE on (the controller binds
the node's address, not loopback); the run finishes and replays.

Skipped, saying why, where no Slurm answers (not installed, or no slurmctld/slurmd
running). On one machine: Debian's slurm-wlm and munge, one node; bench/RESULTS.md
records how it was set up."""

import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from flexmarl.controller import replay
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import read_events

ROOT = Path(__file__).resolve().parents[2]


def why_no_slurm() -> str:
    if shutil.which("sbatch") is None:
        return "Slurm is not installed (no sbatch)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s: is slurmctld running?"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mix") for s in states):
        return f"no idle Slurm node (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    if not (ROOT / ".venv" / "bin" / "flexmarl").exists():
        return "the batch script runs .venv/bin/flexmarl, which is missing"
    return ""


WHY_NOT = why_no_slurm()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_batch_script_places_controller_and_workers_and_the_run_replays(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    env = {**os.environ, "FLEXMARL_RUN_DIR": str(run_dir), "FLEXMARL_PORT": str(free_port()),
           "FLEXMARL_SKIP_SETUP": "1", "OMP_NUM_THREADS": "1"}
    sbatch = subprocess.Popen(
        ["sbatch", "--wait", "--nodes=1", f"--output={out}", "--job-name=flexmarl-test", "scripts/flexmarl.sbatch",
         "examples/default.toml", "--steps", "2", "--no-progress", "--set", "pipeline.queries_per_step=4"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = sbatch.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        sbatch.kill()
        output, _ = sbatch.communicate()
    finally:
        job = re.search(r"Submitted batch job (\d+)", output or "")
        if sbatch.returncode != 0 and job:  # ours, by its id
            subprocess.run(["scancel", job.group(1)], capture_output=True, timeout=30)
    log = out.read_text(errors="replace")[-4000:] if out.exists() else "(no job output)"
    assert sbatch.returncode == 0, f"{output}\n--- job output\n{log}"
    address = (run_dir / "controller.address").read_text().strip()
    assert address.startswith("tcp://") and not address.startswith("tcp://127.")  # off loopback: CURVE on

    events, damage = read_events(run_dir / "events.log")
    assert damage is None
    roles = sorted(e.role for e in events if isinstance(e, ev.WorkerJoined))
    assert roles == ["rollout", "rollout", "rollout", "trainer"]
    steps = {(e.agent, e.version) for e in events if isinstance(e, ev.OptimizerStep)}
    assert steps == {(a, v) for a in ("planner", "solver", "checker") for v in (1, 2)}
    assert replay.check(events) is None
