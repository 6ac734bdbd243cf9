"""An environment worker's process pool: where its calls run, each under its time limit.

`ProcessPool` keeps `processes` processes (process.py) for stateless calls, each running
one call at a time (PIPELINE says why not two) and taking the next from one queue, so a
call goes to whichever process frees up first. A session (op "open") gets a process of its own, for its life:
its object lives there, its calls run there in order, and "close" ends it. At most
`max_sessions` are open at once (another's "open" waits for one to close); one spare
process is kept started, so an "open" rarely waits for a process to start.

Every call submitted is reported exactly once through `report` (the worker sends it):

- its value, or the error its function raised;
- "timeout": it ran `timeout_s` (from the start of its run, not of its wait in the queue):
  its process is killed and another started;
- "crashed": its process died under it (a segfault, a memory limit, `os._exit`): another
  is started;
- "cancelled": the controller gave up on it (`cancel`): dropped from the queue, or its
  process killed;
- "session_lost": its session's process died, or there is no such session here.

A session whose process died stays known as lost until its "close", so later calls of it
fail at once. Processes of a session or a pool slot that die are never restarted for the
session; a slot starts a new one before its next call.

It knows nothing of sockets to the controller or of the workflow's meaning.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

import msgspec

from flexmarl.runtime import protocol

from .process import HEADER, READY

log = logging.getLogger("flexmarl.env")

START_TIMEOUT_S = 120.0  # for a process to import the workflow's module
# Stateless calls in one process's channel at once. 1: a call never waits behind another in
# a channel. At 2 a process would never idle between two calls (more calls per second on a
# loaded machine), but a call queued behind one that hangs would wait for that one's time
# limit, and likely run past its own: one hung call would cost two episodes.
PIPELINE = 1

_results = msgspec.msgpack.Decoder(protocol.EnvResult)
_encode = msgspec.msgpack.Encoder().encode


class PoolError(RuntimeError):
    """The pool cannot run: its processes cannot import the workflow's module."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class NotStarted(Exception):
    """A call queued in a process's channel that never began: the process died first."""


@dataclass
class _InFlight:
    call: protocol.EnvCall
    future: asyncio.Future
    started: float = 0.0  # when its turn in the process came
    cancelled: bool = False  # nobody waits for it: its result is reported as cancelled


