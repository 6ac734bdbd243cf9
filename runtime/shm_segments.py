"""The parameter channel's shared-memory segment names and their clean-up, importable
without torch (the controller's launcher uses it).

A segment is a file `<shm_dir>/flexmarl-param-<pid>-<rest>`, <pid> being its publisher's.
A publisher unlinks its own on close() or at exit; one killed outright cannot, and its
files stay until `remove_orphan_segments` finds them (until then another worker can still
load a parked copy from them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SEGMENT_PREFIX = "flexmarl-param-"


def remove_orphan_segments(shm_dir: str = "/dev/shm", pids: Iterable[int] | None = None) -> list[str]:
    """Unlink segments whose publisher is no longer running; returns what was removed.
    With `pids`, only those publishers' segments are considered. Trusts this host's pid
    namespace: call it where the workers ran."""
    only = None if pids is None else {int(p) for p in pids}
    removed = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        pid = entry.name.removeprefix(SEGMENT_PREFIX).split("-")[0]
        if not entry.name.startswith(SEGMENT_PREFIX) or not pid.isdigit() or (only is not None and int(pid) not in only):
            continue
        if not pid_alive(int(pid)):
            try:
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
