"""A worker's session with the controller: register, heartbeat, execute, leave, come back.

`WorkerSession.run()` connects a DEALER, sends HELLO and waits (bounded) for WELCOME,
then runs three named tasks under `runtime.aio.supervise`: receiving commands, sending
heartbeats (none in an interval in which a reply carried the worker's load: the controller
takes the load from the reply, and any message says the worker lives), and the handler's
own loop (if any). It ends when the controller says SHUTDOWN,
refuses the worker, or falls silent for longer than the heartbeat timeout; the first task
to end, for whatever reason, ends them all. Heartbeat interval and timeout are the
controller's, from WELCOME; only the wait for WELCOME itself is the worker's setting.

A controller that went away (silent, or not reading) may come back, restarted on the same
address (it then answers the old connection with a REJECT: it does not know it): for up to `transport.reconnect_timeout_s` the session tries to register again on
a fresh connection, waiting 0.5 s for the first attempt and twice as long for each next
one (at most 10 s). Taken back, it starts over as a fresh worker: the handler, with its
engines or training states, is closed and a new one made, since the controller commands
a worker that joins from scratch. A REJECT (same id still registered and alive, another
protocol version) ends it at once with exit code 2.

Workers make no decisions: a `CommandHandler` executes each command and replies. The
session knows nothing about engines or models.

Nothing a peer sends stops the receive loop: a malformed message is logged and counted in
`rejected` (by category), a command whose handler raises is answered with an Error. A send
waits at most the heartbeat timeout for the controller to read, then the session ends as
if the controller were lost.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from typing import Any, Callable, Sequence

import zmq

from flexmarl.runtime import protocol
from flexmarl.runtime.aio import StallWatch, TaskEnded, supervise
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import DealerSocket

log = logging.getLogger("flexmarl.worker")

EXIT_SHUTDOWN, EXIT_ERROR, EXIT_REFUSED, EXIT_LOST = 0, 1, 2, 3
RECONNECT_FIRST_S = 0.5  # the first attempt to register again waits this long for a connection
RECONNECT_MAX_S = 10.0  # each next one twice as long, up to this


class SessionEnded(Exception):
    def __init__(self, reason: str, exit_code: int, *, register_again: bool = False) -> None:
        super().__init__(reason)
        self.exit_code = exit_code
        # The controller is gone or no longer knows this connection: with a reconnect
        # timeout, the session registers again instead of exiting.
        self.register_again = register_again or exit_code == EXIT_LOST


class CommandHandler:
    """Executes commands for one role. Subclasses override `handle`, `run`, `load`."""

    role = "worker"

    def __init__(self) -> None:
        self.session: WorkerSession | None = None

    async def reply(self, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        assert self.session is not None
        await self.session.send(msg, buffers)

    async def handle(self, msg: protocol.Message, buffers: list[Any]) -> None:
        """Called from the receive loop: must return quickly (queue long work for `run`)."""
        match msg:
            case protocol.Echo():
                await self.reply(protocol.EchoReply(msg.request_id, msg.payload, self.load()), buffers)
            case _:
                await self.reply(protocol.Error(getattr(msg, "request_id", 0),
                                                f"{self.role} worker cannot handle {type(msg).__name__}"))

    async def run(self) -> None:
        """The handler's own loop (an engine's step loop, say). Default: nothing to do."""
        await asyncio.Event().wait()

    def load(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class WorkerSession:
    def __init__(self, cfg: TransportConfig, address: str, handler: CommandHandler,
                 worker_id: str = "", devices: Sequence[str] = (), capacity: dict[str, float] | None = None,
                 new_handler: Callable[[], CommandHandler] | None = None, visible_gpus: Sequence[str] = (),
                 watch_loop: bool = True) -> None:
        self.cfg = cfg
        self.address = address
        self.handler = handler
        handler.session = self
        # Makes the fresh handler a session starts with after it registered again.
        self.new_handler = new_handler or type(handler)
        self.worker_id = worker_id or f"{handler.role}-{socket.gethostname()}-{os.getpid()}"
        self.devices = list(devices) or ["cpu"]
        self.capacity = capacity or {}
        self.visible_gpus = list(visible_gpus)
        self.sock = self._new_socket()
        # The controller's, from WELCOME: both ends must agree on when a peer is dead.
        self.heartbeat_interval_s = 0.0
        self.heartbeat_timeout_s = 0.0
        self._last_heard = time.monotonic()
        self._load_told = 0.0  # when a message last told the controller this worker's load
        self.rejected: collections.Counter[str] = collections.Counter()
        self.reconnects = 0  # times the session registered again after losing its controller
        # Whether the session watches its event loop for stalls (runtime.aio.StallWatch: a
        # thread and a ticker of its own). A process that runs many sessions on one loop
        # watches it once, for all of them.
        self.watch_loop = watch_loop

    def _new_socket(self, immediate: bool = False) -> DealerSocket:
        # Unique per connection so a restarted worker with the same id is a new peer.
        identity = f"{self.worker_id}/{uuid.uuid4().hex[:8]}".encode()
        return DealerSocket(self.cfg, identity, immediate=immediate)

    async def send(self, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        try:
            await self.sock.send(msg, buffers)
        except zmq.Again:
            if not self.heartbeat_timeout_s:  # not registered yet: HELLO found no connection to queue on
                raise SessionEnded(f"no WELCOME from {self.address}: no connection to it took this worker's "
                                   f"first message within {self.cfg.heartbeat_timeout_s:.1f}s; is the controller "
                                   f"running, and does this worker hold its keys (transport CURVE)?",
                                   EXIT_LOST) from None
            raise SessionEnded(f"the controller has not read for {self.heartbeat_timeout_s:.1f}s "
                               f"(the send queue stayed full)", EXIT_LOST) from None
        if getattr(msg, "load", None):  # a reply carrying the load says what a heartbeat would
            self._load_told = time.monotonic()

    async def run(self) -> int:
        """Returns the process exit code: 0 on SHUTDOWN, 2 if refused, 3 if the controller
        is lost (and did not take the worker back within `reconnect_timeout_s`)."""
        self.sock.connect(self.address)
        watch = StallWatch(f"worker {self.worker_id}")  # a loop held over a second is logged with what held it
        if self.watch_loop:
            watch.start()
        try:
            await self._send_hello()
            await self._await_welcome()
            while True:
                ended = await self._serve()
                if not ended.register_again or self.cfg.reconnect_timeout_s <= 0:
                    return ended.exit_code
                await self._reconnect()
        except SessionEnded as exc:
            log.error("worker %s: %s", self.worker_id, exc)
            return exc.exit_code
        finally:
            await watch.stop()
            self.handler.close()
            self.sock.close()

    async def _serve(self) -> SessionEnded:
        """Runs the registered session's tasks until one ends; returns why."""
        tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("receive", self._receive()), ("heartbeat", self._heartbeat()),
            ("handler", self.handler.run()))]
        try:
            await supervise(tasks, forever=True)
        except TaskEnded as ended:
            if isinstance(ended.cause, SessionEnded):
                log.info("worker %s: %s", self.worker_id, ended.cause)
                return ended.cause
            log.error("worker %s: %s", self.worker_id, ended)
            if ended.cause is not None:
                await self._say_bye(str(ended))
            return SessionEnded(str(ended), EXIT_ERROR)
        return SessionEnded("not reached: with forever=True, supervise only ever raises", EXIT_ERROR)

    async def _reconnect(self) -> None:
        """Registers again on a fresh connection (see the module doc); raises SessionEnded
        when refused or when `reconnect_timeout_s` passes first."""
        timeout = self.cfg.reconnect_timeout_s
        deadline = time.monotonic() + timeout
        log.warning("worker %s lost its controller at %s; trying to register again for up to %.0fs",
                    self.worker_id, self.address, timeout)
        # Whatever the old handler held, the controller will command again from scratch.
        self.handler.close()
        self.handler = self.new_handler()
        self.handler.session = self
        wait = RECONNECT_FIRST_S
        while (left := deadline - time.monotonic()) > 0:
            # A fresh socket drops whatever the old one still queued for the old controller.
            self.sock.close()
            self.sock = self._new_socket(immediate=True)
            self.sock.connect(self.address)
            try:
                await asyncio.wait_for(self._send_hello(), min(wait, left))
            except (asyncio.TimeoutError, SessionEnded):
                log.info("worker %s: no controller at %s yet; next attempt waits %.1fs", self.worker_id,
                         self.address, min(2 * wait, RECONNECT_MAX_S))
                wait = min(2 * wait, RECONNECT_MAX_S)
                continue
            try:
                await self._await_welcome()  # connected: the controller answers HELLO at once
            except SessionEnded as exc:
                if exc.exit_code != EXIT_LOST:
                    raise
                continue
            self.reconnects += 1
            return
        raise SessionEnded(f"the controller at {self.address} did not take this worker back "
                           f"within {timeout:.0f}s (transport.reconnect_timeout_s); exiting", EXIT_LOST)

    async def _say_bye(self, reason: str) -> None:
        try:
            await asyncio.wait_for(self.send(protocol.Bye(reason)), 1.0)
        except Exception:
            pass

    async def _send_hello(self) -> None:
        await self.send(protocol.Hello(protocol.PROTOCOL_VERSION, self.worker_id, self.handler.role,
                                       socket.gethostname(), os.getpid(), self.devices, self.capacity,
                                       self.visible_gpus))

    async def _await_welcome(self) -> None:
        try:
            inbound = await asyncio.wait_for(self.sock.recv(), self.cfg.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise SessionEnded(f"no WELCOME from {self.address} within "
                               f"{self.cfg.handshake_timeout_s:.0f}s; is the controller running?", EXIT_LOST) from None
        if isinstance(inbound.msg, protocol.Reject):
            raise SessionEnded(f"controller refused registration: {inbound.msg.reason}", EXIT_REFUSED)
        if not isinstance(inbound.msg, protocol.Welcome):
            raise SessionEnded(f"expected WELCOME, got {inbound.msg or inbound.error}", EXIT_REFUSED)
        self.heartbeat_interval_s = inbound.msg.heartbeat_interval_s
        self.heartbeat_timeout_s = inbound.msg.heartbeat_timeout_s
        self.sock.set_send_timeout(self.heartbeat_timeout_s)
        self._last_heard = time.monotonic()
        log.info("worker %s registered with %s", self.worker_id, self.address)

    async def _receive(self) -> None:
        while True:
            inbound = await self.sock.recv()
            if not self.sock.waited:  # a queued message is received without suspending: yield
                await asyncio.sleep(0)
            self._last_heard = time.monotonic()
            if inbound.error:
                self.rejected[inbound.reason] += 1
                log.warning("worker %s dropped a message: %s", self.worker_id,
                            protocol.shorten(inbound.error, 300))
                continue
            assert inbound.msg is not None  # decoded: it has no error
            match inbound.msg:
                case protocol.Heartbeat():
                    pass
                case protocol.Shutdown(reason=reason):
                    raise SessionEnded(f"shutdown requested: {reason}", EXIT_SHUTDOWN)
                case protocol.Reject(reason=reason):
                    # After WELCOME, a REJECT means the controller does not know this
                    # connection: it was restarted, or it declared this worker dead.
                    raise SessionEnded(f"controller dropped this worker: {reason}", EXIT_REFUSED,
                                       register_again=True)
                case protocol.Error(message=message):
                    log.warning("controller reports: %s", protocol.shorten(message, 300))
                case msg:
                    await self._hand_over(msg, inbound.buffers)

    async def _hand_over(self, msg: protocol.Message, buffers: list[Any]) -> None:
        try:
            await self.handler.handle(msg, buffers)
        except SessionEnded:
            raise
        except Exception as exc:  # one bad command fails alone; the worker stays up
            self.rejected["handler error"] += 1
            log.exception("worker %s could not take %s", self.worker_id, type(msg).__name__)
            await self.send(protocol.Error(getattr(msg, "request_id", 0),
                                           f"{self.handler.role} worker could not take "
                                           f"{type(msg).__name__}: {protocol.shorten(repr(exc))}"))

    async def _heartbeat(self) -> None:
        """A heartbeat an interval after the last message that told the controller this
        worker's load (a heartbeat, or a reply carrying it): never more than an interval
        without one, none while replies carry it."""
        seq, interval = 0, self.heartbeat_interval_s
        due = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if now - due > self.heartbeat_timeout_s / 2:  # this process was held: what the controller
                # sent meanwhile is unread in the socket, so its silence is counted from now
                self._last_heard = max(self._last_heard, now - interval)
            silent = now - self._last_heard
            if silent > self.heartbeat_timeout_s:
                raise SessionEnded(f"controller silent for {silent:.1f}s", EXIT_LOST)
            if now - self._load_told < interval:  # a reply carried the load meanwhile
                due = self._load_told + interval
                continue
            seq += 1
            await self.send(protocol.Heartbeat(seq, self.handler.load()))
            due = now + interval
