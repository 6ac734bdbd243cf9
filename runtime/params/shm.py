"""The "shm" transport: same host, CPU memory. A bucket is a file in /dev/shm (a
segment: one header page, then the bytes), written once by its publisher and mapped
read-only by receivers, which check its seal before and after reading.

A publisher whose tensors already live in shared memory (a `SharedBucket`, e.g. a
trainer's parameters) publishes without any copy: it seals the segment and a thread writes
the checksum into its header moments later, while receivers already read. The one copy
left is the receiver's; `receive_into(..., atomic=False)` also folds the verification into
it, for destinations that are discarded on error.

This module does not know who receives, or when a publication may end: the channel's
caller decides.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping

import msgspec
import numpy as np
import torch

from .bucket import (
    ALIGN,
    SparePool,
    checksum,
    compare,
    copy_summing,
    pack_into,
    plan_layout,
    round_up,
    unlink_quietly,
    unpack,
)
from .shm_segments import pid_alive, segment_stem
from .transport import Transport
from .types import Location, ParamHandle, ParamTransferError, describe

__all__ = ["SharedBucket", "ShmTransport"]

_SHM_HEADER = 4096  # one page: magic, seal, size, checksum, ready; the bucket starts page-aligned
_SHM_FIELDS = struct.Struct("<8sQQQQ")  # ready: 1 once the checksum field is final
_SHM_MAGIC = b"FLXPSHM1"


def _alive(location: Location) -> bool:
    """False only when `location`'s process is known to be gone (this host only)."""
    return location.host != socket.gethostname() or pid_alive(location.pid)


class _Segment:
    """A file in shm_dir: one header page (magic, seal, size, checksum), then one bucket.
    Only its publisher maps it writable; receivers check the seal before and after
    reading, so a segment released and reused under them is noticed."""

    def __init__(self, path: str, total: int):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, _SHM_HEADER + total)
            self.mm = mmap.mmap(fd, _SHM_HEADER + total, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path, self.total = path, total
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_SHM_HEADER) if total else torch.empty(0, dtype=torch.uint8)
        self.live_key: str | None = None  # the publication sealed into it; at most one
        self.bucket: SharedBucket | None = None  # the bucket whose tensors live here, if any
        self.checksummed: threading.Event | None = None  # set once a pending checksum is written (or abandoned)
        self.abandoned = threading.Event()  # the pending checksum is no longer wanted: stop it

    def seal(self, key: str, checksum_: int | None, total: int) -> None:
        """Seals the segment's first `total` bytes as publication `key`. checksum_ None: it
        follows (`finish_checksum`); receivers wait for it."""
        _SHM_FIELDS.pack_into(self.mm, 0, _SHM_MAGIC, _seal_of(key), total, checksum_ or 0,
                              int(checksum_ is not None))

    def finish_checksum(self, value: int) -> None:
        struct.pack_into("<Q", self.mm, 24, value)
        struct.pack_into("<Q", self.mm, 32, 1)  # after the value: x86 keeps stores in order

    def wait_for_checksum(self) -> None:
        """Wait for a checksum still being computed for this segment, if any."""
        if self.checksummed is not None:
            self.checksummed.wait()
            self.checksummed = None

    def unseal(self) -> None:
        """The publication ends: a checksum still being computed is abandoned (within 64
        MiB of summing; whoever would have read it is done), and only then is the seal
        cleared, so no late write reaches the header of what comes next."""
        self.abandoned.set()
        self.wait_for_checksum()
        self.abandoned.clear()
        struct.pack_into("<Q", self.mm, 8, 0)


