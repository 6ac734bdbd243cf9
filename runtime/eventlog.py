"""The event log on disk: an append-only writer for the controller's event loop, and a reader.

File format (all integers little-endian u32)::

    header   b"FLXEVLOG" + format version
    frame    [length][body][crc32 of length bytes + body]
    frame    ...

A frame's body is a msgpack array of the events of one write (format 3; formats 1 and 2,
still read, hold one event per frame). One checksum and one decoder call per write, not per
event: reading a log of a large run is mostly decoding, and msgspec decodes an array of
events in one call far faster than the same events one frame at a time. A frame holds at
most ``MAX_EVENTS_PER_FRAME`` events, so damage costs at most that many before it.

When a segment would pass ``max_bytes_per_segment`` the writer continues in ``events.log.1``,
``events.log.2``, ... (each with its own header); the reader reads the base path and then
every numbered segment in order. A frame never straddles two segments.

Writing: ``emit`` is synchronous and cheap (stamp, encode, append to a memory buffer), so
the controller can log a transition right before acting on it without awaiting. The disk
is touched only by ``run()`` (a background task the controller owns) and ``flush()``, both
through ``asyncio.to_thread``, one write at a time and in emit order; the writer thread frames
and checksums what it writes. ``run()`` gathers what
``write_interval_s`` brings into one write: every hand-off to the writer thread costs the
event loop a switch of the interpreter lock, and at thousands of events a second one per
event would (a crash loses at most that interval's events; ``flush()`` loses none). A write error is
fatal: a run whose log has holes can be neither replayed nor audited, so ``run()``,
``flush()`` and later ``emit`` calls raise ``EventLogError`` instead of dropping events.

Reading: ``read_events`` returns every event of every intact frame plus a message naming
each damage (file, byte offset, reason). Damage in the middle (a flipped bit, zeroed or
lost bytes with intact frames after them) is passed over: the reader finds the next frame
whose length, checksum and sequence numbers hold, and puts an ``EventsLost`` event naming
the events the damage held where they were (replay leaves out the batches it split). A
torn tail after a crash ends the log. A resumed run (``append=True``) keeps every intact
frame, cuts only a torn tail, and ``lost`` says what the damage took, for the resume to
record.

This module knows the framing, not what events mean; event types live in ``events``. The
writer's methods import asyncio themselves: a reader (``flexmarl replay``) never needs it.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

import msgspec

from . import collector
from .events import EVENT_NAMES, FORMAT_VERSION, AnyEvent, Event, EventsLost
from .legacy_events import TYPED_FORMAT, AnyLegacyEvent, LegacyReader

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

MAGIC = b"FLXEVLOG"
_HEADER = struct.Struct("<8sI")
_U32 = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
FRAME_OVERHEAD = 2 * _U32.size
# No event comes near this; a larger length field means the frame is damaged, and
# refusing it keeps a flipped bit from making the reader allocate gigabytes.
MAX_FRAME_BYTES = 64 * 1024 * 1024
# A write is cut into frames of at most this many events or bytes (whichever comes first).
MAX_EVENTS_PER_FRAME = 4096
FRAME_BYTES = 1024 * 1024
# The first format whose frames hold an array of events.
BATCHED_FORMAT = 3
# Past damage, the reader looks for the next frame among lengths up to this (a frame holds
# at most FRAME_BYTES of events, unless one event alone is larger): a wrong guess costs a
# checksum over that many bytes.
RESYNC_FRAME_BYTES = 4 * FRAME_BYTES
# The first byte of a frame's body: a msgpack array (format 3) or map (formats 1 and 2).
_ARRAY_STARTS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_STARTS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


class EventLogError(Exception):
    """The event log cannot be written. Fatal for the run: events would be lost."""


class EventLogVersionError(Exception):
    """The log was written in a newer format than this FlexMARL can read."""


def segment_path(path: str | Path, index: int) -> Path:
    path = Path(path)
    return path if index == 0 else path.with_name(f"{path.name}.{index}")


def segment_paths(path: str | Path) -> list[Path]:
    """The base log and its numbered segments, in order, up to the first missing one."""
    paths, index = [], 0
    while segment_path(path, index).exists():
        paths.append(segment_path(path, index))
        index += 1
    return paths


def encode_frame(*bodies: bytes) -> bytes:
    """One frame of the current format holding the given encoded events, in order."""
    return _frame(_array_header(len(bodies)) + b"".join(bodies))


def _frame(body: bytes) -> bytes:
    length = _U32.pack(len(body))
    return length + body + _U32.pack(zlib.crc32(body, zlib.crc32(length)))


def _array_header(n: int) -> bytes:
    """The msgpack array header of ``n`` elements (the bodies after it are its elements)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def frames_of(bodies: list[bytes], room: int = FRAME_BYTES) -> list[bytes]:
    """The frames that hold ``bodies`` (encoded events) in order: arrays of events cut at
    ``MAX_EVENTS_PER_FRAME`` events or ``room`` bytes."""
    frames, start, size = [], 0, 0
    for i, body in enumerate(bodies):
        if i > start and (size + len(body) > room or i - start >= MAX_EVENTS_PER_FRAME):
            frames.append(encode_frame(*bodies[start:i]))
            start, size = i, 0
        size += len(body)
    if start < len(bodies):
        frames.append(encode_frame(*bodies[start:]))
    return frames


