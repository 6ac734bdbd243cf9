"""The rollout worker's weight handling, run directly: on a real vLLM engine, and on a
stand-in for the engine where only what the handler does with the channel (or how it
adds requests) matters."""

import asyncio
import random
import types

import pytest
import torch

from flexmarl.controller import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.param_channel import ParamChannel
from flexmarl.workers import models
from flexmarl.workers.engine import Completion
from flexmarl.workers.rollout import RolloutHandler, same_but_seed


def greedy(handler, prompt):
    handler.engine.add("greedy", prompt, 6, 0.0, 0)
    out = []
    while handler.engine.has_unfinished():
        out += handler.engine.step()
    return out[0].token_ids


def transformers_greedy(model_dir, prompt):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             min_new_tokens=6)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_an_idle_instance_switches_agents_in_place_when_architectures_match(tmp_path):
    spec = digit_chain.AGENTS["planner"]
    first = models.build_model(spec, digit_chain.VOCAB, tmp_path / "a")
    other_spec = type(spec)(**{**spec.__dict__, "name": "other", "seed": spec.seed + 100})
    other = models.build_model(other_spec, digit_chain.VOCAB, tmp_path / "b")
    handler = RolloutHandler()
    handler._load_model(p.LoadModel(1, "planner", str(first), 0))
    prompt = digit_chain.planner_prompt(digit_chain.make_query(random.Random(3)))
    from safetensors.torch import load_file
    with ParamChannel() as channel:
        handle = channel.publish(load_file(str(other / "model.safetensors")), agent="other", version=4,
                                 transport="shm")
        handler._load_weights(p.LoadWeights(2, "other", 4, handle))
        assert (handler.agent, handler.version) == ("other", 4)
        assert greedy(handler, prompt) == transformers_greedy(other, prompt)
        # a set that does not fit this engine is refused, and the instance is unchanged:
        # other names (solver: 4 layers), or the same names with other shapes (checker)
        for agent, match in (("solver", None), ("checker", "wrong shape")):
            model_dir = models.build_model(digit_chain.AGENTS[agent], digit_chain.VOCAB, tmp_path / agent)
            bad = channel.publish(load_file(str(model_dir / "model.safetensors")), agent=agent, version=1,
                                  transport="shm")
            with pytest.raises(ValueError, match=match):
                handler._load_weights(p.LoadWeights(3, agent, 1, bad))
            assert (handler.agent, handler.version) == ("other", 4)
            assert greedy(handler, prompt) == transformers_greedy(other, prompt)
    handler.close()


class PublishedLoadRecorder:
    """Stands in for the engine the handler is handed: records the published loads."""

    def __init__(self):
        self.loads = []

    def load_published(self, handle, *, rank=0, config=None):
        self.loads.append((handle, rank, config))

    def has_unfinished(self):
        return False

    def close(self):
        pass


def test_whole_weights_go_to_the_engine_as_a_handle_with_the_rank_and_channel_settings():
    """The rollout process receives no tensors of whole weights: the engine's workers do
    (tests/workers/test_engine_receive.py), each at the rank the controller gave plus its own."""
    from flexmarl.runtime.param_types import ParamChannelConfig

    config = ParamChannelConfig(timeout_s=5.0)
    handler = RolloutHandler(config)
    handler.engine, handler.agent = PublishedLoadRecorder(), "planner"
    handler._load_weights(p.LoadWeights(1, "planner", 1, "nccl handle", rank=3))
    handler._load_weights(p.LoadWeights(2, "planner", 2, "shm handle"))
    assert handler.engine.loads == [("nccl handle", 3, config), ("shm handle", 0, config)]
    assert handler.version == 2 and handler._channel is None  # no channel of its own was needed


class Outbox:
    """Stands in for the session: collects what the handler sends."""

    def __init__(self):
        self.sent = []
        self.arrived = asyncio.Event()

    async def send(self, msg, buffers=()):
        self.sent.append(msg)
        self.arrived.set()


