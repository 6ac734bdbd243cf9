"""The rollout worker's weight handling, run directly: on a real vLLM engine, and on a
stand-in for the engine where only what the handler does with the channel (or how it
adds requests) matters."""

import asyncio
import random
import types

import pytest
import torch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import GroupKey
from flexmarl.runtime.params.channel import ParamChannel
from flexmarl.workers import models
from flexmarl.workers.rollout.engine import Completion
from flexmarl.workers.rollout.worker import RolloutHandler



def K(call):
    """A group's key, named by its call."""
    return GroupKey("e", "agent", call)

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

    def load_published(self, handle, *, rank=0, config=None, in_flight="finish", version=None):
        self.loads.append((handle, rank, config, in_flight, version))

    def has_unfinished(self):
        return False

    def close(self):
        pass


def test_whole_weights_go_to_the_engine_as_a_handle_with_the_rank_and_channel_settings():
    """The rollout process receives no tensors of whole weights: the engine's workers do
    (tests/workers/rollout/test_engine_receive.py), each at the rank the controller gave plus its own."""
    from flexmarl.runtime.params.types import ParamChannelConfig

    config = ParamChannelConfig(timeout_s=5.0)
    handler = RolloutHandler(config)
    handler.engine, handler.agent = PublishedLoadRecorder(), "planner"
    handler._load_weights(p.LoadWeights(1, "planner", 1, "nccl handle", rank=3))
    handler._load_weights(p.LoadWeights(2, "planner", 2, "shm handle", in_flight="keep"))
    assert handler.engine.loads == [("nccl handle", 3, config, "finish", 1), ("shm handle", 0, config, "keep", 2)]
    assert handler.version == 2 and handler._channel is None  # no channel of its own was needed


class Outbox:
    """Stands in for the session: collects what the handler sends."""

    def __init__(self):
        self.sent = []
        self.arrived = asyncio.Event()

    async def send(self, msg, buffers=()):
        self.sent.append(msg)
        self.arrived.set()


async def generate(handler, outbox, request_id, groups):
    """Every group's result (key -> GroupResult) and refusal (key -> reason)."""
    await handler.handle(p.Generate(request_id, groups), [])
    while not any(isinstance(m, p.Generated) and m.request_id == request_id and m.done for m in outbox.sent):
        outbox.arrived.clear()
        await asyncio.wait_for(outbox.arrived.wait(), 60)
    replies = [m for m in outbox.sent if isinstance(m, p.Generated) and m.request_id == request_id]
    return ({r.key.call: r for m in replies for r in m.results}, {r.key.call: r.reason for m in replies for r in m.refused})


def tokens(result):
    """A group result's token ids, one list per member."""
    ids, out, start = p.unpacked(p.TOKEN_TYPECODE, result.token_ids).tolist(), [], 0
    for n in result.lengths:
        out.append(ids[start:start + n])
        start += n
    return out


def planner_handler(tmp_path):
    """A rollout handler serving a fresh planner model (64 tokens of context), its replies
    kept in an Outbox."""
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    model = models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB, tmp_path / "m")
    handler._load_model(p.LoadModel(1, "planner", str(model), 0, max_model_len=64))
    return handler, outbox


