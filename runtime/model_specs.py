"""What a built-in tiny model is, and where its cached build lives: plain data, no torch.

A job that ships its own tiny models (the embedded digit chain does, and so may a user's
job) describes each one as a `TinyModelRecipe`: the model's shape and seed
(`TinyModelSpec`), its tokenizer, and an optional supervised warm-up (an example function, a
version naming what it produces, and a `WarmupSchedule`). The tokenizer is either a
word-level vocabulary (`vocab`, one token per whitespace-separated word) or a
`TrainedTokenizer`: the JSON of a tokenizer the job trained with the `tokenizers` library
on its own text, its special tokens and a Jinja chat template. The job module exposes the
recipes under one name the builder looks for:

    TINY_MODELS: dict[str, TinyModelRecipe]   # agent name -> recipe

A config names one as `tiny:AGENT` (the built-in digit chain) or `tiny:JOB:AGENT`, where JOB
is a dotted module or a path to a .py file (`import_job` loads either).

Built models live in one cache per machine and user (`default_model_cache`: the platform's
cache directory, or `FLEXMARL_MODEL_CACHE`), shared by every run from every directory.
`flexmarl.workers.models` builds a recipe into a Hugging Face directory under
`cache_root / JobModel.key()`: a name for everything that decides the files (the recipe's
fields, its name in the job, the job file's content, the versions of the libraries that
build it). The controller only needs to know whether that directory is already there
(`JobModel.cached`), which is why this module imports neither torch nor transformers:
finding a cached model must not pay for loading them.

An entry is published by one atomic rename, so a directory that exists is complete; a
build in progress lives under a dot-prefixed staging name that is never returned, and two
processes building the same entry take turns on its lock file (workers/models.py).

This module knows nothing about any task, any vocabulary's meaning, or how models are built.
It imports neither `tokenizers` nor transformers: a trained tokenizer is plain JSON here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .user_modules import import_file

# Every tiny vocabulary holds these; the tokenizer and model config take pad, bos, eos and
# unk from them. Putting them first keeps <pad> at id 0.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")

# vLLM's CPU attention backend accepts only these head sizes; checked up front so a bad
# spec fails with a clear message, not deep inside vLLM start-up.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Where built models are cached when set; else `default_model_cache()`.
CACHE_ENV = "FLEXMARL_MODEL_CACHE"

# The libraries whose versions decide a built model's files: the initialisation and the
# warm-up's arithmetic (torch), the model's code and saved format (transformers,
# safetensors), the tokenizer's files (tokenizers).
BUILD_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")

# Bump when the build or warm-up loop itself changes, so cached models built by the old
# loop are not silently reused.
BUILD_VERSION = "1"

# One warm-up example: (prompt_ids, target_ids); the loss covers the target only.
Example = tuple[Sequence[int], Sequence[int]]
# A recipe's warm-up: no argument for a word vocabulary (its ids are known up front); the
# built Hugging Face tokenizer for a TrainedTokenizer (its ids, and its chat template, are
# only known once it is loaded).
Warmup = Callable[..., Sequence[Example]]


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

    def tensor_names(self) -> list[str]:
        """The names of the weights the built model's safetensors file holds (transformers'
        Llama, untied head): what its modules are called, known without building it."""
        layer = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        layer += ["input_layernorm", "post_attention_layernorm"]
        names = ["model.embed_tokens", "model.norm", "lm_head"]
        names += [f"model.layers.{i}.{module}" for i in range(self.num_layers) for module in layer]
        return [f"{name}.weight" for name in names]


@dataclass(frozen=True)
class WarmupSchedule:
    """How the optional supervised warm-up trains; part of the cache key."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3


