"""One vLLM engine serving several LoRA adapters of its model: requests of different
adapters interleave without changing each other's tokens or logprobs, a version stays
loaded while a request uses it, adapters never share prefix-cache entries, and a trainer's
adapter checkpoint loads in vLLM as it is."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


import pytest  # noqa: E402
import torch  # noqa: E402
from rollout_engines import LORA, VOCAB, adapter, drain  # noqa: E402

from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import GroupKey  # noqa: E402
from flexmarl.workers.rollout.engine import RequestRefused, VllmEngine  # noqa: E402
from flexmarl.workers.rollout.engine_adapters import AdapterSlotsFull  # noqa: E402

pytestmark = pytest.mark.slow

# vLLM's CPU backend caches prefixes in blocks of 128 tokens: a prompt must pass one.
LONG = 160



def K(call):
    """A group's key, named by its call."""
    return GroupKey("e", "agent", call)

def engine(base_dir, slots):
    settings = p.EngineSettings(max_loras=slots, max_lora_rank=8, max_cpu_loras=slots)
    return VllmEngine(base_dir, max_model_len=256, max_num_seqs=64, kv_cache_bytes=32 * 2**20, settings=settings)


def prompt(i, length=12):
    return [3 + (i * 7 + j * 5) % (VOCAB - 3) for j in range(length)]


@pytest.fixture(scope="module")
def adapters(base_dir):
    return {"a0": adapter(base_dir, 1)[1], "a1": adapter(base_dir, 2)[1], "b0": adapter(base_dir, 3)[1]}


@pytest.fixture(scope="module")
def only_a(base_dir, adapters):
    """What an engine holding only A at version 0 writes for the prompts below."""
    e = engine(base_dir, 1)
    e.load_adapter("a", 0, adapters["a0"], LORA)
    for i in range(6):
        e.add(f"a{i}", prompt(i), 24, 1.0, 100 + i, adapter="a")
    yield drain(e)
    e.close()


@pytest.fixture(scope="module")
def shared(base_dir):
    e = engine(base_dir, 2)
    yield e
    e.close()


def test_interleaved_requests_of_two_adapters_equal_an_engine_holding_only_one(base_dir, adapters, only_a, shared):
    e = shared
    e.load_adapter("a", 0, adapters["a0"], LORA)
    e.load_adapter("b", 0, adapters["b0"], LORA)
    for i in range(6):
        assert e.add(f"a{i}", prompt(i), 24, 1.0, 100 + i, adapter="a") == 0
        e.add(f"b{i}", prompt(i), 24, 1.0, 100 + i, adapter="b")
        if i == 2:
            e.step()  # later requests join a running batch
    done = drain(e)
    for i in range(6):
        assert done[f"a{i}"].token_ids == only_a[f"a{i}"].token_ids
        assert done[f"a{i}"].logprobs == only_a[f"a{i}"].logprobs
    # the adapters do differ: B's samples are not A's
    assert any(done[f"b{i}"].token_ids != done[f"a{i}"].token_ids for i in range(6))


def test_with_k_1_a_new_version_loads_while_the_old_one_finishes_its_requests(base_dir, adapters, only_a):
    e = engine(base_dir, 2)  # one agent, K = 1: two versions resident
    try:
        e.load_adapter("a", 0, adapters["a0"], LORA)
        for i in range(6):
            e.add(f"old{i}", prompt(i), 24, 1.0, 100 + i, adapter="a")
        e.step(), e.step()
        e.load_adapter("a", 1, adapters["a1"], LORA)  # requests of version 0 are in flight
        assert e.adapters.resident() == [("a", 0), ("a", 1)]
        assert e.add("new", prompt(0), 24, 1.0, 100, adapter="a") == 1  # new requests: the newest
        with pytest.raises(AdapterSlotsFull):
            e.load_adapter("a", 2, adapters["a0"], LORA)
        done = drain(e)
        assert [done[f"old{i}"].token_ids for i in range(6)] == [only_a[f"a{i}"].token_ids for i in range(6)]
        assert [done[f"old{i}"].logprobs for i in range(6)] == [only_a[f"a{i}"].logprobs for i in range(6)]
        assert done["new"].logprobs != only_a["a0"].logprobs  # under version 1
        assert e.adapters.resident() == [("a", 1)]  # version 0 went with its last request
    finally:
        e.close()


