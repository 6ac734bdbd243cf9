"""The order of each trainer's commands: which command goes to a trainer next.

A trainer holds `depth` commands at once (one running, one queued, so it never idles on a
round trip); everything else waits here, in priority order, for a slot (`TrainerLanes.slot`).
Priorities are named (`Priority`): the critical lane (an optimizer step, the weight sync
and checkpoint that follow it: on the next rollout's critical path) never waits here; it
goes to the trainer at once, over the depth, where it passes queued micro-batches of other
agents (the trainer's CommandQueue) and waits only for the command running. In the
micro-batch lane the oldest version goes first, then the micro-batch whose samples were
ready first, whichever agent it is: in a chain the first agent's samples are ready first,
and the next batch's episodes start with its new weights.

It knows trainers by id only: not which agents they hold (allocator.py) nor what the
commands do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
from enum import IntEnum
from typing import NamedTuple


class Lane(IntEnum):
    CRITICAL = 0  # optimizer step, weight sync, checkpoint: sent at once
    MICRO_BATCH = 1  # forward/backward: waits for a slot


class Priority(NamedTuple):
    """Lower goes first; equal priorities keep their order."""

    lane: Lane
    version: int = 0
    ready_seq: int = 0  # among micro-batches of one version: when their samples were ready

    @classmethod
    def critical(cls, version: int) -> "Priority":
        return cls(Lane.CRITICAL, version)

    @classmethod
    def micro_batch(cls, version: int, ready_seq: int) -> "Priority":
        return cls(Lane.MICRO_BATCH, version, ready_seq)


class TrainerLanes:
    def __init__(self, depth: int = 2) -> None:
        self.depth = depth  # commands each trainer holds at once
        self.running: collections.Counter[str] = collections.Counter()  # per trainer (read-only outside)
        self._queue: dict[str, list] = collections.defaultdict(list)
        self._seq = itertools.count()

    @contextlib.asynccontextmanager
    async def slot(self, trainer: str, priority: Priority):
        """Holds one of the trainer's command slots (see the module doc)."""
        if priority.lane == Lane.CRITICAL or (self.running[trainer] < self.depth and not self._queue[trainer]):
            self.running[trainer] += 1
        else:
            granted = asyncio.get_running_loop().create_future()
            heapq.heappush(self._queue[trainer], (priority, next(self._seq), granted))
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._free(trainer)
                raise
        try:
            yield
        finally:
            self._free(trainer)

    def _free(self, trainer: str) -> None:
        queue = self._queue[trainer]
        while queue and self.running[trainer] <= self.depth:
            _, _, granted = heapq.heappop(queue)
            if not granted.done():
                granted.set_result(None)  # the slot passes on; the running count is unchanged
                return
        self.running[trainer] -= 1