class PoolProcess:
    """One started process (process.py) and its channel. Calls sent to it run one at a
    time, in order (the pool sends up to PIPELINE at once). A call's time limit counts
    from when it began: when the call before it was answered."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self.reader = reader
        self.writer = writer
        self.stopping = ""  # why this side is killing it (a time limit, a cancel)
        self.inflight: collections.deque[_InFlight] = collections.deque()
        self.room = asyncio.Event()  # set when a call left its channel (or it died)
        self._timer: asyncio.TimerHandle | None = None
        self._reading: asyncio.Task | None = None

    @classmethod
    async def start(cls, workflow: str, memory_mb: int) -> "PoolProcess":
        """A process that has imported the workflow's module; PoolError saying why not."""
        mine, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "flexmarl.workers.env.process", "--fd", str(theirs.fileno()),
                "--workflow", workflow, "--memory-mb", str(memory_mb), "--parent-pid", str(os.getpid()),
                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=mine)
        process = cls(proc, reader, writer)
        try:
            hello = await asyncio.wait_for(process._read(), START_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            await process.close()
            raise PoolError(f"an environment process did not start: it {describe_exit(proc.returncode)}; see the "
                            f"worker's log") from None
        except asyncio.CancelledError:  # the pool is closing: the process is not left behind
            process.stop("closed")
            await asyncio.shield(proc.wait())
            raise
        if hello.call_id != READY or hello.failure:
            await process.close()
            raise PoolError(f"an environment process could not import the workflow {workflow!r}: {hello.error}")
        process._reading = asyncio.ensure_future(process._read_results())
        return process

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self.stopping

    def send(self, call: protocol.EnvCall) -> asyncio.Future:
        """Queues the call in the process's channel: a future of its result. Past its time
        limit, or once `stop` is called while it runs, the process is killed and the result
        says why; a call that had not begun then fails with NotStarted (to run elsewhere)."""
        item = _InFlight(call, asyncio.get_running_loop().create_future())
        if not self.alive:
            item.future.set_exception(NotStarted())
            return item.future
        body = _encode(call)
        self.writer.write(HEADER.pack(len(body)) + body)
        self.inflight.append(item)
        if len(self.inflight) == 1:
            self._begin(item)
        return item.future

    async def run(self, call: protocol.EnvCall) -> protocol.EnvResult:
        """The call's result, sent alone (a session's calls)."""
        try:
            return await self.send(call)
        except NotStarted:
            return protocol.EnvResult(call.call_id, failure="crashed",
                                      error=f"the process for {call.name} had died before it began")

    def cancel(self, call_id: int) -> None:
        """A running call's process is stopped; one waiting in the channel runs, but is
        reported cancelled."""
        for i, item in enumerate(self.inflight):
            if item.call.call_id == call_id:
                if i == 0:
                    self.stop("cancelled")
                item.cancelled = True

    def stop(self, why: str) -> None:
        """Kills the process now; the call running in it ends as `why` says."""
        self.stopping = self.stopping or why
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def close(self) -> None:
        self.stop("closed")
        self.writer.close()
        await self.proc.wait()
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)

    def _begin(self, item: _InFlight) -> None:
        item.started = time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(item.call.timeout_s, self._expired, item)

    def _expired(self, item: _InFlight) -> None:
        if self.inflight and self.inflight[0] is item:
            self.stop("timeout")

    async def _read_results(self) -> None:
        try:
            while True:
                result = await self._read()
                item = self.inflight.popleft()
                if self._timer is not None:
                    self._timer.cancel()
                if self.inflight:
                    self._begin(self.inflight[0])
                if item.cancelled:
                    result = protocol.EnvResult(item.call.call_id, failure="cancelled", seconds=result.seconds,
                                                error=f"{item.call.name} was cancelled")
                item.future.set_result(result)
                self.room.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self._died(await self.proc.wait())

    def _died(self, code: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        items, self.inflight = list(self.inflight), collections.deque()
        if items:
            head, call = items[0], items[0].call
            seconds = time.monotonic() - head.started
            if self.stopping == "timeout":
                result = protocol.EnvResult(call.call_id, failure="timeout", seconds=seconds,
                                            error=f"{call.name} did not return within {call.timeout_s:g}s; the "
                                                  f"process running it was stopped")
            elif self.stopping == "cancelled" or head.cancelled:
                result = protocol.EnvResult(call.call_id, failure="cancelled", seconds=seconds,
                                            error=f"{call.name} was cancelled; the process running it was stopped")
            else:
                result = protocol.EnvResult(call.call_id, failure="crashed", seconds=seconds,
                                            error=f"the process running {call.name} died under it "
                                                  f"({describe_exit(code)})")
            head.future.set_result(result)
            for item in items[1:]:
                if item.cancelled:
                    item.future.set_result(protocol.EnvResult(item.call.call_id, failure="cancelled",
                                                              error=f"{item.call.name} was cancelled before it ran"))
                else:
                    item.future.set_exception(NotStarted())
        self.room.set()

    async def _read(self) -> protocol.EnvResult:
        head = await self.reader.readexactly(HEADER.size)
        return _results.decode(await self.reader.readexactly(HEADER.unpack(head)[0]))


@dataclass
class Session:
    """A session's process and the calls waiting for it."""

    session_id: str
    queue: collections.deque[protocol.EnvCall] = field(default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    process: PoolProcess | None = None
    running: int = 0  # the call id it runs now; 0: none
    lost: str = ""  # why its process is gone


class ProcessPool:
    def __init__(self, workflow: str, processes: int, max_sessions: int, memory_mb: int,
                 report: Callable[[protocol.EnvResult], None]) -> None:
        self.workflow = workflow
        self.processes = processes
        self.memory_mb = memory_mb
        self.report = report
        self.queue: collections.deque[protocol.EnvCall] = collections.deque()
        self._queued = asyncio.Event()
        self.running: dict[int, PoolProcess] = {}  # call id -> the process running it
        self.cancelled: set[int] = set()  # queued calls cancelled; skipped when taken
        self.sessions: dict[str, Session] = {}
        self._session_slots = asyncio.Semaphore(max_sessions)
        self._slots: list[PoolProcess | None] = []
        self._spare: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.busy_s = 0.0  # seconds the processes spent running calls
        self.calls = 0

    async def start(self) -> None:
        """Starts the stateless processes (and a spare for sessions); PoolError if any
        cannot import the workflow's module."""
        started = await asyncio.gather(*(PoolProcess.start(self.workflow, self.memory_mb)
                                         for _ in range(self.processes)), return_exceptions=True)
        failed = next((r for r in started if isinstance(r, BaseException)), None)
        if failed is not None:
            for process in started:
                if isinstance(process, PoolProcess):
                    await process.close()
            raise failed
        self._slots = [p for p in started if isinstance(p, PoolProcess)]
        self._spare = asyncio.create_task(PoolProcess.start(self.workflow, self.memory_mb))

    async def run(self) -> None:
        """Serves the queue with every slot, until cancelled."""
        await asyncio.gather(*(self._serve(i) for i in range(len(self._slots))))

    def submit(self, call: protocol.EnvCall) -> None:
        if not call.session:
            self.queue.append(call)
            self._queued.set()
            return
        session = self.sessions.get(call.session)
        if call.op == "open":
            if session is not None:
                self._answer(call, "refused", f"session {call.session} is already open on this worker")
                return
            session = self.sessions[call.session] = Session(call.session)
            self._spawn(self._hold(session, call))
            return
        if session is None:
            self._answer(call, "session_lost", f"session {call.session} is not open on this worker (its worker was "
                                               f"restarted, or it was closed)")
            return
        session.queue.append(call)
        session.wake.set()

    def cancel(self, call_ids: list[int]) -> None:
        for call_id in call_ids:
            process = self.running.get(call_id)
            if process is not None:
                process.cancel(call_id)
            else:
                self.cancelled.add(call_id)

    def load(self) -> dict[str, float]:
        return {"running": float(len(self.running)), "queued": float(len(self.queue)),
                "sessions": float(len(self.sessions)), "busy_s": self.busy_s}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        processes = [p for p in self._slots if p is not None]
        processes += [s.process for s in self.sessions.values() if s.process is not None]
        if self._spare is not None:
            self._spare.cancel()
            spare = await asyncio.gather(self._spare, return_exceptions=True)
            processes += [p for p in spare if isinstance(p, PoolProcess)]
        await asyncio.gather(*(p.close() for p in processes), return_exceptions=True)

    def kill_now(self) -> None:
        """Kills every process at once (the worker is exiting and cannot wait)."""
        for process in [p for p in self._slots if p is not None] + [
                s.process for s in self.sessions.values() if s.process is not None]:
            process.stop("closed")

    # ------------------------------------------------------------ stateless calls

    async def _serve(self, slot: int) -> None:
        """Keeps the slot's process fed: up to PIPELINE calls in its channel."""
        while True:
            process = self._slots[slot]
            if process is None or not process.alive:
                process = self._slots[slot] = await self._replacement()
                if process is None:
                    call = await self._next()
                    self._answer(call, "crashed", f"no process could be started to run {call.name}; see the "
                                                  f"worker's log")
                    continue
            while process.alive and len(process.inflight) >= PIPELINE:
                process.room.clear()
                await process.room.wait()
            call = await self._next()
            if not process.alive:
                self.queue.appendleft(call)  # it died meanwhile: the next process takes it
                continue
            self.running[call.call_id] = process
            process.send(call).add_done_callback(functools.partial(self._sent_done, call))

    def _sent_done(self, call: protocol.EnvCall, future: asyncio.Future) -> None:
        del self.running[call.call_id]
        if isinstance(future.exception(), NotStarted):
            self.queue.appendleft(call)  # it never began: it runs in the slot's next process
            self._queued.set()
            return
        self._finished(call, future.result())

    async def _next(self) -> protocol.EnvCall:
        while True:
            while not self.queue:
                self._queued.clear()
                await self._queued.wait()
            call = self.queue.popleft()
            if call.call_id in self.cancelled:
                self.cancelled.discard(call.call_id)
                self._answer(call, "cancelled", f"{call.name} was cancelled before it ran")
                continue
            return call

    async def _replacement(self) -> PoolProcess | None:
        try:
            return await PoolProcess.start(self.workflow, self.memory_mb)
        except PoolError as exc:
            log.error("%s", exc)
            await asyncio.sleep(1.0)  # not a tight loop of failing starts
            return None

    async def _run(self, process: PoolProcess, call: protocol.EnvCall) -> protocol.EnvResult:
        self.running[call.call_id] = process
        try:
            result = await process.run(call)
        finally:
            del self.running[call.call_id]
        self._finished(call, result)
        return result

    def _finished(self, call: protocol.EnvCall, result: protocol.EnvResult) -> None:
        self.busy_s += result.seconds
        self.calls += 1
        if result.failure in ("timeout", "crashed"):
            log.warning("%s%s", result.error, f" (episode {call.episode})" if call.episode else "")
        self.report(result)

    def _answer(self, call: protocol.EnvCall, failure: protocol.EnvFailure, error: str) -> None:
        value = b"" if failure else _encode(None)
        self.report(protocol.EnvResult(call.call_id, value, failure=failure, error=error))

    # ------------------------------------------------------------ sessions

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hold(self, session: Session, opening: protocol.EnvCall) -> None:
        """A session's life: its process, its "open", its calls in order, its "close"."""
        try:
            async with self._session_slots:
                session.process = await self._take_spare()
                if session.process is None:
                    self._answer(opening, "crashed", f"no process could be started for session {session.session_id}")
                elif not (await self._run(session.process, opening)).failure:
                    await self._serve_session(session)
                    return
                self._drop(session, "it did not open")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a silent end: its calls are answered
            log.exception("session %s failed", session.session_id)
            session.lost = f"the worker failed it: {exc!r}"
            await self._serve_session(session)
        finally:
            if session.process is not None:
                await session.process.close()

    def _drop(self, session: Session, why: str) -> None:
        """Forgets a session that never opened; what was sent for it fails."""
        del self.sessions[session.session_id]
        for late in session.queue:
            self._answer(late, "session_lost", f"session {session.session_id} is lost: {why}")

    async def _serve_session(self, session: Session) -> None:
        while True:
            while not session.queue:
                session.wake.clear()
                await session.wake.wait()
            call = session.queue.popleft()
            if call.call_id in self.cancelled:
                self.cancelled.discard(call.call_id)
                self._answer(call, "cancelled", f"{call.name} was cancelled before it ran")
            elif session.lost or session.process is None or not session.process.alive:
                session.lost = session.lost or "its process died"
                if call.op == "close":
                    self._answer(call, "", "")
                else:
                    self._answer(call, "session_lost", f"session {session.session_id} is lost: {session.lost}")
            else:
                result = await self._run(session.process, call)
                if result.failure in ("timeout", "crashed", "cancelled"):
                    session.lost = f"its process was stopped ({result.failure})"
            if call.op == "close":
                self._drop(session, "it was closed")  # what was sent after its close never runs
                return

    async def _take_spare(self) -> PoolProcess | None:
        spare, self._spare = self._spare, asyncio.create_task(PoolProcess.start(self.workflow, self.memory_mb))
        if spare is not None:
            try:
                process = await spare
                if process.alive:
                    return process
            except PoolError as exc:
                log.error("%s", exc)
        return await self._replacement()
