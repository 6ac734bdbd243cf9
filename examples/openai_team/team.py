"""A review team written against the OpenAI API alone: the solver answers a question
several times, the verifier checks each answer in words, and the solver answers again
after hearing the verifier. It imports nothing of FlexMARL: point the client at any
OpenAI-compatible server (the endpoint of a FlexMARL run while it trains, `flexmarl serve`
after, or any other) whose models are named "solver" and "verifier".

    import asyncio, openai
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="...")
    print(asyncio.run(review_team(client, "What is 7 + 5?")))
"""

import asyncio

from openai import AsyncOpenAI


async def review_team(client: AsyncOpenAI, question: str) -> list[str]:
    """The solver's final answers, one per first answer it gave."""
    asked = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(model="solver", messages=asked)  # the server decides how many
    return await asyncio.gather(*(review_and_revise(client, question, asked, choice.message.content)
                                  for choice in first.choices))


async def review_and_revise(client: AsyncOpenAI, question: str, asked: list[dict], answer: str) -> str:
    review = await client.chat.completions.create(
        model="verifier", messages=[{"role": "user", "content": f"Question: {question} Answer: {answer}"}])
    heard = review.choices[0].message.content
    # The same conversation, one turn on: the earlier answer as the solver gave it.
    final = await client.chat.completions.create(
        model="solver", messages=asked + [{"role": "assistant", "content": answer}, {"role": "user", "content": heard}])
    return final.choices[0].message.content
