"""Following a run's files as they grow: JSON lines (metrics.jsonl, samples.jsonl) and the
event log, each read from where the last read stopped, a bounded slice at a time.

A file can also start over under the reader: a resumed run rewrites metrics.jsonl and
samples.jsonl up to its checkpoint (a new file in the old one's place), and a new run in a
reused directory replaces all three. A reader notices by the file's identity and first
bytes, and says so (`replaced`); whoever keeps what was read from it then starts again.

Files are opened for reading only: nothing here writes to a run directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec

from flexmarl.runtime.eventlog import LogTail, segment_paths
from flexmarl.runtime.events import Event

_fast = msgspec.json.Decoder().decode  # a few times faster than json.loads


def _decode(line: bytes) -> Any:
    """A JSON line; Python's json writes a float that is not finite as NaN or Infinity,
    which only its own reader takes."""
    try:
        return _fast(line)
    except msgspec.DecodeError:
        try:
            return json.loads(line)
        except ValueError:
            return None

# Enough of a file's beginning to tell it from another file written in its place (the
# event log's header and first frame: the run's start).
_SIGNATURE_BYTES = 256


class Signature:
    """A file's identity: its inode and its first bytes. `changed()` says whether the file
    at the path is no longer the one first seen (replaced, cut back, or gone)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, bytes] | None = None

    def changed(self, read_up_to: int) -> bool:
        """Whether the first `read_up_to` bytes read of the file are no longer its start."""
        try:
            with open(self.path, "rb") as fh:
                stat = os.fstat(fh.fileno())
                head = fh.read(_SIGNATURE_BYTES)
        except FileNotFoundError:
            gone, self._seen = self._seen is not None, None
            return gone and read_up_to > 0
        seen, self._seen = self._seen, (stat.st_ino, head)
        if seen is None or read_up_to == 0:
            return False
        common = min(len(seen[1]), len(head))  # the start grows with the file
        return stat.st_ino != seen[0] or stat.st_size < read_up_to or head[:common] != seen[1][:common]


class LineTail:
    """The JSON objects of a JSON-lines file that is appended to, each with its byte offset,
    from the whole lines written since the last `poll` (a line still being written is read
    next time; a line that is not a JSON object is skipped and counted in `bad_lines`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.bad_lines = 0
        self.more = False  # the last poll stopped at its limit, not at the end of the file
        self._signature = Signature(path)

    def poll(self, max_bytes: int = 1 << 22) -> tuple[bool, list[tuple[int, dict[str, Any]]]]:
        """(replaced, rows): `replaced` when the file started over (its rows read before
        are no longer in it; these rows are its rows from the start)."""
        replaced = self._signature.changed(self.offset)
        if replaced:
            self.offset = 0
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(max_bytes)
        except FileNotFoundError:
            self.more = False
            return replaced, []
        self.more = len(data) == max_bytes
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) == max_bytes:  # one line longer than a slice: read it whole
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                line = fh.readline()
            data, end = line, len(line) if line.endswith(b"\n") else 0
        rows: list[tuple[int, dict[str, Any]]] = []
        at = self.offset
        for line in data[:end].split(b"\n")[:-1]:
            row = _decode(line)
            if isinstance(row, dict):
                rows.append((at, row))
            elif line.strip():
                self.bad_lines += 1
            at += len(line) + 1
        self.offset += end
        return replaced, rows

    def read_at(self, offset: int) -> dict[str, Any] | None:
        """The row that starts at `offset` (read again on demand: texts stay on disk)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(offset)
                row = _decode(fh.readline())
        except OSError:
            return None
        return row if isinstance(row, dict) else None


class EventTail:
    """The event log's events since the last `poll`, a slice of at most about `max_bytes`
    at a time (LogTail), and how much of the log that is."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail = LogTail(path)
        self._signature = Signature(path)
        self.problem = ""  # why the log cannot be read further (a newer format, damage)

    def poll(self, max_bytes: int) -> tuple[bool, list[Event]]:
        """(replaced, events): `replaced` when the log started over (a new run in this
        directory): these events are the new log's from its start."""
        # The base file's start names the log: its header and first frame (the run's start),
        # whatever segment the tail is in.
        replaced = self._signature.changed(min(self._tail.bytes_read, _SIGNATURE_BYTES))
        if replaced:
            self._tail, self.problem = LogTail(self.path), ""
        if self.problem:
            return replaced, []
        try:
            return replaced, self._tail.poll(max_bytes)
        except Exception as exc:  # a newer format, a damaged header: said on the page, not raised
            self.problem = str(exc)
            return replaced, []

    @property
    def bytes_read(self) -> int:
        return self._tail.bytes_read

    @property
    def skipped(self) -> dict[str, int]:
        """Events of kinds this FlexMARL does not know, passed over: kind -> count."""
        return dict(self._tail.skipped)

    def size(self) -> int:
        total = 0
        for path in segment_paths(self.path):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total
