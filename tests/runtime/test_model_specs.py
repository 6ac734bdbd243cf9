"""Tiny-model recipes and their cache keys: plain data, no torch."""

import dataclasses

import pytest

from flexmarl.runtime.model_specs import (
    SPECIAL_TOKENS,
    TinyModelRecipe,
    TinyModelSpec,
    TrainedTokenizer,
    WarmupSchedule,
    cache_key,
    cached_model_dir,
    check_spec,
    import_job,
    job_recipes,
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


# ---- a job's own trained tokenizer ---------------------------------------------------


def trained_json(texts=("add one and two", "one two three")) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(list(texts), trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<pad>", "<eos>"], show_progress=False))
    return tokenizer.to_str()


TEMPLATE = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"


def test_training_the_same_text_gives_the_same_tokenizer_so_the_cache_key_is_stable():
    assert trained_json() == trained_json()
    trained = TrainedTokenizer(trained_json(), eos="<eos>", pad="<pad>", chat_template=TEMPLATE)
    again = TrainedTokenizer(trained_json(), eos="<eos>", pad="<pad>", chat_template=TEMPLATE)
    assert TinyModelRecipe(SPEC, tokenizer=trained).cache_key() == TinyModelRecipe(SPEC, tokenizer=again).cache_key()


def test_the_trained_tokenizer_its_special_tokens_and_chat_template_are_in_the_cache_key():
    base = TrainedTokenizer(trained_json(), eos="<eos>", pad="<pad>", chat_template=TEMPLATE)
    variants = [
        base,
        dataclasses.replace(base, json=trained_json(("other text entirely", "more"))),
        dataclasses.replace(base, chat_template=TEMPLATE + " "),
        dataclasses.replace(base, pad="<eos>"),
    ]
    keys = {TinyModelRecipe(SPEC, tokenizer=t).cache_key() for t in variants}
    assert len(keys) == len(variants)
    assert cache_key(SPEC, VOCAB, "v1", SCHEDULE) not in keys


def test_a_trained_tokenizer_must_hold_its_special_tokens():
    with pytest.raises(ValueError, match=r"lacks the special tokens \{'bos': '<s>'\}"):
        TrainedTokenizer(trained_json(), eos="<eos>", pad="<pad>", bos="<s>")
    with pytest.raises(ValueError, match="not a tokenizer's JSON"):
        TrainedTokenizer("{not json", eos="<eos>", pad="<pad>")


def test_a_recipe_takes_a_vocabulary_or_a_trained_tokenizer_not_both():
    trained = TrainedTokenizer(trained_json(), eos="<eos>", pad="<pad>")
    with pytest.raises(ValueError, match="either a vocab or a trained tokenizer"):
        TinyModelRecipe(SPEC, VOCAB, tokenizer=trained)
    with pytest.raises(ValueError, match="lacks the special tokens"):
        TinyModelRecipe(SPEC)


def test_a_job_file_is_imported_once_and_can_import_its_neighbours(tmp_path):
    (tmp_path / "job_rules.py").write_text("NAMES = ('solver',)\n")
    (tmp_path / "job_models.py").write_text(
        "from job_rules import NAMES\n"
        "from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, SPECIAL_TOKENS\n"
        "TINY_MODELS = {n: TinyModelRecipe(TinyModelSpec(n, 64, 1, 2, 1, 64), SPECIAL_TOKENS) for n in NAMES}\n")
    path = str(tmp_path / "job_models.py")
    assert import_job(path) is import_job(path)
    assert list(job_recipes(path)) == ["solver"]
    assert job_recipes("flexmarl.controller.tasks.digit_chain").keys() == {"planner", "solver", "checker"}


def test_a_missing_job_file_or_a_job_without_recipes_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="job file 'nowhere/models.py' does not exist"):
        import_job("nowhere/models.py")
    (tmp_path / "empty_job.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="has no TINY_MODELS table"):
        job_recipes(str(tmp_path / "empty_job.py"))
