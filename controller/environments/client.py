"""The workflow's tool, environment and reward calls, routed to environment workers.

`EnvClient.call(fn, args, kwargs, timeout, episode)` sends one call of `fn` (by reference,
its arguments as msgpack: references.py) and returns its value, decoded. Calls queued in
one turn of the event loop are routed together (routing.py: the least loaded worker per
process; a session's calls to the worker it lives on) and go out as one EnvCalls message
per worker. `open_session` opens a stateful environment on one worker for an episode;
its calls run in order in the process that holds it (`EnvSession`).

What can happen to a call, each one line naming the function (and, through the
episode's failure, the episode):

- its function raised, its process crashed, its result cannot be sent: `EnvCallFailed`;
- it ran past `timeout` (from when it was asked for, queueing included): `TimeoutError`,
  and it is cancelled on its worker (EnvCancel), which stops its process;
- its worker died, or hung and was declared dead: `EnvWorkerLost`, or, for a stateless
  call with `env.retries` left, it is sent to another worker; a session on a dead worker
  is lost, and every later call of it fails at once;
- no worker is set up and none is on its way back (`expected`): `EnvWorkerLost` too.

Workers: `start(ids)` sets up the workers registered at the run's start (EnvSetup, answered
by EnvReady once each has imported the workflow's module in its pool; a worker that
cannot stops the run: `EnvSetupFailed`); one that registers later (`joined`, a restarted
worker) is set up by `run()` and routed to from then on; `died` takes one out.

The client counts (`counts`) and routes; it never runs a function and holds no result
longer than it takes to hand it over, so the controller's memory does not grow with the
tools'.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Protocol, Sequence

from flexmarl.runtime import protocol
from flexmarl.runtime.config import EnvConfig

from ..control.registry import WorkerInfo, WorkerRegistry
from ..control.server import RemoteError, ReplyHandler, WorkerDied
from . import routing
from .references import decode, describe, encode_arguments, label, reference

log = logging.getLogger("flexmarl.environments")

CLOSE_TIMEOUT_S = 30.0  # a session's close() may take this long on its worker
SETUP_TIMEOUT_S = 300.0  # for a worker's pool to start (its processes import the workflow's module)
POLL_S = 0.5  # how often `run` looks whether the run is finished
WORKER_WAIT_S = 60.0  # a call waits this long for a worker when none is set up (longer while one is expected)


class EnvCallFailed(RuntimeError):
    """An environment call failed on its worker: its function raised, its process died, its
    result could not be sent back. The worker is fine."""


class EnvWorkerLost(RuntimeError):
    """The environment worker holding a call (or a session) died; no worker is left."""


class EnvSetupFailed(RuntimeError):
    """An environment worker cannot run the workflow's functions (its module does not import there)."""


