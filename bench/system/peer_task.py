"""The peer benchmark's single-agent job: reverse a digit string, one tiny Qwen2, chars as tokens.

A prompt is 2-4 random digits and a ">" ("472>"); the right completion is the digits
reversed and the end-of-sequence token ("274" + <eos>): 3-5 output tokens. The reward is
the fraction of the reversed string's positions the completion gets right, divided by the
longer of the two lengths, so a completion that runs on past the answer loses credit.

The model is a 340k-parameter Qwen2 over a character vocabulary (one token per digit, ">",
and the special tokens), created from a seed and warmed up briefly on noisy targets (each
digit right with probability WARMUP_CORRECT_PROB), so sampling at temperature 1 is often
wrong and GRPO has room to raise the reward within a few dozen steps.

Both sides of bench/system/peer_trl.py use what is here: the prompts (`prompts`), the reward
(`reward`) and the model directory (`build_model`, run in FlexMARL's environment; the
TRL side only loads the directory). `episode` is the FlexMARL workflow of the job
(`run.workflow = "bench/system/peer_task.py:episode"`). The task functions import nothing but
the standard library, so the TRL side, in its own environment, imports this file too.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = tuple("0123456789>")
VOCAB = SPECIALS + CHARS
EOS = "<eos>"
AGENT = "solver"
MAX_TOKENS = 5  # the longest answer (4 digits) plus <eos>

# Qwen2 shape: 5 layers of width 64, head size 32 (one vLLM's CPU attention takes).
MODEL = {"hidden_size": 64, "intermediate_size": 264, "num_hidden_layers": 5, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
MODEL_SEED = 7
WARMUP_CORRECT_PROB = 0.5
WARMUP = {"steps": 200, "batch_size": 64, "lr": 3e-3, "examples": 4096}
# Names everything above that shapes the saved model; part of its cache directory's name.
BUILD_KEY = hashlib.sha256(json.dumps([VOCAB, MODEL, MODEL_SEED, WARMUP_CORRECT_PROB, WARMUP, "1"]).encode()
                           ).hexdigest()[:12]


def make_prompt(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4))) + ">"


def answer(prompt: str) -> str:
    return prompt.rstrip(">")[::-1]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(f"peer-prompts-{seed}")
    return [make_prompt(rng) for _ in range(n)]


def reward(prompt: str, completion: str) -> float:
    """Fraction of the answer's positions right, over the longer of answer and completion
    (the completion is the decoded text, special tokens left out)."""
    want = answer(prompt)
    right = sum(a == b for a, b in zip(want, completion))
    return right / max(len(want), len(completion), 1)


def write_prompts(path: str | Path, n: int, seed: int) -> Path:
    """The prompts as a jsonl dataset ({"prompt": ...} per line) both sides read in order."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(n, seed)))
    return path


# ---- the FlexMARL workflow ----------------------------------------------------------------


async def episode(ctx) -> None:
    prompt = ctx.item["prompt"]
    for sample in await ctx.generate(AGENT, prompt):
        ctx.reward(sample, reward(prompt, sample.text))


# ---- the model (FlexMARL's environment: torch, transformers, tokenizers) ------------------


def char_tokenizer():
    """A PreTrainedTokenizerFast with one token per character and no added specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token=EOS, pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=MODEL["max_position_embeddings"])


def warmup_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    rng = random.Random("peer-warmup")
    digit_ids = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
    examples = []
    for _ in range(WARMUP["examples"]):
        prompt = make_prompt(rng)
        target = [t if rng.random() < WARMUP_CORRECT_PROB else rng.choice(digit_ids)
                  for t in tokenizer.encode(answer(prompt))]
        examples.append((tokenizer.encode(prompt), target + [tokenizer.eos_token_id]))
    return examples


def build_model(cache_root: str | Path) -> Path:
    """The job's model directory under cache_root, built (and warmed up) on first use."""
    final = Path(cache_root) / f"peer-qwen2-{BUILD_KEY}"
    if final.is_dir():
        return final
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flexmarl.runtime.model_specs import WarmupSchedule
    from flexmarl.workers.models import publish_build, save_model, warm_up

    def build(staging: Path) -> None:
        tokenizer = char_tokenizer()
        torch.manual_seed(MODEL_SEED)
        config = Qwen2Config(vocab_size=len(VOCAB), head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"],
                             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        schedule = WarmupSchedule(WARMUP["steps"], WARMUP["batch_size"], WARMUP["lr"])
        warm_up(model, warmup_examples(tokenizer), schedule, MODEL_SEED, tokenizer.pad_token_id)
        save_model(model, tokenizer, staging)

    return publish_build(final, build)
