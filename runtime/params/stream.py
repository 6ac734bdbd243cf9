"""A tensor set made one tensor at a time, as a publish packs it.

A trainer group gathers each full weight from every rank's shard (a collective), and a
GPU trainer casts its float32 master weights to the dtype it serves. Made all at once,
either holds a second copy of the whole set beside the bucket it is packed into. A
`TensorStream` declares its names, dtypes and shapes up front (all the channel needs to
lay the bucket out) and makes each tensor only when the packing reaches it, so the
publisher holds the bucket plus the one tensor being copied.

The tensors are made exactly once each, in declaration order: a gather is a collective
that every rank makes in the same order, so `drain()` makes whatever a publish did not
(the other ranks, or a publish that failed halfway) and a second read is refused.

It knows nothing of ranks, transports or buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

__all__ = ["TensorStream", "declared", "drain"]


class TensorStream(Mapping):
    """`specs` maps each name to the (dtype, shape) that `make(name)` will return, on
    `device` (where a transport puts the bucket: the GPU ones ask before packing)."""

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], make: Callable[[str], torch.Tensor],
                 device: torch.device | str = "cpu"):
        self.specs = dict(specs)
        self.device = torch.device(device)
        self._names = list(self.specs)
        self._make = make
        self._next = 0  # self._names[:_next] have been made

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._next >= len(self._names) or self._names[self._next] != name:
            if name not in self.specs:
                raise KeyError(name)
            made = "was made already" if self._names.index(name) < self._next else "is not next"
            raise RuntimeError(f"tensor {name!r} of a stream {made}: a stream makes each tensor once, "
                               "in order (its makers may be collectives every rank runs in that order)")
        self._next += 1
        tensor = self._make(name)
        dtype, shape = self.specs[name]
        if tensor.device.type != self.device.type:
            raise ValueError(f"tensor {name!r} was made on {tensor.device}, the stream declared {self.device}")
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} was declared {dtype}{list(shape)} but made "
                             f"{tensor.dtype}{list(tensor.shape)}; its bytes would not fit the bucket")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def remaining(self) -> int:
        """Tensors not made yet."""
        return len(self._names) - self._next

    def drain(self) -> None:
        """Make, and drop at once, every tensor not made yet."""
        while self._next < len(self._names):
            self[self._names[self._next]]


def drain(tensors: Mapping[str, torch.Tensor]) -> None:
    """Finish a stream (see TensorStream.drain); a plain mapping has nothing left to make."""
    if isinstance(tensors, TensorStream):
        tensors.drain()


def declared(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], torch.device]]:
    """Each tensor's name, dtype, shape and device, in order: what a transport plans a
    bucket from. A stream's are its declarations (nothing is made); a plain mapping's are
    read off its tensors, which must be dense."""
    if isinstance(tensors, TensorStream):
        for name, (dtype, shape) in tensors.specs.items():
            yield name, dtype, tuple(shape), tensors.device
        return
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"{name!r} is not a dense torch.Tensor; publish dense tensors only")
        yield name, t.dtype, tuple(t.shape), t.device
