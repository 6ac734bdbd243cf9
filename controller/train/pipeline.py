"""One agent's training pipeline: micro-batches to a trainer, one step, one weight sync.

`AgentPipeline.run()` loops over the global batches in order. For each it
- consumes the store's ready groups of the batch, cut into micro-batches by
  `ExperienceStore.form_micro_batches` (async: as soon as a full one is ready, while
  rollout continues; sync: once the batch's rollout has ended), and sends each to the
  trainer the allocator binds the agent to (the gradients accumulate there, weights held
  fixed);
- waits for: ready groups or the batch's end (`schedule.wait_for_work`), a trainer
  (`allocator.acquire`), a command slot on it (`lanes.slot`: micro-batches in their lane,
  the step and sync in the critical one), the trainer's replies;
- once `decisions.step_due` says the batch is done, sends ONE optimizer step, and has the
  weight sync bring the agent's instances to the new version, which unblocks the gate (the
  agent's synced version, versions.py), while the event log is flushed (a crash loses
  nothing that led to a step once the step is done); then writes the step's metrics row
  and, where a checkpoint is due, makes the metrics durable and has the agent's state
  saved (before anything of the next batch reaches the trainer, so the saved state has no
  pending gradients; after the row, so a checkpoint never outlives its step's row);
- counts steps the trainer skipped for a non-finite gradient (`StepStats.skipped`): the
  version still advances, with the last version's (finite) weights, so the sync, the
  staleness gate and checkpoints keep one version per global batch; each is logged
  (`StepSkipped`) and counted in metrics, and `max_skipped_steps` in a row end the run;
- says what work it has for a trainer (`work`: micro-batches sent or formable and a step
  under way, ready now; samples that do not make a micro-batch yet, coming): the
  allocator parks no agent with work ready, and prefetches none over one with samples
  coming;
- writes a checkpoint's part wherever the agent's state is (`allocator.holding`): a
  parked agent is saved from its parked copy, never swapped in for it;
- keeps every micro-batch since the agent's last saved state (read, not committed): when
  the trainer holding the agent dies, `_recover` restores that state on a live trainer and
  trains those micro-batches again, so every sample ends up in the weights exactly once;
- produces: one metrics row per step (with the agent's swap-ins since the last row and
  the seconds its ready work waited on them), `MicroBatchFormed` / `MicroBatchTrained` /
  `OptimizerStep` events, and the trained groups let go.

It does not know other agents, the workflow, or how rollout is routed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine

from flexmarl.runtime import events as ev
from flexmarl.runtime import protocol
from flexmarl.runtime.aio import retrieved
from flexmarl.runtime.checksums import DamagedFile
from flexmarl.runtime.config import PipelineConfig
from flexmarl.runtime.params.types import ParamHandle

from ..control.interfaces import Emit, WorkerCalls
from ..control.server import WorkerDied
from ..state import decisions
from ..state.failures import RunFailed, too_many_failures
from ..state.schedule import BatchSchedule
from ..state.store import ExperienceStore, MicroBatch
from ..weights.sync import WeightSync
from .allocator import AgentLost, TrainerAllocator
from .checkpoints import CheckpointError
from .trainer_lanes import Priority, TrainerLanes

if TYPE_CHECKING:
    from ..records.metrics import MetricsLog
    from .checkpoints import Checkpointer

log = logging.getLogger("flexmarl.pipeline")


@dataclass
class StepTimes:
    rollout_s: float = 0.0
    train_s: float = 0.0
    sync_s: float = 0.0


@dataclass
class Recovery:
    """What the agent needs to recover from losing its trainer. Read, not yet committed:
    every micro-batch trained since the saved training state before its last one
    (`earlier_version`; the last is `saved_version`), by batch. A trainer that dies loses
    what it accumulated and stepped since; these are what is trained again, at most
    `limit` times, from the last saved state, or from the one before when the last was
    damaged on disk since it was written."""

    limit: int
    saved_version: int
    earlier_version: int | None = None  # None: no earlier saved state to fall back to
    kept: dict[int, list[MicroBatch]] = field(default_factory=dict)
    count: int = 0  # trainer losses recovered from so far


@dataclass
class TrainedCounts:
    """Per batch: the samples its optimizer step covered and the tokens trained."""

    samples: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class SkippedSteps:
    """Optimizer steps skipped for a non-finite gradient: in a row now, and in all."""

    in_row: int = 0
    total: int = 0


class AgentPipeline:
    def __init__(self, agent: str, cfg: PipelineConfig, store: ExperienceStore, schedule: BatchSchedule,
                 allocator: TrainerAllocator, weights: WeightSync, server: WorkerCalls, metrics: MetricsLog,
                 emit: Emit, flush_events: Callable[[], Awaitable[None]],
                 loss: protocol.LossOptions | None = None, checkpoints: Checkpointer | None = None,
                 lanes: TrainerLanes | None = None, max_recoveries: int = 10) -> None:
        self.agent = agent
        self.checkpoints = checkpoints
        self.loss = loss or protocol.LossOptions()
        self.cfg = cfg
        self.store = store
        self.schedule = schedule
        self.allocator = allocator
        self.lanes = lanes if lanes is not None else TrainerLanes()  # shared by every agent's pipeline
        self.weights = weights
        self.server = server
        self.metrics = metrics
        self.emit = emit
        self.flush_events = flush_events
        self.micro_batch_size = decisions.MicroBatchSize(cfg.micro_batch, cfg.micro_batch_tokens)
        self.recovery = Recovery(max_recoveries, saved_version=schedule.first_batch - 1)
        self.trained = TrainedCounts()
        self.skipped = SkippedSteps()
        self.batch = schedule.first_batch  # the global batch being trained
        self._pending = 0  # micro-batches and steps sent for a trainer and not finished
        self._swaps_recorded = (0, 0.0)  # the allocator's swap-ins of the agent at the last metrics row

    @property
    def overlap(self) -> bool:
        """Async mode: the batch's rollout and training overlap."""
        return self.cfg.mode == "async"

    @property
    def samples_trained(self) -> int:
        return sum(self.trained.samples.values())

    @property
    def tokens_trained(self) -> int:
        return sum(self.trained.tokens.values())

    def work(self) -> decisions.AgentWork:
        """What the agent has for a trainer now (see the module doc)."""
        waiting = self.store.waiting(self.agent)
        here = self.store.ready_samples(self.agent, self.batch)
        formable = here if decisions.cut_micro_batch(here, self.cfg.micro_batch,
                                                     self.schedule.rollout_complete(self.batch),
                                                     self.overlap) else 0
        return decisions.AgentWork(self._pending + formable, waiting - formable)

    def group_ready(self) -> None:
        """A group of the agent's became trainable (the store's `on_ready`): the pipeline is
        woken where it has something to do now: a micro-batch of the batch it trains can be
        cut (`decisions.cut_micro_batch`), or its agent is not on a trainer (a swap-in may
        start while rollout runs). Otherwise the group waits for the one that completes a
        micro-batch, or for the batch's end (which wakes every pipeline); one of a later
        batch is formed when the pipeline comes to that batch, before it waits. Each wake is
        a task switch of the controller's loop: one per group was the most frequent of them."""
        batch = self.batch
        ready = self.store.ready_size(self.agent, batch, self.micro_batch_size)
        if ready and (self.agent not in self.allocator.resident
                      or decisions.cut_micro_batch(ready, self.micro_batch_size.limit,
                                                   self.schedule.rollout_complete(batch), self.overlap)):
            self.schedule.work_arrived(self.agent)

    def _tracked(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """`work` as a task counted in `work()` until it ends. The count drops inside the
        task, right after the trainer is released and before anything woken by that runs
        (a done-callback would run after them: an agent waiting for this one to be parked
        would find it still busy, and nothing would wake it again); the allocator is told."""
        self._pending += 1
        began = False

        async def counted() -> Any:
            nonlocal began
            began = True
            try:
                return await work
            finally:
                self._work_ended()

        def never_began(_: asyncio.Future) -> None:  # cancelled before its first step
            if not began:
                work.close()
                self._work_ended()

        task = asyncio.ensure_future(counted())
        task.add_done_callback(never_began)
        return task

    def _work_ended(self) -> None:
        self._pending -= 1
        self.allocator.work_changed()

    def _dynamic_sampling(self, batch: int) -> dict[str, int]:
        """With dynamic sampling: the step's groups dropped for equal rewards and as surplus,
        and the extra episodes its batch drew."""
        if self.agent not in self.store.dynamic:
            return {}
        dropped = self.store.dynamic_dropped
        return {"groups_equal_dropped": dropped(self.agent, batch, decisions.EQUAL_REWARDS),
                "groups_surplus_dropped": dropped(self.agent, batch, decisions.SURPLUS),
                "extra_episodes": self.schedule.batches[batch].extra_episodes}

    def _swaps_since_last_row(self) -> dict[str, float]:
        count = self.allocator.swaps_of(self.agent)
        ins, waited = self._swaps_recorded
        self._swaps_recorded = (count.ins, count.waited_s)
        return {"swap_ins": count.ins - ins, "swap_wait_s": round(count.waited_s - waited, 4)}

    async def run(self) -> None:
        last_end = time.monotonic()
        for batch in range(self.schedule.first_batch, self.schedule.steps + 1):
            self.batch = batch
            self.recovery.kept[batch] = []
            recorded = False
            while True:
                try:
                    if not recorded:  # (a recovery during the checkpoint trains the batch again)
                        trained, train_s, stepping = await self._train_batch(batch)
                        t_sync = time.monotonic()
                        stats = await stepping
                        now = time.monotonic()
                        times = StepTimes(self.schedule.batches[batch].rollout_s, train_s, now - t_sync)
                        # The row is written before the checkpoint of this step can be final: a
                        # crash right after the checkpoint loses no row (the resume starts after it).
                        self.metrics.record(batch, self.agent, batch, trained, times,
                                            step_s=round(now - last_end, 4), skipped_steps=self.skipped.total,
                                            episodes_failed=self.schedule.batches[batch].episodes_failed,
                                            **self._swaps_since_last_row(), **step_signals(stats),
                                            **self._dynamic_sampling(batch))
                        recorded, last_end = True, now
                    else:
                        await self._restep(batch)
                    await self._checkpoint(batch)
                    break
                except (WorkerDied, AgentLost) as exc:
                    await self._recover(batch, exc)
            if self.schedule.agent_stepped(batch):
                self.metrics.end_step(batch, self.schedule.steps)

    async def _checkpoint(self, version: int) -> None:
        """Saves the agent's state at `version` where a checkpoint is due. Called before
        anything of the next batch reaches the trainer: the saved state has no pending
        gradients."""
        if self.checkpoints is None or not self.checkpoints.due(version):
            return
        await self.metrics.make_durable()
        try:
            await self._save_where_held(self.checkpoints, version)
        except WorkerDied:
            if self.agent in self.allocator.lost:
                raise  # its state died with its trainer: `_recover` restores it
            await self._save_where_held(self.checkpoints, version)  # the trainer keeping its parked copy died: swapped in elsewhere
        self._committed(version)

    async def _save_where_held(self, checkpoints: Checkpointer, version: int) -> None:
        async with self.allocator.holding(self.agent) as trainer:  # resident or parked: saved where it is
            async with self.lanes.slot(trainer, Priority.critical(version)):
                await checkpoints.save_agent(self.agent, trainer, version)

    async def _restep(self, batch: int) -> None:
        """After a recovery, trains `batch` again (its row is already written) and syncs."""
        *_, stepping = await self._train_batch(batch)
        await stepping

    async def _train_batch(self, batch: int) -> tuple[list[MicroBatch], float, asyncio.Future]:
        """Sends every micro-batch of `batch` to the trainer (those sent before a recovery
        again, first); returns the samples, the trainer seconds and the step and sync under
        way (`_step_and_sync`), once every micro-batch has been trained. The step is sent
        as soon as the last micro-batch is written to the trainer, not after its reply: the
        trainer keeps an agent's commands in order, so the step runs right after them
        instead of waiting behind another agent's micro-batch that took the trainer in the
        meantime."""
        version = batch  # the step trains version batch - 1 into batch
        self.trained.tokens[batch] = 0
        written: list[asyncio.Future] = []
        calls = [self._send(version, mb, written) for mb in self.recovery.kept[batch]]
        try:
            while True:
                complete = self.schedule.rollout_complete(batch)
                for mb in self.store.form_micro_batches(self.agent, batch, self.micro_batch_size, complete,
                                                        self.overlap, self.cfg.max_staleness):
                    self.recovery.kept[batch].append(mb)
                    calls.append(self._send(version, mb, written))
                if decisions.step_due(complete, self.store.ready_samples(self.agent, batch)):
                    break
                if self.store.ready_samples(self.agent, batch):
                    self.allocator.prefetch(self.agent)  # work is coming: swap in while rollout runs
                await self.schedule.wait_for_work(self.agent)
                if self.agent in self.allocator.lost:  # woken by its trainer's death: restored now, not at
                    # its next micro-batch (an instance joining meanwhile loads the restored weights)
                    raise AgentLost(f"the training state of {self.agent} died with trainer "
                                    f"{self.allocator.lost[self.agent]}")
            trained = list(self.recovery.kept[batch])
            if not trained:
                self._no_samples(batch)
            outcomes = await asyncio.gather(*written, return_exceptions=True)
        except BaseException:  # stopped (or failed) before the step: the calls under way end with it
            await _cancelled(calls)
            raise
        if any(isinstance(o, BaseException) for o in outcomes):
            await _all(calls)  # a micro-batch never written: its call failed; that failure is raised
        stepping = self._tracked(self._step_and_sync(batch, sum(mb.samples for mb in trained)))
        try:
            train_s = await _all(calls)
        except BaseException:
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)
            raise
        return trained, train_s, stepping

    def _no_samples(self, batch: int) -> None:
        """An agent with nothing to train in a step learns nothing: the run stops, unless
        the config allows it (a workflow that calls the agent only now and then)."""
        progress = self.schedule.batches[batch]
        hopeless = too_many_failures(batch, progress.episodes_failed, self.cfg.queries_per_step,
                                     self.cfg.max_failed_share, progress.first_failure)
        if hopeless is not None:  # the producer says the same; whichever of us is first
            raise hopeless
        if self.cfg.allow_empty_steps:
            log.warning("agent %s has no trainable samples in step %d (%d failed episodes)", self.agent, batch,
                        progress.episodes_failed)
            return
        first = (f"{progress.episodes_failed} of its episodes failed; the first failure:\n{progress.first_failure}\n"
                 if progress.first_failure else f"no episode failed: the workflow did not call "
                 f"{self.agent!r} in this step (or dropped what it made).\n")
        raise RunFailed(f"the run cannot learn: agent {self.agent!r} got no trainable sample in step {batch}: "
                        f"{first}Fix the workflow, or set pipeline.allow_empty_steps = true if {self.agent!r} "
                        f"is meant to sit some steps out.")

    def _send(self, version: int, mb: MicroBatch, written: list[asyncio.Future]) -> asyncio.Future:
        """Starts training `mb`; appends to `written` a future done once it is written to
        the trainer (cancelled if it never is)."""
        # The trainer is bound when the micro-batch is sent (see MicroBatchTrained).
        self.emit(ev.MicroBatchFormed(self.agent, "", version, mb.parts(), mb.oldest()))
        done = asyncio.get_running_loop().create_future()
        written.append(done)
        return self._tracked(self._train_micro_batch(version, mb, done))

    async def _train_micro_batch(self, version: int, mb: MicroBatch, written: asyncio.Future) -> float:
        try:
            trainer = await self.allocator.acquire(self.agent, lost="raise")
            try:
                async with self.lanes.slot(trainer, Priority.micro_batch(version, mb.ready_first)):
                    reply, _ = await self.server.call(trainer, protocol.TrainMicroBatch(
                        self.server.next_request_id(), self.agent, version, mb.wire(),
                        self.cfg.max_staleness, self.cfg.clip_ratio, self.loss),
                        on_sent=lambda: _resolve(written))
            finally:
                self.allocator.release(self.agent)
        finally:
            written.cancel()  # no-op once written
        self.emit(ev.MicroBatchTrained(self.agent, trainer, version, mb.samples, reply.seconds))
        self.trained.tokens[version] = self.trained.tokens.get(version, 0) + reply.tokens
        return reply.seconds

    async def _step(self, trainer: str, version: int, samples: int) -> protocol.StepStats:
        async with self.lanes.slot(trainer, Priority.critical(version)):
            return await self._step_in_slot(trainer, version, samples)

    async def _step_in_slot(self, trainer: str, version: int, samples: int) -> protocol.StepStats:
        # The trainer refuses the step unless it accumulated exactly these samples; the step
        # ends the agent's last publication (`WeightSync.stepping`).
        async with self.weights.stepping(self.agent):
            reply, _ = await self.server.call(trainer, protocol.OptimStep(
                self.server.next_request_id(), self.agent, version, samples))
        self.emit(ev.OptimizerStep(self.agent, trainer, version, samples))
        self.trained.samples[version] = samples
        self._count_skipped(trainer, version, reply.stats)
        return reply.stats

    def _count_skipped(self, trainer: str, version: int, stats: protocol.StepStats) -> None:
        """Logs a step skipped for a non-finite gradient; too many in a row end the run."""
        if not stats.skipped:
            self.skipped.in_row = 0
            return
        self.skipped.in_row += 1
        self.skipped.total += 1
        self.emit(ev.StepSkipped(self.agent, trainer, version, stats.grad_norm, self.skipped.in_row))
        log.warning("%s: step to version %d skipped: its gradient is not finite (norm %s)", self.agent, version,
                    stats.grad_norm)
        if self.skipped.in_row >= self.cfg.max_skipped_steps:
            raise RuntimeError(
                f"{self.agent}: {self.skipped.in_row} optimizer steps in a row had a non-finite gradient "
                f"(the last, to version {version}: norm {stats.grad_norm}); the weights are those of version "
                f"{version - self.skipped.in_row}. Lower agents.{self.agent}.lr or max_grad_norm, train in "
                f"float32 (agents.{self.agent}.dtype), or raise pipeline.max_skipped_steps")

    async def _step_and_sync(self, batch: int, samples: int) -> protocol.StepStats:
        version = batch
        trainer = await self.allocator.acquire(self.agent, lost="raise")
        try:
            # One slot from the step to the end of the sync: the publish follows the step at
            # once, instead of queueing again behind micro-batches that took the slot between.
            async with self.lanes.slot(trainer, Priority.critical(version)):
                stats = await self._step_in_slot(trainer, version, samples)
                # The log is made durable while the weights go out (the step is done once
                # both are): the sync waits for no disk, nor, with every agent stepping at
                # once, for the other agents' flushes.
                flushed = asyncio.ensure_future(self.flush_events())
                try:
                    await self.schedule.wait_to_sync(version)  # an evaluation of version - 1 first
                    await self.weights.sync(self.agent, trainer, version)
                except BaseException:
                    flushed.add_done_callback(retrieved)  # a write that failed stops the run through the log's task
                    raise
        finally:
            self.allocator.release(self.agent)
        await flushed
        return stats

    def _committed(self, version: int) -> None:
        """The agent's state at `version` is saved: what trained the state saved before it
        can go (kept until then: the state at `version` may be found damaged when it is
        needed, and the earlier one is restored instead)."""
        earlier = self.recovery.saved_version
        self.recovery.earlier_version, self.recovery.saved_version = earlier, version
        for batch in [b for b in self.recovery.kept if b <= earlier]:
            for mb in self.recovery.kept.pop(batch):
                self.store.forget(mb)

    async def _recover(self, batch: int, exc: BaseException) -> None:
        """The trainer holding the agent died (its state with it): restore the agent from
        its last saved state, on a trainer that is alive, and train again, in the same
        micro-batches, every batch since; the batch in progress then starts over."""
        if self.agent not in self.allocator.lost:
            raise exc  # not this agent's trainer (a rollout instance, say): not ours to mend
        self.recovery.count += 1
        if self.recovery.count > self.recovery.limit:
            raise RuntimeError(f"{self.agent} lost its trainer {self.recovery.count} times; giving up") from exc
        if self.checkpoints is not None and not self.checkpoints.full_state:
            raise RuntimeError(f"{self.agent}'s trainer died and its training state cannot be restored: "
                               "trainer groups checkpoint weights only") from exc
        saved, state, checksum = await self._intact_state()
        log.warning("%s: %s; restoring its state of version %d and training batches %d-%d again",
                    self.agent, exc, saved, saved + 1, batch)
        self.recovery.saved_version = saved
        self.allocator.recover(self.agent, state, saved, checksum)
        self.weights.forget(self.agent)  # its last publication died with the trainer
        self.emit(ev.TrainingRestored(self.agent, saved, batch, str(exc)))
        t0 = time.monotonic()
        for b in range(saved + 1, batch):
            self.trained.tokens[b] = 0
            await _all([self._send(b, mb, []) for mb in self.recovery.kept[b]])
            trainer = await self.allocator.acquire(self.agent, lost="raise")
            try:
                await self._step(trainer, b, sum(mb.samples for mb in self.recovery.kept[b]))
            finally:
                self.allocator.release(self.agent)
        if batch - 1 > saved:  # an instance that joined meanwhile loaded the restored, older version
            trainer = await self.allocator.acquire(self.agent, lost="raise")
            try:
                async with self.lanes.slot(trainer, Priority.critical(batch - 1)):
                    await self.weights.catch_up(self.agent, trainer, batch - 1)
            finally:
                self.allocator.release(self.agent)
        log.info("%s is back at version %d after %.2fs", self.agent, batch - 1, time.monotonic() - t0)


    async def _intact_state(self) -> tuple[int, ParamHandle | None, str]:
        """The saved state to restore (version, handle, checksum): the last one, or the one
        before it when the last no longer matches its checkpoint's manifest (said in one
        line); the initial weights (None) before anything was saved."""
        recovery = self.recovery
        if recovery.saved_version <= 0 or self.checkpoints is None:
            return 0, None, ""
        try:
            last, checksum = await self.checkpoints.intact_state(self.agent, recovery.saved_version)
            return recovery.saved_version, last, checksum
        except (DamagedFile, CheckpointError) as exc:
            damaged = exc
        earlier = recovery.earlier_version
        where = f"`flexmarl run --resume {self.checkpoints.root.parent}` starts from the newest intact checkpoint"
        if earlier is None:
            raise RunFailed(f"{self.agent}'s trainer died and its saved training state of step "
                            f"{recovery.saved_version} cannot be restored: {damaged}; no earlier state of this run is "
                            f"at hand to restore instead. {where}") from None
        state: ParamHandle | None = None
        checksum = ""
        try:
            if earlier > 0:
                state, checksum = await self.checkpoints.intact_state(self.agent, earlier)
        except (DamagedFile, CheckpointError) as exc:
            raise RunFailed(f"{self.agent}'s trainer died and neither its saved training state of step "
                            f"{recovery.saved_version} ({damaged}) nor that of step {earlier} ({exc}) can be "
                            f"restored. {where}") from None
        log.warning("%s: the checkpoint of step %d is damaged and is not restored from: %s; restoring from %s "
                    "instead, the newest intact one", self.agent, recovery.saved_version, damaged,
                    f"the checkpoint of step {earlier}" if earlier > 0 else "the initial weights")
        recovery.earlier_version = None
        return earlier, state, checksum


async def _all(calls: list[asyncio.Future]) -> float:
    """Awaits every call; the sum of their results. The first failure cancels the rest."""
    try:
        return sum(await asyncio.gather(*calls))
    except BaseException:
        await _cancelled(calls)
        raise


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _cancelled(calls: list[asyncio.Future]) -> None:
    """Cancels the calls and waits until each has ended (its outcome retrieved)."""
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


def step_signals(stats: protocol.StepStats) -> dict[str, float]:
    """The trainer's step statistics as metrics columns (trainer side of the signals:
    loss, gradient norm, entropy, response lengths, sampler-vs-trainer mismatch, clipping)."""
    return {"loss": stats.loss, "grad_norm": stats.grad_norm, "entropy": stats.entropy,
            "response_len_mean": stats.response_len_mean, "response_len_max": stats.response_len_max,
            "logprob_abs_diff": stats.logprob_abs_diff, "rollout_kl": stats.rollout_kl,
            "clip_frac": stats.clip_frac, "ref_kl": stats.ref_kl, "teacher_kl": stats.teacher_kl,
            "teacher_top_kl": stats.teacher_top_kl,
            "tokens": stats.tokens, "skipped": int(stats.skipped)}
