"""Running a bench in bench/ as its own process, as the bench tests do."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def run_bench(script: str, *args: str, timeout: float = 600.0) -> str:
    """The bench's standard output; fails the test with the ends of both outputs if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    (path,) = BENCH.glob(f"*/{script}")  # bench/KIND/NAME.py
    done = subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done.stdout


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