def _seal_of(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1


class _ShmPublisher:
    """A publisher's segments. A released segment's name disappears at once; its memory
    is renamed to a spare for the next publish of the same size, because faulting in a
    fresh 1 GB segment costs ~15 memcpys here. All are unlinked on close() or at exit."""

    def __init__(self, shm_dir: str, spares: int, defer_checksum_bytes: int):
        self._dir, self._keep, self._defer_bytes = shm_dir, spares > 0, defer_checksum_bytes
        self._paths: set[str] = set()  # every file owned, live or spare
        self._spares: SparePool[_Segment] = SparePool(spares, free=lambda segment: self._unlink(segment.path))
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._checksummer: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, unlink_quietly, self._paths)

    def allocate(self, total: int) -> _Segment:
        """A segment of `total` bytes under a fresh name: a spare if one fits, else new."""
        path = self._new_path("")
        segment = self._spares.take(total)
        if segment is None:
            segment = _Segment(path, total)
            self._paths.add(path)
        else:
            self._rename(segment, path)  # same memory, new name: a stale handle cannot open it
        return segment

    def publish(self, tensors: Mapping[str, torch.Tensor], fields: dict) -> tuple[ParamHandle, _Segment]:
        segment = self.allocate(fields["total_bytes"])
        try:
            handle = ParamHandle(**fields, checksum=pack_into(segment.data, tensors, fields["layout"]), path=segment.path)
        except BaseException:
            self._unlink(segment.path)
            raise
        self._seal(segment, handle)
        return handle, segment

    def publish_bucket(self, bucket: SharedBucket, fields: dict) -> tuple[ParamHandle, _Segment]:
        """Seal the bucket's own segment, with no copy. A large one returns at once: a
        thread computes the checksum and writes it into the header while receivers already
        copy or checksum the bytes themselves, and they compare once it is there. A small
        one is checksummed here (faster than waking a thread that may wait for the GIL).
        A segment holds one publication: a bucket published again while live moves first
        (a leading part of one cannot move: it is refused). A leading part publishes its
        bytes only, from the segment's start."""
        if bucket.segment is None:
            raise RuntimeError("publish() of a closed SharedBucket")
        if bucket.segment.live_key is not None:
            bucket.prepare_write()
        segment, data = bucket.segment, bucket.segment.data[: fields["total_bytes"]]
        if data.numel() < self._defer_bytes:
            handle = ParamHandle(**fields, checksum=checksum(data), path=segment.path)
            self._seal(segment, handle)
            return handle, segment
        handle = ParamHandle(**fields, checksum=None, path=segment.path)
        self._seal(segment, handle)
        segment.checksummed = done = threading.Event()
        if self._checksummer is None:  # one long-lived thread: starting one per publish costs 0.1 ms
            self._checksummer = threading.Thread(target=self._checksum_loop, args=(self._pending,),
                                                 name="param-checksum", daemon=True)
            self._checksummer.start()
        self._pending.put((segment, data, done))
        return handle, segment

    @staticmethod
    def _checksum_loop(pending: queue.SimpleQueue) -> None:
        while True:
            segment, data, done = pending.get()
            try:
                value = checksum(data, stopped=segment.abandoned.is_set)
                if value is not None:
                    segment.finish_checksum(value)
            finally:
                done.set()

    @staticmethod
    def _seal(segment: _Segment, handle: ParamHandle) -> None:
        segment.live_key = handle.key
        segment.seal(handle.key, handle.checksum, handle.total_bytes)  # last: receivers only trust sealed segments

    def release(self, segment: _Segment) -> None:
        segment.unseal()
        segment.live_key = None
        if segment.bucket is None:  # a bucket's own segment stays its, unsealed
            self.free(segment)

    def free(self, segment: _Segment) -> None:
        if self._keep:
            self._rename(segment, self._new_path("spare-"))
            self._spares.give(segment.total, segment)
        else:
            self._unlink(segment.path)

    def close(self) -> None:
        self._spares.clear()
        self._finalizer()

    def _new_path(self, kind: str) -> str:
        return os.path.join(self._dir, f"{segment_stem()}{kind}{secrets.token_hex(6)}")

    def _rename(self, segment: _Segment, path: str) -> None:
        os.rename(segment.path, path)
        self._paths.discard(segment.path)
        self._paths.add(path)
        segment.path = path

    def _unlink(self, path: str) -> None:
        unlink_quietly({path})
        self._paths.discard(path)


