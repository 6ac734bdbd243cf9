"""The review-chain example job as a user wrote it: its data, its rules, and its workflow
driven over a scripted generator (no engine) with the job's own trained tokenizer."""

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl.controller.episodes.data import Dataset
from flexmarl.controller.episodes.tokens import AgentTokenizer
from flexmarl.controller.episodes.user_code import load_workflow
from flexmarl.controller.episodes.workflow import AgentDefaults, EpisodeContext, run_episode
from flexmarl.controller.state.groups import output_of
from flexmarl.controller.state.store import ExperienceStore
from flexmarl.runtime.config import load_config
from flexmarl.runtime.model_specs import import_job

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "review_chain"
task = import_job(str(JOB / "review_task.py"))
job_models = import_job(str(JOB / "models.py"))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Each agent's tokenizer as the controller loads it, saved from the job's recipe (no
    weights needed to tokenize)."""
    from flexmarl.workers.models import recipe_tokenizer

    loaded = {}
    for agent, recipe in job_models.TINY_MODELS.items():
        folder = tmp_path_factory.mktemp(agent)
        recipe_tokenizer(recipe).save_pretrained(folder)
        loaded[agent] = AgentTokenizer(agent, str(folder))
    return loaded


class ScriptedAgents:
    """Stands in for the rollout client: each agent replies with text a script picks from
    the conversation so far; replies end with EOS as a real engine's do."""

    def __init__(self, tokenizers, scripts):
        self.tokenizers, self.scripts = tokenizers, scripts
        self.contexts = []  # (agent, decoded context) of every request

    async def generate(self, agent, group, after=""):
        tok = self.tokenizers[agent]
        context = tok.tok.decode(group.prompt_ids, skip_special_tokens=False)
        self.contexts += [(agent, context)] * group.n
        replies = [tok.encode(self.scripts[agent](context, group.seed + j)) + [tok.eos_token_id] for j in range(group.n)]
        return output_of(replies, [[-0.5] * len(ids) for ids in replies], finish_reason="stop")


def make_ctx(store, generator, tokenizers, item):
    agents = {"solver": AgentDefaults(6, 1.0, 4), "verifier": AgentDefaults(10, 1.0, 2)}
    return EpisodeContext("e0", 0, random.Random(0), store, generator, agents, run_seed=3, item=item,
                          tokenizers=tokenizers)


async def play(tokenizers, scripts, item):
    store = ExperienceStore(["solver", "verifier"])
    generator = ScriptedAgents(tokenizers, scripts)
    episode = load_workflow(f"{JOB / 'workflow.py'}:episode")
    ctx = make_ctx(store, generator, tokenizers, item)
    assert await run_episode(episode, ctx, 10.0) == ""
    return {a: ctx.samples(a) for a in ("solver", "verifier")}, generator


ITEM = {"question": "What is 7 + 5?", "answer": "12"}


async def test_a_right_solver_and_an_honest_verifier_earn_full_rewards(tokenizers):
    scripts = {"solver": lambda context, seed: "12", "verifier": lambda context, seed: "It is 12, correct."}
    samples, generator = await play(tokenizers, scripts, ITEM)
    assert len(samples["solver"]) == 4 and len(samples["verifier"]) == 8
    assert all(s.reward == 1.0 for s in samples["solver"] + samples["verifier"])
    # The verifier saw the question and the solver's answer through its chat template.
    assert ("verifier", "<|user|>Question: What is 7 + 5? Answer: 12<eos><|assistant|>") in generator.contexts


async def test_the_solver_hears_the_review_and_its_revision_is_one_sample_trained_on_its_turns_only(tokenizers):
    scripts = {"solver": lambda context, seed: "12" if "wrong" in context else "13",
               "verifier": lambda context, seed: "It is 12, wrong."}
    samples, generator = await play(tokenizers, scripts, ITEM)
    revision_context = ("<|user|>What is 7 + 5?<eos><|assistant|>13<eos><|user|>It is 12, wrong.<eos>"
                        "<|assistant|>")
    assert ("solver", revision_context) in generator.contexts
    tok = tokenizers["solver"]
    for s in samples["solver"]:
        assert s.reward == 1 - task.FIRST_WEIGHT  # wrong first, right final
        assert s.versions == [0, 0] and s.text == "12"
        trained = [i for i, m in zip(s.output_ids.tolist(), s.mask) if m]
        masked = [i for i, m in zip(s.output_ids.tolist(), s.mask) if not m]
        assert tok.tok.decode(trained, skip_special_tokens=False) == "13<eos>12<eos>"
        assert tok.tok.decode(masked, skip_special_tokens=False) == "<|user|>It is 12, wrong.<eos><|assistant|>"
    assert all(v.reward == 1.0 for v in samples["verifier"])  # "wrong" about 13 is right


