"""NCCL broadcast for the parameter channel's "nccl" transport (param_gpu), via CuPy.

A one-shot communicator per publication. The unique id travels inside the handle; the
publisher is rank 0 and broadcasts from a thread of its own once all receivers (ranks
1..receivers) have joined; each receiver broadcasts into a fresh bucket.

CuPy is imported only when a broadcast runs, so CPU-only installs never load it. This
module does not know who the receivers are or how ranks are assigned: the controller
assigns them and passes each receiver its rank.
"""

from __future__ import annotations

import logging
import threading

import torch

from .param_bucket import ALIGN
from .param_types import NcclInfo, ParamHandle, ParamTransferError, describe

__all__ = ["Broadcast", "new_unique_id", "receive"]

log = logging.getLogger(__name__)


def receive(handle: ParamHandle, rank: int | None, device: str, timeout_s: float) -> torch.Tensor:
    """The handle's bucket (uint8, total_bytes long) on a GPU, not yet verified."""
    world = handle.nccl.world_size
    if rank is None or not 1 <= rank < world:
        raise ValueError(f"nccl receive needs rank= in 1..{world - 1} (the publisher is rank 0), got {rank}")
    target = torch.device(device if device.startswith("cuda") else "cuda")
    bucket = torch.empty(max(handle.total_bytes, ALIGN), dtype=torch.uint8, device=target)
    done, errors = threading.Event(), []

    def join_broadcast() -> None:
        try:
            _broadcast(bucket, handle.nccl, rank)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=join_broadcast, name=f"nccl-recv-{handle.key}", daemon=True).start()
    # CuPy cannot cancel ncclCommInitRank: on timeout the thread stays blocked until its peers appear.
    if not done.wait(timeout_s):
        raise ParamTransferError(f"{describe(handle)}: the NCCL broadcast did not complete within {timeout_s:.0f} s "
                                 f"(rank {rank} of {world}); the publisher or another receiver is missing")
    if errors:
        raise ParamTransferError(f"{describe(handle)}: NCCL broadcast failed: {errors[0]!r}") from errors[0]
    return bucket[: handle.total_bytes]


def new_unique_id() -> bytes:
    from cupy.cuda import nccl

    return bytes(b & 0xFF for b in nccl.get_unique_id())


def _broadcast(bucket: torch.Tensor, info: NcclInfo, rank: int) -> None:
    import cupy
    from cupy.cuda import nccl

    # CuPy hands ncclUniqueId out as C chars: signed on x86, unsigned on ARM.
    signed = tuple(b - 256 if b > 127 else b for b in info.unique_id)
    with cupy.cuda.Device(bucket.device.index), torch.cuda.device(bucket.device):
        try:
            comm = nccl.NcclCommunicator(info.world_size, signed, rank)
        except OverflowError:
            comm = nccl.NcclCommunicator(info.world_size, tuple(info.unique_id), rank)
        try:
            stream = torch.cuda.Stream(bucket.device)  # off the compute stream the trainer uses
            stream.wait_stream(torch.cuda.current_stream(bucket.device))
            comm.broadcast(bucket.data_ptr(), bucket.data_ptr(), bucket.numel(), nccl.NCCL_UINT8, 0, stream.cuda_stream)
            stream.synchronize()
        finally:
            comm.destroy()


class Broadcast:
    """Rank 0 of a publication's communicator: waits for the receivers, sends, tears down."""

    def __init__(self, handle: ParamHandle, bucket: torch.Tensor):
        self.bucket, self.error = bucket, None
        self._thread = threading.Thread(target=self._run, args=(handle,), name=f"nccl-send-{handle.key}", daemon=True)
        self._thread.start()

    def _run(self, handle: ParamHandle) -> None:
        try:
            _broadcast(self.bucket, handle.nccl, 0)
        except BaseException as exc:
            self.error = exc
            log.error("%s: NCCL broadcast from rank 0 failed: %r", describe(handle), exc)

    def close(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("released an nccl publication whose receivers never all joined; its sender "
                        "thread stays blocked in ncclCommInitRank (CuPy cannot cancel it)")
