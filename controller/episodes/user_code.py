"""Loading a user's workflow: `run.workflow` names an async episode function.

    run.workflow = "digit_chain"                  # a built-in, by short name
    run.workflow = "mypkg.workflows:episode"      # a module importable from here
    run.workflow = "path/to/solver.py:episode"    # a file (its folder joins sys.path, so
                                                  # it can import its neighbours)

`load_workflow(spec)` returns the function or raises `WorkflowError` saying what is wrong
and what to do; the driver calls it before any worker starts. A workflow is
`async def episode(ctx)`; see workflow.py for what `ctx` offers.

A built-in is named here by the same reference a user writes (`BUILT_IN`): each lives in
its task module with everything else of that task (controller/tasks/), a user of the
workflow API like any user's job, loaded only when a run names it.

It does not run the workflow or know what it does.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Callable

from flexmarl.runtime.user_modules import import_file

from ..state.failures import user_frame

# The built-in workflows by short name, for `run.workflow`.
BUILT_IN = {"digit_chain": "flexmarl.controller.tasks.digit_chain:episode"}


class WorkflowError(ValueError):
    """`run.workflow` does not name a usable episode function."""


def workflow_reference(spec: str) -> str:
    """`run.workflow` as a reference any process can import: a built-in's short name as
    its module's."""
    return BUILT_IN.get(spec, spec)


def load_workflow(spec: str) -> Callable:
    spec = workflow_reference(spec)
    if ":" not in spec:
        raise WorkflowError(f"run.workflow = {spec!r} is not a built-in ({', '.join(BUILT_IN)}) and not of the "
                            f"form 'package.module:function' or 'path/to/file.py:function'")
    where, name = spec.rsplit(":", 1)
    module = _import_file(where, spec) if where.endswith(".py") or "/" in where else _import_module(where, spec)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if inspect.iscoroutinefunction(v) and not n.startswith("_"))
        raise WorkflowError(f"run.workflow = {spec!r}: {where} has no {name!r}"
                            + (f" (its async functions: {', '.join(defined)})" if defined else ""))
    if not inspect.iscoroutinefunction(fn):
        raise WorkflowError(f"run.workflow = {spec!r}: {name} must be declared `async def {name}(ctx)`")
    if len(inspect.signature(fn).parameters) < 1:
        raise WorkflowError(f"run.workflow = {spec!r}: {name} must take the episode context: `async def {name}(ctx)`")
    return fn


def _import_module(dotted: str, spec: str):
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name and (dotted == exc.name or dotted.startswith(exc.name + ".")):
            raise WorkflowError(f"run.workflow = {spec!r}: no module named {exc.name!r}; install the package, "
                                f"add its folder to PYTHONPATH, or give a file path ('path/to/file.py:{spec.rsplit(':', 1)[1]}')") from None
        raise WorkflowError(f"run.workflow = {spec!r}: importing {dotted} failed: {exc}") from exc
    except Exception as exc:
        raise WorkflowError(f"run.workflow = {spec!r}: importing {dotted} failed: {type(exc).__name__}: {exc}") from exc


def _import_file(path_text: str, spec: str):
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise WorkflowError(f"run.workflow = {spec!r}: no file {path}")
    try:
        return import_file(path, "flexmarl_workflow")
    except Exception as exc:
        where = user_frame(exc)
        raise WorkflowError(f"run.workflow = {spec!r}: running {path} failed: {type(exc).__name__}: {exc}"
                            + (f" (at {where})" if where else "")) from exc
