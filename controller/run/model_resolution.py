"""Model names in a config -> model directories the workers load.

`tiny:AGENT` names one of the digit chain's built-in tiny models (digit_chain.TINY_MODELS);
`tiny:JOB:AGENT` one of a user's job module's TINY_MODELS, JOB being a dotted module
(`tiny:mypkg.models:solver`) or a .py file (`tiny:examples/review_chain/models.py:solver`;
in a TOML relative to its folder, see config.resolve_paths). A cached build is found in the
machine's model cache (model_specs.default_model_cache) by its torch-free key; on a miss
the model is built by `python -m flexmarl.workers.models` in a child process, under a time
limit, so the controller never imports torch or the workers' code (the job module itself
is imported here, to read its recipes: it must not import torch at the top). Anything else
must be a Hugging Face model directory. `tensor_names` says what a model's weights are
called without building it (a recipe knows its shape), for checking adapters' targets.

This module knows nothing about how a model is built or what its vocabulary means.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from flexmarl.runtime.model_specs import JobModel, default_model_cache, job_models
from flexmarl.runtime.progress_file import PROGRESS_FILE_ENV, read_progress

from ..tasks import digit_chain
from .lora_targets import model_tensor_names


TINY_PREFIX = "tiny:"
# The largest model the shipped jobs build (a team's base, warm-up included) takes 3-4
# minutes on a 2-core machine and took 11 under heavy load; a second run asking for the
# same model waits for the first one's build. Far beyond that the builder is stuck.
BUILD_TIMEOUT_S = 3600.0
# Lines of the builder's output quoted when it fails.
OUTPUT_TAIL_LINES = 20


class ModelBuildError(RuntimeError):
    """The builder process failed or ran past its time limit."""


class ModelError(ValueError):
    """A model name in the config names no model: no such directory, recipe or job module."""


def resolve_model(name: str, cache_root: Path | None = None,
                  on_build: Callable[[str], ContextManager[Any]] | None = None) -> str:
    """`tiny:AGENT` / `tiny:JOB:AGENT` builds (once, cached under `default_model_cache()` unless
    `cache_root` is given) a job's tiny model; anything else is a path to a Hugging Face
    model directory. A build runs inside `on_build(name)`, a context whose value's
    `update(done, total)` is given the builder's warm-up steps as they go."""
    cache_root = default_model_cache() if cache_root is None else cache_root
    if name.startswith(TINY_PREFIX):
        job, agent = tiny_model_name(name)
        cached = _job_model(name, job, agent).cached(cache_root)
        if cached is not None:
            return str(cached)
        with (on_build or _no_display)(name) as display:
            return str(_build_in_child(job, name, agent, Path(cache_root), display))
    return str(_model_dir(name))


@contextlib.contextmanager
def _no_display(name: str) -> Iterator[None]:
    yield None


def check_model(name: str) -> None:
    """Raises what `resolve_model` would for a name that names no model, without
    building anything: a config's models are checked before any worker starts."""
    if name.startswith(TINY_PREFIX):
        _job_model(name, *tiny_model_name(name))
    else:
        _model_dir(name)


def tensor_names(name: str) -> list[str] | None:
    """The names of a model's weights without building or loading it: a recipe's from its
    shape, a directory's from its safetensors headers; None when they cannot be known
    (weights in another format)."""
    if name.startswith(TINY_PREFIX):
        return _job_model(name, *tiny_model_name(name)).recipe.spec.tensor_names()
    return model_tensor_names(_model_dir(name))


def _model_dir(name: str) -> Path:
    path = Path(name)
    if not (path / "config.json").exists():
        what = "a directory without a config.json" if path.is_dir() else "no such directory"
        raise ModelError(f"model {name!r} is neither a built-in (tiny:NAME or tiny:JOB:NAME) nor a Hugging Face "
                         f"model directory ({what})")
    return path


def tiny_model_name(name: str) -> tuple[str, str]:
    """(job, agent) of `tiny:AGENT` (the digit chain's) or `tiny:JOB:AGENT`. A job file is
    made absolute, so the builder child finds it whatever its working directory."""
    rest = name[len(TINY_PREFIX):]
    if ":" not in rest:
        return digit_chain.__name__, rest
    job, agent = rest.rsplit(":", 1)
    if job.endswith(".py") or "/" in job:
        job = str(Path(job).expanduser().resolve())
    return job, agent


def _job_model(name: str, job: str, agent: str) -> JobModel:
    try:
        recipes = job_models(job)
    except (ImportError, OSError, ValueError) as exc:
        raise ModelBuildError(f"model {name!r}: the job module {job!r} could not be read: "
                              f"{type(exc).__name__}: {exc}") from None
    if agent not in recipes:
        prefix = TINY_PREFIX if job == digit_chain.__name__ else f"{name.rsplit(':', 1)[0]}:"
        raise ModelError(f"unknown built-in model {name!r} (built in: "
                         f"{', '.join(prefix + a for a in recipes)})")
    return recipes[agent]


def _build_in_child(job: str, name: str, agent: str, cache_root: Path, display: Any = None) -> Path:
    command = [sys.executable, "-m", "flexmarl.workers.models", "--job", job, "--agent", agent,
               "--cache-root", str(cache_root)]
    shown = " ".join(command[1:])
    try:
        with _progress_from_child(display) as env:
            # Pipes kept apart: the path is stdout's last line, whatever libraries log to stderr.
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as exc:
        raise ModelBuildError(
            f"building the built-in model {name!r} did not finish within "
            f"{BUILD_TIMEOUT_S:.0f} s and was stopped; its last output:\n{_tail(exc.stdout, exc.stderr)}\n"
            f"Run `python {shown}` to watch it.") from None
    lines = done.stdout.strip().splitlines()
    built = Path(lines[-1]) if lines else None
    if done.returncode != 0 or built is None or not built.is_dir():
        raise ModelBuildError(
            f"building the built-in model {name!r} failed (exit status "
            f"{done.returncode}); its last output:\n{_tail(done.stdout, done.stderr)}\n"
            f"Fix the cause and run `python {shown}` to retry.")
    return built


@contextlib.contextmanager
def _progress_from_child(display: Any) -> Iterator[dict[str, str]]:
    """The child's environment, with a progress file a thread passes on to `display`."""
    if display is None:
        yield dict(os.environ)
        return
    with tempfile.TemporaryDirectory(prefix="flexmarl-build-") as folder:
        path = Path(folder) / "progress"
        stop = threading.Event()

        def relay() -> None:
            while not stop.wait(0.5):
                count = read_progress(path)
                if count is not None:
                    display.update(*count)

        thread = threading.Thread(target=relay, name="build-progress", daemon=True)
        thread.start()
        try:
            yield dict(os.environ, **{PROGRESS_FILE_ENV: str(path)})
        finally:
            stop.set()
            thread.join()


def _tail(*outputs: str | bytes | None) -> str:
    """The last lines of the builder's stdout then stderr (where a traceback ends up)."""
    text = "\n".join(o.decode(errors="replace") if isinstance(o, bytes) else o
                     for o in outputs if o)
    lines = text.rstrip().splitlines()[-OUTPUT_TAIL_LINES:]
    return "\n".join("  | " + line for line in lines) or "  | (no output)"
