"""The distillation example's model recipes: what each warm-up teaches (no model is built)."""

import json
from pathlib import Path

from flexmarl.controller.tasks.digit_chain import AGENTS, PLANNER, expected_plan, planner_prompt
from flexmarl.runtime.model_specs import import_job

ROOT = Path(__file__).resolve().parents[2]
models = import_job(str(ROOT / "examples" / "distill" / "models.py"))


def share_right(recipe) -> float:
    examples = recipe.warmup()
    right = [t == w for prompt, target in examples for t, w in zip(target, expected_plan(prompt[2:-1]))]
    return sum(right) / len(right)


def test_the_longer_sorts_recipes_warm_up_on_five_digits_right_or_half_right():
    teacher, student = models.TINY_MODELS["long_teacher"], models.TINY_MODELS["long_student"]
    for recipe in (teacher, student):
        prompt, target = recipe.warmup()[0]
        assert prompt == planner_prompt(prompt[2:-1]) and len(prompt[2:-1]) == len(target) == 5
    assert share_right(teacher) == 1.0
    assert 0.5 < share_right(student) < 0.6  # half right, the rest a random digit (right one time in ten)
    assert student.spec.hidden_size == AGENTS[PLANNER].hidden_size and student.cache_key() != teacher.cache_key()


def test_the_weak_student_is_the_planners_shape_warmed_up_on_a_quarter_right():
    weak = models.TINY_MODELS["weak_student"]
    assert len(weak.warmup()[0][1]) == 3 and 0.25 < share_right(weak) < 0.35
    assert (weak.spec.hidden_size, weak.spec.num_layers) == (AGENTS[PLANNER].hidden_size, AGENTS[PLANNER].num_layers)


def test_the_longer_sorts_held_out_queries_are_five_digits():
    rows = [json.loads(line) for line in (ROOT / "examples" / "distill" / "eval_long.jsonl").read_text().splitlines()]
    assert len(rows) == 64 and all(len(r["digits"]) == 5 and all(0 <= d <= 9 for d in r["digits"]) for r in rows)
