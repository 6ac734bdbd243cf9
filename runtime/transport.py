"""ZeroMQ sockets for the control plane: the controller's ROUTER, each worker's DEALER.

Both wrap zmq.asyncio sockets and speak `protocol` frames. What they add:
- a size cap and a frame-count cap checked on every inbound message (a larger one is
  dropped with a reason),
- decoding that turns garbage into an `Inbound` carrying the reason instead of raising,
- bounded queues (below), and sends from the controller that never wait on one peer,
- CURVE authentication, mandatory for any bind address other than loopback,
- ZeroMQ's I/O thread scheduled so that it does not preempt the process's event loop at
  each message (`schedule_io_threads`, `TransportConfig.io_threads`).

Backpressure: a receiver holds one message at a time in Python (no Python-side queue);
at most RECV_HWM whole messages per peer wait inside libzmq, after which libzmq stops
reading that peer's connection and TCP pushes back on the sender, so a peer that floods
slows itself down, not the receiver. Outbound, at most SEND_HWM messages per peer wait;
the ROUTER then refuses (zmq.Again) instead of blocking, so one peer that never reads
cannot stall messages to the others. libzmq bounds each frame (MAXMSGSIZE) but not the
number of frames in one message while it is being received; off loopback, CURVE keeps
unknown peers from sending anything at all.

Heartbeat timing and the registry of workers live above this layer (controller/control/server.py,
workers/session.py); these classes only move frames.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, cast
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

if TYPE_CHECKING:
    from zmq.auth.asyncio import AsyncioAuthenticator

from . import protocol
from .config import ConfigError, TransportConfig

log = logging.getLogger("flexmarl.transport")

# Whole messages per peer that may wait in libzmq's queues (see the module docstring).
RECV_HWM = 100
SEND_HWM = 1000
# Frames in one message: kind and body, then up to this many buffers. Control messages carry
# a few buffers at most (parameters use the parameter channel).
MAX_BUFFERS = 256
# Flags as plain ints: pyzmq's flag enums cost a Python-level enum operation per frame.
_DONTWAIT = int(zmq.DONTWAIT)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_FD = int(zmq.FD)
_POLLIN = int(zmq.POLLIN)


@dataclass(slots=True)
class Inbound:
    """One received message. When it was malformed, `msg` is None, `reason` is a short
    fixed category to count by ("oversized", "bad body", ...) and `error` the details."""

    identity: bytes
    msg: protocol.Message | None
    buffers: list[Any]
    error: str = ""
    reason: str = ""


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_key(host: str, key_env: str, section: str) -> str:
    """The key an HTTP server of the run (`[openai]`, `[view]`) takes from the environment
    variable `key_env`: required when `host` is not loopback, as the ZeroMQ side requires
    CURVE keys there."""
    key = os.environ.get(key_env, "") if key_env else ""
    if not key and not is_loopback_host(host):
        raise ConfigError(f"{section}.host = {host!r} is not loopback: it needs a key there; put one in the "
                          f"environment variable {key_env or 'FLEXMARL_' + section.upper() + '_KEY'} ({section}.key_env)")
    return key


def _is_loopback(address: str) -> bool:
    if address.startswith(("ipc://", "inproc://")):
        return True
    return is_loopback_host(urlsplit(address).hostname or "")


def _curve_keys(curve_dir: str, name: str) -> tuple[bytes, bytes]:
    import zmq.auth

    path = Path(curve_dir) / f"{name}.key_secret"
    if not path.exists():
        raise ConfigError(f"CURVE key {path} is missing; create keys with `flexmarl keys {curve_dir}`")
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ConfigError(f"CURVE key {path} holds no secret key; create keys with `flexmarl keys {curve_dir}`")
    return public, secret


def _public_key(curve_dir: str, name: str) -> bytes:
    import zmq.auth

    path = Path(curve_dir) / f"{name}.key"
    if not path.exists():
        raise ConfigError(f"CURVE key {path} is missing; create keys with `flexmarl keys {curve_dir}`")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def create_curve_keys(curve_dir: str) -> None:
    """Writes server and client key pairs into `curve_dir` (copy it to every host)."""
    import zmq.auth

    os.makedirs(curve_dir, exist_ok=True)
    for name in ("server", "client"):
        if not (Path(curve_dir) / f"{name}.key_secret").exists():
            zmq.auth.create_certificates(curve_dir, name)


# The process whose ZeroMQ threads were scheduled (`TransportConfig.io_threads`): a forked
# child's context starts threads of its own.
_io_threads_scheduled = 0


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def schedule_io_threads(how: str, threads: set[int] | None = None) -> list[int]:
    """Schedules this process's ZeroMQ threads as `how` says (`TransportConfig.io_threads`):
    "batch" is SCHED_BATCH. `threads`: those the context's start made; None: found by the
    names libzmq gives them (ZMQbg/...), which a thread takes only once it runs. Set on the
    threads themselves, not through libzmq's context option, which aborts the process if the
    system refuses; here a refusal is logged and the thread is left as it was. Returns the
    threads it set (none on other systems than Linux, or for "normal")."""
    if how != "batch" or not hasattr(os, "SCHED_BATCH"):
        return []
    if threads is None:
        threads = set()
        for tid in _threads():
            try:
                if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("ZMQbg/"):
                    threads.add(tid)
            except OSError:  # ended meanwhile
                continue
    done = []
    for tid in sorted(threads):
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except OSError as exc:  # ended meanwhile, or not allowed here
            log.debug("ZeroMQ thread %d left as it was scheduled: %s", tid, exc)
            continue
        done.append(tid)
    return done


class _Socket:
    def __init__(self, cfg: TransportConfig, sock_type: int) -> None:
        global _io_threads_scheduled
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context.instance()
        before = None if _io_threads_scheduled == os.getpid() else _threads()
        self.sock = self.ctx.socket(sock_type)  # the context's first socket starts its threads
        if before is not None:
            _io_threads_scheduled = os.getpid()
            made = _threads() - before
            schedule_io_threads(cfg.io_threads, made or None)  # none made: started before, found by name
        self.sock.setsockopt(zmq.LINGER, 0)
        # zmq's own cap is a backstop against memory exhaustion (it silently disconnects);
        # the logged rejection happens in `_check` at `max_message_bytes`.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.max_message_bytes)
        self.sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        # The same libzmq socket without the asyncio layer: every send and receive goes
        # through it (the asyncio socket is kept for options, bind and connect).
        self._plain: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        # Its frame send below pyzmq's Python wrapper (which only adds DRAFT sockets'
        # routing ids and groups): a third of a frame's cost, four frames a message.
        self._send_frame = super(zmq.Socket, self._plain).send
        # A receive with nothing queued waits for the socket's descriptor (DealerSocket says how).
        self._fd: int = self._plain.get(_FD)  # type: ignore[assignment]
        self._reader: asyncio.Future | None = None  # the receive waiting for the descriptor
        self._watched: asyncio.AbstractEventLoop | None = None  # the loop watching the descriptor
        self.waited = False  # whether the last receive waited (False: its message was queued; it did not suspend)

    def _check(self, identity: bytes, frames: Sequence[Any]) -> Inbound:
        if len(frames) > 1 + MAX_BUFFERS:
            return Inbound(identity, None, [], f"too many frames: {len(frames)} > limit {1 + MAX_BUFFERS} "
                                               f"(kind and body, and {MAX_BUFFERS} buffers)", "too many frames")
        # The frames as received (zmq.Frame, or bytes): len is a frame's size in bytes, and
        # the decoder reads a frame's buffer as it is; only the buffers after kind and body
        # are handed on as views.
        size = sum(map(len, frames))
        if size > self.cfg.max_message_bytes:
            return Inbound(identity, None, [], f"oversized message: {size} bytes > limit "
                                               f"{self.cfg.max_message_bytes}", "oversized")
        try:
            msg, buffers = protocol.decode(frames)
            if buffers:
                buffers = [f.buffer if isinstance(f, zmq.Frame) else f for f in buffers]
        except protocol.ProtocolError as exc:
            return Inbound(identity, None, [], str(exc), exc.reason)
        except Exception as exc:  # a decoder surprise is still the peer's garbage, not our crash
            return Inbound(identity, None, [], f"undecodable message: {exc!r}", "undecodable")
        return Inbound(identity, msg, buffers)

    def _queued_frames(self) -> list[zmq.Frame]:
        """The frames of a message already queued (zmq.Again if none is), each frame's own
        flag saying whether another follows: pyzmq's recv_multipart asks the socket for
        that flag after every frame, at twice the cost of the whole receive. A message's
        frames are delivered together, so none after the first has to be waited for."""
        recv = self._plain.recv
        frame = recv(_DONTWAIT, copy=False)
        frames = [frame]
        while frame.more:
            frame = recv(_DONTWAIT, copy=False)
            frames.append(frame)
        return frames

    async def _next_frames(self) -> list[zmq.Frame]:
        """The frames of the next message (waits while none is queued; `waited` says
        whether it did). The socket's events say whether one is: an empty receive would
        raise zmq.Again, which costs several times more."""
        self.waited = False
        while True:
            if self._pollin():
                try:
                    return self._queued_frames()
                except zmq.Again:  # not expected after POLLIN; waited for like an empty queue
                    pass
            self.waited = True
            await self._readable()

    async def _readable(self) -> None:
        """Returns when a message may be queued (the caller looks again), the socket's
        events having just been read and found without one."""
        loop = asyncio.get_running_loop()
        if self._watched is not loop:
            self._watch(loop)
        waiter = self._reader = loop.create_future()
        try:
            await waiter
        finally:
            self._reader = None

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._unwatch()  # another loop's watch (a socket used from a second loop)
        loop.add_reader(self._fd, self._signalled)
        self._watched = loop

    def _unwatch(self) -> None:
        loop, self._watched = self._watched, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    def _signalled(self) -> None:
        """The descriptor's signal: it wakes the waiting receive; with none waiting it is
        consumed here (unread, the loop would call this again at every turn)."""
        waiter = self._reader
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        elif not self._plain.closed:
            self._plain.get(_EVENTS)

    def _pollin(self) -> bool:
        """Whether a message is queued (reading EVENTS: the descriptor's signal is consumed)."""
        return bool(cast(int, self._plain.get(_EVENTS)) & _POLLIN)

    def close(self) -> None:
        self._unwatch()  # the descriptor leaves its loop before it closes
        if self._reader is not None:  # a receive waits
            self._reader.cancel()
        self.sock.close(linger=0)


class RouterSocket(_Socket):
    """The controller's socket: one ROUTER that every worker's DEALER connects to."""

    def __init__(self, cfg: TransportConfig) -> None:
        super().__init__(cfg, zmq.ROUTER)
        # An unknown identity is an error, not a silent drop: we learn a peer is gone.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.authenticator: AsyncioAuthenticator | None = None
        self.address = ""
        self._rearm_pending = False

    def bind(self, address: str = "", curve_dir: str = "") -> str:
        """Binds `address` with the keys in `curve_dir` (by default the configured ones)."""
        address = address or self.cfg.address
        curve_dir = curve_dir or self.cfg.curve_dir
        if not _is_loopback(address) and not curve_dir:
            raise ConfigError(
                f"refusing to bind {address} without authentication: a non-loopback address "
                "needs CURVE keys. Run `flexmarl keys DIR` and set transport.curve_dir=DIR, "
                "or bind tcp://127.0.0.1:PORT")
        if curve_dir:
            self._enable_curve_server(curve_dir)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.address.startswith("tcp://0.0.0.0:"):
            self.address = self.address.replace("0.0.0.0", socket.gethostname(), 1)
        return self.address

    def _enable_curve_server(self, curve_dir: str) -> None:
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret = _curve_keys(curve_dir, "server")
        self.authenticator = AsyncioAuthenticator(self.ctx)
        self.authenticator.start()
        # Only clients whose public keys are in curve_dir may connect.
        self.authenticator.configure_curve(domain="*", location=curve_dir)
        self.sock.curve_secretkey = secret
        self.sock.curve_publickey = public
        self.sock.curve_server = True

    async def recv(self) -> Inbound:
        """The next message, from the plain socket: one already queued is taken at once;
        with none, the receive waits for the socket's descriptor as a DealerSocket's does
        (not through pyzmq's asyncio socket: a future, callbacks and flag enums a wait)."""
        frames = await self._next_frames()
        return self._check(frames[0].bytes, frames[1:])

    async def recv_queued(self, limit: int) -> list[Inbound]:
        """The next message and those queued behind it, at most `limit`: what one turn of
        the event loop takes (waits only while none is queued)."""
        received = [await self.recv()]
        check, queued = self._check, self._queued_frames
        for _ in range(limit - 1):
            try:
                frames = queued()
            except zmq.Again:
                break
            received.append(check(frames[0].bytes, frames[1:]))
        return received

    async def send(self, identity: bytes, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        """Queues `msg` for one peer without waiting (`send_nowait`)."""
        self.send_nowait(identity, msg, buffers)

    def send_nowait(self, identity: bytes, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        """Queues `msg` for one peer: raises zmq.Again when that peer's queue is full (it
        is not reading) and EHOSTUNREACH when it is not connected. Every send is DONTWAIT
        so none is ever parked, which would hold back the sends to every other peer behind
        it; so it goes straight to the plain socket, frame by frame as send_multipart would
        (the first frame is the one libzmq may refuse)."""
        send = self._send_frame
        send(identity, _DONTWAIT | _SNDMORE)
        if buffers:
            frames = protocol.encode(msg, buffers)
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                send(frame, _DONTWAIT | _SNDMORE if i < last else _DONTWAIT, copy=i == 0)
        else:  # kind and body alone, the common case
            send(protocol.encode_one(msg), _DONTWAIT)
        # A send can take the descriptor's signal of a message a waiting receive is owed
        # (`_readable`): once after every send of this loop turn, a receive that waits is
        # woken if a message is queued (one read of the socket's events covers them all).
        if not self._rearm_pending:
            self._rearm_pending = True
            asyncio.get_running_loop().call_soon(self._rearm)

    def _rearm(self) -> None:
        self._rearm_pending = False
        if self._reader is not None and not self._plain.closed and self._pollin():
            _settle(self._reader)

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        super().close()


class DealerSocket(_Socket):
    """A worker's socket to the controller; its identity is unique per connection.

    It sends and receives on the plain libzmq socket, waiting in the event loop itself, not
    through pyzmq's asyncio socket (a future, callbacks and flag enums per message: at a
    few hundred workers to a process, most of what a worker spends per message). A receive
    with nothing queued waits for the socket's descriptor, which libzmq signals on a change
    of the socket's events, edge-triggered: reading EVENTS (as every send and receive does)
    consumes the signal, so a receive reads EVENTS before it waits, and every send made
    while a receive waits looks for a message it may have taken the signal of. The
    descriptor is watched by the loop from the first wait to the socket's close (adding and
    removing the watch at every wait was two system calls a message); a signal that comes
    while no receive waits is consumed where it comes, and the next receive finds the
    message queued. A send the
    socket cannot take (the controller's queue is full; with `immediate`, no connection)
    waits, retrying, at most the send timeout (then zmq.Again); later sends wait behind it,
    in order."""

    def __init__(self, cfg: TransportConfig, identity: bytes, *, immediate: bool = False) -> None:
        super().__init__(cfg, zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        if immediate:  # a send waits for a live connection instead of queueing for one
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.identity = identity
        self._parked = 0  # sends waiting for room (a later one may not pass them)
        self._parked_order = asyncio.Lock()  # ... and among themselves, first come first sent
        self._send_timeout_s = 0.0
        self.set_send_timeout(cfg.heartbeat_timeout_s)

    def set_send_timeout(self, seconds: float) -> None:
        """A send waits at most this long for the controller to read (then zmq.Again):
        a controller that stops reading is as lost as one that stops talking."""
        self._send_timeout_s = max(1, int(seconds * 1000)) / 1000
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(seconds * 1000)))

    def connect(self, address: str) -> None:
        if self.cfg.curve_dir:
            server_public = _public_key(self.cfg.curve_dir, "server")  # its secret is the controller's alone
            public, secret = _curve_keys(self.cfg.curve_dir, "client")
            self.sock.curve_serverkey = server_public
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        self.sock.connect(address)

    async def recv(self) -> Inbound:
        """The next message (waits while none is queued)."""
        return self._check(b"", await self._next_frames())

    async def send(self, msg: protocol.Message, buffers: Sequence[Any] = ()) -> None:
        """Sends `msg`, waiting (at most the send timeout, then zmq.Again) while the socket
        cannot take it."""
        frames = protocol.encode(msg, buffers)
        if not self._parked and self._send_now(frames):
            return
        deadline = time.monotonic() + self._send_timeout_s
        self._parked += 1
        try:
            async with self._parked_order:
                pause = 0.001
                while not self._send_now(frames):
                    if time.monotonic() >= deadline:
                        raise zmq.Again()
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 0.05)
        finally:
            self._parked -= 1

    def _send_now(self, frames: list[Any]) -> bool:
        """Queues the message's frames if the socket takes them now (False: it does not), as
        send_multipart would, the first frame being the one libzmq may refuse."""
        send, last = self._send_frame, len(frames) - 1
        try:
            send(frames[0], _DONTWAIT | _SNDMORE if last else _DONTWAIT, copy=True)
        except zmq.Again:
            return False
        for i in range(1, last + 1):  # the rest of a message whose first frame was taken is taken too
            send(frames[i], _DONTWAIT | _SNDMORE if i < last else _DONTWAIT, copy=False)
        if self._reader is not None and self._pollin():
            _settle(self._reader)  # the send took the signal of a message the receive waits for
        return True


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
