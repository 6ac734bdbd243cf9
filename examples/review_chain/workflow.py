"""The review chain's episode: a solver answers, a verifier judges in words, the solver
revises once. Named in the job's TOML as

    [run]
    workflow = "review_chain/workflow.py:episode"   # relative to the TOML's folder

`ctx.item` is one row of the dataset ({"question": ..., "answer": ...}). Each solver
sample is one conversation (first answer, the verifier's message, final answer) trained
as one sequence; the verifier's message inside it is masked out of the solver's loss.
"""

import asyncio

from review_task import review_request, solver_reward, verifier_reward


async def episode(ctx) -> None:
    question, truth = ctx.item["question"], ctx.item["answer"]
    answers = await ctx.chat("solver", [{"role": "user", "content": question}])
    await asyncio.gather(*(review_and_revise(ctx, question, truth, answer) for answer in answers))


async def review_and_revise(ctx, question: str, truth: str, answer) -> None:
    first = answer.text
    reviews = await ctx.chat("verifier", [{"role": "user", "content": review_request(question, first)}])
    for review in reviews:
        ctx.reward(review, verifier_reward(review.text, first, truth))
    # The solver hears one review (the group's first) and answers again in the same sample.
    await ctx.continue_chat(answer, [{"role": "user", "content": reviews[0].text}])
    ctx.reward(answer, solver_reward(first, answer.text, truth))
