import os
import textwrap
from pathlib import Path

import pytest
import torch

from flexmarl.runtime.model_specs import (
    SPECIAL_TOKENS,
    TinyModelRecipe,
    TinyModelSpec,
    TrainedTokenizer,
    WarmupSchedule,
)
from flexmarl.workers import models

os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = TinyModelSpec("tiny", hidden_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, intermediate_size=64, seed=7)
QUICK = WarmupSchedule(steps=60, batch_size=16, lr=1e-2)
# A vocabulary of no built-in job: the builder takes whatever it is handed. The special
# tokens are deliberately not first.
LETTERS = tuple("abcdefghij")
VOCAB = ("<copy>",) + SPECIAL_TOKENS + LETTERS + ("<then>",)
ID = {t: i for i, t in enumerate(VOCAB)}


def copy_task(n: int = 64):
    """Prompt: <bos> <copy> x <then>; target: x. Learnable in a few dozen steps."""
    return [([ID["<bos>"], ID["<copy>"], ID[x], ID["<then>"]], [ID[x]]) for x in LETTERS] * (n // 10)


def entries(cache: Path) -> list[str]:
    """What the cache holds besides its lock files: entries, and staging left behind."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def recipe(spec=TINY, warmup=copy_task, version="copy-1"):
    return TinyModelRecipe(spec, VOCAB, warmup, version, QUICK)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return models.build_model(TINY, VOCAB, tmp_path_factory.mktemp("tiny"), copy_task(), QUICK)


def test_tokenizer_round_trips_every_token_of_the_vocabulary_handed_in():
    tokenizer = models.build_tokenizer(VOCAB)
    text = " ".join(VOCAB)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == list(range(len(VOCAB)))
    assert tokenizer.decode(ids) == text
    assert tokenizer("h <then> b", add_special_tokens=False).input_ids == [ID["h"], ID["<then>"], ID["b"]]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (ID["<pad>"], ID["<eos>"])


def test_transformers_loads_the_built_directory_with_its_tokenizer(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(VOCAB) == len(tokenizer)
    assert (model.config.bos_token_id, model.config.pad_token_id) == (ID["<bos>"], ID["<pad>"])
    assert tokenizer.decode(tokenizer("<bos> c <eos>").input_ids) == "<bos> c <eos>"
    assert (built / "model.safetensors").exists()
    assert (built / "generation_config.json").exists()


def test_warm_up_teaches_the_model_its_targets(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built).eval()
    prompts = torch.tensor([p for p, _ in copy_task(10)])
    with torch.no_grad():
        predicted = model(input_ids=prompts).logits[:, -1].argmax(-1)
    assert predicted.tolist() == [ID[x] for x in LETTERS]


def test_ensure_model_builds_once_and_then_reuses_the_cached_directory(tmp_path):
    calls = []

    def examples():
        calls.append(1)
        return copy_task(10)

    first = models.ensure_model(recipe(warmup=examples), tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = models.ensure_model(recipe(warmup=examples), tmp_path)
    assert first == second and len(calls) == 1
    assert (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert entries(tmp_path) == [first.name]


def test_a_new_warmup_version_or_spec_gets_its_own_cache_entry(tmp_path):
    base = models.ensure_model(recipe(), tmp_path)
    other_version = models.ensure_model(recipe(version="copy-2"), tmp_path)
    other_seed = models.ensure_model(recipe(spec=TinyModelSpec(**{**TINY.__dict__, "seed": 8})), tmp_path)
    assert len({base, other_version, other_seed}) == 3


def test_a_build_that_crashes_leaves_no_cache_entry_behind(tmp_path):
    def crash():
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        models.ensure_model(recipe(warmup=crash), tmp_path)
    assert entries(tmp_path) == []
    # The next attempt builds normally.
    assert models.ensure_model(recipe(), tmp_path).is_dir()


JOB = """
import time
from pathlib import Path

from flexmarl.runtime.model_specs import SPECIAL_TOKENS, TinyModelRecipe, TinyModelSpec, WarmupSchedule

def examples():
    with open(Path(__file__).with_name("warmups.txt"), "a") as f:
        f.write("warm-up ran\\n")
    time.sleep(3)  # the other builder asks meanwhile
    return [([1, 4], [5])] * 8

TINY_MODELS = {"m": TinyModelRecipe(TinyModelSpec("m", 64, 1, 2, 1, 64, seed=3), SPECIAL_TOKENS + ("x", "y"),
                                    examples, "v1", WarmupSchedule(steps=2, batch_size=4))}
"""


def test_two_processes_asking_for_the_same_model_at_once_build_it_once(tmp_path):
    """Two builders (real processes, as two runs starting together start them): one builds
    while the other waits on the entry's lock, then finds it; the warm-up ran once."""
    import subprocess
    import sys

    (tmp_path / "job.py").write_text(JOB)
    command = [sys.executable, "-m", "flexmarl.workers.models", "--job", str(tmp_path / "job.py"), "--agent", "m",
               "--cache-root", str(tmp_path / "cache")]
    builders = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [b.communicate(timeout=600) for b in builders]
    assert [b.returncode for b in builders] == [0, 0], [err[-2000:] for _, err in outputs]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1 and Path(paths.pop()).is_dir()
    assert (tmp_path / "warmups.txt").read_text().count("warm-up ran") == 1
    assert len(entries(tmp_path / "cache")) == 1  # the entry, no staging left


def test_the_builder_defaults_to_the_machines_model_cache(tmp_path, monkeypatch, capsys):
    (tmp_path / "job.py").write_text(JOB.replace("time.sleep(3)", "pass"))
    monkeypatch.delenv("FLEXMARL_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.main(["--job", str(tmp_path / "job.py"), "--agent", "m"]) == 0
    built = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert built.parent == tmp_path / "xdg" / "flexmarl" / "models" and (built / "config.json").exists()


def test_a_spec_with_a_head_size_vllm_cpu_rejects_is_refused(tmp_path):
    odd = TinyModelSpec("odd", hidden_size=48, num_layers=1, num_heads=2,
                        num_kv_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="head size 24"):
        models.build_model(odd, VOCAB, tmp_path)


def test_warmup_without_a_version_is_refused():
    with pytest.raises(ValueError, match="warmup_version"):
        TinyModelRecipe(TINY, VOCAB, copy_task)


def test_the_command_line_builds_a_job_modules_model_then_finds_it_and_prints_its_directory(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "copy_job.py").write_text(textwrap.dedent(f"""
        from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec
        TINY_MODELS = {{"copier": TinyModelRecipe(TinyModelSpec("copier", hidden_size=64, num_layers=1,
            num_heads=2, num_kv_heads=1, intermediate_size=64), {VOCAB!r})}}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--job", "copy_job", "--agent", "copier", "--cache-root", str(tmp_path / "cache")]

    assert models.main(argv) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    assert path.parent == tmp_path / "cache" and path.name.startswith("copier-")
    assert (path / "config.json").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert models.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_command_line_names_the_agents_a_job_has(tmp_path, capsys):
    with pytest.raises(SystemExit):
        models.main(["--job", "flexmarl.controller.tasks.digit_chain", "--agent", "critic",
                     "--cache-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert "no built-in model for agent 'critic'" in err and "planner, solver, checker" in err
    assert list(tmp_path.iterdir()) == []


def test_a_job_module_without_tiny_models_is_named():
    with pytest.raises(ValueError, match="'flexmarl.controller.episodes.user_code' has no TINY_MODELS"):
        models.job_models("flexmarl.controller.episodes.user_code")


# ---- a recipe with the job's own trained tokenizer and chat template ------------------

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
JOB_TEXT = ["copy red", "red", "copy blue", "blue", "copy green", "green"]


def trained_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as bpe_models

    core = Tokenizer(bpe_models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(JOB_TEXT, trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<pad>", "<eos>", "<|user|>", "<|assistant|>"], show_progress=False))
    return TrainedTokenizer(core.to_str(), eos="<eos>", pad="<pad>", chat_template=CHAT)


def chat_copy_task(tokenizer):
    """Handed the built tokenizer: user says `copy W`, the assistant answers `W` and EOS."""
    examples = []
    for word in ("red", "blue", "green"):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"copy {word}"}],
                                               tokenize=False, add_generation_prompt=True)
        examples.append((tokenizer.encode(prompt, add_special_tokens=False),
                         tokenizer.encode(word, add_special_tokens=False) + [tokenizer.eos_token_id]))
    return examples * 8


@pytest.fixture(scope="module")
def chat_built(tmp_path_factory):
    recipe = TinyModelRecipe(TINY, warmup=chat_copy_task, warmup_version="chat-copy-1", schedule=QUICK,
                             tokenizer=trained_tokenizer())
    return models.ensure_model(recipe, tmp_path_factory.mktemp("chat"))


def test_a_trained_tokenizer_recipe_saves_a_tokenizer_transformers_loads_with_its_chat_template(chat_built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_built)
    model = AutoModelForCausalLM.from_pretrained(chat_built)
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id) == "<eos>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "copy red"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|user|>copy red<eos><|assistant|>"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|user|>"  # one token per special
    assert tokenizer.decode(ids, skip_special_tokens=True) == "copy red"


def test_the_warm_up_of_a_trained_tokenizer_recipe_is_handed_the_tokenizer_and_learns_eos(chat_built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_built)
    model = AutoModelForCausalLM.from_pretrained(chat_built).eval()
    for prompt, target in chat_copy_task(tokenizer)[:3]:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert out[0, len(prompt):].tolist() == target  # the word, then EOS, then nothing


def test_the_command_line_takes_a_job_file_path(tmp_path, capsys):
    job = tmp_path / "my_job" / "models.py"
    job.parent.mkdir()
    job.write_text(textwrap.dedent(f"""
        from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec
        TINY_MODELS = {{"copier": TinyModelRecipe(TinyModelSpec("copier", hidden_size=64, num_layers=1,
            num_heads=2, num_kv_heads=1, intermediate_size=64), {VOCAB!r})}}
    """))
    assert models.main(["--job", str(job), "--agent", "copier", "--cache-root", str(tmp_path / "cache")]) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    assert path.parent == tmp_path / "cache" and (path / "config.json").exists()
