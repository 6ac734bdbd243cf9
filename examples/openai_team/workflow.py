"""The review team (team.py, OpenAI client code) trained by FlexMARL as it is. Named in the
job's TOML as

    [run]
    workflow = "openai_team/workflow.py:episode"

The team is handed a client of this episode's (`ctx.openai_client()`): every call it makes
is a turn of the episode. A call without `n` opens a group of the agent's `group_size`
samples, so the solver answers 8 times and the verifier reviews each answer twice; each
solver sample is one conversation (first answer, the verifier's words, the final answer),
continued with the engine's own ids for the first answer. Each sample is rewarded from
its own conversation with the review chain's rules (examples/review_chain/review_task.py):
the verifier for the truth of its verdict about the answer it was shown, the solver for a
right first (0.25) and final (0.75) answer.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "review_chain"))  # the review chain's task rules

from review_task import solver_reward, verifier_reward  # noqa: E402
from team import review_team  # noqa: E402


def shown_answer(review_request: str) -> str:
    """The answer a verifier was shown ("Question: ... Answer: 12")."""
    return re.search(r"Answer: (.*)$", review_request)[1]


async def episode(ctx) -> None:
    question, truth = ctx.item["question"], ctx.item["answer"]
    await review_team(ctx.openai_client(), question)
    ctx.reward_all("verifier", lambda s: verifier_reward(s.text, shown_answer(s.messages[0]["content"]), truth))
    ctx.reward_all("solver", lambda s: solver_reward(s.messages[1]["content"], s.text, truth))
