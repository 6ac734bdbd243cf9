import random
import subprocess
import sys

import pytest

from flexmarl.controller.episodes.user_code import load_workflow
from flexmarl.controller.tasks import digit_chain
from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, PAD_ID, default_config, digit_of
from flexmarl.runtime.config import load_config
from flexmarl.runtime.model_specs import VLLM_CPU_HEAD_SIZES


def digits(*values: int) -> list[int]:
    return [DIGIT_IDS[v] for v in values]


def test_token_id_constants_name_the_right_tokens():
    assert digit_chain.VOCAB[PAD_ID] == "<pad>"
    assert [digit_of(i) for i in DIGIT_IDS] == list(range(10))
    assert digit_of(digit_chain.EOS_ID) is None


def test_every_agent_has_a_tiny_model_recipe_over_the_job_vocabulary_with_its_warmup():
    recipes = digit_chain.TINY_MODELS
    assert list(recipes) == list(digit_chain.AGENTS)
    for agent, recipe in recipes.items():
        assert recipe.spec == digit_chain.AGENTS[agent] and recipe.vocab == digit_chain.VOCAB
        assert recipe.warmup_version == digit_chain.WARMUP_VERSION
        assert recipe.schedule == digit_chain.WARMUP_SCHEDULE
    # the warm-up is seeded by the agent's name: every builder makes the same examples
    examples = recipes[digit_chain.CHECKER].warmup()
    assert len(examples) == digit_chain.WARMUP_EXAMPLES
    assert examples == digit_chain.warmup_examples(digit_chain.CHECKER, random.Random("warmup-checker"),
                                                   digit_chain.WARMUP_EXAMPLES)


def test_the_job_and_model_resolution_import_neither_torch_nor_the_workers():
    check = ("import sys; import flexmarl.controller.tasks.digit_chain, flexmarl.controller.run.model_resolution, "
             "flexmarl.controller.episodes.user_code, flexmarl.runtime.model_specs; "
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch loaded'; "
             "bad = [m for m in sys.modules if m.startswith('flexmarl.workers')]; assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_planner_is_rewarded_for_each_position_of_the_sorted_query():
    query = digits(7, 2, 5)
    assert digit_chain.planner_reward(query, digits(2, 5, 7)) == 1.0
    assert digit_chain.planner_reward(query, digits(2, 7, 5)) == pytest.approx(1 / 3)
    assert digit_chain.planner_reward(query, digits(7, 2, 5)) == 0.0
    assert digit_chain.planner_reward(query, digits(2, 5)) == 0.0  # wrong length earns nothing


def test_solver_is_rewarded_for_each_position_of_the_expanded_plan_with_wraparound():
    plan = digits(3, 9, 9)
    assert digit_chain.solver_reward(plan, digits(3, 4, 9, 0, 9, 0)) == 1.0
    assert digit_chain.solver_reward(plan, digits(3, 4, 9, 9, 9, 9)) == pytest.approx(4 / 6)
    assert digit_chain.solver_reward(plan, digits(0, 0, 0, 0, 0, 0)) == pytest.approx(2 / 6)


def test_a_non_digit_plan_token_earns_the_solver_nothing_for_its_pair():
    plan = [DIGIT_IDS[1], PAD_ID, DIGIT_IDS[5]]
    assert digit_chain.solver_reward(plan, [DIGIT_IDS[1], DIGIT_IDS[2], PAD_ID, PAD_ID,
                                      DIGIT_IDS[5], DIGIT_IDS[6]]) == pytest.approx(4 / 6)


def test_checker_is_rewarded_for_naming_the_largest_digit_of_the_answer_it_read():
    plan = digits(1, 2, 3)
    wrong_answer = digits(1, 2, 8, 3, 3, 4)
    assert digit_chain.checker_reward(plan, wrong_answer, digits(8)) == 1.0
    assert digit_chain.checker_reward(plan, wrong_answer, digits(4)) == 0.0
    assert digit_chain.checker_reward(plan, digits(1, 2, 2, 3, 3, 4), digits(4)) == 1.0


def test_every_reward_of_random_outputs_lies_in_zero_to_one():
    rng = random.Random(0)
    for _ in range(200):
        query = digit_chain.make_query(rng)
        plan = [rng.randrange(20) for _ in range(3)]
        answer = [rng.randrange(20) for _ in range(6)]
        verdict = [rng.randrange(20)]
        for reward in (digit_chain.planner_reward(query, plan), digit_chain.solver_reward(plan, answer),
                       digit_chain.checker_reward(plan, answer, verdict)):
            assert 0.0 <= reward <= 1.0


def test_agents_differ_in_size_and_output_length_and_fit_vllm_cpu_attention():
    specs = digit_chain.AGENTS.values()
    assert len({(s.hidden_size, s.num_layers) for s in specs}) == len(digit_chain.AGENTS)
    assert len(set(digit_chain.OUTPUT_LEN.values())) == len(digit_chain.AGENTS)
    assert all(s.head_dim in VLLM_CPU_HEAD_SIZES for s in specs)
    longest = len(digit_chain.checker_prompt(digits(1, 2, 3), digits(1, 2, 2, 3, 3, 4))) + 1
    assert all(longest <= s.max_position_embeddings for s in specs)


@pytest.mark.parametrize("agent", list(digit_chain.AGENTS))
def test_warmup_examples_have_fixed_prompt_and_target_lengths_of_digit_targets(agent):
    examples = digit_chain.warmup_examples(agent, random.Random(1), 300)
    assert len(examples) == 300
    assert len({len(prompt) for prompt, _ in examples}) == 1
    assert all(len(target) == digit_chain.OUTPUT_LEN[agent] for _, target in examples)
    assert all(digit_of(t) is not None for _, target in examples for t in target)


def test_warmup_targets_are_right_about_half_the_time():
    examples = digit_chain.warmup_examples(digit_chain.SOLVER, random.Random(2), 2000)
    right = sum(
        t == e for prompt, target in examples
        for t, e in zip(target, digit_chain.expected_answer(prompt[2:5]))
    )
    # Right with probability 0.5, plus the 1-in-10 chance a random digit is right anyway.
    assert right / (2000 * 6) == pytest.approx(0.55, abs=0.02)


def test_warmup_examples_are_reproducible_from_the_seed():
    assert digit_chain.warmup_examples(digit_chain.CHECKER, random.Random(3), 50) == \
        digit_chain.warmup_examples(digit_chain.CHECKER, random.Random(3), 50)


def test_warmup_examples_for_an_unknown_agent_are_refused():
    with pytest.raises(ValueError, match="unknown agent"):
        digit_chain.warmup_examples("critic", random.Random(0), 1)


def test_example_preset_is_the_embedded_default():
    assert load_config("examples/default.toml") == load_config(None, defaults=default_config())


def test_the_built_in_digit_chain_workflow_is_the_job_module_episode():
    assert load_workflow("digit_chain") is digit_chain.episode
