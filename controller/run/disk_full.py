"""A full disk, told in one line: what could not be written, how much room is left, what
to free and the command that goes on from the last checkpoint.

`disk_full_line(exc, run_dir)` finds a full disk (ENOSPC or EDQUOT) anywhere in an error's
chain: its causes, the cause of a supervised task that ended, or a worker's error text
(a trainer writing a checkpoint reports it as text); None when the error is another.

It does not know what was being written: the error says.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from flexmarl.runtime.aio import TaskEnded

from ..train.checkpoints import latest_checkpoint

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def chain(exc: BaseException | None) -> list[BaseException]:
    """`exc`, then what caused it (a supervised task's failure, `raise ... from`), in order.
    An error raised while another was handled is not the other's effect: not followed."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.cause if isinstance(exc, TaskEnded) else exc.__cause__
    return seen


def is_disk_full(exc: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno in FULL_ERRNOS) or any(t in str(e) for t in FULL_TEXTS)
               for e in chain(exc))


def disk_full_line(exc: BaseException, run_dir: Path) -> str | None:
    if not is_disk_full(exc):
        return None
    errors = [e for e in chain(exc) if not isinstance(e, TaskEnded)] or [exc]
    written = next((e.filename for e in errors if isinstance(e, OSError) and e.filename), None)
    what = f"writing {written} failed" if written else _first_line(errors[0])
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    point = latest_checkpoint(run_dir)
    then = (f"`flexmarl run --resume {run_dir}` continues from the checkpoint of step {point.step}" if point
            else "start the run again (no checkpoint was written yet)")
    return (f"the disk holding {run_dir} is full ({free}): {what}. Free some space there (earlier runs, or "
            f"keep fewer checkpoints with run.keep_checkpoints), then {then}")


def _first_line(exc: BaseException) -> str:
    """What failed, as the error says it first (up to its advice, which this line replaces)."""
    text = str(exc).strip().splitlines()
    return text[0].split("; ")[0][:300] if text else type(exc).__name__
