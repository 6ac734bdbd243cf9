"""Agent-centric trainer allocation: trainers are a pool; an agent holds one only while it
has training work, and idle agents' training states are parked in host memory.

`decisions.choose_placement` is the decision (plain data in, a placement out).
`TrainerAllocator` applies it: `acquire(agent)` returns the trainer the agent is resident on, swapping it in
first if needed (parking an idle agent to make room); `release(agent)` ends one piece of
work. An agent with work in flight or ready (`work(agent)`, its pipeline's count) is never
swapped out, so its micro-batches, step and publish are served in one stay; its state has
exactly one owner at any moment: a trainer while resident, else the parked copy, which is
released only after the new owner has loaded it (so a trainer dying mid-swap leaves the
last good copy where it was; a trainer that loads a copy it parked itself takes it back,
and nothing is left to release). `prefetch(agent)` starts a swap early, while rollout
still runs. `holding(agent)` names where the agent's state is without moving it, for a
checkpoint: its trainer, or the trainer keeping its parked copy.

Every swap-in is counted per agent (`swaps_of`), with the seconds ready work of the agent
waited on it: from when the first acquire for work found it parked (or the swap began,
if later) to the end of the swap; a prefetch nobody waits for costs nothing there.

A trainer that dies leaves the pool (`trainer_died`). States resident on it are lost until
the agent's pipeline `recover`s them (from its last saved state); an agent it was loading
stays parked and is placed on another trainer; a parked copy it held is loaded from where
it is if it still can be. A trainer that (re)joins enters the pool (`trainer_joined`).

It knows trainers by id and talks to them only through the controller server. The order
of each trainer's commands is not its business (trainer_lanes.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.params.types import ParamHandle

from ..control.interfaces import Emit, WorkerCalls
from ..control.server import WorkerDied
from ..state.decisions import AgentWork, choose_placement

if TYPE_CHECKING:
    from flexmarl.runtime.config import AgentConfig

log = logging.getLogger("flexmarl.allocator")


class AgentLost(RuntimeError):
    """The agent's training state died with its trainer; `recover` gives it a new one."""


@dataclass
class Parked:
    holder: str  # the trainer whose channel serves the parked copy; "" for a checkpoint file
    handle: ParamHandle  # passed on to LoadAgent and ReleaseState, never looked into
    version: int
    accumulated: int
    nbytes: int
    shards: list[ParamHandle] = field(default_factory=list)  # a trainer group's ranks 1..N-1, passed on likewise
    checksum: str = ""  # a checkpoint file's SHA-256 from its manifest, which the trainer checks


@dataclass
class SwapCount:
    """One agent's swap-ins from a parked copy so far, and what they cost the critical path."""

    ins: int = 0
    waited_s: float = 0.0  # seconds an acquire for ready work waited on them


@dataclass
class AgentSpecs:
    """What a trainer is told to load for each agent (InitAgent, LoadAgent): its config,
    model and seed; how a trainer holds it (an adapter agent: as its base says) and, for an
    adapter agent, its LoRA shape (None: a whole model)."""

    config: dict[str, AgentConfig]
    model_path: dict[str, str]
    seed: int
    settings: dict[str, protocol.TrainerSettings]
    lora: dict[str, protocol.LoraSettings | None]

    def trainer_settings(self, agent: str) -> protocol.TrainerSettings:
        return self.settings.get(agent) or self.config[agent].trainer_settings()


