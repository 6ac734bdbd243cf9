"""A worker's session with the controller: register, heartbeat, execute, leave.

`WorkerSession.run()` connects a DEALER, sends HELLO and waits (bounded) for WELCOME,
then runs three named tasks under `runtime.aio.supervise`: receiving commands, sending
heartbeats, and the handler's own loop (if any). It ends when the controller says SHUTDOWN,
refuses the worker, or falls silent for longer than the heartbeat timeout; the first task
to end, for whatever reason, ends them all. Heartbeat interval and timeout are the
controller's, from WELCOME; only the wait for WELCOME itself is the worker's setting.

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
from typing import Any

import zmq

from flexmarl.runtime import protocol
from flexmarl.runtime.aio import TaskEnded, supervise
from flexmarl.runtime.config import TransportConfig
from flexmarl.runtime.transport import DealerSocket

log = logging.getLogger("flexmarl.worker")


class SessionEnded(Exception):
    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


class CommandHandler:
    """Executes commands for one role. Subclasses override `handle`, `run`, `load`."""

    role = "worker"

    def __init__(self) -> None:
        self.session: WorkerSession | None = None

    async def reply(self, msg: protocol.Message, buffers: list[Any] = ()) -> None:
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
                 worker_id: str = "", devices: list[str] = (), capacity: dict[str, float] = None,
                 visible_gpus: list[str] = ()) -> None:
        self.cfg = cfg
        self.address = address
        self.handler = handler
        handler.session = self
        self.worker_id = worker_id or f"{handler.role}-{socket.gethostname()}-{os.getpid()}"
        self.devices = list(devices) or ["cpu"]
        self.capacity = capacity or {}
        self.visible_gpus = list(visible_gpus)
        # Unique per connection so a restarted worker with the same id is a new peer.
        identity = f"{self.worker_id}/{uuid.uuid4().hex[:8]}".encode()
        self.sock = DealerSocket(cfg, identity)
        # The controller's, from WELCOME: both ends must agree on when a peer is dead.
        self.heartbeat_interval_s = 0.0
        self.heartbeat_timeout_s = 0.0
        self._last_heard = time.monotonic()
        self.rejected: collections.Counter[str] = collections.Counter()

    async def send(self, msg: protocol.Message, buffers: list[Any] = ()) -> None:
        try:
            await self.sock.send(msg, buffers)
        except zmq.Again:
            raise SessionEnded(f"the controller has not read for {self.heartbeat_timeout_s:.1f}s "
                               f"(the send queue stayed full); exiting", 3) from None

    async def run(self) -> int:
        """Returns the process exit code: 0 on SHUTDOWN, 2 if refused, 3 if the controller is lost."""
        self.sock.connect(self.address)
        try:
            await self._handshake()
            tasks = [asyncio.create_task(coro, name=name) for name, coro in (
                ("receive", self._receive()), ("heartbeat", self._heartbeat()),
                ("handler", self.handler.run()))]
            await supervise(tasks, forever=True)
            return 1  # not reached: with forever=True, supervise only ever raises
        except TaskEnded as ended:
            if isinstance(ended.cause, SessionEnded):
                log.info("worker %s: %s", self.worker_id, ended.cause)
                return ended.cause.exit_code
            log.error("worker %s: %s", self.worker_id, ended)
            if ended.cause is not None:
                await self._say_bye(str(ended))
            return 1
        except SessionEnded as exc:
            log.error("worker %s: %s", self.worker_id, exc)
            return exc.exit_code
        finally:
            self.handler.close()
            self.sock.close()

    async def _say_bye(self, reason: str) -> None:
        try:
            await asyncio.wait_for(self.send(protocol.Bye(reason)), 1.0)
        except Exception:
            pass

    async def _handshake(self) -> None:
        hello = protocol.Hello(protocol.PROTOCOL_VERSION, self.worker_id, self.handler.role,
                               socket.gethostname(), os.getpid(), self.devices, self.capacity,
                               self.visible_gpus)
        await self.send(hello)
        try:
            inbound = await asyncio.wait_for(self.sock.recv(), self.cfg.handshake_timeout_s)
        except asyncio.TimeoutError:
            raise SessionEnded(f"no WELCOME from {self.address} within "
                               f"{self.cfg.handshake_timeout_s:.0f}s; is the controller running?", 3) from None
        if isinstance(inbound.msg, protocol.Reject):
            raise SessionEnded(f"controller refused registration: {inbound.msg.reason}", 2)
        if not isinstance(inbound.msg, protocol.Welcome):
            raise SessionEnded(f"expected WELCOME, got {inbound.msg or inbound.error}", 2)
        self.heartbeat_interval_s = inbound.msg.heartbeat_interval_s
        self.heartbeat_timeout_s = inbound.msg.heartbeat_timeout_s
        self.sock.set_send_timeout(self.heartbeat_timeout_s)
        self._last_heard = time.monotonic()
        log.info("worker %s registered with %s", self.worker_id, self.address)

    async def _receive(self) -> None:
        while True:
            await asyncio.sleep(0)  # a queued message is received without suspending: yield
            inbound = await self.sock.recv()
            self._last_heard = time.monotonic()
            if inbound.error:
                self.rejected[inbound.reason] += 1
                log.warning("worker %s dropped a message: %s", self.worker_id,
                            protocol.shorten(inbound.error, 300))
                continue
            match inbound.msg:
                case protocol.Heartbeat():
                    pass
                case protocol.Shutdown(reason=reason):
                    raise SessionEnded(f"shutdown requested: {reason}", 0)
                case protocol.Reject(reason=reason):
                    raise SessionEnded(f"controller dropped this worker: {reason}", 2)
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
        seq = 0
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout_s:
                raise SessionEnded(f"controller silent for {silent:.1f}s; exiting", 3)
            seq += 1
            await self.send(protocol.Heartbeat(seq, self.handler.load()))
