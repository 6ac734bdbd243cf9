"""The review chain's task rules: what is asked, what each agent says, what is right.

A question is a small sum ("What is 7 + 5?"). Two agents talk over three turns:

    solver    answers in a chat turn:                       "12"
    verifier  reads the question and that answer, works     "It is 12, correct."
              the sum out itself, then judges in words:     "It is 11, wrong."
    solver    reads the verifier's message as a user turn
              and answers again:                            "11"

Rewards are exact: the verifier earns 1 when its verdict word ("correct" / "wrong") is
the truth about the answer it was shown; the solver earns FIRST_WEIGHT for a right first
answer plus the rest for a right final answer.

Why the verifier states the sum before judging: a tiny model cannot compare a sum it has
not written with the answer it reads (a 2-layer model stays near chance for thousands of
warm-up steps), but once its own sum is the token just before the verdict, "is this the
number in the answer?" is learned in a few hundred steps.

This module is plain Python (no torch, no FlexMARL): the workflow, the models' warm-up and
the data script all use it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

DATA = Path(__file__).parent / "data"
TRAIN_FILE, EVAL_FILE = DATA / "train.jsonl", DATA / "eval.jsonl"
MAX_TERM = 9  # questions add two numbers in 0..MAX_TERM

CORRECT, WRONG = "correct", "wrong"
FIRST_WEIGHT = 0.25  # the solver's reward for its first answer; the final one gets the rest


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def review_request(question_text: str, answer: str) -> str:
    """What the verifier is shown."""
    return f"Question: {question_text} Answer: {answer}"


def review(stated_sum: int, verdict: str) -> str:
    """What the verifier says: its own sum, then the verdict word."""
    return f"It is {stated_sum}, {verdict}."


def terms(question_text: str) -> tuple[int, int]:
    match = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question_text)
    if match is None:
        raise ValueError(f"not a question of this task: {question_text!r}")
    return int(match[1]), int(match[2])


# ---- rewards --------------------------------------------------------------------------


def is_right(answer_text: str, truth: str) -> bool:
    return answer_text.strip() == truth


def verdict_of(review_text: str) -> str | None:
    """The verdict word a review ends with, or None for anything else."""
    match = re.search(r"\b(correct|wrong)\.?\s*$", review_text)
    return match[1] if match else None


def verifier_reward(review_text: str, answer_text: str, truth: str) -> float:
    right = CORRECT if is_right(answer_text, truth) else WRONG
    return 1.0 if verdict_of(review_text) == right else 0.0


def solver_reward(first_text: str, final_text: str, truth: str) -> float:
    return FIRST_WEIGHT * is_right(first_text, truth) + (1 - FIRST_WEIGHT) * is_right(final_text, truth)


# ---- data -----------------------------------------------------------------------------


def all_rows() -> list[dict]:
    return [{"question": question(a, b), "answer": str(a + b)}
            for a in range(MAX_TERM + 1) for b in range(MAX_TERM + 1)]


def split_rows(seed: int = 0, eval_rows: int = 20) -> tuple[list[dict], list[dict]]:
    """(train, eval): a fixed shuffle of every question, the last `eval_rows` held out."""
    rows = all_rows()
    random.Random(seed).shuffle(rows)
    return rows[:-eval_rows], rows[-eval_rows:]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def near_miss(truth: int, rng: random.Random) -> int:
    """A plausible wrong sum: one or two off, never negative."""
    return abs(truth + rng.choice((-2, -1, 1, 2)))
