"""Parameter channel: moves a named set of tensors between workers, host memory and disk.

A publisher packs the tensors into one contiguous bucket, describes its layout once in a
`ParamHandle` (a msgspec Struct, so it rides typed inside the controller's protocol
messages) and keeps the bytes available until it releases the handle. A receiver turns
the handle back into tensors: views into the received bucket wherever the transport allows.

The transports, one row each in `TRANSPORTS` (the one place a transport is chosen by name):

    inproc    same process: a registry holds the publisher's own tensors, nothing is copied
    shm       same host: a file in /dev/shm written once, mapped read-only by receivers
    tcp       other hosts: ZeroMQ; the publisher serves chunks, receivers pull them
    disk      a self-describing file, for checkpoints and offload
    cuda_ipc  same host, GPU memory  (gpu.py)
    nccl      other GPUs, same or other host: CuPy NCCL broadcast  (gpu.py, nccl.py)

Every bucket carries a checksum (bucket.checksum) that the publisher computes while
packing and receivers verify before handing out a single tensor, so a receiver never sees
a half-written, truncated or corrupted bucket, and a failed receive leaves its previous
tensors untouched. A publisher whose tensors already live in shared memory (a
`SharedBucket`) publishes over shm without any copy (shm.py).

This module is the facade: `ParamChannel` and the public names of the param_* modules.
It deliberately does not know what the tensors are (weights or optimizer state), who asked
for the transfer, or when a handle may be released: the controller decides and tells both
ends. Parameters never pass through the controller. Every call blocks; async code calls
it through `asyncio.to_thread`.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import cast

import msgspec
import torch

from .bucket import ALIGN, CHECKSUM_BLOCK, check_layout, checksum, pack_into, plan_layout, torch_dtype, unpack
from .disk import DiskTransport, read_handle
from .gpu import CudaIpcTransport, NcclTransport
from .inproc import InprocTransport
from .shm import SharedBucket, ShmTransport
from .shm_segments import remove_orphan_segments
from .tcp import TcpTransport
from .transport import HostBuffers, Transport
from .types import (
    CudaIpcInfo,
    Location,
    NcclInfo,
    ParamChannelConfig,
    ParamHandle,
    ParamTransferError,
    TensorSpec,
    choose_transport,
    describe,
)

__all__ = [
    "ALIGN", "CHECKSUM_BLOCK", "TRANSPORTS", "CudaIpcInfo", "Location", "NcclInfo", "ParamChannel",
    "ParamChannelConfig", "ParamHandle", "ParamTransferError", "SharedBucket", "TensorSpec", "Transport",
    "checksum", "choose_transport", "pack_into", "plan_layout", "read_handle", "remove_orphan_segments",
    "torch_dtype", "unpack",
]

# Transport name (as handles and commands carry it) -> its implementation. Adding a
# transport is adding a row; the channel never branches on a name (shared_bucket asks
# the shm row for its segments, since a SharedBucket lives in one).
TRANSPORTS: dict[str, type[Transport]] = {
    "inproc": InprocTransport,
    "shm": ShmTransport,
    "tcp": TcpTransport,
    "disk": DiskTransport,
    "cuda_ipc": CudaIpcTransport,
    "nccl": NcclTransport,
}


class _Publication(msgspec.Struct):
    handle: ParamHandle
    resource: object  # what keeps the bytes alive: segment, host buffer, GPU bucket


class ParamChannel:
    """One worker's end of the parameter channel: publishes and receives tensor sets.

    A handle published here stays valid until `release(handle)` here; receivers must be
    done with their views of it by then (the controller orders the two). A receiver
    releases a handle too, once done with the tensors `receive` gave it: that frees the
    buffer behind them. `close()` ends every publication except disk files, which outlive
    their publisher by design. Not thread-safe: use it from one thread at a time.
    """

    def __init__(self, config: ParamChannelConfig | None = None, *, location: Location | None = None,
                 cancelled: Callable[[str, int], bool] | None = None):
        """`cancelled(agent, version)`: a second source of cancels besides `cancel()`, for a
        channel whose receives are given up from another process (an engine's workers)."""
        self.config = config = config or ParamChannelConfig()
        for transport in TRANSPORTS.values():
            transport.check_config(config)
        self.location = location or Location.here()
        self._host = HostBuffers(config.spare_buffers)
        self._transports: dict[str, Transport] = {}  # made on first use
        self._published: dict[str, _Publication] = {}
        # key -> (transport, what holds the memory behind views handed out: host buffers, mappings)
        self._received: dict[str, list[tuple[Transport, object]]] = {}
        self._closed = False
        self._cancelled: set[str] = set()  # publications whose receive to give up (cancel)
        self._receiving: dict[tuple[str, int], str] = {}  # (agent, version) -> the key being received
        self._cancel_lock = threading.Lock()
        self._cancelled_elsewhere = cancelled

    def __enter__(self) -> ParamChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def shared_bucket(self, tensors: Mapping[str, torch.Tensor], *, copy: bool = True) -> SharedBucket:
        """A SharedBucket holding `tensors`' names, shapes and dtypes, and their values
        unless copy=False (then the contents are undefined until written)."""
        if self._closed:
            raise RuntimeError("shared_bucket() on a closed ParamChannel")
        return cast(ShmTransport, self._transport("shm", ValueError)).shared_bucket(tensors, copy)

    def publish(self, tensors: Mapping[str, torch.Tensor] | SharedBucket, *, agent: str, version: int,
                transport: str, path: str | os.PathLike | None = None, receivers: int = 1,
                group: str = "") -> ParamHandle:
        """Make `tensors` receivable and return their handle. The bytes are complete and
        checksummed before this returns. `path` is the file for "disk"; `receivers` is how
        many ranks will join an "nccl" broadcast, and `group` names its communicator, kept
        for the next publication of the same agent to the same group (empty: one-shot). For "inproc" the tensors themselves are
        shared: do not modify them until release. A SharedBucket published over "shm" is
        sealed in place, without a copy; over any other transport it is its tensors."""
        if self._closed:
            raise RuntimeError("publish() on a closed ParamChannel")
        impl = self._transport(transport, ValueError)
        bucket: SharedBucket | None = None
        if isinstance(tensors, SharedBucket):
            bucket = tensors
            if bucket.segment is None:
                raise RuntimeError("publish() of a closed SharedBucket")
            tensors = bucket.tensors
        layout, total = (bucket.layout, bucket.total_bytes) if bucket is not None else plan_layout(tensors)
        key = f"{agent}-v{version}-{os.getpid()}-{secrets.token_hex(6)}"
        fields = dict(transport=transport, agent=agent, version=version, key=key, layout=layout,
                      total_bytes=total, publisher=self.location)
        handle, resource = impl.publish(tensors, fields, bucket=bucket, path=path, receivers=receivers,
                                        group=group)
        self._published[key] = _Publication(handle, resource)
        return handle

    def receive(self, handle: ParamHandle, *, verify: bool = True, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The published tensors, verified against the handle's checksum. They are views
        into the received bucket: for shm and cuda_ipc, the publisher's memory, which is
        read-only (writing to an shm view crashes the process): copy, or use
        receive_into, before modifying. Release the handle here once done with them: for
        tcp and disk they are views of a buffer this channel holds until then. `rank`
        (1..receivers) is needed for nccl only. Raises ParamTransferError if the bytes are
        missing, short or corrupted."""
        impl = self._checked(handle)
        self._cancel_started(handle)
        try:
            tensors, staging = impl.receive(handle, verify=verify, rank=rank)
        finally:
            self._cancel_done(handle)
        if staging is not None:  # kept until release(handle): the views point into it
            self._received.setdefault(handle.key, []).append((impl, staging))
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
            raise ValueError(f"receive_into({describe(handle)}): dst does not match: " + "; ".join(sorted(problems)))
        impl = self._checked(handle)
        self._cancel_started(handle)
        try:
            impl.receive_into(handle, dst, verify=verify, atomic=atomic, rank=rank)
        finally:
            self._cancel_done(handle)

    def release(self, handle: ParamHandle) -> None:
        """End what this channel holds for `handle`: as its publisher, the bytes; as a
        receiver, the buffer behind its views. Releasing twice is harmless."""
        for impl, staging in self._received.pop(handle.key, []):
            impl.release_received(staging)
        pub = self._published.pop(handle.key, None)
        if pub is not None:
            self._transports[pub.handle.transport].release(pub.handle, pub.resource)

    def cancel(self, key: str) -> None:
        """Makes the receive of the publication `key` (its handle's key), waiting on other
        ranks (nccl), fail now, or as soon as it starts: one of them died. Safe to call from
        another thread than the receiving one. It names one publication: a later one of the
        same agent and version (the sync retried without the dead rank) has another key and
        goes ahead, whenever the cancel arrives."""
        with self._cancel_lock:
            self._cancelled.add(key)

    def _cancel_started(self, handle: ParamHandle) -> None:
        with self._cancel_lock:
            self._receiving[(handle.agent, handle.version)] = handle.key

    def _cancel_done(self, handle: ParamHandle) -> None:
        """A receive ended: its cancel, if any, has done its work."""
        with self._cancel_lock:
            self._cancelled.discard(handle.key)
            if self._receiving.get((handle.agent, handle.version)) == handle.key:
                del self._receiving[(handle.agent, handle.version)]

    def _is_cancelled(self, agent: str, version: int) -> bool:
        """Asked by a transport during the receive of `agent` at `version`: whether the
        publication being received was cancelled."""
        with self._cancel_lock:
            if self._receiving.get((agent, version)) in self._cancelled:
                return True
        return self._cancelled_elsewhere is not None and self._cancelled_elsewhere(agent, version)

    def disown(self, handle: ParamHandle) -> None:
        """Stop tracking a disk publication without deleting its file: from now on the
        file belongs to whoever keeps it (a checkpoint directory), not to this channel."""
        pub = self._published.get(handle.key)
        if pub is not None and not TRANSPORTS[pub.handle.transport].kept_on_close:
            raise ValueError(f"only files outlive their publisher; {handle.transport} publications cannot be disowned")
        self._published.pop(handle.key, None)

    def held_receive_buffers(self) -> int:
        """Host buffers this channel keeps behind tensors `receive` handed out (until their
        handles are released) or as spares for reuse: what it holds as a receiver."""
        return sum(map(len, self._received.values())) + self._host.spares()

    def close(self) -> None:
        """Release every publication (disk files stay), stop serving, free all spares."""
        if self._closed:
            return
        self._closed = True
        for key, pub in list(self._published.items()):
            if TRANSPORTS[pub.handle.transport].kept_on_close:
                del self._published[key]
            else:
                self.release(pub.handle)
        for entries in self._received.values():
            for impl, staging in entries:
                impl.release_received(staging)  # GPU mappings are unmapped, host buffers pooled
        self._received.clear()
        for transport in self._transports.values():
            transport.close()
        self._host.clear()

    def _checked(self, handle: ParamHandle) -> Transport:
        """The handle's transport, once the handle is known to describe a sane bucket."""
        impl = self._transport(handle.transport, ParamTransferError)
        check_layout(handle, checksum_required=impl.checksum_in_handle)
        return impl

    def _transport(self, name: str, error: type[Exception]) -> Transport:
        impl = self._transports.get(name)
        if impl is None:
            if name not in TRANSPORTS:
                raise error(f"unknown transport {name!r}; expected one of {', '.join(TRANSPORTS)}")
            impl = self._transports[name] = TRANSPORTS[name](self.config, self.location, self._host,
                                                             self._is_cancelled)
        return impl
