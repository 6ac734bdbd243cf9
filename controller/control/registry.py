"""The registry of workers: who joined, what they offer, whether they are alive.

Plain synchronous data and decisions (accept or refuse a HELLO, who has expired), so it
is tested without sockets and replayed without processes. It never sends anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flexmarl.runtime import protocol

ROLES = ("rollout", "trainer", "env")
# Worker ids name files, log lines and metrics; a longer one is a malformed HELLO.
MAX_WORKER_ID_CHARS = 128


class RegistrationRefused(Exception):
    """A HELLO was refused; the message is sent back to the worker in a REJECT."""


@dataclass
class WorkerInfo:
    worker_id: str
    identity: bytes
    role: str
    host: str
    pid: int
    devices: list[str]
    capacity: dict[str, float]
    last_seen: float  # when a message last came from it (the server sets it per message)
    alive: bool = True
    why_gone: str = ""
    visible_gpus: list[str] = field(default_factory=list)  # the GPUs it was pinned to; empty: not pinned
    load: dict[str, float] = field(default_factory=dict)
    last_sent: float = 0.0  # when a message last went to it (any message tells it the controller lives)


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self._by_identity: dict[bytes, WorkerInfo] = {}  # a live worker's connection -> the worker
        # The live worker on a connection (None: none), asked per inbound message: the dict's own lookup.
        self.by_identity: Callable[[bytes], WorkerInfo | None] = self._by_identity.get

    def register(self, hello: protocol.Hello, identity: bytes, now: float) -> WorkerInfo:
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            raise RegistrationRefused(
                f"protocol version {hello.protocol_version} is not supported (controller speaks "
                f"{protocol.PROTOCOL_VERSION}); run the same FlexMARL version everywhere")
        if hello.role not in ROLES:
            raise RegistrationRefused(f"unknown role {protocol.shorten(repr(hello.role), 60)} "
                                      f"(expected one of {ROLES})")
        if not hello.worker_id:
            raise RegistrationRefused("empty worker id")
        if len(hello.worker_id) > MAX_WORKER_ID_CHARS:
            raise RegistrationRefused(f"worker id of {len(hello.worker_id)} characters is longer than "
                                      f"{MAX_WORKER_ID_CHARS}; choose a shorter --worker-id")
        current = self.workers.get(hello.worker_id)
        if current is not None and current.alive:
            raise RegistrationRefused(
                f"worker id {hello.worker_id!r} is already registered (pid {current.pid} on "
                f"{current.host}); give each worker a unique --worker-id")
        if identity in self._by_identity:
            raise RegistrationRefused("this connection has already registered")
        info = WorkerInfo(hello.worker_id, identity, hello.role, hello.host, hello.pid,
                          list(hello.devices), dict(hello.capacity), now,
                          visible_gpus=list(hello.visible_gpus))
        self.workers[hello.worker_id] = info
        self._by_identity[identity] = info
        return info

    def heard_all(self, at: float) -> None:
        """Every live worker counts as heard from at `at` or later: the controller itself
        could not listen until then."""
        for w in self.workers.values():
            if w.alive:
                w.last_seen = max(w.last_seen, at)

    def expired(self, now: float, timeout_s: float) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and now - w.last_seen > timeout_s]

    def mark_gone(self, info: WorkerInfo, why: str) -> None:
        info.alive = False
        info.why_gone = why
        self._by_identity.pop(info.identity, None)

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]