@pytest.mark.slow
async def test_refused_prompts_fail_alone_and_the_engine_keeps_serving(tmp_path):
    handler, outbox = planner_handler(tmp_path)
    rng = random.Random(5)
    good = [p.GenGroup(K(f"good-{i}"), "planner", 2, digit_chain.planner_prompt(digit_chain.make_query(rng)), 6, 1.0, i)
            for i in range(4)]
    bad = [
        p.GenGroup(K("empty"), "planner", 2, [], 6, 1.0, 0),
        p.GenGroup(K("too-long"), "planner", 2, [digit_chain.BOS_ID] * 60, 6, 1.0, 0),  # 60 + 6 > max_model_len 64
        p.GenGroup(K("oov"), "planner", 2, [digit_chain.BOS_ID, len(digit_chain.VOCAB) + 7], 6, 1.0, 0),
        p.GenGroup(K("bad-temperature"), "planner", 2, good[0].prompt_ids, 6, -1.0, 0),  # refused by vLLM itself
    ]
    loop = asyncio.create_task(handler.run())
    try:
        results, refused = await generate(handler, outbox, 2, [good[0], bad[0], good[1], bad[1], good[2],
                                                               bad[2], bad[3], good[3]])
        assert sorted(results) == [f"good-{i}" for i in range(4)]
        assert sorted(refused) == sorted(b.key.call for b in bad)
        assert "empty" in refused["empty"] and "max_model_len 64" in refused["too-long"]
        assert f"token id {len(digit_chain.VOCAB) + 7}" in refused["oov"]
        assert "vLLM refused" in refused["bad-temperature"]
        # the refusals changed nothing for the others: alone they sample the same tokens
        again, none = await generate(handler, outbox, 3, [
            p.GenGroup(K(f"again-{i}"), "planner", 2, r.prompt_ids, r.max_tokens, r.temperature, r.seed)
            for i, r in enumerate(good)])
        assert not none and not loop.done()
        assert [tokens(again[f"again-{i}"]) for i in range(4)] == [tokens(results[f"good-{i}"]) for i in range(4)]
        assert handler.engine.num_queued_requests == 0
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        handler.close()


def test_load_model_hands_the_agents_engine_settings_to_the_engine(monkeypatch):
    from flexmarl.workers.rollout import engine as engine_module

    built = []

    class RecordingEngine:
        def __init__(self, model_path, **kwargs):
            built.append((model_path, kwargs))

        def label_weights(self, version):
            built.append(version)

    monkeypatch.setattr(engine_module, "VllmEngine", RecordingEngine)
    settings = p.EngineSettings("bfloat16", 0.5, 2)
    RolloutHandler()._load_model(p.LoadModel(1, "solver", "/models/solver", 0, seed=3, max_model_len=0,
                                             engine=settings))
    assert built == [("/models/solver", {"seed": 3, "max_model_len": 0, "settings": settings}), 0]


class GroupingEngine:
    """Stands in for the engine: records how requests are added, finishes them at once."""

    def __init__(self):
        self.added, self._done = [], []

    def add(self, request_id, prompt_ids, max_tokens, temperature, seed, n=1, **_):
        self.added.append((request_id, n, seed))
        self._done.append(Completion(request_id, [7] * (n * max_tokens), [-0.5] * (n * max_tokens), [max_tokens] * n,
                                     ["length"] * n, cached_tokens=3))
        return -1

    def has_unfinished(self):
        return bool(self._done)

    running_sequences = 0

    def step(self):
        done, self._done = self._done, []
        return done


async def test_a_group_goes_to_the_engine_as_one_request_and_comes_back_whole_as_arrays():
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler.engine, handler.agent, handler.version = GroupingEngine(), "solver", 3
    groups = [p.GenGroup(K("g"), "solver", 4, [1, 2], 4, 1.0, 10), p.GenGroup(K("h"), "solver", 2, [1, 2], 4, 1.0, 20, 2),
              p.GenGroup(K("x"), "solver", 1, [5], 4, 1.0, 2, 1, turn=3)]  # member 1's fourth turn
    loop = asyncio.create_task(handler.run())
    try:
        results, refused = await generate(handler, outbox, 9, groups)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    # one engine request per group, under an id of the worker's own (a number, no grammar)
    assert handler.engine.added == [("0", 4, 10), ("1", 2, 20), ("2", 1, 2)]
    assert not refused and sorted(results) == ["g", "h", "x"] and (results["x"].first, results["x"].turn) == (1, 3)
    assert [(r.first, r.version, r.lengths, r.cached_tokens) for r in (results["g"], results["h"])] == [
        (0, 3, [4] * 4, 3), (2, 3, [4, 4], 3)]
    assert tokens(results["g"]) == [[7] * 4] * 4
    assert p.unpacked(p.LOGPROB_TYPECODE, results["x"].logprobs).tolist() == [-0.5] * 4