class SharedBucket:
    """Tensors that live in a shared-memory segment their channel owns, so that publishing
    them over shm copies nothing: publish checksums the segment in place and seals it.
    Make one with `ParamChannel.shared_bucket` and keep working on `tensors` (a trainer
    points its parameters at them).

    A published segment must not change until it is released, so call `prepare_write()`
    before every modification: when a publication of the segment is still live it moves
    the tensors to a fresh segment (one copy, into a reused spare after the first time),
    leaves the old one to the publication, and returns True; `tensors` then holds new
    views and whoever pointed at the old ones must re-point. Not thread-safe.
    """

    def __init__(self, shm: _ShmPublisher, tensors: Mapping[str, torch.Tensor], copy: bool):
        self.layout, self.total_bytes = plan_layout(tensors)
        self._shm = shm
        self.segment: _Segment | None = shm.allocate(self.total_bytes)  # None once closed
        self.segment.bucket = self
        if copy:
            pack_into(self.segment.data, tensors, self.layout)
        self.tensors = unpack(self.segment.data, self.layout)
        self.moves = 0  # copy-on-write moves so far
        self.whole = self  # the bucket whose segment this is (itself, unless a leading part)

    def leading(self, count: int, rename: Callable[[str], str]) -> SharedBucket:
        """The bucket's first `count` tensors, as a bucket of their own (named `rename(name)`)
        over the start of the same segment: published over shm it seals those bytes only,
        without a copy. The same rule holds: nothing may change while that is live. It
        cannot move (prepare_write refuses) and is not closed: the whole bucket owns the
        segment."""
        if self.segment is None:
            raise RuntimeError("leading() of a closed SharedBucket")
        part = object.__new__(SharedBucket)
        end = self.layout[count - 1].offset + self.layout[count - 1].nbytes if count else 0
        part.layout = [msgspec.structs.replace(spec, name=rename(spec.name)) for spec in self.layout[:count]]
        part.total_bytes = round_up(end, ALIGN)
        part._shm, part.segment, part.moves, part.whole = self._shm, self.segment, 0, self
        part.tensors = unpack(self.segment.data, part.layout)
        return part

    def prepare_write(self) -> bool:
        """Make `tensors` safe to modify; True if they moved (re-point your references)."""
        if self.segment is None:
            raise RuntimeError("prepare_write() on a closed SharedBucket")
        if self.segment.live_key is None:
            return False
        if self.whole is not self:
            raise RuntimeError("the segment of a SharedBucket's leading part is published already; it cannot move")
        old, new = self.segment, self._shm.allocate(self.total_bytes)
        np.copyto(new.data.numpy(), old.data.numpy())
        old.bucket, new.bucket = None, self  # the live publication frees the old one on release
        self.segment, self.tensors = new, unpack(new.data, self.layout)
        self.moves += 1
        return True

    def close(self) -> None:
        """Give the segment back (now, or when its live publication is released). The
        tensors must not be used afterwards. A leading part gives nothing back."""
        if self.whole is not self:
            return
        segment, self.segment, self.tensors = self.segment, None, {}
        if segment is not None:
            segment.bucket = None
            if segment.live_key is None:
                self._shm.free(segment)


