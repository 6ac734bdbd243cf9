"""Model names in a config -> model directories the workers load.

`tiny:AGENT` names one of the digit chain's built-in tiny models (digit_chain.TINY_MODELS).
A cached build is found with the torch-free cache key; on a miss the model is built by
`python -m flexmarl.workers.models` in a child process, under a time limit, so the
controller never imports torch or the workers' code. Anything else must be a Hugging Face
model directory.

This module knows nothing about how a model is built or what its vocabulary means.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flexmarl.runtime.model_specs import cached_model_dir

from . import digit_chain

MODEL_CACHE = Path(".cache/models")
TINY_PREFIX = "tiny:"
# Building the largest built-in model, warm-up included, takes a minute or two on a busy
# 2-core machine; far beyond that the builder is stuck, not slow.
BUILD_TIMEOUT_S = 1200.0
# Lines of the builder's output quoted when it fails.
OUTPUT_TAIL_LINES = 20


class ModelBuildError(RuntimeError):
    """The builder process failed or ran past its time limit."""


def resolve_model(name: str, cache_root: Path = MODEL_CACHE) -> str:
    """`tiny:AGENT` builds (once, cached) a built-in tiny model; anything else is a path
    to a Hugging Face model directory."""
    if name.startswith(TINY_PREFIX):
        return str(_tiny_model(name[len(TINY_PREFIX):], Path(cache_root)))
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name!r} is neither a built-in (tiny:NAME) nor a directory "
                                f"with a config.json")
    return str(path)


def _tiny_model(agent: str, cache_root: Path) -> Path:
    recipes = digit_chain.TINY_MODELS
    if agent not in recipes:
        raise KeyError(f"unknown built-in model {TINY_PREFIX + agent!r} (built in: "
                       f"{', '.join(TINY_PREFIX + a for a in recipes)})")
    cached = cached_model_dir(recipes[agent], cache_root)
    if cached is not None:
        return cached
    return _build_in_child(digit_chain.__name__, agent, cache_root)


def _build_in_child(job: str, agent: str, cache_root: Path) -> Path:
    command = [sys.executable, "-m", "flexmarl.workers.models", "--job", job, "--agent", agent,
               "--cache-root", str(cache_root)]
    shown = " ".join(command[1:])
    try:
        # Pipes kept apart: the path is stdout's last line, whatever libraries log to stderr.
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ModelBuildError(
            f"building the built-in model {TINY_PREFIX + agent!r} did not finish within "
            f"{BUILD_TIMEOUT_S:.0f} s and was stopped; its last output:\n{_tail(exc.stdout, exc.stderr)}\n"
            f"Run `python {shown}` to watch it.") from None
    lines = done.stdout.strip().splitlines()
    built = Path(lines[-1]) if lines else None
    if done.returncode != 0 or built is None or not built.is_dir():
        raise ModelBuildError(
            f"building the built-in model {TINY_PREFIX + agent!r} failed (exit status "
            f"{done.returncode}); its last output:\n{_tail(done.stdout, done.stderr)}\n"
            f"Fix the cause and run `python {shown}` to retry.")
    return built


def _tail(*outputs: str | bytes | None) -> str:
    """The last lines of the builder's stdout then stderr (where a traceback ends up)."""
    text = "\n".join(o.decode(errors="replace") if isinstance(o, bytes) else o
                     for o in outputs if o)
    lines = text.rstrip().splitlines()[-OUTPUT_TAIL_LINES:]
    return "\n".join("  | " + line for line in lines) or "  | (no output)"
