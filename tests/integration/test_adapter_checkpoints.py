"""A finished run of adapter agents and a whole-model agent (`flexmarl run`, real
processes), its model cache deleted afterwards: its adapters load with PEFT from any
working directory (they name the base the run kept, RUN_DIR/bases/NAME) and from a copy of
the run elsewhere, and `flexmarl serve` of a copy serves every agent, adapters and the
whole model together, to a plain `openai` client, building nothing."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEAM = ROOT / "examples" / "digit_team"

# Untrained tiny models over the digit chain's words: built in seconds.
MODELS = '''
from flexmarl.controller.tasks.digit_chain import VOCAB
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec

TINY_MODELS = {
    "base": TinyModelRecipe(TinyModelSpec("served_base", 64, 1, 2, 1, 128, seed=1), VOCAB),
    "whole": TinyModelRecipe(TinyModelSpec("served_whole", 64, 1, 2, 1, 128, seed=2), VOCAB),
}
'''

JOB = f'''
[run]
workflow = "{TEAM / 'workflow.py'}:episode"
steps = 1
progress = false
[cluster]
rollout_workers = 2
trainer_workers = 1
[pipeline]
queries_per_step = 2
[bases.team]
model = "tiny:models.py:base"
[agents.sorter]
base = "team"
group_size = 2
max_tokens = 3
ignore_eos = true
[agents.copier]
base = "team"
group_size = 2
max_tokens = 3
ignore_eos = true
[agents.maxer]
model = "tiny:models.py:whole"
group_size = 2
max_tokens = 1
ignore_eos = true
'''
PROMPTS = {"sorter": "<bos> <query> 3 1 2 <plan>", "copier": "<bos> <query> 3 1 2 <answer>",
           "maxer": "<bos> <plan> 1 2 3 <answer> 1 2 2 3 3 4 <check>"}


def flexmarl(*args, cache: Path, cwd: Path = ROOT) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", FLEXMARL_MODEL_CACHE=str(cache))
    return subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The run, finished, with the model cache it built its models into deleted."""
    folder = tmp_path_factory.mktemp("adapters")
    (folder / "models.py").write_text(MODELS)
    (folder / "job.toml").write_text(JOB)
    proc = flexmarl("run", str(folder / "job.toml"), "--out", str(folder / "run"), cache=folder / "cache")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    shutil.rmtree(folder / "cache")
    return folder / "run"


def test_adapters_load_with_peft_after_the_cache_is_gone_from_anywhere_and_from_a_copy(finished_run, tmp_path,
                                                                                      monkeypatch):
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    final = finished_run / "checkpoints" / "final"
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    monkeypatch.chdir(tmp_path)  # another working directory
    logits = {}
    for agent in ("sorter", "copier"):
        model = AutoPeftModelForCausalLM.from_pretrained(final / agent)
        assert model.peft_config["default"].base_model_name_or_path == str(finished_run / "bases" / "team")
        logits[agent] = model(input_ids=ids).logits

    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    for agent in ("sorter", "copier"):
        base = AutoModelForCausalLM.from_pretrained(copy / "bases" / "team")
        model = PeftModel.from_pretrained(base, copy / "checkpoints" / "final" / agent)
        assert torch.equal(model(input_ids=ids).logits, logits[agent])
    _, loading = AutoModelForCausalLM.from_pretrained(copy / "checkpoints" / "final" / "maxer",
                                                      output_loading_info=True)
    assert not any(loading.values()), loading  # every weight from the checkpoint: none missing, left over or bad


def test_flexmarl_serve_serves_adapter_and_whole_model_agents_of_a_copied_run_to_a_plain_openai_client(
        finished_run, tmp_path):
    import openai

    copy = tmp_path / "copied" / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    proc = flexmarl("serve", str(copy), "--log-level", "WARNING", cache=tmp_path / "empty-cache", cwd=tmp_path)
    try:
        line = ""
        deadline = time.monotonic() + 600
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "serving sorter, copier, maxer (step 1 of" in line, (
            proc.stderr.read()[-3000:] if proc.poll() is not None else line)
        client = openai.OpenAI(base_url=line.rsplit(" at ", 1)[1].strip(), api_key="anything", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["copier", "maxer", "sorter"]
        for agent, prompt in PROMPTS.items():
            answer = client.completions.create(model=agent, prompt=prompt, max_tokens=3, n=2)
            assert len(answer.choices) == 2 and all(c.text.strip() for c in answer.choices), agent
    finally:
        proc.send_signal(2)  # Ctrl-C: the workers are shut down
        proc.wait(timeout=120)
    assert proc.returncode == 0
    assert not (tmp_path / "empty-cache").exists()  # nothing was built: the base is the run's own
    logs = "".join(p.read_text() for p in (copy / "serve-logs").glob("*.log"))
    assert "Triton" not in logs and "adapter" in logs


@pytest.mark.slow
def test_the_review_teams_adapters_are_served_to_chat_clients_after_a_short_run(tmp_path):
    """The multi-turn adapter team (examples/review_team.toml), two steps, then served: each
    agent answers a chat turn of its own kind through the plain `openai` client."""
    import openai

    cache = Path(os.environ.get("FLEXMARL_MODEL_CACHE") or tmp_path / "cache")
    proc = flexmarl("run", str(ROOT / "examples" / "review_team.toml"), "--steps", "2", "--out", str(tmp_path / "run"),
                    "--no-progress", "--set", "eval.every=0", cache=cache)
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-4000:]
    server = flexmarl("serve", str(tmp_path / "run"), "--log-level", "WARNING", cache=cache)
    try:
        line = ""
        deadline = time.monotonic() + 600
        while "serving" not in line and time.monotonic() < deadline and server.poll() is None:
            line = server.stdout.readline()
        assert "serving drafter, critic, reviser (step 2 of" in line, line
        client = openai.OpenAI(base_url=line.rsplit(" at ", 1)[1].strip(), api_key="anything", max_retries=0)
        turns = {"drafter": [{"role": "user", "content": "What is 3 + 4?"}],
                 "critic": [{"role": "user", "content": "Question: What is 3 + 4? Answer: 8"}],
                 "reviser": [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "8"},
                             {"role": "user", "content": "It is 7, wrong."}]}
        said = {agent: client.chat.completions.create(model=agent, messages=messages, max_tokens=10,
                                                      temperature=0).choices[0].message.content
                for agent, messages in turns.items()}
        assert said["drafter"].strip().isdigit() and said["reviser"].strip().isdigit(), said
        assert said["critic"].startswith("It is "), said
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    assert server.returncode == 0
