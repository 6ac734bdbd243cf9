"""What the controller's components need of the collaborators they share, as
`typing.Protocol`s that scripts/typecheck.py holds every user and every implementation to.

A component names the narrowest of these it uses (a trainer's allocator only calls
workers; the rebalancer only reads the registry), so a test double implements that much
and no more. `ControllerServer` (control/server.py) implements them all. Protocols used by one component
live beside it instead (weight_sync.ServedInstances, openai_turns.TurnEndpoint, ...).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol, Sequence

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol

from .registry import WorkerRegistry

# Where a component writes its events: the run's event log (and what watches it).
Emit = Callable[[ev.Event], None]


class WorkerCalls(Protocol):
    """Requests to workers, each answered by one reply."""

    def next_request_id(self) -> int: ...

    async def call(self, worker_id: str, msg: protocol.Message, buffers: Sequence[Any] = (),
                   timeout: float | None = None,
                   on_sent: Callable[[], None] | None = None) -> tuple[Any, list[Any]]:
        """The reply (its type follows the request's: protocol.py pairs them) and its buffers."""

    def request(self, worker_id: str, msg: protocol.Message) -> asyncio.Future:
        """`call` sent at once, without a task: the future of the reply and its buffers."""


class WorkerDirectory(Protocol):
    """The registry of connected workers (who is alive, who serves what)."""

    @property
    def registry(self) -> WorkerRegistry: ...


class WorkerServer(WorkerCalls, WorkerDirectory, Protocol):
    """Calls to workers and the registry of them."""