class EnvServer(Protocol):
    """What the client needs of the controller's server (control/server.py)."""

    @property
    def registry(self) -> WorkerRegistry: ...

    @property
    def closing(self) -> bool: ...

    def next_request_id(self) -> int: ...

    async def call(self, worker_id: str, msg: protocol.Message, buffers: Sequence[Any] = (),
                   timeout: float | None = None,
                   on_sent: Callable[[], None] | None = None) -> tuple[Any, list[Any]]: ...

    def stream(self, worker_id: str, msg: protocol.Message, on_reply: ReplyHandler | None,
               buffers: Sequence[Any] = ()) -> asyncio.Future: ...

    async def send_request(self, worker_id: str, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None: ...


@dataclass
class _Pending:
    """One call until its result is handed over."""

    call: protocol.EnvCall
    future: asyncio.Future
    label: str  # "module.name" (a session's call: "Factory.method"), in every message about it
    worker: str = ""  # where it was sent; "" while queued
    tries: int = 0


@dataclass
class _Worker:
    processes: int
    outstanding: int = 0  # calls sent and not yet answered


@dataclass
class _Place:
    """Where a session lives."""

    worker: str
    label: str
    lost: str = ""


class EnvSession:
    """A stateful environment on one environment worker, for one episode:
    `await env.step(action)` (any public method of the object its factory made) or
    `await env.call("step", action, timeout=5)`. Closed by the `async with` that opened it."""

    def __init__(self, client: "EnvClient", session_id: str, label: str, timeout_s: float, episode: str) -> None:
        self._client = client
        self.session_id = session_id
        self._label = label
        self._timeout_s = timeout_s
        self._episode = episode

    async def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return await self._client.session_call(self, method, args, kwargs, timeout or self._timeout_s)

    def __getattr__(self, method: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if method.startswith("_"):
            raise AttributeError(method)
        return functools.partial(self.call, method)

    def close_soon(self) -> None:
        """Closes it on its worker (its object's close() runs there); waits for nothing."""
        self._client.close_session(self)


class EnvClient:
    def __init__(self, server: EnvServer, workflow: str, cfg: EnvConfig, *,
                 expected: Callable[[], bool] = lambda: False, finished: Callable[[], bool] = lambda: False,
                 worker_wait_s: float = WORKER_WAIT_S) -> None:
        self.server = server
        self.workflow = workflow  # run.workflow as resolved: what every worker's pool imports
        self.cfg = cfg
        self.expected = expected  # an environment worker is on its way back (the launcher restarts one)
        self.finished = finished  # every batch is trained: `run` ends
        self.worker_wait_s = worker_wait_s
        self.ready: dict[str, _Worker] = {}  # workers set up, that calls are routed to
        self.sessions: dict[str, _Place] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(1)
        self._queued: list[_Pending] = []
        self._flush_scheduled = False
        self._waiting: list[_Pending] = []  # calls waiting for a worker to be set up
        self._setting_up: set[str] = set()
        self._joins: asyncio.Queue[str] = asyncio.Queue()
        self._started = False
        self._told_sandbox = False
        self._tasks: set[asyncio.Task] = set()
        self.closed = False

    # ------------------------------------------------------------ workers

    async def start(self, worker_ids: Sequence[str]) -> None:
        """Sets up the workers registered at the run's start; EnvSetupFailed if any cannot."""
        self._started = True
        outcomes = await asyncio.gather(*(self._set_up(w) for w in worker_ids), return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed

    def joined(self, info: WorkerInfo) -> None:
        if info.role == "env" and self._started:
            self._joins.put_nowait(info.worker_id)

    def died(self, info: WorkerInfo) -> None:
        if info.role != "env" or self.ready.pop(info.worker_id, None) is None:
            return
        for place in self.sessions.values():
            if place.worker == info.worker_id and not place.lost:
                place.lost = f"its environment worker {info.worker_id} died ({info.why_gone})"
        # Its calls in flight fail through their messages (WorkerDied): _message_ended.

    async def run(self) -> None:
        """Consumes environment workers that register after the start (a restarted one);
        produces them set up and routed to. Ends once every batch is trained."""
        while not self.finished():
            try:
                worker_id = await asyncio.wait_for(self._joins.get(), POLL_S)
            except asyncio.TimeoutError:
                continue
            if worker_id in self.ready or worker_id in self._setting_up:
                continue
            try:
                await self._set_up(worker_id)
            except (EnvSetupFailed, WorkerDied, asyncio.TimeoutError) as exc:
                log.error("environment worker %s was not set up: %s", worker_id, exc)
            else:
                log.info("environment worker %s is back: calls go to it again", worker_id)

    async def _set_up(self, worker_id: str) -> None:
        self._setting_up.add(worker_id)
        setup = protocol.EnvSetup(self.server.next_request_id(), self.workflow, self.cfg.processes,
                                  self.cfg.max_sessions, self.cfg.process_memory_mb)
        try:
            reply, _ = await self.server.call(worker_id, setup, timeout=SETUP_TIMEOUT_S)
        except RemoteError as exc:
            raise EnvSetupFailed(f"environment worker {worker_id} cannot run the workflow's functions: "
                                 f"{str(exc).split(': ', 1)[-1]}") from None
        finally:
            self._setting_up.discard(worker_id)
        assert isinstance(reply, protocol.EnvReady)  # EnvSetup's reply
        info = self.server.registry.workers.get(worker_id)
        if info is None or not info.alive:
            raise WorkerDied(worker_id, "gone while being set up")
        self.ready[worker_id] = _Worker(reply.processes)
        if reply.sandbox and not self._told_sandbox:
            self._told_sandbox = True
            log.warning("the sandbox for model-written code cannot %s on %s's host", reply.sandbox, worker_id)
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            self._queue(waiting)

    # ------------------------------------------------------------ calls

    async def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float,
                   episode: str = "") -> Any:
        module, name = reference(fn)
        call = protocol.EnvCall(next(self._ids), module, name,
                                encode_arguments(f"ctx.call({name}, ...)", args, kwargs), timeout_s, episode=episode)
        return await self._ask(call, label(module, name), timeout_s)

    async def open_session(self, factory: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float,
                           episode: str = "") -> EnvSession:
        module, name = reference(factory)
        session_id = f"{episode}#{next(self._ids)}"
        call = protocol.EnvCall(next(self._ids), module, name,
                                encode_arguments(f"ctx.env_session({name}, ...)", args, kwargs), timeout_s,
                                op="open", session=session_id, episode=episode)
        await self._ask(call, label(module, name), timeout_s)
        return EnvSession(self, session_id, name, timeout_s, episode)

    async def session_call(self, session: EnvSession, method: str, args: tuple, kwargs: dict[str, Any],
                           timeout_s: float) -> Any:
        what = f"{session._label}.{method}"
        place = self.sessions.get(session.session_id)
        if place is None:
            raise EnvWorkerLost(f"{what}: session {session.session_id} is closed")
        if place.lost:
            raise EnvWorkerLost(f"{what}: its session is lost: {place.lost}")
        call = protocol.EnvCall(next(self._ids), "", method, encode_arguments(what, args, kwargs), timeout_s,
                                session=session.session_id, episode=session._episode)
        return await self._ask(call, what, timeout_s)

    def close_session(self, session: EnvSession) -> None:
        place = self.sessions.get(session.session_id)
        if place is None:
            return
        if place.lost or self.closed:
            self._forget_session(session.session_id)
            return
        call = protocol.EnvCall(next(self._ids), "", "close", encode_arguments("close", (), {}), CLOSE_TIMEOUT_S,
                                op="close", session=session.session_id, episode=session._episode)
        closing = asyncio.get_running_loop().create_future()
        closing.add_done_callback(_log_close)  # nobody waits for a close: a failure is logged, never raised
        self._queue([_Pending(call, closing, f"{session._label}.close")])

    async def _ask(self, call: protocol.EnvCall, label: str, timeout_s: float) -> Any:
        pending = _Pending(call, asyncio.get_running_loop().create_future(), label)
        self.counts["calls"] += 1
        self._queue([pending])
        try:
            return await asyncio.wait_for(pending.future, timeout_s)
        except asyncio.TimeoutError:
            self.counts["timed_out"] += 1
            self._cancel(pending)
            raise TimeoutError(f"{label} did not return within {timeout_s:.1f}s") from None
        except asyncio.CancelledError:
            self._cancel(pending)
            raise

    def _cancel(self, pending: _Pending) -> None:
        """Nobody waits for it any more: its worker stops it (a queued one is never sent)."""
        if pending.worker and pending.worker in self.ready:
            cancel = protocol.EnvCancel(self.server.next_request_id(), [pending.call.call_id])
            self._start(self.server.send_request(pending.worker, cancel))

    # ------------------------------------------------------------ routing, once per loop turn

    def _queue(self, pendings: list[_Pending]) -> None:
        self._queued += pendings
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, []
        bound: dict[str, list[_Pending]] = collections.defaultdict(list)
        load = {w: s.outstanding for w, s in self.ready.items()}  # counted as calls are routed
        capacity = {w: s.processes for w, s in self.ready.items()}
        held: collections.Counter[str] | None = None  # live sessions per worker, counted once a turn if needed
        for pending in queued:
            if pending.future.done() and pending.call.op != "close":
                continue  # timed out or cancelled before it went
            if held is None and pending.call.session:
                held = collections.Counter(p.worker for p in self.sessions.values() if not p.lost)
            worker = self._route(pending, load, capacity, held)
            if worker is None:
                continue
            pending.worker = worker
            pending.tries += 1
            self.ready[worker].outstanding += 1
            load[worker] += 1
            bound[worker].append(pending)
        for worker, pendings in bound.items():
            self._send(worker, pendings)

    def _route(self, pending: _Pending, load: dict[str, int], capacity: dict[str, int],
               held: collections.Counter[str] | None) -> str | None:
        """The worker for this call, or None (it waits for one, or has failed); `held`: the
        live sessions per worker (given for a session's call), kept as sessions open and close."""
        call = pending.call
        if call.op == "open":
            assert held is not None
            worker = routing.place_session(held, load, capacity)
            if worker is not None:
                self.sessions[call.session] = _Place(worker, pending.label)
                held[worker] += 1
        elif call.session:
            place = self.sessions.get(call.session)
            if place is None or place.lost or place.worker not in self.ready:
                why = place.lost if place is not None and place.lost else "it is closed"
                self._fail(pending, EnvWorkerLost(f"{pending.label}: its session is lost: {why}"))
                return None
            worker = place.worker
            if call.op == "close":
                self._forget_session(call.session)
                assert held is not None
                held[worker] -= 1
        else:
            worker = routing.least_loaded(load, capacity)
        if worker is None:
            self._wait_for_worker(pending)
        return worker

    def _forget_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def _wait_for_worker(self, pending: _Pending) -> None:
        self._waiting.append(pending)
        if len(self._waiting) == 1:
            self._start(self._worker_for_waiting())

    async def _worker_for_waiting(self) -> None:
        """Waits for a worker to be set up (the waiting calls are routed once one is:
        `_set_up`); past `worker_wait_s` with none on its way back, they fail."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.worker_wait_s
        while self._waiting and not self.ready:
            if self.expected() or self._setting_up or not self._joins.empty():
                deadline = loop.time() + self.worker_wait_s
            elif loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        if self._waiting and not self.ready:
            gone = [f"{w.worker_id} ({w.why_gone})" for w in self.server.registry.workers.values()
                    if w.role == "env" and not w.alive]
            failure = (f"no environment worker was up for {self.worker_wait_s:g}s and none is being restarted"
                       + (f" (gone: {', '.join(gone)})" if gone else ""))
            waiting, self._waiting = self._waiting, []
            for pending in waiting:
                self._fail(pending, EnvWorkerLost(f"{pending.label}: {failure}"))

    # ------------------------------------------------------------ messages

    def _send(self, worker: str, pendings: list[_Pending]) -> None:
        msg = protocol.EnvCalls(self.server.next_request_id(), [p.call for p in pendings])
        waiting = {p.call.call_id: p for p in pendings}
        future = self.server.stream(worker, msg, lambda reply, _: self._replied(worker, waiting, reply))
        future.add_done_callback(lambda f: self._message_ended(worker, waiting, f))
        self._start(self.server.send_request(worker, msg))

    def _replied(self, worker: str, waiting: dict[int, _Pending], msg: protocol.Message) -> bool:
        assert isinstance(msg, protocol.EnvResults)  # EnvCalls' reply
        state = self.ready.get(worker)
        for result in msg.results:
            pending = waiting.pop(result.call_id, None)
            if pending is None:
                log.warning("%s answered an unknown or repeated call %d", worker, result.call_id)
                continue
            if state is not None:
                state.outstanding -= 1
            self._answered(worker, pending, result)
        return msg.done

    def _answered(self, worker: str, pending: _Pending, result: protocol.EnvResult) -> None:
        call = pending.call
        if result.failure:
            if result.failure != "cancelled":
                self.counts["failed"] += 1
            if call.op == "open":
                self._forget_session(call.session)
            if pending.future.done():
                return
            failure = EnvCallFailed(f"{pending.label} failed on {worker}: {result.error}")
            if result.detail:
                failure.add_note(result.detail)
            pending.future.set_exception(failure)
            return
        if pending.future.done():  # nobody waits: an opened session is closed again at once
            if call.op == "open" and call.session in self.sessions:
                self.close_session(EnvSession(self, call.session, pending.label, CLOSE_TIMEOUT_S, call.episode))
            return
        try:
            pending.future.set_result(decode(result.value))
        except Exception as exc:  # a worker's bytes that do not decode fail this call alone
            pending.future.set_exception(EnvCallFailed(f"{pending.label}: {worker} sent back a value that does "
                                                       f"not decode: {exc}"))

    def _message_ended(self, worker: str, waiting: dict[int, _Pending], future: asyncio.Future) -> None:
        """The message's last reply came, or its worker died or refused it: what it left
        unanswered is sent again (stateless, with retries left) or fails."""
        if not waiting:
            return
        pendings = list(waiting.values())
        waiting.clear()
        state = self.ready.get(worker)
        if state is not None:
            state.outstanding -= len(pendings)
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        again = []
        for pending in pendings:
            in_session = bool(pending.call.session)
            if isinstance(exc, WorkerDied) and not self.closed and not self.server.closing and \
                    routing.retry_after_loss(pending.tries, self.cfg.retries, in_session):
                again.append(pending)
                continue
            if isinstance(exc, WorkerDied):
                self.counts["lost"] += 1
                if pending.call.op == "open":
                    self._forget_session(pending.call.session)
                self._fail(pending, EnvWorkerLost(f"{pending.label}: {exc}"))
            else:
                self._fail(pending, EnvCallFailed(f"{pending.label} failed on {worker}: {exc}"))
        if again:
            self.counts["retried"] += len(again)
            log.warning("sending %d calls again after %s died: %s", len(again), worker, exc)
            self._queue(again)

    def _fail(self, pending: _Pending, failure: BaseException) -> None:
        if not pending.future.done():
            pending.future.set_exception(failure)

    def _start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_report_failure)
        return task

    async def close(self) -> None:
        """Ends every send and wait under way; calls still waiting for a worker fail."""
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        waiting, self._waiting = self._waiting, []
        for pending in waiting:
            self._fail(pending, asyncio.CancelledError())


def _log_close(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("an environment session did not close cleanly: %s", future.exception())


def _report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("an environment message could not be sent: %r", task.exception())


__all__ = ["EnvCallFailed", "EnvClient", "EnvSession", "EnvSetupFailed", "EnvWorkerLost", "describe"]
