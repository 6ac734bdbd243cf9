"""The distillation job's teacher: a larger model than the digit chain's planner (the
student, `tiny:planner`), warmed up on the same sorting task with cleaner targets, over the
same vocabulary (so the two share one tokenizer, as a teacher and its student must). The
job trains it with RL first (examples/distill_teacher.toml); its checkpoint is then the
frozen teacher of examples/distill.toml."""

from __future__ import annotations

import functools
import random

from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, VOCAB, expected_plan, make_query, planner_prompt
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule

TEACHER = TinyModelSpec("sort_teacher", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, seed=21)
CORRECT_PROB = 0.7  # each warm-up target token right with this probability, else a random digit


def _warmup(n: int = 4096) -> list:
    rng = random.Random("warmup-sort-teacher")
    examples = []
    for _ in range(n):
        query = make_query(rng)
        target = [t if rng.random() < CORRECT_PROB else rng.choice(DIGIT_IDS) for t in expected_plan(query)]
        examples.append((planner_prompt(query), target))
    return examples


TINY_MODELS = {
    "teacher": TinyModelRecipe(TEACHER, VOCAB, functools.partial(_warmup), "sort-teacher-1",
                               WarmupSchedule(steps=300, batch_size=64, lr=3e-3)),
}
