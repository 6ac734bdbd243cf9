"""The environment worker's command handler: the workflow's functions, run in a process pool.

`EnvHandler` answers EnvSetup by starting its pool (pool.py: the workflow's module imported
in every process; an error names what failed) and saying what the sandbox can do on this
host (runtime/sandbox.py; logged here once where it cannot do everything). It hands each
call of an EnvCalls to the pool and sends the results back as they finish: everything
finished in one turn of its loop in one EnvResults per request, the last one `done`.
EnvCancel stops the calls it names. Its load (calls running and queued, sessions, busy
seconds) rides on every reply.

The handler's loop (`run`) serves the pool and sends the results; it decides nothing:
which call runs where and when to give up on one is the controller's (and the pool's
time limits).
"""

from __future__ import annotations

import asyncio
import logging
import time

from flexmarl.runtime import protocol, sandbox

from ..session import CommandHandler
from .pool import PoolError, ProcessPool

log = logging.getLogger("flexmarl.env")


class EnvHandler(CommandHandler):
    role = "env"

    def __init__(self) -> None:
        super().__init__()
        self.pool: ProcessPool | None = None
        self._pool_ready = asyncio.Event()
        self._setup: asyncio.Task | None = None
        self._finished: list[protocol.EnvResult] = []
        self._have_results = asyncio.Event()
        self._request_of: dict[int, int] = {}  # call id -> the EnvCalls request it came in
        self._open: dict[int, int] = {}  # request id -> its calls not yet answered

    async def handle(self, msg: protocol.Message, buffers: list) -> None:
        match msg:
            case protocol.EnvSetup():
                if self._setup is None:
                    self._setup = asyncio.create_task(self._start(msg), name="env-setup")
                else:  # the same controller asks again (a retried setup): the pool is the one it asked for
                    await self._setup
                    await self._ready_reply(msg)
            case protocol.EnvCalls():
                if self.pool is None:
                    await self.reply(protocol.Error(msg.request_id, "environment worker not set up: send EnvSetup first"))
                    return
                self._open[msg.request_id] = len(msg.calls)
                for call in msg.calls:
                    self._request_of[call.call_id] = msg.request_id
                    self.pool.submit(call)
                if not msg.calls:
                    await self.reply(protocol.EnvResults(msg.request_id, [], True, self.load()))
            case protocol.EnvCancel():
                if self.pool is not None:
                    self.pool.cancel(msg.call_ids)
            case _:
                await super().handle(msg, buffers)

    async def _start(self, setup: protocol.EnvSetup) -> None:
        started = time.monotonic()
        pool = ProcessPool(setup.workflow, setup.processes, setup.max_sessions, setup.memory_mb, self._finish)
        try:
            await pool.start()
        except PoolError as exc:
            log.error("%s", exc)
            await self.reply(protocol.Error(setup.request_id, str(exc)))
            return
        self.pool = pool
        self._pool_ready.set()
        caps = await asyncio.to_thread(sandbox.capabilities)
        if caps.missing:
            log.warning("the sandbox for model-written code cannot %s on this host", caps.missing)
        log.info("environment pool ready: %d processes for %s in %.1fs", setup.processes, setup.workflow,
                 time.monotonic() - started)
        await self._ready_reply(setup, time.monotonic() - started)

    async def _ready_reply(self, setup: protocol.EnvSetup, seconds: float = 0.0) -> None:
        if self.pool is None:
            await self.reply(protocol.Error(setup.request_id, "the environment pool could not start; see the "
                                                              "worker's log"))
            return
        caps = await asyncio.to_thread(sandbox.capabilities)
        await self.reply(protocol.EnvReady(setup.request_id, self.pool.processes, seconds, caps.missing))

    def _finish(self, result: protocol.EnvResult) -> None:
        self._finished.append(result)
        self._have_results.set()

    async def run(self) -> None:
        """Serves the pool once it is set up, and sends finished calls' results."""
        await asyncio.gather(self._serve_pool(), self._send_results())

    async def _serve_pool(self) -> None:
        await self._pool_ready.wait()
        assert self.pool is not None  # set with the event
        await self.pool.run()

    async def _send_results(self) -> None:
        while True:
            await self._have_results.wait()
            self._have_results.clear()
            finished, self._finished = self._finished, []
            by_request: dict[int, list[protocol.EnvResult]] = {}
            for result in finished:
                request = self._request_of.pop(result.call_id, None)
                if request is not None:
                    by_request.setdefault(request, []).append(result)
            for request, results in by_request.items():
                self._open[request] -= len(results)
                done = self._open[request] == 0
                if done:
                    del self._open[request]
                await self.reply(protocol.EnvResults(request, results, done, self.load()))

    def load(self) -> dict[str, float]:
        return self.pool.load() if self.pool is not None else {}

    def close(self) -> None:
        if self._setup is not None:
            self._setup.cancel()
        if self.pool is not None:
            self.pool.kill_now()
