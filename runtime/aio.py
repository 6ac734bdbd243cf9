"""Process start-up and task supervision shared by the controller and workers: uvloop,
one thread, logging, `supervise` (the first failure stops everything) and `StallWatch`
(an event loop held for more than a second is logged with what held it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, AsyncIterator, Callable, Coroutine, Sequence, TypeVar

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
            retrieved(task)


def retrieved(future: asyncio.Future) -> None:
    """Marks a done future's failure as seen, for one nobody may await (asyncio would log
    it as never retrieved); whoever needs to know learns of it another way."""
    if not future.cancelled():
        future.exception()


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


class StallWatch:
    """Notices when the event loop stops turning: a task in the loop marks every TICK_S
    that it turned, and a thread of its own looks at the mark. A loop held longer than
    `threshold_s` is logged once while held, with the innermost frames its thread is
    running ("what ran"), and again when it turns, with how long it was held. When the
    watching thread was held as long (the whole process was stopped, or starved of the
    CPU), it says that instead: nothing of ours ran.

    It changes nothing: it only tells. The loop's own work is kept short by its callers
    (proportional work goes to threads); this is how a regression shows."""

    TICK_S = 0.1

    def __init__(self, name: str, threshold_s: float = 1.0, log: logging.Logger | None = None) -> None:
        self.name = name
        self.threshold_s = threshold_s
        self.log = log or logging.getLogger("flexmarl.loop")
        self.stalls: list[tuple[float, str]] = []  # (seconds held, what ran), for tests and benches
        self._mark = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticker: asyncio.Task | None = None

    def start(self) -> None:
        """Starts watching the running loop (call from it); `stop()` ends it."""
        self._loop_thread = threading.get_ident()
        self._mark = time.monotonic()
        self._ticker = asyncio.create_task(self._tick(), name="stall-watch")
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[StallWatch]:
        """Watches the running loop while the block runs."""
        self.start()
        try:
            yield self
        finally:
            await self.stop()

    async def _tick(self) -> None:
        while True:
            self._mark = time.monotonic()
            await asyncio.sleep(self.TICK_S)

    def _watch(self) -> None:
        period = min(0.25, self.threshold_s / 4)
        held_by, longest, told = "", 0.0, False
        woke, cpu = time.monotonic(), time.process_time()
        while not self._stop.wait(period):
            now, cpu_now = time.monotonic(), time.process_time()
            overslept, used = now - woke - period, cpu_now - cpu
            woke, cpu = now, cpu_now
            held = now - self._mark - self.TICK_S
            if held > self.threshold_s:
                if not held_by:
                    held_by = self._why(overslept, used)
                longest = held
                if not told and overslept <= self.threshold_s:
                    self.log.warning("%s: the event loop has been held for %.1fs; it is running: %s", self.name,
                                     held, held_by)
                    told = True
            elif held_by:
                self.stalls.append((longest, held_by))
                self.log.warning("%s: the event loop was held for about %.1fs by %s", self.name, longest, held_by)
                held_by, longest, told = "", 0.0, False

    def _why(self, overslept: float, used: float) -> str:
        """What held the loop, seen from this thread: the loop thread's frames, or (when this
        thread could not run either) whether the process ran at all meanwhile."""
        if overslept <= self.threshold_s:
            return self._running()
        if used < 0.1 * overslept:
            return "nothing of ours: the whole process was held (stopped, or starved of the CPU)"
        return f"code that kept this thread from running too (the loop's thread is now at: {self._running()})"

    def _running(self) -> str:
        """The innermost frames of the loop's thread, one line: file:line in function, outermost last."""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return "(its thread is gone)"
        frames = traceback.extract_stack(frame)[-6:]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames))