async def test_a_verifier_that_judges_wrongly_or_says_no_verdict_earns_nothing(tokenizers):
    replies = iter(["It is 12, wrong.", "It is 12"] * 8)
    scripts = {"solver": lambda context, seed: "12", "verifier": lambda context, seed: next(replies)}
    samples, _ = await play(tokenizers, scripts, ITEM)
    assert [v.reward for v in samples["verifier"]] == [0.0] * 8
    assert all(s.reward == 1.0 for s in samples["solver"])  # right twice, whatever it heard


def test_rewards_are_exact_about_the_answer_text():
    assert task.solver_reward(" 12", "12", "12") == 1.0
    assert task.solver_reward("12", "12 13", "12") == task.FIRST_WEIGHT
    assert task.verifier_reward("It is 11, wrong.", "13", "12") == 1.0
    assert task.verifier_reward("It is 13, correct.", "13", "12") == 0.0
    assert task.verdict_of("It is 12, correct. wrong") == "wrong"
    assert task.verdict_of("It is 12, incorrect.") is None
    assert all(task.near_miss(t, random.Random(t)) not in (t, -1) for t in range(19) for _ in range(5))


def test_the_held_out_rows_are_not_trained_and_the_data_script_writes_the_committed_files(tmp_path):
    train = [json.loads(line) for line in (JOB / "data" / "train.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (JOB / "data" / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held_out)) == (80, 20)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert all(str(sum(task.terms(r["question"]))) == r["answer"] for r in train + held_out)
    before = {p.name: p.read_bytes() for p in (JOB / "data").iterdir()}
    subprocess.run([sys.executable, str(JOB / "make_data.py")], check=True, capture_output=True, cwd=tmp_path)
    assert {p.name: p.read_bytes() for p in (JOB / "data").iterdir()} == before
    assert Dataset.from_path(JOB / "data" / "train.jsonl", seed=0).item(0).keys() == {"question", "answer"}


def test_the_jobs_config_loads_and_names_the_jobs_models_workflow_and_data():
    cfg = load_config(ROOT / "examples" / "review_chain.toml")
    assert cfg.run.workflow == f"{JOB.resolve()}/workflow.py:episode"
    assert {a: c.model for a, c in cfg.agents.items()} == {
        a: f"tiny:{JOB.resolve()}/models.py:{a}" for a in ("solver", "verifier")}
    assert all(not c.ignore_eos for c in cfg.agents.values())  # outputs end at EOS
    assert Path(cfg.data.train).is_file() and Path(cfg.data.eval).is_file()
    assert cfg.eval.every > 0


def test_the_jobs_tokenizer_is_trained_on_its_own_text_and_keeps_every_number_one_token(tokenizers):
    tok = tokenizers["solver"]
    for n in range(19):
        assert len(tok.encode(str(n))) == 1
    assert tok.chat_prompt([{"role": "user", "content": "What is 7 + 5?"}])[-1] == \
        tok.tok.convert_tokens_to_ids("<|assistant|>")
    assert job_models.TINY_MODELS["solver"].cache_key() != job_models.TINY_MODELS["verifier"].cache_key()


def test_the_command_line_runs_the_jobs_own_agents_and_not_the_embedded_defaults_too():
    from flexmarl.controller import cli

    cfg = cli._config_from_args(argparse.Namespace(config=str(ROOT / "examples" / "review_chain.toml"), steps=2, set=None))
    assert set(cfg.agents) == {"solver", "verifier"}
    assert cfg.agents["solver"].max_tokens == 6 and cfg.run.steps == 2
    assert set(cli._config_from_args(argparse.Namespace(config=None, set=None)).agents) == {"planner", "solver", "checker"}
