"""The distillation job's teacher: a larger model than the digit chain's planner (the
student, `tiny:planner`), warmed up on the same sorting task with cleaner targets, over the
same vocabulary (so the two share one tokenizer, as a teacher and its student must). The
job trains it with RL first (examples/distill_teacher.toml); its checkpoint is then the
frozen teacher of examples/distill.toml.

Three teachers of the same size, differing in their warm-up: `teacher` on targets right 70%
of the time, `strong_teacher` on targets right 95% of the time, `clean_teacher` on right
targets only and for longer (1,000 steps): a teacher much better at the task than RL makes
the student within the distillation bench's horizon.

`weak_student` is a student of the planner's size and shape whose warm-up targets are right
25% of the time (the planner's: 50%): about one output in thirty is wholly right, so under
the all-or-nothing reward (`episode_exact`) most of its groups have no advantage at all and
RL alone has little to learn from, while the teacher still scores every token it writes.

`long_teacher` and `long_student` are the same two shapes for a longer sort, five digits
(`episode_long`, eval_long.jsonl): the teacher warmed up on right targets, the student on
targets right half the time, as the planner is for three."""

from __future__ import annotations

import dataclasses
import functools
import random

from flexmarl.controller.tasks.digit_chain import (AGENTS, DIGIT_IDS, PLANNER, VOCAB, expected_plan, make_query,
                                                   planner_prompt)
from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule

TEACHER = TinyModelSpec("sort_teacher", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=256, seed=21)
CORRECT_PROB = 0.7  # each warm-up target token right with this probability, else a random digit
STRONG_CORRECT_PROB = 0.95
WEAK_STUDENT = dataclasses.replace(AGENTS[PLANNER], name="weak_planner")
WEAK_CORRECT_PROB = 0.25
LONG_STUDENT = dataclasses.replace(AGENTS[PLANNER], name="long_planner")
LONG_DIGITS = 5


def _warmup(n: int = 4096, correct: float = CORRECT_PROB, name: str = "warmup-sort-teacher", digits: int = 3) -> list:
    rng = random.Random(name)
    examples = []
    for _ in range(n):
        query = make_query(rng) if digits == 3 else [DIGIT_IDS[rng.randrange(10)] for _ in range(digits)]
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
    "weak_student": TinyModelRecipe(
        WEAK_STUDENT, VOCAB, functools.partial(_warmup, correct=WEAK_CORRECT_PROB, name="warmup-weak-student"),
        "weak-student-1", SCHEDULE),
    "long_teacher": TinyModelRecipe(
        TEACHER, VOCAB, functools.partial(_warmup, correct=1.0, name="warmup-long-sort-teacher", digits=LONG_DIGITS),
        "long-sort-teacher-1", WarmupSchedule(steps=600, batch_size=64, lr=3e-3)),
    "long_student": TinyModelRecipe(
        LONG_STUDENT, VOCAB, functools.partial(_warmup, correct=0.5, name="warmup-long-student", digits=LONG_DIGITS),
        "long-student-1", SCHEDULE),
}
