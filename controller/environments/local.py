"""Tool, environment and reward calls in the controller itself, where there is no
environment worker (`cluster.env_workers = 0`): the same calls, run off the event loop.

`run_here(executor, fn, args, kwargs, timeout_s)` runs a blocking function in the
controller's bounded tool pool (`pipeline.tool_threads` threads; an async one is awaited)
and raises TimeoutError past `timeout_s`: the episode that called fails, no other waits
for it. A thread cannot be stopped: a timed-out blocking call keeps its pool thread until
it returns. `LocalSession` is a session (`ctx.env_session`) whose object lives here and
whose methods run the same way. Nothing here needs its arguments to be sendable.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import Executor
from typing import Any, Callable, Coroutine

from .references import describe

log = logging.getLogger("flexmarl.environments")


async def run_here(executor: Executor | None, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                   timeout_s: float) -> Any:
    if asyncio.iscoroutinefunction(fn):
        work = fn(*args, **kwargs)
    else:
        work = asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))
    try:
        return await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{describe(fn)} did not return within {timeout_s:.1f}s") from None


class LocalSession:
    """A stateful environment held in the controller for one episode: `await env.step(a)`,
    or `await env.call("step", a, timeout=5)`."""

    def __init__(self, obj: Any, executor: Executor | None, timeout_s: float) -> None:
        self._obj = obj
        self._executor = executor
        self._timeout_s = timeout_s

    @classmethod
    async def open(cls, factory: Callable[..., Any], args: tuple, kwargs: dict[str, Any], executor: Executor | None,
                   timeout_s: float) -> "LocalSession":
        return cls(await run_here(executor, factory, args, kwargs, timeout_s), executor, timeout_s)

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return await run_here(self._executor, getattr(self._obj, method), args, kwargs, timeout or self._timeout_s)

    def __getattr__(self, method: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if method.startswith("_"):
            raise AttributeError(method)
        return functools.partial(self.call, method)

    def close_soon(self) -> None:
        """Runs the object's close() (if it has one) in the tool pool; waits for nothing."""
        close = getattr(self._obj, "close", None)
        if not callable(close):
            return
        if asyncio.iscoroutinefunction(close):
            task = asyncio.ensure_future(close())
            task.add_done_callback(_log_failure)
        else:
            future = asyncio.get_running_loop().run_in_executor(self._executor, close)
            future.add_done_callback(_log_failure)


def _log_failure(future: "asyncio.Future[Any]") -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("an environment session's close() failed: %r", future.exception())
