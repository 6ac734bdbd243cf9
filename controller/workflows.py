"""Built-in workflows and the embedded default job.

`digit_chain` is the default: three agents of different sizes in a chain (the planner
sorts the query's digits, the solver expands the plan, the checker reports the answer's
largest digit), branch factors that multiply requests down the chain (4 plans per
query, 4 answers per plan, 2 checks per answer: 4 / 16 / 32 requests per query),
different output lengths (3 / 6 / 1 tokens) and exact, verifiable rewards (see tasks.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from . import tasks
from .workflow import EpisodeContext, Episode


async def digit_chain(ctx: EpisodeContext) -> None:
    query = tasks.make_query(ctx.rng)
    plans = await ctx.generate(tasks.PLANNER, tasks.planner_prompt(query))
    for plan in plans:
        ctx.reward(plan, tasks.planner_reward(query, plan.output_ids))

    async def solve(plan_ids: list[int]) -> None:
        answers = await ctx.generate(tasks.SOLVER, tasks.solver_prompt(plan_ids))
        for answer in answers:
            ctx.reward(answer, tasks.solver_reward(plan_ids, answer.output_ids))
        await asyncio.gather(*(check(plan_ids, a.output_ids) for a in answers))

    async def check(plan_ids: list[int], answer_ids: list[int]) -> None:
        await ctx.env()  # e.g. running the answer in a sandbox before judging it
        verdicts = await ctx.generate(tasks.CHECKER, tasks.checker_prompt(plan_ids, answer_ids))
        for v in verdicts:
            ctx.reward(v, tasks.checker_reward(plan_ids, answer_ids, v.output_ids))

    await asyncio.gather(*(solve(p.output_ids) for p in plans))


WORKFLOWS: dict[str, Episode] = {"digit_chain": digit_chain}


def get_workflow(name: str) -> Episode:
    if name not in WORKFLOWS:
        raise KeyError(f"unknown workflow {name!r} (built in: {', '.join(WORKFLOWS)})")
    return WORKFLOWS[name]


def default_config() -> dict[str, Any]:
    """The embedded default job, as the raw dict a TOML file would give."""
    group = {tasks.PLANNER: 4, tasks.SOLVER: 4, tasks.CHECKER: 2}
    return {
        "run": {"workflow": "digit_chain", "steps": 40},
        "cluster": {"rollout_workers": 3, "trainer_workers": 1},
        "pipeline": {"queries_per_step": 16, "micro_batch": 32},
        "agents": {name: {"model": f"tiny:{name}", "group_size": group[name],
                          "max_tokens": tasks.OUTPUT_LEN[name], "lr": 1e-3}
                   for name in tasks.AGENTS},
    }
