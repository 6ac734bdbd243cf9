"""Files replaced whole: written under a temporary name beside the file, then renamed over
it, so a reader (or a crash, or a full disk) never leaves a half-written file behind; the
old file stays until the new one is complete.

It does not know what the files hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], object], *, durable: bool = False) -> None:
    """`write(tmp)` writes the new content to `tmp`, which then replaces `path`. With
    `durable`, the content and the rename are synced to the disk first. A failure removes
    `tmp` and leaves `path` as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_dir(path.parent)


def write_text_atomically(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text), durable=durable)


def sync_dir(path: str | os.PathLike) -> None:
    """Makes the names in a directory (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
