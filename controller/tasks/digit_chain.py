"""The built-in digit-chain job: vocabulary, task rules, tiny models, workflow, default config.

Three agents of different sizes in a chain. A query is three random digits; each agent
reads what the agents before it wrote:

    planner (small)   reads the query,                writes 3 tokens: the digits sorted
    solver  (large)   reads the planner's plan,       writes 6 tokens: each plan digit x
                                                      followed by (x + 1) % 10
    checker (medium)  reads the plan and the answer,  writes 1 token: the answer's largest
                                                      digit, the chain's final result

The workflow (`episode`) branches: 4 plans per query, 4 answers per plan, 2 checks per
answer, so 4 / 16 / 32 requests per query with output lengths 3 / 6 / 1: the skew the load
balancer and allocator must absorb.

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

The agents' models are described as `TINY_MODELS` recipes (see
flexmarl.runtime.model_specs); `python -m flexmarl.workers.models --job
flexmarl.controller.tasks.digit_chain --agent NAME` builds one. This module does no I/O, imports
no torch and nothing from the workers, and knows nothing about engines or how the
controller schedules the chain.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flexmarl.runtime.model_specs import SPECIAL_TOKENS, TinyModelRecipe, TinyModelSpec, WarmupSchedule

if TYPE_CHECKING:
    from ..episodes.workflow import EpisodeContext

# ---- vocabulary ----------------------------------------------------------------------

DIGIT_TOKENS = tuple(str(d) for d in range(10))
# Tags mark the sections of a prompt and say what the model is to write next.
TAG_TOKENS = ("<query>", "<plan>", "<answer>", "<check>")
# Special tokens first, so <pad> is 0 and ids never move when tags are added at the end.
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + DIGIT_TOKENS + TAG_TOKENS
TOKEN_ID: dict[str, int] = {token: index for index, token in enumerate(VOCAB)}

PAD_ID = TOKEN_ID["<pad>"]
BOS_ID = TOKEN_ID["<bos>"]
EOS_ID = TOKEN_ID["<eos>"]
UNK_ID = TOKEN_ID["<unk>"]
QUERY_ID = TOKEN_ID["<query>"]
PLAN_ID = TOKEN_ID["<plan>"]
ANSWER_ID = TOKEN_ID["<answer>"]
CHECK_ID = TOKEN_ID["<check>"]
# DIGIT_IDS[d] is the token id of digit d.
DIGIT_IDS: tuple[int, ...] = tuple(TOKEN_ID[t] for t in DIGIT_TOKENS)


def digit_of(token_id: int) -> int | None:
    """The digit a token id stands for, or None for any other token."""
    offset = token_id - DIGIT_IDS[0]
    return offset if 0 <= offset < 10 else None


# ---- agents --------------------------------------------------------------------------

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
    digits = [d for d in map(digit_of, query) if d is not None]
    if len(digits) < len(query):
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


def _all_known(tokens: list[int | None]) -> Tokens:
    """The right outputs for an input of digits only, which have no None."""
    known = [t for t in tokens if t is not None]
    assert len(known) == len(tokens), tokens
    return known


def _noisy(target: Sequence[int], rng: random.Random) -> Tokens:
    return [t if rng.random() < WARMUP_CORRECT_PROB else rng.choice(DIGIT_IDS) for t in target]


def _solver_like_answer(plan: Sequence[int], rng: random.Random) -> Tokens:
    """Right tokens mixed with random digits at a random error rate: what a partly
    trained solver writes, so the checker warms up on the inputs it will see."""
    error_rate = rng.random()
    return [t if rng.random() >= error_rate else rng.choice(DIGIT_IDS)
            for t in _all_known(expected_answer(plan))]


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
        examples.append((prompt, _noisy(_all_known(target), rng)))
    return examples


def _seeded_warmup(agent: str) -> list[tuple[Tokens, Tokens]]:
    # Seeded by the agent's name, so every builder of a recipe makes the same examples.
    return warmup_examples(agent, random.Random(f"warmup-{agent}"), WARMUP_EXAMPLES)


# What flexmarl.workers.models builds for `tiny:AGENT` (see flexmarl.runtime.model_specs).
TINY_MODELS: dict[str, TinyModelRecipe] = {
    name: TinyModelRecipe(spec, VOCAB, functools.partial(_seeded_warmup, name), WARMUP_VERSION,
                          WARMUP_SCHEDULE)
    for name, spec in AGENTS.items()
}


# ---- the workflow --------------------------------------------------------------------


async def episode(ctx: EpisodeContext) -> None:
    """One query down the chain; every branch runs concurrently."""
    query = make_query(ctx.rng)
    plans = await ctx.generate(PLANNER, planner_prompt(query))
    for plan in plans:
        ctx.reward(plan, planner_reward(query, plan.output_ids))

    async def solve(plan_ids: Sequence[int]) -> None:
        answers = await ctx.generate(SOLVER, solver_prompt(plan_ids))
        for answer in answers:
            ctx.reward(answer, solver_reward(plan_ids, answer.output_ids))
        await asyncio.gather(*(check(plan_ids, a.output_ids) for a in answers))

    async def check(plan_ids: Sequence[int], answer_ids: Sequence[int]) -> None:
        await ctx.env()  # e.g. running the answer in a sandbox before judging it
        verdicts = await ctx.generate(CHECKER, checker_prompt(plan_ids, answer_ids))
        for v in verdicts:
            ctx.reward(v, checker_reward(plan_ids, answer_ids, v.output_ids))

    await asyncio.gather(*(solve(p.output_ids) for p in plans))


# ---- the embedded default job --------------------------------------------------------


def default_config() -> dict[str, Any]:
    """The embedded default job, as the raw dict a TOML file would give."""
    group = {PLANNER: 4, SOLVER: 4, CHECKER: 2}
    return {
        "run": {"workflow": "digit_chain", "steps": 40},
        "cluster": {"rollout_workers": 3, "trainer_workers": 1},
        "pipeline": {"queries_per_step": 16, "micro_batch": 32},
        # Fixed-length outputs (the rewards score each position): the end-of-sequence
        # token does not end them.
        "agents": {name: {"model": f"tiny:{name}", "group_size": group[name],
                          "max_tokens": OUTPUT_LEN[name], "lr": 1e-3, "ignore_eos": True}
                   for name in AGENTS},
    }