async def generate(handler, outbox, request_id, items):
    await handler.handle(p.Generate(request_id, handler.agent, items), [])
    while not any(isinstance(m, p.Generated) and m.request_id == request_id and m.done for m in outbox.sent):
        outbox.arrived.clear()
        await asyncio.wait_for(outbox.arrived.wait(), 60)
    replies = [m for m in outbox.sent if isinstance(m, p.Generated) and m.request_id == request_id]
    return ({r.sample_id: r for m in replies for r in m.results},
            {r.sample_id: r.reason for m in replies for r in m.refused})


@pytest.mark.slow
async def test_refused_prompts_fail_alone_and_the_engine_keeps_serving(tmp_path):
    spec = digit_chain.AGENTS["planner"]
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler._load_model(p.LoadModel(1, "planner", str(models.build_model(spec, digit_chain.VOCAB, tmp_path / "m")), 0,
                                    max_model_len=64))
    rng = random.Random(5)
    good = [p.GenRequest(f"good-{i}", digit_chain.planner_prompt(digit_chain.make_query(rng)), 6, 1.0, i) for i in range(4)]
    bad = [
        p.GenRequest("empty", [], 6, 1.0, 0),
        p.GenRequest("too-long", [digit_chain.BOS_ID] * 60, 6, 1.0, 0),  # 60 + 6 > max_model_len 64
        p.GenRequest("oov", [digit_chain.BOS_ID, len(digit_chain.VOCAB) + 7], 6, 1.0, 0),
        p.GenRequest("bad-temperature", good[0].prompt_ids, 6, -1.0, 0),  # refused by vLLM itself
    ]
    loop = asyncio.create_task(handler.run())
    try:
        results, refused = await generate(handler, outbox, 2, [good[0], bad[0], good[1], bad[1], good[2],
                                                               bad[2], bad[3], good[3]])
        assert sorted(results) == [f"good-{i}" for i in range(4)]
        assert sorted(refused) == sorted(b.sample_id for b in bad)
        assert "empty" in refused["empty"] and "max_model_len 64" in refused["too-long"]
        assert f"token id {len(digit_chain.VOCAB) + 7}" in refused["oov"]
        assert "vLLM refused" in refused["bad-temperature"]
        # the refusals changed nothing for the others: alone they sample the same tokens
        again, none = await generate(handler, outbox, 3, [
            p.GenRequest(f"again-{i}", r.prompt_ids, r.max_tokens, r.temperature, r.seed) for i, r in enumerate(good)])
        assert not none and not loop.done()
        assert [again[f"again-{i}"].token_ids for i in range(4)] == [results[f"good-{i}"].token_ids for i in range(4)]
        assert handler.engine.num_queued_requests == 0
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        handler.close()


def test_load_model_hands_the_agents_engine_settings_to_the_engine(monkeypatch):
    from flexmarl.workers import engine as engine_module

    built = []

    class RecordingEngine:
        def __init__(self, model_path, **kwargs):
            built.append((model_path, kwargs))

    monkeypatch.setattr(engine_module, "VllmEngine", RecordingEngine)
    settings = p.EngineSettings("bfloat16", 0.5, 2)
    RolloutHandler()._load_model(p.LoadModel(1, "solver", "/models/solver", 0, seed=3, max_model_len=0,
                                             engine=settings))
    assert built == [("/models/solver", {"seed": 3, "max_model_len": 0, "settings": settings})]


def test_requests_differing_only_in_consecutive_seeds_form_one_run():
    a = [p.GenRequest(f"g/{i}", [1, 2], 6, 1.0, 40 + i) for i in range(3)]
    other_prompt = p.GenRequest("h/0", [1, 3], 6, 1.0, 43)
    gap = p.GenRequest("h/1", [1, 3], 6, 1.0, 45)  # seed not consecutive
    hotter = p.GenRequest("h/2", [1, 3], 6, 0.5, 46)  # another temperature
    runs = same_but_seed([*a, other_prompt, gap, hotter])
    assert [[r.sample_id for r in run] for run in runs] == [["g/0", "g/1", "g/2"], ["h/0"], ["h/1"], ["h/2"]]


