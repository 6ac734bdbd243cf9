"""The batch schedule: where every global batch stands, the staleness gate, wake-ups.

One `BatchProgress` record per global batch (episodes left and failed, when its rollout
started and ended, how many agents have stepped it, when the last one synced).
`BatchSchedule` holds them and the events the loops wait on; it reads each agent's synced
version from `SyncedVersions` (versions.py), which it does not write:
- the episode producer waits in `wait_to_start(batch)` (sync mode: until every agent's
  weights are at batch - 1; async mode: never) and reports `episode_ended(batch)` (a
  failed one with why: counted, the first kept for the error that stops the run); with
  dynamic sampling it holds a batch's rollout open (`hold`) until it has drawn the extra
  episodes the batch needs (`add_episodes`, `settled`) and `release`s it;
- every turn of an episode waits at `gate(agent, batch)` until the agent's rollout weights
  are within the staleness bound for the batch (a snapshot's: until its refresh due before
  the batch, within the same bound; a frozen agent's never wait);
- each agent's pipeline waits in `wait_for_work(agent)`, woken by `work_arrived(agent)`
  (a group became trainable) or by any batch's rollout ending, and reports
  `agent_stepped(batch)`;
- a change of a synced version (the weight sync sets it) unblocks the producer and the
  turns waiting at the gate for that agent (no other agent's);
- with continuous admission (`pipeline.admission`), an episode is not its starting batch's:
  its first turn (through `gate_of` its `EpisodeSlot`) is admitted while the episodes
  running and ended fit in the batches up to the newest every trained agent's version may
  generate for, plus `spares` (`decisions.may_admit`), waiting for a version change
  otherwise; when it ends, `assign` names the batch that trains it
  (`decisions.assigned_batch`: the first queries_per_step episodes to end fill a batch, a
  slower one carries over, but no newer episode takes the place an older one needs within
  its staleness bound), and that batch's `episode_ended` counts it. The last batch takes every episode left;
  once every batch a running episode's bound allows is full (`doomed`,
  `decisions.doomed_through`), no batch could train it: it leaves its slot at once (the
  producer abandons it: its requests are aborted in the engines, its samples dropped as
  `decisions.ABANDONED`, a fresh spare begun in its place), and no first turn is admitted
  into a bound already full. Only spares make this happen (without them every admitted
  episode keeps the place it needs), so abandoning stops only work that would be dropped;
- with capacity admission, the same, except that the spares are counted only as far as
  the first turn's agent has instances with no group left (`drained`, read from the
  instances' owner, which calls `instance_drained` when an instance's last group comes
  back): see "Capacity admission" below;
- an evaluation after step t (evaluation.py) holds every agent's sync to version t + 1
  (`wait_to_sync`) until it has run (`evaluated(t)`), so it measures version t.

Capacity admission (`pipeline.admission = "capacity"`), and why its rule is this one. An
episode admitted while the agents' versions allow batches up to `newest` can be trained
only by a batch up to `newest` (the bound applies to its oldest token, drawn now), and
those batches hold queries_per_step each. Continuous admission already admits up to that
count: within it every running episode can be trained if it ends in turn, so no first
turn waits while such room is left, whatever the instances' capacity (an engine's
max_num_seqs, 1024 by default, is never what binds; the staleness bound is). Past it, an
episode admitted before the version moves takes a place some running episode needs, and
whichever of them ends last is then too stale: more work for an instance before the
version moves is always bought with a dropped episode. So capacity admission spends that
price only where it buys engine time that would otherwise be idle: past the bound it
counts at most `partial_rollout` spares, and only as many as the first turn's agent has
instances with no group left (`decisions.spare_room`); the router then sends the group to
the least loaded instance, the drained one (with two instances always; with more, the less
loaded of two drawn at random, as for any group). An instance busy with its own groups never
draws a spare, so a spare is not over while every engine has work (continuous admission's
are, from the first batch on). The router counts work by group, which comes back whole,
so an instance counts as drained when its last group has (a group whose last sample runs
alone is not yet drained).

The rules themselves are in decisions.py. It does not know the store, workers or
trainers, only counts, versions and times.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from . import decisions
from .versions import SyncedVersions


@dataclass(eq=False)
class EpisodeSlot:
    """One episode's place under continuous admission: the batch it started as one of,
    the batch its first turn was admitted to (None until then)."""

    started: int
    admitted: int | None = None  # the newest batch its version allowed when its first turn was admitted
    drained: int = -1  # capacity admission: its agent's drained instances then (-1: continuous admission)
    doomed: bool = False  # abandoned: every batch its bound allows was full (`BatchSchedule.doomed`)


@dataclass
class BatchProgress:
    batch: int
    episodes_left: int
    rollout_done: asyncio.Event = field(default_factory=asyncio.Event)  # every episode ended
    trained_done: asyncio.Event = field(default_factory=asyncio.Event)  # every agent stepped and synced
    started: float | None = None  # its first episode started
    rollout_end: float | None = None  # its last episode ended
    agents_stepped: int = 0
    trained: float | None = None  # every agent stepped and synced it
    episodes_failed: int = 0
    first_failure: str = ""  # the first failed episode's reason and the user's traceback
    # Dynamic sampling: the batch's rollout stays open while a top-up holds it (`hold`),
    # which may add extra episodes; `settled` is set whenever no episode of it is running.
    held: int = 0
    extra_episodes: int = 0
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def rollout_s(self) -> float:
        return (self.rollout_end or 0.0) - (self.started or 0.0)

    @property
    def train_sync_s(self) -> float:
        return (self.trained or 0.0) - (self.rollout_end or 0.0)


class BatchSchedule:
    def __init__(self, agents: list[str], steps: int, episodes_per_batch: int, *, overlap: bool,
                 max_staleness: int, versions: SyncedVersions | None = None,
                 clock: Callable[[], float] = time.monotonic, snapshots: dict[str, int] | None = None,
                 continuous: bool = False, spares: int = 0,
                 drained: Callable[[str], int] | None = None) -> None:
        self.agents = list(agents)  # the trained agents: each steps every batch
        # Snapshot agents and their refresh intervals: their turns wait for their refresh.
        # Any other agent not in `agents` is frozen: no gate.
        self.snapshots = dict(snapshots or {})
        self.steps = steps
        self.overlap = overlap
        self.max_staleness = max_staleness
        self.clock = clock
        self.batches = {t: BatchProgress(t, episodes_per_batch) for t in range(1, steps + 1)}
        # Continuous admission: batches fill by the order episodes end (see the module doc).
        self.continuous = continuous
        self.quota, self.spares = episodes_per_batch, spares if continuous else 0
        self.batches[steps].episodes_left += self.spares  # the last batch trains the spares left
        self._due: collections.Counter[int] = collections.Counter()  # batch -> running episodes admitted with it newest
        self._admitted: list[EpisodeSlot] = []  # the running episodes' slots, in the order they were admitted
        self._ended: collections.Counter[int] = collections.Counter()  # batch -> episodes assigned to it
        self._freed = asyncio.Event()  # a slot was freed: admission waiters look again
        # Capacity admission: agent -> its instances with no group left (the instances'
        # owner's count); `instance_drained` wakes the admission waiters. None: continuous.
        self.drained = drained if continuous else None
        self.versions = versions if versions is not None else SyncedVersions(agents)  # read only
        self._work = {a: asyncio.Event() for a in agents}
        self.first_batch = 1  # later after a resume
        self._evaluations: dict[int, asyncio.Event] = {}  # step -> set once its evaluation ran

    def resume_after(self, step: int, spares_over: int = 0) -> None:
        """A run resumed from the checkpoint of `step`: batches up to it are done, every
        agent's instances hold version `step` (set in `SyncedVersions.resume_at`), and
        the loops start at batch step + 1. With continuous admission, `spares_over`
        episodes over-provisioned before the checkpoint are still over (begun, or begun
        again, by the producer): the spares count at least those, whatever
        `partial_rollout` says now (more are begun only if it asks for more)."""
        if self.continuous and spares_over > self.spares:
            self.batches[self.steps].episodes_left += spares_over - self.spares
            self.spares = spares_over
        for t in range(1, step + 1):
            progress = self.batches[t]
            progress.episodes_left, progress.agents_stepped = 0, len(self.agents)
            progress.rollout_done.set()
            progress.trained_done.set()
            progress.trained = progress.rollout_end = progress.started = None  # not timed in this process
        self.first_batch = step + 1

    # -- the episode producer and the gate

    async def wait_to_start(self, batch: int) -> None:
        while not decisions.may_start_episode(batch, {a: self.versions[a] for a in self.agents}, self.overlap):
            await self.versions.changed()
        progress = self.batches[batch]
        if progress.started is None:
            progress.started = self.clock()

    def episode_ended(self, batch: int, failure: str = "") -> None:
        """One episode of `batch` ended; `failure` says why it failed ("" if it did not)."""
        progress = self.batches[batch]
        progress.episodes_left -= 1
        if failure:
            progress.episodes_failed += 1
            progress.first_failure = progress.first_failure or failure
        if progress.episodes_left == 0:
            progress.settled.set()
            self._complete_if_done(progress)

    def _complete_if_done(self, progress: BatchProgress) -> None:
        if progress.episodes_left == 0 and not progress.held and not progress.rollout_done.is_set():
            progress.rollout_end = self.clock()
            progress.rollout_done.set()
            for event in self._work.values():  # pipelines waiting for the batch's end
                event.set()

    # -- dynamic sampling's top-ups (the producer's)

    def hold(self, batch: int) -> None:
        """The batch's rollout stays open after its episodes end, until `release`."""
        self.batches[batch].held += 1

    def release(self, batch: int) -> None:
        progress = self.batches[batch]
        progress.held -= 1
        self._complete_if_done(progress)

    def add_episodes(self, batch: int, n: int) -> None:
        """`n` extra episodes of a held batch are starting (each ends with `episode_ended`)."""
        progress = self.batches[batch]
        progress.episodes_left += n
        progress.extra_episodes += n
        if n:
            progress.settled.clear()

    async def settled(self, batch: int) -> None:
        """Returns once no episode of `batch` is running."""
        await self.batches[batch].settled.wait()

    async def gate(self, agent: str, batch: int) -> None:
        while not self._may_generate(agent, batch):
            await self.versions.changed(agent)  # its own agent's syncs (a snapshot's refreshes) only

    def _may_generate(self, agent: str, batch: int) -> bool:
        every = self.snapshots.get(agent)
        if every is not None:
            return decisions.may_play_snapshot(batch, self.versions[agent], every, self.max_staleness)
        if agent not in self.agents:  # frozen: its weights never change, nothing to wait for
            return True
        return decisions.may_generate(batch, self.versions[agent], self.max_staleness)

    # -- continuous admission

    def slot(self, batch: int) -> EpisodeSlot:
        """The place of an episode starting as one of `batch`'s."""
        return EpisodeSlot(batch)

    def gate_of(self, slot: EpisodeSlot, on_admitted: Callable[[EpisodeSlot], None] | None = None
                ) -> Callable[[str, int], Awaitable[None]]:
        """The staleness gate an episode's turns wait at: `gate` at its own batch, or with
        continuous admission at the newest batch its agent's version allowed when its first
        turn was admitted (`on_admitted` told then)."""
        if not self.continuous:
            return self.gate

        async def gate(agent: str, batch: int) -> None:
            if slot.admitted is None:
                await self._admit(slot, on_admitted, agent)
            assert slot.admitted is not None
            await self.gate(agent, slot.admitted)
        return gate

    async def _admit(self, slot: EpisodeSlot, on_admitted: Callable[[EpisodeSlot], None] | None, agent: str) -> None:
        while True:
            newest = self._newest_batch()
            drained = None if self.drained is None else self.drained(agent)
            if decisions.may_admit(sum(self._due.values()), self._ended, self.first_batch, newest, self.steps, self.quota,
                                   decisions.spare_room(self.spares, drained)):
                slot.admitted = newest
                slot.drained = -1 if drained is None else drained
                self._due[newest] += 1
                self._admitted.append(slot)
                if on_admitted is not None:
                    on_admitted(slot)
                return
            freed = self._freed
            waits = [asyncio.ensure_future(self.versions.changed()), asyncio.ensure_future(freed.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def instance_drained(self, worker: str) -> None:
        """An instance's last group came back (the instances' owner tells): under capacity
        admission a waiting first turn may now count on a spare."""
        if self.drained is not None:
            self._wake_admissions()

    def _wake_admissions(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    def _newest_batch(self) -> int:
        """The newest batch every trained agent's version may generate for now: an
        episode's groups may be any of theirs (a frozen agent or a snapshot, whatever turn
        comes first, waits at its own gate after)."""
        if not self.agents:
            return self.steps
        return min(self.steps, min(self.versions[a] for a in self.agents) + 1 + self.max_staleness)

    def assign(self, slot: EpisodeSlot) -> int:
        """An episode under continuous admission ended: the batch that trains it (the
        caller moves its groups there, then calls `episode_ended` of that batch)."""
        if slot.admitted is not None:
            self._due[slot.admitted] -= 1
            self._admitted.remove(slot)
        batch = decisions.assigned_batch(self._ended, +self._due, self.first_batch, self.steps, self.quota, self.spares,
                                         slot.admitted)
        self._ended[batch] += 1
        self._wake_admissions()
        return batch

    def doomed(self) -> list[EpisodeSlot]:
        """The running episodes no batch can train any more (`decisions.doomed_through`:
        every batch their bound allows is full), in the order they were admitted: each
        leaves the schedule here (marked `doomed`; it is never assigned) and its place
        frees at once, so a fresh episode may be admitted. The caller abandons them."""
        through = decisions.doomed_through(self._ended, self.first_batch, self.steps, self.quota)
        doomed = [s for s in self._admitted if s.admitted is not None and s.admitted <= through]
        for slot in doomed:
            assert slot.admitted is not None
            slot.doomed = True
            self._due[slot.admitted] -= 1
            self._admitted.remove(slot)
        if doomed:
            self._wake_admissions()
        return doomed

    # -- the per-agent pipelines

    def rollout_complete(self, batch: int) -> bool:
        return self.batches[batch].rollout_done.is_set()

    def work_arrived(self, agent: str) -> None:
        self._work[agent].set()

    async def wait_for_work(self, agent: str) -> None:
        await self._work[agent].wait()
        self._work[agent].clear()

    def agent_stepped(self, batch: int) -> bool:
        """Counts one agent's step (and sync) of `batch`; True when it was the last."""
        progress = self.batches[batch]
        progress.agents_stepped += 1
        if progress.agents_stepped == len(self.agents):
            progress.trained = self.clock()
            progress.trained_done.set()
            return True
        return False

    async def wait_trained(self, batch: int) -> None:
        await self.batches[batch].trained_done.wait()

    # -- evaluations

    def evaluation_at(self, step: int) -> None:
        """An evaluation will run after `step`: syncs to version step + 1 wait for it."""
        self._evaluations.setdefault(step, asyncio.Event())

    def evaluated(self, step: int) -> None:
        self._evaluations.setdefault(step, asyncio.Event()).set()

    async def wait_to_sync(self, version: int) -> None:
        """Returns once an agent's instances may move to `version` (no evaluation of
        version - 1 is still to run)."""
        held = self._evaluations.get(version - 1)
        if held is not None:
            await held.wait()

    @property
    def finished(self) -> bool:
        return all(p.trained_done.is_set() for p in self.batches.values())

    def trained_batches(self) -> list[BatchProgress]:
        return [p for p in self.batches.values() if p.trained is not None and p.started is not None]

    def stage_times(self) -> dict[str, float]:
        """Mean seconds per global batch from its first episode to its last (rollout) and
        from there to the last agent's synced weights (train + sync). Back to back in sync
        mode; overlapped (and then less meaningful) in async mode."""
        done = self.trained_batches()
        if not done:
            return {"rollout_s": 0.0, "train_sync_s": 0.0}
        return {"rollout_s": sum(p.rollout_s for p in done) / len(done),
                "train_sync_s": sum(p.train_sync_s for p in done) / len(done)}
