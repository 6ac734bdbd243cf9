"""The GPU transports of the parameter channel: "cuda_ipc" (same host) and "nccl" (any host).

Buckets are packed and checksummed on the GPU (the same `checksum` as every other
transport). Importing this module touches no GPU and no CuPy: CUDA is initialised by the
first GPU transfer and CuPy is imported only when a GPU transfer runs, so CPU-only
installs never load either.

cuda_ipc: the publisher's bucket is GPU memory of its own (cudaMalloc through CuPy, outside
torch's caching allocator), shared by a cudaIpcMemHandle carried in the handle as plain
bytes (no pickle), with an id of the allocation. Receivers map it in place
(cudaIpcOpenMemHandle), so their tensors are views of the publisher's GPU memory. Mapping
costs more than copying the bytes (18-42 ms for 1-3 GB on an H100, 0.04-0.06 of a device
copy), so both ends keep it: a released allocation stays with the publisher (up to
`spare_buffers` of them) and the next publication of the same size reuses it, and a
receiver keeps its mappings open after release (up to `cached_maps`, by allocation id) and
maps only an allocation it has not seen: each sync after the first is a device copy. A
receiver unmaps what it evicts, and everything at close; the publisher frees its spares
at close. torch's own CUDA IPC is not used: it frees a shared block only once every
receiver it counts has let go, and a publication nobody opened stayed allocated until the
publisher exited.

nccl: a CuPy NCCL broadcast (nccl.py), the publisher as rank 0. A publication to a
named group reuses the group's communicator (and its unique id) from the last publication
to it; one with no group name gets a one-shot communicator.

This module does not know who the receivers are or how ranks are assigned: the
controller assigns them and passes each receiver its rank.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import torch

from . import nccl as param_nccl
from .bucket import ALIGN, SparePool, pack_into, unpack, verify_bucket
from .stream import declared
from .transport import Transport
from .types import CudaIpcInfo, NcclInfo, ParamHandle, ParamTransferError, describe

__all__ = ["CudaIpcTransport", "NcclTransport"]


def _one_device(tensors, transport: str) -> torch.device:
    found = [device for *_, device in declared(tensors)]  # a stream's are asked, not made
    devices = {d for d in found if d.type == "cuda"}
    if len(devices) != 1 or any(d.type != "cuda" for d in found):
        where = sorted(map(str, set(found))) or ["the CPU"]
        raise ValueError(f"{transport} publishes tensors from one CUDA device; these are on {where}")
    device = devices.pop()
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _gpu_bucket(tensors, fields: dict, transport: str) -> torch.Tensor:
    """A bucket on the tensors' one CUDA device, packed; sets fields["checksum"]. At least
    ALIGN bytes: an empty CUDA storage has no address to broadcast."""
    bucket = torch.empty(max(fields["total_bytes"], ALIGN), dtype=torch.uint8, device=_one_device(tensors, transport))
    fields["checksum"] = pack_into(bucket[: fields["total_bytes"]], tensors, fields["layout"])  # after a device sync
    return bucket


def _require_cuda(handle: ParamHandle) -> None:
    if torch.cuda.device_count() == 0:
        raise ParamTransferError(f"{describe(handle)}: this process has no CUDA device")


def _receive_device(device: str) -> torch.device:
    """Where a receiver puts an NCCL bucket: its channel's GPU, or its current one."""
    target = torch.device(device if device.startswith("cuda") else "cuda")
    return target if target.index is not None else torch.device("cuda", torch.cuda.current_device())


class CudaIpcTransport(Transport):
    def __init__(self, *args, open_mapping=None):
        super().__init__(*args)
        # Released allocations, by (bytes, device), for the next publication of that size.
        self._spares = SparePool(self.config.spare_buffers, free=lambda memory: memory.free())
        self.mappings = IpcMappings(self.config.cached_maps, open_mapping or _IpcMapping.open)

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        device = _one_device(tensors, "cuda_ipc")
        size = (max(fields["total_bytes"], ALIGN), device.index)
        memory = self._spares.take(size) or _IpcMemory.allocate(*size)
        try:
            fields["checksum"] = pack_into(memory.tensor[: fields["total_bytes"]], tensors, fields["layout"])
        except BaseException:
            self._spares.give(size, memory)
            raise
        return ParamHandle(**fields, cuda_ipc=memory.info()), memory  # kept for reuse at release

    def receive(self, handle, *, verify, rank):
        _require_cuda(handle)
        mapping = self.mappings.get(handle.cuda_ipc)
        bucket = mapping.tensor[: handle.total_bytes]
        if verify:
            verify_bucket(handle, bucket)
        # The next version of the same agent comes in the same allocation with the same
        # layout: its views are the ones made last time (hundreds of views cost more than
        # the copy of a gigabyte on the GPU).
        made = getattr(mapping, "unpacked", None)
        if made is None or made[0] != handle.total_bytes or made[1] != handle.layout:
            made = (handle.total_bytes, handle.layout, unpack(bucket, handle.layout))
            mapping.unpacked = made
        return dict(made[2]), None  # the mapping stays open for the next sync

    def release(self, handle, resource):
        self._spares.give((resource.nbytes, resource.device), resource)

    def close(self):
        self.mappings.close()
        self._spares.clear()