class TrainerAllocator:
    def __init__(self, server: WorkerCalls, trainers: list[str], capacity: int, agent_config: dict[str, AgentConfig],
                 model_path: dict[str, str], seed: int, work: Callable[[str], AgentWork],
                 emit: Emit, trainer_wait_s: float = 60.0,
                 settings: dict[str, protocol.TrainerSettings] | None = None,
                 lora: dict[str, protocol.LoraSettings | None] | None = None,
                 saves_parked: bool = True) -> None:
        self.server = server
        self.specs = AgentSpecs(agent_config, model_path, seed, settings or {}, lora or {})
        self.trainer_wait_s = trainer_wait_s
        self.trainers = list(trainers)
        self.capacity = capacity
        self.work = work
        # A trainer of one process writes a parked agent's checkpoint from the copy it keeps;
        # a trainer group's parked shards are written by swapping the agent in.
        self.saves_parked = saves_parked
        self.emit = emit
        self.resident: dict[str, str] = {}
        self.parked: dict[str, Parked] = {}
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.last_used: dict[str, float] = {}
        self.swaps = 0
        self.swap_counts: dict[str, SwapCount] = collections.defaultdict(SwapCount)
        self._waiting: dict[str, list[float]] = collections.defaultdict(list)  # agent -> starts of acquires for work
        self.lost: dict[str, str] = {}  # agent -> the dead trainer its training state died with
        self._lock = asyncio.Lock()  # one placement change at a time
        self._changed = asyncio.Event()
        self._prefetches: set[asyncio.Task] = set()
        self.on_parked: list[Callable[[str], None]] = []  # told once an agent's state is parked

    async def acquire(self, agent: str, *, lost: str = "wait") -> str:
        """The trainer holding `agent`, which stays there until the matching release().
        An agent whose state died with its trainer raises AgentLost with lost="raise" (its
        pipeline, which restores it) and otherwise waits until it is restored. With no
        trainer in the pool, waits `trainer_wait_s` for one to join before raising. Work
        waits on the call: the time it waits on a swap-in of the agent is counted."""
        started = time.monotonic()
        self._waiting[agent].append(started)
        try:
            return await self._acquire(agent, lost)
        finally:
            self._waiting[agent].remove(started)

    def _bind(self, agent: str) -> str:
        self.in_flight[agent] += 1
        self.last_used[agent] = time.monotonic()
        return self.resident[agent]

    async def _acquire(self, agent: str, lost: str) -> str:
        while True:
            if agent in self.lost:
                if lost == "raise":
                    raise AgentLost(f"the training state of {agent} died with trainer {self.lost[agent]}")
            elif not self.trainers:
                where = f"; its state is parked with {self.parked[agent].holder}" if agent in self.parked else ""
                if not await self._changed_within(self.trainer_wait_s):
                    raise RuntimeError(f"no trainer is left in the pool to train {agent}{where}, and none "
                                       f"joined within {self.trainer_wait_s:.0f}s")
                continue
            elif agent in self.resident:
                return self._bind(agent)
            else:
                async with self._lock:
                    if agent in self.resident or agent in self.lost or not self.trainers:
                        continue
                    placement = self._placement(agent, prefetch=False)
                    if placement is not None:
                        await self._place(agent, *placement)
                        continue
            self._changed.clear()
            await self._changed.wait()

    async def _changed_within(self, seconds: float) -> bool:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return bool(self.trainers)

    def recover(self, agent: str, state: ParamHandle | None, version: int, checksum: str = "") -> None:
        """After its trainer died: the agent's state is `state` (a saved training state at
        `version`, loaded on the next acquire, its file checked against `checksum` where
        given) or, with None, a fresh initialisation."""
        self.lost.pop(agent, None)
        self.resident.pop(agent, None)
        if state is None:
            self.parked.pop(agent, None)
        else:
            self.parked[agent] = Parked("", state, version, 0, state.total_bytes, checksum=checksum)
        self._changed.set()

    def trainer_joined(self, trainer: str) -> None:
        """A trainer (new, or restarted under its old id) joins the pool."""
        if trainer not in self.trainers:
            self.trainers.append(trainer)
        self._changed.set()

    def work_changed(self) -> None:
        """An agent's work for a trainer shrank (`work`): placements waiting on it look again."""
        self._changed.set()

    def release(self, agent: str) -> None:
        self.in_flight[agent] -= 1
        assert self.in_flight[agent] >= 0, f"release without acquire for {agent}"
        self._changed.set()

    def prefetch(self, agent: str) -> None:
        """Swap `agent` in now if that needs no waiting and parks nobody with work ready or
        coming (`choose_placement`), so the swap overlaps rollout."""
        if agent in self.resident or self._lock.locked() or any(not t.done() for t in self._prefetches):
            return
        if self._placement(agent, prefetch=True) is None:
            return

        async def swap_in() -> None:  # once, if still possible when the lock is ours; never waits for a victim
            async with self._lock:
                placement = self._placement(agent, prefetch=True)
                if agent not in self.resident and agent not in self.lost and self.trainers and placement:
                    await self._place(agent, *placement)

        task = asyncio.ensure_future(swap_in())
        self._prefetches.add(task)
        task.add_done_callback(self._prefetch_done)

    def _placement(self, agent: str, prefetch: bool) -> tuple[str, str | None] | None:
        return choose_placement(agent, self.trainers, self.capacity, self.resident, self.in_flight,
                                {a: self.work(a) for a in self.specs.config}, self.last_used, prefetch)

    @contextlib.asynccontextmanager
    async def holding(self, agent: str):
        """The trainer that holds `agent`'s state now, resident or parked, kept there until
        the block ends: for a command that reads the state where it is (a checkpoint), so
        nothing is swapped in for it. A resident agent is pinned like an acquire; a parked
        copy stays with its trainer (a swap-in of it reaches that trainer after this
        command). An agent parked where no live trainer writes from it (a trainer group, a
        trainer that died, a checkpoint file) is swapped in, as acquire() would."""
        if agent not in self.resident and agent not in self.parked:
            async with self._lock:  # being parked right now: where it ends up is known once the swap is done
                pass
        parked = self.parked.get(agent)
        if (agent not in self.resident and agent not in self.lost and parked is not None and self.saves_parked
                and parked.holder in self.trainers):
            yield parked.holder
            return
        trainer = await self.acquire(agent, lost="raise")
        try:
            yield trainer
        finally:
            self.release(agent)

    def swaps_of(self, agent: str) -> SwapCount:
        """`agent`'s swap-ins so far (a copy)."""
        count = self.swap_counts[agent]
        return SwapCount(count.ins, count.waited_s)

    def _prefetch_done(self, task: asyncio.Task) -> None:
        self._prefetches.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("prefetch swap failed: %r (the agent will be swapped in on demand)", task.exception())

    async def _place(self, agent: str, trainer: str, victim: str | None) -> None:
        t0 = time.monotonic()
        if victim is not None:
            await self._park(victim)
        cfg = self.specs.config[agent]
        if agent in self.parked:
            parked = self.parked[agent]
            try:
                await self.server.call(trainer, protocol.LoadAgent(
                    self.server.next_request_id(), agent, self.specs.model_path[agent], cfg.lr, cfg.max_grad_norm,
                    parked.version, parked.accumulated, parked.handle, self.specs.trainer_settings(agent), parked.shards,
                    self.specs.lora.get(agent), checksum=parked.checksum))
            except WorkerDied:
                if getattr(self.server, "closing", False):
                    # Shutting down: the pool keeps its trainers, so acquire() would place
                    # the agent on this dead one again at once, forever, without yielding.
                    raise
                # Nothing was trained on a half-loaded state: the parked copy is still the
                # owner, and acquire() places the agent on a trainer that is alive.
                self.trainer_died(trainer)
                self.emit(ev.AllocationChanged("trainer", agent, [], f"{trainer} died while loading it; "
                                                                    f"still parked with {parked.holder}"))
                return
            # The new owner has the state; only now may the parked copy go (a checkpoint's
            # file stays: it belongs to the run directory; a trainer that took back its own
            # copy holds nothing more to release).
            del self.parked[agent]
            if parked.holder and parked.holder != trainer:
                await self._release_parked(agent, parked)
            source = f"{parked.holder}'s host memory" if parked.holder else f"checkpoint {parked.handle.path}"
            why = f"swapped in from {source} ({parked.nbytes / 1e6:.1f} MB)"
            swapped = bool(parked.holder)
        else:
            reply, _ = await self.server.call(trainer, protocol.InitAgent(
                self.server.next_request_id(), agent, self.specs.model_path[agent], cfg.lr, self.specs.seed, cfg.max_grad_norm,
                self.specs.trainer_settings(agent), self.specs.lora.get(agent)))
            why = f"initial placement ({reply.num_params / 1e6:.2f}M parameters)"
            swapped = False
        self.resident[agent] = trainer
        if victim is not None or swapped:
            self.swaps += 1
        end = time.monotonic()
        waited = end - max(min(self._waiting[agent], default=end), t0)
        if swapped:
            count = self.swap_counts[agent]
            count.ins += 1
            count.waited_s += waited
        self.emit(ev.AllocationChanged("trainer", agent, [trainer], f"{why}, {end - t0:.3f}s",
                                       swap="in" if swapped else "", seconds=round(end - t0, 4),
                                       waited_s=round(waited, 4)))
        log.info("%s bound to %s (%s)", agent, trainer, why)
        self._changed.set()

    async def _release_parked(self, agent: str, parked: Parked) -> None:
        try:
            await self.server.call(parked.holder, protocol.ReleaseState(
                self.server.next_request_id(), agent, parked.handle, parked.shards))
        except WorkerDied:
            log.warning("%s, which held the parked copy of %s, died after the copy was loaded; "
                        "the launcher removes its segments once it is reaped", parked.holder, agent)

    async def _park(self, agent: str) -> None:
        # Unbound before the first await: from here on acquire(agent) queues behind this
        # swap instead of sending work that would reach the trainer after the offload.
        trainer = self.resident.pop(agent)
        try:
            reply, _ = await self.server.call(trainer, protocol.OffloadAgent(self.server.next_request_id(), agent))
        except BaseException as exc:
            self.resident[agent] = trainer  # the offload did not happen; it is still there
            if isinstance(exc, WorkerDied):
                self.trainer_died(trainer)  # ... unless it died with its trainer
            raise
        self.parked[agent] = Parked(trainer, reply.handle, reply.version, reply.accumulated, reply.nbytes,
                                    list(reply.shards))
        for listener in self.on_parked:  # parking released the agent's published weights
            listener(agent)
        self.emit(ev.AllocationChanged("trainer", agent, [], f"parked in {trainer}'s host memory "
                                                            f"({reply.nbytes / 1e6:.1f} MB, {reply.seconds:.3f}s)",
                                       swap="out", seconds=round(reply.seconds, 4)))

    def trainer_died(self, trainer: str) -> list[str]:
        """Take a dead trainer out of the pool; returns the agents whose states died with it.
        After shutdown was sent, trainers leaving is expected and changes nothing."""
        if getattr(self.server, "closing", False):
            return []
        if trainer in self.trainers:
            self.trainers.remove(trainer)
        lost = sorted(a for a, t in self.resident.items() if t == trainer)
        for agent in lost:
            del self.resident[agent]
            self.lost[agent] = trainer
            self.emit(ev.AllocationChanged("trainer", agent, [], f"lost: {trainer} died"))
        self._changed.set()  # waiters re-check: the pool changed
        return lost

    async def close(self) -> None:
        for task in list(self._prefetches):
            task.cancel()
        await asyncio.gather(*self._prefetches, return_exceptions=True)
