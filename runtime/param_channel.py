"""Parameter channel: moves a named set of tensors between workers, host memory and disk.

A publisher packs the tensors into one contiguous bucket, describes its layout once in a
`ParamHandle` (a msgspec Struct, so it rides inside the controller's msgpack messages) and
keeps the bytes available until it releases the handle. A receiver turns the handle back
into tensors: views into the received bucket wherever the transport allows.

    inproc    same process: a registry holds the publisher's own tensors, nothing is copied
    shm       same host: a file in /dev/shm written once, mapped read-only by receivers
    tcp       other hosts: ZeroMQ; the publisher serves chunks, receivers pull them
    disk      a self-describing file, for checkpoints and offload
    cuda_ipc  same host, GPU memory  (param_nccl.py, imported only when used)
    nccl      other hosts, GPU memory, CuPy NCCL broadcast  (param_nccl.py)

Every bucket carries a checksum (see `checksum`) that the publisher computes while packing
and receivers verify before handing out a single tensor, so a receiver never sees a
half-written, truncated or corrupted bucket, and a failed receive leaves its previous
tensors untouched.

A publisher whose tensors already live in shared memory (a `SharedBucket`, e.g. a
trainer's parameters) publishes over shm without any copy: it seals the segment and a
thread writes the checksum into its header moments later, while receivers already read.
The one copy left is the receiver's; `receive_into(..., atomic=False)` also folds the
verification into it, for destinations that are discarded on error.

This module deliberately does not know what the tensors are (weights or optimizer state),
who asked for the transfer, or when a handle may be released: the controller decides and
tells both ends. Parameters never pass through the controller. Every call blocks; async
code calls it through `asyncio.to_thread`.
"""

from __future__ import annotations

import hashlib
import logging
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
import zmq

from .shm_segments import SEGMENT_PREFIX, pid_alive, remove_orphan_segments

__all__ = [
    "TRANSPORTS", "ParamChannel", "ParamChannelConfig", "ParamHandle", "ParamTransferError", "Location",
    "TensorSpec", "CudaIpcInfo", "NcclInfo", "choose_transport", "plan_layout", "pack_into", "unpack",
    "checksum", "read_handle", "remove_orphan_segments", "SharedBucket", "torch_dtype",
]

log = logging.getLogger(__name__)

TRANSPORTS = ("inproc", "shm", "tcp", "disk", "cuda_ipc", "nccl")
ALIGN = 64  # tensor offsets are cache-line aligned, so a view of any dtype is aligned
CHECKSUM_BLOCK = 1 << 20  # part of the checksum's definition: changing it changes every sum
_PACK_CHUNK = 512 << 10  # copy-then-sum granularity: the chunk is still in L2 when summed
_SHM_HEADER = 4096  # one page: magic, seal, size, checksum, ready; the bucket starts page-aligned
_SHM_FIELDS = struct.Struct("<8sQQQQ")  # ready: 1 once the checksum field is final
_SHM_MAGIC = b"FLXPSHM1"
_DISK_MAGIC = b"FLXPDSK1"
_MASK = (1 << 64) - 1


class ParamTransferError(RuntimeError):
    """A tensor set could not be received intact. The receiver's earlier tensors are
    untouched; the remedy is to ask the publisher for a fresh publish."""


# --- data that travels: locations, layout, handles -------------------------------------


class Location(msgspec.Struct, frozen=True):
    """Where one end of a transfer lives."""

    host: str
    pid: int
    device: str = "cpu"  # torch device string: "cpu", "cuda:0", ...

    @classmethod
    def here(cls, device: str = "cpu") -> Location:
        return cls(socket.gethostname(), os.getpid(), str(device))


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor's place in a bucket."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket, a multiple of ALIGN
    nbytes: int


