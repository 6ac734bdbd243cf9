"""The shared-memory files workers create, named by their creator's pid, and their
clean-up; importable without torch (the controller's launcher uses it).

- A parameter segment is a file `<shm_dir>/flexmarl-param-<pid>-o<owner>-<rest>`, <pid>
  being its publisher's and <owner> the pid of the controller whose launcher started it
  (`OWNER_ENV`; 0 for a worker started by hand). A publisher unlinks its own on close() or
  at exit; one killed outright cannot, and its files stay until someone removes them.
  While the owner runs, another worker may still load a parked copy from them, so only
  the owner's launcher removes them (`remove_orphan_segments`, once it stops); once the
  owner is gone too, no one can, and the next worker started on the host removes them
  (`remove_abandoned_segments`).
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
# Set by the launcher for the workers it starts (and their ranks): the controller's pid.
OWNER_ENV = "FLEXMARL_OWNER_PID"
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


def segment_stem() -> str:
    """How this process's parameter segments begin: the prefix, its pid and its owner's."""
    owner = os.environ.get(OWNER_ENV, "0")
    return f"{SEGMENT_PREFIX}{os.getpid()}-o{owner if owner.isdigit() else 0}-"


def remove_abandoned_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink parameter segments whose publisher and owner are both gone (no controller
    can hand them out any more); returns what was removed."""
    removed = []
    for path in remove_candidates(shm_dir, (SEGMENT_PREFIX,)):
        owner = os.path.basename(path).removeprefix(SEGMENT_PREFIX).split("-")[1:2]
        if owner and owner[0][:1] == "o" and owner[0][1:].isdigit() and int(owner[0][1:]) > 0 \
                and not pid_alive(int(owner[0][1:])):
            removed += _remove([path])
    return removed


def remove_orphan_engine_dirs(pids: Iterable[int] | None = None, directory: str | None = None) -> list[str]:
    """Remove the adapter and cancellation directories of rollout engines no longer
    running (with `pids`, only those processes'); returns what was removed."""
    return _remove_orphans(directory or memory_dir(), (LORA_PREFIX, CANCEL_PREFIX), pids)


def _remove_orphans(directory: str, prefixes: tuple[str, ...], pids: Iterable[int] | None) -> list[str]:
    return _remove(remove_candidates(directory, prefixes, pids))


def remove_candidates(directory: str, prefixes: tuple[str, ...], pids: Iterable[int] | None = None) -> list[str]:
    """Paths in `directory` named with one of `prefixes` and the pid of a process that is
    gone (with `pids`: one of those)."""
    only = None if pids is None else {int(p) for p in pids}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
        pid = entry.name.removeprefix(prefix).split("-")[0] if prefix else ""
        if pid.isdigit() and (only is None or int(pid) in only) and not pid_alive(int(pid)):
            found.append(entry.path)
    return found


def _remove(paths: list[str]) -> list[str]:
    removed = []
    for path in paths:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
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
