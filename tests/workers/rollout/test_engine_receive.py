"""The weight receive inside an engine's workers (engine_receive.py), on stand-ins for
vLLM's workers: each receives a real publication through its own channel (shm, tcp),
at its own NCCL rank, verifies before anything is staged, frees what it received once
loaded, and sees a cancel made by another process. The real engine's side is in
test_engine.py and test_engine_tensor_parallel.py."""

from __future__ import annotations

import pickle
import types
from pathlib import Path

import msgspec
import pytest
import torch

from flexmarl.runtime.params.channel import ParamChannel, ParamChannelConfig
from flexmarl.runtime.params.types import ParamTransferError
from flexmarl.workers.rollout.engine_receive import (
    Outcome,
    PublishedLoad,
    WeightReceiver,
    cancel_mark,
    raise_failures,
)


class Worker(WeightReceiver):
    """vLLM's worker as the extension sees it: a rank, a model runner, a reload."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.model = torch.nn.Linear(4, 4)
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)
        self.reloaded: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.reloaded.append({name: t.clone() for name, t in weights_iterator})


@pytest.fixture
def config(tmp_path):
    return ParamChannelConfig(shm_dir=str(tmp_path), timeout_s=5.0, disk_fsync=False)


def request(handle, config, **fields) -> bytes:
    return msgspec.msgpack.encode(PublishedLoad(handle=handle, config=config, inplace=False, **fields))


def state(version: int) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((4, 4), float(version)), "bias": torch.arange(4.0) * version}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_each_worker_receives_the_bucket_itself_and_loads_exactly_what_was_published(config, transport):
    workers = [Worker(0), Worker(1)]
    with ParamChannel(config) as trainer:
        handle = trainer.publish(state(3), agent="a", version=3, transport=transport)
        payload = request(handle, config)
        assert isinstance(payload, bytes) and len(payload) < 2048  # the handle, not the tensors
        assert [w.flexmarl_receive(payload) for w in workers] == [Outcome(True, str(handle.total_bytes))] * 2
        assert all(w.reloaded == [] for w in workers)  # nothing loads before every worker received
        outcomes = [w.flexmarl_apply(handle.key) for w in workers]
    assert outcomes == [Outcome(True, "vllm")] * 2
    for w in workers:
        assert w.reloaded[0].keys() == state(3).keys()
        assert all(torch.equal(w.reloaded[0][k], v) for k, v in state(3).items())
        w.flexmarl_close_channel()


def test_weights_received_over_tcp_free_their_buffer_once_loaded(config):
    """Over tcp the received tensors are views of a host buffer the worker's channel holds
    until the handle is released: kept, every sync would pin one more copy of the model."""
    worker = Worker()
    with ParamChannel(config) as trainer:
        for version in range(1, 5):
            handle = trainer.publish(state(version), agent="a", version=version, transport="tcp")
            assert worker.flexmarl_receive(request(handle, config)).ok
            assert worker.flexmarl_apply(handle.key).ok
            trainer.release(handle)
            assert torch.equal(worker.reloaded[-1]["weight"], state(version)["weight"])
            assert worker._flexmarl_channel[1].held_receive_buffers() <= 1  # one spare, reused next time
    worker.flexmarl_close_channel()


def test_a_worker_joins_an_nccl_broadcast_at_the_engines_rank_plus_its_own(config, monkeypatch):
    ranks = []
    monkeypatch.setattr(ParamChannel, "receive", lambda self, handle, rank=None: ranks.append(rank) or {})
    with ParamChannel(config) as trainer:
        handle = trainer.publish(state(1), agent="a", version=1, transport="shm")
    for worker in (Worker(0), Worker(1)):
        worker.flexmarl_receive(request(handle, config, rank=3))
        worker.flexmarl_receive(request(handle, config))  # not nccl: no rank
    assert ranks == [3, None, 4, None]


def test_a_corrupt_bucket_fails_the_receive_stages_nothing_and_names_the_worker(config):
    worker = Worker(1)
    with ParamChannel(config) as trainer:
        handle = trainer.publish(state(2), agent="a", version=2, transport="tcp")
        forged = msgspec.structs.replace(handle, checksum=handle.checksum ^ 1)  # as if bytes changed on the way
        outcome = worker.flexmarl_receive(request(forged, config))
        assert not outcome.ok and outcome.value == "ParamTransferError" and "checksum" in outcome.detail
        assert not worker.__dict__.get("_flexmarl_staged")
        with pytest.raises(ParamTransferError, match=r"receiving failed: .*checksum.*\(engine worker 1 of 2\)"):
            raise_failures([Outcome(True, "8"), outcome], "receiving failed")
        assert worker.flexmarl_receive(request(handle, config)).ok
        assert worker.flexmarl_drop(handle.key).ok and worker._flexmarl_staged == {}  # another worker failed
        assert not worker.flexmarl_apply(handle.key).ok and worker.reloaded == []
    worker.flexmarl_close_channel()


def test_a_cancel_made_in_another_process_reaches_the_workers_channel(config, tmp_path):
    cancel_dir = tmp_path / "cancels"
    cancel_dir.mkdir()
    worker = Worker()
    with ParamChannel(config) as trainer:
        handle = trainer.publish(state(5), agent="team/a", version=5, transport="shm")
        worker.flexmarl_receive(request(handle, config, cancel_dir=str(cancel_dir)))
        channel = worker._flexmarl_channel[1]
        assert not channel._is_cancelled("team/a", 5)
        Path(cancel_mark(str(cancel_dir), handle.key)).touch()
        assert channel._is_cancelled("team/a", 5)
        worker.flexmarl_drop(handle.key)
        # The same version published again (the sync retried without a dead rank) is another
        # publication: the mark left for the first never cancels it.
        again = trainer.publish(state(5), agent="team/a", version=5, transport="shm")
        assert worker.flexmarl_receive(request(again, config, cancel_dir=str(cancel_dir))).ok
        assert not channel._is_cancelled("team/a", 5)
        worker.flexmarl_drop(again.key)
    worker.flexmarl_close_channel()


def test_outcomes_cross_vllms_process_boundary_intact():
    """vLLM's executor pickles what a worker returns."""
    for outcome in (Outcome(True, "in place"), Outcome(False, "ValueError", "differ")):
        assert pickle.loads(pickle.dumps(outcome)) == outcome
