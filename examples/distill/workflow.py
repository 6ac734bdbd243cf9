"""The distillation job's episode: sort three digits (the digit chain's planner task). A
training episode draws its query; a held-out one (`[eval]`) reads it from its row. The
student's reward is the fraction of positions right (`episode`), or 1 only when all three
are (`episode_exact`: a sparse reward); `episode_long` sorts five digits. With
`agents.student.teacher` set, its teacher also scores every token it wrote (the reverse KL
in its loss). The teacher itself never runs
here: its logprobs are a prefill of the student's samples."""

from __future__ import annotations

from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, make_query, planner_prompt, planner_reward


async def episode(ctx, exact: bool = False, digits: int = 3) -> None:
    query = ([DIGIT_IDS[d] for d in ctx.item["digits"]] if ctx.item else
             make_query(ctx.rng) if digits == 3 else [DIGIT_IDS[ctx.rng.randrange(10)] for _ in range(digits)])
    for agent in [a for a in ctx.agents if a in ("student", "sorter")]:
        for s in await ctx.generate(agent, planner_prompt(query)):
            score = planner_reward(query, s.output_ids)
            ctx.reward(s, float(score == 1.0) if exact else score)


async def episode_exact(ctx) -> None:
    await episode(ctx, exact=True)


async def episode_long(ctx) -> None:
    """Five digits to sort (examples/distill/models.py: long_teacher, long_student)."""
    await episode(ctx, digits=5)
