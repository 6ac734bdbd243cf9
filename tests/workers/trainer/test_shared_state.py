"""A trainer's agents parked without a second copy (workers/trainer/shared_state.py), run through the
trainer's own commands (no processes): on the CPU the training state lives in one shared-
memory bucket, parking publishes it in place and a swap-in on the same trainer takes it
back; the arithmetic is that of a trainer that never parks; a parked agent's checkpoint is
written from the kept state."""

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_batches import TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.params.types import ParamChannelConfig
from flexmarl.workers import models
from flexmarl.workers.trainer.worker import TrainerHandler, training_state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB, tmp_path_factory.mktemp("planner"))


class PrivateStateTrainer(TrainerHandler):
    """A trainer whose live state is in private memory, as on a GPU or before this module:
    the reference the shared state must equal, and the path a GPU's park takes."""

    def _shares_state(self, placement):
        return False


def batch(version, seed, n=8):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        query = digit_chain.make_query(rng)
        out.append(TrainSample(f"s{seed}-{i}", digit_chain.planner_prompt(query), digit_chain.make_query(rng),
                                 rng.uniform(-1, 1), [-1.0, -1.0, -1.0], [version - 1]))
    return out


def trained(h, model_dir, steps=2, pending=True):
    """`steps` steps, then (pending) half a batch more: gradients and step sums in progress."""
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0))
    for v in range(1, steps + 1):
        h._execute(micro_batch(2, "planner", v, batch(v, v)))
        h._execute(p.OptimStep(3, "planner", v, samples=8))
    if pending:
        h._execute(micro_batch(4, "planner", steps + 1, batch(steps + 1, 99, 4)))
    return h


def state_of(h, agent="planner"):
    state = h.agents[agent]
    return {k: v.clone() for k, v in training_state(state.model, state.optimizer, state.sums).items()}


def assert_same_state(a, b):
    a, b = state_of(a), state_of(b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def shm_bytes(directory: Path) -> int:
    """Bytes of every shared-memory segment in the channel's directory (live, parked or spare)."""
    return sum(f.stat().st_size for f in directory.iterdir())


def test_parking_an_agent_whose_state_is_in_shared_memory_allocates_no_second_copy(model_dir, tmp_path):
    h = trained(TrainerHandler(ParamChannelConfig(shm_dir=str(tmp_path))), model_dir, pending=False)
    h._execute(p.PublishWeights(4, "planner", 2, "shm", ["r"]))  # synced, as an agent is before it is parked
    h._execute(micro_batch(5, "planner", 3, batch(3, 99, 4)))  # and half a batch in progress
    live = h.agents["planner"]
    state_bytes = sum(t.numel() * t.element_size() for t in state_of(h).values())
    pointers = [q.data_ptr() for q in live.model.parameters()]
    before = shm_bytes(tmp_path)
    parked = h._execute(p.OffloadAgent(6, "planner"))
    grown = shm_bytes(tmp_path) - before
    assert grown < 4096, f"parking a state of {state_bytes} bytes took {grown} more bytes of shared memory"
    assert "planner" not in h.agents and parked.nbytes >= state_bytes
    assert before >= state_bytes  # the live state was in shared memory already
    assert [q.data_ptr() for q in live.model.parameters()] == pointers  # the very same memory
    ready = h._execute(p.LoadAgent(7, "planner", str(model_dir), 1e-3, 1.0, parked.version, parked.accumulated,
                                   parked.handle))
    assert ready.version == parked.version and shm_bytes(tmp_path) - before < 4096  # taken back, not rebuilt
    assert h.agents["planner"] is live and [q.data_ptr() for q in live.model.parameters()] == pointers
    h.close()


def test_a_parked_agent_taken_back_trains_on_exactly_like_one_that_was_never_parked(model_dir):
    parked, stayed = trained(TrainerHandler(), model_dir), trained(TrainerHandler(), model_dir)
    out = parked._execute(p.OffloadAgent(5, "planner"))
    parked._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    for h in (parked, stayed):
        h._execute(micro_batch(7, "planner", 3, batch(3, 100, 4)))
        h._execute(p.OptimStep(8, "planner", 3, samples=8))
        h._execute(micro_batch(9, "planner", 4, batch(4, 101)))
        h._execute(p.OptimStep(10, "planner", 4, samples=8))
    assert_same_state(parked, stayed)
    parked.close(), stayed.close()


def test_a_shared_state_computes_bit_for_bit_what_a_private_one_does_with_adams_own_lazy_state(model_dir):
    shared, private = trained(TrainerHandler(), model_dir, 3), trained(PrivateStateTrainer(), model_dir, 3)
    assert shared.agents["planner"].shared is not None and private.agents["planner"].shared is None
    grads = [q.grad.data_ptr() for q in shared.agents["planner"].model.parameters()]
    for h in (shared, private):
        h._execute(p.OptimStep(5, "planner", 4, samples=4))
    a, b = state_of(shared), state_of(private)
    weights_and_moments = [k for k in b if not k.startswith("grad/")]
    assert weights_and_moments and all(torch.equal(a[k], b[k]) for k in weights_and_moments)
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in b)  # Adam made its state there
    # Between steps the shared gradients are zero where they live; the private ones are freed.
    assert [q.grad.data_ptr() for q in shared.agents["planner"].model.parameters()] == grads
    assert not any(q.grad.any() for q in shared.agents["planner"].model.parameters())
    shared.close(), private.close()


