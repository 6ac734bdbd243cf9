"""The controller's end of the control plane: one ROUTER, the worker registry, liveness.

`ControllerServer` accepts workers (HELLO -> WELCOME or REJECT), exchanges heartbeats with
every live worker (none to a worker it sent anything to within the interval: any message
tells a worker the controller lives, and at a thousand workers the heartbeats would be
most of what it sends), declares a silent one dead, and turns request/reply pairs into awaitable
calls. A malformed or unexpected message is logged with its reason, counted in `rejected`
(by a fixed category, so a flood of distinct garbage cannot grow it), and dropped; it never
stops the loop. Sends never wait on a peer that does not read: a notice to it is dropped
(counted in `undelivered`), a request waits at most the heartbeat timeout and then the
worker is declared dead.

It knows nothing about agents, samples or training: the experiment drives it through
`call`, `stream`, `workers` and the joined/died listeners. Once it broadcast SHUTDOWN
(`closing`) the workers' going is the run's own doing: their requests still fail, but no
died listener is told (nothing is logged as a death).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import zmq

from flexmarl.runtime import protocol
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import Inbound, RouterSocket

from .registry import RegistrationRefused, WorkerInfo, WorkerRegistry

log = logging.getLogger("flexmarl.controller")


class WorkerDied(Exception):
    """The worker handling a request was declared dead; the request may be re-issued."""

    def __init__(self, worker_id: str, why: str) -> None:
        super().__init__(f"worker {worker_id} is gone: {why}")
        self.worker_id = worker_id


class RemoteError(Exception):
    """A worker reported that one request failed (the worker itself is fine)."""


# Heartbeats sent in one turn of the event loop (the rest in the next turns).
HEARTBEATS_PER_TURN = 64
# Inbound messages taken and dispatched in one turn of the event loop. A reply wakes the
# work waiting on it in the next turn, so a larger batch makes longer turns: at 1,024
# instances x 32 agents (wide, async K = 2, a shared machine) 64 saved under a microsecond
# of the 2.5-3.5 us a reply costs here and raised the loop's median lag from 0.2-1.4 ms to
# 4-5 ms; 8 kept it at 0.8-1.6 ms (bench/HISTORY.md).
MESSAGES_PER_TURN = 8

# A streaming reply handler returns True when the reply it was given is the last one.
ReplyHandler = Callable[[protocol.Message, list[Any]], bool]


@dataclass(slots=True)
class _Pending:
    worker_id: str
    future: asyncio.Future
    on_reply: ReplyHandler | None


# What a worker sends that is not a reply to a request (no request_id).
_NOT_REPLIES = frozenset(cls for cls in protocol.MESSAGE_TYPES.values() if "request_id" not in cls.__struct_fields__)
# Replies that carry the worker's load.
_WITH_LOAD = frozenset(cls for cls in protocol.MESSAGE_TYPES.values() if "load" in cls.__struct_fields__)


class ControllerServer:
    def __init__(self, cfg: TransportConfig) -> None:
        self.cfg = cfg
        self.socket = RouterSocket(cfg)
        self.registry = WorkerRegistry()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.undelivered: collections.Counter[str] = collections.Counter()
        self._not_reading: set[bytes] = set()  # peers already warned about (one line each)
        self.on_joined: list[Callable[[WorkerInfo], None]] = []
        # A worker died while the run goes on: not called once closing (the run is stopping its workers).
        self.on_died: list[Callable[[WorkerInfo], None]] = []
        self._pending: dict[int, _Pending] = {}
        self._sending: set[asyncio.Future] = set()  # `request`s waiting for room in a worker's queue
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._hb_seq = 0
        self.address = ""
        self.closing = False  # after SHUTDOWN, a vanishing worker is expected, not an alarm
        self._loop: asyncio.AbstractEventLoop | None = None  # where `serve` runs, once it does

    # ------------------------------------------------------------ lifecycle

    def bind(self, address: str = "", curve_dir: str = "") -> str:
        """Binds `address` with the CURVE keys in `curve_dir` (by default the configured ones)."""
        self.address = self.socket.bind(address, curve_dir)
        log.info("controller listening on %s", self.address)
        return self.address

    async def serve(self) -> None:
        """Receive loop. Consumes every inbound message; never returns while running. Per
        turn of the event loop it takes the messages queued (up to MESSAGES_PER_TURN),
        dispatches them, then yields once: a reply is handled where it arrives, without a
        coroutine or a loop turn of its own."""
        self._loop = asyncio.get_running_loop()
        while True:
            batch = await self.socket.recv_queued(MESSAGES_PER_TURN)
            now = time.monotonic()
            for inbound in batch:
                try:
                    if not self._dispatch_reply(inbound, now):
                        await self._dispatch(inbound, now)
                except Exception:  # a handler bug must not take the control plane down
                    self.rejected["handler error"] += 1
                    log.exception("error while handling a message from %r", inbound.identity)
            # A recv whose message is already queued completes without suspending: under a
            # flood this loop would never give the heartbeats or the driver a turn.
            await asyncio.sleep(0)

    async def heartbeat(self) -> None:
        """Sends a heartbeat to every live worker each interval; declares silent ones dead.
        A turn that comes late by more than half the timeout means this process was held
        (stopped, or its loop busy): what the workers sent meanwhile is still unread in the
        socket, so their silence is counted from now, not held against them."""
        interval, timeout = self.cfg.heartbeat_interval_s, self.cfg.heartbeat_timeout_s
        due = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if now - due > timeout / 2:
                log.warning("the controller did not run for %.1fs; the workers' silence is counted from now",
                            now - due + interval)
                self.registry.heard_all(now - interval)
            due = now + interval
            for info in self.registry.expired(now, self.cfg.heartbeat_timeout_s):
                self._declare_dead(info, f"no heartbeat for {now - info.last_seen:.1f}s "
                                         f"(timeout {self.cfg.heartbeat_timeout_s}s)")
            self._hb_seq += 1
            quiet = now - self.cfg.heartbeat_interval_s  # a worker sent anything since needs no heartbeat
            for i, info in enumerate(self.registry.alive()):
                if info.last_sent <= quiet:
                    await self._send(info.identity, protocol.Heartbeat(self._hb_seq))
                if i % HEARTBEATS_PER_TURN == HEARTBEATS_PER_TURN - 1:
                    await asyncio.sleep(0)  # a thousand sends in one loop turn would hold everything else

    def worker_exited(self, worker_id: str, why: str) -> None:
        """Whoever started the worker saw its process end: it is dead now, without waiting
        for its heartbeats to stop (so a restarted process may register under its id)."""
        info = self.registry.workers.get(worker_id)
        if info is not None:
            self._declare_dead(info, why)

    def close(self) -> None:
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(WorkerDied(pending.worker_id, "controller closed"))
        self._pending.clear()
        for sending in self._sending:
            sending.cancel()
        self.socket.close()

    # ------------------------------------------------------------ requests

    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the server runs on: known once `serve` started, asked of asyncio
        before (asking costs a system call, its fork check: the router asks per group)."""
        loop = self._loop
        return loop if loop is not None and not loop.is_closed() else asyncio.get_running_loop()

    def next_request_id(self) -> int:
        return next(self._ids)

    async def call(self, worker_id: str, msg: protocol.Message, buffers: Sequence[Any] = (),
                   timeout: float | None = None,
                   on_sent: Callable[[], None] | None = None) -> tuple[protocol.Message, list[Any]]:
        """Sends `msg` (which carries a request_id) and waits for its single reply;
        `on_sent()` runs once the message is written to the worker's connection (messages
        to one worker arrive in the order they were written)."""
        future = self.stream(worker_id, msg, None, buffers)
        await self._send_request(worker_id, msg, buffers)
        if on_sent is not None:
            on_sent()
        # No timeout: the future itself (asyncio.wait_for's own steps cost a loop lookup, a
        # system call, per call; a cancelled caller cancels the future either way).
        return await (future if timeout is None else asyncio.wait_for(future, timeout))

    def request(self, worker_id: str, msg: protocol.Message) -> asyncio.Future:
        """`call` without a coroutine of its own: the request is registered and written now
        (where the worker's queue is full, by a task that waits for room, as `call` does),
        and the future of its single reply returned. For a fan-out, a weight sync's load to
        each of an agent's instances: there a task per request cost more than the request."""
        future = self.stream(worker_id, msg, None)
        if not future.done() and self.send_now([(worker_id, msg)]) == 0:
            sending = asyncio.ensure_future(self._send_request(worker_id, msg, ()))
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)
            future.add_done_callback(lambda f: sending.cancel() if f.cancelled() else None)
        return future

    def stream(self, worker_id: str, msg: protocol.Message, on_reply: ReplyHandler | None,
               buffers: Sequence[Any] = ()) -> asyncio.Future:
        """Registers a request whose replies go to `on_reply`; the caller then sends it
        with `send_request`. The future resolves at the last reply or fails with
        WorkerDied/RemoteError."""
        info = self.registry.workers.get(worker_id)
        future = self.loop().create_future()
        if info is None or not info.alive:
            future.set_exception(WorkerDied(worker_id, "not registered or already dead"))
            return future
        # Every request carries one (runtime/protocol.py); read without typing.cast's call.
        request_id: int = msg.request_id  # type: ignore[attr-defined]
        self._pending[request_id] = _Pending(worker_id, future, on_reply)
        return future

    async def send_request(self, worker_id: str, msg: protocol.Message,
                           buffers: Sequence[Any] = ()) -> None:
        await self._send_request(worker_id, msg, buffers)

    def send_now(self, requests: Sequence[tuple[str, protocol.Message]]) -> int:
        """Sends registered requests (`stream`), in order, while each worker's queue takes
        one now; returns how many it handled: the first whose worker's queue is full and
        those after it are the caller's to send with `send_request` (which waits for room)."""
        workers, send = self.registry.workers, self.socket.send_nowait
        now = time.monotonic()
        for i, (worker_id, msg) in enumerate(requests):
            info = workers.get(worker_id)
            if info is None or not info.alive:
                continue  # its future already carries WorkerDied
            try:
                send(info.identity, msg)
            except zmq.Again:
                return i
            except zmq.ZMQError as exc:
                self._send_failed(info.identity, msg, exc)
                continue
            info.last_sent = now
        return len(requests)

    async def _send_request(self, worker_id: str, msg: protocol.Message, buffers: Sequence[Any]) -> None:
        info = self.registry.workers.get(worker_id)
        if info is None or not info.alive:
            return  # the future already carries WorkerDied
        # Its queue is full only if it has not read SEND_HWM messages: wait for it, bounded
        # like silence is, then treat it as dead (which fails this request's future).
        deadline = 0.0
        pause = 0.001
        while info.alive:
            try:
                self.socket.send_nowait(info.identity, msg, buffers)
                info.last_sent = time.monotonic()
                return
            except zmq.Again:
                if not deadline:
                    deadline = time.monotonic() + self.cfg.heartbeat_timeout_s
                elif time.monotonic() > deadline:
                    self._declare_dead(info, f"not reading: its queue stayed full for "
                                             f"{self.cfg.heartbeat_timeout_s}s")
                    return
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.05)
            except zmq.ZMQError as exc:
                self._send_failed(info.identity, msg, exc)
                return

    async def broadcast_shutdown(self, reason: str) -> None:
        self.closing = True
        for info in self.registry.alive():
            await self._send(info.identity, protocol.Shutdown(reason))

    async def shut_down_workers(self, reason: str, timeout: float) -> None:
        """Tells every live worker to shut down and waits (at most `timeout`) until they
        have gone; a failure is logged, never raised: the caller goes on tearing down."""
        alive = [w.worker_id for w in self.registry.alive()]
        try:
            await self.broadcast_shutdown(reason)
            await self.wait_until_gone(alive, timeout)
        except Exception:
            log.exception("error while shutting workers down")

    async def wait_for_workers(self, counts: dict[str, int], timeout: float) -> None:
        """Returns once at least counts[role] workers of each role are alive."""
        deadline = time.monotonic() + timeout
        while True:
            missing = {r: n - len(self.registry.alive(r)) for r, n in counts.items()}
            missing = {r: n for r, n in missing.items() if n > 0}
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"workers did not join within {timeout:.0f}s; still missing "
                                   f"{missing} (is `flexmarl worker --connect {self.address}` running?)")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def wait_until_gone(self, worker_ids: Sequence[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(self.registry.workers[w].alive for w in worker_ids if w in self.registry.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    # ------------------------------------------------------------ internals

    async def _send(self, identity: bytes, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        """A notice (heartbeat, error, welcome, reject): sent now or dropped, never awaited."""
        try:
            self.socket.send_nowait(identity, msg, buffers)
        except zmq.ZMQError as exc:
            self._send_failed(identity, msg, exc)
        else:
            self._not_reading.discard(identity)
            info = self.registry.by_identity(identity)
            if info is not None:
                info.last_sent = time.monotonic()

    def _send_failed(self, identity: bytes, msg: protocol.Message, exc: zmq.ZMQError) -> None:
        info = self.registry.by_identity(identity)
        if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected
            self.undelivered["peer gone"] += 1
            if info is not None:
                self._declare_dead(info, "connection lost")
            return
        if exc.errno == zmq.EAGAIN:  # its queue is full: it is not reading
            self.undelivered["peer not reading"] += 1
            warn = info is not None and identity not in self._not_reading
            if info is not None:
                self._not_reading.add(identity)
            log.log(logging.WARNING if warn else logging.DEBUG,
                    "dropping messages to %r: its queue is full (it is not reading); counted in "
                    "undelivered until it reads again", identity)
            return
        self.undelivered["send error"] += 1
        log.warning("cannot send %s to %r: %s", type(msg).__name__, identity, exc)

    def _reject(self, identity: bytes, reason: str, detail: str) -> None:
        """Counts a dropped inbound message under `reason` (a fixed category) and logs why."""
        self.rejected[reason] += 1
        log.warning("dropped message from %r: %s", identity, protocol.shorten(detail, 300))

    def _dispatch_reply(self, inbound: Inbound, now: float) -> bool:
        """A registered worker's reply to a request, or its heartbeat, handled at once
        (most of what arrives); False for anything else, which `_dispatch` handles."""
        msg: Any = inbound.msg  # read by its kind (`type`: no isinstance or getattr per message)
        if msg is None:
            return False
        kind = type(msg)
        if kind in _NOT_REPLIES and kind is not protocol.Heartbeat:
            return False
        info = self.registry.by_identity(inbound.identity)
        if info is None:
            return False
        info.last_seen = now
        if kind is protocol.Heartbeat:
            info.load = dict(msg.load)
            return True
        if kind in _WITH_LOAD and msg.load:  # a busy worker's replies stand in for its heartbeats
            info.load = msg.load
        self._deliver(info, msg, inbound.buffers)
        return True

    async def _dispatch(self, inbound: Inbound, now: float) -> None:
        info = self.registry.by_identity(inbound.identity)
        if inbound.error:
            self._reject(inbound.identity, inbound.reason, inbound.error)
            if info is not None:
                await self._send(info.identity, protocol.Error(
                    0, f"message dropped: {protocol.shorten(inbound.error, 300)}"))
            return
        msg = inbound.msg
        if info is None:
            await self._handle_unregistered(inbound, now)
            return
        info.last_seen = now
        match msg:
            case protocol.Heartbeat():
                info.load = dict(msg.load)
            case protocol.Bye():
                self._declare_dead(info, f"left: {msg.reason}")
            case protocol.Hello():
                self._reject(inbound.identity, "duplicate HELLO", "duplicate HELLO on a registered connection")
            case _:  # what a worker never sends (its replies to requests went to `_dispatch_reply`)
                self._reject(inbound.identity, "unexpected kind",
                             f"unexpected {type(msg).__name__} from worker {info.worker_id}")

    async def _handle_unregistered(self, inbound: Inbound, now: float) -> None:
        msg = inbound.msg
        if not isinstance(msg, protocol.Hello):
            self._reject(inbound.identity, "before HELLO", f"unregistered peer sent {type(msg).__name__} before HELLO")
            await self._send_raw_reject(inbound.identity, "not registered: send HELLO first (or restart the worker)")
            return
        try:
            info = self.registry.register(msg, inbound.identity, now)
        except RegistrationRefused as exc:
            self._reject(inbound.identity, "registration refused", f"registration refused: {exc}")
            await self._send_raw_reject(inbound.identity, str(exc))
            return
        await self._send(info.identity, protocol.Welcome(
            protocol.PROTOCOL_VERSION, self.cfg.heartbeat_interval_s, self.cfg.heartbeat_timeout_s))
        log.info("worker %s joined: role=%s host=%s pid=%d devices=%s gpus=%s",
                 info.worker_id, info.role, protocol.shorten(info.host, 100), info.pid,
                 protocol.shorten(str(info.devices), 200), protocol.shorten(",".join(info.visible_gpus), 100) or "unpinned")
        for listener in self.on_joined:
            listener(info)
        self._changed.set()

    async def _send_raw_reject(self, identity: bytes, reason: str) -> None:
        try:
            await self.socket.send(identity, protocol.Reject(reason))
        except zmq.ZMQError:  # gone or not reading: an unregistered peer is owed nothing
            self.undelivered["reject to unregistered peer"] += 1

    def _deliver(self, info: WorkerInfo, msg: Any, buffers: list[Any]) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None or pending.worker_id != info.worker_id:
            if isinstance(msg, protocol.Error) and msg.request_id == 0:
                log.warning("worker %s reports: %s", info.worker_id, protocol.shorten(msg.message, 300))
            else:
                self._reject(info.identity, "unknown request", f"reply {type(msg).__name__} for unknown "
                                                               f"request {msg.request_id} from {info.worker_id}")
            return
        if pending.future.done():  # cancelled by the caller
            del self._pending[msg.request_id]
            return
        if type(msg) is protocol.Error:
            del self._pending[msg.request_id]
            pending.future.set_exception(RemoteError(f"{info.worker_id}: {msg.message}"))
            return
        if pending.on_reply is None:
            del self._pending[msg.request_id]
            pending.future.set_result((msg, buffers))
            return
        try:
            finished = pending.on_reply(msg, buffers)
        except Exception as exc:
            del self._pending[msg.request_id]
            pending.future.set_exception(exc)
            return
        if finished:
            del self._pending[msg.request_id]
            pending.future.set_result((msg, buffers))

    def _declare_dead(self, info: WorkerInfo, why: str) -> None:
        if not info.alive:
            return
        self.registry.mark_gone(info, why)
        log.log(logging.INFO if self.closing else logging.WARNING,
                "worker %s %s: %s", info.worker_id, "left" if self.closing else "declared dead", why)
        for request_id, pending in list(self._pending.items()):
            if pending.worker_id == info.worker_id:
                del self._pending[request_id]
                if not pending.future.done():
                    pending.future.set_exception(WorkerDied(info.worker_id, why))
        if not self.closing:
            for listener in self.on_died:
                listener(info)
        self._changed.set()
