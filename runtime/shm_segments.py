"""The shared-memory files workers create, named by their creator's pid, and their
clean-up; importable without torch (the controller's launcher uses it).

- A parameter segment is a file `<shm_dir>/flexmarl-param-<pid>-<rest>`, <pid> being its
  publisher's. A publisher unlinks its own on close() or at exit; one killed outright
  cannot, and its files stay until `remove_orphan_segments` finds them (until then another
  worker can still load a parked copy from them, so only the launcher that started the
  dead publisher removes them, once it stops).
- A rollout engine's own directories, `<memory_dir()>/flexmarl-lora-<pid>-<rest>` (the
  adapters it hands vLLM) and `flexmarl-cancel-<pid>-<rest>` (its receive cancellations),
  are no one else's: the engine removes them when it closes, and after a crash the
  launcher removes them as soon as it sees the process gone, or the next worker started
  on the host does (`remove_orphan_engine_dirs`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

SEGMENT_PREFIX = "flexmarl-param-"
LORA_PREFIX = "flexmarl-lora-"
CANCEL_PREFIX = "flexmarl-cancel-"


def memory_dir() -> str:
    """Where a rollout engine's directories go: memory-backed /dev/shm where the host has
    it (vLLM loads adapters from a path; the run's disk is never written), else the temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def remove_orphan_segments(shm_dir: str = "/dev/shm", pids: Iterable[int] | None = None) -> list[str]:
    """Unlink parameter segments whose publisher is no longer running; returns what was
    removed. With `pids`, only those publishers' segments are considered. Trusts this
    host's pid namespace: call it where the workers ran."""
    return _remove_orphans(shm_dir, (SEGMENT_PREFIX,), pids)


def remove_orphan_engine_dirs(pids: Iterable[int] | None = None, directory: str | None = None) -> list[str]:
    """Remove the adapter and cancellation directories of rollout engines no longer
    running (with `pids`, only those processes'); returns what was removed."""
    return _remove_orphans(directory or memory_dir(), (LORA_PREFIX, CANCEL_PREFIX), pids)


def _remove_orphans(directory: str, prefixes: tuple[str, ...], pids: Iterable[int] | None) -> list[str]:
    only = None if pids is None else {int(p) for p in pids}
    removed = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
        pid = entry.name.removeprefix(prefix).split("-")[0] if prefix else ""
        if not pid.isdigit() or (only is not None and int(pid) not in only) or pid_alive(int(pid)):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.path)
        except FileNotFoundError:
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by someone else
    return True