class IpcMappings:
    """A receiver's open mappings of publishers' allocations, by allocation id, the most
    recently used kept (up to `limit`); a mapping evicted, or left at close, is unmapped."""

    def __init__(self, limit: int, open_mapping) -> None:
        self._limit, self._open = max(limit, 1), open_mapping
        self._open_now: OrderedDict[str, _IpcMapping] = OrderedDict()
        self.opened = 0  # mappings made so far: a sync that reused one made none

    def get(self, info: CudaIpcInfo):
        key = info.allocation or bytes(info.handle).hex()  # a publisher without ids: by its handle
        mapping = self._open_now.pop(key, None)
        if mapping is None:
            mapping = self._open(info)
            self.opened += 1
        self._open_now[key] = mapping
        while len(self._open_now) > self._limit:
            self._open_now.popitem(last=False)[1].close()
        return mapping

    def __len__(self) -> int:
        return len(self._open_now)

    def close(self) -> None:
        while self._open_now:
            self._open_now.popitem()[1].close()


class NcclTransport(Transport):
    def __init__(self, *args, new_unique_id=param_nccl.new_unique_id, communicators=None) -> None:
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
        bucket = param_nccl.receive(self.communicators, handle, rank, _receive_device(self.location.device),
                                    self.config.timeout_s, self.config.nccl_setup_timeout_s,
                                    cancelled=lambda: self.cancelled(handle.agent, handle.version))
        if verify:
            verify_bucket(handle, bucket)
        return unpack(bucket, handle.layout), None

    def release(self, handle, resource):
        resource.close()

    def close(self):
        self.communicators.close()


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU `index`: the same GPU has the same one in every
    process, however each numbers its GPUs."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu(info: CudaIpcInfo, uuids: list[str]) -> int:
    """This process's index of the GPU a publication's memory is on (`uuids`: this
    process's GPUs' UUIDs, in its order). A publication without a UUID: its index."""
    if not info.uuid:
        return info.device
    if info.uuid in uuids:
        return uuids.index(info.uuid)
    raise ParamTransferError(f"the published memory is on GPU {info.uuid}, which this process does not see "
                             f"(it sees {len(uuids)}: CUDA_VISIBLE_DEVICES); CUDA IPC needs the publisher's GPU, "
                             "so this pair should sync over NCCL or host memory")


def _as_tensor(pointer: int, nbytes: int, device: int, owner) -> torch.Tensor:
    """A uint8 tensor over GPU memory torch did not allocate (CuPy's array interface;
    `owner` is kept alive by the tensor)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(pointer, nbytes, owner, device)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=f"cuda:{device}")


class _IpcMemory:
    """The publisher's side: GPU memory of its own, exported by an IPC handle."""

    def __init__(self, memory, device: int, nbytes: int):
        self._memory, self.device, self.nbytes = memory, device, nbytes
        self.tensor = _as_tensor(memory.ptr, nbytes, device, memory)
        self._info: CudaIpcInfo | None = None

    @classmethod
    def allocate(cls, nbytes: int, device: int) -> _IpcMemory:
        import cupy

        with cupy.cuda.Device(device):
            return cls(cupy.cuda.Memory(nbytes), device, nbytes)  # cudaMalloc, not a pool

    def info(self) -> CudaIpcInfo:
        import cupy

        if self._info is None:  # the same allocation, the same handle: asked once
            with cupy.cuda.Device(self.device):
                handle = cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
            self._info = CudaIpcInfo(self.device, bytes(handle), self.nbytes, gpu_uuid(self.device),
                                     allocation=secrets.token_hex(8))
        return self._info

    def free(self) -> None:
        """cudaFree, once the last reference goes: the tensor here and CuPy's Memory."""
        self.tensor = self._memory = None


class _IpcMapping:
    """A receiver's side: a publisher's IPC memory mapped into this process."""

    def __init__(self, pointer: int, info: CudaIpcInfo, device: int):
        self._pointer: int | None = pointer
        self._device = device
        self.tensor = _as_tensor(pointer, info.size, device, self)
        self.unpacked = None  # (total bytes, layout, views) of the last publication received here

    @classmethod
    def open(cls, info: CudaIpcInfo) -> _IpcMapping:
        """Map the memory on the GPU it lives on, as this process numbers that GPU."""
        import cupy

        device = local_gpu(info, [gpu_uuid(i) for i in range(torch.cuda.device_count())])
        with cupy.cuda.Device(device):
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(info.handle)
        return cls(pointer, info, device)

    def close(self) -> None:
        """Unmap. The tensors handed out are views of this memory: done with them by now."""
        import cupy

        if self._pointer is None:
            return
        pointer, self._pointer, self.tensor, self.unpacked = self._pointer, None, None, None
        with cupy.cuda.Device(self._device):
            torch.cuda.synchronize(self._device)  # no kernel may still read it
            cupy.cuda.runtime.ipcCloseMemHandle(pointer)