class CudaIpcInfo(msgspec.Struct, frozen=True, array_like=True):
    """torch's CUDA IPC description of a bucket (UntypedStorage._share_cuda_), pickle-free."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    tensor_offset: int


class NcclInfo(msgspec.Struct, frozen=True, array_like=True):
    """A one-shot NCCL communicator: the publisher is rank 0, receivers 1..world_size-1."""

    unique_id: bytes  # ncclUniqueId (128 bytes), passed out of band inside the handle
    world_size: int


class ParamHandle(msgspec.Struct, frozen=True, kw_only=True):
    """A published tensor set. Publisher -> controller -> receivers, inside their commands."""

    transport: str
    agent: str
    version: int
    key: str  # unique per publication
    layout: list[TensorSpec]
    total_bytes: int
    checksum: int | None  # None for inproc (never leaves the process) and for a SharedBucket
    # over shm, whose publisher writes it into the segment's header just after sealing
    publisher: Location
    path: str | None = None  # shm segment or disk file
    endpoint: str | None = None  # tcp: where the publisher serves chunks
    server_key: str | None = None  # tcp: the publisher's CURVE public key (z85)
    cuda_ipc: CudaIpcInfo | None = None
    nccl: NcclInfo | None = None


class ParamChannelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's channel settings (a [param_channel] table in the config TOML)."""

    shm_dir: str = "/dev/shm"
    disk_fsync: bool = True  # a checkpoint survives a crash once publish() returns
    tcp_bind_host: str = "127.0.0.1"  # anything but loopback needs the CURVE keys below
    tcp_advertise_host: str | None = None  # what receivers connect to; default bind host
    curve_public_key: str | None = None  # z85, from zmq.curve_keypair()
    curve_secret_key: str | None = None
    tcp_chunk_bytes: int = 1 << 20  # measured: 1-2 MiB chunks stay in cache on loopback, 4+ do not
    tcp_window: int = 4  # chunks in flight per receiver: bounds queues on both ends
    timeout_s: float = 30.0  # a transfer with no progress for this long has failed
    spare_buffers: int = 2  # released buffers kept for reuse, per kind; 0 frees at once
    cached_maps: int = 4  # shm segments a receiver keeps mapped between receives
    # A SharedBucket at least this large is checksummed on a thread while receivers read;
    # a smaller one in publish() (about 0.5 ms at the default, here).
    defer_checksum_bytes: int = 16 << 20


def choose_transport(src: Location, dst: Location) -> str:
    """The cheapest transport between two locations. Never "disk": that is a destination
    the controller names, not a peer."""
    on_gpus = src.device.startswith("cuda") and dst.device.startswith("cuda")
    if src.host != dst.host:
        return "nccl" if on_gpus else "tcp"
    if src.pid == dst.pid:
        return "inproc"
    return "cuda_ipc" if on_gpus else "shm"


# --- buckets: layout, packing, checksum -------------------------------------------------


def plan_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], int]:
    """Place each tensor at the next ALIGN boundary; returns the layout and bucket size."""
    layout, offset = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{name!r} is not a dense torch.Tensor; publish dense tensors only")
        nbytes = t.numel() * t.element_size()
        layout.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset = _round_up(offset + nbytes, ALIGN)
    return layout, offset


def checksum(data: torch.Tensor) -> int:
    """Checksum of a bucket: a uint8 tensor on any device whose length is a multiple of 8.

    The bucket is read as little-endian 64-bit words and cut into CHECKSUM_BLOCK blocks;
    with s_i the wrapping sum of block i, the result folds A = sum(s_i), B = sum(i * s_i)
    and the length. Any change to one word changes A; reordered blocks (misplaced chunks)
    change B; truncation changes the length. It runs at memory bandwidth (~1.5x faster
    than a memcpy of the same bytes here, where crc32 is 4x and blake2b 20x slower), and
    on a GPU bucket it runs on the GPU.
    """
    words = data.view(torch.int64)
    per_block = CHECKSUM_BLOCK // 8
    full = words.numel() // per_block
    sums = words[: full * per_block].view(full, per_block).sum(dim=1).tolist()
    if words.numel() > full * per_block:
        sums.append(int(words[full * per_block :].sum()))
    return _fold(sums, data.numel())


