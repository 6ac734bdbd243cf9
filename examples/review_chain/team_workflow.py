"""The review team's episode: three agents, adapters of one base, over one conversation.

    drafter   answers the question:                         "13"
    critic    reads the question and the draft, states      "It is 12, wrong."
              the sum itself and judges the draft:
    reviser   reads the question, the draft and the         "12"
              critique, and answers again:

Rewards are exact: the drafter's draft and the reviser's revision earn 1 when right; the
critic earns 1 when its verdict word is the truth about the draft (review_task.py). Each
draft gets `group_size` critiques and, after the group's first critique, `group_size`
revisions; every sample is trained as its own agent's.
"""

import asyncio

from review_task import is_right, review_request, verifier_reward


async def episode(ctx) -> None:
    question, truth = ctx.item["question"], ctx.item["answer"]
    drafts = await ctx.chat("drafter", [{"role": "user", "content": question}])
    for draft in drafts:
        ctx.reward(draft, float(is_right(draft.text, truth)))
    await asyncio.gather(*(critique_and_revise(ctx, question, truth, draft.text) for draft in drafts))


async def critique_and_revise(ctx, question: str, truth: str, draft: str) -> None:
    critiques = await ctx.chat("critic", [{"role": "user", "content": review_request(question, draft)}])
    for critique in critiques:
        ctx.reward(critique, verifier_reward(critique.text, draft, truth))
    revisions = await ctx.chat("reviser", [{"role": "user", "content": question},
                                           {"role": "assistant", "content": draft},
                                           {"role": "user", "content": critiques[0].text}])
    for revision in revisions:
        ctx.reward(revision, float(is_right(revision.text, truth)))
