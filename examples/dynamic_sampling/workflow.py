"""Dynamic sampling's example: the digit chain's sorting task where a third of the training
queries cannot be scored (a stand-in for prompts too hard for every sample: each of their
samples gets reward 0), so a third of the groups have all rewards equal and no advantage.
With `agents.sorter.dynamic_sampling` those groups are dropped before they reach a
micro-batch and the step draws more episodes to keep its batch size; without it they are
trained on, adding nothing but their share of the batch. Held-out episodes (`[eval]`) read
their query from a row and are always scored."""

from __future__ import annotations

from flexmarl.controller.tasks.digit_chain import DIGIT_IDS, make_query, planner_prompt, planner_reward


async def episode(ctx) -> None:
    if ctx.item:
        query, scored = [DIGIT_IDS[d] for d in ctx.item["digits"]], True
    else:
        query, scored = make_query(ctx.rng), ctx.rng.random() >= 1 / 3
    for s in await ctx.generate("sorter", planner_prompt(query)):
        ctx.reward(s, planner_reward(query, s.output_ids) if scored else 0.0)
