"""The review team's base: one tiny model that drafts, critiques and revises, shared by
the team's three agents as LoRA adapters (examples/review_team.toml).

It is the review chain's task (review_task.py) and tokenizer (models.py) with a single
model warmed up on all three turns of a conversation, each with noisy targets so that RL
has room: a first answer to a question (right half the time), a critique of a shown answer
(the review chain's verifier turn: its own sum, right 70% of the time, then the verdict
word), and a revised answer after a critique (half the time what the critique implies,
else right half the time). The three turns differ in their prompts, so one model tells
them apart; each agent's adapter then learns its own turn.

What RL can teach which turn, and what shows on held-out questions: a model this small
holds the sums of the 100 questions as a table, so a drafter trained on 80 of them answers
those better and the other 20 no better; following the critique is one rule for every
question, so the reviser's gain shows on held-out questions too (bench/RESULTS.md).

Imports no torch: the controller reads this recipe to find the cached model.
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path

from review_task import CORRECT, WRONG, review

from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, WarmupSchedule
from flexmarl.runtime.user_modules import import_file

# The review chain's models.py, by its path: a neighbour called "models" might be another
# job's in a process that imported several.
chain = import_file(Path(__file__).with_name("models.py"), "flexmarl_job")
ROWS, TOKENIZER, _maybe, verifier_turns = chain.ROWS, chain.TOKENIZER, chain._maybe, chain.verifier_turns

DRAFT_CORRECT_PROB = 0.5
REVISION_CORRECT_PROB = 0.5
FOLLOW_PROB = 0.5  # a revision follows the critique this often in the warm-up
WARMUP_EXAMPLES = 6144
SCHEDULE = WarmupSchedule(steps=1500, batch_size=64, lr=2e-3)


def draft_turns(row: dict, rng: random.Random) -> tuple[list[dict], str]:
    return [{"role": "user", "content": row["question"]}], str(_maybe(int(row["answer"]), DRAFT_CORRECT_PROB, rng))


def revision_turns(row: dict, rng: random.Random) -> tuple[list[dict], str]:
    """The question, a draft, a critique of it (its sum right 80% of the time), the revision:
    what the critique implies (its sum when it says wrong, the draft when it says correct)
    FOLLOW_PROB of the time, else an answer right half the time, whatever the critique said."""
    truth = int(row["answer"])
    draft, stated = _maybe(truth, 0.5, rng), _maybe(truth, 0.8, rng)
    verdict = CORRECT if draft == stated else WRONG
    messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": str(draft)},
                {"role": "user", "content": review(stated, verdict)}]
    implied = draft if verdict == CORRECT else stated
    return messages, str(implied if rng.random() < FOLLOW_PROB else _maybe(truth, REVISION_CORRECT_PROB, rng))


TURNS = (draft_turns, verifier_turns, revision_turns)


def warmup_examples(tokenizer, n: int = WARMUP_EXAMPLES) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of the three turns in equal parts; every target ends in EOS."""
    rng = random.Random("warmup-review-team")
    examples = []
    for i in range(n):
        messages, target = TURNS[i % len(TURNS)](rng.choice(ROWS), rng)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        examples.append((tokenizer.encode(prompt, add_special_tokens=False),
                         tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]))
    return examples


WARMUP_VERSION = "review-team-2-" + hashlib.sha256(repr(ROWS).encode()).hexdigest()[:8]

BASE = TinyModelSpec("review_team_base", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                     intermediate_size=256, max_position_embeddings=64, seed=3)

TINY_MODELS = {
    "base": TinyModelRecipe(BASE, warmup=functools.partial(warmup_examples), warmup_version=WARMUP_VERSION,
                            schedule=SCHEDULE, tokenizer=TOKENIZER),
}
