"""A weight load with requests in flight, in a real vLLM engine: "keep" and "recompute" let
them continue and every token says which weights produced it; "finish" refuses the load."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
from rollout_engines import drain, logprobs_under  # noqa: E402

from flexmarl.controller.tasks import digit_chain  # noqa: E402
from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.model_specs import TinyModelSpec, WarmupSchedule  # noqa: E402
from flexmarl.workers import models  # noqa: E402

SPEC = TinyModelSpec("in-flight-test", hidden_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, intermediate_size=128, seed=5)
MAX_TOKENS, BEFORE, N = 16, 5, 3  # tokens per sample, engine steps before the load, samples per request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    examples = digit_chain.warmup_examples(digit_chain.SOLVER, random.Random(0), 256)
    return models.build_model(SPEC, digit_chain.VOCAB, tmp_path_factory.mktemp("model"), examples,
                              WarmupSchedule(steps=10, batch_size=16, lr=3e-3))


@pytest.fixture(scope="module")
def engine(model_dir):
    from flexmarl.workers.rollout.engine import VllmEngine

    engine = VllmEngine(model_dir, seed=0, max_model_len=0, settings=p.EngineSettings())
    yield engine
    engine.close()


def new_weights(model_dir, seed: int):
    """The engine's model with every weight moved a little: what a step publishes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def prompt() -> list[int]:
    return digit_chain.solver_prompt(digit_chain.make_query(random.Random(4)))


@pytest.mark.parametrize("in_flight", ["keep", "recompute"])
def test_a_load_with_requests_in_flight_continues_them_and_each_token_carries_its_version(
        engine, model_dir, in_flight):
    old = engine.weights_version + 1
    version = old + 1
    before = new_weights(model_dir, old)
    engine.load_weights(before.named_parameters(), version=old)  # nothing in flight: any setting loads
    engine.add(f"{in_flight}-0", prompt(), MAX_TOKENS, 1.0, 7, n=N)
    for _ in range(BEFORE):  # the first step prefills and samples one token, each later one one more
        assert not engine.step()
    model = new_weights(model_dir, version)
    engine.load_weights(model.named_parameters(), in_flight=in_flight, version=version)
    engine.add(f"{in_flight}-1", prompt(), MAX_TOKENS, 1.0, 8)  # admitted under the new weights
    done = drain(engine)

    spanning, after = done[f"{in_flight}-0"], done[f"{in_flight}-1"]
    assert spanning.lengths == [MAX_TOKENS] * N
    assert spanning.token_versions == ([old] * BEFORE + [version] * (MAX_TOKENS - BEFORE)) * N
    assert after.token_versions is None  # one version throughout: nothing to say per token
    assert engine.weights_version == version
    if in_flight == "recompute":
        # The cache was rebuilt under the new weights: each later token's logprob is the new
        # model's given everything before it, exactly what a trainer scores.
        for j in range(N):
            ids = spanning.token_ids[j * MAX_TOKENS:(j + 1) * MAX_TOKENS]
            expected = logprobs_under(model, prompt(), ids)[BEFORE:]
            got = torch.tensor(spanning.logprobs[j * MAX_TOKENS + BEFORE:(j + 1) * MAX_TOKENS])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        # A trainer holding the new weights compares each token with the logprob it was
        # sampled at: the tokens after the load match exactly, those before differ by what
        # the old weights gave them.
        from flexmarl.workers.trainer.batch import samples_of, train_group
        from flexmarl.workers.trainer.loss import policy_loss

        outputs = [spanning.token_ids[j * MAX_TOKENS:(j + 1) * MAX_TOKENS] for j in range(N)]
        group = train_group(p.GroupKey("e", "a", "c"), prompt(), outputs, [1.0] * N,
                            [spanning.logprobs[j * MAX_TOKENS:(j + 1) * MAX_TOKENS] for j in range(N)],
                            [old] * N)
        _, sums = policy_loss(model, samples_of([group]), p.LossOptions(), off_policy=True, clip_ratio=2.0)
        drift = sum(float((logprobs_under(model, prompt(), ids)[:BEFORE]
                           - logprobs_under(before, prompt(), ids)[:BEFORE]).abs().sum()) for ids in outputs)
        assert sums.compared == N * MAX_TOKENS and drift > 1e-3
        assert sums.abs_diff == pytest.approx(drift, abs=N * MAX_TOKENS * 1e-4)


@pytest.mark.slow
def test_finish_refuses_a_load_while_requests_are_in_flight_and_bad_settings_are_refused(engine, model_dir):
    engine.add("finish-0", prompt(), MAX_TOKENS, 1.0, 1)
    engine.step()
    model = new_weights(model_dir, 99)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_weights(model.named_parameters(), in_flight="finish")
    with pytest.raises(ValueError, match="in_flight is 'later'"):
        engine.load_weights(model.named_parameters(), in_flight="later")
    assert drain(engine)["finish-0"].token_versions is None
