"""What a built-in tiny model is, and where its cached build lives: plain data, no torch.

A job that ships its own tiny models (the embedded digit chain does) describes each one as a
`TinyModelRecipe`: the model's shape and seed (`TinyModelSpec`), the word-level vocabulary
its tokenizer is built from, and an optional supervised warm-up (an example function, a
version naming what it produces, and a `WarmupSchedule`). The job module exposes them under
one name the builder looks for:

    TINY_MODELS: dict[str, TinyModelRecipe]   # agent name -> recipe

`flexmarl.workers.models` builds a recipe into a Hugging Face directory under
`cache_root / cache_key(...)`. The controller only needs to know whether that directory is
already there (`cached_model_dir`), which is why this module imports neither torch nor
transformers: finding a cached model must not pay for loading them.

An entry is published by one atomic rename, so a directory that exists is complete; a
build in progress lives under a dot-prefixed staging name that `cached_model_dir` never
returns.

This module knows nothing about any task, any vocabulary's meaning, or how models are built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Every tiny vocabulary holds these; the tokenizer and model config take pad, bos, eos and
# unk from them. Putting them first keeps <pad> at id 0.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")

# vLLM's CPU attention backend accepts only these head sizes; checked up front so a bad
# spec fails with a clear message, not deep inside vLLM start-up.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Bump when the build or warm-up loop itself changes, so cached models built by the old
# loop are not silently reused.
BUILD_VERSION = "1"

# One warm-up example: (prompt_ids, target_ids); the loss covers the target only.
Example = tuple[Sequence[int], Sequence[int]]


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


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that decides one built-in model's files.

    `warmup` is called only when the model is actually built; `warmup_version` names what
    it produces and must change whenever the examples change, or a stale model is reused.
    """

    spec: TinyModelSpec
    vocab: tuple[str, ...]
    warmup: Callable[[], Sequence[Example]] | None = None
    warmup_version: str = ""
    schedule: WarmupSchedule = WarmupSchedule()

    def __post_init__(self) -> None:
        if self.warmup is not None and not self.warmup_version:
            raise ValueError(f"{self.spec.name}: a recipe with a warm-up needs a warmup_version "
                             f"naming what the warm-up examples are")
        missing = [t for t in SPECIAL_TOKENS if t not in self.vocab]
        if missing:
            raise ValueError(f"{self.spec.name}: the vocabulary lacks the special tokens {missing}; "
                             f"every tiny vocabulary holds {SPECIAL_TOKENS}")

    def cache_key(self) -> str:
        return cache_key(self.spec, self.vocab, self.warmup_version if self.warmup else "",
                         self.schedule)


def check_spec(spec: TinyModelSpec) -> None:
    """Refuse a shape the model config or vLLM's CPU attention cannot take."""
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


def cache_key(spec: TinyModelSpec, vocab: Sequence[str], warmup_version: str,
              schedule: WarmupSchedule) -> str:
    """A name for everything that shapes the saved weights and files. An empty
    warmup_version means no warm-up, and then the schedule does not matter."""
    payload = json.dumps(
        {
            "spec": dataclasses.asdict(spec),
            "vocab": list(vocab),
            "warmup_version": warmup_version,
            "schedule": dataclasses.asdict(schedule) if warmup_version else None,
            "build_version": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return f"{spec.name}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def cached_model_dir(recipe: TinyModelRecipe, cache_root: str | os.PathLike) -> Path | None:
    """The recipe's built directory under cache_root, or None if it has not been built.
    An entry exists only after its atomic rename, so existing means complete."""
    entry = Path(cache_root) / recipe.cache_key()
    return entry if entry.is_dir() else None