def test_a_state_in_private_memory_is_parked_into_shared_memory_and_taken_back_byte_exact(model_dir):
    # A GPU trainer's path: the live state is copied into a bucket tensor by tensor at the park.
    h = trained(PrivateStateTrainer(), model_dir)
    before = state_of(h)
    out = h._execute(p.OffloadAgent(5, "planner"))
    kept = next(iter(h.kept.values()))
    assert all(q.data_ptr() in range(kept.shared.bucket.segment.data.data_ptr(),
                                     kept.shared.bucket.segment.data.data_ptr() + out.nbytes)
               for q in kept.model.parameters())  # the model now points into the bucket
    other = TrainerHandler()  # and another trainer can load the copy
    other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    h._execute(p.LoadAgent(7, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    for got in (state_of(h), state_of(other)):
        assert got.keys() == before.keys() and all(torch.equal(got[k], before[k]) for k in before)
    h.close(), other.close()


def test_a_parked_agents_checkpoint_is_written_from_the_state_its_trainer_keeps(model_dir, tmp_path):
    h = trained(TrainerHandler(), model_dir, pending=False)
    h._execute(p.SaveCheckpoint(5, "planner", str(tmp_path / "resident"), full_state=True))
    h._execute(p.OffloadAgent(6, "planner"))
    saved = h._execute(p.SaveCheckpoint(7, "planner", str(tmp_path / "parked"), full_state=True))
    assert saved.version == 2 and "planner" not in h.agents  # written without a swap-in
    for name in ("model.safetensors", p.TRAINING_STATE_FILE):
        assert (tmp_path / "parked" / name).read_bytes() != b""
    a, b = load_file(str(tmp_path / "resident" / "model.safetensors")), load_file(str(tmp_path / "parked" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from flexmarl.controller.train.checkpoints import read_state
    from flexmarl.runtime.params.channel import ParamChannel

    private = trained(PrivateStateTrainer(), model_dir, pending=False)
    private._execute(p.SaveCheckpoint(8, "planner", str(tmp_path / "private"), full_state=True))
    with ParamChannel() as channel:
        files = {name: channel.receive(read_state(tmp_path / name / p.TRAINING_STATE_FILE))
                 for name in ("resident", "parked", "private")}
        for name, got in files.items():  # the same state, whichever way it was written
            assert got.keys() == files["private"].keys(), name
            assert all(torch.equal(got[k], files["private"][k]) for k in got), name
        assert not any(k.startswith("grad/") for k in files["parked"])  # between steps there are none to keep
    # Written from the shared state as it lies: no host buffer of the state's size was made for it.
    assert h.channel().held_receive_buffers() == 0 and private.channel().held_receive_buffers() > 0
    h.close(), private.close()


def test_a_checkpoints_training_state_is_read_straight_into_a_new_shared_state_and_trains_on(model_dir, tmp_path):
    from flexmarl.controller.train.checkpoints import read_state

    h = trained(TrainerHandler(), model_dir, pending=False)
    h._execute(p.SaveCheckpoint(5, "planner", str(tmp_path / "ck"), full_state=True))
    saved = read_state(tmp_path / "ck" / p.TRAINING_STATE_FILE)
    resumed = TrainerHandler()
    resumed._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, saved.version, 0, saved))
    assert resumed.agents["planner"].shared is not None and resumed.channel().held_receive_buffers() == 0
    for t in (h, resumed):
        t._execute(micro_batch(7, "planner", 3, batch(3, 7)))
        t._execute(p.OptimStep(8, "planner", 3, samples=8))
    assert_same_state(h, resumed)
    h.close(), resumed.close()


def test_a_backward_pass_adds_into_the_gradients_where_they_live(model_dir):
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0))
    model = h.agents["planner"].model
    where = [q.grad.data_ptr() for q in model.parameters()]
    h._execute(micro_batch(2, "planner", 1, batch(1, 1)))
    assert [q.grad.data_ptr() for q in model.parameters()] == where
    assert any(q.grad.any() for q in model.parameters())
    h.close()
