"""The GPU transports of the parameter channel: "cuda_ipc" (same host) and "nccl" (any host).

Buckets are packed and checksummed on the GPU (the same `checksum` as every other
transport). Importing this module touches no GPU and no CuPy: CUDA is initialised by the
first GPU transfer and CuPy is imported by param_nccl only when a broadcast runs, so
CPU-only installs never load either.

cuda_ipc: the publisher's bucket is shared through torch's CUDA IPC (the fields of
UntypedStorage._share_cuda_, carried in the handle as plain bytes and ints: no pickle);
receivers open it in place, so their tensors are views of the publisher's GPU memory.

nccl: a CuPy NCCL broadcast (param_nccl), the publisher as rank 0. A publication to a
named group reuses the group's communicator (and its unique id) from the last publication
to it; one with no group name gets a one-shot communicator.

This module does not know who the receivers are or how ranks are assigned: the
controller assigns them and passes each receiver its rank.
"""

from __future__ import annotations

import torch

from . import param_nccl
from .param_bucket import ALIGN, pack_into, unpack, verify_bucket
from .param_transport import Transport
from .param_types import CudaIpcInfo, NcclInfo, ParamHandle, ParamTransferError, describe

__all__ = ["CudaIpcTransport", "NcclTransport"]


def _gpu_bucket(tensors, fields: dict, transport: str) -> torch.Tensor:
    """A bucket on the tensors' one CUDA device, packed; sets fields["checksum"]. At least
    ALIGN bytes: an empty CUDA storage has no IPC handle and no address to broadcast."""
    devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
    if len(devices) != 1:
        raise ValueError(f"{transport} publishes tensors from one CUDA device; these are on {sorted(map(str, devices)) or 'the CPU'}")
    bucket = torch.empty(max(fields["total_bytes"], ALIGN), dtype=torch.uint8, device=devices.pop())
    fields["checksum"] = pack_into(bucket[: fields["total_bytes"]], tensors, fields["layout"])  # after a device sync
    return bucket


def _require_cuda(handle: ParamHandle) -> None:
    if not torch.cuda.is_available():
        raise ParamTransferError(f"{describe(handle)}: this process has no CUDA device")


class CudaIpcTransport(Transport):
    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        gpu = _gpu_bucket(tensors, fields, "cuda_ipc")
        return ParamHandle(**fields, cuda_ipc=_share(gpu)), gpu  # the bucket lives until release

    def receive(self, handle, *, verify, rank):
        _require_cuda(handle)
        bucket = _open(handle)[: handle.total_bytes]
        if verify:
            verify_bucket(handle, bucket)
        return unpack(bucket, handle.layout), None


class NcclTransport(Transport):
    def __init__(self, *args, new_unique_id=param_nccl.new_unique_id, communicators=None):
        super().__init__(*args)
        self._new_unique_id = new_unique_id
        self.communicators = communicators or param_nccl.Communicators()
        self._groups: dict[str, NcclInfo] = {}  # agent -> the group this publisher last sent it to

    def group_info(self, agent: str, group: str, receivers: int) -> NcclInfo:
        """The communicator for a publication: the agent's current one if `group` names
        it, else a new one (a new unique id) that replaces it."""
        if receivers < 1:
            raise ValueError(f"nccl needs receivers >= 1, got {receivers}")
        info = self._groups.get(agent)
        if group and info is not None and (info.group, info.world_size) == (group, receivers + 1):
            return info
        info = NcclInfo(self._new_unique_id(), receivers + 1, group)
        if group:
            self._groups[agent] = info
        return info

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        gpu = _gpu_bucket(tensors, fields, "nccl")
        handle = ParamHandle(**fields, nccl=self.group_info(fields["agent"], group, receivers))
        return handle, param_nccl.Broadcast(self.communicators, handle, gpu)

    def receive(self, handle, *, verify, rank):
        _require_cuda(handle)
        bucket = param_nccl.receive(self.communicators, handle, rank, self.location.device, self.config.timeout_s)
        if verify:
            verify_bucket(handle, bucket)
        return unpack(bucket, handle.layout), None

    def release(self, handle, resource):
        resource.close()

    def close(self):
        self.communicators.close()


def _share(bucket: torch.Tensor) -> CudaIpcInfo:
    (device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync) = bucket.untyped_storage()._share_cuda_()
    return CudaIpcInfo(device, handle, size, offset, rc_handle, rc_offset, event_handle, event_sync, bucket.storage_offset())


def _open(handle: ParamHandle) -> torch.Tensor:
    info = handle.cuda_ipc
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        info.device, info.handle, info.storage_size, info.storage_offset, info.ref_counter_handle,
        info.ref_counter_offset, info.event_handle, info.event_sync_required)
    bucket = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info.device}")
    return bucket.set_(storage, info.tensor_offset, (max(handle.total_bytes, ALIGN),), (1,))
