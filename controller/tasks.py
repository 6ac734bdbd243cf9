"""The embedded default task, "digit chain": three agents of different sizes in a chain.

A query is three random digits. The chain, one agent's output the next one's input:

    planner (small)   reads the query,               writes 3 tokens: the digits sorted
    solver  (large)   reads the planner's plan,      writes 6 tokens: each plan digit x
                                                     followed by (x + 1) % 10
    checker (medium)  reads the plan and the answer, writes 1 token: how many of the three
                                                     (x, x + 1) pairs the solver got right

Every reward is in [0, 1] and checked exactly against the agent's own input, so each agent
is judged on its own job even when the agent before it erred. The checker reports a count
rather than yes/no because while the chain is still poor almost no answer is fully right,
and "always no" would score well without checking anything.

Warm-up examples carry deliberately noisy targets: each target token is right with
probability WARMUP_CORRECT_PROB, otherwise random. A model fitted to them puts its largest
probability on the right token, yet sampling at temperature 1 is often wrong, which leaves
room for policy-gradient RL to raise the reward visibly within minutes.

Plain functions over token-id lists; this module does no I/O and knows nothing about
engines, workers or how the controller schedules the chain.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from flexmarl.workers.models import (
    ANSWER_ID,
    BOS_ID,
    CHECK_ID,
    DIGIT_IDS,
    PLAN_ID,
    QUERY_ID,
    TinyModelSpec,
    digit_of,
)

PLANNER, SOLVER, CHECKER = "planner", "solver", "checker"

# Deliberately different sizes: the skew the load balancer and allocator must absorb.
AGENTS: dict[str, TinyModelSpec] = {
    PLANNER: TinyModelSpec(PLANNER, hidden_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=2, intermediate_size=128, seed=1),
    SOLVER: TinyModelSpec(SOLVER, hidden_size=128, num_layers=4, num_heads=4,
                          num_kv_heads=2, intermediate_size=256, seed=2),
    CHECKER: TinyModelSpec(CHECKER, hidden_size=96, num_layers=2, num_heads=3,
                           num_kv_heads=3, intermediate_size=192, seed=3),
}
# Tokens each agent writes; sampled with ignore_eos so every output has exactly this length.
OUTPUT_LEN: dict[str, int] = {PLANNER: 3, SOLVER: 6, CHECKER: 1}
QUERY_LEN = 3

WARMUP_CORRECT_PROB = 0.5
# Names what warmup_examples produces; part of the model cache key, so bump it whenever
# the prompts, targets or noise change.
WARMUP_VERSION = "digit-chain-1"

Tokens = list[int]


def make_query(rng: random.Random) -> Tokens:
    """Three random digit tokens."""
    return [DIGIT_IDS[rng.randrange(10)] for _ in range(QUERY_LEN)]


# ---- prompts -------------------------------------------------------------------------


def planner_prompt(query: Sequence[int]) -> Tokens:
    return [BOS_ID, QUERY_ID, *query, PLAN_ID]


def solver_prompt(plan: Sequence[int]) -> Tokens:
    return [BOS_ID, PLAN_ID, *plan, ANSWER_ID]


def checker_prompt(plan: Sequence[int], answer: Sequence[int]) -> Tokens:
    return [BOS_ID, PLAN_ID, *plan, ANSWER_ID, *answer, CHECK_ID]


# ---- the right outputs ---------------------------------------------------------------


def expected_plan(query: Sequence[int]) -> Tokens:
    return sorted(query, key=digit_of)


def expected_answer(plan: Sequence[int]) -> list[int | None]:
    """Per position the right answer token; None where the plan token is not a digit,
    because such a token has no right expansion."""
    out: list[int | None] = []
    for token in plan:
        digit = digit_of(token)
        if digit is None:
            out += [None, None]
        else:
            out += [DIGIT_IDS[digit], DIGIT_IDS[(digit + 1) % 10]]
    return out


def correct_pairs(plan: Sequence[int], answer: Sequence[int]) -> int:
    """How many (x, x + 1) pairs of the answer are right for the plan."""
    expected = expected_answer(plan)
    return sum(
        expected[i] is not None and answer[i] == expected[i] and answer[i + 1] == expected[i + 1]
        for i in range(0, 2 * len(plan), 2)
    )


def expected_verdict(plan: Sequence[int], answer: Sequence[int]) -> Tokens:
    return [DIGIT_IDS[correct_pairs(plan, answer)]]


# ---- rewards -------------------------------------------------------------------------


def _fraction_equal(output: Sequence[int], expected: Sequence[int | None]) -> float:
    if len(output) != len(expected):
        return 0.0
    return sum(o == e for o, e in zip(output, expected)) / len(expected)


def planner_reward(query: Sequence[int], plan: Sequence[int]) -> float:
    """Fraction of plan positions holding the right sorted digit."""
    return _fraction_equal(plan, expected_plan(query))


def solver_reward(plan: Sequence[int], answer: Sequence[int]) -> float:
    """Fraction of answer positions right for the plan the solver was given."""
    return _fraction_equal(answer, expected_answer(plan))


def checker_reward(plan: Sequence[int], answer: Sequence[int], verdict: Sequence[int]) -> float:
    """1 if the checker counted the right pairs exactly, else 0."""
    return float(list(verdict) == expected_verdict(plan, answer))


# ---- warm-up -------------------------------------------------------------------------


def _noisy(target: Sequence[int], rng: random.Random, choices: Sequence[int]) -> Tokens:
    return [t if rng.random() < WARMUP_CORRECT_PROB else rng.choice(choices) for t in target]


def _corrupted_answer(plan: Sequence[int], rng: random.Random) -> Tokens:
    """A solver-like answer: right tokens mixed with random digits at a random error rate,
    so the checker sees every pair count from 0 to 3 during warm-up."""
    error_rate = rng.random()
    return [
        t if t is not None and rng.random() >= error_rate else rng.choice(DIGIT_IDS)
        for t in expected_answer(plan)
    ]


def warmup_examples(agent: str, rng: random.Random, n: int) -> list[tuple[Tokens, Tokens]]:
    """n (prompt_ids, noisy target_ids) pairs for agent's supervised warm-up.

    Solver and checker inputs are random, not produced by the chain, so each agent learns
    its job for any input the agent before it may write.
    """
    examples = []
    for _ in range(n):
        if agent == PLANNER:
            query = make_query(rng)
            examples.append((planner_prompt(query), _noisy(expected_plan(query), rng, DIGIT_IDS)))
        elif agent == SOLVER:
            plan = make_query(rng)
            examples.append((solver_prompt(plan), _noisy(expected_answer(plan), rng, DIGIT_IDS)))
        elif agent == CHECKER:
            plan = make_query(rng)
            answer = _corrupted_answer(plan, rng)
            examples.append((
                checker_prompt(plan, answer),
                _noisy(expected_verdict(plan, answer), rng, DIGIT_IDS[:4]),
            ))
        else:
            raise ValueError(f"unknown agent {agent!r}; the digit chain has {list(AGENTS)}")
    return examples
