"""The digit team: one small digit task per agent, over the digit chain's vocabulary.

Each agent reads the same three random digits and does its own job, scored per position:

    sorter    the digits sorted                        3 tokens
    expander  each digit x followed by (x + 1) % 10    6 tokens
    maxer     the largest digit of the expansion       1 token
    copier    the digits as they are                   3 tokens
    reverser  the digits in reverse order              3 tokens

`sorter`, `expander` and `maxer` are the digit chain's planner, solver and checker jobs
(the built-in whole models tiny:planner, tiny:solver and tiny:checker do them as well);
the base model of this job is warmed up on all five, with noisy targets, so that each
agent's adapter has its own task to learn. An agent's task is its name's first word
(`copier_b` copies too). Plain Python: no torch, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from flexmarl.controller.tasks.digit_chain import (
    ANSWER_ID,
    BOS_ID,
    DIGIT_IDS,
    QUERY_ID,
    checker_prompt,
    expected_answer,
    expected_plan,
    expected_verdict,
    planner_prompt,
    solver_prompt,
)

Tokens = list[int]


def _copy_prompt(query: Sequence[int]) -> Tokens:
    return [BOS_ID, QUERY_ID, *query, ANSWER_ID]


def _reverse_prompt(query: Sequence[int]) -> Tokens:
    return [BOS_ID, ANSWER_ID, *query, QUERY_ID]


# task -> (prompt of the query, the right output of the query)
TASKS: dict[str, tuple[Callable[[Tokens], Tokens], Callable[[Tokens], list[int | None]]]] = {
    "sorter": (planner_prompt, expected_plan),
    "expander": (solver_prompt, expected_answer),
    "maxer": (lambda q: checker_prompt(q, expected_answer(q)), lambda q: expected_verdict(expected_answer(q))),
    "copier": (_copy_prompt, list),
    "reverser": (_reverse_prompt, lambda q: list(reversed(q))),
}
OUTPUT_LEN = {"sorter": 3, "expander": 6, "maxer": 1, "copier": 3, "reverser": 3}


def task_of(agent: str) -> str:
    task = agent.split("_")[0]
    if task not in TASKS:
        raise ValueError(f"agent {agent!r}: its name must start with a task ({', '.join(TASKS)})")
    return task


def make_query(rng: random.Random) -> Tokens:
    return [DIGIT_IDS[rng.randrange(10)] for _ in range(3)]


def reward(task: str, query: Sequence[int], output: Sequence[int]) -> float:
    """The fraction of positions holding the right token."""
    expected = TASKS[task][1](list(query))
    if len(output) != len(expected):
        return 0.0
    return sum(e is not None and o == e for o, e in zip(output, expected)) / len(expected)


def warmup_examples(rng: random.Random, n: int, correct_prob: float) -> list[tuple[Tokens, Tokens]]:
    """n (prompt, noisy target) pairs, the tasks in turn: each target token right with
    probability `correct_prob`, else a random digit."""
    names = list(TASKS)
    examples = []
    for i in range(n):
        prompt, expected = TASKS[names[i % len(names)]]
        query = make_query(rng)
        target = [t if rng.random() < correct_prob else rng.choice(DIGIT_IDS) for t in expected(query)]
        examples.append((prompt(query), target))
    return examples
