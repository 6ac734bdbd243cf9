"""A trainer group of two ranks (FSDP2 over gloo, on the CPU) against one trainer process on
the same samples: the same update within round-off, its state parked and restored shard by
shard, and states of the wrong shape refused. Rank 0 runs in the test process; rank 1 is
the process it starts."""

import random

import pytest
import torch
from safetensors.torch import load_file

from train_batches import TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.params.channel import ParamChannel
from flexmarl.workers import models
from flexmarl.workers.trainer.group import TrainerGroupHandler
from flexmarl.workers.trainer.worker import TrainerHandler

LR = 1e-2
ROUND_OFF = 1e-6  # of losses: float32 sums in another order
# Of weights after Adam steps: Adam divides each gradient element by its own running
# magnitude, so the round-off of a tiny element shows in its update at the scale of the
# learning rate. A real difference (a sample lost or counted twice) moves weights by ~LR.
WEIGHT_ROUND_OFF = 1e-2 * LR


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB,
                              tmp_path_factory.mktemp("planner"))


@pytest.fixture(scope="module")
def group():
    torch.set_num_threads(1)
    handler = TrainerGroupHandler.start(world=2)
    yield handler
    handler.close()
    assert all(child.poll() is not None for child in handler.children) and not handler.children


@pytest.fixture()
def single():
    handler = TrainerHandler()
    yield handler
    handler.close()


def batch(seed, n, version):
    rng = random.Random(seed)
    return [TrainSample(f"s{seed}-{i}", digit_chain.planner_prompt(digit_chain.make_query(rng)),
                          digit_chain.make_query(rng), rng.uniform(-1, 1), [], [version - 1]) for i in range(n)]


def train_step(h, agent, version, sizes=(5, 2, 1)):
    """One global batch in micro-batches of `sizes` (1: rank 1 has no sample of its own)."""
    replies = [h._execute(micro_batch(2, agent, version, batch(100 * version + i, n, version)))
               for i, n in enumerate(sizes)]
    return replies, h._execute(p.OptimStep(3, agent, version, samples=sum(sizes)))


def weights(h, agent, version):
    out = h._execute(p.PublishWeights(4, agent, version, "shm"))
    with ParamChannel() as channel:
        return {k: v.clone() for k, v in channel.receive(out.handle).items()}


@pytest.mark.slow
def test_a_two_rank_group_makes_the_same_update_as_one_trainer_on_the_same_samples(group, single, model_dir):
    for h in (group, single):
        h._execute(p.InitAgent(1, "same", str(model_dir), LR, 0))
    for version in (1, 2):
        got, want = train_step(group, "same", version), train_step(single, "same", version)
        for g, w in zip(got[0], want[0]):
            assert g.tokens == w.tokens and g.loss == pytest.approx(w.loss, abs=ROUND_OFF)
        assert got[1].stats.samples == want[1].stats.samples == 8
        assert got[1].grad_norm == pytest.approx(want[1].grad_norm, rel=1e-5)
    grouped, alone = weights(group, "same", 2), weights(single, "same", 2)
    assert grouped.keys() == alone.keys()
    assert max((grouped[k] - alone[k]).abs().max().item() for k in alone) < WEIGHT_ROUND_OFF
    initial = load_file(next(model_dir.glob("*.safetensors")))
    assert all(not torch.equal(alone[k], initial[k]) for k in alone)  # and it did train


@pytest.mark.slow
def test_a_group_parks_each_ranks_shard_and_trains_on_identically_after_restoring_it(group, single, model_dir):
    for h in (group, single):
        h._execute(p.InitAgent(1, "swapped", str(model_dir), LR, 0))
        train_step(h, "swapped", 1)
        h._execute(micro_batch(2, "swapped", 2, batch(7, 3, 2)))  # gradients pending across the swap
    parked = group._execute(p.OffloadAgent(5, "swapped"))
    assert "swapped" not in group.agents and len(parked.shards) == 1 and parked.accumulated == 3
    group._execute(p.LoadAgent(6, "swapped", str(model_dir), LR, 1.0, parked.version, parked.accumulated,
                               parked.handle, p.TrainerSettings(), parked.shards))
    assert group.parked == {}  # loaded by the group that parked it: its copy went with the load
    for h in (group, single):
        h._execute(micro_batch(8, "swapped", 2, batch(8, 5, 2)))
        h._execute(p.OptimStep(9, "swapped", 2, samples=8))  # Adam's moments came back too
    grouped, alone = weights(group, "swapped", 2), weights(single, "swapped", 2)
    assert max((grouped[k] - alone[k]).abs().max().item() for k in alone) < WEIGHT_ROUND_OFF


