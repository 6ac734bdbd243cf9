"""The parameter channel's data that travels, and its settings: importable without torch.

A `ParamHandle` names one published tensor set: which transport holds the bytes, where,
their layout and checksum. It rides typed inside the controller's protocol messages, so
the controller (which never imports torch) can hold and forward handles, and every worker
gets them back already decoded.

This module knows nothing about how bytes move: the transports (shm, tcp,
disk, gpu, ...) and the channel (channel.py) do that.
"""

from __future__ import annotations

import os
import socket

import msgspec

__all__ = [
    "CudaIpcInfo", "Location", "NcclInfo", "ParamChannelConfig", "ParamHandle", "ParamTransferError",
    "TensorSpec", "choose_transport", "describe", "host_device",
]


class ParamTransferError(RuntimeError):
    """A tensor set could not be received intact. The receiver's earlier tensors are
    untouched; the remedy is to ask the publisher for a fresh publish."""


class Location(msgspec.Struct, frozen=True):
    """Where one end of a transfer lives."""

    host: str
    pid: int
    device: str = "cpu"  # torch device string: "cpu", "cuda:0", ... (GPUs numbered as the host numbers them)

    @classmethod
    def here(cls, device: str = "cpu") -> Location:
        return cls(socket.gethostname(), os.getpid(), str(device))


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor's place in a bucket."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket, a multiple of bucket.ALIGN
    nbytes: int


class CudaIpcInfo(msgspec.Struct, frozen=True, array_like=True):
    """A bucket in GPU memory of its own (cudaMalloc), as cudaIpcGetMemHandle describes it."""

    device: int  # the publisher's device index, in the publisher's numbering
    handle: bytes  # cudaIpcMemHandle_t (64 bytes)
    size: int  # bytes allocated (at least the bucket's total_bytes)
    # The GPU's UUID: receivers number GPUs their own way (pinning, an engine's workers),
    # so they find the GPU the memory is on by it. Empty: the device index is used.
    uuid: str = ""
    # Names the allocation, the same for every publication that reuses it: a receiver
    # that has it mapped maps nothing again.
    allocation: str = ""


class NcclInfo(msgspec.Struct, frozen=True, array_like=True):
    """An NCCL communicator: the publisher is rank 0, receivers 1..world_size-1 (each told
    its rank by the controller). `group` names a communicator kept for later publications
    to the same receivers; empty for a one-shot one."""

    unique_id: bytes  # ncclUniqueId (128 bytes), passed out of band inside the handle
    world_size: int
    group: str = ""


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
    """One worker's channel settings, made from where its controller is
    (workers/channel_config.py); no config file sets them."""

    shm_dir: str = "/dev/shm"
    disk_fsync: bool = True  # a checkpoint survives a crash once publish() returns
    tcp_bind_host: str = "127.0.0.1"  # anything but loopback needs the CURVE keys below
    tcp_advertise_host: str | None = None  # what receivers connect to; default bind host
    curve_public_key: str | None = None  # z85, from zmq.curve_keypair()
    curve_secret_key: str | None = None
    tcp_chunk_bytes: int = 1 << 20  # measured: 1-2 MiB chunks stay in cache on loopback, 4+ do not
    tcp_window: int = 4  # chunks in flight per receiver: bounds queues on both ends
    timeout_s: float = 30.0  # a transfer with no progress for this long has failed
    # nccl: how long a receiver waits for its group to form (every rank joined) before the
    # broadcast's own timeout_s starts. In async mode an agent's instances finish their
    # work, and join, at different times; the first may wait for the last.
    nccl_setup_timeout_s: float = 600.0
    spare_buffers: int = 2  # released buffers kept for reuse, per kind; 0 frees at once
    cached_maps: int = 4  # shm segments a receiver keeps mapped between receives
    # A SharedBucket at least this large is checksummed on a thread while receivers read;
    # a smaller one in publish() (about 0.5 ms at the default, here).
    defer_checksum_bytes: int = 16 << 20


def host_device(device: str, pinned: list[str]) -> str:
    """A process's torch device named as its host names it: with CUDA_VISIBLE_DEVICES
    entries `pinned`, the process's cuda:i is the host's GPU pinned[i] (an index, or a
    UUID such as GPU-5b3c...). Unpinned processes number GPUs as the host does."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not pinned:
        return device
    i = int(index or 0)
    return f"cuda:{pinned[i].strip()}" if i < len(pinned) else device


def choose_transport(src: Location, dst: Location) -> str:
    """The cheapest transport between two locations: one process, itself; one GPU, CUDA
    IPC; two GPUs, on one host or two, NCCL; otherwise host memory, shared on one host and
    TCP across hosts. Never "disk": that is a destination the controller names, not a peer.
    A device names the GPU as its host numbers them, so "cuda:0" of two processes on one
    host is one GPU."""
    same_host = src.host == dst.host
    if same_host and src.pid == dst.pid:
        return "inproc"
    if src.device.startswith("cuda") and dst.device.startswith("cuda"):
        return "cuda_ipc" if same_host and src.device == dst.device else "nccl"
    return "shm" if same_host else "tcp"


def describe(handle: ParamHandle) -> str:
    """How errors name a transfer."""
    return f"{handle.transport} transfer of agent {handle.agent!r} version {handle.version}"
