"""The review chain's tiny models: a tokenizer trained on the job's own text, a chat
template, and each agent's recipe with a short supervised warm-up.

FlexMARL builds a recipe on first use and caches it (`model = "tiny:examples/review_chain/
models.py:solver"` in the job's TOML); to build one by hand:

    python -m flexmarl.workers.models --job examples/review_chain/models.py --agent solver

The tokenizer is a byte-level BPE trained with the `tokenizers` library on the dataset's
questions and answers plus the verifier's phrases (milliseconds, at import). Warm-up
targets are deliberately noisy: a target answer is right with probability
SOLVER_CORRECT_PROB and the verifier's stated sum with VERIFIER_CORRECT_PROB, otherwise a
near miss. A model fitted to them is usually right when greedy but often wrong when
sampling at temperature 1, which leaves room for RL to raise each agent's reward. The
warm-up covers every question, held-out ones included (what the models "know" before RL);
RL then trains on data/train.jsonl only.

Imports no torch: the controller reads these recipes to find cached models.
"""

from __future__ import annotations

import functools
import hashlib
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from flexmarl.runtime.model_specs import TinyModelRecipe, TinyModelSpec, TrainedTokenizer, WarmupSchedule
from review_task import (
    CORRECT, EVAL_FILE, TRAIN_FILE, WRONG, near_miss, read_rows, review, review_request,
)

SOLVER, VERIFIER = "solver", "verifier"
SPECIAL = ("<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>")
# Every message is <|role|>content<eos>; the assistant's turn starts after <|assistant|> and
# ends with the <eos> it writes itself.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB_SIZE = 128

SOLVER_CORRECT_PROB = 0.5
VERIFIER_CORRECT_PROB = 0.7
WARMUP_EXAMPLES = 4096
SCHEDULE = WarmupSchedule(steps=1500, batch_size=64, lr=2e-3)


def job_text(rows: list[dict]) -> list[str]:
    """The text the tokenizer is trained on: everything the agents read and write."""
    texts = []
    for row in rows:
        truth = int(row["answer"])
        texts += [row["question"], row["answer"], review_request(row["question"], row["answer"])]
        texts += [review(truth, CORRECT), review(truth, WRONG)]
    return texts


def train_tokenizer(texts: list[str]) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


ROWS = read_rows(TRAIN_FILE) + read_rows(EVAL_FILE)
TOKENIZER = TrainedTokenizer(train_tokenizer(job_text(ROWS)), eos="<eos>", pad="<pad>", bos="<bos>",
                             chat_template=CHAT_TEMPLATE)


# ---- warm-up --------------------------------------------------------------------------


def _maybe(truth: int, p_right: float, rng: random.Random) -> int:
    return truth if rng.random() < p_right else near_miss(truth, rng)


def solver_turns(row: dict, rng: random.Random) -> tuple[list[dict], str]:
    """A first question, or a revision after a verifier-like review; the (noisy) answer."""
    truth = int(row["answer"])
    messages = [{"role": "user", "content": row["question"]}]
    if rng.random() < 0.5:
        first = _maybe(truth, 0.5, rng)
        stated = _maybe(truth, 0.8, rng)
        messages += [{"role": "assistant", "content": str(first)},
                     {"role": "user", "content": review(stated, CORRECT if first == stated else WRONG)}]
    return messages, str(_maybe(truth, SOLVER_CORRECT_PROB, rng))


def verifier_turns(row: dict, rng: random.Random) -> tuple[list[dict], str]:
    truth = int(row["answer"])
    shown = _maybe(truth, 0.5, rng)
    stated = _maybe(truth, VERIFIER_CORRECT_PROB, rng)
    messages = [{"role": "user", "content": review_request(row["question"], str(shown))}]
    return messages, review(stated, CORRECT if shown == stated else WRONG)


TURNS = {SOLVER: solver_turns, VERIFIER: verifier_turns}


def warmup_examples(agent: str, tokenizer, n: int = WARMUP_EXAMPLES) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) with the agent's chat template; every target ends in EOS."""
    rng = random.Random(f"warmup-{agent}")
    examples = []
    for _ in range(n):
        messages, target = TURNS[agent](rng.choice(ROWS), rng)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        examples.append((tokenizer.encode(prompt, add_special_tokens=False),
                         tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]))
    return examples


# Names what the warm-up produces: bump the number when its code changes; the data's hash
# keeps models built from other rows apart.
WARMUP_VERSION = "review-chain-1-" + hashlib.sha256(repr(ROWS).encode()).hexdigest()[:8]

SPECS = {
    SOLVER: TinyModelSpec(SOLVER, hidden_size=96, num_layers=2, num_heads=3, num_kv_heads=3,
                          intermediate_size=192, max_position_embeddings=64, seed=1),
    VERIFIER: TinyModelSpec(VERIFIER, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                            intermediate_size=128, max_position_embeddings=64, seed=2),
}

TINY_MODELS = {
    agent: TinyModelRecipe(spec, warmup=functools.partial(warmup_examples, agent), warmup_version=WARMUP_VERSION,
                           schedule=SCHEDULE, tokenizer=TOKENIZER)
    for agent, spec in SPECS.items()
}
