"""A new adapter version loaded with requests of its agent in flight, in a real vLLM engine:
"keep" and "recompute" move them to the new version between two steps (its weights loaded
into the old version's slot in place) and every token says which version produced it;
another agent's requests on the same base run on untouched; "finish" leaves them under the
version they were admitted with."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from rollout_engines import LORA, VOCAB, adapter, drain, logprobs_under  # noqa: E402

from flexmarl.runtime import protocol as p  # noqa: E402

MAX_TOKENS, BEFORE, N = 16, 5, 3  # tokens per sample, engine steps before the load, samples per request


@pytest.fixture(scope="module")
def engine(base_dir):
    from flexmarl.workers.rollout.engine import VllmEngine

    settings = p.EngineSettings(max_loras=2, max_lora_rank=8, max_cpu_loras=6)
    engine = VllmEngine(base_dir, max_model_len=256, max_num_seqs=64, kv_cache_bytes=32 * 2**20, settings=settings)
    yield engine
    engine.close()


PROMPT = [3 + (j * 5) % (VOCAB - 3) for j in range(12)]


def samples(completion) -> list[list[int]]:
    out, at = [], 0
    for length in completion.lengths:
        out.append(completion.token_ids[at:at + length])
        at += length
    return out


@pytest.mark.parametrize("in_flight", ["keep", "recompute"])
def test_an_adapter_load_moves_its_agents_requests_in_flight_and_each_token_carries_its_version(
        engine, base_dir, in_flight):
    old = 10 if in_flight == "keep" else 20  # each case an agent of its own in the one engine
    agent = f"a-{in_flight}"
    _, before = adapter(base_dir, old)
    model, after = adapter(base_dir, old + 1)
    _, other = adapter(base_dir, 99)
    engine.load_adapter(agent, old, before, LORA, in_flight=in_flight)  # the first version: plain
    engine.load_adapter("b", old, other, LORA)
    # What the requests draw with no load meanwhile: the same seeds, the same engine.
    engine.add("alone", PROMPT, MAX_TOKENS, 1.0, 7, n=N, ignore_eos=True, adapter=agent)
    engine.add("b-alone", PROMPT, MAX_TOKENS, 1.0, 3, ignore_eos=True, adapter="b")
    alone = drain(engine)

    assert engine.add("spans", PROMPT, MAX_TOKENS, 1.0, 7, n=N, ignore_eos=True, adapter=agent) == old
    engine.add("b", PROMPT, MAX_TOKENS, 1.0, 3, ignore_eos=True, adapter="b")
    for _ in range(BEFORE):  # the first step prefills and samples one token, each later one one more
        assert not engine.step()
    slot = engine.adapters.resolve(agent).lora_id
    engine.load_adapter(agent, old + 1, after, LORA, in_flight=in_flight)
    assert (agent, old) not in engine.adapters.resident() and (agent, old + 1) in engine.adapters.resident()
    assert engine.adapters.resolve(agent).lora_id == slot  # the same slot, in place
    assert engine.add("later", PROMPT, MAX_TOKENS, 1.0, 8, ignore_eos=True, adapter=agent, adapter_version=old) \
        == old + 1  # a group issued under the version just replaced runs under the new one
    done = drain(engine)

    spanning = done["spans"]
    assert spanning.lengths == [MAX_TOKENS] * N
    assert spanning.token_versions == ([old] * BEFORE + [old + 1] * (MAX_TOKENS - BEFORE)) * N
    assert done["later"].token_versions is None  # one version throughout
    for j, (ids, solo) in enumerate(zip(samples(spanning), samples(alone["alone"]))):
        assert ids[:BEFORE] == solo[:BEFORE]  # the same draws until the load
        got = spanning.logprobs[j * MAX_TOKENS:(j + 1) * MAX_TOKENS]
        was = alone["alone"].logprobs[j * MAX_TOKENS:(j + 1) * MAX_TOKENS]
        assert got[:BEFORE] == was[:BEFORE]
        # The new adapter produced the rest (the old one would give other logprobs).
        assert max(abs(a - b) for a, b in zip(got[BEFORE:], was[BEFORE:])) > 1e-3 or ids[BEFORE:] != solo[BEFORE:]
        if in_flight == "recompute":
            # The cache was rebuilt under the new adapter: each later token's logprob is the
            # new adapter's given everything before it, exactly what a trainer scores.
            expected = logprobs_under(model, PROMPT, ids)[BEFORE:]
            torch.testing.assert_close(torch.tensor(got[BEFORE:]), expected, atol=1e-4, rtol=1e-4)
    # The other agent's request ran on under its own adapter: what it draws alone.
    assert done["b"].token_ids == alone["b-alone"].token_ids and done["b"].token_versions is None
    torch.testing.assert_close(torch.tensor(done["b"].logprobs), torch.tensor(alone["b-alone"].logprobs),
                               atol=1e-4, rtol=1e-4)


def test_finish_leaves_an_adapters_requests_under_the_version_they_were_admitted_with(engine, base_dir):
    _, first = adapter(base_dir, 30)
    _, second = adapter(base_dir, 31)
    engine.load_adapter("c", 0, first, LORA)
    engine.add("c0", PROMPT, MAX_TOKENS, 1.0, 1, ignore_eos=True, adapter="c")
    engine.step()
    engine.load_adapter("c", 1, second, LORA, in_flight="finish")
    assert ("c", 0) in engine.adapters.resident() and ("c", 1) in engine.adapters.resident()
    assert drain(engine)["c0"].token_versions is None
    assert ("c", 0) not in engine.adapters.resident()
    with pytest.raises(ValueError, match="in_flight is 'later'"):
        engine.load_adapter("c", 2, second, LORA, in_flight="later")
