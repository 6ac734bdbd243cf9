"""Model resolution: a config's model name to a Hugging Face model directory."""

from __future__ import annotations

import random
from pathlib import Path

MODEL_CACHE = Path(".cache/models")


def resolve_model(name: str, cache_root: Path = MODEL_CACHE) -> str:
    """`tiny:AGENT` builds (once, cached) a built-in tiny model; anything else is a path
    to a Hugging Face model directory."""
    if name.startswith("tiny:"):
        from flexmarl.workers import models

        from . import tasks

        key = name.split(":", 1)[1]
        if key not in tasks.AGENTS:
            raise KeyError(f"unknown built-in model {name!r} (built in: "
                           f"{', '.join('tiny:' + a for a in tasks.AGENTS)})")
        examples = lambda: tasks.warmup_examples(key, random.Random(f"warmup-{key}"), tasks.WARMUP_EXAMPLES)  # noqa: E731
        return str(models.ensure_model(tasks.AGENTS[key], cache_root, examples, tasks.WARMUP_VERSION,
                                       tasks.WARMUP_SCHEDULE))
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {name!r} is neither a built-in (tiny:NAME) nor a directory "
                                f"with a config.json")
    return str(path)
