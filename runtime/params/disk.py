"""The "disk" transport: a self-describing file, for checkpoints and offload.

The file starts with a preamble and the handle itself, so a checkpoint loads without its
publisher (`read_handle`); the bucket follows, page-aligned. It is written under a
temporary name and renamed, so a reader never finds a half-written file, and it outlives
the channel that wrote it until someone releases its handle.

This module does not know where checkpoints belong: the path comes from the caller.
"""

from __future__ import annotations

import os
import struct

import msgspec
import torch

from .bucket import checksum, compare, laid_out, pack_into, round_up, unlink_quietly
from .transport import Transport
from .types import ParamHandle, ParamTransferError, describe

__all__ = ["DiskTransport", "read_handle"]

_DISK_MAGIC = b"FLXPDSK1"
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
    data_offset = round_up(_DISK_PREAMBLE.size + len(header), 4096)
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
        unlink_quietly({tmp})
        raise
    if fsync:
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _read_disk(handle: ParamHandle, dest: torch.Tensor) -> None:
    if handle.path is None:
        raise ParamTransferError(f"{describe(handle)}: malformed handle (no file path)")
    try:
        f = open(handle.path, "rb")
    except FileNotFoundError:
        raise ParamTransferError(f"{describe(handle)}: {handle.path} does not exist (released or moved)") from None
    with f:
        magic, data_offset, _ = _DISK_PREAMBLE.unpack(f.read(_DISK_PREAMBLE.size).ljust(_DISK_PREAMBLE.size, b"\0"))
        size = os.fstat(f.fileno()).st_size
        if magic != _DISK_MAGIC or size < data_offset + handle.total_bytes:
            raise ParamTransferError(f"{describe(handle)}: {handle.path} is truncated or not a bucket file "
                                     f"({size} bytes, needs {data_offset + handle.total_bytes}). Publish it again.")
        f.seek(data_offset)
        view, done = memoryview(dest.numpy()), 0
        while done < handle.total_bytes:
            n = f.readinto(view[done:])
            if not n:
                raise ParamTransferError(f"{describe(handle)}: {handle.path} ended after {done} bytes")
            done += n


class DiskTransport(Transport):
    kept_on_close = True  # a checkpoint outlives its writer

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        """Tensors that already are the bucket (a shared training state's part, say) are
        written as they lie; others are packed into a host buffer first."""
        if path is None:
            raise ValueError("publish(transport='disk') needs path=")
        data = laid_out(tensors, fields["layout"], fields["total_bytes"])
        staging = self.host.take(fields["total_bytes"]) if data is None else None
        try:
            if staging is not None:
                fields["checksum"] = pack_into(staging, tensors, fields["layout"])
            else:
                fields["checksum"] = checksum(data)
            handle = ParamHandle(**fields, path=os.fspath(path))
            _write_disk(handle.path, handle, data if staging is None else staging, self.config.disk_fsync)
        finally:
            if staging is not None:
                self.host.give(staging)
        return handle, None

    def receive(self, handle, *, verify, rank):
        def read(staging: torch.Tensor) -> None:
            _read_disk(handle, staging)
            if verify:  # a file is not published again: say which one is damaged
                compare(handle, handle.checksum, checksum(staging),
                        f"The file {handle.path} is damaged (changed after it was written): not loaded.")

        return self.staged(handle, False, read)

    def receive_into(self, handle, dst, *, verify, atomic, rank):
        """Into a destination that is the bucket's layout already (a shared training state
        being made), and may be thrown away on error, the file is read straight in and
        verified after; anything else through a host buffer."""
        data = None if atomic else laid_out(dst, handle.layout, handle.total_bytes)
        if data is None:
            return super().receive_into(handle, dst, verify=verify, atomic=atomic, rank=rank)
        _read_disk(handle, data)
        if verify:
            compare(handle, handle.checksum, checksum(data),
                    "Found after reading it in (atomic=False): the destination must be discarded.")

    def release(self, handle, resource):
        unlink_quietly({handle.path})
