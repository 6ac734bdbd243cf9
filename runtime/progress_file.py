"""A count carried from a child process to its parent through a file (the model builder's
warm-up steps, shown by the controller while it waits): one line "DONE TOTAL", replaced
atomically, at the path the parent puts in the child's FLEXMARL_PROGRESS_FILE.

It does not know what is counted or how it is shown.
"""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import write_text_atomically

PROGRESS_FILE_ENV = "FLEXMARL_PROGRESS_FILE"


def write_progress(done: int, total: int) -> None:
    """In the child: its count, where the parent asked for it (nothing otherwise)."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    write_text_atomically(path, f"{done} {total}\n")


def read_progress(path: str | Path) -> tuple[int, int] | None:
    """In the parent: the child's last count, or None before its first."""
    try:
        done, total = Path(path).read_text().split()
        return int(done), int(total)
    except (OSError, ValueError):
        return None
