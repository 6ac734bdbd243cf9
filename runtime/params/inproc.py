"""The "inproc" transport: publisher and receiver are the same process, so a registry
hands over the publisher's own tensors and nothing is copied or checksummed.

It does not know which channel published what: every channel of the process shares the
registry, keyed by the publication's unique key.
"""

from __future__ import annotations

import os
import threading

import torch

from .transport import Transport
from .types import ParamHandle, ParamTransferError, describe

__all__ = ["InprocTransport"]

_published: dict[str, dict[str, torch.Tensor]] = {}  # key -> the publisher's own tensors
_lock = threading.Lock()


class InprocTransport(Transport):
    checksum_in_handle = False  # the bytes never leave the process

    def publish(self, tensors, fields, *, bucket=None, path=None, receivers=1, group=""):
        with _lock:
            _published[fields["key"]] = {name: t.detach() for name, t in tensors.items()}
        return ParamHandle(**fields, checksum=None), None

    def receive(self, handle, *, verify, rank):
        if handle.publisher.pid != os.getpid():
            raise ParamTransferError(f"{describe(handle)}: an inproc handle from pid {handle.publisher.pid} cannot "
                                     f"be received in pid {os.getpid()}; publish with choose_transport()'s choice")
        with _lock:
            tensors = _published.get(handle.key)
        if tensors is None:
            raise ParamTransferError(f"{describe(handle)}: not published in this process, or already released")
        return dict(tensors), None

    def release(self, handle, resource):
        with _lock:
            _published.pop(handle.key, None)