# ---------------------------------------------------------------- writer


class EventLog:
    """Append-only event log writer. Use from one event loop::

        log = EventLog(run_dir / "events.log")
        writer = asyncio.create_task(log.run(), name="event-log")
        log.emit(RunStarted(...))      # sync; stamps seq and t
        await log.flush()              # on disk and fsynced (every optimizer step)
        await log.close()              # flushes; run() then returns

    Buffering: emit never waits, so the buffer is bounded by failing instead:
    past ``max_buffered_bytes`` not yet written (the disk stalls, or nobody runs ``run()``)
    emit raises EventLogError.

    An existing log at ``path`` (and its numbered segments) is replaced when the first
    write happens, so a reused run directory never mixes two runs in one log; with
    ``append=True`` (a resumed run) it is continued instead: seq and t go on from its last
    intact event, a torn tail left by a crash is cut off first, and damage before it stays
    where it is (the intact frames after it are kept); ``lost`` names what it held.
    """

    def __init__(self, path: str | Path, *, max_bytes_per_segment: int = 64 * 1024 * 1024,
                 max_buffered_bytes: int = 256 * 1024 * 1024,
                 clock: Callable[[], float] = time.monotonic, append: bool = False,
                 write_interval_s: float = 0.05) -> None:
        import asyncio

        if max_bytes_per_segment <= HEADER_BYTES:
            raise ValueError(f"max_bytes_per_segment must exceed the {HEADER_BYTES}-byte header")
        self.path = Path(path)
        self.max_bytes_per_segment = max_bytes_per_segment
        self.max_buffered_bytes = max_buffered_bytes
        self.write_interval_s = write_interval_s
        self._clock = clock
        self._t0 = clock()
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._pending: list[bytes] = []  # encoded events not yet written (framed by _write)
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._woken = False  # emit set _wake since run() last cleared it (one call to set per write, not per event)
        self._disk = asyncio.Lock()  # one write at a time keeps frames in emit order
        self._inflight: asyncio.Future | None = None
        # flush(): the fsynced write under way (every flush called before it starts shares
        # it), and how many events had been emitted when the last one that ended began.
        self._syncing: asyncio.Future | None = None
        self._synced_seq = -1
        self._error: BaseException | None = None
        self._closed = False
        # Touched only inside the writer thread (under _thread_lock):
        self._thread_lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._segment = 0
        self._segment_bytes = 0
        self._dir_dirty = False
        self._append_at: tuple[int, int] | None = None  # (segment, intact bytes) to continue
        # What damage before the point of appending held (EventsLost, for the resume to record).
        self.lost: list[EventsLost] = []
        self.torn: str | None = None  # the torn tail cut off, if any: where and why
        # What was read to append (for the resume to judge; it lets go of them): the events,
        # and the last segment's path, intact bytes and size.
        self.intact: list[Event] = []
        self.tail: tuple[Path, int, int] | None = None
        if append and segment_paths(self.path):
            reader = _SegmentReader()
            paths = segment_paths(self.path)
            for index, seg in enumerate(paths):
                reader.segment = index
                torn = reader.read(seg, last=index == len(paths) - 1)
            self.torn = torn
            self.lost = reader.lost
            self.intact = reader.events
            self.tail = (paths[-1], reader.good_end, paths[-1].stat().st_size)
            self._seq = reader.next_seq
            self._t0 = clock() - (reader.events[-1].t if reader.events else 0.0)
            self._append_at = (reader.segment, reader.good_end)

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def failed(self) -> bool:
        """A write failed: emit, flush and run raise from now on."""
        return self._error is not None

    def emit(self, event: Event) -> Event:
        """Stamps ``event`` with the next ``seq`` and the time, buffers it, returns it."""
        if self._error is not None:
            raise self._failed()
        self.emit_unless_failed(event)
        return event

    def emit_unless_failed(self, event: Event) -> None:
        """``emit``, or nothing once a write failed (``failed``): for what keeps emitting
        while the run stops with that failure. The controller's emit: one call per event."""
        if self._error is not None:
            return
        if self._closed:
            raise EventLogError(f"event log {self.path} is closed; {type(event).__name__} not logged")
        event.seq = self._seq
        event.t = self._clock() - self._t0
        body = self._encoder.encode(event)
        self._seq += 1
        self._pending.append(body)
        self._pending_bytes += len(body)
        if not self._woken:  # the writer wakes once per write
            self._woken = True
            self._wake.set()
        if self._pending_bytes > self.max_buffered_bytes:
            raise EventLogError(
                f"event log {self.path}: {self._pending_bytes} bytes emitted but not written; "
                f"the disk is stalled or the log's run() task is not running")

    async def run(self) -> None:
        """Writes buffered events as they come. Returns after ``close()``; raises
        EventLogError when a write fails (the caller should stop the run)."""
        import asyncio

        while True:
            await self._wake.wait()
            if not self._closed and self._error is None:
                await asyncio.sleep(self.write_interval_s)  # what the interval brings goes in the same write
            self._wake.clear()
            self._woken = False
            if self._error is not None:
                raise self._failed()
            if self._closed:
                return
            await self._drain(fsync=False)

    async def flush(self) -> None:
        """Everything emitted so far is written and fsynced when this returns.

        Calls made while one is under way share the next write-and-fsync (a group commit):
        every agent's optimizer step flushes, and with dozens of agents stepping together
        one each, in turn, would keep the last of them waiting for all the others' (each a
        hand-off to the writer thread, which waits for the interpreter lock while the loop
        is busy)."""
        import asyncio

        from .aio import retrieved

        wanted = self._seq
        while self._synced_seq < wanted:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync(self._seq))
                # Its callers may all be cancelled: a failure is kept (`failed`) and raised again.
                self._syncing.add_done_callback(retrieved)
            await asyncio.shield(self._syncing)

    async def _sync(self, seq: int) -> None:
        try:
            await self._drain(fsync=True)
            self._synced_seq = seq  # one at a time: each began after the last
        finally:
            self._syncing = None

    async def close(self) -> None:
        import asyncio

        if self._closed:
            return
        self._closed = True
        try:
            await self._drain(fsync=True)  # also leaves a header-only log when nothing was emitted
        finally:
            async with self._disk:
                await asyncio.to_thread(self._close_file)
            self._wake.set()  # lets run() return

    async def _drain(self, fsync: bool) -> None:
        import asyncio

        async with self._disk:
            # A write whose awaiting task was cancelled goes on in its thread; wait for it
            # so frames still reach the file in emit order.
            if self._inflight is not None and not self._inflight.done():
                await asyncio.wait([self._inflight])
            if self._error is not None:
                raise self._failed()
            bodies, self._pending, self._pending_bytes = self._pending, [], 0
            if not bodies and not fsync:
                return
            self._inflight = asyncio.ensure_future(asyncio.to_thread(self._write, bodies, fsync))
            self._inflight.add_done_callback(self._note_failure)
            await asyncio.shield(self._inflight)

    def _failed(self) -> EventLogError:
        error = EventLogError(f"event log {self.path} failed earlier: {self._error}")
        error.__cause__ = self._error
        return error

    def _note_failure(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._error = fut.exception()
            self._wake.set()  # run() raises even when flush() was the one that failed

    # -- everything below runs in the writer thread

    def _write(self, bodies: list[bytes], fsync: bool) -> None:
        """Frames the encoded events and writes them."""
        with self._thread_lock:
            current = segment_path(self.path, self._segment)
            try:
                if self._file is None:
                    self._start()
                assert self._file is not None  # _start opened it; _rotate replaces it with the next
                # Each frame fits an empty segment (one event larger than a segment excepted).
                room = min(FRAME_BYTES, self.max_bytes_per_segment - HEADER_BYTES - FRAME_OVERHEAD - 5)
                frames = frames_of(bodies, room=room)
                data = b"".join(frames)
                if self._segment_bytes + len(data) <= self.max_bytes_per_segment:  # the common case: one write
                    frames = [data]
                for frame in frames:  # a frame never straddles two segments
                    if (self._segment_bytes + len(frame) > self.max_bytes_per_segment
                            and self._segment_bytes > HEADER_BYTES):
                        self._rotate()
                        current = segment_path(self.path, self._segment)
                    self._file.write(frame)
                    self._segment_bytes += len(frame)
                self._file.flush()  # in the OS after every batch: survives a controller crash
                if fsync:
                    os.fsync(self._file.fileno())
                    self._sync_dir()
            except OSError as exc:
                raise EventLogError(
                    f"cannot write the event log {current}: {exc.strerror or exc}; "
                    f"the run stops since it could not be replayed (free disk space?)") from exc

    def _start(self) -> None:
        if self._append_at is not None:
            self._continue(*self._append_at)
            return
        stale = segment_paths(self.path)
        for old in reversed(stale[1:]):
            old.unlink()
        if stale:
            log.warning("replacing the existing event log %s (%d segments)", self.path, len(stale))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open_segment(0)

    def _open_segment(self, index: int) -> None:
        self._segment = index
        self._file = open(segment_path(self.path, index), "wb")
        self._file.write(_HEADER.pack(MAGIC, FORMAT_VERSION))
        self._segment_bytes = HEADER_BYTES
        self._dir_dirty = True

    def _continue(self, index: int, intact: int) -> None:
        """Appends to segment `index` (the last) after its `intact` bytes; what follows them
        (a torn frame) is removed. A segment of an older format, or one whose header is
        damaged, is left as it is and the log goes on in a new segment of this one."""
        if intact < HEADER_BYTES:
            if segment_path(self.path, index).stat().st_size < HEADER_BYTES:
                self._open_segment(index)  # torn while its header was written: nothing was in it
            else:
                self._open_segment(index + 1)  # its header is damaged: kept as it is, the reader passes it over
            return
        self._segment = index
        self._file = open(segment_path(self.path, index), "r+b")
        self._file.truncate(intact)
        self._file.seek(intact)
        self._segment_bytes = intact
        (version,) = _U32.unpack(os.pread(self._file.fileno(), _U32.size, len(MAGIC)))
        if version < FORMAT_VERSION:
            self._rotate()

    def _rotate(self) -> None:
        # The finished segment is made durable before the next exists, so a reader never
        # finds a segment N+1 after a segment N that lost its tail.
        assert self._file is not None  # rotated only while writing to it
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._open_segment(self._segment + 1)

    def _sync_dir(self) -> None:
        if not self._dir_dirty or os.name != "posix":
            return
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_dirty = False

    def _close_file(self) -> None:
        with self._thread_lock:
            f, self._file = self._file, None
            if f is None:
                return
            try:
                f.close()
            except OSError as exc:
                # After a failed write the buffer still holds what could not be written;
                # that failure was reported already.
                if self._error is None:
                    raise EventLogError(f"cannot close the event log {f.name}: {exc}") from exc


# ---------------------------------------------------------------- reader


def read_events(path: str | Path) -> tuple[list[Event], str | None]:
    """All events of the log at ``path`` (base file and numbered segments), in order.

    Stops at the first damage and says where in the second element (None when the log
    is whole). Events of kinds this version does not know are skipped and mentioned.
    Raises FileNotFoundError when there is no log, EventLogVersionError when it was
    written by a newer FlexMARL.
    """
    paths = segment_paths(path)
    if not paths:
        raise FileNotFoundError(f"no event log at {path}")
    reader = _SegmentReader()
    with collector.paused():  # decoding makes no cycles, only many lists
        for index, seg in enumerate(paths):
            torn = reader.read(seg, last=index == len(paths) - 1)
        problems = [f"{lost.segment}: byte offset {lost.offset}: {lost.why}; {_held(lost)}; read on after it"
                    for lost in reader.lost]
        if torn is not None:
            problems.append(torn)
        reader.place_gap(-1)  # damage no intact frame followed: in its place, at the end
        return reader.events, reader.with_skipped_note("; ".join(problems) or None)


def _held(lost: EventsLost) -> str:
    if lost.next_seq < 0:
        return f"the events from seq {lost.first_seq} on were in it"
    n = lost.next_seq - lost.first_seq
    return f"{n} event{'s' * (n != 1)} (seq {lost.first_seq}-{lost.next_seq - 1}) were in its {lost.nbytes} bytes"


class LogTail:
    """Follows a log that is being written: each `poll()` returns the events appended since
    the last one (whole frames only: a frame still being written is read next time). For
    watching a live run without reading its whole log again and again. `poll(max_bytes)`
    reads a slice of about that many bytes (at least one whole frame), so a long log can be
    read a slice at a time; `bytes_read` says how far it got."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._segment = 0
        self._offset = 0
        self._reader = _SegmentReader()
        self.bytes_read = 0  # over every segment: headers and whole frames read so far

    def poll(self, max_bytes: int | None = None) -> list[Event]:
        left = max_bytes
        while left is None or left > 0:
            seg = segment_path(self.path, self._segment)
            # Asked before reading: a segment is complete once the next one exists.
            has_next = segment_path(self.path, self._segment + 1).exists()
            try:
                data, whole = self._slice(seg, left)
            except FileNotFoundError:
                break
            start = self._offset
            if self._offset == 0:
                if len(data) < HEADER_BYTES:
                    break
                problem = self._reader.header(data, seg)
                if problem is not None:
                    raise EventLogError(f"{seg}: byte offset {problem}")
                data, self._offset = data[HEADER_BYTES:], HEADER_BYTES
            off = 0
            while off < len(data):
                nxt = self._reader._read_frame(data, off)
                if isinstance(nxt, str):
                    break  # not yet complete (or damaged, or past the slice): tried again on the next poll
                off = nxt
            self._offset += off
            self.bytes_read += self._offset - start
            if left is not None:
                left -= self._offset - start
            if whole and off == len(data) and has_next:
                self._segment, self._offset = self._segment + 1, 0
                continue
            if whole or self._offset == start:
                break
        new, self._reader.events = self._reader.events, []
        return new

    @property
    def skipped(self) -> dict[str, int]:
        """Events of kinds this version does not know, passed over so far: kind -> count."""
        return self._reader.skipped

    def _slice(self, seg: Path, left: int | None) -> tuple[memoryview, bool]:
        """The bytes of `seg` after those read: all of them, or about `left` but never less
        than the next frame; and whether they run to the end of the file."""
        with open(seg, "rb") as fh:
            fh.seek(self._offset)
            if left is None:
                return memoryview(fh.read()), True
            want = max(left, HEADER_BYTES + _U32.size if self._offset == 0 else _U32.size)
            data = fh.read(want)
            at = HEADER_BYTES if self._offset == 0 else 0
            if len(data) == want and len(data) >= at + _U32.size:
                (length,) = _U32.unpack_from(data, at)
                frame = at + _U32.size + length + _U32.size
                if frame > want and length <= MAX_FRAME_BYTES:  # the next frame is larger than the slice
                    data += fh.read(frame - want)
                    want = frame
            return memoryview(data), len(data) < want


def _first_seq(items: list) -> int:
    """The seq of a frame's first event (one of a kind this version does not know: (kind, seq))."""
    return items[0][1] if type(items[0]) is tuple else items[0].seq


class _Decoders:
    """The decoders of one format's events: one at a time, an array."""

    def __init__(self, union: object) -> None:
        self.one = msgspec.msgpack.Decoder(union)
        self.array = msgspec.msgpack.Decoder(list[union])  # type: ignore[valid-type]


_TYPED = _Decoders(AnyEvent)


class _SegmentReader:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.decoders = _TYPED
        self.raw_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self.batched = True  # the format of the segment being read: an array of events a frame
        # Formats 1 to 3 (groups named by strings), read as format 4; None for format 4.
        self.legacy: LegacyReader | None = None
        self._legacy_decoders: _Decoders | None = None
        self.next_seq = 0
        self.skipped: dict[str, int] = {}
        self.segment = 0  # for appending: the segment read last and its intact bytes
        self.good_end = 0
        self.lost: list[EventsLost] = []  # damage passed over, in order (its events put in place)
        self._open_gap: EventsLost | None = None  # damage to a segment's end: closed by the next frame

    def with_skipped_note(self, problem: str | None) -> str | None:
        if not self.skipped:
            return problem
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.skipped.items()))
        note = f"skipped events of kinds this FlexMARL does not know ({kinds}); upgrade to see them"
        return note if problem is None else f"{problem}; {note}"

    def read(self, seg: Path, last: bool = True) -> str | None:
        """Reads one segment, passing over damage to the next intact frame (see the module
        docstring); what is wrong with its tail, if the log ends there torn (`last`)."""
        self.good_end = 0
        data = memoryview(seg.read_bytes())
        where = f"{seg}: byte offset"
        bad_header = self.header(data, seg)
        if bad_header is not None:
            if last:
                return f"{where} {bad_header}"
            self._damaged(seg, 0, len(data), bad_header.partition(": ")[2], self.next_seq)
            return None
        off = self.good_end = HEADER_BYTES
        while off < len(data):
            nxt = self._read_frame(data, off)
            if isinstance(nxt, str):
                expected = self.next_seq
                found = self._resync(data, off + 1)
                if found is None and last:
                    return f"{where} {off}: {nxt}; {len(self.events)} events read before it"
                end = len(data) if found is None else found
                self._damaged(seg, off, end, nxt, expected)
                if found is None:
                    return None
                nxt = self._read_frame(data, found)
                assert not isinstance(nxt, str)  # _resync read it
            off = self.good_end = nxt
        return None

    def _damaged(self, seg: Path, offset: int, end: int, why: str, first_seq: int) -> None:
        """Damage from `offset` to `end`: its events are from `first_seq` (the next expected)
        to the first of the next intact frame (filled in when that frame is read)."""
        gap = EventsLost(str(seg), offset, end - offset, first_seq, -1, why)
        self.lost.append(gap)
        self._open_gap = gap

    def place_gap(self, next_seq: int) -> None:
        """The open damage's EventsLost, its events ending before `next_seq` (-1: the log
        ended in it), put among the events where it was; nothing if none is open."""
        gap, self._open_gap = self._open_gap, None
        if gap is None:
            return
        gap.next_seq = next_seq
        gap.seq, gap.t = gap.first_seq, self.events[-1].t if self.events else 0.0
        self.events.append(gap)

    def _resync(self, data: memoryview, start: int) -> int | None:
        """The offset of the first intact frame at or after `start` (its length plausible,
        its checksum right, its events decodable and numbered on from the last read), or
        None: damage to the segment's end."""
        starts = _ARRAY_STARTS if self.batched else _MAP_STARTS
        size, unpack = len(data), _U32.unpack_from
        for off in range(start, size - FRAME_OVERHEAD):
            (length,) = unpack(data, off)
            if not 0 < length <= min(RESYNC_FRAME_BYTES, size - off - FRAME_OVERHEAD) or data[off + 4] not in starts:
                continue
            end = off + _U32.size + length + _U32.size
            (crc,) = unpack(data, end - _U32.size)
            if zlib.crc32(data[off + _U32.size:end - _U32.size], zlib.crc32(data[off:off + _U32.size])) != crc:
                continue
            items = self._decode(data[off + _U32.size:end - _U32.size])
            if isinstance(items, str) or not items:
                continue
            first = _first_seq(items)
            if first >= self.next_seq:
                self.next_seq = first  # what the damage held is counted from here on
                return off
        return None

    def header(self, data: memoryview, seg: Path) -> str | None:
        """Reads a segment's header (its format); says what is wrong with it, if anything."""
        if len(data) < HEADER_BYTES:
            return f"0: header truncated ({len(data)} of {HEADER_BYTES} bytes)"
        magic, version = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            return f"0: not a FlexMARL event log (magic bytes {bytes(magic)!r})"
        if version > FORMAT_VERSION:
            raise EventLogVersionError(
                f"{seg} was written by a newer FlexMARL (format {version}); upgrade to read it "
                f"(this one reads formats up to {FORMAT_VERSION})")
        if version < 1:
            return f"8: unknown format version {version}"
        self.batched = version >= BATCHED_FORMAT
        if version < TYPED_FORMAT:
            if self._legacy_decoders is None:
                self._legacy_decoders = _Decoders(AnyLegacyEvent)
            self.decoders, self.legacy = self._legacy_decoders, self.legacy or LegacyReader()
        else:
            self.decoders = _TYPED
        return None

    def _read_frame(self, data: memoryview, off: int) -> int | str:
        """The offset of the next frame, or why the frame at ``off`` is damaged (then none
        of its events is kept)."""
        left = len(data) - off
        if left < _U32.size:
            return f"truncated frame: {left} bytes where a frame length belongs"
        (length,) = _U32.unpack_from(data, off)
        if length > MAX_FRAME_BYTES:
            return f"damaged frame: implausible length {length}"
        end = off + _U32.size + length + _U32.size
        if end > len(data):
            return f"truncated frame: needs {end - off} bytes, the file ends after {left}"
        body = data[off + _U32.size:end - _U32.size]
        (crc,) = _U32.unpack_from(data, end - _U32.size)
        if zlib.crc32(body, zlib.crc32(data[off:off + _U32.size])) != crc:
            return "damaged frame: checksum mismatch"
        items = self._decode(body)
        if isinstance(items, str):
            return items
        seq, skipped = self.next_seq, []
        if self._open_gap is not None and items:  # after damage that ran to a segment's end: numbered on from here
            seq = max(seq, _first_seq(items))
        for item in items:
            if type(item) is tuple:  # an event of a kind this version does not know
                skipped.append(item[0])
                seq = item[1] + 1
            elif item.seq != seq:
                return f"sequence gap: expected seq {seq}, found {item.seq}"
            else:
                seq += 1
        for kind in skipped:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
        if self._open_gap is not None:  # the first frame after damage: what it held, in its place
            self.place_gap(_first_seq(items))
        if skipped:
            items = [e for e in items if type(e) is not tuple]
        if self.decoders is not _TYPED and self.legacy is not None:
            items = list(map(self.legacy, items))
        self.events += items
        self.next_seq = seq
        return end

    def _decode(self, body: memoryview) -> list | str:
        """A frame's events; one of a kind added after this version is (kind, seq)."""
        decoders = self.decoders
        try:
            return decoders.array.decode(body) if self.batched else [decoders.one.decode(body)]
        except msgspec.DecodeError as exc:
            error = exc
        try:
            raws = self.raw_decoder.decode(body) if self.batched else [body]
        except msgspec.DecodeError:
            return f"undecodable event body: {error}"
        items: list = []
        for raw in raws:
            try:
                items.append(decoders.one.decode(raw))
            except msgspec.DecodeError as exc:
                unknown = _unknown_kind(raw)
                if unknown is None:
                    return f"undecodable event body: {exc}"
                items.append(unknown)
        return items


def _unknown_kind(body: memoryview | msgspec.Raw) -> tuple[str, int] | None:
    """(kind, seq) when ``body`` is a well-formed event of a kind added after this version."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return None
    if (isinstance(raw, dict) and isinstance(raw.get("event"), str)
            and raw["event"] not in EVENT_NAMES and isinstance(raw.get("seq"), int)):
        return raw["event"], raw["seq"]
    return None
