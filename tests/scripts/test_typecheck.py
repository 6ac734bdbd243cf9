"""The type checker over controller/, runtime/ and workers/ (scripts/typecheck.py, mypy as
configured in pyproject.toml): the code holds to its interfaces, and a call that breaks
one is caught."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def typecheck(root: Path) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "scripts/typecheck.py"], cwd=root, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out.returncode, out.stdout + out.stderr


def test_the_controller_runtime_and_workers_type_check():
    code, out = typecheck(ROOT)
    assert code == 0, out


def break_call(path: Path, call: str, wrong: str) -> None:
    source = path.read_text()
    assert call in source
    path.write_text(source.replace(call, wrong, 1))


def test_calls_that_break_a_collaborators_protocol_or_class_are_caught(tmp_path):
    for name in ("controller", "runtime", "workers", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    if (ROOT / ".mypy_cache" / "cache").is_dir():  # a warm start: seconds instead of a cold run
        shutil.copytree(ROOT / ".mypy_cache" / "cache", tmp_path / ".mypy_cache" / "cache")
    # the server, through the WorkerCalls protocol; the allocator, by its class
    break_call(tmp_path / "controller" / "train" / "allocator.py", "self.server.next_request_id()", "self.server.next_request_id(1)")
    break_call(tmp_path / "controller" / "train" / "pipeline.py", "self.allocator.release(self.agent)",
               "self.allocator.release(self.agent, 1)")
    code, out = typecheck(tmp_path)
    assert code == 1, out
    assert 'controller/train/allocator.py' in out and '"next_request_id" of "WorkerCalls"' in out, out
    assert 'controller/train/pipeline.py' in out and '"release" of "TrainerAllocator"' in out, out
