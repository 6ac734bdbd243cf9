"""A TensorStream published over every CPU transport: laid out from its declared specs,
each tensor made when the packing reaches it and let go before the next is made (so a
publisher holds the bucket and one tensor), made exactly once in order, and drained
after a publish that stopped before making them all."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from flexmarl.runtime.params.channel import ParamChannel, ParamChannelConfig
from flexmarl.runtime.params.stream import TensorStream, drain

CPU_TRANSPORTS = ["shm", "tcp", "disk"]


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"embed": torch.randn(50, 16), "layer.0.w": torch.randn(16, 16), "layer.0.b": torch.randn(16),
            "scalar": torch.tensor(1.5), "head": torch.randn(7, 16)}


class Maker:
    """Makes bfloat16 copies of `source`'s tensors (as a cast or a gather does: new memory
    each time), counting how many of them are alive at once."""

    def __init__(self, source: dict[str, torch.Tensor]):
        self.source, self.made, self.live, self.most_live = source, [], 0, 0

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self.source[name].to(torch.bfloat16)
        self.made.append(name)
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        weakref.finalize(tensor, self._gone)
        return tensor

    def _gone(self) -> None:
        self.live -= 1

    def stream(self) -> TensorStream:
        return TensorStream({k: (torch.bfloat16, tuple(v.shape)) for k, v in self.source.items()}, self)


@pytest.fixture
def channel(tmp_path):
    with ParamChannel(ParamChannelConfig(shm_dir=str(tmp_path), disk_fsync=False)) as ch:
        yield ch


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_streamed_publish_holds_one_made_tensor_at_a_time_and_moves_the_same_bytes(channel, transport,
                                                                                    tmp_path):
    source = weights()
    maker = Maker(source)
    handle = channel.publish(maker.stream(), agent="a", version=1, transport=transport, path=tmp_path / "w")
    gc.collect()
    assert maker.made == list(source) and maker.most_live == 1 and maker.live == 0
    plain = channel.publish({k: v.to(torch.bfloat16) for k, v in source.items()}, agent="a", version=1,
                            transport=transport, path=tmp_path / "plain")
    assert (handle.layout, handle.total_bytes, handle.checksum) == (plain.layout, plain.total_bytes, plain.checksum)
    with ParamChannel(channel.config) as receiver:
        got = receiver.receive(handle)
        assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in source.items())
        receiver.release(handle)


def test_a_shared_bucket_made_from_a_stream_holds_one_made_tensor_at_a_time(channel):
    maker = Maker(weights())
    bucket = channel.shared_bucket(maker.stream())
    gc.collect()
    assert maker.most_live == 1 and list(bucket.tensors) == list(maker.source)
    bucket.close()


def test_a_stream_makes_each_tensor_once_and_in_order():
    maker = Maker(weights())
    stream = maker.stream()
    with pytest.raises(RuntimeError, match="'layer.0.w' of a stream is not next"):
        stream["layer.0.w"]
    stream["embed"]
    with pytest.raises(RuntimeError, match="'embed' of a stream was made already"):
        stream["embed"]
    with pytest.raises(KeyError):
        stream["missing"]
    assert stream.remaining == 4
    drain(stream)
    assert maker.made == list(maker.source) and stream.remaining == 0
    drain(stream)  # nothing left: makes nothing more
    assert len(maker.made) == 5


def test_a_made_tensor_that_differs_from_its_declaration_is_refused():
    stream = TensorStream({"w": (torch.bfloat16, (2, 2))}, lambda name: torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"declared torch.bfloat16\[2, 2\] but made torch.bfloat16\[2, 3\]"):
        stream["w"]
    stream = TensorStream({"w": (torch.bfloat16, (2,))}, lambda name: torch.zeros(2))
    with pytest.raises(ValueError, match="would not fit the bucket"):
        stream["w"]


def test_a_publish_that_fails_before_packing_leaves_the_whole_stream_to_drain(channel):
    maker = Maker(weights())
    stream = maker.stream()
    with pytest.raises(ValueError, match="needs path="):
        channel.publish(stream, agent="a", version=1, transport="disk")
    assert maker.made == [] and stream.remaining == 5
    drain(stream)
    assert maker.made == list(maker.source)


def test_a_plain_mapping_has_nothing_to_drain():
    tensors = weights()
    drain(tensors)
    assert list(tensors) == list(weights())


def test_the_gpu_transports_ask_a_stream_its_device_without_making_a_tensor():
    """cuda_ipc and nccl check that a publication is on one GPU before packing; asking the
    tensors would make (gather) them all, and the packing could then make none."""
    from flexmarl.runtime.params.gpu import _one_device

    maker = Maker(weights())
    with pytest.raises(ValueError, match=r"from one CUDA device; these are on \['cpu'\]"):
        _one_device(maker.stream(), "nccl")
    on_gpu = TensorStream({"w": (torch.bfloat16, (2,))}, maker, device="cuda:1")
    assert _one_device(on_gpu, "cuda_ipc") == torch.device("cuda", 1)
    assert maker.made == []


def test_a_tensor_made_on_another_device_than_declared_is_refused():
    stream = TensorStream({"w": (torch.float32, (2,))}, lambda name: torch.zeros(2), device="cuda:0")
    with pytest.raises(ValueError, match="made on cpu, the stream declared cuda:0"):
        stream["w"]
