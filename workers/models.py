"""Builds tiny causal language models locally from a recipe, and caches them.

No model hub can be reached, so a built-in model is created here from a
`TinyModelRecipe` (flexmarl.runtime.model_specs): a word-level `tokenizers` tokenizer over
the vocabulary handed in, saved in Hugging Face format, a small Llama config from the spec
and its seed, an optional short supervised warm-up, and a directory that transformers
(`AutoModelForCausalLM`, `AutoTokenizer`) and vLLM both load.

`ensure_model` caches built directories under the recipe's cache key and publishes an entry
with one atomic `os.rename`, so a crash never leaves a half-written entry and concurrent
builders of the same entry cannot corrupt it.

Run as a program it builds (or finds) one agent's model of a job module and prints the
directory as the last line of its output; the controller starts it as a child process so
that it never loads torch itself:

    python -m flexmarl.workers.models --job flexmarl.controller.digit_chain \\
        --agent planner --cache-root .cache/models

This module knows nothing about any task: the vocabulary, the warm-up examples and what
they mean all come from the recipe.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from flexmarl.runtime.model_specs import (
    SPECIAL_TOKENS,
    Example,
    TinyModelRecipe,
    TinyModelSpec,
    WarmupSchedule,
    cached_model_dir,
    check_spec,
)

PAD, BOS, EOS, UNK = SPECIAL_TOKENS


def build_tokenizer(vocab: Sequence[str]):
    """A word-level PreTrainedTokenizerFast over vocab (token i gets id i); splits on
    whitespace only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token=UNK))
    # WhitespaceSplit, not Whitespace: the latter would cut "<bos>" into "<", "bos", ">".
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
    )


def llama_config(spec: TinyModelSpec, vocab: Sequence[str]):
    from transformers import LlamaConfig

    check_spec(spec)
    return LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=vocab.index(BOS),
        eos_token_id=vocab.index(EOS),
        pad_token_id=vocab.index(PAD),
        dtype="float32",
    )


def warm_up(model, examples: Sequence[Example], schedule: WarmupSchedule, seed: int,
            pad_id: int) -> None:
    """Next-token loss on target tokens only, Adam, random minibatches of the examples."""
    import torch

    rows = [(list(p), list(t)) for p, t in examples]
    if not rows:
        return
    lengths = torch.tensor([len(p) + len(t) for p, t in rows])
    width = int(lengths.max())
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # -100: no loss here
    for row, (prompt, target) in enumerate(rows):
        input_ids[row, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        labels[row, len(prompt) : len(prompt) + len(target)] = torch.tensor(target)
    # Right padding is harmless under causal attention: pads come after every label.
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=schedule.lr)
    model.train()
    for _ in range(schedule.steps):
        batch = torch.randint(len(rows), (schedule.batch_size,), generator=generator)
        loss = model(
            input_ids=input_ids[batch],
            attention_mask=attention_mask[batch],
            labels=labels[batch],
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def build_model(
    spec: TinyModelSpec,
    vocab: Sequence[str],
    out_dir: str | os.PathLike,
    warmup: Sequence[Example] | None = None,
    schedule: WarmupSchedule = WarmupSchedule(),
) -> Path:
    """Create the model from `spec.seed`, optionally warm it up, and save it with a
    tokenizer over vocab to out_dir."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    vocab = list(vocab)
    # The default job shares two cores among many processes; more threads only thrash.
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, vocab)).to(torch.float32)
    if warmup:
        warm_up(model, warmup, schedule, spec.seed, vocab.index(PAD))
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(vocab).save_pretrained(out)
    # Explicit generation defaults, so neither loader guesses sampling settings.
    GenerationConfig(
        bos_token_id=vocab.index(BOS), eos_token_id=vocab.index(EOS),
        pad_token_id=vocab.index(PAD), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    ).save_pretrained(out)
    return out


def ensure_model(recipe: TinyModelRecipe, cache_root: str | os.PathLike) -> Path:
    """The cached model directory for recipe, building it first if it is not there.
    The recipe's warm-up examples are only made on a miss."""
    found = cached_model_dir(recipe, cache_root)
    if found is not None:
        return found
    root = Path(cache_root)
    final = root / recipe.cache_key()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=root))
    try:
        examples = recipe.warmup() if recipe.warmup else None
        build_model(recipe.spec, recipe.vocab, staging, examples, recipe.schedule)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process published the same entry first; theirs is equally good.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def job_recipes(job: str) -> dict[str, TinyModelRecipe]:
    """The TINY_MODELS table of the job module named `job` (a dotted import path)."""
    module = importlib.import_module(job)
    recipes = getattr(module, "TINY_MODELS", None)
    if not isinstance(recipes, dict):
        raise ValueError(f"job module {job!r} has no TINY_MODELS table (agent name -> "
                         f"TinyModelRecipe); it ships no built-in models")
    return recipes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexmarl.workers.models",
        description="Build (or find in the cache) one agent's built-in tiny model of a job "
                    "module; prints the model directory as the last line.")
    parser.add_argument("--job", required=True, help="dotted module path exposing TINY_MODELS")
    parser.add_argument("--agent", required=True)
    parser.add_argument("--cache-root", required=True, type=Path)
    args = parser.parse_args(argv)
    recipes = job_recipes(args.job)
    if args.agent not in recipes:
        parser.error(f"job {args.job!r} has no built-in model for agent {args.agent!r} "
                     f"(it has: {', '.join(recipes)})")
    print(ensure_model(recipes[args.agent], args.cache_root), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
