"""Process start-up and task supervision shared by the controller and workers: uvloop,
one thread, logging, and `supervise` (the first failure stops everything)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any, Callable, Coroutine, Sequence, TypeVar

T = TypeVar("T")


def limit_threads(n: int = 1) -> None:
    """One compute thread per process: on small machines processes otherwise fight
    over cores and everything slows down many-fold."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(n)


def setup_logging(level: str = "INFO", name: str = "") -> None:
    fmt = f"%(asctime)s %(levelname).1s {name or '%(name)s'} %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=True)


def run_async(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Runs `main()` on uvloop (plain asyncio where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


class TaskEnded(Exception):
    """A supervised task that should have kept running ended, or failed."""

    def __init__(self, name: str, cause: BaseException | None) -> None:
        self.name = name
        self.cause = cause
        super().__init__(f"task {name!r} " + (f"failed: {cause!r}" if cause is not None else "ended early"))


async def supervise(tasks: Sequence[asyncio.Task], *, watch: Sequence[asyncio.Task] = (),
                    forever: bool = False) -> list[Any]:
    """The one "first failure stops everything" rule of every FlexMARL process.

    Waits for every task in `tasks` and returns their results in order. The first of them
    to raise cancels the others (and waits for them) and its exception is raised as is.
    With `forever`, the tasks are loops meant to run until cancelled: any of them ending,
    with or without an exception, is a failure and raises `TaskEnded` naming it.
    A task in `watch` (a background loop the caller owns, such as a receive loop) ending
    while `tasks` run is a failure too: `tasks` are cancelled and `TaskEnded` is raised;
    `watch` tasks are never cancelled here, their owner tears them down. If the caller is
    cancelled, `tasks` are cancelled with it."""
    tasks = list(tasks)
    pending = set(tasks)
    try:
        while pending:
            done, _ = await asyncio.wait(pending | set(watch), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in watch:
                    raise _ended(task)
                pending.discard(task)
                if task.cancelled() or task.exception() is not None or forever:
                    raise _ended(task) if forever else _exception_of(task)
        return [t.result() for t in tasks]
    finally:
        live = [t for t in tasks if not t.done()]
        for task in live:
            task.cancel()
        if live:
            await asyncio.gather(*live, return_exceptions=True)
        for task in tasks:  # a failure behind the one raised (or behind our cancellation) is seen, not reported
            if not task.cancelled():
                task.exception()


def _exception_of(task: asyncio.Task) -> BaseException:
    """What stopped a task that failed or was cancelled."""
    if task.cancelled():
        return asyncio.CancelledError(f"task {task.get_name()!r} was cancelled")
    exc = task.exception()
    assert exc is not None  # callers ask only of a task that failed
    return exc


def _ended(task: asyncio.Task) -> TaskEnded:
    cause = _exception_of(task) if task.cancelled() or task.exception() is not None else None
    return TaskEnded(task.get_name(), cause)
