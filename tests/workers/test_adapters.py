"""Adapter agents on a trainer, run directly (no processes): the base is loaded once and
frozen, each agent's micro-batches train its own adapter only, a publish, a park and a
checkpoint move the adapter (and its optimizer state) and nothing of the base, and a
checkpoint is a PEFT adapter that peft loads as it is."""

import json
import random

import pytest
import torch

from train_batches import TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.workers import models
from flexmarl.workers.trainer.worker import TrainerHandler, training_state

LORA = p.LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB, tmp_path_factory.mktemp("base"))


def sample(i, rng, version):
    query = digit_chain.make_query(rng)
    return TrainSample(f"s{i}", digit_chain.planner_prompt(query), digit_chain.make_query(rng),
                         rng.uniform(-1, 1), [-1.0, -1.0, -1.0], [version])


def batch(seed, version, n=4):
    rng = random.Random(seed)
    return [sample(i, rng, version) for i in range(n)]


def init(h, agent, base_dir, seed=0):
    return h._execute(p.InitAgent(1, agent, str(base_dir), 1e-2, seed, lora=LORA))


def step(h, agent, version, seed):
    h._execute(micro_batch(2, agent, version, batch(seed, version - 1)))
    h._execute(p.OptimStep(3, agent, version, samples=4))


def adapter(h, agent):
    return {k: v.detach().clone() for k, v in h.agents[agent].model.named_parameters()}


def adapter_bytes(config, lora, itemsize=4):
    """What rank-r adapters of q, k, v and o of every layer hold: r * (in + out) per module."""
    head = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    per_layer = sum(lora.rank * (i + o) for i, o in ((config.hidden_size, q), (config.hidden_size, kv),
                                                      (config.hidden_size, kv), (q, config.hidden_size)))
    return per_layer * config.num_hidden_layers * itemsize


def test_agents_of_one_base_share_one_frozen_copy_of_it(base_dir):
    h = TrainerHandler()
    a, b = init(h, "writer", base_dir), init(h, "critic", base_dir, seed=1)
    assert list(h.bases) == [str(base_dir)]
    base = h.bases[str(base_dir)]
    assert base.agents == ["writer", "critic"] and h.agents["writer"].adapter and h.agents["critic"].adapter
    assert not any(x.requires_grad for name, x in base._base.named_parameters() if "lora_" not in name)
    config = base._base.config
    expected = adapter_bytes(config, LORA) // 4
    assert a.num_params == b.num_params == expected < base.base_params / 10
    # the optimizer of each agent holds its adapter, not the base
    assert sum(x.numel() for g in h.agents["writer"].optimizer.param_groups for x in g["params"]) == expected
    h.close()


def test_interleaved_micro_batches_of_two_agents_train_each_exactly_as_alone(base_dir):
    both, alone = TrainerHandler(), TrainerHandler()
    init(both, "writer", base_dir), init(both, "critic", base_dir, seed=1), init(alone, "writer", base_dir)
    base_before = {k: v.clone() for k, v in both.bases[str(base_dir)]._base.state_dict().items()
                   if "lora_" not in k}
    for version in (1, 2):
        both._execute(micro_batch(2, "writer", version, batch(version, version - 1)))
        both._execute(micro_batch(2, "critic", version, batch(100 + version, version - 1)))
        both._execute(micro_batch(2, "writer", version, batch(200 + version, version - 1)))
        both._execute(p.OptimStep(3, "critic", version, samples=4))
        both._execute(p.OptimStep(3, "writer", version, samples=8))
        alone._execute(micro_batch(2, "writer", version, batch(version, version - 1)))
        alone._execute(micro_batch(2, "writer", version, batch(200 + version, version - 1)))
        alone._execute(p.OptimStep(3, "writer", version, samples=8))
    got, want = adapter(both, "writer"), adapter(alone, "writer")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert not torch.equal(got[next(k for k in got if "lora_B" in k)], torch.zeros_like(want[next(
        k for k in got if "lora_B" in k)]))  # it did train (PEFT starts B at zero)
    base_after = {k: v for k, v in both.bases[str(base_dir)]._base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    both.close(), alone.close()


def test_a_sync_moves_exactly_the_adapters_bytes(base_dir):
    from flexmarl.runtime.params.channel import ParamChannel

    h = TrainerHandler()
    init(h, "writer", base_dir), init(h, "critic", base_dir, seed=1)
    step(h, "writer", 1, 0)
    out = h._execute(p.PublishWeights(4, "writer", 1, "shm", ["r"]))
    config = h.bases[str(base_dir)]._base.config
    assert out.nbytes == out.handle.total_bytes == adapter_bytes(config, LORA)
    receiver = ParamChannel()
    try:
        got = receiver.receive(out.handle)
        want = adapter(h, "writer")
        assert got.keys() == want.keys()  # PEFT's file names
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in got)
    finally:
        receiver.release(out.handle)
        receiver.close()
    h.close()


