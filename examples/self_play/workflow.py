"""Self-play on the digit chain's sorting task: `player` plays against `past`, a snapshot of
itself a few steps old. Both sort the same three digits; the player's reward is its score
minus the snapshot's mean score on that query (positive: it beats its past). The snapshot is
frozen, so its samples need no reward; each one gets its own score anyway, which the event
log keeps with the served group (`GroupServed`), so a run can say how good the past was.
An optional frozen `judge` (any agent of the digit chain's vocabulary) is asked about the
player's best answer and never trained: a judge that plays but does not learn."""

from __future__ import annotations

import asyncio

from flexmarl.controller.tasks.digit_chain import checker_prompt, make_query, planner_prompt, planner_reward


async def episode(ctx) -> None:
    query = make_query(ctx.rng)
    mine, theirs = await asyncio.gather(ctx.generate("player", planner_prompt(query)),
                                        ctx.generate("past", planner_prompt(query)))
    their_scores = [planner_reward(query, s.output_ids) for s in theirs]
    for s, score in zip(theirs, their_scores):
        ctx.reward(s, score)  # recorded with the served group, never trained
    against = sum(their_scores) / len(their_scores)
    scores = [planner_reward(query, s.output_ids) for s in mine]
    for s, score in zip(mine, scores):
        ctx.reward(s, score - against)
    if "judge" in ctx.agents:
        best = mine[scores.index(max(scores))]
        await ctx.generate("judge", checker_prompt(best.output_ids, best.output_ids))
