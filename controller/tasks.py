"""The embedded default task, "digit chain": three agents of different sizes in a chain.

A query is three random digits. Each agent reads what the agents before it wrote:

    planner (small)   reads the query,                writes 3 tokens: the digits sorted
    solver  (large)   reads the planner's plan,       writes 6 tokens: each plan digit x
                                                      followed by (x + 1) % 10
    checker (medium)  reads the plan and the answer,  writes 1 token: the answer's largest
                                                      digit, the chain's final result

Every reward is in [0, 1] and checked exactly against the agent's own input, so each agent
is judged on its own job even when an agent before it erred.

Why the checker reports the largest digit instead of judging the answer right or wrong:
the tiny models cannot learn to compare two digits for equality within the warm-up budget
(a 2-layer d=96 model stays at chance after 2000 steps on clean labels, whether it counts
right pairs, judges the whole answer or only its first token), while copying, successor
and order statistics (sorting, maximum) are learned in a few hundred steps. A yes/no
verdict would also be rewarded for answering "no" to everything while the chain is poor.

Warm-up examples carry deliberately noisy targets: each target token is right with
probability WARMUP_CORRECT_PROB, otherwise a random digit. A model fitted to them puts its
largest probability on the right token, yet sampling at temperature 1 is often wrong, which
leaves room for policy-gradient RL to raise the reward visibly within minutes.

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
    WarmupSchedule,
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
WARMUP_EXAMPLES = 4096
WARMUP_SCHEDULE = WarmupSchedule(steps=300, batch_size=64, lr=3e-3)
# Names what warmup_examples produces; part of the model cache key, so bump it whenever
# the prompts, targets, noise or vocabulary change.
WARMUP_VERSION = "digit-chain-2"

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


def expected_plan(query: Sequence[int]) -> list[int | None]:
    """The query's digits sorted; None everywhere if the query holds a non-digit."""
    digits = [digit_of(t) for t in query]
    if None in digits:
        return [None] * len(query)
    return [DIGIT_IDS[d] for d in sorted(digits)]


def expected_answer(plan: Sequence[int]) -> list[int | None]:
    """Per position the right answer token; None where the plan token is not a digit,
    because such a token has no right expansion and no output earns credit for it."""
    out: list[int | None] = []
    for token in plan:
        digit = digit_of(token)
        if digit is None:
            out += [None, None]
        else:
            out += [DIGIT_IDS[digit], DIGIT_IDS[(digit + 1) % 10]]
    return out


def expected_verdict(answer: Sequence[int]) -> list[int | None]:
    """The largest digit in the answer; non-digit tokens are skipped."""
    digits = [d for d in map(digit_of, answer) if d is not None]
    return [DIGIT_IDS[max(digits)] if digits else None]


# ---- rewards -------------------------------------------------------------------------


def _fraction_right(output: Sequence[int], expected: Sequence[int | None]) -> float:
    if len(output) != len(expected):
        return 0.0
    return sum(e is not None and o == e for o, e in zip(output, expected)) / len(expected)


def planner_reward(query: Sequence[int], plan: Sequence[int]) -> float:
    """Fraction of plan positions holding the right sorted digit."""
    return _fraction_right(plan, expected_plan(query))


def solver_reward(plan: Sequence[int], answer: Sequence[int]) -> float:
    """Fraction of answer positions right for the plan the solver was given."""
    return _fraction_right(answer, expected_answer(plan))


def checker_reward(plan: Sequence[int], answer: Sequence[int], verdict: Sequence[int]) -> float:
    """1 if the verdict is the largest digit of the answer the checker was given, else 0.
    The plan is in the checker's prompt but does not change the right verdict."""
    return _fraction_right(verdict, expected_verdict(answer))


# ---- warm-up -------------------------------------------------------------------------


def _noisy(target: Sequence[int], rng: random.Random) -> Tokens:
    return [t if rng.random() < WARMUP_CORRECT_PROB else rng.choice(DIGIT_IDS) for t in target]


def _solver_like_answer(plan: Sequence[int], rng: random.Random) -> Tokens:
    """Right tokens mixed with random digits at a random error rate: what a partly
    trained solver writes, so the checker warms up on the inputs it will see."""
    error_rate = rng.random()
    return [t if rng.random() >= error_rate else rng.choice(DIGIT_IDS)
            for t in expected_answer(plan)]


def warmup_examples(agent: str, rng: random.Random, n: int) -> list[tuple[Tokens, Tokens]]:
    """n (prompt_ids, noisy target_ids) pairs for agent's supervised warm-up.

    Solver and checker inputs are random rather than produced by the chain, so each agent
    learns its job for any input an agent before it may write.
    """
    if agent not in AGENTS:
        raise ValueError(f"unknown agent {agent!r}; the digit chain has {list(AGENTS)}")
    examples = []
    for _ in range(n):
        query = make_query(rng)
        if agent == PLANNER:
            prompt, target = planner_prompt(query), expected_plan(query)
        elif agent == SOLVER:
            prompt, target = solver_prompt(query), expected_answer(query)
        else:
            plan = query  # any three digits, sorted or not, as a partly trained planner writes
            answer = _solver_like_answer(plan, rng)
            prompt, target = checker_prompt(plan, answer), expected_verdict(answer)
        examples.append((prompt, _noisy(target, rng)))
    return examples