async def test_a_message_naming_an_agent_the_instance_does_not_serve_is_answered_with_an_error():
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler.engine, handler.agent = GroupingEngine(), "solver"
    await handler.handle(p.Generate(4, [p.GenGroup(K("g"), "solver", 2, [1], 2, 1.0, 0),
                                        p.GenGroup(K("h"), "planner", 2, [1], 2, 1.0, 0)]), [])
    (error,) = outbox.sent
    assert isinstance(error, p.Error) and "serves solver, not planner" in error.message
    assert handler.engine.added == [] and handler._admit == []


async def test_a_cancelled_load_fails_at_once_whether_queued_or_receiving():
    """Another rank of an NCCL broadcast died: the LoadWeights of the publication the
    controller names fails, dropped from the queue if it had not started (a whole model's
    or an adapter's), its receive given up if it had; another publication is never touched."""
    handler, outbox = RolloutHandler(), Outbox()
    handler.session = outbox
    cancels, engine_cancels = [], []
    handler._channel = types.SimpleNamespace(cancel=cancels.append, close=lambda: None)
    # Whole weights are received in the engine's own workers; an adapter in this process.
    handler.engine = types.SimpleNamespace(cancel_receive=engine_cancels.append, close=lambda: None, adapters=None)
    handle = lambda key: types.SimpleNamespace(key=key)  # noqa: E731
    handler._control.append(p.LoadWeights(1, "planner", 2, handle("planner-v2-a"), rank=1))
    handler._adapter_loads.append(p.LoadWeights(7, "coach", 2, handle("coach-v2-a"), lora=p.LoraSettings()))
    await handler.handle(p.CancelLoad(2, "planner", "planner-v2-a"), [])
    await handler.handle(p.CancelLoad(8, "coach", "coach-v2-a"), [])
    assert handler._control == [] and handler._adapter_loads == [] and cancels == []
    errors = [m for m in outbox.sent if isinstance(m, p.Error)]
    assert [e.request_id for e in errors] == [1, 7] and all("cancelled" in e.message for e in errors)
    assert [m.request_id for m in outbox.sent if isinstance(m, p.LoadCancelled)] == [2, 8]
    handler._applying = p.LoadWeights(3, "planner", 3, handle("planner-v3-a"), rank=1)  # receiving
    await handler.handle(p.CancelLoad(4, "planner", "planner-v3-b"), [])  # another publication of v3
    await handler.handle(p.CancelLoad(5, "planner", "planner-v3-a"), [])
    assert engine_cancels == ["planner-v3-a"] and cancels == []
    handler._applying = p.LoadWeights(5, "coach", 4, handle("coach-v4-a"), rank=1, lora=p.LoraSettings())
    await handler.handle(p.CancelLoad(6, "coach", "coach-v4-a"), [])
    assert cancels == ["coach-v4-a"] and engine_cancels == ["planner-v3-a"]


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


