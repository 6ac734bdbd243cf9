"""Tiny-model recipes and their cache keys: plain data, no torch."""

import dataclasses

import pytest

from flexmarl.runtime.model_specs import (
    SPECIAL_TOKENS,
    TinyModelRecipe,
    TinyModelSpec,
    WarmupSchedule,
    cache_key,
    cached_model_dir,
    check_spec,
)

SPEC = TinyModelSpec("tiny", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=64, seed=7)
VOCAB = SPECIAL_TOKENS + ("a", "b")
SCHEDULE = WarmupSchedule()


def no_examples():
    return []


def test_the_cache_key_of_a_fixed_recipe_never_changes_by_accident():
    # A changed key silently rebuilds every user's cached models: change it only on purpose
    # (BUILD_VERSION, or a new field that shapes the weights).
    assert cache_key(SPEC, VOCAB, "v1", SCHEDULE) == "tiny-e26cf7b060602e5d"


def test_everything_that_shapes_the_weights_changes_the_cache_key():
    base = cache_key(SPEC, VOCAB, "v1", SCHEDULE)
    others = [
        cache_key(dataclasses.replace(SPEC, seed=8), VOCAB, "v1", SCHEDULE),
        cache_key(SPEC, VOCAB + ("c",), "v1", SCHEDULE),
        cache_key(SPEC, VOCAB, "v2", SCHEDULE),
        cache_key(SPEC, VOCAB, "v1", WarmupSchedule(steps=10)),
        cache_key(SPEC, VOCAB, "", SCHEDULE),
    ]
    assert len({base, *others}) == 6
    assert all(key.startswith("tiny-") for key in others)


def test_without_a_warmup_the_schedule_does_not_matter():
    assert cache_key(SPEC, VOCAB, "", SCHEDULE) == cache_key(SPEC, VOCAB, "", WarmupSchedule(steps=1))
    assert TinyModelRecipe(SPEC, VOCAB, None, "v1").cache_key() == cache_key(SPEC, VOCAB, "", SCHEDULE)


def test_a_cached_directory_is_found_only_once_it_is_published(tmp_path):
    recipe = TinyModelRecipe(SPEC, VOCAB, no_examples, "v1", SCHEDULE)
    assert cached_model_dir(recipe, tmp_path) is None
    (tmp_path / f".building-{recipe.cache_key()}-abc").mkdir()  # a build under way
    assert cached_model_dir(recipe, tmp_path) is None
    (tmp_path / recipe.cache_key()).mkdir()
    assert cached_model_dir(recipe, tmp_path) == tmp_path / recipe.cache_key()
    assert cached_model_dir(recipe, tmp_path / "absent") is None


def test_a_recipe_whose_vocabulary_lacks_the_special_tokens_is_refused():
    with pytest.raises(ValueError, match=r"lacks the special tokens \['<unk>'\]"):
        TinyModelRecipe(SPEC, ("<pad>", "<bos>", "<eos>", "a"))


def test_a_recipe_with_a_warmup_needs_a_version():
    with pytest.raises(ValueError, match="needs a warmup_version"):
        TinyModelRecipe(SPEC, VOCAB, no_examples)


def test_shapes_vllm_cpu_attention_cannot_take_are_refused():
    check_spec(SPEC)
    with pytest.raises(ValueError, match="head size 24"):
        check_spec(dataclasses.replace(SPEC, hidden_size=48))
    with pytest.raises(ValueError, match="must divide"):
        check_spec(dataclasses.replace(SPEC, num_kv_heads=3))