class _ShmReceiver:
    """Maps segments read-only and keeps the mappings between receives: mapping a fresh
    1 GB costs about two memcpys in page faults, and a recycled segment keeps its inode."""

    def __init__(self, limit: int, timeout_s: float):
        self._limit, self._timeout_s = max(limit, 1), timeout_s
        self._maps: OrderedDict[tuple[int, int], tuple[int, mmap.mmap]] = OrderedDict()

    def receive(self, handle: ParamHandle, verify: bool) -> dict[str, torch.Tensor]:
        data = self.bucket(handle)
        if verify:
            got = checksum(data)  # meanwhile a bucket's publisher may still compute its own
            compare(handle, self.expected_checksum(handle), got)
        self.check_still_published(handle)  # released and reused while we were reading?
        return unpack(data, handle.layout)

    def expected_checksum(self, handle: ParamHandle) -> int:
        """The handle's checksum, or the one its publisher writes into the header after
        sealing (a SharedBucket's): waited for while the publisher lives."""
        if handle.checksum is not None:
            return handle.checksum
        mm, deadline, pause = self._open(handle), time.monotonic() + self._timeout_s, 20e-6
        while True:
            self._check_seal(handle, mm)
            # `ready` first, then the value: the publisher writes them in the other order.
            if struct.unpack_from("<Q", mm, 32)[0]:
                return struct.unpack_from("<Q", mm, 24)[0]
            if not _alive(handle.publisher) or time.monotonic() > deadline:
                raise ParamTransferError(f"{describe(handle)}: the publisher (pid {handle.publisher.pid}) died or "
                                         f"stalled before it finished the checksum of {handle.path}. "
                                         f"Ask for a fresh publish.")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def bucket(self, handle: ParamHandle) -> torch.Tensor:
        """The sealed bucket's bytes, mapped read-only; not yet verified."""
        mm = self._open(handle)
        self._check_seal(handle, mm)
        if not handle.total_bytes:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(mm, dtype=torch.uint8, count=handle.total_bytes, offset=_SHM_HEADER)

    def check_still_published(self, handle: ParamHandle) -> None:
        self._check_seal(handle, self._open(handle))

    @staticmethod
    def _check_seal(handle: ParamHandle, mm: mmap.mmap) -> None:
        magic, seal, total, value, ready = _SHM_FIELDS.unpack_from(mm, 0)
        if ((magic, seal, total) != (_SHM_MAGIC, _seal_of(handle.key), handle.total_bytes)
                or (handle.checksum is not None and (value, ready) != (handle.checksum, 1))):
            raise ParamTransferError(f"{describe(handle)}: segment {handle.path} no longer holds this publication "
                                     f"(released and reused, or overwritten). Ask for a fresh publish.")

    def _open(self, handle: ParamHandle) -> mmap.mmap:
        if handle.path is None:
            raise ParamTransferError(f"{describe(handle)}: malformed handle (no segment path)")
        try:
            fd = os.open(handle.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ParamTransferError(f"{describe(handle)}: segment {handle.path} is gone; the publisher "
                                     f"released it or exited. Ask for a fresh publish.") from None
        st = os.fstat(fd)
        if st.st_size < _SHM_HEADER + handle.total_bytes:
            os.close(fd)
            raise ParamTransferError(f"{describe(handle)}: segment {handle.path} is truncated ({st.st_size} bytes, "
                                     f"needs {_SHM_HEADER + handle.total_bytes}). Ask for a fresh publish.")
        ident, needed = (st.st_dev, st.st_ino), _SHM_HEADER + handle.total_bytes
        cached = self._maps.pop(ident, None)
        if cached is not None and needed <= len(cached[1]) <= st.st_size:
            os.close(fd)
            fd, mm = cached
        else:
            if cached is not None:
                os.close(cached[0])
            # The publication only: a trainer's weights are the first part of a segment
            # that holds its whole training state.
            populate = getattr(mmap, "MAP_POPULATE", 0)  # one fault pass in the kernel, not 250k
            mm = mmap.mmap(fd, needed, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
        self._maps[ident] = (fd, mm)
        self._prune()
        return mm

    def _prune(self) -> None:
        # Never mm.close(): views handed out hold a reference, not a buffer export, so
        # closing would leave them dangling. Dropping ours unmaps once they are gone.
        for ident, (fd, _) in list(self._maps.items()):
            if len(self._maps) > self._limit or os.fstat(fd).st_nlink == 0:
                os.close(fd)
                del self._maps[ident]

    def close(self) -> None:
        for fd, _ in self._maps.values():
            os.close(fd)
        self._maps.clear()


class ShmTransport(Transport):
    checksum_in_handle = False  # a SharedBucket's may follow in the segment's header

    def __init__(self, config, location, host, *args):
        super().__init__(config, location, host, *args)
        self.publisher = _ShmPublisher(config.shm_dir, config.spare_buffers, config.defer_checksum_bytes)
        self.receiver = _ShmReceiver(config.cached_maps, config.timeout_s)

    def shared_bucket(self, tensors: Mapping[str, torch.Tensor], copy: bool) -> SharedBucket:
        return SharedBucket(self.publisher, tensors, copy)

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        if bucket is not None:
            return self.publisher.publish_bucket(bucket, fields)
        return self.publisher.publish(tensors, fields)

    def receive(self, handle, *, verify, rank):
        return self.receiver.receive(handle, verify), None

    def receive_into(self, handle, dst, *, verify, atomic, rank):
        if verify and not atomic:
            got = copy_summing(handle, self.receiver.bucket(handle), dst)
            compare(handle, self.receiver.expected_checksum(handle), got,
                    "Found while copying (atomic=False): the destination holds part of these bytes "
                    "and must be discarded. Ask for a fresh publish.")
        else:
            super().receive_into(handle, dst, verify=verify, atomic=atomic, rank=rank)
        self.receiver.check_still_published(handle)  # released and reused while we copied?

    def release(self, handle, resource):
        self.publisher.release(resource)

    def close(self):
        self.publisher.close()
        self.receiver.close()
