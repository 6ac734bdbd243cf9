"""Builds tiny causal language models locally from a recipe, and caches them.

No model hub can be reached, so a built-in model is created here from a
`TinyModelRecipe` (flexmarl.runtime.model_specs): its tokenizer (a word-level `tokenizers`
tokenizer over the vocabulary handed in, or the job's own trained tokenizer with its chat
template) saved in Hugging Face format, a small Llama config from the spec and its seed, an
optional short supervised warm-up, and a directory that transformers
(`AutoModelForCausalLM`, `AutoTokenizer` with `apply_chat_template`) and vLLM both load.

`ensure_model` caches built directories under the model's cache key and publishes an entry
with one atomic `os.rename`, so a crash never leaves a half-written entry. Two processes
that need the same entry at once (two runs starting together) take turns on the entry's
lock file: one builds, the other waits and then finds the entry, so a model is built once
per cache however many runs start.

Run as a program it builds (or finds) one agent's model of a job module (a dotted module or
a .py file) in the machine's model cache (`--cache-root` to choose another) and prints the
directory as the last line of its output; the controller starts it as a child process so
that it never loads torch itself:

    python -m flexmarl.workers.models --job flexmarl.controller.tasks.digit_chain --agent planner
    python -m flexmarl.workers.models --job examples/review_chain/models.py --agent solver

This module knows nothing about any task: the vocabulary, the warm-up examples and what
they mean all come from the recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from flexmarl.runtime.model_specs import (
    SPECIAL_TOKENS,
    Example,
    JobModel,
    TinyModelRecipe,
    TinyModelSpec,
    TrainedTokenizer,
    WarmupSchedule,
    check_spec,
    default_model_cache,
    job_models,
)
from flexmarl.runtime.progress_file import write_progress

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


def load_trained_tokenizer(trained: TrainedTokenizer):
    """A PreTrainedTokenizerFast from a job's trained tokenizer JSON, its special tokens and
    chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    named = {"bos_token": trained.bos, "eos_token": trained.eos, "pad_token": trained.pad,
             "unk_token": trained.unk}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(trained.json),
        chat_template=trained.chat_template or None,
        model_max_length=4096,
        **{role: token for role, token in named.items() if token},
    )


def recipe_tokenizer(recipe: TinyModelRecipe):
    """The Hugging Face tokenizer a recipe's model is saved with."""
    if recipe.tokenizer is not None:
        return load_trained_tokenizer(recipe.tokenizer)
    return build_tokenizer(recipe.vocab)


def llama_config(spec: TinyModelSpec, tokenizer):
    """The model config for spec over tokenizer's vocabulary and special ids (a word
    vocabulary is accepted too, for callers that have no tokenizer built)."""
    from transformers import LlamaConfig

    if not hasattr(tokenizer, "convert_tokens_to_ids"):
        tokenizer = build_tokenizer(tokenizer)
    check_spec(spec)
    special = {f"{role}_token_id": getattr(tokenizer, f"{role}_token_id")
               for role in ("bos", "eos", "pad")}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="float32",
        **special,
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
    for step in range(schedule.steps):
        if step % max(1, schedule.steps // 100) == 0:
            write_progress(step, schedule.steps)  # the controller shows it while it waits
        batch = torch.randint(len(rows), (schedule.batch_size,), generator=generator)
        loss = model(
            input_ids=input_ids[batch],
            attention_mask=attention_mask[batch],
            labels=labels[batch],
        ).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    write_progress(schedule.steps, schedule.steps)
    model.eval()


def build_model(
    spec: TinyModelSpec,
    tokenizer,
    out_dir: str | os.PathLike,
    warmup: Sequence[Example] | None = None,
    schedule: WarmupSchedule = WarmupSchedule(),
) -> Path:
    """Create the model from `spec.seed`, optionally warm it up, and save it with its
    tokenizer (a Hugging Face tokenizer, or a word vocabulary to build one over) to out_dir."""
    import torch
    from transformers import LlamaForCausalLM

    if not hasattr(tokenizer, "convert_tokens_to_ids"):
        tokenizer = build_tokenizer(tokenizer)
    # The default job shares two cores among many processes; more threads only thrash.
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    config = llama_config(spec, tokenizer)
    model = LlamaForCausalLM(config).to(torch.float32)
    if warmup:
        warm_up(model, warmup, schedule, spec.seed, config.pad_token_id)
    save_model(model, tokenizer, out)
    return out


def save_model(model, tokenizer, out: Path) -> None:
    """The model, its tokenizer and explicit generation defaults (so neither transformers
    nor vLLM guesses sampling settings), into out."""
    from transformers import GenerationConfig

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
    ).save_pretrained(out)


def warmup_examples(recipe: TinyModelRecipe, tokenizer) -> Sequence[Example] | None:
    """The recipe's warm-up examples; a trained tokenizer's recipe is handed the tokenizer."""
    if recipe.warmup is None:
        return None
    return recipe.warmup(tokenizer) if recipe.tokenizer is not None else recipe.warmup()


def ensure_model(model: JobModel | TinyModelRecipe, cache_root: str | os.PathLike) -> Path:
    """The cached model directory for a job's model (a bare recipe: keyed by its own fields
    alone), building it first if it is not there. The recipe's warm-up examples are only
    made on a miss."""
    recipe = model.recipe if isinstance(model, JobModel) else model
    key = model.key() if isinstance(model, JobModel) else model.cache_key()
    final = Path(cache_root) / key
    if final.is_dir():
        return final

    def build(staging: Path) -> None:
        tokenizer = recipe_tokenizer(recipe)
        build_model(recipe.spec, tokenizer, staging, warmup_examples(recipe, tokenizer), recipe.schedule)

    return publish_build(final, build)


def publish_build(final: Path, build: Callable[[Path], None]) -> Path:
    """`build(staging)` fills a fresh directory next to final, which is then renamed to
    final: a reader never sees a half-built model. Under the entry's lock: a second
    process asking for the same entry waits for the first and then finds it built; a
    staging directory left by a builder that died is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(final):
        if final.is_dir():  # built by another process while this one waited
            return final
        for stale in final.parent.glob(f".building-{final.name}-*"):  # no one else holds the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=final.parent))
        try:
            build(staging)
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


@contextlib.contextmanager
def entry_lock(final: Path) -> Iterator[None]:
    """An exclusive lock on the cache entry `final` (its `.NAME.lock` file beside it),
    held while it is built; released by the kernel if the process dies."""
    with open(final.parent / f".{final.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flexmarl.workers.models",
        description="Build (or find in the cache) one agent's built-in tiny model of a job "
                    "module; prints the model directory as the last line.")
    parser.add_argument("--job", required=True,
                        help="the job module exposing TINY_MODELS: a dotted module path or a .py file")
    parser.add_argument("--agent", required=True)
    parser.add_argument("--cache-root", type=Path, default=None,
                        help=f"default: the machine's model cache (now {default_model_cache()})")
    args = parser.parse_args(argv)
    found = job_models(args.job)
    if args.agent not in found:
        parser.error(f"job {args.job!r} has no built-in model for agent {args.agent!r} "
                     f"(it has: {', '.join(found)})")
    print(ensure_model(found[args.agent], args.cache_root or default_model_cache()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
