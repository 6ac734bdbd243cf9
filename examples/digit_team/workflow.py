"""The digit team's episode: one query, every configured agent does its own task on it
(concurrently), each sample rewarded by the fraction of right positions."""

from __future__ import annotations

import asyncio

from tasks import TASKS, make_query, reward, task_of


async def episode(ctx) -> None:
    query = make_query(ctx.rng)

    async def work(agent: str) -> None:
        task = task_of(agent)
        samples = await ctx.generate(agent, TASKS[task][0](query))
        for sample in samples:
            ctx.reward(sample, reward(task, query, sample.output_ids))

    await asyncio.gather(*(work(agent) for agent in ctx.agents))
