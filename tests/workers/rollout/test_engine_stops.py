"""How outputs end, on a real vLLM engine: at the model's end-of-sequence token (kept in
the ids), at a stop token, at a stop string; or at max_tokens with ignore_eos. Top-k 1 is
greedy at any temperature."""

import json
import random
import shutil

import pytest

from flexmarl.controller.run.model_resolution import resolve_model
from flexmarl.controller.tasks import digit_chain as chain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_and_base(tmp_path_factory):
    from flexmarl.workers.rollout.engine import VllmEngine

    model = tmp_path_factory.mktemp("m") / "planner"
    shutil.copytree(resolve_model("tiny:planner"), model)
    prompt = chain.planner_prompt(chain.make_query(random.Random(1)))
    probe = VllmEngine(model, seed=0, max_model_len=64)
    base = run(probe, prompt)
    probe.close()
    # Make the second greedy token the model's end of sequence: a model that "learned to stop".
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = base.token_ids[1]
    (model / "generation_config.json").write_text(json.dumps(config))
    engine = VllmEngine(model, seed=0, max_model_len=64)
    yield engine, prompt, base
    engine.close()


def run(engine, prompt, **sampling):
    engine.add("r", prompt, 6, sampling.pop("temperature", 0.0), 0, **sampling)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    return done[0]


def test_ignore_eos_writes_exactly_max_tokens(engine_and_base):
    engine, prompt, base = engine_and_base
    assert len(base.token_ids) == 6 and base.finish_reason == "length"
    assert run(engine, prompt, ignore_eos=True).token_ids == base.token_ids


def test_generation_ends_at_the_end_of_sequence_token_which_stays_in_the_ids(engine_and_base):
    engine, prompt, base = engine_and_base
    out = run(engine, prompt, ignore_eos=False)
    assert out.token_ids == base.token_ids[:2] and out.finish_reason == "stop"
    assert len(out.logprobs) == 2


def test_generation_ends_at_a_stop_token_and_at_a_stop_string(engine_and_base):
    engine, prompt, base = engine_and_base
    assert run(engine, prompt, stop_token_ids=[base.token_ids[0]]).token_ids == base.token_ids[:1]
    third = str(chain.digit_of(base.token_ids[2]))
    out = run(engine, prompt, stop=[third])
    assert out.token_ids == base.token_ids[:3] and out.finish_reason == "stop"


def test_top_k_one_samples_the_greedy_tokens_at_temperature_one(engine_and_base):
    engine, prompt, base = engine_and_base
    assert run(engine, prompt, temperature=1.0, top_k=1, ignore_eos=True).token_ids == base.token_ids
