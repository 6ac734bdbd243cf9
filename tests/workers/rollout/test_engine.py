import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from flexmarl.controller.tasks import digit_chain  # noqa: E402
from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.model_specs import TinyModelSpec, WarmupSchedule  # noqa: E402
from flexmarl.workers import models  # noqa: E402

pytestmark = pytest.mark.slow

SPEC = TinyModelSpec("engine-test", hidden_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, intermediate_size=128, seed=11)
# A short warm-up makes next-token distributions peaked, so greedy choices are not
# near-ties that float rounding could flip between vLLM and transformers.
SCHEDULE = WarmupSchedule(steps=80, batch_size=32, lr=3e-3)
MAX_TOKENS = 6


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [digit_chain.solver_prompt(digit_chain.make_query(rng)) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    examples = digit_chain.warmup_examples(digit_chain.SOLVER, random.Random(0), 1024)
    return models.build_model(SPEC, digit_chain.VOCAB, tmp_path_factory.mktemp("model"), examples, SCHEDULE)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The transformers copy of the weights the engine holds; tests that change one
    change the other."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    from flexmarl.workers.rollout.engine import VllmEngine

    # The settings a CPU rollout worker gets by default: "auto" dtype, the device's length.
    engine = VllmEngine(model_dir, seed=0, max_model_len=0, settings=p.EngineSettings())
    yield engine
    engine.close()


def test_default_settings_on_the_cpu_run_float32_with_a_64_token_context(engine):
    config = engine._engine.vllm_config
    assert engine.device == "cpu" and config.model_config.dtype == torch.float32
    assert engine.max_model_len == 64
    assert config.cache_config.kv_cache_memory_bytes == 256 * 2**20


def run(engine, requests, temperature=1.0) -> dict:
    """requests: (request_id, prompt_ids, seed); runs the engine until all finish."""
    for request_id, prompt, seed in requests:
        engine.add(request_id, prompt, MAX_TOKENS, temperature, seed)
    done = {}
    while engine.has_unfinished():
        for completion in engine.step():
            done[completion.request_id] = completion
    return done


def test_engine_starts_and_writes_exactly_max_tokens_per_request(engine):
    done = run(engine, [(f"len-{i}", p, i) for i, p in enumerate(prompts(10))])
    assert sorted(done) == sorted(f"len-{i}" for i in range(10))
    for completion in done.values():
        assert len(completion.token_ids) == len(completion.logprobs) == MAX_TOKENS
        assert all(lp <= 0.0 for lp in completion.logprobs)
        assert completion.finish_reason == "length"
    assert engine.num_queued_requests == 0 and engine.queued_tokens == 0
    assert engine.startup_seconds > 0


def test_the_same_prompt_seed_and_weights_give_the_same_tokens(engine):
    batch = prompts(16)
    first = run(engine, [(f"a-{i}", p, 100 + i) for i, p in enumerate(batch)])
    again = run(engine, [(f"b-{i}", p, 100 + i) for i, p in enumerate(batch)])
    reseeded = run(engine, [(f"c-{i}", p, 900 + i) for i, p in enumerate(batch)])
    assert all(first[f"a-{i}"].token_ids == again[f"b-{i}"].token_ids for i in range(16))
    assert any(first[f"a-{i}"].token_ids != reseeded[f"c-{i}"].token_ids for i in range(16))


def test_a_request_samples_the_same_alone_as_inside_a_batch_it_joined_late(engine):
    batch = prompts(8, seed=1)
    alone = run(engine, [("alone", batch[3], 7)])["alone"]
    for i, prompt in enumerate(batch[:3]):
        engine.add(f"early-{i}", prompt, MAX_TOKENS, 1.0, i)
    engine.step()  # the early requests are running when the late one joins
    done = run(engine, [("late", batch[3], 7)])
    assert {"early-0", "early-1", "early-2", "late"} <= set(done)
    assert done["late"].token_ids == alone.token_ids


def test_queued_work_is_counted_until_requests_finish(engine):
    engine.add("q-0", prompts(1)[0], MAX_TOKENS, 1.0, 0)
    engine.add("q-1", prompts(1)[0], MAX_TOKENS, 1.0, 1)
    assert engine.num_queued_requests == 2
    assert engine.queued_tokens == 2 * (len(prompts(1)[0]) + MAX_TOKENS)
    run(engine, [])
    assert engine.num_queued_requests == 0


def test_aborted_requests_never_come_back(engine):
    engine.add("keep", prompts(1)[0], MAX_TOKENS, 1.0, 0)
    engine.add("drop", prompts(1)[0], MAX_TOKENS, 1.0, 1)
    engine.abort(["drop", "never-added"])
    assert set(run(engine, [])) == {"keep"}
    assert engine.num_queued_requests == 0


def test_adding_a_request_id_twice_is_refused(engine):
    engine.add("twice", prompts(1)[0], MAX_TOKENS, 1.0, 0)
    with pytest.raises(ValueError, match="already"):
        engine.add("twice", prompts(1)[0], MAX_TOKENS, 1.0, 0)
    run(engine, [])


def samples_of(completion) -> list[list[int]]:
    """A request's samples' token ids, one list each."""
    out, start = [], 0
    for n in completion.lengths:
        out.append(completion.token_ids[start:start + n])
        start += n
    return out


def test_a_request_of_n_samples_draws_exactly_what_n_requests_of_one_draw_and_comes_back_whole(engine):
    prompt = prompts(1, seed=4)[0]
    alone = run(engine, [(f"alone-{j}", prompt, 50 + j) for j in range(6)])
    engine.add("group", prompt, MAX_TOKENS, 1.0, 50, n=6)
    assert engine.num_queued_requests == 1 and engine.queued_tokens == 6 * (len(prompt) + MAX_TOKENS)
    (grouped,) = run(engine, []).values()
    assert grouped.request_id == "group" and grouped.lengths == [MAX_TOKENS] * 6
    assert samples_of(grouped) == [alone[f"alone-{j}"].token_ids for j in range(6)]
    assert grouped.logprobs == pytest.approx([lp for j in range(6) for lp in alone[f"alone-{j}"].logprobs], abs=1e-5)
    assert grouped.finish_reasons == ["length"] * 6
    assert engine.num_queued_requests == 0


def test_aborting_a_request_of_n_samples_aborts_every_sample_and_nothing_else(engine):
    prompt = prompts(1, seed=5)[0]
    engine.add("g", prompt, MAX_TOKENS, 1.0, 0, n=3)
    engine.add("other", prompt, MAX_TOKENS, 1.0, 9)
    engine.abort(["g"])
    assert engine.num_queued_requests == 1
    assert set(run(engine, [])) == {"other"}


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_returned_logprobs_match_transformers_for_the_sampled_tokens(engine, reference,
                                                                     temperature):
    done = run(engine, [(f"lp-{temperature}-{i}", p, i) for i, p in enumerate(prompts(8))],
               temperature)
    for i, prompt in enumerate(prompts(8)):
        completion = done[f"lp-{temperature}-{i}"]
        expected = reference_logprobs(reference, prompt, completion.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected,
                                   atol=1e-4, rtol=1e-4)


def greedy_reference(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_after_load_weights_greedy_tokens_equal_transformers_on_the_same_weights(engine,
                                                                                 reference):
    batch = prompts(16, seed=2)
    before = run(engine, [(f"g0-{i}", p, 0) for i, p in enumerate(batch)], temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)

    engine.load_weights(reference.named_parameters())

    after = run(engine, [(f"g1-{i}", p, 0) for i, p in enumerate(batch)], temperature=0.0)
    assert [after[f"g1-{i}"].token_ids for i in range(16)] == \
        [greedy_reference(reference, p) for p in batch]
    assert any(after[f"g1-{i}"].token_ids != before[f"g0-{i}"].token_ids for i in range(16))
    for i, prompt in enumerate(batch):  # the new weights' logprobs, not the old ones'
        expected = reference_logprobs(reference, prompt, after[f"g1-{i}"].token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(after[f"g1-{i}"].logprobs), expected,
                                   atol=1e-4, rtol=1e-4)


def test_load_weights_is_refused_while_requests_are_in_flight(engine, reference):
    engine.add("in-flight", prompts(1)[0], MAX_TOKENS, 1.0, 0)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_weights(reference.named_parameters())
    engine.abort(["in-flight"])
    engine.load_weights(reference.named_parameters())  # drained: accepted


def test_a_partial_set_of_weights_is_refused_and_the_old_weights_stay(engine, reference):
    prompt = prompts(1, seed=3)[0]
    before = run(engine, [("p0", prompt, 0)], temperature=0.0)["p0"]
    head_only = [(n, t * 2) for n, t in reference.named_parameters() if n == "lm_head.weight"]
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(head_only)
    after = run(engine, [("p1", prompt, 0)], temperature=0.0)["p1"]
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)


def test_seeded_requests_beyond_one_steps_token_budget_run_without_splitting_prompts(engine):
    # 3000 prompts of 6 tokens exceed one step's 16384-token budget: they must run in
    # waves. (vLLM on CPU fails seeded sampling for a prompt whose prefill was split.)
    batch = [(f"wave-{i}", p, i) for i, p in enumerate(prompts(3000, seed=7))]
    assert sum(len(p) for _, p, _ in batch) > 16384
    done = run(engine, batch)
    assert len(done) == 3000 and all(len(c.token_ids) == MAX_TOKENS for c in done.values())


def test_a_published_load_passes_only_the_handle_through_vllms_calls_and_loads_the_same_weights(engine,
                                                                                                reference):
    """The engine's worker receives the publication itself (engine_receive.py): what goes
    through collective_rpc is bytes and names, never a tensor, and the weights loaded are
    the published ones."""
    from flexmarl.runtime.params.channel import ParamChannel

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    calls = []
    rpc = engine._engine.collective_rpc

    def spy(method, timeout=None, args=(), kwargs=None):
        calls.append((method, args, kwargs))
        return rpc(method, timeout, args, kwargs)

    batch = prompts(8, seed=5)
    with ParamChannel() as trainer:
        handle = trainer.publish(dict(reference.named_parameters()), agent="a", version=9, transport="shm")
        engine._engine.collective_rpc = spy
        try:
            engine.load_published(handle)
        finally:
            del engine._engine.collective_rpc
    assert [method for method, _, _ in calls] == ["flexmarl_receive", "flexmarl_apply"]
    assert all(isinstance(arg, (bytes, str)) for _, args, _ in calls for arg in args) and all(
        kwargs is None for _, _, kwargs in calls)
    assert len(calls[0][1][0]) < handle.total_bytes / 100
    after = run(engine, [(f"pub-{i}", p, 0) for i, p in enumerate(batch)], temperature=0.0)
    assert [after[f"pub-{i}"].token_ids for i in range(8)] == [greedy_reference(reference, p) for p in batch]


def test_a_corrupt_publication_is_refused_by_the_worker_and_the_old_weights_stay(engine, reference):
    import msgspec

    from flexmarl.runtime.params.channel import ParamChannel, ParamTransferError

    prompt = prompts(1, seed=4)[0]
    before = run(engine, [("c0", prompt, 0)], temperature=0.0)["c0"]
    changed = {n: t * 2 for n, t in reference.named_parameters()}
    with ParamChannel() as trainer:
        handle = trainer.publish(changed, agent="a", version=10, transport="tcp")
        forged = msgspec.structs.replace(handle, checksum=handle.checksum ^ 1)
        with pytest.raises(ParamTransferError, match="checksum mismatch"):
            engine.load_published(forged)
    after = run(engine, [("c1", prompt, 0)], temperature=0.0)["c1"]
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)


def test_a_scoring_request_returns_the_models_logprob_of_each_given_id_and_generates_nothing(engine, reference):
    """A teacher's view of a student's sample: one prefill of prompt + output with vLLM's
    prompt logprobs, against transformers' log-softmax of the same weights."""
    prompt, output = prompts(1, seed=9)[0], [digit_chain.DIGIT_IDS[d] for d in (3, 4, 1, 2, 7, 8)]
    engine.add("score-0", prompt + output, 1, 1.0, None, score_from=len(prompt))
    done = run(engine, [])["score-0"]
    assert done.token_ids == output and done.finish_reason == "score"
    with torch.no_grad():
        ids = torch.tensor([prompt + output])
        lp = torch.log_softmax(reference(ids).logits[0].float(), -1)
    want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(output)]
    assert done.logprobs == pytest.approx(want, abs=1e-4)
    with pytest.raises(ValueError, match="a scoring request scores ids of one prompt from index 1 on"):
        engine.add("s-a", prompt, 1, 1.0, None, n=2, score_from=2)
    assert engine.num_queued_requests == 0
