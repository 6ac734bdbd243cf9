"""The distillation job's teacher: a larger model than the digit chain's planner (the
student, `tiny:planner`), warmed up on the same sorting task with cleaner targets, over the
same vocabulary (so the two share one tokenizer, as a teacher and its student must). The
job trains it with RL first (examples/distill_teacher.toml); its checkpoint is then the
frozen teacher of examples/distill.toml.

Three teachers of the same size, differing in their warm-up: `teacher` on targets right 70%
of the time, `strong_teacher` on targets right 95% of the time, `clean_teacher` on right
targets only and for longer (1,000 steps): a teacher much better at the task than RL makes
the student within the distillation bench's horizon."""

from __future__ import annotations

import functools
import random

from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, VOCAB, expected_plan, make_query, planner_prompt
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule

TEACHER = TinyModelSpec("sort_teacher", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, seed=21)
CORRECT_PROB = 0.7  # each warm-up target token right with this probability, else a random digit
STRONG_CORRECT_PROB = 0.95


def _warmup(n: int = 4096, correct: float = CORRECT_PROB, name: str = "warmup-sort-teacher") -> list:
    rng = random.Random(name)
    examples = []
    for _ in range(n):
        query = make_query(rng)
        target = [t if rng.random() < correct else rng.choice(DIGIT_IDS) for t in expected_plan(query)]
        examples.append((planner_prompt(query), target))
    return examples


SCHEDULE = WarmupSchedule(steps=300, batch_size=64, lr=3e-3)
TINY_MODELS = {
    "teacher": TinyModelRecipe(TEACHER, VOCAB, functools.partial(_warmup), "sort-teacher-1", SCHEDULE),
    "strong_teacher": TinyModelRecipe(
        TEACHER, VOCAB, functools.partial(_warmup, correct=STRONG_CORRECT_PROB, name="warmup-strong-sort-teacher"),
        "strong-sort-teacher-1", SCHEDULE),
    "clean_teacher": TinyModelRecipe(
        TEACHER, VOCAB, functools.partial(_warmup, correct=1.0, name="warmup-clean-sort-teacher"),
        "clean-sort-teacher-1", WarmupSchedule(steps=1000, batch_size=64, lr=3e-3)),
}
