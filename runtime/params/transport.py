"""What one transport of the parameter channel is: the interface every row of the channel's
transport table (channel.TRANSPORTS) implements, and the host buffers it is handed.

A channel makes one instance per transport it uses, the first time it uses it, and hands
it the channel's settings, its location and its pool of host buffers; the instance keeps
whatever state its transport needs (a server, mapped segments) until `close()`.

This module does not know any particular transport, nor which one to use when: the
channel's table names them and the controller (or `choose_transport`) picks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch

from .bucket import SparePool, unpack, verify_bucket
from .types import Location, ParamChannelConfig, ParamHandle

__all__ = ["HostBuffers", "Transport"]


class HostBuffers:
    """Host buckets for packing and staging. A released one is kept (up to `spares` of
    them) for the next bucket of the same size: a fresh 1 GB buffer costs ten memcpys in
    page faults on this kind of VM, a reused one nothing."""

    def __init__(self, spares: int):
        self._spares: SparePool[torch.Tensor] = SparePool(spares, free=lambda _: None)

    def take(self, total: int) -> torch.Tensor:
        buf = self._spares.take(total)
        return buf if buf is not None else torch.empty(total, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        self._spares.give(buf.numel(), buf)

    def spares(self) -> int:
        return len(self._spares)

    def clear(self) -> None:
        self._spares.clear()


class Transport:
    """One way of moving a bucket. Publish and release run at the publisher, receive and
    receive_into at a receiver; the channel checks a handle's layout before either."""

    # False where a handle may carry no checksum: inproc never leaves the process, and a
    # SharedBucket's checksum over shm follows in the segment's header.
    checksum_in_handle: ClassVar[bool] = True
    # True where a publication outlives its channel's close(): disk files are checkpoints.
    kept_on_close: ClassVar[bool] = False

    def __init__(self, config: ParamChannelConfig, location: Location, host: HostBuffers,
                 cancelled: Callable[[str, int], bool] = lambda agent, version: False):
        self.config, self.location, self.host = config, location, host
        # Whether the channel was told to give up receiving (agent, version): a transport
        # that waits on other ranks polls it (a peer died); the others never wait on peers.
        self.cancelled = cancelled

    @classmethod
    def check_config(cls, config: ParamChannelConfig) -> None:
        """Refuse settings this transport cannot run safely with (raises ValueError)."""

    def publish(self, tensors: Mapping[str, torch.Tensor], fields: dict, *, bucket=None, path=None,
                receivers: int = 1, group: str = "") -> tuple[ParamHandle, object]:
        """Make the bytes receivable. `fields` are the handle's common fields; `bucket` is
        the SharedBucket `tensors` live in, if any; `receivers` and `group` are for
        transports with ranks (nccl). Returns the handle and whatever keeps the bytes
        alive until `release`."""
        raise NotImplementedError

    def receive(self, handle: ParamHandle, *, verify: bool, rank: int | None) -> tuple[dict[str, torch.Tensor], object]:
        """The tensors (views), and what holds the memory behind them if anything must (a
        host buffer from `self.host`, a mapping): the channel keeps that until the
        receiver releases the handle, then passes it to `release_received`."""
        raise NotImplementedError

    def receive_into(self, handle: ParamHandle, dst: Mapping[str, torch.Tensor], *, verify: bool, atomic: bool,
                     rank: int | None) -> None:
        """Copy into `dst`, already checked to match the layout. By default: receive, copy,
        and the staging buffer is free again at once (its views never escaped)."""
        received, staging = self.receive(handle, verify=verify, rank=rank)
        try:
            copy_all([(dst[name], t) for name, t in received.items()])
        finally:
            del received
            if staging is not None:
                self.release_received(staging)

    def release(self, handle: ParamHandle, resource: object) -> None:
        """End a publication of this channel's; what `publish` returned comes back."""

    def release_received(self, resource: object) -> None:
        """A receiver is done with the views `receive` gave it; what it returned comes back.
        By default that is a host buffer, kept for reuse."""
        self.host.give(resource)

    def close(self) -> None:
        """Stop whatever this transport runs; publications are released before."""

    def staged(self, handle: ParamHandle, verify: bool, fill: Callable[[torch.Tensor], None]):
        """Receive into a host buffer: `fill` writes the bucket's bytes into it. The buffer
        goes back to the pool if anything fails."""
        staging = self.host.take(handle.total_bytes)
        try:
            fill(staging)
            if verify:
                verify_bucket(handle, staging)
        except BaseException:
            self.host.give(staging)
            raise
        return unpack(staging, handle.layout), staging


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for each (dst, src). Pairs on one CUDA device go in one multi-tensor
    copy (a few kernel launches for a model's hundreds of tensors, where one copy each
    spent more on launches than on bytes); any other pair is copied on its own."""
    with torch.no_grad():
        same_gpu = [d.is_cuda and s.device == d.device and d.dtype == s.dtype for d, s in pairs]
        if any(same_gpu):
            batched = [pair for pair, fast in zip(pairs, same_gpu) if fast]
            torch._foreach_copy_([d for d, _ in batched], [s for _, s in batched])
        for (d, s), fast in zip(pairs, same_gpu):
            if not fast:
                d.copy_(s)