@pytest.mark.slow
def test_states_parked_by_another_number_of_ranks_are_refused_and_the_group_keeps_working(group, single, model_dir):
    single._execute(p.InitAgent(1, "whole", str(model_dir), LR, 0))
    whole = single._execute(p.OffloadAgent(2, "whole"))
    with pytest.raises(ValueError, match="has 1 shards and this trainer has 2 ranks"):
        group._execute(p.LoadAgent(3, "whole", str(model_dir), LR, 1.0, whole.version, 0, whole.handle))
    group._execute(p.InitAgent(4, "sharded", str(model_dir), LR, 0))
    sharded = group._execute(p.OffloadAgent(5, "sharded"))
    with pytest.raises(ValueError, match="has 2 shards and this trainer has 1 ranks"):
        single._execute(p.LoadAgent(6, "sharded", str(model_dir), LR, 1.0, 0, 0, sharded.handle,
                                    p.TrainerSettings(), sharded.shards))
    group._execute(p.InitAgent(7, "after", str(model_dir), LR, 0))  # the ranks are still in step
    train_step(group, "after", 1, sizes=(2,))
    single._execute(p.ReleaseState(8, "whole", whole.handle))
    group._execute(p.ReleaseState(9, "sharded", sharded.handle, sharded.shards))


@pytest.mark.slow
def test_a_groups_checkpoint_is_the_full_model_rank_0_gathered(group, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    group._execute(p.InitAgent(1, "saved", str(model_dir), LR, 0))
    train_step(group, "saved", 1, sizes=(3,))
    out = group._execute(p.SaveCheckpoint(2, "saved", str(tmp_path / "ckpt")))
    assert out.version == 1
    saved = dict(AutoModelForCausalLM.from_pretrained(out.path, dtype=torch.float32).named_parameters())
    published = weights(group, "saved", 1)
    assert saved.keys() == published.keys()
    assert all(torch.equal(saved[k], published[k]) for k in published)


def test_a_groups_publish_names_the_agents_nccl_communicator(monkeypatch):
    """The publish is the trainer's own command; the group supplies only the gather of the
    full weights (stubbed here: it needs the other ranks), so the communicator the
    controller names reaches the channel, as from a single trainer."""
    import types

    from flexmarl.workers.trainer.worker import AgentState

    handler = TrainerGroupHandler(rank=0, world=2, device="cpu")
    model = torch.nn.Linear(2, 2)
    handler.agents["a"] = AgentState("a", model, None, "/models/a", 3, 1.0)
    monkeypatch.setattr(handler, "_full_weights",
                        lambda state, dtype: {k: v.detach().to(dtype) for k, v in state.model.named_parameters()})
    published = []

    class Channel:
        def publish(self, tensors, **options):
            published.append((sorted(tensors), options))
            return types.SimpleNamespace(total_bytes=8)

        def release(self, handle):
            pass

    handler._channel = Channel()
    reply = handler.COMMANDS[p.PublishWeights](handler, p.PublishWeights(1, "a", 3, "nccl", ["r0", "r1"], "a-g1"))
    assert reply.version == 3
    assert published == [(["bias", "weight"], {"agent": "a", "version": 3, "transport": "nccl", "receivers": 2,
                                               "group": "a-g1"})]
    # Engines of two ranks each: every worker of an engine receives, so four receivers.
    handler.COMMANDS[p.PublishWeights](handler, p.PublishWeights(2, "a", 3, "nccl", ["r0", "r1"], "a-g2", 2))
    assert published[-1][1]["receivers"] == 4


def test_a_mixed_precision_groups_weights_are_gathered_and_published_in_the_compute_dtype(monkeypatch):
    """FSDP does a group's mixed precision, so its placement computes in float32 as far as
    the trainer knows; what it serves is still bfloat16, and each tensor is cast as it is
    gathered, so rank 0 never holds the whole float32 set beside the bucket."""
    import types

    from flexmarl.workers.precision import TrainPlacement
    from flexmarl.workers.trainer.worker import AgentState

    handler = TrainerGroupHandler(rank=0, world=2, device="cpu")
    placement = TrainPlacement(torch.device("cpu"), torch.float32, torch.float32, serve_dtype=torch.bfloat16)
    handler.agents["a"] = AgentState("a", torch.nn.Linear(2, 2), None, "/models/a", 3, 1.0, placement=placement)
    asked = []

    def gather(state, dtype):
        asked.append(dtype)
        return {k: v.detach().to(dtype) for k, v in state.model.named_parameters()}

    monkeypatch.setattr(handler, "_full_weights", gather)
    published = []

    class Channel:
        def publish(self, tensors, **options):
            published.append({k: v.dtype for k, v in tensors.items()})
            return types.SimpleNamespace(total_bytes=12)

    handler._channel = Channel()
    handler.COMMANDS[p.PublishWeights](handler, p.PublishWeights(1, "a", 3, "shm", ["r0"]))
    assert asked == [torch.bfloat16] and published == [{"weight": torch.bfloat16, "bias": torch.bfloat16}]


def test_rank_0_gathers_one_weight_at_a_time_as_it_publishes_and_serves_the_same_bytes(group, model_dir,
                                                                                      monkeypatch):
    """Each full weight is gathered when rank 0's publish packs it and let go once copied:
    rank 0 holds the bucket and one gathered weight, never the whole set beside it."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor

    group._execute(p.InitAgent(1, "streamed", str(model_dir), LR, 0))
    train_step(group, "streamed", 1, sizes=(3,))
    whole = weights(group, "streamed", 1)
    counts = {"gathered": 0, "live": 0, "most_live": 0}
    full_tensor = DTensor.full_tensor

    def gone():
        counts["live"] -= 1

    def counted(self, *args, **kwargs):
        tensor = full_tensor(self, *args, **kwargs)
        counts["gathered"] += 1
        counts["live"] += 1
        counts["most_live"] = max(counts["most_live"], counts["live"])
        weakref.finalize(tensor, gone)
        return tensor

    monkeypatch.setattr(DTensor, "full_tensor", counted)
    again = weights(group, "streamed", 1)
    gc.collect()
    assert counts["gathered"] == len(whole) and counts["most_live"] == 1 and counts["live"] == 0
    assert again.keys() == whole.keys() and all(torch.equal(again[k], whole[k]) for k in whole)


def test_a_publish_that_fails_on_rank_0_still_makes_every_gather_and_the_group_stays_in_step(group, model_dir):
    """The gathers are collectives: rank 0's publish stopping before it packed anything
    (here: a disk publish with no path) must not leave rank 1 waiting in one."""
    group._execute(p.InitAgent(1, "unpublished", str(model_dir), LR, 0))
    with pytest.raises(ValueError, match="needs path="):
        group._execute(p.PublishWeights(2, "unpublished", 0, "disk"))
    assert weights(group, "unpublished", 0).keys()  # a collective after it: both ranks are in step


def test_a_mixed_precision_group_gathers_and_publishes_the_served_dtype(group, model_dir):
    """bfloat16 shards are gathered (the bytes the engine serves, half of float32's), and
    they equal the float32 weights cast."""
    settings = p.TrainerSettings(dtype="bfloat16", precision="mixed")
    group._execute(p.InitAgent(1, "mixed", str(model_dir), LR, 0, settings=settings))
    served = weights(group, "mixed", 0)
    group._execute(p.InitAgent(2, "full", str(model_dir), LR, 0))
    full = weights(group, "full", 0)
    assert {t.dtype for t in served.values()} == {torch.bfloat16} and served.keys() == full.keys()
    assert all(torch.equal(served[k], full[k].to(torch.bfloat16)) for k in full)