def _fold(block_sums: list[int], nbytes: int) -> int:
    a = b = 0
    for i, s in enumerate(block_sums, 1):
        a += s
        b += i * s
    # Nested bijective mixes, not a linear fold: a linear one lets a top-bit flip, which
    # moves A and B both by 2**63, cancel out. Here a change in A alone, or in B (or the
    # length) alone, always changes the result.
    return _mix64((a & _MASK) ^ _mix64((b & _MASK) ^ _mix64(nbytes)))


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with full avalanche."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _RunningChecksum:
    """`checksum` computed while packing: each range is summed just after it is written,
    while it is still in cache, so the checksum costs a fraction of a second read pass."""

    def __init__(self, data: torch.Tensor):
        self._words = data.view(torch.int64)
        self._nbytes = data.numel()
        self._sums = [0] * -(-self._nbytes // CHECKSUM_BLOCK)
        self.cursor = 0  # bytes [0, cursor) are summed

    def advance(self, end: int) -> None:
        end -= end % 8
        while self.cursor < end:
            block = self.cursor // CHECKSUM_BLOCK
            stop = min(end, (block + 1) * CHECKSUM_BLOCK)
            self._sums[block] += int(self._words[self.cursor // 8 : stop // 8].sum())
            self.cursor = stop

    def value(self) -> int:
        self.advance(self._nbytes)
        return _fold(self._sums, self._nbytes)


def pack_into(data: torch.Tensor, tensors: Mapping[str, torch.Tensor], layout: list[TensorSpec]) -> int:
    """Copy `tensors` into the uint8 bucket `data` at `layout`'s offsets, zero the padding
    and return the bucket's checksum."""
    if data.device.type != "cpu":
        data.zero_()  # padding; one memset on the GPU is cheaper than many small ones
        for spec, t in zip(layout, tensors.values()):
            _typed_view(data, spec).copy_(t.detach())
        return checksum(data)
    running = _RunningChecksum(data)
    flat = data.numpy()
    end = 0
    for spec, t in zip(layout, tensors.values()):
        flat[end : spec.offset] = 0
        t = t.detach().resolve_conj().resolve_neg()
        if t.device.type == "cpu" and t.is_contiguous() and spec.nbytes:
            bucket_range = flat[spec.offset : spec.offset + spec.nbytes]
            _copy_in_chunks(bucket_range, t.reshape(-1).view(torch.uint8).numpy(), running, spec.offset)
        elif spec.nbytes:
            _typed_view(data, spec).copy_(t)  # strided or on a GPU: torch does the gather
        end = spec.offset + spec.nbytes
        if end - running.cursor >= _PACK_CHUNK:
            running.advance(end)
    flat[end:] = 0
    return running.value()


def unpack(data: torch.Tensor, layout: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of `data`, one per layout entry; nothing is copied."""
    return {spec.name: _typed_view(data, spec) for spec in layout}


def _typed_view(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return data[spec.offset : spec.offset + spec.nbytes].view(torch_dtype(spec.dtype)).view(spec.shape)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a TensorSpec names ("bfloat16" -> torch.bfloat16)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ParamTransferError(f"unknown dtype {name!r} in a handle's layout; publisher and receiver run different torch versions?")
    return dtype


def _check_layout(handle: ParamHandle) -> None:
    """A handle may come off the wire: refuse one whose layout does not fit its bucket."""
    for spec in handle.layout:
        count = 1
        for dim in spec.shape:
            count *= dim
        itemsize = torch_dtype(spec.dtype).itemsize
        if (min(spec.shape, default=0) < 0 or spec.offset % ALIGN or count * itemsize != spec.nbytes
                or spec.offset < 0 or spec.offset + spec.nbytes > handle.total_bytes):
            raise ParamTransferError(f"{_describe(handle)}: layout entry {spec!r} does not fit a "
                                     f"{handle.total_bytes}-byte bucket; the handle is malformed")
    if handle.total_bytes % 8 or (handle.transport not in ("inproc", "shm") and handle.checksum is None):
        raise ParamTransferError(f"{_describe(handle)}: malformed handle (size {handle.total_bytes}, checksum {handle.checksum})")


def _alive(location: Location) -> bool:
    """False only when `location`'s process is known to be gone (this host only)."""
    return location.host != socket.gethostname() or pid_alive(location.pid)


def _describe(handle: ParamHandle) -> str:
    return f"{handle.transport} transfer of agent {handle.agent!r} version {handle.version}"


def _verify(handle: ParamHandle, data: torch.Tensor) -> None:
    _compare(handle, handle.checksum, checksum(data))


def _compare(handle: ParamHandle, expected: int, got: int,
             outcome: str = "Nothing was overwritten; ask the publisher to publish again.") -> None:
    if got != expected:
        raise ParamTransferError(
            f"{_describe(handle)}: checksum mismatch over {handle.total_bytes} bytes "
            f"(expected {expected:#018x}, got {got:#018x}); the bytes were corrupted or "
            f"changed after publish. {outcome}")


def _copy_summing(handle: ParamHandle, data: torch.Tensor, dst: Mapping[str, torch.Tensor]) -> int:
    """Copy `data`'s tensors into `dst` and return `data`'s checksum, computed on the
    way: each chunk is summed right after it is copied, while it is still in cache."""
    running = _RunningChecksum(data)
    src = data.numpy()
    with torch.no_grad():
        for spec in handle.layout:
            t = dst[spec.name].detach()
            if t.device.type == "cpu" and t.is_contiguous() and spec.nbytes:
                bucket_range = src[spec.offset : spec.offset + spec.nbytes]
                _copy_in_chunks(t.reshape(-1).view(torch.uint8).numpy(), bucket_range, running, spec.offset)
            elif spec.nbytes:
                t.copy_(_typed_view(data, spec))
                running.advance(spec.offset + spec.nbytes)
    return running.value()


def _copy_in_chunks(out: np.ndarray, src: np.ndarray, running: _RunningChecksum, bucket_offset: int) -> None:
    """out[:] = src in cache-sized chunks (one of the two is the bucket's range starting at
    `bucket_offset`), summing the bucket up to each chunk's end while it is still in cache;
    small tensors are summed together once a chunk's worth has accumulated."""
    for start in range(0, len(src), _PACK_CHUNK):
        stop = min(start + _PACK_CHUNK, len(src))
        out[start:stop] = src[start:stop]
        if bucket_offset + stop - running.cursor >= _PACK_CHUNK:
            running.advance(bucket_offset + stop)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _SparePool:
    """Released buffers kept for the next publish or receive of the same size: on this kind
    of VM a fresh 1 GB buffer costs ten memcpys in page faults, a reused one nothing."""

    def __init__(self, limit: int, free: Callable[[object], None]):
        self._limit, self._free = limit, free
        self._items: list[tuple[int, object]] = []

    def take(self, size: int) -> object | None:
        for i, (item_size, item) in enumerate(self._items):
            if item_size == size:
                return self._items.pop(i)[1]
        return None

    def give(self, size: int, item: object) -> None:
        self._items.append((size, item))
        while len(self._items) > self._limit:
            self._free(self._items.pop(0)[1])

    def clear(self) -> None:
        while self._items:
            self._free(self._items.pop()[1])


# --- shared memory ----------------------------------------------------------------------


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
        self.checksummed: threading.Event | None = None  # set once a pending checksum is written

    def seal(self, key: str, checksum_: int | None) -> None:
        """checksum_ None: it follows (`finish_checksum`); receivers wait for it."""
        _SHM_FIELDS.pack_into(self.mm, 0, _SHM_MAGIC, _seal_of(key), self.total, checksum_ or 0,
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
        self.wait_for_checksum()
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
        self._spares = _SparePool(spares, free=lambda segment: self._unlink(segment.path))
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._checksummer: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _unlink_quietly, self._paths)

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
        A segment holds one publication: a bucket published again while live moves first."""
        if bucket.segment.live_key is not None:
            bucket.prepare_write()
        segment = bucket.segment
        if segment.total < self._defer_bytes:
            handle = ParamHandle(**fields, checksum=checksum(segment.data), path=segment.path)
            self._seal(segment, handle)
            return handle, segment
        handle = ParamHandle(**fields, checksum=None, path=segment.path)
        self._seal(segment, handle)
        segment.checksummed = done = threading.Event()
        if self._checksummer is None:  # one long-lived thread: starting one per publish costs 0.1 ms
            self._checksummer = threading.Thread(target=self._checksum_loop, args=(self._pending,),
                                                 name="param-checksum", daemon=True)
            self._checksummer.start()
        self._pending.put((segment, done))
        return handle, segment

    @staticmethod
    def _checksum_loop(pending: queue.SimpleQueue) -> None:
        while True:
            segment, done = pending.get()
            try:
                segment.finish_checksum(checksum(segment.data))
            finally:
                done.set()

    @staticmethod
    def _seal(segment: _Segment, handle: ParamHandle) -> None:
        segment.live_key = handle.key
        segment.seal(handle.key, handle.checksum)  # last: receivers only trust sealed segments

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
        return os.path.join(self._dir, f"{SEGMENT_PREFIX}{os.getpid()}-{kind}{secrets.token_hex(6)}")

    def _rename(self, segment: _Segment, path: str) -> None:
        os.rename(segment.path, path)
        self._paths.discard(segment.path)
        self._paths.add(path)
        segment.path = path

    def _unlink(self, path: str) -> None:
        _unlink_quietly({path})
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
        self.segment = shm.allocate(self.total_bytes)
        self.segment.bucket = self
        if copy:
            pack_into(self.segment.data, tensors, self.layout)
        self.tensors = unpack(self.segment.data, self.layout)
        self.moves = 0  # copy-on-write moves so far

    def prepare_write(self) -> bool:
        """Make `tensors` safe to modify; True if they moved (re-point your references)."""
        if self.segment is None:
            raise RuntimeError("prepare_write() on a closed SharedBucket")
        if self.segment.live_key is None:
            return False
        old, new = self.segment, self._shm.allocate(self.total_bytes)
        np.copyto(new.data.numpy(), old.data.numpy())
        old.bucket, new.bucket = None, self  # the live publication frees the old one on release
        self.segment, self.tensors = new, unpack(new.data, self.layout)
        self.moves += 1
        return True

    def close(self) -> None:
        """Give the segment back (now, or when its live publication is released). The
        tensors must not be used afterwards."""
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
            _compare(handle, self.expected_checksum(handle), got)
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
                raise ParamTransferError(f"{_describe(handle)}: the publisher (pid {handle.publisher.pid}) died or "
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
            raise ParamTransferError(f"{_describe(handle)}: segment {handle.path} no longer holds this publication "
                                     f"(released and reused, or overwritten). Ask for a fresh publish.")

    def _open(self, handle: ParamHandle) -> mmap.mmap:
        try:
            fd = os.open(handle.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ParamTransferError(f"{_describe(handle)}: segment {handle.path} is gone; the publisher "
                                     f"released it or exited. Ask for a fresh publish.") from None
        st = os.fstat(fd)
        if st.st_size < _SHM_HEADER + handle.total_bytes:
            os.close(fd)
            raise ParamTransferError(f"{_describe(handle)}: segment {handle.path} is truncated ({st.st_size} bytes, "
                                     f"needs {_SHM_HEADER + handle.total_bytes}). Ask for a fresh publish.")
        ident = (st.st_dev, st.st_ino)
        cached = self._maps.pop(ident, None)
        if cached is not None and len(cached[1]) == st.st_size:
            os.close(fd)
            fd, mm = cached
        else:
            if cached is not None:
                os.close(cached[0])
            populate = getattr(mmap, "MAP_POPULATE", 0)  # one fault pass in the kernel, not 250k
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ)
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


def _unlink_quietly(paths: set[str]) -> None:
    for path in list(paths):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        paths.discard(path)


# --- tcp --------------------------------------------------------------------------------


class _ChunkRequest(msgspec.Struct, array_like=True):
    """Receiver -> publisher's tcp server: send me bytes [offset, offset + size) of `key`."""

    key: str
    offset: int
    size: int


class _ChunkReply(msgspec.Struct, array_like=True):
    """Publisher's tcp server -> receiver; the chunk's bytes follow in the next frame."""

    key: str
    offset: int
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(_ChunkRequest).decode
_decode_reply = msgspec.msgpack.Decoder(_ChunkReply).decode


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _TcpServer:
    """Serves published buckets in chunks from one ROUTER socket on a thread of its own.
    Receivers pull with credit-based flow control (ZeroMQ guide, chapter 7): each asks for
    at most tcp_window chunks at a time, so neither end queues more than that."""

    def __init__(self, ctx: zmq.Context, config: ParamChannelConfig):
        self._ctx, self._config = ctx, config
        self._buckets: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._stop, self._ready = threading.Event(), threading.Event()
        self.endpoint, self.error = "", None
        self._thread = threading.Thread(target=self._run, name="param-tcp-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.check()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the parameter channel's tcp server failed: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise RuntimeError("the parameter channel's tcp server is not running")

    def add(self, key: str, bucket: np.ndarray) -> None:
        with self._lock:
            self._buckets[key] = bucket

    def remove(self, key: str) -> None:
        with self._lock:
            self._buckets.pop(key, None)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("parameter tcp server did not stop within %.1f s", timeout_s)

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.maxmsgsize = 64 << 10  # requests are tiny; a peer sending more is disconnected
            if self._config.curve_secret_key:
                sock.curve_server = True
                sock.curve_secretkey = self._config.curve_secret_key.encode()
            port = sock.bind_to_random_port(f"tcp://{self._config.tcp_bind_host}")
            self.endpoint = f"tcp://{self._config.tcp_advertise_host or self._config.tcp_bind_host}:{port}"
        except BaseException as exc:  # reported to the caller by check()
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self._answer(sock, sock.recv_multipart())
        except BaseException as exc:
            self.error = exc
            log.exception("parameter tcp server stopped")
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            req = _decode_request(body[0]) if len(body) == 1 else None
        except msgspec.DecodeError:
            req = None
        if req is None:
            log.warning("parameter tcp server: dropped a malformed request")
            sock.send_multipart([ident, _encode(_ChunkReply("", 0, "malformed request")), b""])
            return
        with self._lock:
            bucket = self._buckets.get(req.key)
        if bucket is None:
            error = f"no publication {req.key!r} here: it was released, or never published by this worker"
        elif req.offset < 0 or req.size <= 0 or req.offset + req.size > len(bucket):
            error = f"chunk [{req.offset}, {req.offset + req.size}) is outside the {len(bucket)}-byte bucket"
        else:
            chunk = memoryview(bucket[req.offset : req.offset + req.size])
            sock.send_multipart([ident, _encode(_ChunkReply(req.key, req.offset)), chunk], copy=False)
            return
        sock.send_multipart([ident, _encode(_ChunkReply(req.key, req.offset, error)), b""])


def _tcp_pull(ctx: zmq.Context, handle: ParamHandle, dest: np.ndarray, config: ParamChannelConfig) -> None:
    """Fill `dest` with the handle's bucket, chunk by chunk, or raise ParamTransferError."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if handle.server_key:
        sock.curve_serverkey = handle.server_key.encode()
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(handle.endpoint)
    total, chunk, received, next_offset = handle.total_bytes, config.tcp_chunk_bytes, 0, 0
    pending: dict[int, int] = {}  # offset -> size of every chunk asked for, not yet here
    try:
        while received < total:
            while len(pending) < config.tcp_window and next_offset < total:
                size = min(chunk, total - next_offset)
                sock.send(_encode(_ChunkRequest(handle.key, next_offset, size)))
                pending[next_offset] = size
                next_offset += size
            if not sock.poll(int(config.timeout_s * 1000)):
                raise ParamTransferError(
                    f"{_describe(handle)}: no data from {handle.endpoint} for {config.timeout_s:g} s after "
                    f"{received} of {total} bytes; the publisher died or is unreachable. Ask for a fresh publish.")
            frames = sock.recv_multipart(copy=False)
            try:
                reply = _decode_reply(frames[0].bytes) if len(frames) == 2 else None
            except msgspec.DecodeError:
                reply = None
            if reply is None:
                raise ParamTransferError(f"{_describe(handle)}: malformed reply from {handle.endpoint}")
            if reply.error:
                raise ParamTransferError(f"{_describe(handle)}: {handle.endpoint} refused: {reply.error}")
            size = pending.pop(reply.offset, None) if reply.key == handle.key else None
            data = frames[1].buffer
            if size is None or len(data) != size:
                raise ParamTransferError(
                    f"{_describe(handle)}: size mismatch: got {len(data)} bytes at offset {reply.offset}, "
                    f"expected {size if size is not None else 'no chunk there'}. Ask for a fresh publish.")
            dest[reply.offset : reply.offset + size] = np.frombuffer(data, dtype=np.uint8)
            received += size
    finally:
        sock.close(linger=0)


# --- disk -------------------------------------------------------------------------------

_encode_handle = msgspec.msgpack.Encoder().encode
_decode_handle = msgspec.msgpack.Decoder(ParamHandle).decode
_DISK_PREAMBLE = struct.Struct("<8sQQ")  # magic, data offset, handle length; then the handle


def read_handle(path: str | os.PathLike) -> ParamHandle:
    """The handle stored inside a disk bucket: a checkpoint loads without its publisher."""
    with open(path, "rb") as f:
        magic, _, length = _DISK_PREAMBLE.unpack(f.read(_DISK_PREAMBLE.size).ljust(_DISK_PREAMBLE.size, b"\0"))
        if magic != _DISK_MAGIC:
            raise ParamTransferError(f"{path} is not a parameter bucket file (bad magic {magic!r})")
        return _decode_handle(f.read(length))


def _write_disk(path: str, handle: ParamHandle, data: torch.Tensor, fsync: bool) -> None:
    """Write to a temporary name and rename, so a reader never finds a half-written file."""
    header = _encode_handle(handle)
    data_offset = _round_up(_DISK_PREAMBLE.size + len(header), 4096)
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_DISK_PREAMBLE.pack(_DISK_MAGIC, data_offset, len(header)) + header)
            f.write(b"\0" * (data_offset - f.tell()))
            f.write(memoryview(data.numpy()))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly({tmp})
        raise
    if fsync:
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_disk(handle: ParamHandle, dest: torch.Tensor) -> None:
    try:
        f = open(handle.path, "rb")
    except FileNotFoundError:
        raise ParamTransferError(f"{_describe(handle)}: {handle.path} does not exist (released or moved)") from None
    with f:
        magic, data_offset, _ = _DISK_PREAMBLE.unpack(f.read(_DISK_PREAMBLE.size).ljust(_DISK_PREAMBLE.size, b"\0"))
        size = os.fstat(f.fileno()).st_size
        if magic != _DISK_MAGIC or size < data_offset + handle.total_bytes:
            raise ParamTransferError(f"{_describe(handle)}: {handle.path} is truncated or not a bucket file "
                                     f"({size} bytes, needs {data_offset + handle.total_bytes}). Publish it again.")
        f.seek(data_offset)
        view, done = memoryview(dest.numpy()), 0
        while done < handle.total_bytes:
            n = f.readinto(view[done:])
            if not n:
                raise ParamTransferError(f"{_describe(handle)}: {handle.path} ended after {done} bytes")
            done += n


# --- the channel ------------------------------------------------------------------------

_inproc: dict[str, dict[str, torch.Tensor]] = {}  # key -> the publisher's own tensors
_inproc_lock = threading.Lock()


class _Publication(msgspec.Struct):
    handle: ParamHandle
    resource: object  # what keeps the bytes alive: segment, host buffer, GPU bucket


class ParamChannel:
    """One worker's end of the parameter channel: publishes and receives tensor sets.

    A handle published here stays valid until `release(handle)` here; receivers must be
    done with their views of it by then (the controller orders the two). `close()` ends
    every publication except disk files, which outlive their publisher by design. Not
    thread-safe: use it from one thread at a time.
    """

    def __init__(self, config: ParamChannelConfig | None = None, *, location: Location | None = None):
        self.config = config = config or ParamChannelConfig()
        if not _is_loopback(config.tcp_bind_host) and not (config.curve_public_key and config.curve_secret_key):
            raise ValueError(f"refusing to serve parameters on {config.tcp_bind_host} without authentication: "
                             f"set curve_public_key and curve_secret_key (zmq.curve_keypair()) or bind 127.0.0.1")
        self.location = location or Location.here()
        self._published: dict[str, _Publication] = {}
        self._received: dict[str, list[tuple[int, torch.Tensor]]] = {}  # key -> staging buffers behind views
        self._host_spares = _SparePool(config.spare_buffers, free=lambda _: None)
        self._shm = _ShmPublisher(config.shm_dir, config.spare_buffers, config.defer_checksum_bytes)
        self._maps = _ShmReceiver(config.cached_maps, config.timeout_s)
        self._ctx: zmq.Context | None = None
        self._server: _TcpServer | None = None
        self._closed = False

    def __enter__(self) -> ParamChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shared_bucket(self, tensors: Mapping[str, torch.Tensor], *, copy: bool = True) -> SharedBucket:
        """A SharedBucket holding `tensors`' names, shapes and dtypes, and their values
        unless copy=False (then the contents are undefined until written)."""
        if self._closed:
            raise RuntimeError("shared_bucket() on a closed ParamChannel")
        return SharedBucket(self._shm, tensors, copy)

    def publish(self, tensors: Mapping[str, torch.Tensor] | SharedBucket, *, agent: str, version: int,
                transport: str, path: str | os.PathLike | None = None, receivers: int = 1) -> ParamHandle:
        """Make `tensors` receivable and return their handle. The bytes are complete and
        checksummed before this returns. `path` is the file for "disk"; `receivers` is how
        many ranks will join an "nccl" broadcast. For "inproc" the tensors themselves are
        shared: do not modify them until release. A SharedBucket published over "shm" is
        sealed in place, without a copy; over any other transport it is its tensors."""
        if self._closed:
            raise RuntimeError("publish() on a closed ParamChannel")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")
        if transport == "disk" and path is None:
            raise ValueError("publish(transport='disk') needs path=")
        bucket = tensors if isinstance(tensors, SharedBucket) else None
        if bucket is not None:
            if bucket.segment is None:
                raise RuntimeError("publish() of a closed SharedBucket")
            tensors = bucket.tensors
        layout, total = (bucket.layout, bucket.total_bytes) if bucket is not None else plan_layout(tensors)
        key = f"{agent}-v{version}-{os.getpid()}-{secrets.token_hex(6)}"
        fields = dict(transport=transport, agent=agent, version=version, key=key, layout=layout,
                      total_bytes=total, publisher=self.location)
        resource = None
        if transport == "inproc":
            handle = ParamHandle(**fields, checksum=None)
            with _inproc_lock:
                _inproc[key] = {name: t.detach() for name, t in tensors.items()}
        elif transport == "shm" and bucket is not None:
            handle, resource = self._shm.publish_bucket(bucket, fields)
        elif transport == "shm":
            handle, resource = self._shm.publish(tensors, fields)
        elif transport == "tcp":
            resource = self._host_buffer(total)
            fields["checksum"] = pack_into(resource, tensors, layout)
            server = self._tcp_server()
            handle = ParamHandle(**fields, endpoint=server.endpoint, server_key=self.config.curve_public_key)
            server.add(key, resource.numpy())
        elif transport == "disk":
            staging = self._host_buffer(total)
            try:
                fields["checksum"] = pack_into(staging, tensors, layout)
                handle = ParamHandle(**fields, path=os.fspath(path))
                _write_disk(handle.path, handle, staging, self.config.disk_fsync)
            finally:
                self._host_spares.give(total, staging)
        else:
            from flexmarl.runtime import param_nccl

            handle, resource = param_nccl.publish(tensors, fields, transport, receivers, self.config.timeout_s)
        self._published[key] = _Publication(handle, resource)
        return handle

    def receive(self, handle: ParamHandle, *, verify: bool = True, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The published tensors, verified against the handle's checksum. They are views
        into the received bucket: for shm and cuda_ipc, the publisher's memory, which is
        read-only (writing to an shm view crashes the process): copy, or use
        receive_into, before modifying. `rank` (1..receivers) is needed for nccl only.
        Raises ParamTransferError if the bytes are missing, short or corrupted."""
        tensors, staging = self._receive(handle, verify, rank)
        if staging is not None:  # kept until release(handle): the views point into it
            self._received.setdefault(handle.key, []).append((handle.total_bytes, staging))
        return tensors

    def receive_into(self, handle: ParamHandle, dst: Mapping[str, torch.Tensor], *, verify: bool = True,
                     atomic: bool = True, rank: int | None = None) -> None:
        """Copy the published tensors into `dst` (same names, shapes and dtypes; any
        device). All or nothing: every check runs before the first byte is written.

        atomic=False, for a destination that is thrown away on error (a model being
        built): over shm the checksum is then computed during the copy, one pass over the
        bytes instead of two. Every other check still runs first, but a checksum mismatch
        is found after `dst` was written: it raises and `dst` must be discarded."""
        expected = {spec.name: spec for spec in handle.layout}
        problems = [f"{name!r} missing from dst" for name in expected.keys() - dst.keys()]
        problems += [f"{name!r} not in the handle" for name in dst.keys() - expected.keys()]
        for name in expected.keys() & dst.keys():
            spec, t = expected[name], dst[name]
            if tuple(t.shape) != spec.shape or str(t.dtype).removeprefix("torch.") != spec.dtype:
                problems.append(f"{name!r} is {t.dtype}{list(t.shape)} in dst, {spec.dtype}{list(spec.shape)} in the handle")
        if problems:
            raise ValueError(f"receive_into({_describe(handle)}): dst does not match: " + "; ".join(sorted(problems)))
        if handle.transport == "shm" and verify and not atomic:
            _check_layout(handle)
            got = _copy_summing(handle, self._maps.bucket(handle), dst)
            _compare(handle, self._maps.expected_checksum(handle), got,
                     "Found while copying (atomic=False): the destination holds part of these bytes "
                     "and must be discarded. Ask for a fresh publish.")
            self._maps.check_still_published(handle)
            return
        received, staging = self._receive(handle, verify, rank)
        try:
            with torch.no_grad():
                for name, t in received.items():
                    dst[name].copy_(t)
            if handle.transport == "shm":
                self._maps.check_still_published(handle)
        finally:
            del received
            if staging is not None:  # its views never escaped: the buffer is free again
                self._host_spares.give(handle.total_bytes, staging)

    def _receive(self, handle: ParamHandle, verify: bool, rank: int | None):
        """The tensors, and the host staging buffer behind them when this channel owns one."""
        _check_layout(handle)
        if handle.transport == "inproc":
            if handle.publisher.pid != os.getpid():
                raise ParamTransferError(f"{_describe(handle)}: an inproc handle from pid {handle.publisher.pid} cannot "
                                         f"be received in pid {os.getpid()}; publish with choose_transport()'s choice")
            with _inproc_lock:
                tensors = _inproc.get(handle.key)
            if tensors is None:
                raise ParamTransferError(f"{_describe(handle)}: not published in this process, or already released")
            return dict(tensors), None
        if handle.transport == "shm":
            return self._maps.receive(handle, verify), None
        if handle.transport in ("tcp", "disk"):
            staging = self._host_buffer(handle.total_bytes)
            try:
                if handle.transport == "tcp":
                    self._ctx = self._ctx or zmq.Context()
                    _tcp_pull(self._ctx, handle, staging.numpy(), self.config)
                else:
                    _read_disk(handle, staging)
                if verify:
                    _verify(handle, staging)
            except BaseException:
                self._host_spares.give(handle.total_bytes, staging)
                raise
            return unpack(staging, handle.layout), staging
        if handle.transport in ("cuda_ipc", "nccl"):
            from flexmarl.runtime import param_nccl

            bucket = param_nccl.receive(handle, rank, self.location.device, self.config.timeout_s)
            if verify:
                _verify(handle, bucket)
            return unpack(bucket, handle.layout), None
        raise ParamTransferError(f"unknown transport {handle.transport!r} in a handle; expected one of {TRANSPORTS}")

    def release(self, handle: ParamHandle) -> None:
        """End what this channel holds for `handle`: as its publisher, the bytes; as a
        receiver, the staging buffer behind its views. Releasing twice is harmless."""
        for size, staging in self._received.pop(handle.key, []):
            self._host_spares.give(size, staging)
        pub = self._published.pop(handle.key, None)
        transport = pub.handle.transport if pub else None
        if transport == "inproc":
            with _inproc_lock:
                _inproc.pop(handle.key, None)
        elif transport == "shm":
            self._shm.release(pub.resource)
        elif transport == "tcp":
            self._server.remove(handle.key)
            self._host_spares.give(handle.total_bytes, pub.resource)
        elif transport == "disk":
            _unlink_quietly({pub.handle.path})
        elif transport in ("cuda_ipc", "nccl"):
            from flexmarl.runtime import param_nccl

            param_nccl.release(pub.resource)

    def close(self) -> None:
        """Release every publication (disk files stay), stop serving, free all spares."""
        if self._closed:
            return
        self._closed = True
        for key, pub in list(self._published.items()):
            if pub.handle.transport == "disk":
                del self._published[key]
            else:
                self.release(pub.handle)
        if self._server is not None:
            self._server.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._shm.close()
        self._maps.close()
        self._host_spares.clear()
        self._received.clear()

    def _host_buffer(self, total: int) -> torch.Tensor:
        buf = self._host_spares.take(total)
        return buf if buf is not None else torch.empty(total, dtype=torch.uint8)

    def _tcp_server(self) -> _TcpServer:
        if self._server is None:
            self._ctx = self._ctx or zmq.Context()
            self._server = _TcpServer(self._ctx, self.config)
        self._server.check()
        return self._server
