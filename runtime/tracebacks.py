"""The user's part of a traceback: the frame of theirs that raised, and their frames alone.

`user_frame(exc)` is "FILE:LINE in FUNCTION" of the innermost frame of the traceback that
is the user's: not FlexMARL's own source, not the standard library and, where any frame
qualifies, not an installed package (a library the user's code called).
`user_traceback(exc)` is the traceback with FlexMARL's and the standard library's frames
left out, ending with the exception line, as Python prints it. The controller names the
frame of a failed episode with them; an environment worker names the frame of a failed
call the same way.

It does not know where the code ran or what it was for.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# FlexMARL's own folders (controller/, runtime/, workers/), resolved through any symlink.
_OWN = tuple(str(Path(__file__).resolve().parents[1] / p) + "/" for p in ("controller", "runtime", "workers"))
_STDLIB = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + "/" for k in ("stdlib", "platstdlib"))
_INSTALLED = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + "/" for k in ("purelib", "platlib"))


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
