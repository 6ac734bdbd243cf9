"""The real engine against the trainer, on identical weights: tokens drawn at a temperature
with top_p or top_k are scored by the trainer exactly as the engine reported them, so an
on-policy step sees importance ratios of 1 and no correction clips or masks anything."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from train_batches import as_trained, TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain  # noqa: E402
from flexmarl.runtime import protocol as p  # noqa: E402
from flexmarl.runtime.model_specs import TinyModelSpec  # noqa: E402
from flexmarl.workers import models  # noqa: E402
from flexmarl.workers.trainer.sampling import turn_settings  # noqa: E402
from flexmarl.workers.trainer.scoring import token_scores  # noqa: E402
from flexmarl.workers.trainer.worker import TrainerHandler  # noqa: E402

pytestmark = pytest.mark.slow

# Untrained: next-token distributions stay broad, so top_p = 0.7 and top_k = 5 cut many
# tokens at every position (a peaked model would keep one and make every logprob 0).
SPEC = TinyModelSpec("sampling-test", hidden_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, intermediate_size=128, seed=13)
SETTINGS = [(0.8, 0.7, 0), (0.8, 1.0, 5)]  # (temperature, top_p, top_k)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """(model dir, {settings: TrainSamples with the engine's tokens and logprobs})."""
    from flexmarl.workers.rollout.engine import VllmEngine

    torch.set_num_threads(1)
    model_dir = models.build_model(SPEC, digit_chain.VOCAB, tmp_path_factory.mktemp("model"))
    engine = VllmEngine(model_dir, seed=0, max_model_len=0, settings=p.EngineSettings())
    rng = random.Random(0)
    prompts = [digit_chain.solver_prompt(digit_chain.make_query(rng)) for _ in range(8)]
    out = {}
    try:
        for temperature, top_p, top_k in SETTINGS:
            for i, prompt in enumerate(prompts):
                engine.add(f"{top_k}-{i}", prompt, 8, temperature, 100 + i, top_p=top_p, top_k=top_k)
            done = {}
            while engine.has_unfinished():
                for c in engine.step():
                    done[c.request_id] = c
            out[(temperature, top_p, top_k)] = [
                TrainSample(rid, prompts[i], done[rid].token_ids, 1.0 if i % 2 else -1.0, done[rid].logprobs,
                              [0], temperature, [], top_p, top_k)
                for i, rid in enumerate(f"{top_k}-{i}" for i in range(len(prompts)))]
    finally:
        engine.close()
    return model_dir, out


def trainer_logprobs(model_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(s.output_ids) for s in samples)
    valid = torch.tensor([[j < len(s.output_ids) for j in range(width)] for s in samples])
    with torch.no_grad():
        logp, _ = token_scores(model, as_trained(samples), valid, *turn_settings(as_trained(samples), width))
    return logp, valid


@pytest.mark.parametrize("setting", SETTINGS, ids=["T0.8-top_p0.7", "T0.8-top_k5"])
def test_the_trainers_logprobs_equal_the_engines_under_top_p_and_top_k(drawn, setting):
    model_dir, out = drawn
    samples = out[setting]
    logp, valid = trainer_logprobs(model_dir, samples)
    engine = torch.tensor([s.rollout_logprobs for s in samples])
    assert valid.all() and engine.shape == logp.shape
    assert (logp - engine).abs().max().item() < 1e-4
    # The cut matters: the full softmax at the same temperature is far from the engine's.
    untruncated = [TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, s.rollout_logprobs,
                                 s.versions, s.temperature) for s in samples]
    full, _ = trainer_logprobs(model_dir, untruncated)
    assert (full - engine).abs().mean().item() > 0.05


@pytest.mark.parametrize("correction", ["ppo_clip", "token_mis", "tis"])
def test_an_on_policy_step_under_top_p_and_top_k_clips_and_masks_nothing(drawn, correction):
    model_dir, out = drawn
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "solver", str(model_dir), 1e-3, 0, 1.0))
    samples = [s for setting in SETTINGS for s in out[setting]]
    h._execute(micro_batch(2, "solver", 1, samples, max_staleness=1, loss=p.LossOptions(off_policy=correction)))
    stats = h._execute(p.OptimStep(3, "solver", 1, samples=len(samples))).stats
    assert stats.clip_frac == 0 and stats.logprob_abs_diff < 1e-4 and stats.tokens == 8 * len(samples)
    h.close()
