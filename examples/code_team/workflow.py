"""The coding team's episode: the coder writes a program for the row's spec, the tester
writes an input against a planted bug; both are scored by running code in the sandbox,
on the environment workers (`ctx.call`), never in the controller."""

from __future__ import annotations

import asyncio

from code_tasks import catches, coder_prompt, pass_rate, plant_bug, tester_prompt


async def episode(ctx) -> None:
    op, d = ctx.item["op"], ctx.item["d"]

    async def code() -> None:
        programs = await ctx.generate("coder", coder_prompt(op, d))
        rates = await asyncio.gather(*(ctx.call(pass_rate, op, d, s.text) for s in programs))
        for sample, rate in zip(programs, rates):
            ctx.reward(sample, rate)

    async def test() -> None:
        planted = plant_bug(op, d, ctx.rng)
        inputs = await ctx.generate("tester", tester_prompt(op, d, planted))
        caught = await ctx.call(catches, op, d, planted, [s.text for s in inputs])
        for sample, hit in zip(inputs, caught):
            ctx.reward(sample, hit)

    await asyncio.gather(code(), test())
