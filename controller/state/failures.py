"""What a user is shown when their code fails: the frame of theirs that raised, and the
error that stops a run that cannot learn.

`user_frame(exc)` is "FILE:LINE in FUNCTION" of the innermost frame of the traceback that
is the user's: not FlexMARL's own source, not the standard library and, where any frame
qualifies, not an installed package (a library the workflow called). `user_traceback(exc)`
is the traceback with FlexMARL's and the standard library's frames left out, ending with
the exception line, as Python prints it.

`RunFailed` is the error that ends a run which cannot learn (too many failed episodes in a
step, or an agent with no sample in a step); its message carries the first failure's
user traceback and what to do.

`too_many_failures(...)` is the rule for a step's failed episodes (more than
`pipeline.max_failed_share` of them), with the error it raises; the episode producer and
the agents' pipelines both apply it, so whichever sees a hopeless step first says the same.

It does not know the workflow, the store or how failures are counted.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# FlexMARL's own folders (controller/, runtime/, workers/), resolved through any symlink.
_OWN = tuple(str(Path(__file__).resolve().parents[2] / p) + "/" for p in ("controller", "runtime", "workers"))
_STDLIB = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + "/" for k in ("stdlib", "platstdlib"))
_INSTALLED = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + "/" for k in ("purelib", "platlib"))


class RunFailed(RuntimeError):
    """The run cannot learn and was stopped; the message says why and what to do."""


def _resolved(filename: str) -> str:
    try:
        return str(Path(filename).resolve())
    except OSError:
        return filename


def _ours_or_stdlib(filename: str) -> bool:
    path = _resolved(filename)
    return path.startswith(_OWN) or (path.startswith(_STDLIB) and not path.startswith(_INSTALLED))


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(exc.__traceback__) if not _ours_or_stdlib(f.filename)]


def user_frame(exc: BaseException) -> str:
    """'FILE:LINE in FUNCTION' of the innermost frame of the user's, or '' if none."""
    return _innermost(_frames(exc))


def calling_user_frame() -> str:
    """The same for the code running now: the user's frame that called into FlexMARL."""
    return _innermost([f for f in traceback.extract_stack() if not _ours_or_stdlib(f.filename)])


def _innermost(frames: list[traceback.FrameSummary]) -> str:
    own = [f for f in frames if not _resolved(f.filename).startswith(_INSTALLED)]
    shown = own or frames
    if not shown:
        return ""
    frame = shown[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


def user_traceback(exc: BaseException) -> str:
    """The traceback without FlexMARL's and the standard library's frames, then the error."""
    lines = traceback.format_list(_frames(exc))
    error = "".join(traceback.format_exception_only(type(exc), exc)).rstrip()
    return ("Traceback (your code):\n" + "".join(lines) if lines else "") + error


def too_many_failures(step: int, failed: int, episodes: int, max_share: float, first: str) -> RunFailed | None:
    """The error that stops the run when more than `max_share` of a step's `episodes`
    failed (already, or in the end), `first` being the first failure; None otherwise."""
    if max_share >= 1.0 or failed <= max_share * episodes:
        return None
    return RunFailed(f"the run cannot learn: {failed} of the {episodes} episodes of step {step} failed, more than "
                     f"pipeline.max_failed_share = {max_share}. The first failure:\n{first}\n"
                     f"Fix the workflow (each failure is also logged above), or raise pipeline.max_failed_share "
                     f"(1.0: never stop) if failures are expected.")