class GroupingEngine:
    """Stands in for the engine: records how requests are added, finishes them at once."""

    def __init__(self):
        self.added, self._done = [], []

    def add_group(self, ids, prompt_ids, max_tokens, temperature, seed, **_):
        self.added.append((list(ids), seed))
        self._done += [Completion(rid, [7] * max_tokens, [-0.5] * max_tokens, "length") for rid in ids]

    def has_unfinished(self):
        return bool(self._done)

    def step(self):
        done, self._done = self._done, []
        return done


async def test_a_groups_members_go_to_the_engine_together_and_come_back_one_by_one():
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler.engine, handler.agent, handler.version = GroupingEngine(), "solver", 3
    items = [p.GenRequest(f"g/{i}", [1, 2], 4, 1.0, 10 + i) for i in range(4)] + [p.GenRequest("x", [5], 4, 1.0, 2)]
    loop = asyncio.create_task(handler.run())
    try:
        results, refused = await generate(handler, outbox, 9, items)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert handler.engine.added == [(["g/0", "g/1", "g/2", "g/3"], 10), (["x"], 2)]
    assert not refused and sorted(results) == ["g/0", "g/1", "g/2", "g/3", "x"]
    assert all(r.version == 3 and r.token_ids == [7] * 4 for r in results.values())


async def test_a_cancelled_load_fails_at_once_whether_queued_or_receiving():
    """Another rank of an NCCL broadcast died: the LoadWeights the controller names fails,
    dropped from the queue if it had not started, its receive given up if it had."""
    handler, outbox = RolloutHandler(), Outbox()
    handler.session = outbox
    cancels, engine_cancels = [], []
    handler._channel = types.SimpleNamespace(cancel=lambda agent, version: cancels.append((agent, version)),
                                             close=lambda: None)
    # Whole weights are received in the engine's own workers; an adapter in this process.
    handler.engine = types.SimpleNamespace(cancel_receive=engine_cancels.append, close=lambda: None, adapters=None)
    queued = p.LoadWeights(1, "planner", 2, "any handle", rank=1)
    handler._control.append(queued)
    await handler.handle(p.CancelLoad(2, "planner", 2), [])
    assert handler._control == [] and cancels == []
    error, done = outbox.sent
    assert isinstance(error, p.Error) and error.request_id == 1 and "cancelled" in error.message
    assert isinstance(done, p.LoadCancelled) and done.request_id == 2
    handler._applying = p.LoadWeights(3, "planner", 3, types.SimpleNamespace(key="planner-v3-1"), rank=1)  # receiving
    await handler.handle(p.CancelLoad(4, "planner", 3), [])
    assert engine_cancels == ["planner-v3-1"] and cancels == []  # this publication's receive, no later one
    handler._applying = p.LoadWeights(5, "coach", 4, "any handle", rank=1, lora=p.LoraSettings())
    await handler.handle(p.CancelLoad(6, "coach", 4), [])
    assert cancels == [("coach", 4)] and engine_cancels == ["planner-v3-1"]


def test_an_engine_is_not_started_on_checkpoint_files_that_fail_their_manifest(tmp_path):
    from flexmarl.runtime.checksums import DamagedFile, sha256_file

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 100)
    digests = {name: sha256_file(tmp_path / name) for name in ("config.json", "model.safetensors")}
    (tmp_path / "model.safetensors").write_bytes(b"weightz" * 100)  # changed after the manifest was written
    handler = RolloutHandler()
    with pytest.raises(DamagedFile, match="model.safetensors does not match its checksum"):
        handler._load_model(p.LoadModel(1, "planner", str(tmp_path), 4, checksums=digests))
    assert handler.engine is None and handler.version == -1  # vLLM never read a byte of it
