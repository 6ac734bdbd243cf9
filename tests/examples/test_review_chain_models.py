"""The review chain's tiny models, built for real from the job's recipes the way a run
builds them (resolve_model, the builder child process, the shared cache): transformers and
vLLM load them, the chat template works, and the warm-up leaves RL room to improve."""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from flexmarl.controller.run.model_resolution import resolve_model  # noqa: E402
from flexmarl.runtime.model_specs import import_job  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "review_chain"


@pytest.fixture(scope="module")
def model_dirs():
    torch.set_num_threads(1)
    cwd = os.getcwd()
    os.chdir(ROOT)  # the config's paths, like a run's, are relative to the repository root
    try:
        return {agent: resolve_model(f"tiny:examples/review_chain/models.py:{agent}")
                for agent in ("solver", "verifier")}
    finally:
        os.chdir(cwd)


def test_transformers_loads_each_model_with_its_chat_template(model_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for agent, folder in model_dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.vocab_size == len(tokenizer)
        assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<eos>")
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered == "<|user|>What is 2 + 3?<eos><|assistant|>", agent


def test_the_warm_up_leaves_greedy_policies_good_and_sampled_ones_room_to_improve(model_dirs):
    measure = import_job(str(JOB / "measure_warmup.py"))
    task = import_job(str(JOB / "review_task.py"))
    torch.manual_seed(0)
    solver, verifier = measure.Agent(model_dirs["solver"]), measure.Agent(model_dirs["verifier"])
    rows = task.read_rows(task.EVAL_FILE)

    def mean_rewards(temperature, repeats):
        results = [measure.play(solver, verifier, row, temperature) for row in rows for _ in range(repeats)]
        return [sum(r[i] for r in results) / len(results) for i in (0, 1)]

    greedy, sampled = mean_rewards(0.0, 1), mean_rewards(1.0, 3)
    assert min(greedy) >= 0.8, greedy
    assert sampled[0] <= 0.75 and sampled[1] <= 0.9, sampled  # RL's room


def test_vllm_loads_each_model_and_answers_a_chat_prompt(model_dirs):
    from transformers import AutoTokenizer

    from flexmarl.workers.rollout.engine import VllmEngine

    asked = {"solver": ("What is 4 + 4?", "8"),
             "verifier": ("Question: What is 4 + 4? Answer: 9", "It is 8, wrong.")}
    for agent, (content, expected) in asked.items():
        tokenizer = AutoTokenizer.from_pretrained(model_dirs[agent])
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                               add_generation_prompt=True)
        engine = VllmEngine(model_dirs[agent], seed=0, max_model_len=64)
        try:
            engine.add("q", tokenizer.encode(prompt, add_special_tokens=False), 10, 0.0, 0)
            done = []
            while engine.has_unfinished():
                done += engine.step()
        finally:
            engine.close()
        (completion,) = done
        ids = completion.token_ids
        # Up to the EOS the model wrote (an engine that ignores EOS writes on past it).
        reply = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
        assert tokenizer.decode(reply) == expected, agent