def test_parking_and_restoring_an_adapter_with_its_optimizer_state_is_byte_exact(base_dir):
    h = TrainerHandler()
    init(h, "writer", base_dir), init(h, "critic", base_dir, seed=1)
    step(h, "writer", 1, 0)
    h._execute(micro_batch(4, "writer", 2, batch(7, 1)))  # pending gradients travel too
    state = h.agents["writer"]
    before = {k: v.clone() for k, v in training_state(state.model, state.optimizer, state.sums).items()}
    assert any(k.startswith("grad/") for k in before) and any(k.startswith("optim/") for k in before)
    out = h._execute(p.OffloadAgent(5, "writer"))
    # kept on its base until its parked copy is released (a swap-in here takes it back)
    assert "writer" not in h.agents and sorted(h.bases[str(base_dir)].agents) == ["critic", "writer"]
    # the parked copy is the adapter's state and nothing else: no tensor of the base
    assert {spec.name for spec in out.handle.layout} == before.keys()
    assert sum(spec.nbytes for spec in out.handle.layout) == sum(v.numel() * v.element_size()
                                                                 for v in before.values())
    other = TrainerHandler()
    init(other, "critic", base_dir, seed=1)  # the other trainer already holds the base for another agent
    other._execute(p.LoadAgent(6, "writer", str(base_dir), 1e-2, 1.0, out.version, out.accumulated, out.handle,
                               lora=LORA))
    moved = other.agents["writer"]
    assert moved.adapter and other.agents["critic"].adapter
    after = training_state(moved.model, moved.optimizer, moved.sums)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    h._execute(p.ReleaseState(7, "writer", out.handle))
    assert h.bases[str(base_dir)].agents == ["critic"]  # loaded elsewhere: it leaves this base
    other._execute(p.OptimStep(8, "writer", 2, samples=4))
    h.close(), other.close()


def test_the_last_adapter_agent_to_leave_takes_the_base_with_it(base_dir):
    h = TrainerHandler()
    init(h, "writer", base_dir)
    out = h._execute(p.OffloadAgent(5, "writer"))
    assert list(h.bases) == [str(base_dir)]  # its parked copy is kept here, on its base
    h._execute(p.ReleaseState(7, "writer", out.handle))
    assert h.bases == {}
    h.close()


def test_an_adapter_checkpoint_is_a_peft_adapter_that_peft_loads_as_it_is(base_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    h = TrainerHandler()
    init(h, "writer", base_dir), init(h, "critic", base_dir, seed=1)
    step(h, "writer", 1, 0)
    saved = h._execute(p.SaveCheckpoint(9, "writer", str(tmp_path / "writer"), full_state=True))
    files = {f.name for f in (tmp_path / "writer").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", p.TRAINING_STATE_FILE} <= files
    assert not any(f.startswith("model") for f in files)  # no copy of the base
    config = json.loads((tmp_path / "writer" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "writer")
    ids = torch.tensor([digit_chain.planner_prompt(digit_chain.make_query(random.Random(3)))])
    with torch.no_grad():
        want = h.agents["writer"].model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    assert saved.version == 1
    h.close()


def test_an_adapter_checkpoint_names_its_base_so_peft_loads_it_from_any_directory(base_dir, tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(base_dir.parent)  # the run names its base relative to where it runs
    h = TrainerHandler()
    init(h, "writer", base_dir.name)
    step(h, "writer", 1, 0)
    h._execute(p.SaveCheckpoint(9, "writer", str(tmp_path / "writer"), full_state=True))
    config = json.loads((tmp_path / "writer" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "writer")
    ids = torch.tensor([digit_chain.planner_prompt(digit_chain.make_query(random.Random(3)))])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, h.agents["writer"].model(input_ids=ids).logits)
    h.close()
