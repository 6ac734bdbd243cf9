"""Tiny causal language models built locally, for the embedded default job.

No model hub can be reached, so every model the default job trains is created here from a
config and a seed: a fixed word-level vocabulary, a `tokenizers` tokenizer saved in Hugging
Face format, a small Llama config, an optional short supervised warm-up, and a directory
that transformers (`AutoModelForCausalLM`, `AutoTokenizer`) and vLLM both load.

`ensure_model` caches built directories under a key derived from everything that shapes the
weights, and publishes an entry with one atomic `os.rename`, so a crash never leaves a
half-written entry and concurrent builders of the same entry cannot corrupt it.

This module knows nothing about any task: warm-up examples are plain
`(prompt_ids, target_ids)` pairs handed in by the caller (see flexmarl.controller.tasks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Special tokens first, so <pad> is 0 and ids never move when tags are added at the end.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DIGIT_TOKENS = tuple(str(d) for d in range(10))
# Tags mark the sections of a prompt and say what the model is to write next.
TAG_TOKENS = ("<query>", "<plan>", "<answer>", "<check>")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + DIGIT_TOKENS + TAG_TOKENS
TOKEN_ID: dict[str, int] = {token: index for index, token in enumerate(VOCAB)}

PAD_ID = TOKEN_ID["<pad>"]
BOS_ID = TOKEN_ID["<bos>"]
EOS_ID = TOKEN_ID["<eos>"]
UNK_ID = TOKEN_ID["<unk>"]
QUERY_ID = TOKEN_ID["<query>"]
PLAN_ID = TOKEN_ID["<plan>"]
ANSWER_ID = TOKEN_ID["<answer>"]
CHECK_ID = TOKEN_ID["<check>"]
# DIGIT_IDS[d] is the token id of digit d.
DIGIT_IDS: tuple[int, ...] = tuple(TOKEN_ID[t] for t in DIGIT_TOKENS)

# Bump when the warm-up loop itself changes, so cached models built by the old loop are
# not silently reused.
BUILD_VERSION = "1"

Example = tuple[Sequence[int], Sequence[int]]


def digit_of(token_id: int) -> int | None:
    """The digit a token id stands for, or None for any other token."""
    offset = token_id - DIGIT_IDS[0]
    return offset if 0 <= offset < 10 else None


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of one tiny Llama model; head size is hidden_size / num_heads."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 64
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class WarmupSchedule:
    """How the optional supervised warm-up trains; part of the cache key."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3


# vLLM's CPU attention backend accepts only these head sizes; checked up front so a bad
# spec fails here with a clear message, not deep inside vLLM start-up.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_spec(spec: TinyModelSpec) -> None:
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"{spec.name}: hidden_size must divide by num_heads and num_heads by "
            f"num_kv_heads, got {spec.hidden_size}/{spec.num_heads}/{spec.num_kv_heads}"
        )
    if spec.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"{spec.name}: head size {spec.head_dim} is not one vLLM's CPU attention "
            f"accepts {VLLM_CPU_HEAD_SIZES}; change hidden_size or num_heads"
        )


def build_tokenizer():
    """A word-level PreTrainedTokenizerFast over VOCAB; splits on whitespace only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(TOKEN_ID), unk_token="<unk>"))
    # WhitespaceSplit, not Whitespace: the latter would cut "<bos>" into "<", "bos", ">".
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=4096,
    )


def llama_config(spec: TinyModelSpec):
    from transformers import LlamaConfig

    _check_spec(spec)
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def warm_up(model, examples: Sequence[Example], schedule: WarmupSchedule, seed: int) -> None:
    """Next-token loss on target tokens only, Adam, random minibatches of the examples."""
    import torch

    rows = [(list(p), list(t)) for p, t in examples]
    if not rows:
        return
    lengths = torch.tensor([len(p) + len(t) for p, t in rows])
    width = int(lengths.max())
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
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
    out_dir: str | os.PathLike,
    warmup: Sequence[Example] | None = None,
    schedule: WarmupSchedule = WarmupSchedule(),
) -> Path:
    """Create the model from `spec.seed`, optionally warm it up, and save it to out_dir."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    # The default job shares two cores among many processes; more threads only thrash.
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec)).to(torch.float32)
    if warmup:
        warm_up(model, warmup, schedule, spec.seed)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    # Explicit generation defaults, so neither loader guesses sampling settings.
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=True,
        temperature=1.0, top_p=1.0, top_k=0,
    ).save_pretrained(out)
    return out


def cache_key(spec: TinyModelSpec, warmup_version: str, schedule: WarmupSchedule) -> str:
    """A name for everything that shapes the saved weights and files."""
    payload = json.dumps(
        {
            "spec": dataclasses.asdict(spec),
            "vocab": VOCAB,
            "warmup_version": warmup_version,
            "schedule": dataclasses.asdict(schedule) if warmup_version else None,
            "build_version": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return f"{spec.name}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def ensure_model(
    spec: TinyModelSpec,
    cache_root: str | os.PathLike,
    warmup_fn: Callable[[], Sequence[Example]] | None = None,
    warmup_version: str = "",
    schedule: WarmupSchedule = WarmupSchedule(),
) -> Path:
    """The cached model directory for spec, building it first if it is not there.

    `warmup_fn` is only called on a miss; `warmup_version` names what it produces (change it
    whenever the examples change, or a stale model is reused).
    """
    if warmup_fn is not None and not warmup_version:
        raise ValueError("ensure_model needs a warmup_version when warmup_fn is given")
    root = Path(cache_root)
    final = root / cache_key(spec, warmup_version if warmup_fn else "", schedule)
    # An entry exists only after its rename, so existing means complete.
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=root))
    try:
        build_model(spec, staging, warmup_fn() if warmup_fn else None, schedule)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process published the same entry first; theirs is equally good.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final