@dataclass(frozen=True)
class TrainedTokenizer:
    """A tokenizer a job trained itself, as the files it becomes; all of it is in the cache key.

    `json` is `tokenizers.Tokenizer.to_str()` of the trained tokenizer. The special tokens
    must be in it (pass them to the trainer's `special_tokens`); `eos` ends every output,
    `pad` pads batches. `chat_template` is the Jinja template `apply_chat_template` renders
    (messages with `role` and `content`; `add_generation_prompt` asks for the assistant's
    turn); empty: no chat, only `ctx.generate` with text or ids.
    """

    json: str
    eos: str
    pad: str
    bos: str = ""
    unk: str = ""
    chat_template: str = ""

    def __post_init__(self) -> None:
        try:
            data = json.loads(self.json)
        except ValueError as exc:
            raise ValueError(f"TrainedTokenizer.json is not a tokenizer's JSON ({exc}); pass "
                             f"tokenizers.Tokenizer.to_str()") from None
        known = set(self.vocabulary(data))
        named = {"eos": self.eos, "pad": self.pad, "bos": self.bos, "unk": self.unk}
        missing = {role: token for role, token in named.items() if token and token not in known}
        if missing:
            raise ValueError(f"the trained tokenizer lacks the special tokens {missing}; pass them to "
                             f"the trainer's special_tokens so each is one token")

    @staticmethod
    def vocabulary(data: dict[str, Any]) -> list[str]:
        """Every token of a tokenizer's JSON: its model's vocabulary and its added tokens."""
        vocab = data.get("model", {}).get("vocab", {})
        tokens = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]  # Unigram: pairs
        return tokens + [added["content"] for added in data.get("added_tokens", [])]

    def key_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that decides one built-in model's files.

    The tokenizer is `vocab` (a word-level vocabulary holding SPECIAL_TOKENS) or
    `tokenizer` (a TrainedTokenizer), never both. `warmup` is called only when the model is
    actually built (with the built tokenizer as its argument when `tokenizer` is given, see
    `Warmup`); `warmup_version` names what it produces and must change whenever the
    examples change, or a stale model is reused.
    """

    spec: TinyModelSpec
    vocab: tuple[str, ...] = ()
    warmup: Warmup | None = None
    warmup_version: str = ""
    schedule: WarmupSchedule = WarmupSchedule()
    tokenizer: TrainedTokenizer | None = None

    def __post_init__(self) -> None:
        if self.warmup is not None and not self.warmup_version:
            raise ValueError(f"{self.spec.name}: a recipe with a warm-up needs a warmup_version "
                             f"naming what the warm-up examples are")
        if self.tokenizer is not None:
            if self.vocab:
                raise ValueError(f"{self.spec.name}: give a recipe either a vocab or a trained "
                                 f"tokenizer, not both")
            return
        missing = [t for t in SPECIAL_TOKENS if t not in self.vocab]
        if missing:
            raise ValueError(f"{self.spec.name}: the vocabulary lacks the special tokens {missing}; "
                             f"every tiny vocabulary holds {SPECIAL_TOKENS}")

    def cache_key(self) -> str:
        return cache_key(self.spec, self.vocab, self.warmup_version if self.warmup else "",
                         self.schedule, self.tokenizer)


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
              schedule: WarmupSchedule, tokenizer: TrainedTokenizer | None = None) -> str:
    """A name for everything that shapes the saved weights and files. An empty
    warmup_version means no warm-up, and then the schedule does not matter."""
    fields: dict[str, Any] = {
        "spec": dataclasses.asdict(spec),
        "vocab": list(vocab),
        "warmup_version": warmup_version,
        "schedule": dataclasses.asdict(schedule) if warmup_version else None,
        "build_version": BUILD_VERSION,
    }
    # Only present when used, so the keys of word-vocabulary recipes stay what they were.
    if tokenizer is not None:
        fields["tokenizer"] = tokenizer.key_fields()
    payload = json.dumps(fields, sort_keys=True)
    return f"{spec.name}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def cached_model_dir(recipe: TinyModelRecipe, cache_root: str | os.PathLike) -> Path | None:
    """The recipe's built directory under cache_root, or None if it has not been built.
    An entry exists only after its atomic rename, so existing means complete."""
    entry = Path(cache_root) / recipe.cache_key()
    return entry if entry.is_dir() else None


def default_model_cache() -> Path:
    """Where built models are cached: `FLEXMARL_MODEL_CACHE` when set, else the platform's
    per-user cache directory ($XDG_CACHE_HOME/flexmarl/models, else
    ~/.cache/flexmarl/models; ~/Library/Caches/flexmarl/models on macOS)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "flexmarl" / "models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flexmarl" / "models"


def library_versions() -> dict[str, str]:
    """The installed versions of BUILD_LIBRARIES, read from their metadata (none imported)."""
    from importlib import metadata

    versions = {}
    for name in BUILD_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


@dataclass(frozen=True)
class JobModel:
    """One recipe of a job module and what names its build: the recipe's own fields
    (`TinyModelRecipe.cache_key`), its name in TINY_MODELS, the SHA-256 of the file that
    defines it (an edit to the recipe file builds anew, whatever `warmup_version` says)
    and the versions of the libraries that build it."""

    name: str
    recipe: TinyModelRecipe
    source: str  # SHA-256 of the job module's file
    libraries: tuple[tuple[str, str], ...] = ()  # (library, version); default: what is installed

    def key(self) -> str:
        fields = {"recipe": self.recipe.cache_key(), "name": self.name, "source": self.source,
                  "libraries": dict(self.libraries or library_versions().items())}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.recipe.spec.name}-{digest}"

    def cached(self, cache_root: str | os.PathLike) -> Path | None:
        """The built directory under cache_root, or None if it has not been built. An entry
        exists only after its atomic rename, so existing means complete."""
        entry = Path(cache_root) / self.key()
        return entry if entry.is_dir() else None


def job_models(job: str) -> dict[str, JobModel]:
    """Every recipe of the job module `job` (see `import_job`) with what names its build."""
    module = import_job(job)
    recipes = getattr(module, "TINY_MODELS", None)
    if not isinstance(recipes, dict):
        raise ValueError(f"job module {job!r} has no TINY_MODELS table (agent name -> "
                         f"TinyModelRecipe); it ships no built-in models")
    source = hashlib.sha256(Path(module.__file__ or "").read_bytes()).hexdigest() if module.__file__ else ""
    libraries = tuple(library_versions().items())
    return {name: JobModel(name, recipe, source, libraries) for name, recipe in recipes.items()}


def has_tokenizer(model_dir: str | os.PathLike) -> bool:
    """Whether a Hugging Face model directory ships a tokenizer."""
    return any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


def import_job(job: str) -> ModuleType:
    """The job module `job` names: a dotted import path, or a path to a .py file (ending in
    .py or holding a "/"; relative to the working directory). A file's folder joins
    sys.path, so it can import its neighbours; the same file is imported once per process."""
    if not (job.endswith(".py") or "/" in job):
        return importlib.import_module(job)
    path = Path(job).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"job file {job!r} does not exist (looked at {path}); paths are "
                                f"relative to the working directory")
    return import_file(path, "flexmarl_job")


def job_recipes(job: str) -> dict[str, TinyModelRecipe]:
    """The TINY_MODELS table of the job module `job` (see `import_job`)."""
    return {name: model.recipe for name, model in job_models(job).items()}