def test_requests_of_different_adapters_never_share_prefix_cache_entries(base_dir, adapters):
    e = engine(base_dir, 3)
    try:
        e.load_adapter("a", 0, adapters["a0"], LORA)
        e.load_adapter("b", 0, adapters["b0"], LORA)
        long = prompt(9, LONG)

        def cached(rid, **adapter):
            e.add(rid, long, 4, 0.0, 0, **adapter)
            return drain(e)[rid].cached_tokens

        assert cached("a-first", adapter="a") == 0
        assert cached("a-again", adapter="a") >= 128  # the cache works: a full block is reused
        assert cached("b", adapter="b") == 0  # same tokens, another adapter: nothing shared
        with pytest.raises(RequestRefused, match="must name one"):
            e.add("plain", long, 4, 0.0, 0)  # the base alone is no agent of an adapter engine
        e.load_adapter("a", 1, adapters["a1"], LORA)
        assert cached("a-next", adapter="a") == 0  # nor between two versions of one agent
    finally:
        e.close()


def test_a_trainers_adapter_checkpoint_loads_in_vllm_as_it_is(base_dir, tmp_path):
    from vllm.lora.request import LoRARequest

    from flexmarl.workers.trainer.worker import TrainerHandler

    h = TrainerHandler()
    h._execute(p.InitAgent(1, "writer", str(base_dir), 1e-2, 0, lora=LORA))
    with torch.no_grad():  # as if trained: B away from zero
        for _, param in h.agents["writer"].model.named_parameters():
            param.add_(torch.randn(param.shape) * 0.3)
    h._execute(p.SaveCheckpoint(2, "writer", str(tmp_path / "writer"), full_state=True))
    tensors = {k: v.detach().clone() for k, v in h.agents["writer"].model.named_parameters()}
    h.close()
    e = engine(base_dir, 2)
    try:
        e.load_adapter("writer", 3, tensors, LORA)
        assert e._engine.add_lora(LoRARequest("checkpoint", 999, str(tmp_path / "writer")))
        e.add("synced", prompt(1), 16, 0.0, 0, adapter="writer")
        synced = drain(e)
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        e._engine.add_request("ckpt", tokens_input(prompt(1)), SamplingParams(max_tokens=16, temperature=0.0,
                                                                              logprobs=0),
                              lora_request=LoRARequest("checkpoint", 999, str(tmp_path / "writer")))
        while e._engine.has_unfinished_requests():
            for out in e._engine.step():
                if out.finished:
                    sample = out.outputs[0]
                    ckpt = (list(sample.token_ids), [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)])
        assert ckpt == (synced["synced"].token_ids, synced["synced"].logprobs)
    finally:
        e.close()


def test_a_rollout_worker_takes_a_trainers_adapter_sync_and_stamps_each_sample_with_its_version(base_dir):
    from flexmarl.workers.rollout.worker import RolloutHandler
    from flexmarl.workers.trainer.worker import TrainerHandler

    trainer, rollout = TrainerHandler(), RolloutHandler()
    try:
        trainer._execute(p.InitAgent(1, "writer", str(base_dir), 1e-2, 0, lora=LORA))
        rollout._load_model(p.LoadModel(2, "shared", str(base_dir), 0, max_model_len=256,
                                        engine=p.EngineSettings(max_loras=2, max_lora_rank=8, max_cpu_loras=2)))
        published = trainer._execute(p.PublishWeights(3, "writer", 0, "shm", ["r"]))
        rollout._load_weights(p.LoadWeights(4, "writer", 0, published.handle, lora=LORA))
        assert rollout._serves_adapter("writer") and rollout.engine.adapters.resident() == [("writer", 0)]
        groups = [p.GenGroup(K(f"s{i}"), "writer", 2, prompt(i), 8, 1.0, i, version=0) for i in range(3)]
        assert rollout._start(p.Generate(5, groups)) is None
        assert {run.version for run in rollout._running._running.values()} == {0}
        refused = rollout._start(p.Generate(6, [p.GenGroup(K("x"), "writer", 1, prompt(0), 8, 1.0, 0, version=7)]))
        assert "version 7 is not loaded" in refused.refused[0].reason
        drain(rollout.engine)
    finally:
        trainer.close(), rollout.close()
