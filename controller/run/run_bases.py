"""The bases of a run's adapter agents, kept in the run directory when nothing else keeps them.

An adapter checkpoint (`checkpoints/step-N/AGENT/adapter_config.json`) names its base, and
PEFT loads that base by the name (`AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`).
A base built from a recipe lives in the machine's model cache, which may be emptied at any
time and is on no other machine, so such a base is saved once per run, as
RUN_DIR/bases/NAME/ (hard links to the cache's files where both are on one file system,
else copies), and every process of the run loads it from there: the adapters name a base
that lasts as long as the run and travels with it. A base that is the user's own directory
is named where it is, and one in a Hugging Face hub cache by its hub id
(workers/adapters.base_reference).

A resumed run and `flexmarl serve` use a kept base as it is (`kept_base`): nothing is
built, even where the recipe or the cache is gone.

It knows nothing of adapters or checkpoints beyond the folder's name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

BASES_DIR = "bases"


def kept_base(run_dir: str | Path, base: str) -> Path | None:
    """RUN_DIR/bases/BASE, absolute, when the run keeps that base; None otherwise."""
    path = (Path(run_dir) / BASES_DIR / base).absolute()
    return path if (path / "config.json").is_file() else None


def keep_base(run_dir: str | Path, base: str, model_dir: str | Path) -> Path:
    """Saves the model directory `model_dir` as the run's base `base` (once: a kept one
    stays as it is) and returns where it is. Written under a temporary name and renamed,
    so a kept base is whole."""
    kept = kept_base(run_dir, base)
    if kept is not None:
        return kept
    final = (Path(run_dir) / BASES_DIR / base).absolute()
    staging = final.with_name(f".{base}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_dir, staging, copy_function=_link_or_copy)
    shutil.rmtree(final, ignore_errors=True)  # a folder left without its config.json
    os.rename(staging, final)
    return final


def _link_or_copy(source: str, target: str) -> str:
    """A hard link (a cache entry is never changed in place, so sharing its bytes is safe,
    and the link outlives the entry); a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return target