@pytest.mark.parametrize("in_flight", [pytest.param("finish", marks=pytest.mark.slow), "keep", "recompute"])
async def test_a_load_under_keep_or_recompute_is_applied_while_a_group_runs_and_the_group_says_which_tokens_each_made(
        tmp_path, in_flight):
    from safetensors.torch import load_file

    spec = digit_chain.AGENTS["planner"]
    model_dir = models.build_model(spec, digit_chain.VOCAB, tmp_path / "m")
    handler = RolloutHandler()
    handler.session = outbox = Outbox()
    handler._load_model(p.LoadModel(1, "planner", str(model_dir), 0, max_model_len=64))
    prompt = digit_chain.planner_prompt(digit_chain.make_query(random.Random(6)))
    group = p.GenGroup(K("long"), "planner", 2, prompt, 64 - len(prompt), 1.0, 3, ignore_eos=True)
    weights = {name: t + 0.01 for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    loop = asyncio.create_task(handler.run())
    with ParamChannel() as channel:
        try:
            handle = channel.publish(weights, agent="planner", version=1, transport="shm")
            await handler.handle(p.Generate(2, [group]), [])
            while not handler._running:  # admitted: the group is in flight from here on
                await asyncio.sleep(0)
            await handler.handle(p.LoadWeights(3, "planner", 1, handle, in_flight=in_flight), [])
            while not any(isinstance(m, p.Generated) and m.done for m in outbox.sent) or \
                    not any(isinstance(m, p.WeightsLoaded) for m in outbox.sent):
                outbox.arrived.clear()
                await asyncio.wait_for(outbox.arrived.wait(), 60)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            handler.close()
    order = [type(m).__name__ for m in outbox.sent if isinstance(m, (p.Generated, p.WeightsLoaded))]
    (result,) = next(m for m in outbox.sent if isinstance(m, p.Generated)).results
    versions = p.unpacked(p.TOKEN_TYPECODE, result.token_versions).tolist()
    assert result.version == 0 and result.lengths == [group.max_tokens] * 2
    if in_flight == "finish":  # the load waited for the group: one version throughout
        assert order == ["Generated", "WeightsLoaded"] and versions == []
    else:  # loaded between two steps; the group went on under version 1
        assert order == ["WeightsLoaded", "Generated"]
        for j in range(2):
            own = versions[j * group.max_tokens:(j + 1) * group.max_tokens]
            switch = own.index(1)
            assert 0 < switch < group.max_tokens and own == [0] * switch + [1] * (group.max_tokens - switch)


async def test_an_aborted_group_comes_back_once_as_aborted_queued_or_running_and_the_engine_serves_the_rest(tmp_path):
    handler, outbox = planner_handler(tmp_path)
    prompt = digit_chain.planner_prompt(digit_chain.make_query(random.Random(7)))

    def group(call, max_tokens):
        return p.GenGroup(K(call), "planner", 2, prompt, max_tokens, 1.0, 1, ignore_eos=True)

    def abort(*groups):
        return p.AbortGroups(9, [g.key for g in groups], [g.first for g in groups], [g.turn for g in groups])

    queued, served, long, short = group("queued", 8), group("served", 8), group("long", 64 - len(prompt)), group("short", 4)
    # Named before the engine loop ever looks: it leaves its message, the rest of which runs.
    await handler.handle(p.Generate(2, [queued, served]), [])
    await handler.handle(abort(queued), [])
    loop = asyncio.create_task(handler.run())
    try:
        results, refused = await generate(handler, outbox, 2, [])
        assert sorted(results) == ["served"] and refused == {"queued": "aborted"}
        # Running: the long one is aborted in the engine between two steps; the short one finishes.
        await handler.handle(p.Generate(3, [long, short]), [])
        while not handler._running:
            await asyncio.sleep(0)
        await handler.handle(abort(long), [])
        results, refused = await generate(handler, outbox, 3, [])
        assert sorted(results) == ["short"] and refused == {"long": "aborted"}
        replies = [m for m in outbox.sent if isinstance(m, p.Generated) and m.request_id == 3]
        assert [r.aborted for m in replies for r in m.refused] == [True]  # once
        # A group that already came back: the name matches nothing, nothing comes back again.
        await handler.handle(abort(short), [])
        again, none = await generate(handler, outbox, 4, [group("after", 4)])
        assert sorted(again) == ["after"] and not none and not loop.done()
        assert sum(1 for m in outbox.sent if isinstance(m, p.Generated) and m.request_id == 3) == len(replies)
        assert handler.engine.num_queued_requests == 0 and not handler._running
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        handler.close()
