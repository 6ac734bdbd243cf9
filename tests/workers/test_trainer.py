"""The trainer's command handlers, run directly (no processes): training states swap
byte-exactly, and a damaged parked copy is refused without side effects."""

import random
from pathlib import Path

import msgspec
import pytest
import torch

from flexmarl.controller import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.param_channel import ParamHandle, ParamTransferError
from flexmarl.workers import models
from flexmarl.workers.trainer import TrainerHandler, training_state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB,
                              tmp_path_factory.mktemp("planner"))


def sample(i, rng, version):
    query = digit_chain.make_query(rng)
    return p.TrainSample(f"s{i}", digit_chain.planner_prompt(query), digit_chain.make_query(rng),
                         rng.uniform(-1, 1), [-1.0, -1.0, -1.0], [version])


def trained_handler(model_dir, steps=2):
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0))
    rng = random.Random(0)
    for v in range(1, steps + 1):
        h._execute(p.TrainMicroBatch(2, "planner", v, [sample(i, rng, v - 1) for i in range(8)]))
        h._execute(p.OptimStep(3, "planner", v, 1 / 8))
    # leave gradients pending, so the swap must carry them too
    h._execute(p.TrainMicroBatch(4, "planner", steps + 1, [sample(i, rng, steps) for i in range(8)]))
    return h


def snapshot(h):
    state = h.agents["planner"]
    return {k: v.clone() for k, v in training_state(state.model, state.optimizer).items()}


def test_a_swapped_training_state_comes_back_byte_exact(model_dir):
    h = trained_handler(model_dir)
    before = snapshot(h)
    assert any(k.startswith("grad/") for k in before) and any(k.startswith("optim/") for k in before)
    out = h._execute(p.OffloadAgent(5, "planner"))
    assert "planner" not in h.agents
    other = TrainerHandler()  # another trainer takes it over
    other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    after = snapshot(other)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    h._execute(p.ReleaseState(7, "planner", out.handle))
    # and it keeps training from exactly where it was
    other._execute(p.OptimStep(8, "planner", out.version + 1, 1 / 8))
    assert other.agents["planner"].version == out.version + 1
    h.close(), other.close()


def test_a_corrupted_parked_copy_is_refused_and_nothing_is_trained_on_it(model_dir):
    h = trained_handler(model_dir)
    out = h._execute(p.OffloadAgent(5, "planner"))
    handle = msgspec.msgpack.decode(out.handle, type=ParamHandle)
    segment = Path(handle.path)  # the shared-memory file holding the parked copy
    with open(segment, "r+b") as fh:
        fh.seek(segment.stat().st_size - 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    other = TrainerHandler()
    with pytest.raises(ParamTransferError):
        other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    assert "planner" not in other.agents
    with pytest.raises(KeyError, match="not resident"):
        other._execute(p.TrainMicroBatch(7, "planner", out.version + 1, []))
    with open(segment, "r+b") as fh:  # repair: the parked copy was kept, a retry succeeds
        fh.seek(segment.stat().st_size - 100)
        fh.write(byte)
    other._execute(p.LoadAgent(8, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    assert "planner" in other.agents
    h.close(), other.close()


def test_weights_published_over_shm_stay_frozen_while_the_trainer_steps_on(model_dir):
    from flexmarl.runtime.param_channel import ParamChannel

    shm, plain = trained_handler(model_dir), trained_handler(model_dir)
    for h in (shm, plain):
        h._execute(p.OptimStep(5, "planner", 3, 1 / 8))
    v3 = msgspec.msgpack.decode(shm._execute(p.PublishWeights(6, "planner", 3, "shm", ["r"])).handle, type=ParamHandle)
    plain._execute(p.PublishWeights(6, "planner", 3, "tcp", ["r"]))
    state = shm.agents["planner"]
    assert v3.path == state.bucket.segment.path  # sealed where the parameters live: no copy
    want_v3 = {k: v.clone() for k, v in state.model.state_dict().items()}
    batch = [sample(i, random.Random(1), 3) for i in range(8)]
    for h in (shm, plain):
        h._execute(p.TrainMicroBatch(7, "planner", 4, batch))
        h._execute(p.OptimStep(8, "planner", 4, 1 / 8))
    assert state.bucket.moves == 1  # v3 was still live: the step wrote to a fresh copy
    with ParamChannel() as receiver:
        got = receiver.receive(v3)
        assert all(torch.equal(got[k], want_v3[k]) for k in want_v3)
        # Living in shared memory changes nothing in the arithmetic.
        assert all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(),
                                                     plain.agents["planner"].model.state_dict().values()))
        assert not all(torch.equal(a, want_v3[k]) for k, a in state.model.state_dict().items())
        v4 = msgspec.msgpack.decode(shm._execute(p.PublishWeights(9, "planner", 4, "shm", ["r"])).handle,
                                    type=ParamHandle)
        got = receiver.receive(v4)
        assert all(torch.equal(got[k], v) for k, v in state.model.state_dict().items())
    shm.close(), plain.close()
